"""Describers of the layouts an optimizer reports itself or that need no rule: ZeRO-1 + TP over
a dp x tp grid (:func:`describe_grid`, from each rank's report) and whole in one process
(:func:`describe_whole`). Owner rules and DDP replicas are :mod:`.owners`; which describer an
optimizer gets is :func:`muonckpt.state.placement.describe`.

The grid's param list and ranks are learned by a collective the first time and kept beside the
optimizer in weak mappings.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

import torch

from ..distributed import collectives, group_steps, groups
from ..errors import StateDictError
from ..layout.grid import GridParams, RankReport, grid_of_alike, merge_reports
from ..layout.topology import Region, Topology, whole_region
from .paramnames import HasParamGroups, is_named, param_names, torch_dtype_name
from .sharding_model import Holding, ParamSharding, Sharding, check_unique_names


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


def flat_params(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's params in order over its groups (torch's state-dict indices)."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def state_dict_steps(ranks: Sequence[int], root: int) -> group_steps.CollectiveSteps:
    """The protocol of a state-dict collective: any rank's failure a StateDictError on all."""
    return group_steps.CollectiveSteps("state dict", ranks, root, StateDictError)


def describe_grid(
    optimizer: HasParamGroups,
    report: Callable[[], RankReport],
    dp_group: collectives.Group,
    tp_group: collectives.Group,
    keys: Callable[[int], tuple[str, ...]],
) -> Sharding:
    """Sharding of a ZeRO-1 + TP optimizer over its whole dp x tp grid, from each rank's
    ``report()`` of the params it holds (in the layout math's terms, :class:`RankReport`).

    The grid's param list is learned once by a collective over the grid (:func:`learn_grid`)
    and kept beside the optimizer in a weak mapping, with the sharding made from it.
    """
    ranks, grid = _grid_params(optimizer, report, dp_group, tp_group)
    group_keys = tuple(keys(g) for g in range(grid.groups))
    cached = _SHARDINGS.get(optimizer)
    if cached is None or cached[0] is not grid or cached[1] != group_keys:
        cached = (grid, group_keys, _grid_sharding(grid, ranks, group_keys))
        _SHARDINGS[optimizer] = cached
    made = cached[2]  # the same every call: a copy of its lists for the caller
    return replace(made, params=list(made.params), participants=list(made.participants))


def _grid_sharding(
    grid: GridParams, ranks: list[int], group_keys: tuple[tuple[str, ...], ...]
) -> Sharding:
    """This rank's :class:`Sharding` of the grid (its owners from each param's place in its
    bucket, equal regions one object)."""
    topo = grid.topology
    here = ranks.index(collectives.global_rank())
    coords = topo.coords(here)
    regions: dict[Region, Region] = {}  # equal values one object: 70k params of a few shapes
    holdings: dict[tuple[int, Region], Holding] = {}
    params = []
    for gp in grid.params:
        sources = []
        for rank in gp.owner_ranks(topo):
            region = gp.owner_region(topo, *topo.coords(rank))
            if region.numel:
                region = regions.setdefault(region, region)
                sources.append(holdings.setdefault((rank, region), Holding(ranks[rank], region)))
        local_index = gp.position_on(here)
        local = None
        if local_index is not None:
            local = gp.region(topo, *coords)
            local = regions.setdefault(local, local)
        params.append(
            ParamSharding(
                name=gp.name,
                full_shape=gp.full_shape,
                sources=tuple(sources),
                local=local,
                held=local,
                local_index=local_index,
                group=gp.spec.group,
                expected_keys=group_keys[gp.spec.group],
                tp_split_dim=gp.spec.tp_split_dim,
                dtype=gp.spec.dtype,
            )
        )
    named = bool(grid.params) and grid.params[0].spec.name is not None
    return Sharding(params, ranks, ranks[0], {"dp": topo.dp, "tp": topo.tp}, named)


_GRIDS: weakref.WeakKeyDictionary[
    Any, tuple[tuple[tuple[int, ...], int], list[int], GridParams]
] = weakref.WeakKeyDictionary()
"""Per distributed optimizer: (its local structure, the grid's global ranks, its params)."""

_SHARDINGS: weakref.WeakKeyDictionary[
    Any, tuple[GridParams, tuple[tuple[str, ...], ...], Sharding]
] = weakref.WeakKeyDictionary()
"""Per distributed optimizer: (the grid, its groups' state keys, this rank's sharding of it)."""


def _grid_params(
    optimizer: HasParamGroups,
    report: Callable[[], RankReport],
    dp_group: collectives.Group,
    tp_group: collectives.Group,
) -> tuple[list[int], GridParams]:
    """The grid's global ranks and canonical params (a collective the first time: later
    descriptions, some of them on one rank alone, need none)."""
    flat = flat_params(optimizer)
    structure = (tuple(id(p) for p in flat), len(optimizer.param_groups))
    cached = _GRIDS.get(optimizer)
    if cached is not None and cached[0] == structure:
        return cached[1], cached[2]
    ranks, grid = learn_grid(optimizer, report, dp_group, tp_group)
    _GRIDS[optimizer] = (structure, ranks, grid)
    return ranks, grid


def learn_grid(
    optimizer: HasParamGroups,
    report: Callable[[], RankReport],
    dp_group: collectives.Group,
    tp_group: collectives.Group,
) -> tuple[list[int], GridParams]:
    """The grid's global ranks (:func:`grid_members`) and canonical params, from every rank's
    ``report()``: a collective over the grid, which fails on every rank when they disagree.
    The ranks first compare digests of their reports (step ``params``); where all are alike
    (the packaged sharding), each builds the grid from its own
    (:func:`~muonckpt.layout.grid.grid_of_alike`), else the root merges every rank's report
    (step ``params of each rank``)."""
    topo = Topology(collectives.group_size(dp_group), collectives.group_size(tp_group))
    ranks = grid_members(optimizer, dp_group, tp_group)
    steps = state_dict_steps(ranks, ranks[0])
    mine: list[RankReport] = []

    def digest() -> str:
        mine.append(report())
        return hashlib.sha256(json.dumps(mine[0].to_json()).encode()).hexdigest()

    if steps.each_then_root("params", digest, lambda digests: len(set(digests)) == 1):
        return ranks, grid_of_alike(mine[0], topo)

    def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
        return merge_reports([RankReport.from_json(r) for r in reports], topo).to_json()

    merged = steps.each_then_root("params of each rank", lambda: mine[0].to_json(), merge)
    return ranks, GridParams.from_json(merged)


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


def describe_whole(
    optimizer: HasParamGroups,
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
    check_unique_names([p.name for p in params])
    return Sharding(params, [me], me, {"dp": 1, "tp": 1}, is_named(optimizer) or names is not None)
