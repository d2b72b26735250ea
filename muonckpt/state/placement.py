"""Where every param's state lives: :func:`describe` picks an optimizer's describer and returns
its :class:`~muonckpt.state.sharding_model.Sharding`, the layout model every path reads.

A :class:`~muonckpt.state.sharding_model.Sharding` says, for one optimizer over the ranks it
spans, each param's full shape, the regions its sources hold (what a gather and a per-rank save
read) and the region this rank keeps (what a load and ``load_state_dict`` fill). Save, load, the
gather and the trim read only that, so a new layout is one new describer, not a new save path.

:func:`describe` is a function of the optimizer that returns its ``Sharding``:

* the packaged :class:`~muonckpt.optim.muon.Muon` reports its own layout
  (:class:`~muonckpt.state.describers.ReportsItsGrid`): :func:`~.describers.describe_grid` over
  its dp x tp grid, :func:`~.describers.describe_whole` in one process;
* an optimizer whose state lives whole on owner ranks is described by the owner rule
  :func:`~.owners.declare_owners` recorded beside it (:func:`muonckpt.install_hooks` records
  it; the upstream KellerJordan rule is :func:`~.owners.upstream_owner`);
* any other optimizer is whole in one process (:func:`~.describers.describe_whole`) or a
  replica on every rank of a process group (:func:`~.owners.describe_replicated`, DDP), unless
  the call says it is this process's own (``local=True``: whole, here alone, whatever process
  group there is);
* several optimizers trained together are one :class:`Joined`.

Describing a distributed optimizer is a collective over its ranks the first time (the grid's
param list is learned from every rank's report) or every time (owner rules: the ranks check
they agree); :func:`participants` gives those ranks without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..distributed import collectives
from ..errors import ArgumentError, StateDictError
from ..storage import unstorable_kind
from .describers import ReportsItsGrid, describe_grid, describe_whole, grid_members
from .owners import describe_replicated, owner_rule
from .paramnames import param_names
from .sharding_model import Sharding


def describe(
    optimizer: torch.optim.Optimizer | Joined, *, agree: bool = True, local: bool = False
) -> Sharding:
    """How ``optimizer``'s state is sharded: as it reports it (the packaged Muon), by the owner
    rule recorded for it (:func:`~.owners.declare_owners`), else every param whole and local in
    a single process or with ``local`` (this process's own, :func:`check_local`), a replica on
    every rank in a process group.

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
    if not isinstance(optimizer, Joined) and (rule := owner_rule(optimizer)) is not None:
        return rule.describe(optimizer, agree)
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


class Joined:
    """Several optimizers that together train one model (``torch.optim.Muon`` for the matrices
    and ``AdamW`` for the rest), seen as one by save and load: their groups in order, their
    state together. Across ranks only as replicas (DDP): a sharded optimizer goes alone
    (``local``: this process's own optimizers, which :func:`check_local` checks instead)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], *, local: bool = False) -> None:
        if not optimizers:
            raise ArgumentError("no optimizer to save", argument="optimizer")
        sharded = [type(o).__name__ for o in optimizers if has_own_layout(o)]
        if sharded and not local and _in_process_group():
            raise ArgumentError(
                f"a list of optimizers goes into one checkpoint across ranks only as replicas "
                f"(DDP: no muonckpt hooks), and {sharded} shard their state: save a sharded "
                "optimizer on its own",
                argument="optimizer",
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
    return isinstance(optimizer, ReportsItsGrid) or owner_rule(optimizer) is not None


def participants(optimizer: Any, operation: str, *, local: bool = False) -> list[int]:
    """The global ranks of ``operation`` (``save``, ``load``, ...) over ``optimizer``, found
    without a collective on the process groups, so that the operation can begin with a
    bounded rendezvous among them (:func:`muonckpt.distributed.group_steps.rendezvous`): its grid
    for a optimizer that reports its grid or has an owner rule, the world for any other in a process
    group (:func:`describe`); with ``local``, this process alone (:func:`check_local`)."""
    if not isinstance(local, bool):
        raise ArgumentError(
            f"{operation}: local must be True or False, got {local!r}", argument="local"
        )
    if local:
        check_local(optimizer, operation)
        return [collectives.global_rank()]
    if isinstance(optimizer, ReportsItsGrid):
        if not optimizer.distributed_mode:
            return [collectives.global_rank()]
        return grid_members(optimizer, optimizer.dist_group, optimizer.tp_group, operation)
    rule = owner_rule(optimizer)
    if rule is not None:
        return rule.ranks(optimizer, operation)
    return collectives.group_ranks(None)


def check_local(optimizer: Optimizers, operation: str) -> None:
    """``local=True`` names an optimizer of this process alone: one that keeps state on other
    ranks (a distributed packaged Muon, an owner rule over a group of several ranks) is refused,
    told without a collective."""
    spread = [type(o).__name__ for o in optimizers_of(optimizer) if _spans_ranks(o)]
    if spread:
        raise ArgumentError(
            f"{operation}(..., local=True) is for an optimizer of this process alone, and "
            f"{spread} keep their state across ranks: {operation} it without local=True, on "
            "every rank of its grid",
            argument="local",
        )


def _spans_ranks(optimizer: object) -> bool:
    """Whether ``optimizer`` keeps state on ranks other than this one (its grid or its owner
    rule's group has several), told from its groups' sizes."""
    if isinstance(optimizer, ReportsItsGrid):
        grid = collectives.group_size(optimizer.dist_group) * collectives.group_size(
            optimizer.tp_group
        )
        return optimizer.distributed_mode and grid > 1
    rule = owner_rule(optimizer)
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
