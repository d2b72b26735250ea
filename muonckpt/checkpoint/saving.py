"""A save's collect and plan, in the caller's thread: the rendezvous, the layout, each rank's
check of what it will write (``stage``), the state holders' check or the consolidated gather,
then each rank's write and the root's manifest, as functions of values taken at the call
(:class:`PreparedSave`), which :func:`muonckpt.checkpoint.writing.finish` runs (in the background
for
:func:`muonckpt.async_save`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .. import settings, storage
from ..distributed import collectives, group_steps
from ..errors import CheckpointError
from ..format import conversion
from ..format.manifest import (
    CONSOLIDATED,
    EXTRA_FILE,
    PARAM_KEY,
    PER_RANK,
    Extra,
    GroupEntry,
    Manifest,
    ModelFile,
    ParamEntry,
    Scalar,
    extra_rank_file,
    extra_to_json,
    json_safe,
    model_tensor,
)
from ..format.manifest_json import extra_from_json
from ..format.writeplan import WritePlan, consolidated_plan, rank_plan, unique_tensor_keys
from ..state import trainstate
from ..state.gather import (
    ParamState,
    PlainValue,
    ScalarValue,
    StateValue,
    TensorValue,
    check_state_holders,
    gather_full_state,
    state_value,
)
from ..state.hostcopy import HostBuffers
from ..state.model_state import ModelTensors, model_tensors
from ..state.placement import (
    Optimizers,
    Sharding,
    describe,
    flat_params,
    optimizers_of,
    participants,
    replica_hint,
)
from . import retention, writing


@dataclass
class PreparedSave:
    """A save staged: its protocol over the grid, the staging directory, each rank's write of
    its files and the root's manifest, with every value they need already taken from the
    optimizer."""

    steps: group_steps.CollectiveSteps
    staging: Path
    write: Callable[[Path], writing.Written]
    manifest: Callable[[writing.Reports], Manifest]


def prepare_save(
    operation: str,
    optimizer: Optimizers,
    buffers: HostBuffers,
    path: str | os.PathLike[str],
    consolidated: bool,
    max_shard_size: int | str | None,
    params: bool,
    overwrite: bool,
    keep_last: int | None,
    *,
    extra: Mapping[str, Any] | None = None,
    rank_extra: Mapping[str, Any] | None = None,
    background: bool = False,
    timeout: float | None = None,
    model: torch.nn.Module | None = None,
    local: bool = False,
) -> PreparedSave:
    """Everything of a save before the writing, in the caller's thread, so that any rank's
    failure here is every rank's: one ``stage`` step (every rank checks what it will write,
    and for a ``background`` save copies it into its host buffers, so that the optimizer may
    change as soon as this returns; the root checks that the ranks agree on the call and its
    arguments, ``path`` resolved, then creates the staging directory, and for a
    ``background`` save its mailbox), the state holders' check, the group settings, and for a
    consolidated save the full state gathered to the destination's host memory. ``local``:
    the optimizer is this process's alone (:func:`muonckpt.state.placement.check_local`), saved by
    this process alone whatever process group there is."""
    max_shard_size = settings.shard_size(max_shard_size)
    arguments = {
        "path": os.path.abspath(path),
        "consolidated": consolidated,
        "max_shard_size": max_shard_size,
        "params": params,
        "overwrite": overwrite,
        "keep_last": keep_last,
        "timeout": timeout,
        "model given": model is not None,
    }
    ranks = participants(optimizer, operation, local=local)
    hint = replica_hint(optimizer)
    group_steps.rendezvous(operation, ranks, arguments, CheckpointError, hint=hint)
    sharding = describe(optimizer, local=local)
    steps = group_steps.CollectiveSteps(
        operation, sharding.participants, sharding.destination, CheckpointError
    )
    taken: list[_Payload] = []
    collected: list[dict[int, ParamState]] = []
    described: list[ModelTensors | None] = []
    job: list[_JobState] = []

    def check() -> dict[str, Any]:
        collected.append(_collect(sharding, optimizer, params, keep_last, Path(path)))
        described.append(
            model_tensors(model, [p.name for p in sharding.params], consolidated, params)
        )
        state = _JobState.take(extra, rank_extra)
        job.append(state)
        payload = None
        if not consolidated:
            payload = _rank_payload(sharding, collected[0])
            if background:
                payload.tensors = buffers.snapshot(payload.tensors)
            taken.append(payload)
        _check_manifest(sharding, collected[0], payload, max_shard_size, Path(path))
        return state.agreement()

    mailbox = background and len(sharding.participants) > 1
    staging = writing.stage(steps, path, overwrite=overwrite, check=check, mailbox=mailbox)
    try:
        if not consolidated and len(sharding.participants) > 1:
            # Each rank writes only the state it owns: a wrong owner rule would drop the rest
            # unnoticed (the consolidated gather checks this itself).
            check_state_holders(sharding, collected[0])
        groups = _group_entries(optimizer, sharding)
        if consolidated:  # gathered into fresh host tensors: a snapshot already
            taken.append(
                _consolidated_payload(sharding, collected[0], max_shard_size, described[0])
            )
    except BaseException:
        if steps.is_root:
            writing.abandon(staging)
        raise
    (payload,), (state,) = taken, job
    me = sharding.participants.index(collectives.global_rank())
    if background:
        fetch = lambda w: payload.tensors[w.param, w.key].reshape(-1)  # noqa: E731
    else:  # streamed: each CUDA tensor through one reused host buffer
        fetch = lambda w: buffers.to_host(payload.tensors[w.param, w.key]).reshape(-1)  # noqa: E731

    def write(staging: Path) -> writing.Written:
        written = writing.Written([], [], {})
        if payload.plan is not None:
            plan = payload.plan()
            _check_plan_holds(plan, payload.tensors)
            written = writing.write_files(plan, staging, fetch, prefetch=False)
        shared = state.shared if steps.is_root else None  # stored once, by the root
        job_state = state.write(staging, shared, me, len(sharding.participants))
        written.extra = {"scalars": payload.scalars, "extra": job_state}
        return written

    kind = CONSOLIDATED if consolidated else PER_RANK
    given_step = None if extra is None else extra.get("step")
    return PreparedSave(
        steps,
        staging,
        write,
        lambda reports: build_manifest(groups, sharding, reports, kind, described[0], given_step),
    )


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
    where: Path,
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
            typed[key] = kept = state_value(param, key, value, p.numel())
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
    """What one rank of a save writes: its plan (None: nothing; a consolidated plan is made
    when it is written, in the background for a background save; a rank's own file's at the
    call, where its manifest lines are counted), the tensors by (param, key), and the scalars
    it reports for the manifest."""

    plan: Callable[[], WritePlan] | None
    tensors: dict[tuple[str, str], torch.Tensor]
    scalars: dict[str, dict[str, Any]]


def _rank_payload(sharding: Sharding, collected: Mapping[int, ParamState]) -> _Payload:
    """This rank's own pieces (its file of :func:`rank_plan`)."""
    me = collectives.global_rank()
    owned: list[Any] = []
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for param in sharding.params:
        holding = next((h for h in param.sources if h.rank == me), None)
        if holding is None:
            continue
        for key, value in _stored(collected[param.index_here]):
            if not isinstance(value, TensorValue):
                scalars.setdefault(param.name, {})[key] = _scalar_json(value)
                continue
            dtype = storage.dtype_name(value.tensor.dtype)
            owned.append(((param.name, key, dtype), holding.region))
            tensors[param.name, key] = value.tensor
    rank, world = sharding.participants.index(me), len(sharding.participants)
    plan = rank_plan(rank, world, owned)  # made at the call: its manifest lines are counted
    return _Payload(lambda: plan, tensors, scalars)


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
        return _Payload(None, {}, {})
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    items: list[Any] = []
    for name, tensor in (model.extras if model is not None else {}).items():
        value = tensor.detach().to("cpu", copy=True)  # a snapshot, as the gathered state
        items.append(((name, PARAM_KEY, storage.dtype_name(value.dtype)), tuple(value.shape)))
        tensors[name, PARAM_KEY] = value
    scalars = _consolidated_items(sharding, full, items, tensors)
    aliases = dict(model.aliases) if model is not None else None
    return _Payload(lambda: consolidated_plan(items, max_shard_size, aliases), tensors, scalars)


def _consolidated_items(
    sharding: Sharding,
    full: Mapping[int, ParamState],
    items: list[Any],
    tensors: dict[tuple[str, str], torch.Tensor],
) -> dict[str, Any]:
    """The tensors of ``full`` (by canonical index) as a consolidated plan takes them, into
    ``items`` ((param, key, dtype), full shape) and ``tensors``; their scalars, returned."""
    scalars: dict[str, Any] = {}
    for index, param in enumerate(sharding.params):
        gathered = full.get(index)
        for key, stored in _stored(gathered) if gathered is not None else ():
            if isinstance(stored, TensorValue):
                dtype = storage.dtype_name(stored.tensor.dtype)
                items.append(((param.name, key, dtype), param.full_shape))
                tensors[param.name, key] = stored.tensor
            else:
                scalars.setdefault(param.name, {})[key] = _scalar_json(stored)
    return scalars


def _check_manifest(
    sharding: Sharding,
    collected: Mapping[int, ParamState],
    payload: _Payload | None,
    max_shard_size: int | None,
    where: Path,
) -> None:
    """(each rank, in the stage step: before any data is written, a refusal every rank's)
    Refuse a save whose manifest would pass the readers' limit, counted from every param and
    the tensors and scalars this rank holds as it writes them: its own file (``payload``), or
    (None) whole in the shared files of a consolidated save. Exact in one process but for the
    groups and ``extra``; with several ranks a lower bound (the commit checks the whole
    manifest)."""
    if payload is not None:
        plan, scalars = payload.plan() if payload.plan is not None else None, payload.scalars
    else:
        held = {
            i: collected[p.index_here]
            for i, p in enumerate(sharding.params)
            if p.local_index is not None
        }
        items: list[Any] = []
        scalars = _consolidated_items(sharding, held, items, {})
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
        hyper = {k: json_safe(v) for k, v in group.items() if k not in ("params", "param_names")}
        names = tuple(sharding.params[i].name for i in sharding.members(g))
        groups.append(GroupEntry(hyperparams=hyper, params=names, optimizer=computes.to_json()))
    return groups


def build_manifest(
    groups: Sequence[GroupEntry],
    sharding: Sharding,
    reports: writing.Reports,
    kind: str,
    model: ModelTensors | None = None,
    given_step: int | None = None,
) -> Manifest:
    """The manifest of a save: params from the grid, groups as taken at the save's start,
    files, pieces, dtypes, scalars and the job's own state from the ranks' reports
    (``model``'s other tensors apart, in :class:`ModelFile`); the step ``given_step``
    (``extra["step"]``), else the optimizer's count where it keeps one."""
    scalars: dict[str, dict[str, Scalar]] = {}
    for report in reports.extras:
        for name, values in report["scalars"].items():
            for key, item in values.items():
                scalars.setdefault(name, {}).setdefault(key, Scalar(item["value"], item["dtype"]))
    extras = model.extras if model is not None else {}
    pieces = [p for p in reports.pieces if p.param not in extras]
    dtypes = reports.dtypes
    keys: dict[str, set[str]] = {}
    for piece in pieces:
        keys.setdefault(piece.param, set()).add(piece.key)
    entries = []
    for param in sharding.params:
        entries.append(
            ParamEntry(
                name=param.name,
                shape=tuple(param.full_shape),
                group=param.group,
                tp_split_dim=param.tp_split_dim,
                dtypes={k: dtypes[param.name, k] for k in sorted(keys.get(param.name, ()))},
                scalars=dict(scalars.get(param.name, {})),
            )
        )
    model_file = None
    if model is not None:
        model_file = ModelFile(
            tensors=tuple(
                model_tensor(name, t.shape, dtypes[name, PARAM_KEY]) for name, t in extras.items()
            ),
            pieces=tuple(p for p in reports.pieces if p.param in extras),
            aliases=dict(model.aliases),
        )
    manifest = Manifest(
        kind=kind,
        topology=dict(sharding.topology),
        groups=tuple(groups),
        params=tuple(entries),
        files=tuple(reports.files),
        pieces=tuple(pieces),
        model=model_file,
        extra=_merged_extra([report["extra"] for report in reports.extras]),
    )
    step = given_step if given_step is not None else manifest.step
    return replace(manifest, recorded_step=step)


def _merged_extra(parts: Sequence[dict[str, Any] | None]) -> Extra | None:
    """Every rank's part of the job's own state (in grid order) as one: the root's ``extra``,
    each rank's ``rank_extra``, all their files."""
    found = [extra_from_json(part) for part in parts if part is not None]
    if not found:
        return None
    shared = next((e.shared for e in found if e.shared is not None), None)
    ranks = tuple(tree for e in found for tree in e.ranks)
    return Extra(shared, ranks, tuple(f for e in found for f in e.files))
