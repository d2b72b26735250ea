"""The packaged Muon optimizer: Megatron-style ZeRO-1 + TP, bitwise identical to the seed design.

The math lives in small pure functions (:func:`newton_schulz`, :func:`adjusted_lr`); the class
adds the param-group bookkeeping and, in distributed mode, the traffic Newton-Schulz needs. By
default each Muon matrix is orthogonalized on one rank of the dp x tp grid (its worker, picked by
:func:`muonckpt.optim.nsplan.plan_newton_schulz`): the holders send it their pieces of the input
and it sends each holder its piece of the result. ``orthogonalize="every_holder"`` keeps the seed's
way: the DP all-gather of each bucket's Newton-Schulz inputs and the TP all-gather of each split
param, then every holder orthogonalizes the whole matrix. Both give the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, cast

import torch

from ..distributed import collectives
from ..errors import LayoutError
from ..format.kinds import ADAMW_STATE_KEYS, MUON_STATE_KEYS
from ..layout.grid import LocalParam, RankReport
from ..layout.topology import Range, Region, dp_slice
from ..state.describers import flat_params, learn_grid
from ..state.hooks import StateDictHooks
from ..state.paramnames import named_params, param_names, torch_dtype_name
from ..state.regions import extract, insert_
from .nsplan import Message, NsPlan, plan_newton_schulz

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

SecondMoment = Literal["element", "row"]
"""A Muon group's ``second_moment``: normalize each orthogonalized update by an EMA of its
square, ``"element"`` element by element (AdaMuon's), ``"row"`` by the mean of its whole row
(NorMuon's row normalization); absent or None: plain Muon."""
SECOND_MOMENTS = ("element", "row")
UPDATE_SQ = "update_sq"
"""The state key of that EMA: fp32, shaped like the param (a row statistic repeated along its
row), so that it is sharded and resharded with the param at any dp x tp."""

Orthogonalize = Literal["one_rank", "every_holder"]
"""Where a distributed :class:`Muon` runs Newton-Schulz: ``"one_rank"`` (the default) on one
rank of the grid per matrix, ``"every_holder"`` (the seed's way) on every rank holding a piece."""


ParamUpdate = tuple[torch.Tensor, tuple[int, ...], torch.Tensor | None]
"""A Muon param's orthogonalized update, the full shape its lr is scaled by, and (a group
with ``second_moment="row"``) the mean square of each of its elements' whole row, computed
where the whole matrix is (:func:`row_mean_square`), as a piece like the update's."""
UpdateRule = Callable[[torch.Tensor, dict[str, Any]], ParamUpdate]
"""How one step computes each Muon param's update, given the param and its group."""


def newton_schulz(grad: torch.Tensor, steps: int) -> torch.Tensor:
    """Quintic Newton-Schulz orthogonalization of a 2-D tensor (KellerJordan's iteration).

    Runs in the dtype it is given (the optimizer passes bf16); the operation order is the
    seed's, which is what makes results bitwise reproducible against it.
    """
    if grad.dim() != 2:
        raise LayoutError(f"newton_schulz needs a 2-D tensor, got shape {tuple(grad.shape)}")
    a, b, c = NS_COEFFICIENTS
    tall = grad.size(0) > grad.size(1)
    x: torch.Tensor = grad.T if tall else grad
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        poly = b * gram + c * gram @ gram
        x = a * x + poly @ x
    return x.T if tall else x


def row_mean_square(update: torch.Tensor) -> torch.Tensor:
    """The fp32 mean square of each row of a whole orthogonalized matrix, repeated along the
    row (the statistic NorMuon normalizes a row by), to be cut as the update is."""
    return update.float().square().mean(dim=1, keepdim=True).expand(update.shape).contiguous()


def adjusted_lr(lr: float, matched_adamw_rms: float, full_shape: Sequence[int]) -> float:
    """Moonlight's scaling: ``lr * sqrt(max(A, B)) * matched_adamw_rms`` for an A x B matrix."""
    rows, cols = full_shape[:2]
    return lr * (math.sqrt(max(rows, cols)) * matched_adamw_rms)


def normalize_range(span: Range, start: int) -> Range:
    """``span`` shifted so that ``start`` becomes 0."""
    return span[0] - start, span[1] - start


class MuonDistMeta:
    """Where one param's TP shard sits in the ZeRO-1 buffers (the seed's constructor).

    Args:
        buffer_idx: index of the flat buffer holding the param.
        bucket_idx: index of the bucket inside that buffer.
        shape: shape of the TP shard (the full shape with ``tp_split_dim`` divided by tp).
        global_range: flat ``[start, stop)`` of the shard inside the buffer.
        tp_split_dim: dimension split across TP ranks, or -1 for a TP-replicated param.
    """

    def __init__(
        self,
        buffer_idx: int,
        bucket_idx: int,
        shape: Sequence[int],
        global_range: Range,
        tp_split_dim: int,
    ) -> None:
        self.buffer_idx = buffer_idx
        self.bucket_idx = bucket_idx
        self.shape = torch.Size(shape)
        self.global_range = (int(global_range[0]), int(global_range[1]))
        self.tp_split_dim = tp_split_dim
        self.local_range: Range | None = None

    def set_local_buffer_range(self, local_buffer_range: Range) -> None:
        """Record the part of ``global_range`` inside this rank's slice of the bucket."""
        start = max(self.global_range[0], local_buffer_range[0])
        end = min(self.global_range[1], local_buffer_range[1])
        self.local_range = (start, end) if start < end else (local_buffer_range[0],) * 2

    def held_range(self) -> Range:
        """:attr:`local_range`, which :meth:`set_local_buffer_range` sets."""
        if self.local_range is None:
            raise LayoutError("a param's local range is unknown: call enable_distributed_mode")
        return self.local_range

    def __repr__(self) -> str:
        return (
            f"MuonDistMeta(buffer_idx={self.buffer_idx}, bucket_idx={self.bucket_idx}, "
            f"shape={tuple(self.shape)}, global_range={self.global_range}, "
            f"tp_split_dim={self.tp_split_dim})"
        )


class Muon(torch.optim.Optimizer):
    """Muon with an AdamW branch, single-process or ZeRO-1 + TP distributed.

    Groups with ``use_muon=True`` hold 2-D matrices updated by sum-form Nesterov momentum
    (``buf = momentum * buf + g``) orthogonalized by :func:`newton_schulz` in bf16 and scaled by
    :func:`adjusted_lr`; every other group uses AdamW with the seed's bias correction. Weight decay
    is decoupled. Params may be given as ``(name, tensor)`` pairs; checkpoints are keyed by name.

    In distributed mode (:meth:`enable_distributed_mode`) every param is this rank's flat ZeRO-1
    slice of its TP shard, possibly empty; every rank must hold every param, in the same order.
    ``state_dict()`` is then a collective returning the complete, topology-independent state on
    rank 0 (see :mod:`muonckpt.state.hooks`), and ``load_state_dict()`` keeps this rank's share of
    it.

    ``orthogonalize`` says where a distributed step runs Newton-Schulz: ``"one_rank"`` (the
    default) once per matrix in the grid, on the rank :mod:`muonckpt.optim.nsplan` picks, which
    receives the input's pieces and sends each holder its piece of the result (point-to-point
    over the default process group); ``"every_holder"`` on every rank holding a piece of the
    matrix, after all-gathers over DP and TP, as the seed does (to compare step times). The
    params come out bitwise the same either way; the optimizer's state and checkpoints do not
    depend on it.
    """

    def __init__(
        self,
        param_groups: Iterable[Any],
        lr: float = 2e-2,
        weight_decay: float = 0.1,
        matched_adamw_rms: float = 0.2,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adamw_betas: tuple[float, float] = (0.95, 0.95),
        adamw_eps: float = 1e-8,
        *,
        orthogonalize: Orthogonalize = "one_rank",
        second_moment: SecondMoment | None = None,
        second_moment_beta: float = 0.95,
        second_moment_eps: float = 1e-8,
    ) -> None:
        defaults: dict[str, Any] = dict(
            lr=lr,
            weight_decay=weight_decay,
            matched_adamw_rms=matched_adamw_rms,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
        )
        if second_moment is not None:  # (absent: plain Muon, its settings as they always were)
            defaults.update(
                second_moment=second_moment,
                second_moment_beta=second_moment_beta,
                second_moment_eps=second_moment_eps,
            )
        super().__init__(_name_empty_groups(param_groups), defaults)
        for group in self.param_groups:
            if group.get("second_moment") not in (None, *SECOND_MOMENTS):
                raise LayoutError(
                    f"second_moment must be one of {SECOND_MOMENTS} or None, got "
                    f"{group['second_moment']!r}"
                )
            if group.get("second_moment") is not None:
                group.setdefault("second_moment_beta", second_moment_beta)
                group.setdefault("second_moment_eps", second_moment_eps)
        if orthogonalize not in ("one_rank", "every_holder"):
            raise LayoutError(
                f"orthogonalize must be 'one_rank' or 'every_holder', got {orthogonalize!r}"
            )
        self.orthogonalize = orthogonalize
        self._ns_plan_cache: tuple[list[int], int, NsPlan, dict[int, torch.Tensor]] | None = None
        self.distributed_mode = False
        self.dist_group: collectives.Group = None
        self.tp_group: collectives.Group = None
        self.dist_metas: dict[torch.Tensor, MuonDistMeta] = {}
        self.global_buffer_sizes: list[list[tuple[int, int]]] = []
        self.local_buffer_ranges: list[list[Range]] = []
        StateDictHooks(self)  # described by placement.describe (describers.ReportsItsGrid)

    def enable_distributed_mode(
        self,
        global_buffer_sizes: Sequence[Sequence[tuple[int, int]]],
        dist_group: collectives.Group,
        tp_group: collectives.Group,
        dist_metas: dict[torch.Tensor, MuonDistMeta],
    ) -> None:
        """Switch to ZeRO-1 + TP mode.

        Args:
            global_buffer_sizes: per buffer, ``[(bucket_size, bucket_offset), ...]``; each bucket
                size must be divisible by the DP world size.
            dist_group: the data-parallel group (ranks sharing a TP rank).
            tp_group: the tensor-parallel group (ranks sharing a DP rank).
            dist_metas: a :class:`MuonDistMeta` for every param of every group.
        """
        dp_size, dp_rank = collectives.size_and_rank(dist_group)
        names = self._param_names()
        sizes = [[(int(s), int(o)) for s, o in buffer] for buffer in global_buffer_sizes]
        for b, buffer in enumerate(sizes):
            for k, (size, _) in enumerate(buffer):
                if size % dp_size:
                    raise LayoutError(
                        f"buffer {b} bucket {k}: size {size} is not divisible by dp={dp_size}"
                    )
        ranges = [
            [(o + s // dp_size * dp_rank, o + s // dp_size * (dp_rank + 1)) for s, o in buffer]
            for buffer in sizes
        ]
        for group in self.param_groups:
            for p in group["params"]:
                meta = dist_metas.get(p)
                name = names[p]
                if meta is None:
                    raise LayoutError(f"param {name!r} has no MuonDistMeta in dist_metas")
                _check_meta(name, p, meta, sizes, group.get("use_muon", False))
                meta.set_local_buffer_range(ranges[meta.buffer_idx][meta.bucket_idx])
                size, offset = sizes[meta.buffer_idx][meta.bucket_idx]
                owned = dp_slice(meta.global_range, offset, size, dp_size, dp_rank)
                if p.numel() != owned[1] - owned[0]:
                    raise LayoutError(
                        f"param {name!r}: local tensor has {p.numel()} elements but this rank "
                        f"owns {owned[1] - owned[0]} of it in the buffer layout"
                    )
        self.global_buffer_sizes = sizes
        self.local_buffer_ranges = ranges
        self.dist_group, self.tp_group, self.dist_metas = dist_group, tp_group, dist_metas
        self.distributed_mode = True
        self._ns_plan_cache = None

    def state_keys(self, group: int) -> tuple[str, ...]:
        """The state keys a complete entry of group ``group`` has (Muon's, with
        :data:`UPDATE_SQ` for a ``second_moment``, or AdamW's)."""
        settings = self.param_groups[group]
        if not settings.get("use_muon", False):
            return ADAMW_STATE_KEYS
        return MUON_STATE_KEYS + ((UPDATE_SQ,) if settings.get("second_moment") else ())

    def rank_report(self) -> RankReport:
        """This rank's params in the layout math's terms: shapes, buffers, buckets, ranges."""
        held = []
        for name, group, p in named_params(self):
            meta = self.dist_metas[p]
            bucket_size, bucket_offset = self.global_buffer_sizes[meta.buffer_idx][meta.bucket_idx]
            held.append(
                LocalParam(
                    name=name,
                    group=group,
                    local_shape=tuple(meta.shape),
                    tp_split_dim=meta.tp_split_dim,
                    buffer=meta.buffer_idx,
                    bucket=meta.bucket_idx,
                    global_range=(meta.global_range[0], meta.global_range[1]),
                    bucket_span=(bucket_size, bucket_offset),
                    dtype=torch_dtype_name(p.dtype),
                )
            )
        return RankReport(len(self.param_groups), tuple(held))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step. In distributed mode every rank of the dp x tp grid must call it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
        muon_groups = [g for g in self.param_groups if g.get("use_muon", False)]
        ns_inputs = self._momentum_step(muon_groups)
        if not self.distributed_mode:
            update_of = _orthogonalize_here(ns_inputs)
        elif self.orthogonalize == "every_holder":
            update_of = self._orthogonalize_every_holder(self._gather_dp(ns_inputs))
        else:
            update_of = self._orthogonalize_one_rank(ns_inputs)
        for group in muon_groups:
            self._muon_update(group, update_of)
        for group in self.param_groups:
            if not group.get("use_muon", False):
                _adamw_update(group, self.state)
        return loss

    def _momentum_step(self, muon_groups: list[dict[str, Any]]) -> dict[torch.Tensor, torch.Tensor]:
        """Update momentum in place; return each param's bf16 Newton-Schulz input."""
        names = self._param_names()
        ns_inputs = {}
        for group in muon_groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if not self.distributed_mode and p.dim() != 2:
                    raise LayoutError(
                        f"param {names[p]!r} in a Muon group must be 2-D, got shape "
                        f"{tuple(p.shape)}; put it in a group without use_muon"
                    )
                grad = _grad_or_zeros(p)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.contiguous_format
                    )
                buf = state["momentum_buffer"]
                buf.mul_(momentum).add_(grad)
                ns_input = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
                ns_inputs[p] = ns_input.bfloat16().contiguous()
        return ns_inputs

    def _gather_dp(
        self, ns_inputs: dict[torch.Tensor, torch.Tensor]
    ) -> dict[torch.Tensor, torch.Tensor]:
        """All-gather every bucket over DP; return each param's whole TP-shard input."""
        device = self._device()
        local = [
            [torch.zeros(hi - lo, device=device, dtype=torch.bfloat16) for lo, hi in ranges]
            for ranges in self.local_buffer_ranges
        ]
        for p, ns_input in ns_inputs.items():
            meta = self.dist_metas[p]
            start = self.local_buffer_ranges[meta.buffer_idx][meta.bucket_idx][0]
            lo, hi = normalize_range(meta.held_range(), start)
            local[meta.buffer_idx][meta.bucket_idx][lo:hi].copy_(ns_input.view(-1))
        gathered = [
            [collectives.all_gather_flat(bucket, self.dist_group) for bucket in buffer]
            for buffer in local
        ]
        full = {}
        for p in ns_inputs:
            meta = self.dist_metas[p]
            offset = self.global_buffer_sizes[meta.buffer_idx][meta.bucket_idx][1]
            lo, hi = normalize_range(meta.global_range, offset)
            full[p] = gathered[meta.buffer_idx][meta.bucket_idx][lo:hi].view(meta.shape)
        return full

    def _orthogonalize_every_holder(
        self, ns_inputs: dict[torch.Tensor, torch.Tensor]
    ) -> UpdateRule:
        """The seed's way: each holder all-gathers the TP shards of a split param and
        orthogonalizes the whole matrix (``ns_inputs``: each param's whole TP shard)."""
        tp_size, tp_rank = collectives.size_and_rank(self.tp_group)

        def update_of(p: torch.Tensor, group: dict[str, Any]) -> ParamUpdate:
            ns_input, meta = ns_inputs[p], self.dist_metas[p]
            split_dim = meta.tp_split_dim if tp_size > 1 else -1
            if split_dim != -1:
                # Every TP rank joins, including one that owns no element of p.
                ns_input = torch.cat(
                    collectives.all_gather_list(ns_input, self.tp_group), dim=split_dim
                )
            if p.numel() == 0:
                return ns_input, tuple(ns_input.shape), None
            update = newton_schulz(ns_input, steps=group["ns_steps"])
            rows = row_mean_square(update) if group.get("second_moment") == "row" else None
            lo, hi = normalize_range(meta.held_range(), meta.global_range[0])

            def mine(full: torch.Tensor) -> torch.Tensor:
                if split_dim != -1:
                    full = full.chunk(tp_size, dim=split_dim)[tp_rank]
                return full.reshape(-1)[lo:hi]

            return mine(update), tuple(ns_input.shape), None if rows is None else mine(rows)

        return update_of

    def _orthogonalize_one_rank(self, ns_inputs: dict[torch.Tensor, torch.Tensor]) -> UpdateRule:
        """Each matrix orthogonalized on its worker only: the holders' pieces of its input go
        there, each holder's piece of the result comes back (two exchanges per step)."""
        ranks, me, plan, mine = self._newton_schulz_plan()
        device = self._device()
        received = _exchange(plan.inputs, me, ranks, device, lambda k, _: ns_inputs[mine[k]])
        fulls: dict[int, torch.Tensor] = {}
        for k, matrix in enumerate(plan.matrices):
            if matrix.worker == me and any(plan.held[k]):  # an empty matrix needs nothing
                fulls[k] = torch.empty(matrix.full_shape, dtype=torch.bfloat16, device=device)
                if k in mine:  # (this rank holds a region of it)
                    insert_(fulls[k], cast(Region, plan.held[k][me]), ns_inputs[mine[k]])
        for k, region, piece in received:
            insert_(fulls[k], region, piece)
        updates = {
            k: newton_schulz(full, steps=self.param_groups[plan.matrices[k].group]["ns_steps"])
            for k, full in fulls.items()
        }
        pieces = _pieces_back(plan, me, ranks, device, updates, mine, torch.bfloat16)
        rows: dict[int, torch.Tensor] = {}
        if any(group.get("second_moment") == "row" for group in self.param_groups):
            stats = {k: row_mean_square(update) for k, update in updates.items()}
            rows = _pieces_back(plan, me, ranks, device, stats, mine, torch.float32)
        results = {
            mine[k]: (piece, plan.matrices[k].full_shape, rows.get(k))
            for k, piece in pieces.items()
        }

        def update_of(p: torch.Tensor, group: dict[str, Any]) -> ParamUpdate:
            if p in results:
                return results[p]
            if p.numel():  # never an update that was not orthogonalized
                raise LayoutError(
                    f"a Muon param of shape {tuple(p.shape)} is not in the Newton-Schulz plan: "
                    "the optimizer's params changed after enable_distributed_mode (call it "
                    "again after add_param_group)"
                )
            return ns_inputs[p], (), None  # no elements here: nothing to update

        return update_of

    def _newton_schulz_plan(self) -> tuple[list[int], int, NsPlan, dict[int, torch.Tensor]]:
        """The grid's global ranks, this rank's grid index, the Newton-Schulz plan and, per
        matrix of the plan this rank holds elements of, its param here. Learned by a collective
        over the grid at the first step after :meth:`enable_distributed_mode`, then kept (a
        step every rank takes, so every rank learns it at the same call)."""
        if self._ns_plan_cache is None:
            ranks, grid = learn_grid(self, self.rank_report, self.dist_group, self.tp_group)
            me = ranks.index(collectives.global_rank())
            steps = {
                g: group["ns_steps"]
                for g, group in enumerate(self.param_groups)
                if group.get("use_muon", False)
            }
            plan = plan_newton_schulz(grid, steps)
            flat = flat_params(self)
            mine = {}
            for k, matrix in enumerate(plan.matrices):
                index = grid.params[matrix.param].position_on(me)
                if plan.held[k][me] is not None and index is not None:
                    mine[k] = flat[index]
            self._ns_plan_cache = (ranks, me, plan, mine)
        return self._ns_plan_cache

    def _muon_update(
        self,
        group: dict[str, Any],
        update_of: UpdateRule,
    ) -> None:
        """Decoupled weight decay, then each param's piece of its orthogonalized update
        (normalized by its second moment, for a group with ``second_moment``)."""
        lr, weight_decay = group["lr"], group["weight_decay"]
        for p in group["params"]:
            update, full_shape, rows = update_of(p, group)
            if p.numel() == 0:
                continue
            if group.get("second_moment") is not None:
                update = self._normalized(p, group, update, rows)
            p.mul_(1 - lr * weight_decay)
            p.add_(
                update.reshape(p.shape),
                alpha=-adjusted_lr(lr, group["matched_adamw_rms"], full_shape),
            )

    def _normalized(
        self,
        p: torch.Tensor,
        group: dict[str, Any],
        update: torch.Tensor,
        rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """This rank's piece of ``update`` divided by the root of its second moment, an EMA
        (:data:`UPDATE_SQ`) of the update's square element by element (``"element"``) or of
        its whole row's mean square (``"row"``, ``rows``): element-wise on each holder, so
        the state is the same whatever the layout."""
        state = self.state[p]
        if UPDATE_SQ not in state:
            state[UPDATE_SQ] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        second: torch.Tensor = state[UPDATE_SQ]
        piece = update.reshape(p.shape).float()
        square = piece.square() if rows is None else rows.reshape(p.shape)
        second.lerp_(square, 1 - group["second_moment_beta"])
        normalized: torch.Tensor = piece / (second.sqrt() + group["second_moment_eps"])
        return normalized

    def _device(self) -> torch.device:
        for group in self.param_groups:
            params: list[torch.Tensor] = group["params"]
            if params:
                return params[0].device
        return torch.device("cpu")

    def _param_names(self) -> dict[torch.Tensor, str]:
        """Every param's name: its ``param_names`` entry, else its flat index as a string."""
        params = (p for group in self.param_groups for p in group["params"])
        return dict(zip(params, param_names(self), strict=True))


def _pieces_back(
    plan: NsPlan,
    me: int,
    ranks: list[int],
    device: torch.device,
    fulls: dict[int, torch.Tensor],
    mine: dict[int, torch.Tensor],
    dtype: torch.dtype,
) -> dict[int, torch.Tensor]:
    """Each matrix this rank holds a piece of: its piece of the whole matrix of ``fulls``
    (computed here, on the matrix's worker) or sent by the worker (``dtype``)."""
    pieces = {k: extract(fulls[k], cast(Region, plan.held[k][me])) for k in fulls if k in mine}
    back = _exchange(
        plan.outputs, me, ranks, device, lambda k, region: extract(fulls[k], region), dtype
    )
    for k, _, piece in back:
        pieces[k] = piece
    return pieces


def _exchange(
    messages: Sequence[Message],
    me: int,
    ranks: list[int],
    device: torch.device,
    piece_of: Callable[[int, Region], torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
) -> list[tuple[int, Region, torch.Tensor]]:
    """Send this rank's messages of one direction of the plan (each piece from
    ``piece_of(matrix, region)``), receive the others'; returns each received piece as
    ``(matrix, region, 1-D tensor of dtype on device)``."""
    sends = [
        (
            torch.cat([piece_of(pc.matrix, pc.region).reshape(-1) for pc in m.pieces]),
            ranks[m.dst],
        )
        for m in messages
        if m.src == me
    ]
    incoming = [m for m in messages if m.dst == me]
    buffers = collectives.exchange(
        sends, [(ranks[m.src], m.numel, dtype) for m in incoming], device
    )
    return [
        (pc.matrix, pc.region, buffer[pc.offset : pc.offset + pc.region.numel])
        for m, buffer in zip(incoming, buffers, strict=True)
        for pc in m.pieces
    ]


def _orthogonalize_here(
    ns_inputs: dict[torch.Tensor, torch.Tensor],
) -> UpdateRule:
    """Single process: each param's update is :func:`newton_schulz` of its own input."""

    def update_of(p: torch.Tensor, group: dict[str, Any]) -> ParamUpdate:
        ns_input = ns_inputs[p]
        update = newton_schulz(ns_input, steps=group["ns_steps"])
        rows = row_mean_square(update) if group.get("second_moment") == "row" else None
        return update, tuple(ns_input.shape), rows

    return update_of


def _name_empty_groups(param_groups: Iterable[Any]) -> list[Any]:
    """Give empty groups ``param_names=[]`` when others are named: torch counts them unnamed."""
    groups = list(param_groups)
    if not groups or not all(isinstance(g, dict) for g in groups):
        return groups
    groups = [
        g if isinstance(g["params"], torch.Tensor) else {**g, "params": list(g["params"])}
        for g in groups
    ]
    named = any(
        isinstance(p, tuple) for g in groups if isinstance(g["params"], list) for p in g["params"]
    )
    return [
        {**g, "param_names": []}
        if named and isinstance(g["params"], list) and not g["params"]
        else g
        for g in groups
    ]


def _adamw_update(group: dict[str, Any], state: dict[torch.Tensor, dict[str, Any]]) -> None:
    """The seed's AdamW branch: lerp-form moments, bias correction folded into the step size."""
    step = group["step"]
    lr, weight_decay = group["lr"], group["weight_decay"]
    beta1, beta2 = group["adamw_betas"]
    eps = group["adamw_eps"]
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    scale = bias_correction1 / bias_correction2**0.5
    for p in group["params"]:
        grad = _grad_or_zeros(p)
        param_state = state[p]
        if "exp_avg" not in param_state:
            param_state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            param_state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        exp_avg, exp_avg_sq = param_state["exp_avg"], param_state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.lerp_(grad.square(), 1 - beta2)
        direction = exp_avg / (eps + exp_avg_sq.sqrt())
        p.mul_(1 - lr * weight_decay)
        p.add_(direction, alpha=-lr / scale)


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    """The param's grad, or zeros when it has none, so every rank still joins every collective."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _check_meta(
    name: str,
    p: torch.Tensor,
    meta: MuonDistMeta,
    sizes: list[list[tuple[int, int]]],
    use_muon: bool,
) -> None:
    if not (
        0 <= meta.buffer_idx < len(sizes) and 0 <= meta.bucket_idx < len(sizes[meta.buffer_idx])
    ):
        raise LayoutError(
            f"param {name!r}: buffer {meta.buffer_idx} bucket {meta.bucket_idx} does not exist"
        )
    if use_muon and len(meta.shape) != 2:
        raise LayoutError(
            f"param {name!r} in a Muon group must be 2-D, got TP shard shape {tuple(meta.shape)}"
        )
    if not -1 <= meta.tp_split_dim < max(len(meta.shape), 1):
        raise LayoutError(
            f"param {name!r}: tp_split_dim {meta.tp_split_dim} is not a dimension "
            f"of {tuple(meta.shape)}"
        )
    lo, hi = meta.global_range
    size, offset = sizes[meta.buffer_idx][meta.bucket_idx]
    if hi - lo != math.prod(meta.shape) or lo < offset or hi > offset + size:
        raise LayoutError(
            f"param {name!r}: global_range {meta.global_range} does not hold shape "
            f"{tuple(meta.shape)} inside bucket [{offset}, {offset + size})"
        )
