"""A save's steps in the caller's thread, each a call that returns data: :func:`agree` (the
rendezvous, then the layout), :func:`collect` (this rank's values, taken once, or its
refusal, and where it holds state), :func:`stage` (the ranks compare what they collected,
the root checks where the state is and opens the staging directory), :func:`plan` (the
consolidated gather, the checked write plan and the manifest's draft), and :func:`write`
(this rank's files, in the caller's thread or the background), which
:mod:`muonckpt.checkpoint.api` calls in turn, then the commit and retire of the write engine
(:mod:`muonckpt.files.writing`)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import storage
from ..distributed import collectives, group_steps
from ..distributed.group_steps import default_store
from ..distributed.mailbox import Mailbox
from ..distributed.steps import disagreement
from ..errors import CheckpointError, StateDictError
from ..files import retention, writing
from ..files.attempt import Attempt
from ..files.progress import Progress
from ..format import conversion
from ..format.manifest import (
    CONSOLIDATED,
    PER_RANK,
    Extra,
    GroupEntry,
    ParamEntry,
    Scalar,
    extra_to_json,
    json_safe,
    tuple_paths,
)
from ..format.names import EXTRA_FILE, PARAM_KEY, extra_rank_file
from ..format.writeplan import WritePlan, consolidated_plan, rank_plan, unique_tensor_keys
from ..layout.state_shapes import StateShape, state_region
from ..state import trainstate
from ..state.describers import flat_params
from ..state.gather import (
    EntryReports,
    check_state_holders,
    gather_full_state,
    state_holders_report,
)
from ..state.hostcopy import HostBuffers, PendingSnapshot
from ..state.model_state import ModelTensors, model_tensors
from ..state.placement import Optimizers, describe, optimizers_of, participants, replica_hint
from ..state.sharding_model import Sharding
from ..state.values import ParamState, PlainValue, ScalarValue, StateValue, TensorValue, state_value
from ..storage.places import target
from . import _save_manifest
from .options import SaveOptions


@dataclass(frozen=True)
class SaveCall:
    """A save described and agreed: the optimizer, the path as given, the options, the layout
    over the grid and the step protocol among its ranks."""

    optimizer: Optimizers
    path: Path | str
    """The target as the store takes it (:func:`muonckpt.storage.places.target`)."""
    options: SaveOptions
    sharding: Sharding
    steps: group_steps.CollectiveSteps


def agree(optimizer: Optimizers, path: str | os.PathLike[str], options: SaveOptions) -> SaveCall:
    """Describe and agree: the bounded rendezvous where the ranks compare the call and its
    arguments (``path`` resolved), then the optimizer's layout (``options.local``: this
    process's alone, :func:`muonckpt.state.placement.check_local`)."""
    operation = options.operation
    ranks = participants(optimizer, operation, local=options.local)
    hint = replica_hint(optimizer)
    group_steps.rendezvous(operation, ranks, options.agreement(path), CheckpointError, hint=hint)
    sharding = describe(optimizer, local=options.local)
    steps = group_steps.CollectiveSteps(
        operation, sharding.participants, sharding.destination, CheckpointError
    )
    return SaveCall(optimizer, target(path), options, sharding, steps)


@dataclass
class Collected:
    """This rank's share of a save, taken once from the optimizer: its state by flat param
    index, ``model``'s other tensors, the job's own state, and for a per-rank save its own
    file (for a background save, its tensors copied into host buffers already)."""

    state: dict[int, ParamState]
    model: ModelTensors | None
    job: _JobState
    payload: _Payload | None
    agreement: dict[str, Any]
    """What every rank's must have alike (the ``stage`` step compares it)."""
    report: EntryReports | None
    """Where this rank holds state (a per-rank save over several ranks), which the ``stage``
    step's root checks against the sharding (:func:`stage`)."""


def collect(call: SaveCall, buffers: HostBuffers) -> Attempt[Collected]:
    """This rank's :class:`Collected`, or its refusal (a value a checkpoint could not hold or
    load back, a manifest past the readers' limit), which the ``stage`` step (:func:`stage`)
    raises on every rank."""
    try:
        return Attempt(_collected(call, buffers))
    except BaseException as exc:
        return Attempt(failure=exc)


def _collected(call: SaveCall, buffers: HostBuffers) -> Collected:
    sharding, options = call.sharding, call.options
    state = _collect(sharding, call.optimizer, options.params, options.keep_last, call.path)
    names = [p.name for p in sharding.params]
    model = model_tensors(options.model, names, options.consolidated, options.params)
    job = _JobState.take(options.extra, options.rank_extra)
    payload = None if options.consolidated else _rank_payload(sharding, state)
    _check_manifest(sharding, state, payload, options.shard_bytes, call.path)
    report = state_holders_report(sharding, state) if _holders_checked(call) else None
    if payload is not None and options.background:  # the optimizer may change on return
        payload.snapshot = buffers.start_snapshot(payload.tensors)  # done by settle()
        payload.tensors = payload.snapshot.copies
    return Collected(state, model, job, payload, job.agreement(), report)


def settle(collected: Attempt[Collected]) -> None:
    """(before a background save's call returns, however it ends) Wait for the snapshot that
    :func:`collect` started (its CUDA copies run while the ``stage`` step is exchanged); a
    copy that failed is this rank's failure of the ``write`` step, which every rank raises."""
    payload = collected.value.payload if collected.value is not None else None
    if payload is None or payload.snapshot is None:
        return
    try:
        payload.snapshot.wait()
    except Exception as exc:
        payload.plan = Attempt(failure=exc)


def _holders_checked(call: SaveCall) -> bool:
    """Whether the ``stage`` step checks where the state is: a per-rank save over several
    ranks (a wrong owner rule would drop state unnoticed; a consolidated save's gather checks
    it itself)."""
    return not call.options.consolidated and len(call.sharding.participants) > 1


def stage(
    call: SaveCall,
    collected: Attempt[Collected],
    store: storage.CheckpointStore,
    mailbox: bool,
) -> tuple[Path, Mailbox | None]:
    """The ``stage`` step: every rank hands in what it ``collected`` (its refusal fails the
    step on every rank), and the root compares the ranks' :attr:`Collected.agreement` and,
    for a per-rank save over several ranks, checks their :attr:`Collected.report`\\ s against
    the sharding (:func:`muonckpt.state.gather.check_state_holders`: a refusal raised as one
    on every rank), in the exchange the ranks make anyway rather than one more; when all
    passed and agree, it opens the staging directory
    (:func:`muonckpt.files.writing.open_staging`) and, with ``mailbox``, creates the
    :class:`~muonckpt.distributed.mailbox.Mailbox` of a background finish; on every rank,
    the directory it writes into (:meth:`~muonckpt.storage.CheckpointStore.join_staging`)
    and that mailbox (None without). (That the ranks were called alike is the rendezvous,
    :func:`agree`, before this.)"""
    steps = call.steps

    def mine() -> list[Any]:
        found = collected.result()
        return [found.agreement, found.report]

    def open_if_agreed(found: list[list[Any]]) -> dict[str, Any]:
        differ = disagreement([agreement for agreement, _ in found], steps.ranks)
        if differ is not None:
            raise CheckpointError(f"the ranks disagree on {differ}; nothing was written")
        try:
            if _holders_checked(call):
                check_state_holders(call.sharding, [report for _, report in found])
        except StateDictError as exc:
            return {"refused": str(exc)}
        staging = writing.open_staging(store, call.path, overwrite=call.options.overwrite)
        try:
            name = Mailbox.create().name if mailbox else None
        except BaseException:
            store.discard(staging)
            raise
        return {"staging": str(staging), "mailbox": name}

    decided = steps.each_then_root("stage", mine, open_if_agreed)
    if "refused" in decided:  # the state dict does not fit its sharding: that error, on all
        raise StateDictError(f"stage: {decided['refused']}", agreed_by=steps.ranks)
    name = decided["mailbox"]
    staging = store.join_staging(decided["staging"], steps.rank, call.path)
    return staging, None if name is None else Mailbox(name, default_store())


@dataclass
class PreparedSave:
    """A save planned, every value its write and commit need taken from the optimizer: the
    protocol over the grid, the staging directory, the mailbox of a background save's ranks
    (None: not one, or one rank), this rank's plan (or why it could not be
    made, raised in the ``write`` step) and tensors, the host buffers they stream through
    (None: a snapshot already), the job's own state, the manifest's draft, and the target's
    store."""

    steps: group_steps.CollectiveSteps
    staging: Path
    mailbox: Mailbox | None
    payload: _Payload
    host: HostBuffers | None
    job: _JobState
    draft: writing.Draft
    store: storage.CheckpointStore
    progress: Progress | None
    """The caller's report of this rank's files written (:attr:`SaveOptions.progress`)."""


def plan(
    call: SaveCall,
    collected: Collected,
    staging: Path,
    mailbox: Mailbox | None,
    buffers: HostBuffers,
    store: storage.CheckpointStore,
) -> PreparedSave:
    """(after the ``stage`` step) The group settings; for a consolidated save the full state
    gathered to the destination's host memory and its plan. A failure here removes the
    staging directory and the ``mailbox`` (the root)."""
    sharding, options = call.sharding, call.options
    try:
        groups = _group_entries(call.optimizer, sharding)
        payload = collected.payload
        if payload is None:  # gathered into fresh host tensors: a snapshot already
            payload = _consolidated_payload(
                sharding, collected.state, options.shard_bytes, collected.model
            )
    except BaseException:
        if call.steps.is_root:
            abandon(store, staging, mailbox)
        raise
    kind = CONSOLIDATED if options.consolidated else PER_RANK
    given_step = None if options.extra is None else options.extra.get("step")
    device = _save_manifest.device_of(call.optimizer)
    draft = _save_manifest.draft(groups, sharding, kind, collected.model, given_step, device)
    host = None if options.background else buffers  # else streamed: one reused host buffer
    job = collected.job
    return PreparedSave(
        call.steps, staging, mailbox, payload, host, job, draft, store, options.progress
    )


def abandon(store: storage.CheckpointStore, staging: Path, mailbox: Mailbox | None) -> None:
    """(the root) Remove a staging directory and the ``mailbox`` of a save that will never be
    written."""
    writing.abandon(store, staging)
    if mailbox is not None:
        with contextlib.suppress(CheckpointError):  # the store gone: nothing to delete
            mailbox.remove()


def write(prepared: PreparedSave) -> Attempt[writing.Written]:
    """This rank's files: its plan checked against what it collected, its tensors, the job's
    own state (``extra`` by the root); its report for the root, or its failure, which the
    ``write`` step (:func:`muonckpt.files.writing.commit`) raises on every rank."""
    try:
        return Attempt(_write(prepared))
    except BaseException as exc:
        return Attempt(failure=exc)


def _write(prepared: PreparedSave) -> writing.Written:
    payload, steps = prepared.payload, prepared.steps
    written = writing.Written([], [], {})
    planned = payload.plan.result()
    if planned is not None:
        _check_plan_holds(planned, payload.tensors)
        tensors = _streamed(planned, payload.tensors, prepared.host)
        staging, store = prepared.staging, prepared.store
        written = writing.write_files(
            store, planned, staging, tensors, prepared.progress, prefetch=False
        )
    shared = prepared.job.shared if steps.is_root else None  # stored once, by the root
    me = steps.ranks.index(steps.rank)
    written.scalars = payload.scalars
    written.shapes = payload.shapes
    written.extra = prepared.job.write(prepared.staging, shared, me, len(steps.ranks))
    return written


def _streamed(
    plan: WritePlan, tensors: Mapping[tuple[str, str], torch.Tensor], host: HostBuffers | None
) -> writing.Tensors:
    """Each tensor of ``plan`` in the order it is written, flat, copied through ``host``'s
    reused buffer as the writer takes it (streamed), or as it is (a snapshot in host memory
    already, ``host`` None)."""
    for w in writing.in_order(plan):
        tensor = tensors[w.param, w.key]
        yield w, (tensor if host is None else host.to_host(tensor)).reshape(-1)


def _check_plan_holds(plan: WritePlan, tensors: Mapping[tuple[str, str], torch.Tensor]) -> None:
    """The plan writes every tensor this rank collected, once, and nothing else (as DCP
    validates its plan before writing): a tensor left out would vanish from the checkpoint
    without a gap for any reader to find."""
    planned = [(w.param, w.key) for w in plan.writes]
    if len(planned) != len(tensors) or set(planned) != tensors.keys():
        missing = sorted(set(tensors) - set(planned))[:3]
        stray = sorted(set(planned) - set(tensors))[:3]
        raise CheckpointError(
            f"the write plan does not hold exactly the state collected (left out: {missing}, "
            f"not collected: {stray}); nothing was committed"
        )


@dataclass
class _JobState:
    """The training job's own state of one rank's save: ``extra`` and ``rank_extra`` as
    taken at the call (:func:`muonckpt.state.trainstate.take`)."""

    shared: trainstate.Taken | None
    own: trainstate.Taken | None

    @classmethod
    def take(
        cls, extra: Mapping[str, Any] | None, rank_extra: Mapping[str, Any] | None
    ) -> _JobState:
        return cls(
            None if extra is None else trainstate.take(extra, "extra"),
            None if rank_extra is None else trainstate.take(rank_extra, "rank_extra"),
        )

    def agreement(self) -> dict[str, Any]:
        """What every rank's call must have alike (the stage step compares it)."""
        return {
            "extra (the same on every rank; per-rank values go in rank_extra)": (
                None if self.shared is None else self.shared.digest()
            ),
            "rank_extra given": self.own is not None,
        }

    def write(
        self, staging: Path, shared: trainstate.Taken | None, rank: int, world: int
    ) -> dict[str, Any] | None:
        """Write this rank's files of it (``shared``: the root's ``extra``); its part of the
        manifest's ``extra``, as JSON."""
        if shared is None and self.own is None:
            return None
        trees: list[Any] = []
        files = []
        for taken, file in ((shared, EXTRA_FILE), (self.own, extra_rank_file(rank, world))):
            if taken is None:
                trees.append(None)
                continue
            tensors = [
                (path, storage.dtype_name(t.dtype), tuple(t.shape), t) for path, t in taken.tensors
            ]
            tree, entry = writing.write_extra(staging, file, taken.values, tensors)
            trees.append(tree)
            files += [entry] if entry is not None else []
        ranks = () if trees[1] is None else (trees[1],)
        return extra_to_json(Extra(trees[0], ranks, tuple(files)))


def _collect(
    sharding: Sharding,
    optimizer: Optimizers,
    params: bool,
    keep_last: int | None,
    where: Path | str,
) -> dict[int, ParamState]:
    """This rank's state by its own flat param index, each value classified once, with each
    param's values when ``params``; refused, before anything is written, what a checkpoint
    could not hold or load back."""
    if keep_last is not None:
        retention.check_keep_last(keep_last)
    flat = flat_params(optimizer)
    keys = [(p.name, k) for p in sharding.params for k in p.expected_keys]
    collected: dict[int, ParamState] = {}
    for param in sharding.local():
        p = flat[param.index_here]
        state = optimizer.state.get(p, {})
        if PARAM_KEY in state:
            raise CheckpointError(
                f"state key {PARAM_KEY!r} is reserved for the param's values", param=param.name
            )
        typed: dict[str, StateValue] = {}
        for key, value in state.items():
            if not isinstance(key, str):
                raise CheckpointError(f"state key {key!r} is not a string", param=param.name)
            typed[key] = kept = state_value(param, key, value, tuple(p.shape))
            if isinstance(kept, TensorValue):
                keys.append((param.name, key))
            elif isinstance(kept.value, float) and not math.isfinite(kept.value):
                raise CheckpointError(
                    f"state {key!r} is {kept.value}, which a JSON manifest cannot hold",
                    param=param.name,
                )
        collected[param.index_here] = ParamState(typed, p.detach() if params else None)
    keys += [(p.name, PARAM_KEY) for p in sharding.params] if params else []
    unique_tensor_keys(iter(keys), where)
    return collected


def _stored(held: ParamState) -> list[tuple[str, StateValue]]:
    """A param's values as a checkpoint stores them, by key: its state, and its own values
    under :data:`PARAM_KEY`."""
    values = [(PARAM_KEY, TensorValue(held.values))] if held.values is not None else []
    return sorted([*held.state.items(), *values], key=lambda item: item[0])


@dataclass
class _Payload:
    """What one rank of a save writes: its plan (None: nothing; a rank's own file's made in
    :func:`collect`, where its manifest lines are counted; a consolidated one in :func:`plan`,
    or why it could not be, raised in the ``write`` step), the tensors by (param, key), and
    the scalars it reports for the manifest."""

    plan: Attempt[WritePlan | None]
    tensors: dict[tuple[str, str], torch.Tensor]
    scalars: dict[str, dict[str, Any]]
    shapes: dict[str, dict[str, StateShape]]
    """The state tensors not shaped like their param: param -> key -> full shape and rule."""
    snapshot: PendingSnapshot[tuple[str, str]] | None = None
    """A background save's copies of :attr:`tensors` being made (:func:`settle` waits)."""


def _rank_payload(sharding: Sharding, collected: Mapping[int, ParamState]) -> _Payload:
    """This rank's own pieces (its file of :func:`rank_plan`)."""
    me = collectives.global_rank()
    owned: list[Any] = []
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    shapes: dict[str, dict[str, StateShape]] = {}
    for param in sharding.params:
        holding = next((h for h in param.sources if h.rank == me), None)
        if holding is None:
            continue
        for key, value in _stored(collected[param.index_here]):
            if not isinstance(value, TensorValue):
                scalars.setdefault(param.name, {})[key] = _scalar_json(value)
                continue
            dtype = storage.dtype_name(value.tensor.dtype)
            region = state_region(value.stored, param.full_shape, holding.region)
            assert region is not None  # (state_value refused a layout that cuts it)
            owned.append(((param.name, key, dtype), region))
            tensors[param.name, key] = value.tensor
            if value.stored is not None:
                shapes.setdefault(param.name, {})[key] = value.stored
    rank, world = sharding.participants.index(me), len(sharding.participants)
    plan = rank_plan(rank, world, owned)  # made at the call: its manifest lines are counted
    return _Payload(Attempt(plan), tensors, scalars, shapes)


def _scalar_json(value: ScalarValue | PlainValue) -> dict[str, Any]:
    """A scalar's manifest form: its value, and its safetensors dtype if it is a 0-d tensor."""
    dtype = value.dtype if isinstance(value, ScalarValue) else None
    stored = storage.dtype_name(getattr(torch, dtype)) if dtype else None
    return {"value": json_safe(value.value), "dtype": stored}


def _consolidated_payload(
    sharding: Sharding,
    collected: Mapping[int, ParamState],
    max_shard_size: int | None,
    model: ModelTensors | None = None,
) -> _Payload:
    """Every param's full state gathered on the destination, which writes every file of
    :func:`consolidated_plan` (with ``model``'s other tensors and tied names); the other ranks
    write nothing."""
    full = gather_full_state(sharding, lambda: collected)
    if full is None:
        return _Payload(Attempt(None), {}, {}, {})
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    items: list[Any] = []
    for name, tensor in (model.extras if model is not None else {}).items():
        value = tensor.detach().to("cpu", copy=True)  # a snapshot, as the gathered state
        items.append(((name, PARAM_KEY, storage.dtype_name(value.dtype)), tuple(value.shape)))
        tensors[name, PARAM_KEY] = value
    shapes: dict[str, dict[str, StateShape]] = {}
    scalars = _consolidated_items(sharding, full, items, tensors, shapes)
    aliases = dict(model.aliases) if model is not None else None
    try:
        planned: Attempt[WritePlan | None] = Attempt(
            consolidated_plan(items, max_shard_size, aliases)
        )
    except BaseException as exc:
        planned = Attempt(failure=exc)
    return _Payload(planned, tensors, scalars, shapes)


def _consolidated_items(
    sharding: Sharding,
    full: Mapping[int, ParamState],
    items: list[Any],
    tensors: dict[tuple[str, str], torch.Tensor],
    shapes: dict[str, dict[str, StateShape]],
) -> dict[str, Any]:
    """The tensors of ``full`` (by canonical index) as a consolidated plan takes them, into
    ``items`` ((param, key, dtype), full shape), ``tensors`` and (those not shaped like their
    param) ``shapes``; their scalars, returned."""
    scalars: dict[str, Any] = {}
    for index, param in enumerate(sharding.params):
        gathered = full.get(index)
        for key, stored in _stored(gathered) if gathered is not None else ():
            if isinstance(stored, TensorValue):
                dtype = storage.dtype_name(stored.tensor.dtype)
                shape = param.full_shape if stored.stored is None else stored.stored.shape
                items.append(((param.name, key, dtype), shape))
                tensors[param.name, key] = stored.tensor
                if stored.stored is not None:
                    shapes.setdefault(param.name, {})[key] = stored.stored
            else:
                scalars.setdefault(param.name, {})[key] = _scalar_json(stored)
    return scalars


def _check_manifest(
    sharding: Sharding,
    collected: Mapping[int, ParamState],
    payload: _Payload | None,
    max_shard_size: int | None,
    where: Path | str,
) -> None:
    """(each rank, in the stage step: before any data is written, a refusal every rank's)
    Refuse a save whose manifest would pass the readers' limit, counted from every param and
    the tensors and scalars this rank holds as it writes them: its own file (``payload``), or
    (None) whole in the shared files of a consolidated save. Exact in one process but for the
    groups and ``extra``; with several ranks a lower bound (the commit checks the whole
    manifest)."""
    if payload is not None:
        plan, scalars, shapes = payload.plan.result(), payload.scalars, payload.shapes
    else:
        held = {
            i: collected[p.index_here]
            for i, p in enumerate(sharding.params)
            if p.local_index is not None
        }
        items: list[Any] = []
        shapes = {}
        scalars = _consolidated_items(sharding, held, items, {}, shapes)
        plan = consolidated_plan(items, max_shard_size)
    writes = plan.writes if plan is not None else ()
    dtypes: dict[str, dict[str, str]] = {}
    for w in writes:
        dtypes.setdefault(w.param, {})[w.key] = w.dtype
    params = (
        ParamEntry(
            p.name,
            p.full_shape,
            p.tp_split_dim,
            p.group,
            dtypes.get(p.name, {}),
            {k: Scalar(v["value"], v["dtype"]) for k, v in scalars.get(p.name, {}).items()},
            shapes.get(p.name, {}),
        )
        for p in sharding.params
    )
    writing.check_manifest_fits(params, writes, where)


def _group_entries(optimizer: Optimizers, sharding: Sharding) -> list[GroupEntry]:
    """Each group's settings, params and what it computes, as the manifest records them."""
    groups = []
    for g, (group, computes) in enumerate(
        zip(optimizer.param_groups, conversion.group_kinds(optimizers_of(optimizer)), strict=True)
    ):
        settings = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        hyper = {k: json_safe(v) for k, v in settings.items()}
        names = tuple(sharding.params[i].name for i in sharding.members(g))
        groups.append(GroupEntry(hyper, names, computes.to_json(), tuple(tuple_paths(settings))))
    return groups
