"""Load a checkpoint into an optimizer at its own topology: open -> map -> read -> apply.

:func:`load` calls the steps in turn, each a call that returns data: the rendezvous and the
layout (``_agree``); every rank opens the checkpoint (``_open``) and agrees with the others that
it is one (the ``open`` step); it plans how the checkpoint's state maps onto the target
(``_map``: the same optimizer, or another implementation by
:mod:`muonckpt.format.conversion`'s rules), reads and checks only the byte ranges of its own
share and hands it to the optimizers (torch's ``load_state_dict``, the trim passed by) and the
stateful values of ``extra`` / ``rank_extra`` to theirs, each of which may refuse
(``_read_and_take``); the ``read`` step then finds whether every rank did; only then are the loaded
values copied into the tensors kept and the params (``_apply``). A rank's refusal before a step
travels as data (:class:`~muonckpt.files.attempt.Attempt`) and fails that step on every
rank.

Every rank reads the manifest and then only the bytes of the pieces overlapping its own share,
verifying their checksums, and holds it until every rank has read (small tensors packed
together: a tensor object each would cost more than their bytes). State the optimizer already
has, of the dtype, device and shape torch would give the loaded value, keeps its tensors: the
checkpoint's values are copied into them, so a rollback inside a running job holds no second
copy of the state. New small state tensors (a fresh optimizer's) view the shared blocks they
were read into: ``torch.save`` of one of them alone writes its whole block. In distributed
mode a load is a collective over the grid (for optimizers without hooks in a process group,
DDP replicas, the world: every rank reads the whole state): a bounded rendezvous where the
ranks agree on the call and its arguments, then they agree that they opened one checkpoint (its
resolved directory and manifest) and that every share was read and taken; any rank's failure
is every rank's.

All or nothing: a load that fails (damage, a mismatch, a stateful value or an optimizer whose
``load_state_dict`` refuses, on any rank) leaves the optimizers, the params and the model, and
every value of ``extra`` / ``rank_extra`` as they were. Stateful values are handed their saved
state first (their previous ``state_dict()`` copied to put them back), then the optimizers
theirs (the state and groups they had kept aside); nothing is written into a tensor, a param or
a plain value until every rank has taken its share. (A stateful value that then refuses its own
previous state too is the one thing a failed load can leave changed, named in its error.)
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import events, storage
from ..distributed import collectives, group_steps
from ..distributed.steps import disagreement
from ..errors import CheckpointError, ConversionWarning, EnvironmentWarning
from ..files import job_tree
from ..files.attempt import Attempt
from ..files.pieces import PieceReader, load_pieces, open_checkpoint
from ..files.progress import Progress
from ..format import conversion, kinds
from ..format.manifest import Manifest, environment_differences, json_safe
from ..format.names import MANIFEST_NAME
from ..format.renames import Rename, names_hint
from ..optim.sharding import ShardedParams, following
from ..state import trainstate
from ..state.describers import flat_params
from ..state.hooks import remap_groups
from ..state.placement import (
    Joined,
    Optimizers,
    describe,
    optimizers_of,
    participants,
    replica_hint,
)
from ..state.sharding_model import Sharding
from ..storage.places import target as target_text
from . import _checking, _reading, _save_manifest
from ._model_copies import Model, ModelCopies
from ._taking import Taken, Target, put_back


@dataclass
class LoadReport:
    """What :func:`load` did beyond copying bytes (also logged, and warned for settings)."""

    converted: list[str] = field(default_factory=list)
    """Momentum converted between forms, per group: which params, from which form, by what."""
    warnings: list[str] = field(default_factory=list)
    """Target settings that cannot continue the saved trajectory, and what would."""
    environment: list[str] = field(default_factory=list)
    """What differs from the environment the save ran in, ``key saved -> now``
    (:data:`muonckpt.format.manifest.ENVIRONMENT_KEYS`; warned as an
    :class:`~muonckpt.errors.EnvironmentWarning`): empty where a resume can be bitwise."""


def load(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    params: bool = True,
    momentum_form: str | None = None,
    rename: Rename | None = None,
    extra: MutableMapping[str, Any] | None = None,
    rank_extra: MutableMapping[str, Any] | None = None,
    local: bool = False,
    progress: Progress | None = None,
    check: bool = True,
    model: Model | None = None,
) -> LoadReport:
    """Load a checkpoint of any kind and source topology into ``optimizer`` at its topology.

    Restores the optimizer state and, by default, the optimizer's params (each rank its own
    share, bitwise): a resumed run needs nothing but the checkpoint. A model whose weights are
    not the optimizer's params (the packaged Muon's shards from
    :func:`muonckpt.optim.sharding.shard_for_groups`) gets them back too: ``load`` then calls
    :meth:`muonckpt.optim.sharding.ShardedParams.params_to_model` itself, on every rank.

    The target may be another Muon implementation than the one that saved, or several
    optimizers that together hold every param (``[torch.optim.Muon(...),
    torch.optim.AdamW(...)]`` for a packaged Muon + AdamW checkpoint). Momentum is then
    converted between sum and EMA form by ``1 - mu`` (:mod:`muonckpt.format.kinds`), AdamW
    state and step counts are mapped as each optimizer keeps them, the target keeps its own
    settings, and settings that cannot continue the saved trajectory are warned about.

    Every rank reads only the bytes of its own share, verified. In distributed mode a
    collective over the grid, which any rank's failure fails on every rank. All or nothing: a
    load that fails leaves the optimizers, the params, the model and every value of ``extra``
    / ``rank_extra`` as they were (how: :mod:`muonckpt.checkpoint.loading`).

    Args:
        optimizer: an optimizer :func:`muonckpt.save` takes, at any topology, or a list of them.
        path: a checkpoint directory, or an ``s3://bucket/prefix`` URL (its manifest read by
            one GET, each rank's byte ranges by ranged GETs; never a LIST).
        params: restore the params too (the default; the checkpoint must hold them). False
            restores the optimizer state only, for weights loaded elsewhere.
        momentum_form: ``"sum"`` or ``"ema"``: the momentum form of a target whose form
            muonckpt does not know (required then), or an override for one it knows.
        rename: the checkpoint's param names as the optimizer has them: prefix replacements
            (``{"module.": ""}`` strips DDP's prefix, ``{"_orig_mod.": ""}`` torch.compile's,
            ``{"": "model."}`` adds one; the longest matching prefix applies) or a function of
            the saved name. Names that differ by a prefix only are refused naming the prefix
            and this fix.
        extra: a dict to fill with the ``extra`` saved with the checkpoint, in place: a
            stateful value in it (an LR scheduler) gets ``load_state_dict`` of its saved
            state, a dict is filled key by key, anything else is replaced, and keys only the
            checkpoint has are added. Every key it holds must be in the checkpoint; an empty
            dict stays empty when the checkpoint holds no extra.
        rank_extra: the same for this rank's ``rank_extra``: the values the rank of the same
            place in the grid saved. Only at the number of ranks that saved (per-rank values
            such as RNG states or data positions do not carry over to another; load without
            it there and derive them afresh, from ``extra``).
        local: the optimizer is this process's alone, not a DDP replica: loaded by this process
            alone, whatever process group is initialized (as :func:`muonckpt.save`'s
            ``local``). Without it an optimizer without hooks in a process group is a replica,
            and every rank of the world must call ``load``.
        progress: a :data:`muonckpt.offline.Progress` callback, called with this rank's bytes
            and tensors read and their totals as its share is read
            (:class:`muonckpt.ProgressLines` prints them as lines for a log).
        check: prove what the load restored (the default): each rank digests what it hands
            the optimizers, after any reshard and conversion, and after the load what the
            optimizers, the params and the models that follow them hold; state an optimizer
            dropped, a value that differs or a model weight not synced to its param fails the
            load on every rank (:class:`~muonckpt.errors.RestoreError`, naming the param and
            key), state it cast by torch's rule is warned once
            (:class:`~muonckpt.errors.RestoreWarning`). Its cost: one XXH3 pass over the params'
            values, and one over the state after a reshard (docs/benchmarks.md); False skips it.
        model: a model whose weights are separate copies of the optimizer's params (a bf16
            model beside the fp32 master params its optimizer steps, as Megatron-LM keeps
            them), a module or its weights by name: each weight named as a param this rank
            holds is given the loaded param cast to its dtype, and the check proves it holds it
            (a weight left unsynced, Megatron-LM #6920, fails the load naming the param). A
            param the model lacks, or holds in another number of elements, is refused before
            anything changes. Needs ``params=True``.

    Returns:
        A :class:`LoadReport` of the conversions made and the settings warned about.

    Raises:
        CheckpointError: naming the file and param on any damage or mismatch, or the value of
            ``extra`` / ``rank_extra`` whose ``load_state_dict`` refused (and any that then
            refused its own previous state too, named). StateDictError: naming the optimizer
            whose ``load_state_dict`` refused the state.
    """
    asked = _LoadOptions(
        path, params, momentum_form, rename, extra, rank_extra, local, check, progress, model
    )
    return _load(optimizer, asked)


def load_node_copy(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    params: bool,
    extra: MutableMapping[str, Any] | None,
    rank_extra: MutableMapping[str, Any] | None,
    progress: Progress | None,
    check: bool,
) -> LoadReport:
    """:func:`load` of a checkpoint each node holds a copy of in its own directory ``path``
    (a step of the node-local tier, recovered): the ranks agree on its manifest, not on its
    path."""
    asked = _LoadOptions(
        path, params, None, None, extra, rank_extra, False, check, progress, per_node=True
    )
    return _load(optimizer, asked)


def _load(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], asked: _LoadOptions
) -> LoadReport:
    """:func:`load`'s steps, in order."""
    path, local = asked.path, asked.local
    with event("load", path, local) as logged:
        call = _agree(optimizer, asked)  # the rendezvous, then the layout
        opened = _open(call)  # open: the manifest, or this rank's refusal
        _agree_open(call, opened)
        report = LoadReport()
        mapped = _map(call, opened.result(), report)  # map: the checkpoint onto the target
        read = _read_and_take(call, opened.result(), mapped)  # read, and hand to the optimizers
        del opened  # nothing holds the manifest now: the state made takes its place in memory
        _agree_read(call, read)
        taken = read.taken.result()
        logged.bytes = taken[0].share.nbytes
        _apply(call, taken, report, read.copies)
        _agree_check(call, read.check, read.copies)
    return report


def event(operation: str, path: str | os.PathLike[str], local: bool) -> events.Event:
    """The start of ``operation`` (save, async_save, load) on ``path`` logged, with this rank
    and the ranks of the default process group (this process alone for a ``local`` call)."""
    where = target_text(path)
    if local or not collectives.is_distributed():
        return events.Event(operation, where)
    rank, ranks = collectives.global_rank(), collectives.group_size(None)
    return events.Event(operation, where, rank=rank, ranks=ranks)


@dataclass(frozen=True)
class _LoadOptions:
    """The arguments of one :func:`load` call."""

    path: str | os.PathLike[str]
    params: bool
    momentum_form: str | None
    rename: Rename | None
    extra: MutableMapping[str, Any] | None
    rank_extra: MutableMapping[str, Any] | None
    local: bool
    check: bool
    progress: Progress | None = None
    """This rank's own report of its reads (not compared across ranks)."""
    model: Model | None = None
    per_node: bool = False
    """Each node reads its own copy at its own ``path`` (:func:`load_node_copy`): the ranks
    compare the manifest they opened, not where."""

    def agreement(self) -> dict[str, Any]:
        """What every rank's call must have alike (the rendezvous compares it)."""
        rename = self.rename
        return {
            "path": "(each node's own)" if self.per_node else storage.resolved_place(self.path),
            "params": self.params,
            "momentum_form": self.momentum_form,
            "rename": rename if rename is None or isinstance(rename, Mapping) else _named(rename),
            "extra given": self.extra is not None,
            "rank_extra given": self.rank_extra is not None,
            "check": self.check,
            "model given": self.model is not None,
        }


@dataclass(frozen=True)
class _LoadCall:
    """A load described and agreed: its arguments, the optimizer(s) (several as one), their
    layout, the models whose weights follow the params, and the step protocol."""

    options: _LoadOptions
    optimizer: Optimizers
    sharding: Sharding
    models: list[ShardedParams]
    steps: group_steps.CollectiveSteps

    @property
    def rank(self) -> int:
        """This rank's place in the grid."""
        return self.sharding.participants.index(collectives.global_rank())


def _agree(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], options: _LoadOptions
) -> _LoadCall:
    """Describe and agree: the bounded rendezvous where the ranks compare the call and its
    arguments, then the layout (a collective the first time)."""
    targets = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    joined = targets[0] if len(targets) == 1 else Joined(targets, local=options.local)
    ranks = participants(joined, "load", local=options.local)
    hint = replica_hint(joined)
    group_steps.rendezvous("load", ranks, options.agreement(), CheckpointError, hint=hint)
    sharding = describe(joined, local=options.local)
    models = following(p for o in targets for p in flat_params(o)) if options.params else []
    steps = group_steps.CollectiveSteps(
        "load", sharding.participants, sharding.destination, CheckpointError
    )
    return _LoadCall(options, joined, sharding, models, steps)


@dataclass(frozen=True)
class _Opened:
    """The checkpoint this rank opened: its files, its manifest (renamed as asked), and
    what the ranks compare to find they opened one (empty in one process)."""

    files: storage.CheckpointFiles
    manifest: Manifest
    agreement: dict[str, Any]


def _open(call: _LoadCall) -> Attempt[_Opened]:
    """The checkpoint opened, checked to hold what the load asks for; or the refusal."""
    try:
        return Attempt(_opened(call))
    except BaseException as exc:
        return Attempt(failure=exc)


def _opened(call: _LoadCall) -> _Opened:
    options = call.options
    files, manifest = open_checkpoint(options.path, pieces=False)  # the indexes: when read
    if options.rename is not None:
        manifest = manifest.renamed(options.rename)
    if options.params and not manifest.has_values:
        raise CheckpointError(
            "the checkpoint holds no param values (saved with params=False, or by format "
            f"version {manifest.format_version}); load it with params=False to restore "
            "the optimizer state only",
            path=files.at(MANIFEST_NAME),
        )
    world = len(call.sharding.participants)
    _check_job_state(manifest, files.location, options.extra, options.rank_extra, world)
    if len(call.steps.ranks) == 1:
        return _Opened(files, manifest, {})  # nobody to agree with: no digest of it
    agreement = {
        "checkpoint": "(each node's own)" if options.per_node else files.resolved(),
        "manifest": manifest.digest(),
        "models that follow the params": len(call.models),  # each a collective below
    }
    return _Opened(files, manifest, agreement)


def _agree_open(call: _LoadCall, opened: Attempt[_Opened]) -> None:
    """The ``open`` step: every rank opened the same checkpoint, or every rank fails. (In one
    process every failure is raised as it is.)"""
    steps = call.steps
    if len(steps.ranks) == 1:
        opened.result()
        return

    def mine() -> dict[str, Any]:
        return opened.result().agreement

    steps.each_then_root("open", mine, lambda found: _agreed_load(found, steps.ranks))


def _map(call: _LoadCall, opened: _Opened, report: LoadReport) -> Attempt[Target]:
    """How the checkpoint maps onto the target (names that differ by a wrapper's prefix
    refused, every checkpoint param landing in one optimizer); or the refusal."""
    try:
        manifest, directory = opened.manifest, opened.files.location
        _check_prefix(manifest, call.sharding, directory)
        form = call.options.momentum_form
        now = _save_manifest.environment(_save_manifest.device_of(call.optimizer))
        report.environment = environment_differences(manifest.environment, now)
        target = _plan(call.optimizer, call.sharding, manifest, form, report)
        _check_covered(manifest, target, directory)
        return Attempt(target)
    except BaseException as exc:
        return Attempt(failure=exc)


@dataclass
class _Read:
    """This rank's share read and handed to the optimizers and the job's stateful values (or
    the refusal), with what puts back what that changed, in the order it changed it."""

    undo: list[Callable[[], list[str]]]
    taken: Attempt[tuple[Taken, trainstate.Restore]]
    check: _checking.Check | None = None
    """What the load applies, digested before it was handed over (None: not checked)."""
    copies: ModelCopies | None = None
    """The model whose weights are copies of the params (``load(model=)``), paired."""


def _read_and_take(call: _LoadCall, opened: _Opened, mapped: Attempt[Target]) -> _Read:
    """Read this rank's share and the job's own state, then hand them over, which may refuse:
    inside the ``read`` step, so that a refusal on any rank fails every rank, each putting
    back what it changed (the stateful values first, then the optimizers take their share, no
    tensor of theirs written into yet)."""
    options, undo = call.options, []
    check = _checking.Check() if options.check else None
    try:
        target, manifest, files = mapped.result(), opened.manifest, opened.files
        copies = None if options.model is None else _model_copies(target, options)
        manifest = load_pieces(files, manifest, _read_here(target, options.params))
        with PieceReader(files, manifest) as reader:
            done = None if check is None else check.read
            where = files.location
            share = _reading.read_share(
                target, manifest, reader, options.params, where, options.progress, done
            )
            asked = _read_job_state(manifest, reader, options.extra, options.rank_extra, call.rank)
        restore = trainstate.Restore(asked)
        undo.append(restore.put_back)
        restore.load_objects()
        state = Taken(target, share)
        if check is not None:
            check.handing(state)
        undo.append(state.put_back)
        state.take()
        if check is not None:
            check.taken()  # state dropped refuses here: every rank puts back
        return _Read(undo, Attempt((state, restore)), check, copies)
    except BaseException as exc:
        return _Read(undo, Attempt(failure=exc))
    finally:
        if check is not None:
            check.close()


def _model_copies(target: Target, options: _LoadOptions) -> ModelCopies:
    """``load(model=)``'s model paired with the params this rank holds, by name; refused
    (before anything changes) where it cannot be synced."""
    assert options.model is not None
    if not options.params:
        raise CheckpointError(
            "load(model=...) gives the model the loaded params: it needs params=True",
            path=options.path,
        )
    flat = flat_params(target.optimizer)
    held = [
        (p.name, flat[p.local_index]) for p in target.sharding.local() if p.local_index is not None
    ]
    return ModelCopies.pair(options.model, held)


def _read_here(target: Target, params: bool) -> list[str]:
    """The params of which this rank reads elements (its state, its values): whose piece
    indexes it reads (:func:`muonckpt.files.pieces.load_pieces`)."""
    names = []
    for p in target.sharding.params:
        if p.local_index is None:
            continue
        state = p.local is not None and p.local.numel > 0
        values = params and (p.held is None or p.held.numel > 0)
        if state or values:
            names.append(p.name)
    return names


def _agree_read(call: _LoadCall, read: _Read) -> None:
    """The ``read`` step: every rank read and handed over its share, or every rank puts back
    what it changed (all or none change)."""
    steps = call.steps

    def mine() -> None:
        read.taken.result()

    try:
        if len(steps.ranks) > 1:
            steps.each_then_root("read", mine, lambda _: None)
        else:
            mine()
    except BaseException as exc:
        put_back(read.undo, exc)
        raise


def _agree_check(
    call: _LoadCall, check: _checking.Check | None, copies: ModelCopies | None
) -> None:
    """The ``check`` step (after the apply): every rank's optimizers, params and models hold
    what it read, or the load fails on every rank alike, naming what differs on which rank;
    casts warned."""
    if check is None:
        return
    steps = call.steps
    if len(steps.ranks) > 1:  # (a rank's own failure to check: that step's, on every rank)

        def every(problems: list[list[list[str]]]) -> list[list[Any]]:
            return [[r, *p] for r, ps in zip(steps.ranks, problems, strict=True) for p in ps]

        def mine() -> list[list[str]]:
            return [list(p) for p in check.problems(call.models, copies)]

        found: list[list[Any]] = steps.each_then_root("check", mine, every)
    else:
        found = [[None, *problem] for problem in check.problems(call.models, copies)]
    if found:
        raise _checking.refusal(found)
    check.warn()


def _apply(
    call: _LoadCall,
    taken: tuple[Taken, trainstate.Restore],
    report: LoadReport,
    copies: ModelCopies | None,
) -> None:
    """(every rank has taken its share) The loaded values into the optimizers' tensors, the
    params and the job's plain values, the model's weights from the loaded shards; the
    report's notes logged, and warned (at the caller of :func:`load`) by the first rank alone:
    every rank holds the same report, and a job's log wants each warning once."""
    state, restore = taken
    state.finish()  # from here on nothing can refuse
    restore.assign()
    for sharded in call.models:  # the model's weights from the loaded shards: never forgotten
        sharded.params_to_model()
    if copies is not None:  # (load(model=): its weights from the loaded params, cast)
        copies.params_to_model()
    for message in report.converted:
        _LOG.info("muonckpt.load: converted %s", message)
    for message in report.warnings if call.rank == 0 else ():
        warnings.warn(message, ConversionWarning, stacklevel=3)
    if report.environment and call.rank == 0:  # (every rank's report still lists its own)
        warnings.warn(_environment_message(report.environment), EnvironmentWarning, stacklevel=3)


def _environment_message(differences: list[str]) -> str:
    """The one warning of a load in another environment than the save's."""
    return (
        f"this load runs in another environment than the save: {'; '.join(differences)}. A "
        "resumed run is bitwise the uninterrupted one only under the same torch, device type, "
        "intra-op and inter-op thread counts (torch.set_num_threads, OMP_NUM_THREADS: a "
        "one-process torchrun leaves it unset) and deterministic settings; set them as the "
        "save had them for a bitwise resume"
    )


_LOG = logging.getLogger("muonckpt")


def _named(function: Callable[..., Any]) -> str:
    """A function as the ranks of one call can compare it (its qualified name)."""
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', '?')}"


def _check_job_state(
    manifest: Manifest,
    directory: storage.Location,
    extra: Mapping[str, Any] | None,
    rank_extra: Mapping[str, Any] | None,
    world: int,
) -> None:
    """A load that asks for the job's own state must find it, ``rank_extra`` at the number of
    ranks that saved it. An empty dict asks for no key: it stays empty where none was saved, so
    that one resume script serves checkpoints with and without it."""
    saved = manifest.extra
    where = directory / MANIFEST_NAME
    if extra and (saved is None or saved.shared is None):
        raise CheckpointError(
            "the checkpoint holds no extra (saved without extra=); load it without extra= "
            "(or with an empty dict)",
            path=where,
        )
    if rank_extra is None:
        return
    if saved is None or not saved.ranks:
        if not rank_extra:
            return
        raise CheckpointError(
            "the checkpoint holds no rank_extra (saved without rank_extra=); load it "
            "without rank_extra= (or with an empty dict)",
            path=where,
        )
    if len(saved.ranks) != world:
        raise CheckpointError(
            f"rank_extra was saved by {len(saved.ranks)} ranks and this load has {world}: "
            "per-rank values (RNG states, data positions) do not carry over to another number "
            "of ranks; load without rank_extra= and derive them afresh (from extra=)",
            path=where,
        )


def _read_job_state(
    manifest: Manifest,
    reader: PieceReader,
    extra: MutableMapping[str, Any] | None,
    rank_extra: MutableMapping[str, Any] | None,
    rank: int,
) -> list[tuple[str, MutableMapping[str, Any], dict[str, Any]]]:
    """(name, target, saved tree) of what the load asks for, its tensors read and verified, every
    asked-for key checked present: nothing changes yet."""
    out: list[tuple[str, MutableMapping[str, Any], dict[str, Any]]] = []
    saved = manifest.extra
    if saved is None:  # (asked for nothing: a load that asks needs it, checked when opened)
        return out
    asked = [("extra", extra, saved.shared)]
    if rank_extra is not None and saved.ranks:
        asked.append((f"rank_extra[{rank}]", rank_extra, saved.ranks[rank]))
    for what, target, tree in asked:
        if target is None or tree is None:
            continue
        saved = job_tree.read(reader, tree, what)
        lacking = trainstate.missing(target, saved, what)
        if lacking:
            raise CheckpointError(
                f"the checkpoint's {what} does not hold what the load asks for: "
                f"{'; '.join(lacking[:8])}",
                path=reader.files.at(MANIFEST_NAME),
            )
        out.append((what, target, saved))
    return out


def _agreed_load(arguments: list[dict[str, Any]], ranks: Sequence[int]) -> None:
    """(the root of a load) Every rank opened the same checkpoint, the same manifest, and was
    asked the same: a mix of checkpoints never loads."""
    differ = disagreement(arguments, ranks)
    if differ is not None:
        raise CheckpointError(
            f"the ranks of one load disagree on {differ}: a load reads one checkpoint on every "
            "rank (a path re-pointed or replaced while they opened it, or different paths?)"
        )


def _check_prefix(manifest: Manifest, sharding: Sharding, directory: storage.Location) -> None:
    """Names that differ by a wrapper's prefix (DDP's ``module.``, torch.compile's
    ``_orig_mod.``) are refused naming the prefix and the ``rename`` that maps them; an optimizer
    without names, loading named params, naming ``named_parameters()``."""
    hint = names_hint((e.name for e in manifest.params), (p.name for p in sharding.params))
    if hint is not None:
        raise CheckpointError(hint, path=directory / MANIFEST_NAME)


def _plan(
    optimizer: Optimizers,
    sharding: Sharding,
    manifest: Manifest,
    momentum_form: str | None,
    report: LoadReport,
) -> Target:
    """How the checkpoint's state maps onto ``optimizer``: name for name into the same
    optimizer, else by :mod:`muonckpt.format.conversion`'s rules (its notes go to ``report``)."""
    source = [
        kinds.GroupKind.from_json(g.optimizer) if g.optimizer else None for g in manifest.groups
    ]
    target = conversion.group_kinds(optimizers_of(optimizer))
    steps_in = [k.step_in for k in target]
    if not conversion.needs_mapping(source, target, momentum_form):
        own = [
            {k: json_safe(v) for k, v in g.items() if k in conversion.UPDATE_SETTINGS}
            for g in optimizer.param_groups
        ]
        names = [k.optimizer for k in target]
        report.warnings += conversion.replaced_settings(manifest.groups, own, names)
        groups = remap_groups(optimizer, _torch_groups(manifest), sharding)
        return Target(optimizer, sharding, groups, None, steps_in)
    mapping = conversion.load_mapping(
        manifest, source, target, ((p.name, p.group) for p in sharding.params), momentum_form
    )
    report.converted += mapping.converted
    report.warnings += mapping.warnings
    groups = _own_groups(optimizer, target, sharding, manifest)
    return Target(optimizer, sharding, groups, mapping.maps, steps_in)


def _own_groups(
    optimizer: Optimizers,
    computed: Sequence[kinds.GroupKind],
    sharding: Sharding,
    manifest: Manifest,
) -> list[dict[str, Any]]:
    """The target's own group settings in local indices; a group that counts steps itself (the
    packaged AdamW) takes the checkpoint's count."""
    groups, start = [], 0
    for g, (group, computes) in enumerate(zip(optimizer.param_groups, computed, strict=True)):
        settings = {k: v for k, v in group.items() if k != "params"}
        settings["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        names = (p.name for p in sharding.params if p.group == g)
        step = conversion.group_step(manifest, names, computes.step_in, counts="step" in group)
        if step is not None:
            settings["step"] = step
        groups.append(settings)
    return groups


def _check_covered(manifest: Manifest, plan: Target, directory: storage.Location) -> None:
    """Loading across optimizers, every checkpoint param must land in exactly one of them."""
    if plan.maps is None:
        return  # the same optimizer: remap_groups has matched every name
    names = [p.name for p in plan.sharding.params]
    missing = sorted({e.name for e in manifest.params} - set(names))
    if missing:
        raise CheckpointError(
            f"the optimizers must together hold every param of the checkpoint: held by none "
            f"{missing[:8]}",
            path=directory / MANIFEST_NAME,
        )


def _torch_groups(manifest: Manifest) -> list[dict[str, Any]]:
    return [
        {**g.settings(), "param_names": list(g.params), "params": list(g.params)}
        for g in manifest.groups
    ]
