"""Hooks that make a sharded optimizer's ``state_dict()`` complete and resumable anywhere.

A sharded optimizer keeps each param's state on the ranks that own it: pieces of a flat ZeRO-1
buffer in the packaged :class:`~muonckpt.optim.muon.Muon`, whole tensors on one owner rank in
KellerJordan-style Muon. The hooks here, attached through torch's optimizer hook API, turn that
into torch's ordinary state-dict format with every param's full-shape state:

* ``state_dict()`` (a collective over every rank that holds state) learns the complete list of
  params from the whole grid (a rank may leave out a param it owns no element of), then streams
  each param's pieces to the destination rank, which assembles full tensors one at a time in
  host memory (CPU tensors, whatever device the state lives on).
  Other ranks return a stub marked incomplete, so loading one by mistake fails loudly instead
  of silently restarting momentum at zero.
* ``load_state_dict(sd)`` matches params by name, validates names, keys and shapes, and keeps
  only this rank's share under the current topology. For a distributed packaged Muon the first
  call that needs the grid's param list (``state_dict``, ``load_state_dict``, ``save`` or
  ``load``) is a collective over the grid; the list is kept for later calls.

Memory: the destination holds the complete state in host memory plus one piece in flight on the
device of the process group (:func:`muonckpt.distributed.collectives.comm_device`); every other
rank its own share plus one piece (or one full param when delivering to all ranks).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..distributed import collectives, group_steps
from ..errors import StateDictError
from ..format.renames import names_hint
from ..layout.state_shapes import StateShape, local_shape, shape_rule, state_region
from .describers import flat_params
from .gather import gather_full_state
from .owners import declare_owners
from .placement import Optimizers, describe, participants
from .regions import extract
from .sharding_model import ParamSharding, Sharding
from .values import TensorValue, param_states, state_value

MARKER = "muonckpt"
"""Top-level key that tags state dicts produced by these hooks."""
STATE_DICT_VERSION = 1
"""The version of the state-dict marker under :data:`MARKER` (not the checkpoint format's,
:data:`muonckpt.format.manifest.FORMAT_VERSION`)."""
LOCAL_SHARE = "muonckpt local share"
"""Key of a state dict already cut to this rank's share (:func:`load_local_share`): the trim
passes it through."""


class StateDictHooks:
    """The four hooks on one optimizer, over the layout :func:`muonckpt.state.placement.describe`
    gives: ``state_dict()`` gathers (to every rank with ``all_ranks``), ``load_state_dict()``
    trims to this rank's share and checks what it loaded. Holds no state between calls."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, all_ranks: bool = False) -> None:
        self.all_ranks = all_ranks
        self._handles = [
            optimizer.register_state_dict_pre_hook(self._rendezvous),
            optimizer.register_state_dict_post_hook(self._gather),
            optimizer.register_load_state_dict_pre_hook(_trim),
            optimizer.register_load_state_dict_post_hook(_check_loaded),
        ]
        _HOOKS[optimizer] = self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _rendezvous(self, optimizer: torch.optim.Optimizer) -> None:
        _rendezvous(optimizer, self.all_ranks)

    def _gather(self, optimizer: torch.optim.Optimizer, _: dict[str, Any]) -> dict[str, Any]:
        return _complete_state_dict(optimizer, self.all_ranks)


def _rendezvous(optimizer: torch.optim.Optimizer, all_ranks: bool) -> None:
    """The first step of a gather: every rank of the optimizer calls, asking the same."""
    operation = "state_dict()"
    ranks = participants(optimizer, operation)
    group_steps.rendezvous(operation, ranks, {"all_ranks": all_ranks}, StateDictError)


def _complete_state_dict(optimizer: torch.optim.Optimizer, all_ranks: bool) -> dict[str, Any]:
    """The optimizer's complete state dict, on the destination (every rank with ``all_ranks``);
    a stub marked incomplete elsewhere. A collective over its ranks."""
    sharding = describe(optimizer)
    flat = flat_params(optimizer)
    local_state = {i: optimizer.state[p] for i, p in enumerate(flat) if p in optimizer.state}
    shapes = [tuple(p.shape) for p in flat]
    full = gather_full_state(
        sharding, lambda: param_states(sharding, local_state, shapes), all_ranks
    )
    receives = full is not None
    marker = {
        "complete": receives,
        "format_version": STATE_DICT_VERSION,
        "source_topology": dict(sharding.topology),
        "source_rank": collectives.global_rank(),
    }
    return {
        "state": {
            index: {key: value.as_state() for key, value in gathered.state.items()}
            for index, gathered in (full or {}).items()
        },
        "param_groups": canonical_groups(optimizer.param_groups, sharding),
        MARKER: marker,
    }


def _trim(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    if state_dict.get(LOCAL_SHARE):
        return {k: v for k, v in state_dict.items() if k != LOCAL_SHARE}
    return trim_state_dict(optimizer, state_dict, describe(optimizer, agree=False))


def _check_loaded(optimizer: torch.optim.Optimizer) -> None:
    """After loading, every region-sharded state tensor must be exactly this rank's share."""
    flat = flat_params(optimizer)
    for param in describe(optimizer, agree=False).local():
        if param.local is None:
            continue
        for key, value in optimizer.state.get(flat[param.index_here], {}).items():
            kept = state_value(param, key, value)
            if not isinstance(kept, TensorValue):
                continue
            share = state_region(kept.stored, param.full_shape, param.local)
            if share is None or value.numel() != share.numel:
                raise StateDictError(
                    f"param {param.name!r}: loaded state {key!r} has {value.numel()} "
                    f"elements, this rank's share is {share.numel if share else 'none'}"
                )


def load_local_share(optimizer: torch.optim.Optimizer, share: Mapping[str, Any]) -> None:
    """Load a state dict already cut to this rank's share, in its own param indices (as
    :func:`muonckpt.load` builds it): torch's ``load_state_dict`` without the trim (for an
    optimizer with these hooks; any other takes it as it is), the loaded share still checked."""
    optimizer.load_state_dict({**share, LOCAL_SHARE: True})


_HOOKS: weakref.WeakKeyDictionary[torch.optim.Optimizer, StateDictHooks] = (
    weakref.WeakKeyDictionary()
)
"""Each hooked optimizer's hooks, kept beside it rather than as an attribute on it."""


def hooks_of(optimizer: torch.optim.Optimizer) -> StateDictHooks:
    """The muonckpt hooks of ``optimizer``; :class:`StateDictError` if it has none."""
    hooks = _HOOKS.get(optimizer)
    if hooks is None:
        raise StateDictError(
            "optimizer has no muonckpt hooks: use muonckpt.optim.muon.Muon or install_hooks"
        )
    return hooks


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
    flat = flat_params(optimizer)
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
    optimizer: Optimizers, saved_groups: Sequence[Mapping[str, Any]], sharding: Sharding
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
    if param.local is None:
        return None
    kept: dict[str, Any] = {}
    for key, value in entry.items():
        full = param.full_shape
        if not isinstance(value, torch.Tensor) or (value.dim() == 0 and len(full) != 0):
            kept[key] = value  # a number, or a scalar such as AdamW's step
            continue
        shape = tuple(value.shape)
        stored = None if shape == full else StateShape(shape_rule(full, shape), shape)
        region = state_region(stored, full, param.local)
        if region is None or (stored is not None and key in param.expected_keys):
            raise StateDictError(
                f"param {param.name!r}: state {key!r} has shape {shape}, expected the full "
                f"shape {full}"
                + (f" (or {stored.rule} state this rank's share would not cut)" if stored else "")
            )
        piece = extract(value, region)
        if stored is not None:
            kept[key] = piece.reshape(local_shape(stored, full, param.local, p.shape))
        else:
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
    hint = names_hint(saved, current)
    raise StateDictError(
        "param names differ between the state dict and the optimizer: "
        f"only in the state dict {only_saved}, only in the optimizer {only_current}"
        + (f": {hint}" if hint else "")
    )


def install_hooks(
    optimizer: torch.optim.Optimizer,
    owner: Callable[[int, torch.Tensor], Any] | None = None,
    *,
    names: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
    group: collectives.Group = None,
    tp_group: collectives.Group = None,
    tp_split_dims: Mapping[str, int] | None = None,
    all_ranks: bool = False,
) -> StateDictHooks:
    """Make ``state_dict()``, :func:`muonckpt.save` and :func:`muonckpt.load` complete for an
    optimizer whose per-param state lives whole on an owner rank.

    After this, ``state_dict()`` (a collective over the ranks) returns on the first rank every
    param's state, and ``load_state_dict()`` of such a dict on any number of ranks keeps on each
    rank only the state of the params it now owns (and all of the replicated state).

    Args:
        optimizer: any torch optimizer; every rank holds every param (its TP shard of it with
            ``tp_group``).
        owner: ``owner(index, param)``: the rank of ``group`` that keeps the state of param
            ``index`` (counted in order over all param groups), or :data:`muonckpt.REPLICATED`
            when every rank keeps it identically. None: the rule of upstream KellerJordan
            ``muon.Muon``, ``muon.MuonWithAuxAdam`` and their single-device classes (see
            :func:`muonckpt.state.owners.upstream_owner`); other optimizers need an explicit
            rule.
        names: ``model.named_parameters()`` or a ``{name: param}`` dict, so that checkpoints are
            keyed by name when the optimizer's groups carry no names.
        group: the ranks sharing the work, the DP group with ``tp_group`` (default: the world).
        tp_group: for a tensor-parallel optimizer whose params are TP shards, each owned whole
            by one rank of ``group`` (Megatron-Core's layer-wise layout); full shapes and
            regions follow ``tp_split_dims``.
        tp_split_dims: param name -> dimension split across ``tp_group`` (missing: replicated).
        all_ranks: deliver the complete state dict on every rank instead of the first.

    Raises:
        StateDictError: for an optimizer without a known rule and no ``owner``, or unknown
            names. A rule that does not match where the optimizer keeps its state raises when
            the state is gathered, naming the param, the declared owner and the holder.

    Example:
        >>> hooks = muonckpt.install_hooks(opt)  # upstream muon.MuonWithAuxAdam
        >>> sd = opt.state_dict()            # complete on rank 0
        >>> opt.load_state_dict(sd)          # on any world size: keeps this rank's share
    """
    declare_owners(
        optimizer, owner, names=names, group=group, tp_group=tp_group, tp_split_dims=tp_split_dims
    )
    return StateDictHooks(optimizer, all_ranks=all_ranks)


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
