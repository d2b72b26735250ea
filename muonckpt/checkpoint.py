"""Save and load an optimizer's whole training state as safetensors checkpoints.

Any optimizer muonckpt understands: the packaged Muon (single-process or ZeRO-1 + TP), one with
:func:`muonckpt.install_hooks` (KellerJordan's Muon, layer-wise layouts), or any single-process
torch optimizer. A checkpoint holds every param's optimizer state and, by default, the param's
own values (the optimizer's params: in distributed mode each rank's ZeRO-1 slice of its TP
shard, Megatron's "main params"), so a run resumes from the checkpoint alone at any dp x tp.
It is a directory: safetensors data files plus ``manifest.json``, written last as the commit
marker (docs/format.md). ``save`` writes into a staging directory beside the target and swaps it in
atomically; ``load`` asks which elements this rank owns under its own topology and reads just
those from whichever pieces hold them. Collectives come from :mod:`muonckpt.collectives`, file
I/O from :mod:`muonckpt.storage`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch

from . import collectives, kinds, retention, storage, trainstate, writing
from .errors import CheckpointError, ConversionWarning, MuonCkptError, StateDictError
from .hooks import (
    _HOOKS,
    ParamSharding,
    Sharding,
    check_state_holders,
    describe,
    describe_value,
    flat_params,
    gather_full_state,
    participants,
    remap_groups,
    value_of,
)
from .hostcopy import HostBuffers
from .layout import Region, whole_region
from .manifest import (
    CONSOLIDATED,
    EXTRA_FILE,
    MANIFEST_NAME,
    PARAM_KEY,
    PER_RANK,
    Extra,
    GroupEntry,
    Manifest,
    ModelFile,
    ParamEntry,
    Rename,
    Scalar,
    extra_rank_file,
    extra_to_json,
    json_safe,
    model_tensor,
    prefix_hint,
)
from .manifest_json import extra_from_json
from .model_state import ModelTensors, model_tensors
from .pieces import PieceReader, open_checkpoint
from .sharding import following
from .steps import describe_failure, disagreement
from .writeplan import WritePlan, consolidated_plan, rank_plan, unique_tensor_keys

DEFAULT_ASYNC_TIMEOUT_S: float = 1800.0
"""How long, by default, the root of a background save waits at each step for every rank (and
the others for the root, twice that) before the save fails: gloo's default process-group
timeout (NCCL's is 10 minutes)."""


def save(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    consolidated: bool = False,
    max_shard_size: int | None = None,
    params: bool = True,
    overwrite: bool = False,
    keep_last: int | None = None,
    model: torch.nn.Module | None = None,
    extra: Mapping[str, Any] | None = None,
    rank_extra: Mapping[str, Any] | None = None,
) -> Path:
    """Save ``optimizer``'s state (and its params) to directory ``path``; a collective over its
    dp x tp grid, which begins with a bounded rendezvous (every rank must call it, with the same
    arguments, within :func:`muonckpt.set_rendezvous_timeout` of each other).

    Args:
        optimizer: a packaged :class:`~muonckpt.Muon`, single-process or distributed (every
            rank holding every param, or only those it owns elements of); an optimizer with
            :func:`muonckpt.install_hooks`; or any torch optimizer without hooks, in one process
            or replicated on every rank of a process group (DDP: each param's state written
            once, the ranks sharing the writing, after their digests of it are found equal).
            Also a list of such optimizers that together train a model (torch.optim.Muon for
            the matrices and AdamW for the rest): their groups are saved in order, as one.
            State and params may be in CUDA memory: each tensor is copied to a reused (pinned)
            host buffer just before it is written.
        path: target directory. The save is staged beside it and swapped in atomically.
        consolidated: gather full-shape tensors on rank 0 and write the state as
            ``state.<param>.<key>`` in ``optimizer.safetensors`` and the params by name in
            ``model.safetensors`` (:func:`muonckpt.writeplan.consolidated_plan`), instead of
            one file per rank (no gathering; only metadata crosses ranks).
        max_shard_size: with ``consolidated``, split each family of files past this many bytes,
            HF style.
        params: also save the optimizer's params (the default), so that :func:`load` restores
            them; False saves the optimizer state only, for weights kept elsewhere.
        overwrite: replace an existing checkpoint at ``path`` (otherwise an error).
        keep_last: after the commit, delete the older complete muonckpt checkpoints of
            ``path``'s series beside it (directly under its parent, named as it is but for
            their numbers: ``step-10`` beside ``step-30``) so that ``keep_last`` remain, the
            new one always among them (:func:`muonckpt.retention.prune`).
        model: with ``consolidated``, the model the params belong to (the optimizer's param
            names must be its ``state_dict()`` names): ``model.safetensors`` then holds its
            whole ``state_dict()``, buffers and params no optimizer holds taken from the
            destination rank's model, tied names stored once and recorded in the file's
            metadata (alias -> stored name, as ``safetensors.torch.save_model`` does), so that
            ``safetensors.torch.load_model(model, ...)`` loads it strictly.
        extra: the training job's own state, saved in the same atomic commit: a dict of JSON
            values (numbers, strings, booleans, None, lists, dicts with string keys), tensors
            (on any device; copied to host memory at the call) and objects with
            ``state_dict()`` / ``load_state_dict()`` (an LR scheduler), saved as their state
            dict. Every rank passes the same (compared by a digest: ranks that differ fail the
            save, nothing written); rank 0 stores it. ``extra["step"]``, a non-negative int,
            is the step the checkpoint records (``inspect``, :func:`muonckpt.latest`).
        rank_extra: each rank's own values, as ``extra`` but stored per rank (RNG states:
            :class:`muonckpt.RNGState`; a data loader's position); every rank passes one, or
            none does.

    Returns:
        The checkpoint directory.

    A background save of the same optimizer still in flight (:func:`async_save`) commits
    first.
    """
    optimizer = _one(optimizer)
    _wait_in_flight(optimizer)
    prepared = _prepare_save(
        "save",
        optimizer,
        path,
        consolidated,
        max_shard_size,
        params,
        overwrite,
        keep_last,
        model=model,
        extra=extra,
        rank_extra=rank_extra,
    )
    final = writing.finish(
        prepared.steps, prepared.staging, path, write=prepared.write, manifest=prepared.manifest
    )
    if prepared.steps.is_root:
        _prune(final, keep_last)
    return final


def async_save(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    consolidated: bool = False,
    max_shard_size: int | None = None,
    params: bool = True,
    overwrite: bool = False,
    keep_last: int | None = None,
    extra: Mapping[str, Any] | None = None,
    rank_extra: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_ASYNC_TIMEOUT_S,
    model: torch.nn.Module | None = None,
) -> Future[Path]:
    """:func:`save`, returning as soon as the state and params are copied to host memory; the
    write, fsync, commit, retiring a replaced checkpoint and ``keep_last`` run in the
    background. A collective over the grid while it snapshots (every rank calls it).

    Training may step right after it returns: the checkpoint holds the values at the call.
    The snapshot goes into host buffers kept per optimizer and reused by its next save: extra
    host memory of this rank's share of the state and params (a consolidated save: the full
    state on rank 0, gathered as in :func:`save`). For CUDA state they are pinned, from
    torch's caching host allocator, which rounds each allocation up to a power of two.

    The background work never uses the job's process groups (a collective from another thread
    could deadlock with, or be reordered against, the job's own). The ranks agree through
    files in a directory beside the target, ``.NAME.steps-XXXXXXXX``, which every rank must
    see (as they must see the staging directory they write into): each rank reports its
    write there, rank 0 commits when every report is in and leaves the outcome for the others
    (:class:`muonckpt.writing.DirectorySteps`). Callbacks added to the returned future run in
    that background thread, so they must not use the process groups either.

    Args:
        optimizer, path, consolidated, max_shard_size, params, overwrite, keep_last, model,
            extra, rank_extra: as for :func:`save` (``extra`` and ``rank_extra`` are taken at
            the call: tensors copied, state dicts asked for).
        timeout: seconds (positive) rank 0 waits at each step for the slowest rank before the
            save fails on every rank still there (the others wait twice that for rank 0): a
            rank whose write never finishes is an error, never a hang.

    Returns:
        A :class:`concurrent.futures.Future` whose ``result()`` is the committed checkpoint's
        path on every rank, or raises the save's error (a :class:`CheckpointError`; the same
        on every rank).

    At most one save per optimizer is in flight: a next ``async_save`` or :func:`save` of the
    same optimizer waits for this one to end first (its error stays with its own future:
    check it, as the README's loop does). At interpreter exit a save in flight is finished (its
    thread is not a daemon); a process killed meanwhile leaves the previous checkpoint at
    ``path`` whole, and an unfinished staging directory and the mailbox beside it. Errors
    found before the snapshot is taken (a target that may not be written, state that cannot
    be stored, a bad ``timeout``) are raised by this call itself, on every rank.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise CheckpointError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if math.isinf(timeout):
        raise CheckpointError("timeout must be finite: a rank that never reports would hang")
    optimizer = _one(optimizer)
    _wait_in_flight(optimizer)
    prepared = _prepare_save(
        "async_save",
        optimizer,
        path,
        consolidated,
        max_shard_size,
        params,
        overwrite,
        keep_last,
        extra=extra,
        rank_extra=rank_extra,
        background=True,
        timeout=timeout,
        model=model,
    )
    foreground = prepared.steps
    background = writing.DirectorySteps(
        "async_save",
        storage.Mailbox(storage.mailbox_path(prepared.staging)),
        foreground.ranks,
        foreground.root,
        foreground.rank,
        timeout,
        CheckpointError,
    )
    future: Future[Path] = Future()
    future.set_running_or_notify_cancel()
    thread = threading.Thread(
        target=_finish_in_background,
        # absolute: the thread commits where the call named, whatever the working directory
        args=(future, background, Path(os.path.abspath(path)), prepared, keep_last),
        name=f"muonckpt async_save {path}",
        daemon=False,  # the interpreter waits for it at exit: a save in flight is finished
    )
    try:
        thread.start()
    except BaseException as exc:  # no thread to be had (at interpreter shutdown, say)
        if foreground.is_root:
            writing.abandon(prepared.staging)
        raise CheckpointError(f"cannot start the background save: {exc}", path=path) from exc
    _IN_FLIGHT[_key(optimizer)] = future
    return future


def _finish_in_background(
    future: Future[Path],
    steps: writing.DirectorySteps,
    final: Path,
    prepared: _PreparedSave,
    keep_last: int | None,
) -> None:
    """The background half of :func:`async_save`: write, commit, retire, prune; the outcome
    to ``future``, always a library error on failure."""
    try:
        committed = writing.finish(
            steps, prepared.staging, final, write=prepared.write, manifest=prepared.manifest
        )
        if steps.is_root:
            _prune(committed, keep_last)
    except MuonCkptError as exc:
        future.set_exception(exc)
    except BaseException as exc:  # not a library error yet: the same rule as a step's failure
        error = CheckpointError(f"async_save: {describe_failure(exc, steps.rank)}", path=final)
        error.__cause__ = exc
        future.set_exception(error)
    else:
        future.set_result(committed)
    finally:
        steps.leave()


_IN_FLIGHT: weakref.WeakKeyDictionary[Any, Future[Path]] = weakref.WeakKeyDictionary()
"""Per optimizer (the first of a list), its background save in flight, if any."""
_HOST_BUFFERS: weakref.WeakKeyDictionary[Any, HostBuffers] = weakref.WeakKeyDictionary()
"""Per optimizer (the first of a list), the host buffers its saves copy state into."""


def _one(optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> Any:
    """One optimizer, or several single-process ones joined (:class:`_Joined`)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    return _Joined(list(optimizer))


def _key(optimizer: Any) -> Any:
    """What the in-flight and buffer bookkeeping of ``optimizer`` is keyed by."""
    return optimizer.optimizers[0] if isinstance(optimizer, _Joined) else optimizer


def _wait_in_flight(optimizer: Any) -> None:
    """Wait until a background save of ``optimizer`` in flight has finished (its own future
    reports how)."""
    previous = _IN_FLIGHT.get(_key(optimizer))
    if previous is not None:
        wait([previous])


def _prune(final: Path, keep_last: int | None) -> None:
    """(the root, after a commit) Apply ``keep_last`` beside ``final``."""
    if keep_last is not None:
        retention.prune(final.parent, keep_last, keep=final)


@dataclass
class _PreparedSave:
    """A save staged: its protocol over the grid, the staging directory, each rank's write of
    its files and the root's manifest, with every value they need already taken from the
    optimizer."""

    steps: collectives.CollectiveSteps
    staging: Path
    write: Callable[[Path], writing.Written]
    manifest: Callable[[writing.Reports], Manifest]


def _prepare_save(
    operation: str,
    optimizer: Any,
    path: str | os.PathLike[str],
    consolidated: bool,
    max_shard_size: int | None,
    params: bool,
    overwrite: bool,
    keep_last: int | None,
    *,
    extra: Mapping[str, Any] | None = None,
    rank_extra: Mapping[str, Any] | None = None,
    background: bool = False,
    timeout: float | None = None,
    model: torch.nn.Module | None = None,
) -> _PreparedSave:
    """Everything of a save before the writing, in the caller's thread, so that any rank's
    failure here is every rank's: one ``stage`` step (every rank checks what it will write,
    and for a ``background`` save copies it into its host buffers, so that the optimizer may
    change as soon as this returns; the root checks that the ranks agree on the call and its
    arguments, ``path`` resolved, then creates the staging directory, and for a
    ``background`` save its mailbox), the state holders' check, the group settings, and for a
    consolidated save the full state gathered to the destination's host memory."""
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
    ranks = participants(optimizer, operation)
    collectives.rendezvous(operation, ranks, arguments, CheckpointError)
    sharding = describe(optimizer)
    steps = collectives.CollectiveSteps(
        operation, sharding.participants, sharding.destination, CheckpointError
    )
    buffers = _HOST_BUFFERS.setdefault(_key(optimizer), HostBuffers())
    taken: list[_Payload] = []
    described: list[ModelTensors | None] = []
    job: list[_JobState] = []

    def check() -> dict[str, Any]:
        _check_storable(sharding, optimizer, params, keep_last, Path(path))
        described.append(
            model_tensors(model, [p.name for p in sharding.params], consolidated, params)
        )
        state = _JobState.take(extra, rank_extra)
        job.append(state)
        if not consolidated:
            payload = _rank_payload(optimizer, sharding, params)
            if background:
                payload.tensors = buffers.snapshot(payload.tensors)
            taken.append(payload)
        return state.agreement()

    mailbox = background and len(sharding.participants) > 1
    staging = writing.stage(steps, path, overwrite=overwrite, check=check, mailbox=mailbox)
    try:
        if not consolidated and len(sharding.participants) > 1:
            # Each rank writes only the state it owns: a wrong owner rule would drop the rest
            # unnoticed (the consolidated gather checks this itself).
            check_state_holders(sharding, _local_state(optimizer, sharding, params=False))
        groups = _group_entries(optimizer, sharding)
        if consolidated:  # gathered into fresh host tensors: a snapshot already
            taken.append(
                _consolidated_payload(optimizer, sharding, max_shard_size, params, described[0])
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
            written = writing.write_files(payload.plan(), staging, fetch, prefetch=False)
        shared = state.shared if steps.is_root else None  # stored once, by the root
        job_state = state.write(staging, shared, me, len(sharding.participants))
        written.extra = {"scalars": payload.scalars, "extra": job_state}
        return written

    kind = CONSOLIDATED if consolidated else PER_RANK
    given_step = None if extra is None else extra.get("step")
    return _PreparedSave(
        steps,
        staging,
        write,
        lambda reports: build_manifest(groups, sharding, reports, kind, described[0], given_step),
    )


@dataclass
class _JobState:
    """The training job's own state of one rank's save: ``extra`` and ``rank_extra`` as
    taken at the call (:func:`muonckpt.trainstate.take`)."""

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


class _Joined:
    """Several single-process optimizers seen as one by :func:`save`: their groups in order."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise CheckpointError("no optimizer to save")
        hooked = [type(o).__name__ for o in optimizers if o in _HOOKS]
        if hooked and collectives.is_distributed() and collectives.group_size(None) > 1:
            raise CheckpointError(
                f"a list of optimizers goes into one checkpoint across ranks only as replicas "
                f"(DDP: no muonckpt hooks), and {hooked} shard their state: save a sharded "
                "optimizer on its own"
            )
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.state = {p: s for o in optimizers for p, s in o.state.items()}


def _group_kinds(optimizer: Any) -> list[kinds.GroupKind]:
    """What each group computes, by the optimizer that owns the group."""
    owners = optimizer.optimizers if isinstance(optimizer, _Joined) else [optimizer]
    return [kinds.group_kind(o, g) for o in owners for g in o.param_groups]


def _check_storable(
    sharding: Sharding,
    optimizer: torch.optim.Optimizer,
    params: bool,
    keep_last: int | None,
    where: Path,
) -> None:
    """Refuse, before writing anything, what a checkpoint could not hold or load back."""
    if keep_last is not None:
        retention.check_keep_last(keep_last)
    flat = flat_params(optimizer)
    keys = [(p.name, k) for p in sharding.params for k in p.expected_keys]
    for param in sharding.local():
        p = flat[param.index_here]
        state = optimizer.state.get(p, {})
        if PARAM_KEY in state:
            raise CheckpointError(
                f"state key {PARAM_KEY!r} is reserved for the param's values", param=param.name
            )
        for key, value in state.items():
            if not isinstance(key, str):
                raise CheckpointError(f"state key {key!r} is not a string", param=param.name)
            info = describe_value(param, key, value, p.numel())
            if info["kind"] == "tensor":
                keys.append((param.name, key))
            elif isinstance(info["value"], float) and not math.isfinite(info["value"]):
                raise CheckpointError(
                    f"state {key!r} is {info['value']}, which a JSON manifest cannot hold",
                    param=param.name,
                )
    keys += [(p.name, PARAM_KEY) for p in sharding.params] if params else []
    unique_tensor_keys(iter(keys), where)


def _local_state(
    optimizer: torch.optim.Optimizer, sharding: Sharding, params: bool
) -> dict[int, dict[str, Any]]:
    """This rank's state by its own flat param index, with each param's values under
    :data:`PARAM_KEY` when ``params``."""
    flat = flat_params(optimizer)
    local: dict[int, dict[str, Any]] = {}
    for param in sharding.local():
        p = flat[param.index_here]
        entry = dict(optimizer.state.get(p, {}))
        if params:
            entry[PARAM_KEY] = p.detach()
        local[param.index_here] = entry
    return local


def _owned(
    optimizer: torch.optim.Optimizer, sharding: Sharding, params: bool
) -> Iterator[tuple[ParamSharding, dict[str, Any]]]:
    """(param sharding, local state and values) of each param this rank must write."""
    me = collectives.global_rank()
    local = _local_state(optimizer, sharding, params)
    for param in sharding.params:
        if any(h.rank == me for h in param.sources):
            yield param, local[param.index_here]


@dataclass
class _Payload:
    """What one rank of a save writes: its plan (None: nothing; made when it is written, in
    the background for a background save), the tensors by (param, key), and the scalars it
    reports for the manifest."""

    plan: Callable[[], WritePlan] | None
    tensors: dict[tuple[str, str], torch.Tensor]
    scalars: dict[str, dict[str, Any]]


def _rank_payload(optimizer: Any, sharding: Sharding, params: bool) -> _Payload:
    """This rank's own pieces (its file of :func:`rank_plan`)."""
    me = collectives.global_rank()
    owned: list[Any] = []
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for param, state in _owned(optimizer, sharding, params):
        holding = next(h for h in param.sources if h.rank == me)
        for key, value in sorted(state.items()):
            info = describe_value(param, key, value)
            if info["kind"] != "tensor":
                scalars.setdefault(param.name, {})[key] = _scalar_json(info)
                continue
            owned.append(((param.name, key, storage.dtype_name(value.dtype)), holding.region))
            tensors[param.name, key] = value
    rank, world = sharding.participants.index(me), len(sharding.participants)
    return _Payload(lambda: rank_plan(rank, world, owned), tensors, scalars)


def _scalar_json(info: Mapping[str, Any]) -> dict[str, Any]:
    """A scalar's manifest form: its value, and its safetensors dtype if it is a 0-d tensor."""
    dtype = info.get("dtype")
    value = json_safe(info["value"])
    return {"value": value, "dtype": storage.dtype_name(getattr(torch, dtype)) if dtype else None}


def _consolidated_payload(
    optimizer: Any,
    sharding: Sharding,
    max_shard_size: int | None,
    params: bool,
    model: ModelTensors | None = None,
) -> _Payload:
    """Every param's full state gathered on the destination, which writes every file of
    :func:`consolidated_plan` (with ``model``'s other tensors and tied names); the other ranks
    write nothing."""
    full = gather_full_state(sharding, _local_state(optimizer, sharding, params))
    if full is None:
        return _Payload(None, {}, {})
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    items: list[Any] = []
    scalars: dict[str, Any] = {}
    for name, tensor in (model.extras if model is not None else {}).items():
        value = tensor.detach().to("cpu", copy=True)  # a snapshot, as the gathered state
        items.append(((name, PARAM_KEY, storage.dtype_name(value.dtype)), tuple(value.shape)))
        tensors[name, PARAM_KEY] = value
    for index, param in enumerate(sharding.params):
        for key, value in sorted(full.get(index, {}).items()):
            info = describe_value(param, key, value)
            if info["kind"] == "tensor":
                items.append(((param.name, key, storage.dtype_name(value.dtype)), param.full_shape))
                tensors[param.name, key] = value
            else:
                scalars.setdefault(param.name, {})[key] = _scalar_json(info)
    aliases = dict(model.aliases) if model is not None else None
    return _Payload(lambda: consolidated_plan(items, max_shard_size, aliases), tensors, scalars)


def _group_entries(optimizer: Any, sharding: Sharding) -> list[GroupEntry]:
    """Each group's settings, params and what it computes, as the manifest records them."""
    groups = []
    for g, (group, computes) in enumerate(
        zip(optimizer.param_groups, _group_kinds(optimizer), strict=True)
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


@dataclass
class LoadReport:
    """What :func:`load` did beyond copying bytes (also logged, and warned for settings)."""

    converted: list[str] = field(default_factory=list)
    """Momentum converted between forms, per group: which params, from which form, by what."""
    warnings: list[str] = field(default_factory=list)
    """Target settings that cannot continue the saved trajectory, and what would."""


@dataclass
class _Target:
    """The optimizer(s) to load into, and how the checkpoint's state maps onto them."""

    optimizer: Any
    """One optimizer, or a :class:`_Joined` list of them."""
    sharding: Sharding
    groups: list[dict[str, Any]]
    maps: dict[str, kinds.KeyMap] | None
    """Per param name, the key map of a load across implementations; None: same optimizer."""
    steps_in: list[str | None]
    """Per target group, where an AdamW step count goes."""


def load(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    params: bool = True,
    momentum_form: str | None = None,
    rename: Rename | None = None,
    extra: MutableMapping[str, Any] | None = None,
    rank_extra: MutableMapping[str, Any] | None = None,
) -> LoadReport:
    """Load a checkpoint of any kind and source topology into ``optimizer`` at its topology.

    Restores the optimizer state and, by default, the optimizer's params (each rank its own
    share, bitwise): a resumed run needs nothing but the checkpoint. A model whose weights are
    not the optimizer's params (the packaged Muon's shards from
    :func:`muonckpt.shard_for_groups`) gets them back too: ``load`` then calls
    :meth:`muonckpt.ShardedParams.params_to_model` itself, on every rank.

    The target may be another Muon implementation than the one that saved, or several
    optimizers that together hold every param (``[torch.optim.Muon(...),
    torch.optim.AdamW(...)]`` for a packaged Muon + AdamW checkpoint). Momentum is then
    converted between sum and EMA form by ``1 - mu`` (:mod:`muonckpt.kinds`), AdamW state and
    step counts are mapped as each optimizer keeps them, the target keeps its own settings,
    and settings that cannot continue the saved trajectory are warned about.

    Every rank reads the manifest and then only the bytes of the pieces overlapping its own
    share, verifying their checksums; memory is its share plus one piece span in flight.
    In distributed mode a collective over the grid (for optimizers without hooks in a process
    group, DDP replicas, the world: every rank reads the whole state): a bounded rendezvous
    where the ranks agree on the call and its arguments, then they agree that they opened one
    checkpoint (its resolved directory and manifest) and that every share was read, before any
    optimizer changes; any rank's failure is every rank's.

    Args:
        optimizer: an optimizer :func:`save` takes, at any topology, or a list of them.
        path: a checkpoint directory.
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
            checkpoint has are added. Every key it holds must be in the checkpoint.
        rank_extra: the same for this rank's ``rank_extra``: the values the rank of the same
            place in the grid saved. Only at the number of ranks that saved (per-rank values
            such as RNG states or data positions do not carry over to another; load without
            it there and derive them afresh, from ``extra``).

    Returns:
        A :class:`LoadReport` of the conversions made and the settings warned about.

    Raises:
        CheckpointError: naming the file and param on any damage or mismatch, before anything
            in the optimizer changes. StateDictError: for a target that cannot take the state.
    """
    targets = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    joined = targets[0] if len(targets) == 1 else _Joined(targets)
    arguments = {
        "path": os.path.abspath(path),
        "params": params,
        "momentum_form": momentum_form,
        "rename": rename if rename is None or isinstance(rename, Mapping) else _named(rename),
        "extra given": extra is not None,
        "rank_extra given": rank_extra is not None,
    }
    collectives.rendezvous("load", participants(joined, "load"), arguments, CheckpointError)
    sharding = describe(cast(torch.optim.Optimizer, joined))  # a collective the first time
    models = following(p for o in targets for p in flat_params(o)) if params else []
    steps = collectives.CollectiveSteps(
        "load", sharding.participants, sharding.destination, CheckpointError
    )
    opened: list[tuple[Path, Manifest]] = []

    def open_it() -> dict[str, Any]:
        directory, manifest = open_checkpoint(path)
        if rename is not None:
            manifest = manifest.renamed(rename)
        if params and not manifest.has_values:
            raise CheckpointError(
                "the checkpoint holds no param values (saved with params=False, or by format "
                f"version {manifest.format_version}); load it with params=False to restore "
                "the optimizer state only",
                path=directory / MANIFEST_NAME,
            )
        _check_job_state(manifest, directory, extra, rank_extra, len(sharding.participants))
        opened.append((directory, manifest))
        if len(steps.ranks) == 1:
            return {}  # nobody to agree with: no digest of a large manifest
        return {
            "checkpoint": os.path.realpath(directory),
            "manifest": manifest.digest(),
            "models that follow the params": len(models),  # each a collective below
        }

    if len(steps.ranks) > 1:  # (in one process every failure is raised as it is)
        steps.each_then_root("open", open_it, lambda opened: _agreed_load(opened, steps.ranks))
    else:
        open_it()
    (directory, manifest), report = opened[0], LoadReport()
    read: list[tuple[_Target, dict[int, dict[str, Any]], dict[int, torch.Tensor]]] = []
    me = sharding.participants.index(collectives.global_rank())

    def read_share() -> None:
        _check_prefix(manifest, sharding, directory)
        plan = _plan(joined, sharding, manifest, momentum_form, report)
        _check_covered(manifest, plan, directory)
        with PieceReader(directory, manifest) as reader:
            read.append((plan, *_read(plan, manifest, reader, params, directory)))
            asked = _read_job_state(manifest, reader, extra, rank_extra, me)
        # The job's own state first, all or nothing on this rank (a load_state_dict that
        # refuses); inside the step, so that a refusal on any rank fails every rank, each
        # putting back what it restored, before the optimizer changes.
        undo.append(trainstate.restore_all(asked))

    undo: list[trainstate.Undo] = []
    try:
        if len(steps.ranks) > 1:
            steps.each_then_root("read", read_share, lambda _: None)  # all or none change
        else:
            read_share()
    except BaseException:
        for each in undo:
            each()
        raise
    _apply(*read[0])
    for sharded in models:  # the model's weights from the loaded shards: never forgotten
        sharded.params_to_model()
    for message in report.converted:
        _LOG.info("muonckpt.load: converted %s", message)
    for message in report.warnings:
        warnings.warn(message, ConversionWarning, stacklevel=2)
    return report


_LOG = logging.getLogger("muonckpt")


def _named(function: Callable[..., Any]) -> str:
    """A function as the ranks of one call can compare it (its qualified name)."""
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', '?')}"


def _check_job_state(
    manifest: Manifest,
    directory: Path,
    extra: Mapping[str, Any] | None,
    rank_extra: Mapping[str, Any] | None,
    world: int,
) -> None:
    """A load that asks for the job's own state must find it, ``rank_extra`` at the number of
    ranks that saved it."""
    saved = manifest.extra
    where = directory / MANIFEST_NAME
    if extra is not None and (saved is None or saved.shared is None):
        raise CheckpointError(
            "the checkpoint holds no extra (saved without extra=); load it without extra=",
            path=where,
        )
    if rank_extra is None:
        return
    if saved is None or not saved.ranks:
        raise CheckpointError(
            "the checkpoint holds no rank_extra (saved without rank_extra=); load it "
            "without rank_extra=",
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
    if rank_extra is not None:
        asked.append((f"rank_extra[{rank}]", rank_extra, saved.ranks[rank]))
    for what, target, tree in asked:
        if target is None or tree is None:
            continue
        tensors = {
            t.path: storage.tensor_of_bytes(reader.read_extra(t, what), t.dtype).reshape(t.shape)
            for t in tree.tensors
        }
        saved = trainstate.rebuild(tree.values, tensors)
        lacking = trainstate.missing(target, saved, what)
        if lacking:
            raise CheckpointError(
                f"the checkpoint's {what} does not hold what the load asks for: "
                f"{'; '.join(lacking[:8])}",
                path=reader.directory / MANIFEST_NAME,
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


def _check_prefix(manifest: Manifest, sharding: Sharding, directory: Path) -> None:
    """Names that differ by a wrapper's prefix (DDP's ``module.``, torch.compile's
    ``_orig_mod.``) are refused naming the prefix and the ``rename`` that maps them."""
    hint = prefix_hint((e.name for e in manifest.params), (p.name for p in sharding.params))
    if hint is not None:
        raise CheckpointError(hint, path=directory / MANIFEST_NAME)


def _plan(
    optimizer: Any,
    sharding: Sharding,
    manifest: Manifest,
    momentum_form: str | None,
    report: LoadReport,
) -> _Target:
    source = [
        kinds.GroupKind.from_json(g.optimizer) if g.optimizer else None for g in manifest.groups
    ]
    target = _group_kinds(optimizer)
    steps_in = [k.step_in for k in target]
    same = {k.optimizer for k in target} == {k.optimizer for k in source if k is not None}
    same = same and not any(k and k.converted_from for k in source)
    if momentum_form is None and (same or None in source):
        groups = remap_groups(optimizer, _torch_groups(manifest), sharding)
        return _Target(optimizer, sharding, groups, None, steps_in)
    maps: dict[str, kinds.KeyMap] = {}
    converted: dict[tuple[int, str], list[str]] = {}
    pairs = set()
    for param in sharding.params:
        entry = manifest.param(param.name)
        origin = source[entry.group]
        if origin is None:
            raise StateDictError(
                f"param {param.name!r}: the checkpoint does not say which optimizer saved it "
                "(format 1), so it loads only into the same optimizer"
            )
        maps[param.name] = key_map = kinds.state_mapping(
            origin, target[param.group], param.name, momentum_form
        )
        if key_map.note is not None:
            converted.setdefault((param.group, key_map.note), []).append(param.name)
        pairs.add((entry.group, param.group))
    for (group, note), names in converted.items():
        where = f"{target[group].optimizer} (group {group})"
        report.converted.append(f"{where}: momentum of {len(names)} params, {note}")
    for source_group, target_group in sorted(pairs):
        where = f"{target[target_group].optimizer} (group {target_group})"
        origin = source[source_group]
        for note in kinds.trajectory_notes(origin, target[target_group]) if origin else ():
            report.warnings.append(f"{where}: {note}")
    return _Target(optimizer, sharding, _own_groups(optimizer, sharding, manifest), maps, steps_in)


def _own_groups(optimizer: Any, sharding: Sharding, manifest: Manifest) -> list[dict[str, Any]]:
    """The target's own group settings in local indices; a group that counts steps itself (the
    packaged AdamW) takes the checkpoint's count."""
    groups, start = [], 0
    computed = _group_kinds(optimizer)
    for g, (group, computes) in enumerate(zip(optimizer.param_groups, computed, strict=True)):
        settings = {k: v for k, v in group.items() if k != "params"}
        settings["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        if "step" in group or computes.step_in == "group":
            step = manifest.latest_step(p.name for p in sharding.params if p.group == g)
            if step is not None:
                settings["step"] = step
        groups.append(settings)
    return groups


def _check_covered(manifest: Manifest, plan: _Target, directory: Path) -> None:
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


def _read(
    plan: _Target, manifest: Manifest, reader: PieceReader, params: bool, directory: Path
) -> tuple[dict[int, dict[str, Any]], dict[int, torch.Tensor]]:
    """This rank's share of the state (in the target's keys) and of its params' values."""
    grouped = manifest.pieces_of()

    def read(entry: ParamEntry, key: str, region: Region) -> torch.Tensor:
        data = reader.gather(grouped[entry.name, key], entry, key, region)
        return storage.tensor_of_bytes(data, entry.dtype_of(key))

    flat = flat_params(plan.optimizer)
    state: dict[int, dict[str, Any]] = {}
    values: dict[int, torch.Tensor] = {}
    for param in plan.sharding.params:
        entry = manifest.param(param.name)
        _check_param(entry, param, directory)
        if param.local_index is None:
            continue
        p = flat[param.index_here]
        if param.local is not None and (entry.state_keys or entry.scalars):
            if plan.maps is None:
                kept = {k: read(entry, k, param.local).reshape(p.shape) for k in entry.state_keys}
                kept.update({k: _scalar_value(v) for k, v in entry.scalars.items()})
            else:
                kept = _mapped(plan, param, entry, manifest, read)
                kept = {k: v.reshape(p.shape) if k != "step" else v for k, v in kept.items()}
            state[param.local_index] = kept
        if params:
            held = param.held or whole_region(entry.numel)
            values[param.local_index] = _checked_value(
                read(entry, PARAM_KEY, held), p, entry, directory
            )
    return state, values


def _mapped(
    plan: _Target,
    param: ParamSharding,
    entry: ParamEntry,
    manifest: Manifest,
    read: Callable[[ParamEntry, str, Region], torch.Tensor],
) -> dict[str, Any]:
    """A param's state in the target's keys and forms."""
    assert plan.maps is not None  # (a load across implementations)
    key_map = plan.maps[param.name]
    out: dict[str, Any] = {}
    for key, (source_key, factor) in key_map.keys.items():
        if source_key in entry.state_keys:
            value = read(entry, source_key, param.region_here)
            out[key] = value.mul_(factor) if factor != 1.0 else value
    step = manifest.step_of(entry)
    where = plan.steps_in[param.group]
    if key_map.step and out and step is not None and where in ("tensor", "int"):
        out["step"] = torch.tensor(float(step)) if where == "tensor" else int(step)
    return out


class _Indices(list):
    """A group's param indices for ``load_state_dict``: torch asks ``index in group["params"]``
    once per state value, which on a plain list makes a load quadratic in the params."""

    def __init__(self, indices: Iterable[int]) -> None:
        super().__init__(indices)
        self._members = frozenset(self)

    def __contains__(self, index: object) -> bool:
        return index in self._members


def _apply(
    plan: _Target, state: dict[int, dict[str, Any]], values: dict[int, torch.Tensor]
) -> None:
    """Hand each optimizer its share (in its own indices), then copy the params' values."""
    owners = plan.optimizer.optimizers if isinstance(plan.optimizer, _Joined) else [plan.optimizer]
    first_group = first_param = 0
    for optimizer in owners:
        groups = plan.groups[first_group : first_group + len(optimizer.param_groups)]
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        share = {
            "state": {
                i - first_param: v
                for i, v in state.items()
                if first_param <= i < first_param + count
            },
            "param_groups": [
                {**g, "params": _Indices(i - first_param for i in g["params"])} for g in groups
            ],
        }
        hooks = _HOOKS.get(optimizer)
        if hooks is None:
            optimizer.load_state_dict(share)
        else:
            hooks.load_local_share(optimizer, share)
        flat = flat_params(optimizer)
        with torch.no_grad():
            for index, value in values.items():
                if first_param <= index < first_param + count:
                    p = flat[index - first_param]
                    p.copy_(value.reshape(p.shape))
        first_group += len(optimizer.param_groups)
        first_param += count


def _scalar_value(scalar: Scalar) -> Any:
    """A stored scalar as the optimizer had it: a 0-d tensor of its dtype, or the number."""
    if scalar.dtype is None:
        return scalar.value
    name = str(storage.torch_dtype(scalar.dtype)).removeprefix("torch.")
    return value_of({"kind": "scalar", "value": scalar.value, "dtype": name})


def _checked_value(
    value: torch.Tensor, p: torch.Tensor, entry: ParamEntry, directory: Path
) -> torch.Tensor:
    if value.dtype != p.dtype or value.numel() != p.numel():
        raise CheckpointError(
            f"saved values are {value.dtype} x {value.numel()} elements here, the optimizer's "
            f"param {p.dtype} x {p.numel()}",
            path=directory / MANIFEST_NAME,
            param=entry.name,
        )
    return value


def _torch_groups(manifest: Manifest) -> list[dict[str, Any]]:
    return [
        {**g.hyperparams, "param_names": list(g.params), "params": list(g.params)}
        for g in manifest.groups
    ]


def _check_param(entry: ParamEntry, param: ParamSharding, directory: Path) -> None:
    if param.full_shape is not None and tuple(entry.shape) != tuple(param.full_shape):
        raise CheckpointError(
            f"checkpoint shape {entry.shape} differs from the optimizer's full shape "
            f"{tuple(param.full_shape)}",
            path=directory / MANIFEST_NAME,
            param=param.name,
        )
    missing = [k for k in param.expected_keys if entry.state_keys and k not in entry.state_keys]
    if missing:
        raise CheckpointError(
            f"checkpoint lacks state key(s) {missing}",
            path=directory / MANIFEST_NAME,
            param=param.name,
        )
