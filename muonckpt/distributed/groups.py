"""Process groups: joining the default group (torchrun's environment, or the store of
:func:`muonckpt.distributed.launch.run_distributed`) and leaving it, and the dp x tp grid of
groups (:func:`grid_groups`) and of ranks (:func:`grid_ranks`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore
from torch.distributed.distributed_c10d import Store

from ..errors import CollectiveError, LayoutError
from .collectives import Group, group_ranks, is_distributed
from .group_steps import StoreSteps


def grid_ranks(dp_group: Group, tp_group: Group, operation: str = "describe the grid") -> list[int]:
    """Global ranks of the dp x tp grid, indexed ``dp_rank * tp + tp_rank``.

    A collective over the DP group (the first step of ``operation``), through the store with
    bounded waits (:class:`StoreSteps`), so that it cannot hang on a rank that never comes;
    raises :class:`CollectiveError` when the groups do not form a grid (a TP group whose size
    differs between DP ranks, say)."""
    if not is_distributed():
        return [0]
    tp_members = group_ranks(tp_group)

    def grid(rows: list[list[int]]) -> list[int]:
        if any(len(row) != len(tp_members) for row in rows):
            raise CollectiveError("the TP groups of different DP ranks differ in size")
        ranks = [rank for row in rows for rank in row]
        if len(set(ranks)) != len(ranks):
            raise CollectiveError(f"the DP and TP groups do not form a grid: ranks {ranks}")
        return ranks

    dp_members = group_ranks(dp_group)
    if len(dp_members) == 1:
        return grid([tp_members])
    steps = StoreSteps(operation, dp_members, CollectiveError)
    return steps.each_then_root("grid", lambda: tp_members, grid)


def grid_groups(dp: int, tp: int) -> tuple[Group, Group]:
    """Megatron-style (dp_group, tp_group) of this rank over the default group of dp * tp ranks.

    DP groups stride ``tp``; TP groups are consecutive ranks. A collective: every rank creates
    every group, as ``new_group`` requires.

    Raises:
        LayoutError: ``dp`` or ``tp`` not a positive int, or ``dp * tp`` not the world size
            (checked before any group is created, so every rank fails the same way).
    """
    if not is_distributed():
        raise LayoutError("grid_groups needs an initialized default process group")
    world = dist.get_world_size()
    for name, value in (("dp", dp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"grid_groups: {name} must be a positive int, got {value!r}")
    if dp * tp != world:
        raise LayoutError(
            f"grid_groups: dp={dp} x tp={tp} = {dp * tp} ranks, but the default process group "
            f"has {world}: launch dp * tp processes, or choose dp and tp whose product is {world}"
        )
    rank, dp_group, tp_group = dist.get_rank(), None, None
    for i in range(tp):
        ranks = list(range(i, dp * tp, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    for i in range(dp):
        ranks = list(range(i * tp, (i + 1) * tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    return dp_group, tp_group


@contextmanager
def default_group_from_env(timeout: timedelta) -> Iterator[None]:
    """The default process group torchrun describes in the environment, over gloo.

    Joined here (and left on exit) unless one is already initialized.
    """
    if is_distributed():
        yield
        return
    dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tcp_store(host: str, port: int, world_size: int, **options: Any) -> TCPStore:
    """``torch.distributed.TCPStore(host, port, world_size, **options)``: a rendezvous store
    (``port`` 0 with ``is_master=True`` picks a free port, then read ``.port``)."""
    return TCPStore(host, port, world_size, **options)


def host_store(world_size: int, timeout: timedelta) -> TCPStore:
    """A rendezvous store for ``world_size`` ranks, hosted by this process on a free port
    (read ``.port``) on the loopback interface."""
    return tcp_store(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout
    )


def join_default_group(
    backend: str, store: Store, rank: int, world_size: int, timeout: timedelta
) -> None:
    """Join the default process group of ``world_size`` ranks that meet at ``store``."""
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def leave_default_group() -> None:
    """Destroy the default process group (and every group made from it)."""
    dist.destroy_process_group()


_TIER_GROUPS: dict[tuple[int, ...], tuple[Any, Group]] = {}
"""Per world (its ranks), its default group and the gloo group the node-local tier's copies
travel over."""


def tier_group(timeout: timedelta) -> Group:
    """The gloo group of every rank of the default group, made for the node-local tier's
    copies between nodes the first time it is asked for (a collective then, as
    ``new_group`` is: every rank asks at the same point, in the foreground), so that a
    background save's copies never use the job's own groups."""
    ranks, world = tuple(group_ranks(None)), dist.group.WORLD
    made = _TIER_GROUPS.get(ranks)
    if made is None or made[0] is not world:  # (a default group made anew: its own)
        group = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
        made = _TIER_GROUPS[ranks] = (world, group)
    return made[1]
