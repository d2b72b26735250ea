"""Save and load an optimizer's whole training state as safetensors checkpoints.

Any optimizer muonckpt understands: the packaged Muon (single-process or ZeRO-1 + TP), one with
:func:`muonckpt.install_hooks` (KellerJordan's Muon, layer-wise layouts), or any single-process
torch optimizer. A checkpoint holds every param's optimizer state and, by default, the param's
own values (the optimizer's params: in distributed mode each rank's ZeRO-1 slice of its TP
shard, Megatron's "main params"), so a run resumes from the checkpoint alone at any dp x tp.
It is a directory: safetensors data files plus ``manifest.json``, written last as the commit
marker (docs/format.md). ``save`` writes into a staging directory beside the target and swaps it in
atomically; ``load`` asks which elements this rank owns under its own topology and reads just
those from whichever pieces hold them. Collectives come from
:mod:`muonckpt.distributed.collectives`, file I/O from :mod:`muonckpt.storage`.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import torch

from .. import events, storage
from ..distributed.mailbox import MailboxSteps
from ..distributed.steps import failure_line
from ..errors import CheckpointError, MuonCkptError
from ..files import retention, writing
from ..files.progress import Progress
from ..state.hostcopy import HostBuffers
from ..state.placement import Joined, Optimizers, optimizers_of
from ..storage.places import Location, location
from ..storage.places import target as target_text
from . import saving, tiers
from .loading import LoadReport, event, load
from .options import LocalTier, SaveOptions

__all__ = ["DEFAULT_ASYNC_TIMEOUT_S", "LoadReport", "async_save", "load", "save"]

DEFAULT_ASYNC_TIMEOUT_S: float = 1800.0
"""How long, by default, the root of a background save waits at each step for every rank (and
the others for the root, twice that) before the save fails: gloo's default process-group
timeout (NCCL's is 10 minutes)."""


def save(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    consolidated: bool = False,
    max_shard_size: int | str | None = None,
    params: bool = True,
    overwrite: bool = False,
    keep_last: int | None = None,
    model: torch.nn.Module | None = None,
    extra: Mapping[str, Any] | None = None,
    rank_extra: Mapping[str, Any] | None = None,
    local: bool = False,
    progress: Progress | None = None,
    tier: LocalTier | None = None,
) -> Location:
    """Save ``optimizer``'s state (and its params) to directory ``path``; a collective over its
    dp x tp grid, which begins with a bounded rendezvous (every rank must call it, with the same
    arguments, within :func:`muonckpt.distributed.set_rendezvous_timeout` of each
    other).

    Args:
        optimizer: a packaged :class:`~muonckpt.optim.muon.Muon`, single-process or distributed
            (every rank holding every param, or only those it owns elements of); an optimizer
            with :func:`muonckpt.install_hooks`; or any torch optimizer without hooks, in one
            process or replicated on every rank of a process group (DDP: each param's state
            written once, the ranks sharing the writing, after their digests of it are found
            equal). Also a list of such optimizers that together train a model
            (torch.optim.Muon for the matrices and AdamW for the rest): their groups are saved
            in order, as one. State and params may be in CUDA memory: each tensor is copied to
            a reused (pinned) host buffer just before it is written.
        path: target directory, or an ``s3://bucket/prefix`` URL. A local save is staged beside
            it and swapped in atomically; on S3 each rank uploads its own files under a prefix
            of the save's own and the root commits the manifest by one conditional write.
        consolidated, max_shard_size, params, overwrite, keep_last, model, extra, rank_extra,
            local: the save's options, each described where they are defined once, as the
            fields of :class:`muonckpt.checkpoint.options.SaveOptions` (``consolidated``
            gathers full-shape tensors into HF-style files; ``params=False`` leaves the params'
            values out; ``overwrite`` replaces a checkpoint; ``keep_last`` prunes the run's
            older ones; ``extra`` / ``rank_extra`` save the job's own state in the same commit;
            ``local`` saves an optimizer that is this process's alone).
        progress: a :data:`muonckpt.offline.Progress` callback, called with this rank's bytes
            and tensors written and their totals as its files are written
            (:class:`muonckpt.ProgressLines` prints them as lines for a log).
        tier: a :class:`muonckpt.LocalTier`: write the save to each node's own directory,
            each rank's files copied to ``tier.replicas`` other nodes, and to ``path`` (the
            durable target) only every ``tier.durable_every`` saves (recover with
            :func:`muonckpt.recover`).

    Returns:
        The checkpoint directory (an :class:`~muonckpt.storage.s3.S3Url` for an S3 target);
        with ``tier``, the durable one when written, else this node's local step.

    A background save of the same optimizer still in flight (:func:`async_save`) commits
    first.
    """
    options = SaveOptions(
        consolidated=consolidated,
        max_shard_size=max_shard_size,
        params=params,
        overwrite=overwrite,
        keep_last=keep_last,
        model=model,
        extra=extra,
        rank_extra=rank_extra,
        local=local,
        progress=progress,
        tier=tier,
    )
    with event("save", path, local) as logged:
        prepared, tiered = _prepare(_target(optimizer, path, local), path, options)
        return _write_and_commit(prepared.steps, prepared, path, keep_last, logged, tiered)


def _prepare(
    target: Optimizers, path: str | os.PathLike[str], options: SaveOptions
) -> tuple[saving.PreparedSave, tiers.TierSave | None]:
    """A save's steps in the caller's thread, in order: describe and agree (with a tier, the
    nodes and where the copies go: the save then stages in each node's local step), collect,
    stage (with the check of where the state is), plan (:func:`_write_and_commit` does the
    rest, here or in the background)."""
    buffers = _HOST_BUFFERS.setdefault(_key(target), HostBuffers())
    store = storage.store_for(target_text(path))
    call = saving.agree(target, path, options)
    tiered = None
    if options.tier is not None:
        tiered = tiers.prepare(options.tier, path, call.sharding.participants, options.overwrite)
        call = dataclasses.replace(call, path=tiered.final)
        store = storage.NodeStore(leader=tiered.nodes.leader)
    collected = saving.collect(call, buffers)  # this rank's values, or its refusal
    mailbox = options.background and len(call.sharding.participants) > 1
    try:
        staging, box = saving.stage(call, collected, store, mailbox)
        return saving.plan(call, collected.result(), staging, box, buffers, store), tiered
    finally:
        saving.settle(collected)  # the snapshot made before the call returns or raises


def _write_and_commit(
    steps: writing.Steps,
    prepared: saving.PreparedSave,
    final: str | os.PathLike[str],
    keep_last: int | None,
    event: events.Event,
    tiered: tiers.TierSave | None = None,
) -> Location:
    """A save's steps after :func:`_prepare`, in order: write, commit, retire, prune; in the
    caller's thread (:func:`save`) or the background (:func:`async_save`, over ``steps``
    through its mailbox); the bytes this rank wrote to ``event``. With ``tiered``, first the
    local step (:func:`muonckpt.checkpoint.tiers.commit`), then, when due, the same steps
    again into a staging directory at the durable target."""
    if tiered is not None:
        local = tiers.commit(steps, prepared, tiered)
        if not tiered.durable:
            return local
        store = storage.store_for(target_text(final))
        staging = writing.stage(steps, store, final, overwrite=tiered.overwrite)
        prepared = dataclasses.replace(prepared, staging=staging, store=store)
    written = saving.write(prepared)  # this rank's files: its report, or its failure
    if written.value is not None:
        event.bytes = sum(written.value.sizes.values())
    store, staging = prepared.store, prepared.staging
    final = target_text(final)
    replaced = writing.commit(steps, store, staging, final, written, prepared.draft)
    committed = writing.retire(steps, store, replaced, final)
    if steps.is_root and keep_last is not None:
        retention.prune(committed.parent, keep_last, keep=committed, store=store)
    return committed


def async_save(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    consolidated: bool = False,
    max_shard_size: int | str | None = None,
    params: bool = True,
    overwrite: bool = False,
    keep_last: int | None = None,
    extra: Mapping[str, Any] | None = None,
    rank_extra: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_ASYNC_TIMEOUT_S,
    model: torch.nn.Module | None = None,
    local: bool = False,
    progress: Progress | None = None,
    tier: LocalTier | None = None,
) -> Future[Location]:
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
    small messages in the default process group's store (where the ranks met: torchrun's,
    or the one ``init_process_group`` made), under keys of this save's own that rank 0
    deletes at its end, so no filesystem need be shared by the ranks for that: each rank
    reports its write there, rank 0 commits when every report is in and leaves the outcome
    for the others (:class:`muonckpt.distributed.mailbox.MailboxSteps`). Callbacks added to
    the returned future run in that background thread, so they must not use the process
    groups either.

    Args:
        optimizer, path, consolidated, max_shard_size, params, overwrite, keep_last, model,
            extra, rank_extra, local, progress, tier: as for :func:`save` (``extra`` and
            ``rank_extra`` are taken at the call: tensors copied, state dicts asked for;
            ``progress`` is called from the background thread; with ``tier``, the copies to
            other nodes are made in the background too, over the tier's own gloo group).
        timeout: seconds (positive) rank 0 waits at each step for the slowest rank before the
            save fails on every rank still there (the others wait twice that for rank 0): a
            rank whose write never finishes is an error, never a hang.

    Returns:
        A :class:`concurrent.futures.Future` whose ``result()`` is the committed checkpoint's
        path on every rank, or raises the save's error (a :class:`CheckpointError`; the same
        on every rank).

    At most one save per optimizer is in flight: a next ``async_save`` or :func:`save` of the
    same optimizer waits for this one to end first (its error stays with its own future:
    check it, as the README's loop does). At interpreter exit (the script's end, ``sys.exit``,
    an uncaught exception or KeyboardInterrupt) a save in flight is finished first
    (:func:`_finish_saves_at_exit`); a save that failed and whose error was never read
    (``result()``, ``exception()``) is then one line on stderr, and the process exits with
    code 1. A process killed meanwhile leaves the previous checkpoint at ``path`` whole, and
    an unfinished staging directory (for ``muonckpt clean``). Errors found before the
    snapshot is taken (a target that may not be written, state that cannot be stored, a bad
    ``timeout``) are raised by this call itself, on every rank.
    """
    options = SaveOptions(
        consolidated=consolidated,
        max_shard_size=max_shard_size,
        params=params,
        overwrite=overwrite,
        keep_last=keep_last,
        model=model,
        extra=extra,
        rank_extra=rank_extra,
        local=local,
        background=True,
        timeout=timeout,
        progress=progress,
        tier=tier,
    )
    logged = event("async_save", path, local)
    try:
        target = _target(optimizer, path, local)
        prepared, tiered = _prepare(target, path, options)
        return _in_background(target, prepared, path, options, logged, tiered)
    except BaseException as exc:
        logged.fail(exc)
        raise


def _in_background(
    target: Optimizers,
    prepared: saving.PreparedSave,
    path: str | os.PathLike[str],
    options: SaveOptions,
    event: events.Event,
    tiered: tiers.TierSave | None,
) -> Future[Location]:
    """Start :func:`_write_and_commit` of ``prepared`` (and its ``tiered`` local step) on a
    thread of its own, the ranks agreeing through its mailbox; its future (whose outcome
    ends ``event``)."""
    foreground = prepared.steps
    assert options.timeout is not None  # (a background save's options)
    background = MailboxSteps(
        "async_save",
        prepared.mailbox,
        foreground.ranks,
        foreground.root,
        foreground.rank,
        options.timeout,
        CheckpointError,
    )
    future = _BackgroundSave()
    future.set_running_or_notify_cancel()
    go = threading.Event()
    future.thread = threading.Thread(
        target=_finish_in_background,
        # absolute: the thread commits where the call named, whatever the working directory
        args=(future, go, background, _absolute(path), prepared, options.keep_last, event, tiered),
        name=f"muonckpt async_save {path}",
        daemon=False,  # a daemon would die unnoticed at exit; _finish_saves_at_exit waits
    )
    _UNSETTLED.add(future)  # before it starts: it removes itself once settled
    try:
        future.thread.start()
    except RuntimeError as exc:  # no thread to be had (at interpreter shutdown, say)
        _UNSETTLED.discard(future)
        if foreground.is_root:
            saving.abandon(prepared.store, prepared.staging, prepared.mailbox)
        raise CheckpointError(f"cannot start the background save: {exc}", path=path) from exc
    finally:  # always: a Ctrl-C in start() must not leave a started thread waiting for ever
        go.set()
    _IN_FLIGHT[_key(target)] = future
    if _exiting():  # (a user's atexit handler) nothing would wait for it: finish it now
        future.thread.join()
        _finish_saves_at_exit(in_atexit_handler=True)  # a failure, unread: said, exit 1
    return future


def _finish_in_background(
    future: _BackgroundSave,
    go: threading.Event,
    steps: MailboxSteps,
    final: Path | str,
    prepared: saving.PreparedSave,
    keep_last: int | None,
    event: events.Event,
    tiered: tiers.TierSave | None,
) -> None:
    """The background half of :func:`async_save`: :func:`_write_and_commit`; the outcome to
    ``future`` (and ``event``), always a library error on failure. It begins once ``go`` is
    set: a thread that ran on from its start would hold the GIL that the call, waiting in
    ``Thread.start``, needs to return (up to the interpreter's switch interval, 5 ms)."""
    go.wait()
    try:
        steps.connect()
        committed = _write_and_commit(steps, prepared, final, keep_last, event, tiered)
    except MuonCkptError as exc:
        event.fail(exc)
        future.set_exception(exc)
    except BaseException as exc:  # not a library error yet: the same rule as a step's failure
        error = CheckpointError(f"async_save: {failure_line(exc, steps.rank)}", path=final)
        error.__cause__ = exc
        event.fail(error)
        future.set_exception(error)
    else:
        event.end()
        future.set_result(committed)
    finally:
        steps.leave()
        if future.settled():
            _UNSETTLED.discard(future)


class _BackgroundSave(Future[Location]):
    """The future of one background save, which knows whether its outcome was read: a failure
    nobody read (with :meth:`result` or :meth:`exception`) is reported at exit."""

    thread: threading.Thread
    """The thread that writes and commits the save."""
    read = False
    """Whether its outcome was read once it was known."""

    def result(self, timeout: float | None = None) -> Location:
        try:
            return super().result(timeout)
        finally:
            self._was_read()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        finally:
            self._was_read()

    def _was_read(self) -> None:
        """Mark the outcome read, once there is one."""
        if self.done():
            self.read = True
            if self.settled():
                _UNSETTLED.discard(self)

    def settled(self) -> bool:
        """Its thread has ended, and it succeeded or its error was read: nothing to report."""
        if self.thread.is_alive():
            return False
        return self.read or Future.exception(self, 0) is None


def _finish_saves_at_exit(*, in_atexit_handler: bool = False) -> None:
    """(at interpreter exit) Wait for every background save still running; report each failed
    save whose error nobody read on stderr, one line, and end the process with exit code 1.

    Registered with ``threading._register_atexit`` after :mod:`concurrent.futures` (which
    :mod:`muonckpt.files.writing` imports), so it runs before concurrent.futures' own exit
    hook, which makes every ThreadPoolExecutor refuse new work ("cannot schedule new futures after
    interpreter shutdown") while the non-daemon threads still run: a save waited for only as
    a non-daemon thread failed there, and nobody saw its error. A failure must not pass for a
    clean exit (the script's own exit code is not known here: 1 stands for it); nor may a
    Ctrl-C while it waits (said, exit code 1, the staging left for ``muonckpt clean``).
    Before that exit the job's atexit handlers run (os._exit would skip them), unless this is
    called from one of them (``in_atexit_handler``: an async_save started there)."""
    try:
        for save in list(_UNSETTLED):
            save.thread.join()
        said = [
            f"a background save failed and its error was never read: {Future.exception(s, 0)}"
            for s in list(_UNSETTLED)
            if not s.settled()
        ]
    except BaseException:  # a second Ctrl-C while waiting: an exit hook must not raise
        said = [
            "interrupted at exit while a background save was being written: it may not be committed"
        ]
    if not said:
        return
    for line in said:
        print(f"muonckpt: {' '.join(line.split())}", file=sys.stderr)
    if not in_atexit_handler:  # os._exit skips them: the job's own (a logger's, a tracker's)
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream: nothing more to say there
            stream.flush()
    os._exit(1)


_UNSETTLED: set[_BackgroundSave] = set()
"""Every background save still running, or failed with its error unread, whether or not its
optimizer is still alive: what :func:`_finish_saves_at_exit` waits for and reports."""


def _exiting() -> bool:
    """Whether the interpreter's exit has begun (its threading exit hooks, ours among them,
    have run or are running): a background thread started now would be waited for by no one."""
    return bool(getattr(threading, "_SHUTTING_DOWN", False)) or sys.is_finalizing()


with contextlib.suppress(RuntimeError):  # first imported at exit (a user's atexit handler)
    threading._register_atexit(_finish_saves_at_exit)  # type: ignore[attr-defined]


_IN_FLIGHT: weakref.WeakKeyDictionary[Any, Future[Location]] = weakref.WeakKeyDictionary()
"""Per optimizer (the first of a list), its background save in flight, if any."""


def _forget_saves_in_child() -> None:
    """(a forked child) The parent's background saves are the parent's: the child has no
    thread writing them, so it neither reports them at exit nor waits for them before a save
    of its own (which would wait forever)."""
    _UNSETTLED.clear()
    _IN_FLIGHT.clear()


os.register_at_fork(after_in_child=_forget_saves_in_child)
_HOST_BUFFERS: weakref.WeakKeyDictionary[Any, HostBuffers] = weakref.WeakKeyDictionary()
"""Per optimizer (the first of a list), the host buffers its saves copy state into."""


def _absolute(path: str | os.PathLike[str]) -> Path | str:
    """``path`` as the engine takes it (:func:`muonckpt.storage.places.target`), a local
    one made absolute: a background save commits where the call named, whatever the working
    directory is by then."""
    where = target_text(path)
    return Path(os.path.abspath(where)) if isinstance(where, Path) else where


def _target(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    local: bool,
) -> Optimizers:
    """What a save of ``optimizer`` to ``path`` saves, once ``path`` is found a local path or
    an ``s3://`` URL and any background save of it in flight has ended: one optimizer, or
    several joined (:class:`Joined`)."""
    location(path)
    target: Optimizers
    if isinstance(optimizer, torch.optim.Optimizer):
        target = optimizer
    else:
        target = Joined(list(optimizer), local=local)
    _wait_in_flight(target)
    return target


def _key(optimizer: Optimizers) -> torch.optim.Optimizer:
    """What the in-flight and buffer bookkeeping of ``optimizer`` is keyed by."""
    return optimizers_of(optimizer)[0]


def _wait_in_flight(optimizer: Optimizers) -> None:
    """Wait until a background save of ``optimizer`` in flight has finished (its own future
    reports how)."""
    previous = _IN_FLIGHT.get(_key(optimizer))
    if previous is not None:
        wait([previous])
