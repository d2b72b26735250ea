"""Hooks that make a sharded optimizer's ``state_dict()`` complete and resumable anywhere.

A sharded optimizer keeps each param's state on the ranks that own it: pieces of a flat ZeRO-1
buffer in the packaged :class:`~muonckpt.Muon`, whole tensors on one owner rank in
KellerJordan-style Muon. The hooks here, attached through torch's optimizer hook API, turn that
into torch's ordinary state-dict format with every param's full-shape state:

* ``state_dict()`` (a collective over every rank that holds state) checks that all ranks agree
  on the params, then streams each param's pieces to the destination rank, which assembles
  full tensors one at a time. Other ranks return a stub marked incomplete, so loading one by
  mistake fails loudly instead of silently restarting momentum at zero.
* ``load_state_dict(sd)`` (local, no collectives) matches params by name, validates names, keys
  and shapes, and keeps only this rank's share under the current topology.

Memory: the destination holds the complete state plus one piece in flight; every other rank its
own share plus one piece (or one full param when delivering to all ranks).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import collectives
from .errors import StateDictError
from .layout import Region, Topology, dp_slice, tp_full_shape, tp_region, whole_region
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
    """How one param's state is spread over ranks."""

    name: str
    full_shape: tuple[int, ...] | None
    """Shape of every full state tensor; None when whole tensors keep the owner's shapes."""
    sources: tuple[Holding, ...]
    """Owners that together hold every element exactly once (what the gather reads)."""
    local: Region | None
    """This rank's share when loading: a region, the whole state (owner), or nothing."""
    keeps: bool
    """Whether this rank keeps any state of the param when loading."""
    expected_keys: tuple[str, ...] = ()
    """State keys a complete entry must have (empty: whatever the source had)."""


@dataclass
class Sharding:
    """Everything the hooks need to know about one optimizer's sharding, for one call."""

    params: list[ParamSharding]
    participants: list[int]
    """Global ranks taking part in the gather."""
    destination: int
    """Global rank that receives the complete state dict."""
    topology: dict[str, int] = field(default_factory=dict)


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
            optimizer.register_state_dict_pre_hook(self._check_agreement),
            optimizer.register_state_dict_post_hook(self._gather),
            optimizer.register_load_state_dict_pre_hook(self._trim),
            optimizer.register_load_state_dict_post_hook(self._check_loaded),
        ]
        self._sharding: Sharding | None = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _check_agreement(self, optimizer: torch.optim.Optimizer) -> None:
        self._sharding = self.describe(True)
        check_agreement(self._sharding)

    def _gather(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        sharding = self._sharding or self.describe(True)
        self._sharding = None
        me = collectives.global_rank()
        local_state = state_dict["state"]
        entries = _gather_entry_metadata(sharding, local_state)
        full_state: dict[int, dict[str, Any]] = {}
        receives = me == sharding.destination or self.all_ranks
        for index, param in enumerate(sharding.params):
            spec = entries[index]
            if spec is None:
                continue
            full_state[index] = {}
            for key, info in spec.items():
                value = _gather_value(
                    param, index, key, info, local_state, sharding, self.all_ranks
                )
                if receives:
                    full_state[index][key] = value
        marker = {
            "complete": receives,
            "format_version": FORMAT_VERSION,
            "source_topology": dict(sharding.topology),
            "source_rank": me,
        }
        return {
            "state": full_state if receives else {},
            "param_groups": state_dict["param_groups"],
            MARKER: marker,
        }

    def _trim(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        return trim_state_dict(optimizer, state_dict, self.describe(False))

    def _check_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After loading, every region-sharded state tensor must be exactly this rank's share."""
        sharding = self.describe(False)
        flat = [p for g in optimizer.param_groups for p in g["params"]]
        for p, param in zip(flat, sharding.params, strict=True):
            if param.local is None:
                continue
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.numel() != param.local.numel:
                    raise StateDictError(
                        f"param {param.name!r}: loaded state {key!r} has {value.numel()} "
                        f"elements, this rank's share is {param.local.numel}"
                    )


def check_agreement(sharding: Sharding) -> None:
    """Raise :class:`StateDictError` on every rank unless all agree on names and full shapes.

    A collective over ``sharding.participants``, run before any state moves, so a mismatch is
    an error instead of a hang or a scrambled gather.
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


def _gather_entry_metadata(
    sharding: Sharding, local_state: Mapping[int, Mapping[str, Any]]
) -> list[dict[str, Any] | None]:
    """Every rank learns, per param, the state keys with their dtype and shape (or value)."""
    mine: dict[str, dict[str, Any]] = {}
    me = collectives.global_rank()
    for index, param in enumerate(sharding.params):
        if any(h.rank == me for h in param.sources) and index in local_state:
            mine[str(index)] = {
                key: _describe_value(value) for key, value in local_state[index].items()
            }
    reports = collectives.gather_json(mine, sharding.participants, sharding.destination)
    merged: Any = None
    if reports is not None:
        try:
            merged = _merge_entry_reports(sharding, reports)
        except StateDictError as exc:
            merged = {"error": str(exc)}
    merged = collectives.broadcast_json(merged, sharding.participants, sharding.destination)
    if isinstance(merged, dict):
        raise StateDictError(merged["error"])
    return merged


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
    index: int,
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
            piece = local_state[index][key].reshape(-1)
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
    Raises :class:`StateDictError` naming the param on any mismatch. A dict that
    :func:`muonckpt.load` already cut to this rank's share passes through unchanged.
    """
    marker = state_dict.get(MARKER)
    if isinstance(marker, Mapping) and marker.get("local_share"):
        return dict(state_dict)
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
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    new_state: dict[int, dict[str, Any]] = {}
    for index, (p, param) in enumerate(zip(flat, sharding.params, strict=True)):
        entry = by_name[param.name]
        if not entry:
            if any_state and param.expected_keys:
                raise StateDictError(f"state dict has no state for param {param.name!r}")
            continue
        kept = _cut_entry(param, entry, p)
        if kept is not None:
            new_state[index] = kept
    return {"state": new_state, "param_groups": new_groups}


def remap_groups(
    optimizer: torch.optim.Optimizer, saved_groups: Sequence[Mapping[str, Any]], sharding: Sharding
) -> list[dict[str, Any]]:
    """Saved groups' settings (step included) laid over ``optimizer``'s groups, matched by name.

    Each current group must hold exactly the params of the saved group at the same position.
    """
    current_names = [p.name for p in sharding.params]
    _check_names([n for g in saved_groups for n in _group_names(g)], current_names)
    if len(saved_groups) != len(optimizer.param_groups):
        raise StateDictError(
            f"state dict has {len(saved_groups)} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    new_groups, index = [], 0
    for group_index, (group, saved) in enumerate(
        zip(optimizer.param_groups, saved_groups, strict=True)
    ):
        names = current_names[index : index + len(group["params"])]
        if sorted(names) != sorted(_group_names(saved)):
            raise StateDictError(
                f"param group {group_index} holds {names}, the state dict's group "
                f"{group_index} holds {_group_names(saved)}"
            )
        settings = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        for key, value in settings.items():
            if isinstance(group.get(key), tuple) and isinstance(value, list):
                settings[key] = tuple(value)
        settings["params"] = list(range(index, index + len(names)))
        if "param_names" in group:
            settings["param_names"] = list(names)
        new_groups.append(settings)
        index += len(names)
    return new_groups


def _cut_entry(
    param: ParamSharding, entry: Mapping[str, Any], p: torch.Tensor
) -> dict[str, Any] | None:
    missing = [k for k in param.expected_keys if k not in entry]
    if missing:
        raise StateDictError(f"param {param.name!r}: state dict lacks state key(s) {missing}")
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


def attach_muon_hooks(optimizer: Any) -> StateDictHooks:
    """Attach the hooks to a packaged :class:`~muonckpt.Muon` (done by its constructor)."""
    hooks = StateDictHooks(optimizer, lambda collective: describe_muon(optimizer, collective))
    optimizer.state_dict_hooks = hooks
    return hooks


def describe_muon(optimizer: Any, collective: bool) -> Sharding:
    """Sharding of a packaged Muon; ``collective`` allows learning the grid's global ranks."""
    from .optim import ADAMW_STATE_KEYS, MUON_STATE_KEYS

    names = param_names(optimizer)
    me = collectives.global_rank()
    params: list[ParamSharding] = []
    flat = [(p, g) for g in optimizer.param_groups for p in g["params"]]
    if not optimizer.distributed_mode:
        for (p, group), name in zip(flat, names, strict=True):
            whole = whole_region(p.numel())
            keys = MUON_STATE_KEYS if group.get("use_muon", False) else ADAMW_STATE_KEYS
            params.append(
                ParamSharding(name, tuple(p.shape), (Holding(me, whole),), whole, True, keys)
            )
        return Sharding(params, [me], me, {"dp": 1, "tp": 1})
    dp_group, tp_group = optimizer.dist_group, optimizer.tp_group
    topo = Topology(collectives.group_size(dp_group), collectives.group_size(tp_group))
    dp_rank, tp_rank = collectives.group_rank(dp_group), collectives.group_rank(tp_group)
    grid = _grid(optimizer) if collective else []
    for (p, group), name in zip(flat, names, strict=True):
        meta = optimizer.dist_metas[p]
        size, offset = optimizer.global_buffer_sizes[meta.buffer_idx][meta.bucket_idx]
        split = meta.tp_split_dim if topo.tp > 1 else -1
        full = tp_full_shape(meta.shape, split, topo.tp)

        def region(
            d: int,
            t: int,
            meta: Any = meta,
            full: tuple = full,
            split: int = split,
            size: int = size,
            offset: int = offset,
        ) -> Region:
            return tp_region(
                full, split, topo.tp, t, dp_slice(meta.global_range, offset, size, topo.dp, d)
            )

        sources = tuple(
            Holding(grid[topo.rank(d, t)], region(d, t))
            for d in range(topo.dp)
            for t in range(topo.tp if split >= 0 else 1)
            if grid and region(d, t).numel
        )
        keys = MUON_STATE_KEYS if group.get("use_muon", False) else ADAMW_STATE_KEYS
        params.append(ParamSharding(name, full, sources, region(dp_rank, tp_rank), True, keys))
    destination = grid[0] if grid else me
    return Sharding(params, grid or [me], destination, {"dp": topo.dp, "tp": topo.tp})


def _grid(optimizer: Any) -> list[int]:
    grid = getattr(optimizer, "_muonckpt_grid", None)
    if grid is None:
        grid = collectives.grid_ranks(optimizer.dist_group, optimizer.tp_group)
        optimizer._muonckpt_grid = grid
    return grid


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
        flat = [p for g in optimizer.param_groups for p in g["params"]]
        params = []
        for index, (p, name) in enumerate(zip(flat, names, strict=True)):
            holder = ranks[owner(index, p)]
            params.append(ParamSharding(name, None, (Holding(holder, None),), None, holder == me))
        return Sharding(params, ranks, ranks[0], {"world_size": len(ranks)})

    hooks = StateDictHooks(optimizer, describe, all_ranks=all_ranks)
    optimizer.state_dict_hooks = hooks  # type: ignore[attr-defined]
    return hooks


def gather_state_dict(
    optimizer: torch.optim.Optimizer, *, all_ranks: bool = False
) -> dict[str, Any]:
    """``optimizer.state_dict()``, delivered to every rank when ``all_ranks`` (a collective)."""
    hooks = _hooks_of(optimizer)
    previous, hooks.all_ranks = hooks.all_ranks, all_ranks
    try:
        return optimizer.state_dict()
    finally:
        hooks.all_ranks = previous


def _hooks_of(optimizer: torch.optim.Optimizer) -> StateDictHooks:
    hooks = getattr(optimizer, "state_dict_hooks", None)
    if hooks is None:
        raise StateDictError("optimizer has no muonckpt hooks: use muonckpt.Muon or install_hooks")
    return hooks
