"""Hooks that make a sharded optimizer's ``state_dict()`` complete and resumable anywhere.

A sharded optimizer keeps each param's state on the ranks that own it: pieces of a flat ZeRO-1
buffer in the packaged :class:`~muonckpt.Muon`, whole tensors on one owner rank in
KellerJordan-style Muon. The hooks here, attached through torch's optimizer hook API, turn that
into torch's ordinary state-dict format with every param's full-shape state:

* ``state_dict()`` (a collective over every rank that holds state) learns the complete list of
  params from the whole grid (a rank may leave out a param it owns no element of), then streams
  each param's pieces to the destination rank, which assembles full tensors one at a time.
  Other ranks return a stub marked incomplete, so loading one by mistake fails loudly instead
  of silently restarting momentum at zero.
* ``load_state_dict(sd)`` matches params by name, validates names, keys and shapes, and keeps
  only this rank's share under the current topology. For a distributed packaged Muon the first
  call that needs the grid's param list (``state_dict``, ``load_state_dict``, ``save`` or
  ``load``) is a collective over the grid; the list is kept for later calls.

Memory: the destination holds the complete state plus one piece in flight; every other rank its
own share plus one piece (or one full param when delivering to all ranks).
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from . import collectives
from .errors import StateDictError
from .grid import GridParams, LocalParam, RankReport, merge_reports
from .layout import Region, Topology, whole_region
from .regions import extract, insert_

MARKER = "muonckpt"
"""Top-level key that tags state dicts produced by these hooks."""
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Holding:
    """A global rank's share of a param's state: ``region`` of the full tensor, or all of it."""

    rank: int
    region: Region | None
    """None: the whole tensor, whatever its shape (owner-style sharding)."""


@dataclass(frozen=True)
class ParamSharding:
    """How one param of the whole grid is spread over ranks, seen from this rank."""

    name: str
    full_shape: tuple[int, ...] | None
    """Shape of every full state tensor; None when whole tensors keep the owner's shapes."""
    sources: tuple[Holding, ...]
    """Owners that together hold every element exactly once (what the gather reads)."""
    local: Region | None
    """This rank's share when loading: a region, the whole state (owner), or nothing."""
    keeps: bool
    """Whether this rank keeps any state of the param when loading."""
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


class StateDictHooks:
    """The four hooks on one optimizer. ``all_ranks=True`` delivers the full state everywhere."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        describe: Callable[[bool], Sharding],
        *,
        all_ranks: bool = False,
    ) -> None:
        self.describe = describe
        self.all_ranks = all_ranks
        self._handles = [
            optimizer.register_state_dict_pre_hook(self._describe_for_gather),
            optimizer.register_state_dict_post_hook(self._gather),
            optimizer.register_load_state_dict_pre_hook(self._trim),
            optimizer.register_load_state_dict_post_hook(self._check_loaded),
        ]
        self._sharding: Sharding | None = None
        self._loading_local_share = False
        _HOOKS[optimizer] = self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    @contextmanager
    def local_share_load(self) -> Iterator[None]:
        """Within the block, ``load_state_dict`` takes a dict already cut to this rank's share
        (in this rank's own param indices), as :func:`muonckpt.load` builds it."""
        self._loading_local_share = True
        try:
            yield
        finally:
            self._loading_local_share = False

    def _describe_for_gather(self, optimizer: torch.optim.Optimizer) -> None:
        self._sharding = self.describe(True)

    def _gather(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        sharding = self._sharding or self.describe(True)
        self._sharding = None
        full_state = gather_full_state(sharding, state_dict["state"], self.all_ranks)
        receives = full_state is not None
        marker = {
            "complete": receives,
            "format_version": FORMAT_VERSION,
            "source_topology": dict(sharding.topology),
            "source_rank": collectives.global_rank(),
        }
        return {
            "state": full_state if receives else {},
            "param_groups": canonical_groups(state_dict["param_groups"], sharding),
            MARKER: marker,
        }

    def _trim(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._loading_local_share:
            return dict(state_dict)
        return trim_state_dict(optimizer, state_dict, self.describe(False))

    def _check_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After loading, every region-sharded state tensor must be exactly this rank's share."""
        flat = _flat_params(optimizer)
        for param in self.describe(False).local():
            if param.local is None:
                continue
            for key, value in optimizer.state.get(flat[param.local_index], {}).items():
                if isinstance(value, torch.Tensor) and value.numel() != param.local.numel:
                    raise StateDictError(
                        f"param {param.name!r}: loaded state {key!r} has {value.numel()} "
                        f"elements, this rank's share is {param.local.numel}"
                    )


_HOOKS: weakref.WeakKeyDictionary[torch.optim.Optimizer, StateDictHooks] = (
    weakref.WeakKeyDictionary()
)
"""Each hooked optimizer's hooks, kept beside it rather than as an attribute on it."""


def hooks_of(optimizer: torch.optim.Optimizer) -> StateDictHooks:
    """The muonckpt hooks of ``optimizer``; :class:`StateDictError` if it has none."""
    hooks = _HOOKS.get(optimizer)
    if hooks is None:
        raise StateDictError("optimizer has no muonckpt hooks: use muonckpt.Muon or install_hooks")
    return hooks


def _flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def canonical_groups(
    local_groups: Sequence[Mapping[str, Any]], sharding: Sharding
) -> list[dict[str, Any]]:
    """This rank's group settings, each listing every param of the grid's group by index."""
    groups = []
    for g, group in enumerate(local_groups):
        members = sharding.members(g)
        out = {**group, "params": members}
        if sharding.named or "param_names" in group:
            out["param_names"] = [sharding.params[i].name for i in members]
        groups.append(out)
    return groups


def check_agreement(sharding: Sharding) -> None:
    """Raise :class:`StateDictError` on every rank unless all agree on names and full shapes.

    A collective over ``sharding.participants``, run before any state moves, so a mismatch is
    an error instead of a hang or a scrambled gather. For owner-style sharding, where every
    rank holds every param.
    """
    fingerprint = [[p.name, list(p.full_shape) if p.full_shape else None] for p in sharding.params]
    digest = zlib.crc32(repr(fingerprint).encode())
    views = collectives.gather_json(digest, sharding.participants, sharding.destination)
    agreed = views is None or len(set(views)) == 1
    if not collectives.broadcast_json(agreed, sharding.participants, sharding.destination):
        raise StateDictError(
            "ranks disagree about the optimizer's params (names, order or full shapes): "
            "every rank must hold every param, in the same order"
        )


def _decide(work: Callable[[], Any], ranks: Sequence[int], root: int) -> Any:
    """``work()`` on ``root``, its value on every rank; its failure a StateDictError on all."""
    outcome = None
    if collectives.global_rank() == root:
        try:
            outcome = {"value": work()}
        except StateDictError as exc:
            outcome = {"error": str(exc)}
        except Exception as exc:  # every rank must learn of it, or the others wait forever
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
    outcome = collectives.broadcast_json(outcome, ranks, root)
    if "error" in outcome:
        raise StateDictError(outcome["error"])
    return outcome["value"]


def gather_full_state(
    sharding: Sharding, local_state: Mapping[int, Mapping[str, Any]], all_ranks: bool = False
) -> dict[int, dict[str, Any]] | None:
    """Every param's full state by canonical index, on the destination (and every rank with
    ``all_ranks``); None elsewhere. ``local_state`` is keyed by this rank's flat param index.

    A collective over ``sharding.participants``.
    """
    me = collectives.global_rank()
    entries = _gather_entry_metadata(sharding, local_state)
    receives = me == sharding.destination or all_ranks
    full_state: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(sharding.params):
        spec = entries[index]
        if spec is None:
            continue
        full_state[index] = {}
        for key, info in spec.items():
            value = _gather_value(param, key, info, local_state, sharding, all_ranks)
            if receives:
                full_state[index][key] = value
    return full_state if receives else None


def _gather_entry_metadata(
    sharding: Sharding, local_state: Mapping[int, Mapping[str, Any]]
) -> list[dict[str, Any] | None]:
    """Every rank learns, per param, the state keys with their dtype and shape (or value)."""
    mine: dict[str, dict[str, Any]] = {}
    me = collectives.global_rank()
    for index, param in enumerate(sharding.params):
        if any(h.rank == me for h in param.sources) and param.local_index in local_state:
            mine[str(index)] = {
                key: _describe_value(value) for key, value in local_state[param.local_index].items()
            }
    reports = collectives.gather_json(mine, sharding.participants, sharding.destination)
    return _decide(
        lambda: _merge_entry_reports(sharding, reports),
        sharding.participants,
        sharding.destination,
    )


def _merge_entry_reports(
    sharding: Sharding, reports: list[dict[str, dict[str, Any]]]
) -> list[dict[str, Any] | None]:
    merged: list[dict[str, Any] | None] = [None] * len(sharding.params)
    for report in reports:
        for index, keys in report.items():
            slot = merged[int(index)] = merged[int(index)] or {}
            for key, info in keys.items():
                if key in slot and slot[key]["kind"] != info["kind"]:
                    raise StateDictError(
                        f"param {sharding.params[int(index)].name!r}: "
                        f"ranks disagree about state {key!r}"
                    )
                slot.setdefault(key, info)
    return merged


def _describe_value(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {
            "kind": "tensor",
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
        }
    return {"kind": "value", "value": value}


def _gather_value(
    param: ParamSharding,
    key: str,
    info: Mapping[str, Any],
    local_state: Mapping[int, Mapping[str, Any]],
    sharding: Sharding,
    all_ranks: bool,
) -> Any:
    """Assemble one full state value on the destination (and, if asked, on every rank)."""
    if info["kind"] == "value":
        return info["value"]
    me, dst = collectives.global_rank(), sharding.destination
    dtype = getattr(torch, info["dtype"])
    shape = param.full_shape if param.full_shape is not None else tuple(info["shape"])
    full = torch.empty(shape, dtype=dtype) if me == dst else None
    for holding in param.sources:
        if holding.rank == me:
            piece = local_state[param.local_index][key].reshape(-1)
            if me == dst:
                _place(full, holding.region, piece)
            else:
                collectives.send(piece, dst)
        elif me == dst:
            numel = holding.region.numel if holding.region is not None else math.prod(shape)
            piece = torch.empty(numel, dtype=dtype)
            collectives.recv(piece, holding.rank)
            _place(full, holding.region, piece)
    if all_ranks:
        if me == dst:
            for rank in sharding.participants:
                if rank != dst:
                    collectives.send(full, rank)
        else:
            full = torch.empty(shape, dtype=dtype)
            collectives.recv(full, dst)
    return full


def _place(full: torch.Tensor, region: Region | None, piece: torch.Tensor) -> None:
    if region is None:
        full.view(-1).copy_(piece)
    else:
        insert_(full, region, piece)


def trim_state_dict(
    optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], sharding: Sharding
) -> dict[str, Any]:
    """A complete state dict, re-keyed to ``optimizer``'s params and cut to this rank's share.

    Params are matched by name, so the source may order its groups' params differently.
    Raises :class:`StateDictError` naming the param on any mismatch.
    """
    marker = state_dict.get(MARKER)
    if isinstance(marker, Mapping) and not marker.get("complete", False):
        raise StateDictError(
            f"this state dict came from rank {marker.get('source_rank')}, which does not hold the "
            "complete state; load the one returned on the destination rank (rank 0 of the "
            "dp x tp grid), or gather with all_ranks=True"
        )
    saved_groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, Mapping):
        raise StateDictError("not an optimizer state dict: needs 'state' and 'param_groups'")
    new_groups = remap_groups(optimizer, saved_groups, sharding)
    by_name = {
        name: saved_state.get(index)
        for group in saved_groups
        for name, index in zip(_group_names(group), group["params"], strict=True)
    }
    any_state = any(v for v in by_name.values())
    flat = _flat_params(optimizer)
    new_state: dict[int, dict[str, Any]] = {}
    for param in sharding.params:
        entry = by_name[param.name]
        if not entry:
            if any_state and param.expected_keys:
                raise StateDictError(f"state dict has no state for param {param.name!r}")
            continue
        if param.local_index is None:
            _check_keys(param, entry)
            continue
        kept = _cut_entry(param, entry, flat[param.local_index])
        if kept is not None:
            new_state[param.local_index] = kept
    return {"state": new_state, "param_groups": new_groups}


def remap_groups(
    optimizer: torch.optim.Optimizer, saved_groups: Sequence[Mapping[str, Any]], sharding: Sharding
) -> list[dict[str, Any]]:
    """Saved groups' settings (step included) laid over ``optimizer``'s groups, matched by name.

    Each group of the grid must hold exactly the params of the saved group at the same
    position; the result lists this rank's own params of each group, in its own indices.
    """
    saved_names = [n for g in saved_groups for n in _group_names(g)]
    _check_names(saved_names, [p.name for p in sharding.params])
    if len(saved_groups) != len(optimizer.param_groups):
        raise StateDictError(
            f"state dict has {len(saved_groups)} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    local_names = {p.local_index: p.name for p in sharding.local()}
    new_groups, start = [], 0
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        names = [sharding.params[i].name for i in sharding.members(g)]
        if sorted(names) != sorted(_group_names(saved)):
            raise StateDictError(
                f"param group {g} holds {names}, the state dict's group {g} holds "
                f"{_group_names(saved)}"
            )
        settings = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        for key, value in settings.items():
            if isinstance(group.get(key), tuple) and isinstance(value, list):
                settings[key] = tuple(value)
        indices = list(range(start, start + len(group["params"])))
        settings["params"] = indices
        if "param_names" in group:
            settings["param_names"] = [local_names[i] for i in indices]
        new_groups.append(settings)
        start += len(indices)
    return new_groups


def _check_keys(param: ParamSharding, entry: Mapping[str, Any]) -> None:
    missing = [k for k in param.expected_keys if k not in entry]
    if missing:
        raise StateDictError(f"param {param.name!r}: state dict lacks state key(s) {missing}")


def _cut_entry(
    param: ParamSharding, entry: Mapping[str, Any], p: torch.Tensor
) -> dict[str, Any] | None:
    _check_keys(param, entry)
    if not param.keeps:
        return None
    kept: dict[str, Any] = {}
    for key, value in entry.items():
        if not isinstance(value, torch.Tensor) or param.full_shape is None:
            kept[key] = value
            continue
        if tuple(value.shape) != param.full_shape:
            raise StateDictError(
                f"param {param.name!r}: state {key!r} has shape {tuple(value.shape)}, "
                f"expected the full shape {param.full_shape}"
            )
        piece = extract(value, param.local) if param.local is not None else value.clone()
        kept[key] = piece.reshape(p.shape) if piece.numel() == p.numel() else piece
    return kept


def _group_names(group: Mapping[str, Any]) -> list[str]:
    names = group.get("param_names")
    if names is not None:
        return list(names)
    return [str(i) for i in group["params"]]


def _check_names(saved: Sequence[str], current: Sequence[str]) -> None:
    if sorted(saved) == sorted(current) and len(set(current)) == len(current):
        return
    only_saved = sorted(set(saved) - set(current))
    only_current = sorted(set(current) - set(saved))
    raise StateDictError(
        "param names differ between the state dict and the optimizer: "
        f"only in the state dict {only_saved}, only in the optimizer {only_current}"
    )


def param_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of all params in order: ``param_names`` entries, else flat indices as strings."""
    names: list[str] = []
    for group in optimizer.param_groups:
        group_names = group.get("param_names")
        names.extend(
            group_names
            if group_names
            else [str(len(names) + i) for i in range(len(group["params"]))]
        )
    return names


def _named(optimizer: torch.optim.Optimizer) -> bool:
    return any(group.get("param_names") for group in optimizer.param_groups)


def attach_muon_hooks(optimizer: Any) -> StateDictHooks:
    """Attach the hooks to a packaged :class:`~muonckpt.Muon` (done by its constructor)."""
    return StateDictHooks(optimizer, lambda collective: describe_muon(optimizer))


def describe_muon(optimizer: Any) -> Sharding:
    """Sharding of a packaged Muon over its whole grid.

    In distributed mode the grid's param list is learned once by a collective over the grid
    (:func:`muonckpt.grid.merge_reports`) and kept beside the optimizer.
    """
    from .optim import ADAMW_STATE_KEYS, MUON_STATE_KEYS

    def keys(group: int) -> tuple[str, ...]:
        use_muon = optimizer.param_groups[group].get("use_muon", False)
        return MUON_STATE_KEYS if use_muon else ADAMW_STATE_KEYS

    me = collectives.global_rank()
    if not optimizer.distributed_mode:
        params = []
        flat = [(p, g) for g, group in enumerate(optimizer.param_groups) for p in group["params"]]
        for index, ((p, g), name) in enumerate(zip(flat, param_names(optimizer), strict=True)):
            whole = whole_region(p.numel())
            params.append(
                ParamSharding(
                    name,
                    tuple(p.shape),
                    (Holding(me, whole),),
                    whole,
                    True,
                    index,
                    g,
                    keys(g),
                    dtype=_dtype_name(p),
                )
            )
        _check_unique([p.name for p in params])
        return Sharding(params, [me], me, {"dp": 1, "tp": 1}, _named(optimizer))
    ranks, grid = _grid_params(optimizer)
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
                keeps=local_index is not None,
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
"""Per distributed packaged Muon: (its local structure, the grid's global ranks, its params)."""


def _grid_params(optimizer: Any) -> tuple[list[int], GridParams]:
    """The grid's global ranks and canonical params (a collective the first time)."""
    flat = _flat_params(optimizer)
    structure = (tuple(id(p) for p in flat), len(optimizer.param_groups))
    cached = _GRIDS.get(optimizer)
    if cached is not None and cached[0] == structure:
        return cached[1], cached[2]
    dp_group, tp_group = optimizer.dist_group, optimizer.tp_group
    topo = Topology(collectives.group_size(dp_group), collectives.group_size(tp_group))
    ranks = collectives.grid_ranks(dp_group, tp_group)
    report = RankReport(len(optimizer.param_groups), tuple(_local_params(optimizer)))
    reports = collectives.gather_json(report.to_json(), ranks, ranks[0])

    def merge() -> dict:
        return merge_reports([RankReport.from_json(r) for r in reports], topo).to_json()

    grid = GridParams.from_json(_decide(merge, ranks, ranks[0]))
    _GRIDS[optimizer] = (structure, ranks, grid)
    return ranks, grid


def _local_params(optimizer: Any) -> Iterator[LocalParam]:
    named = _named(optimizer)
    names = param_names(optimizer)
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            meta = optimizer.dist_metas[p]
            yield LocalParam(
                name=names[index] if named else None,
                group=g,
                local_shape=tuple(meta.shape),
                tp_split_dim=meta.tp_split_dim,
                buffer=meta.buffer_idx,
                bucket=meta.bucket_idx,
                global_range=tuple(meta.global_range),
                bucket_span=tuple(optimizer.global_buffer_sizes[meta.buffer_idx][meta.bucket_idx]),
                dtype=_dtype_name(p),
            )
            index += 1


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _check_unique(names: Sequence[str]) -> None:
    seen: set[str] = set()
    dupes = sorted({n for n in names if n in seen or seen.add(n)})
    if dupes:
        raise StateDictError(f"duplicate param names {dupes}: names must be unique")


def install_hooks(
    optimizer: torch.optim.Optimizer,
    *,
    owner: Callable[[int, torch.Tensor], int],
    group: collectives.Group = None,
    all_ranks: bool = False,
) -> StateDictHooks:
    """Make ``state_dict()`` complete for an optimizer whose per-param state lives on one owner.

    After this, ``state_dict()`` (a collective over ``group``) returns on the group's first
    rank every param's state, and ``load_state_dict()`` of such a dict on any group size keeps
    on each rank only the state of the params it now owns.

    Args:
        optimizer: any torch optimizer; params are numbered in order over its groups.
        owner: ``owner(index, param) -> group rank`` holding that param's state. For
            KellerJordan's Muon: ``lambda i, p: i % world_size`` over its size-sorted params.
        group: the process group sharing the work (default: the whole world).
        all_ranks: deliver the complete state dict on every rank instead of the first.

    Example:
        >>> hooks = muonckpt.install_hooks(opt, owner=lambda i, p: i % dist.get_world_size())
        >>> sd = opt.state_dict()            # complete on rank 0
        >>> opt.load_state_dict(sd)          # on any world size: keeps this rank's share
    """

    def describe(collective: bool) -> Sharding:
        ranks = collectives.group_ranks(group)
        me = collectives.global_rank()
        names = param_names(optimizer)
        flat = [(p, g) for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]]
        params = []
        for index, ((p, g), name) in enumerate(zip(flat, names, strict=True)):
            holder = ranks[owner(index, p)]
            params.append(
                ParamSharding(name, None, (Holding(holder, None),), None, holder == me, index, g)
            )
        sharding = Sharding(params, ranks, ranks[0], {"world_size": len(ranks)}, _named(optimizer))
        if collective:
            check_agreement(sharding)
        return sharding

    return StateDictHooks(optimizer, describe, all_ranks=all_ranks)


def gather_state_dict(
    optimizer: torch.optim.Optimizer, *, all_ranks: bool = False
) -> dict[str, Any]:
    """``optimizer.state_dict()``, delivered to every rank when ``all_ranks`` (a collective)."""
    hooks = hooks_of(optimizer)
    previous, hooks.all_ranks = hooks.all_ranks, all_ranks
    try:
        return optimizer.state_dict()
    finally:
        hooks.all_ranks = previous
