"""Owner rules: an optimizer whose state lives whole on owner ranks (or on every rank alike,
:data:`~muonckpt.state.sharding_model.REPLICATED`), recorded beside it by :func:`declare_owners`
(:func:`muonckpt.install_hooks`), upstream KellerJordan Muon's rule (:func:`upstream_owner`),
and the DDP replica (:func:`describe_replicated`), described as every param replicated.

Describing by an owner rule is a collective every time: the ranks check they agree.
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed import collectives
from ..errors import StateDictError
from ..layout.topology import Region, Topology, tp_full_shape, tp_region
from ..layout.workplan import spread
from .describers import describe_whole, flat_params, grid_members, state_dict_steps
from .paramnames import is_named, param_names, torch_dtype_name
from .sharding_model import REPLICATED, Holding, ParamSharding, Sharding, check_unique_names


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
    :func:`muonckpt.install_hooks`, which documents them), so that
    :func:`~muonckpt.state.placement.describe` and :func:`~muonckpt.state.placement.participants`
    follow it; the rule recorded."""
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


def owner_rule(optimizer: object) -> OwnerRule | None:
    """The owner rule recorded for ``optimizer`` (:func:`declare_owners`); None: none."""
    return _OWNERS.get(optimizer) if optimizer in _OWNERS else None


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

        def region(
            t: int, full: tuple[int, ...] = full, split: int = split, block: int = block
        ) -> Region:
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
    check_unique_names([p.name for p in params])
    sharding = Sharding(
        params, ranks, ranks[0], {"dp": topo.dp, "tp": topo.tp}, is_named(optimizer) or bool(names)
    )
    if collective:
        check_agreement(sharding, owners)
    return sharding
