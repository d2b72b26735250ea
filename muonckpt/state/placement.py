"""Where every param's state lives: the layout model every path reads, and its describers.

A :class:`Sharding` says, for one optimizer over the ranks it spans, each param's full shape,
the regions its sources hold (what a gather and a per-rank save read) and the region this
rank keeps (what a load and ``load_state_dict`` fill). Save, load, the gather and the trim read
only that, so a new layout is one new describer here, not a new save path.

:func:`describe` is a function of the optimizer that returns its :class:`Sharding`:

* the packaged :class:`~muonckpt.optim.muon.Muon` reports its own layout (:class:`ReportsItsGrid`):
  :func:`describe_grid` over its dp x tp grid, :func:`describe_whole` in one process;
* an optimizer whose state lives whole on owner ranks is described by the owner rule
  :func:`declare_owners` recorded beside it (:func:`muonckpt.install_hooks` records it; the
  upstream KellerJordan rule is :func:`upstream_owner`);
* any other optimizer is whole in one process (:func:`describe_whole`) or a replica on every
  rank of a process group (:func:`describe_replicated`, DDP), unless the call says it is this
  process's own (``local=True``: whole, here alone, whatever process group there is);
* several optimizers trained together are one :class:`Joined`.

Describing a distributed optimizer is a collective over its ranks the first time (the grid's
param list is learned from every rank's report) or every time (owner rules: the ranks check
they agree); :func:`participants` gives those ranks without one.
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..distributed import collectives, group_steps, groups
from ..errors import CheckpointError, StateDictError
from ..layout.grid import GridParams, RankReport, merge_reports
from ..layout.topology import Region, Topology, tp_full_shape, tp_region, whole_region
from ..layout.workplan import spread
from ..storage import unstorable_kind
from .paramnames import is_named, param_names, torch_dtype_name


class _Replicated:
    """The type of :data:`REPLICATED`."""

    def __repr__(self) -> str:
        return "muonckpt.REPLICATED"


REPLICATED = _Replicated()
"""What an ``owner`` rule returns for a param whose state every rank keeps identically (the
AdamW state of KellerJordan's ``MuonWithAuxAdam``): gathered from one rank, restored on all."""


@dataclass(frozen=True, slots=True)
class Holding:
    """A global rank's share of a param's state: ``region`` of the full tensor."""

    rank: int
    region: Region


@dataclass(frozen=True, slots=True)
class ParamSharding:
    """How one param of the whole grid is spread over ranks, seen from this rank."""

    name: str
    full_shape: tuple[int, ...]
    """Full shape of the param and of each state tensor shaped like it."""
    sources: tuple[Holding, ...]
    """Owners that together hold every element exactly once (what the gather reads)."""
    local: Region | None
    """This rank's share of the state when loading (None: it keeps no state of the param)."""
    local_index: int | None
    """The param's position in this rank's flat param order; None where this rank lacks it."""
    group: int
    """Index of its param group."""
    expected_keys: tuple[str, ...] = ()
    """State keys a complete entry must have (empty: whatever the source had)."""
    tp_split_dim: int = -1
    """TP split dimension in this run (recorded in checkpoints)."""
    dtype: str | None = None
    """torch dtype name of the param itself (``float32``), where known."""
    held: Region | None = None
    """What this rank's param tensor holds of the full param (None: all of it)."""
    replicated: bool = False
    """Every rank keeps the same state of this param (:data:`REPLICATED`)."""

    @property
    def index_here(self) -> int:
        """:attr:`local_index`, for a param this rank holds (:meth:`Sharding.local`)."""
        if self.local_index is None:
            raise StateDictError(f"param {self.name!r} is not held on this rank")
        return self.local_index

    @property
    def region_here(self) -> Region:
        """:attr:`local`, for a param this rank holds (:meth:`Sharding.local`)."""
        if self.local is None:
            raise StateDictError(f"param {self.name!r} is not held on this rank")
        return self.local

    @property
    def held_numel(self) -> int:
        """Elements of this rank's param tensor (and of each state tensor shaped like it)."""
        return self.held.numel if self.held is not None else math.prod(self.full_shape)


@dataclass
class Sharding:
    """Everything the hooks need to know about one optimizer's sharding, for one call."""

    params: list[ParamSharding]
    """Every param of the grid, in canonical order (group by group)."""
    participants: list[int]
    """Global ranks taking part in the gather."""
    destination: int
    """Global rank that receives the complete state dict."""
    topology: dict[str, int] = field(default_factory=dict)
    named: bool = True
    """Whether the params carry names (else their names are canonical positions)."""

    def local(self) -> Iterator[ParamSharding]:
        """The params this rank's optimizer holds, in its own flat order."""
        return iter(sorted((p for p in self.params if p.local_index is not None), key=_position))

    def members(self, group: int) -> list[int]:
        """Canonical indices of the params of one group."""
        return [i for i, p in enumerate(self.params) if p.group == group]


def _position(param: ParamSharding) -> int:
    return param.local_index if param.local_index is not None else -1


@runtime_checkable
class ReportsItsGrid(Protocol):
    """An optimizer that reports its own layout (the packaged :class:`~muonckpt.optim.muon.Muon`):
    whole in one process, or ZeRO-1 + TP over the dp x tp grid of its two groups in distributed
    mode, each rank reporting the params it holds (:func:`describe_grid`)."""

    distributed_mode: bool
    dist_group: collectives.Group
    tp_group: collectives.Group
    param_groups: list[dict[str, Any]]

    def rank_report(self) -> RankReport:
        """This rank's params in the layout math's terms (shapes, buffers, buckets, ranges)."""
        ...

    def state_keys(self, group: int) -> tuple[str, ...]:
        """The state keys a complete entry of group ``group`` has."""
        ...


class Joined:
    """Several optimizers that together train one model (``torch.optim.Muon`` for the matrices
    and ``AdamW`` for the rest), seen as one by save and load: their groups in order, their
    state together. Across ranks only as replicas (DDP): a sharded optimizer goes alone
    (``local``: this process's own optimizers, which :func:`check_local` checks instead)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], *, local: bool = False) -> None:
        if not optimizers:
            raise CheckpointError("no optimizer to save")
        sharded = [type(o).__name__ for o in optimizers if has_own_layout(o)]
        if sharded and not local and _in_process_group():
            raise CheckpointError(
                f"a list of optimizers goes into one checkpoint across ranks only as replicas "
                f"(DDP: no muonckpt hooks), and {sharded} shard their state: save a sharded "
                "optimizer on its own"
            )
        self.optimizers = list(optimizers)
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.state = {p: s for o in optimizers for p, s in o.state.items()}


Optimizers = torch.optim.Optimizer | Joined
"""What save and load take: one optimizer, or several as one."""


def optimizers_of(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    """The optimizers ``optimizer`` stands for, in order."""
    return optimizer.optimizers if isinstance(optimizer, Joined) else [optimizer]


def has_own_layout(optimizer: object) -> bool:
    """Whether ``optimizer`` reports its grid or has an owner rule (muonckpt's hooks)."""
    return isinstance(optimizer, ReportsItsGrid) or optimizer in _OWNERS


@dataclass(frozen=True, eq=False)
class OwnerRule:
    """Where an optimizer keeps each param's state, whole on one owner rank of ``group`` (its
    TP shard with ``tp_group``) or :data:`REPLICATED`: what :func:`declare_owners` records."""

    owner: Callable[[int, torch.Tensor], Any]
    names: list[str] | None
    """Each flat param's name; None: the optimizer's own names."""
    group: collectives.Group
    tp_group: collectives.Group
    splits: dict[str, int]
    """Param name -> dimension split across ``tp_group``."""
    local_only: bool
    """Everything on this one rank (upstream's single-device classes)."""

    def describe(self, optimizer: torch.optim.Optimizer, agree: bool) -> Sharding:
        """The optimizer's :class:`Sharding`; with ``agree`` the ranks check it is one."""
        if self.local_only:
            return describe_whole(optimizer, names=self.names)
        return _describe_owned(
            optimizer, self.owner, self.names, self.group, self.tp_group, self.splits, agree
        )

    def ranks(self, optimizer: torch.optim.Optimizer, operation: str) -> list[int]:
        """The global ranks of ``operation`` over the optimizer, without a collective."""
        if self.local_only:
            return [collectives.global_rank()]
        if self.tp_group is None:
            return collectives.group_ranks(self.group)
        return grid_members(optimizer, self.group, self.tp_group, operation)


_OWNERS: weakref.WeakKeyDictionary[Any, OwnerRule] = weakref.WeakKeyDictionary()
"""Each owner-rule optimizer's rule, kept beside it rather than as an attribute on it."""


def declare_owners(
    optimizer: torch.optim.Optimizer,
    owner: Callable[[int, torch.Tensor], Any] | None = None,
    *,
    names: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
    group: collectives.Group = None,
    tp_group: collectives.Group = None,
    tp_split_dims: Mapping[str, int] | None = None,
) -> OwnerRule:
    """Record where ``optimizer`` keeps each param's state (the arguments of
    :func:`muonckpt.install_hooks`, which documents them), so that :func:`describe` and
    :func:`participants` follow it; the rule recorded."""
    rule = owner if owner is not None else upstream_owner(optimizer)
    if rule is None:
        raise StateDictError(
            f"install_hooks cannot tell where a {type(optimizer).__name__} keeps its state: "
            "pass owner=lambda index, param: rank (or muonckpt.REPLICATED)"
        )
    given = _names_by_param(optimizer, names)
    splits = dict(tp_split_dims or {})
    unknown = sorted(set(splits) - set(given if given is not None else param_names(optimizer)))
    if unknown:
        raise StateDictError(f"tp_split_dims names params the optimizer does not hold: {unknown}")
    local_only = owner is None and type(optimizer).__name__.startswith("SingleDevice")
    recorded = OwnerRule(rule, given, group, tp_group, splits, local_only)
    _OWNERS[optimizer] = recorded
    return recorded


def flat_params(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's params in order over its groups (torch's state-dict indices)."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def check_agreement(sharding: Sharding, owners: Sequence[str] = ()) -> None:
    """Raise :class:`StateDictError` on every rank unless all agree on names and full shapes.

    A collective over ``sharding.participants``, run before any state moves, so a mismatch is
    an error instead of a hang or a scrambled gather. For owner-style sharding, where every
    rank holds every param.
    """
    fingerprint = [[p.name, list(p.full_shape)] for p in sharding.params] + [list(owners)]
    digest = zlib.crc32(repr(fingerprint).encode())

    def agreed(views: list[int]) -> None:
        if len(set(views)) != 1:
            raise StateDictError(
                "ranks disagree about the optimizer's params (names, order, full shapes or "
                "owners): every rank must hold every param, in the same order"
            )

    state_dict_steps(sharding.participants, sharding.destination).each_then_root(
        "agree", lambda: digest, agreed
    )


def state_dict_steps(ranks: Sequence[int], root: int) -> group_steps.CollectiveSteps:
    """The protocol of a state-dict collective: any rank's failure a StateDictError on all."""
    return group_steps.CollectiveSteps("state dict", ranks, root, StateDictError)


def describe_grid(
    optimizer: Optimizers,
    report: Callable[[], RankReport],
    dp_group: collectives.Group,
    tp_group: collectives.Group,
    keys: Callable[[int], tuple[str, ...]],
) -> Sharding:
    """Sharding of a ZeRO-1 + TP optimizer over its whole dp x tp grid, from each rank's
    ``report()`` of the params it holds (in the layout math's terms, :class:`RankReport`).

    The grid's param list is learned once by a collective over the grid
    (:func:`muonckpt.layout.grid.merge_reports`) and kept beside the optimizer in a weak mapping.
    """
    me = collectives.global_rank()
    ranks, grid = _grid_params(optimizer, report, dp_group, tp_group)
    topo = grid.topology
    coords = topo.coords(ranks.index(me))
    params = []
    for gp in grid.params:
        sources = []
        for rank in range(topo.world_size):
            region = gp.owner_region(topo, *topo.coords(rank))
            if region.numel:
                sources.append(Holding(ranks[rank], region))
        local_index = gp.local_index[ranks.index(me)]
        params.append(
            ParamSharding(
                name=gp.name,
                full_shape=gp.full_shape,
                sources=tuple(sources),
                local=gp.region(topo, *coords) if local_index is not None else None,
                held=gp.region(topo, *coords) if local_index is not None else None,
                local_index=local_index,
                group=gp.spec.group,
                expected_keys=keys(gp.spec.group),
                tp_split_dim=gp.spec.tp_split_dim,
                dtype=gp.spec.dtype,
            )
        )
    named = bool(grid.params) and grid.params[0].spec.name is not None
    return Sharding(params, ranks, ranks[0], {"dp": topo.dp, "tp": topo.tp}, named)


_GRIDS: weakref.WeakKeyDictionary[Any, tuple[tuple, list[int], GridParams]] = (
    weakref.WeakKeyDictionary()
)
"""Per distributed optimizer: (its local structure, the grid's global ranks, its params)."""


def _grid_params(
    optimizer: Optimizers,
    report: Callable[[], RankReport],
    dp_group: collectives.Group,
    tp_group: collectives.Group,
) -> tuple[list[int], GridParams]:
    """The grid's global ranks and canonical params (a collective the first time)."""
    flat = flat_params(optimizer)
    structure = (tuple(id(p) for p in flat), len(optimizer.param_groups))
    cached = _GRIDS.get(optimizer)
    if cached is not None and cached[0] == structure:
        return cached[1], cached[2]
    ranks, grid = learn_grid(optimizer, report, dp_group, tp_group)
    _GRIDS[optimizer] = (structure, ranks, grid)
    return ranks, grid


def learn_grid(
    optimizer: Optimizers,
    report: Callable[[], RankReport],
    dp_group: collectives.Group,
    tp_group: collectives.Group,
) -> tuple[list[int], GridParams]:
    """The grid's global ranks (:func:`grid_members`) and canonical params, from every rank's
    ``report()``: a collective over the grid (step ``params``), which fails on every rank when
    they disagree."""
    topo = Topology(collectives.group_size(dp_group), collectives.group_size(tp_group))
    ranks = grid_members(optimizer, dp_group, tp_group)

    def merge(reports: list[dict]) -> dict:
        return merge_reports([RankReport.from_json(r) for r in reports], topo).to_json()

    grid = GridParams.from_json(
        state_dict_steps(ranks, ranks[0]).each_then_root(
            "params", lambda: report().to_json(), merge
        )
    )
    return ranks, grid


_GRID_RANKS: weakref.WeakKeyDictionary[Any, tuple[Any, Any, list[int]]] = (
    weakref.WeakKeyDictionary()
)
"""Per grid optimizer: its DP and TP groups and the grid's global ranks (learned once)."""


def grid_members(
    optimizer: Any,
    dp_group: collectives.Group,
    tp_group: collectives.Group,
    operation: str = "describe the grid",
) -> list[int]:
    """The global ranks of ``optimizer``'s dp x tp grid, indexed ``dp_rank * tp + tp_rank``:
    learned the first time by :func:`muonckpt.distributed.groups.grid_ranks` (the first step of
    ``operation``, bounded), then kept beside the optimizer."""
    cached = _GRID_RANKS.get(optimizer)
    if cached is not None and cached[0] is dp_group and cached[1] is tp_group:
        return cached[2]
    ranks = groups.grid_ranks(dp_group, tp_group, operation)
    _GRID_RANKS[optimizer] = (dp_group, tp_group, ranks)
    return ranks


def participants(optimizer: Any, operation: str, *, local: bool = False) -> list[int]:
    """The global ranks of ``operation`` (``save``, ``load``, ...) over ``optimizer``, found
    without a collective on the process groups, so that the operation can begin with a
    bounded rendezvous among them (:func:`muonckpt.distributed.group_steps.rendezvous`): its grid
    for a optimizer that reports its grid or has an owner rule, the world for any other in a process
    group (:func:`describe`); with ``local``, this process alone (:func:`check_local`)."""
    if not isinstance(local, bool):
        raise CheckpointError(f"{operation}: local must be True or False, got {local!r}")
    if local:
        check_local(optimizer, operation)
        return [collectives.global_rank()]
    if isinstance(optimizer, ReportsItsGrid):
        if not optimizer.distributed_mode:
            return [collectives.global_rank()]
        return grid_members(optimizer, optimizer.dist_group, optimizer.tp_group, operation)
    rule = _OWNERS.get(optimizer)
    if rule is not None:
        return rule.ranks(optimizer, operation)
    return collectives.group_ranks(None)


def check_local(optimizer: Optimizers, operation: str) -> None:
    """``local=True`` names an optimizer of this process alone: one that keeps state on other
    ranks (a distributed packaged Muon, an owner rule over a group of several ranks) is refused,
    told without a collective."""
    spread = [type(o).__name__ for o in optimizers_of(optimizer) if _spans_ranks(o)]
    if spread:
        raise CheckpointError(
            f"{operation}(..., local=True) is for an optimizer of this process alone, and "
            f"{spread} keep their state across ranks: {operation} it without local=True, on "
            "every rank of its grid"
        )


def _spans_ranks(optimizer: object) -> bool:
    """Whether ``optimizer`` keeps state on ranks other than this one (its grid or its owner
    rule's group has several), told from its groups' sizes."""
    if isinstance(optimizer, ReportsItsGrid):
        grid = collectives.group_size(optimizer.dist_group) * collectives.group_size(
            optimizer.tp_group
        )
        return optimizer.distributed_mode and grid > 1
    rule = _OWNERS.get(optimizer)
    if rule is None or rule.local_only:
        return False
    tp = collectives.group_size(rule.tp_group) if rule.tp_group is not None else 1
    return collectives.group_size(rule.group) * tp > 1


def _in_process_group() -> bool:
    """Whether this process is one of several in an initialized default process group."""
    return collectives.is_distributed() and collectives.group_size(None) > 1


def replica_hint(optimizer: Optimizers) -> str:
    """What to say where a call over ``optimizer`` found the ranks out of step (some never
    came, or each asked for another path): an optimizer without hooks in a process group is
    taken for a DDP replica on every rank, and one each process keeps for itself needs
    ``local=True``. Empty for any other."""
    if any(has_own_layout(o) for o in optimizers_of(optimizer)) or not _in_process_group():
        return ""
    return (
        "an optimizer without muonckpt hooks in a process group is taken for a DDP replica "
        "on every rank; for an optimizer of this process alone, pass local=True"
    )


def _check_unique(names: Sequence[str]) -> None:
    counts = Counter(names)
    dupes = sorted(n for n, count in counts.items() if count > 1)
    if dupes:
        raise StateDictError(f"duplicate param names {dupes}: names must be unique")


def describe_whole(
    optimizer: Optimizers,
    keys: Callable[[int], tuple[str, ...]] = lambda group: (),
    names: Sequence[str] | None = None,
) -> Sharding:
    """Sharding of a single-process optimizer: every param whole, its state all local."""
    me = collectives.global_rank()
    names = list(names) if names is not None else param_names(optimizer)
    flat = [(p, g) for g, group in enumerate(optimizer.param_groups) for p in group["params"]]
    params: list[ParamSharding] = []
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # equal values one object: 100k
    sources: dict[Region, tuple[Holding, ...]] = {}  # params of a few shapes hold a few
    for index, ((p, g), name) in enumerate(zip(flat, names, strict=True)):
        whole = whole_region(p.numel())
        shape = tuple(p.shape)
        params.append(
            ParamSharding(
                name,
                shapes.setdefault(shape, shape),
                sources.setdefault(whole, (Holding(me, whole),)),
                whole,
                index,
                g,
                keys(g),
                dtype=torch_dtype_name(p.dtype),
            )
        )
    _check_unique([p.name for p in params])
    return Sharding(params, [me], me, {"dp": 1, "tp": 1}, is_named(optimizer) or names is not None)


def describe(
    optimizer: torch.optim.Optimizer | Joined, *, agree: bool = True, local: bool = False
) -> Sharding:
    """How ``optimizer``'s state is sharded: as it reports it (the packaged Muon), by
    the owner rule recorded for it (:func:`declare_owners`), else every param whole and local
    in a single process or with ``local`` (this process's own, :func:`check_local`), a replica
    on every rank in a process group.

    A collective over the optimizer's ranks where describing it needs one; ``agree=False``
    skips an owner rule's check that the ranks agree (a local trim, after a state dict that
    was gathered by a collective).
    """
    _check_dense(optimizer)
    if isinstance(optimizer, ReportsItsGrid):
        if not optimizer.distributed_mode:
            return describe_whole(optimizer, optimizer.state_keys)
        report, keys = optimizer.rank_report, optimizer.state_keys
        return describe_grid(optimizer, report, optimizer.dist_group, optimizer.tp_group, keys)
    if not isinstance(optimizer, Joined) and optimizer in _OWNERS:
        return _OWNERS[optimizer].describe(optimizer, agree)
    if _in_process_group() and not local:
        return describe_replicated(optimizer)
    return describe_whole(optimizer)


def _check_dense(optimizer: torch.optim.Optimizer | Joined) -> None:
    """Refuse a param of a kind no checkpoint holds (nested, sparse, meta, quantized:
    :func:`muonckpt.storage.unstorable_kind`), naming it, before its shape is asked for (a
    nested tensor has none)."""
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    for index, p in enumerate(flat):
        if (kind := unstorable_kind(p)) is not None:
            raise StateDictError(
                f"param {param_names(optimizer)[index]!r} is {kind}: muonckpt checkpoints "
                "dense params only"
            )


def describe_replicated(optimizer: Any) -> Sharding:
    """Sharding of an optimizer without hooks in a process group: a replica on every rank of
    the world (DDP), its state the same everywhere, every param :data:`REPLICATED` (saved
    once, the ranks sharing the writing by :func:`muonckpt.layout.workplan.spread`; loaded whole on
    every rank). A collective over the world: the ranks check that they hold the same params
    (a sharded optimizer such as upstream ``muon.Muon`` needs :func:`muonckpt.install_hooks`,
    and a gather or save checks that the replicas' state agrees, see
    :func:`muonckpt.state.gather.replica_digest`)."""
    kind = type(optimizer)
    if kind.__module__ == UPSTREAM_MODULE and kind.__name__ in ("Muon", "MuonWithAuxAdam"):
        raise StateDictError(
            f"upstream muon.{type(optimizer).__name__} keeps each Muon param's state on one "
            "rank, not replicated: call muonckpt.install_hooks(optimizer) first"
        )
    world = collectives.group_size(None)
    writers = spread([p.numel() * p.element_size() for p in flat_params(optimizer)], world)
    return _describe_owned(
        optimizer, lambda i, p: REPLICATED, None, None, None, {}, True, writers=writers
    )


UPSTREAM_MODULE = "muon"
"""The module of KellerJordan's Muon (``pip install muon-optimizer``)."""
_UPSTREAM = {"Muon", "MuonWithAuxAdam", "SingleDeviceMuon", "SingleDeviceMuonWithAuxAdam"}


def upstream_owner(optimizer: torch.optim.Optimizer) -> Callable[[int, torch.Tensor], Any] | None:
    """The owner rule of upstream KellerJordan Muon classes, or None for any other optimizer.

    ``Muon`` and ``MuonWithAuxAdam`` give param ``k`` of each Muon group (in the group's own,
    size-sorted order) to rank ``k % world``; every rank runs AdamW on every param of the other
    groups (:data:`REPLICATED`). The single-device classes keep everything on their one rank.
    """
    kind = type(optimizer)
    if kind.__module__ != UPSTREAM_MODULE or kind.__name__ not in _UPSTREAM:
        return None
    if kind.__name__.startswith("SingleDevice"):
        return lambda index, p: 0
    rule: dict[int, Any] = {}
    start = 0
    world = collectives.group_size(None)
    for group in optimizer.param_groups:
        muon = group.get("use_muon", kind.__name__ == "Muon")
        for k in range(len(group["params"])):
            rule[start + k] = k % world if muon else REPLICATED
        start += len(group["params"])
    return lambda index, p: rule[index]


def _names_by_param(
    optimizer: torch.optim.Optimizer,
    names: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None,
) -> list[str] | None:
    """Each flat param's name from ``names``; None to use the optimizer's own names."""
    if names is None:
        return None
    pairs = names.items() if isinstance(names, Mapping) else names
    by_id = {id(p): n for n, p in pairs}
    flat = flat_params(optimizer)
    missing = [i for i, p in enumerate(flat) if id(p) not in by_id]
    if missing:
        raise StateDictError(
            f"names= has no name for the optimizer's param(s) at flat index {missing[:8]} "
            f"(shapes {[tuple(flat[i].shape) for i in missing[:8]]})"
        )
    return [by_id[id(p)] for p in flat]


def _describe_owned(
    optimizer: torch.optim.Optimizer,
    owner: Callable[[int, torch.Tensor], Any],
    names: Sequence[str] | None,
    group: collectives.Group,
    tp_group: collectives.Group,
    splits: Mapping[str, int],
    collective: bool,
    writers: Sequence[int] | None = None,
) -> Sharding:
    """Sharding of an owner-rule optimizer; ``writers``: per param, the DP rank whose copy of
    a replicated param's state is saved (default the first)."""
    me = collectives.global_rank()
    if tp_group is None:
        ranks = collectives.group_ranks(group)
        topo = Topology(len(ranks), 1)
    else:
        ranks = grid_members(optimizer, group, tp_group)
        topo = Topology(collectives.group_size(group), collectives.group_size(tp_group))
    my_dp, my_tp = topo.coords(ranks.index(me))
    names = list(names) if names is not None else param_names(optimizer)
    flat = [(p, g) for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]]
    params, owners = [], []
    for index, ((p, g), name) in enumerate(zip(flat, names, strict=True)):
        split = splits.get(name, -1) if topo.tp > 1 else -1
        full = tp_full_shape(p.shape, split, topo.tp)
        block = math.prod(p.shape)
        tps = range(topo.tp) if split >= 0 else range(1)

        def region(t: int, full: tuple = full, split: int = split, block: int = block) -> Region:
            return tp_region(full, split, topo.tp, t, (0, block))

        rank = owner(index, p)
        replicated = rank is REPLICATED
        dp_owner = (writers[index] if writers else 0) if replicated else int(rank)
        if not 0 <= dp_owner < topo.dp:
            raise StateDictError(f"param {name!r}: owner rank {rank} is outside 0..{topo.dp - 1}")
        owners.append(repr(rank))
        mine = region(my_tp if split >= 0 else 0)
        keeps = replicated or dp_owner == my_dp
        params.append(
            ParamSharding(
                name=name,
                full_shape=full,
                sources=tuple(Holding(ranks[topo.rank(dp_owner, t)], region(t)) for t in tps),
                local=mine if keeps else None,
                local_index=index,
                group=g,
                tp_split_dim=splits.get(name, -1),
                dtype=torch_dtype_name(p.dtype),
                held=mine,
                replicated=replicated,
            )
        )
    _check_unique([p.name for p in params])
    sharding = Sharding(
        params, ranks, ranks[0], {"dp": topo.dp, "tp": topo.tp}, is_named(optimizer) or bool(names)
    )
    if collective:
        check_agreement(sharding, owners)
    return sharding
