"""Run a function in N torch.distributed processes on this machine (gloo on CPU by default).

Used by the test suite and by ``muonckpt demo``.
Children start from a forkserver that has already imported torch, so a launch costs well under
a second per process; the parent hosts the rendezvous store on a free port chosen at run time.
The first child that raises, dies or outlives the timeout ends the whole run, and its error
becomes the parent's (one line in :attr:`DistributedRunError.summary`, the traceback after it).

No child outlives the parent, however the parent ends (SIGKILL included): each child holds the
read end of a pipe whose only write end is the parent's, and a thread of the child's that
waits on it kills the child the moment it reads end-of-file, that is, when the kernel closes
the parent's end. Children also ask for SIGKILL when their own parent, the forkserver, dies
(``PR_SET_PDEATHSIG``, Linux). The forkserver and multiprocessing's resource tracker exit by
themselves once the parent and every child are gone.
"""

from __future__ import annotations

import ctypes
import io
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeAlias

import torch

from ..errors import DistributedRunError
from . import collectives, groups

DEFAULT_WAIT: float = 1800.0
"""Seconds a rank waits for the others at one step when neither timeout is given."""

Reports: TypeAlias = "mp.Queue[tuple[int, bool, Any]]"
"""How the children report: ``(rank, True, the value as torch.save bytes)`` or ``(rank, False,
(summary, traceback))``."""

_PR_SET_PDEATHSIG = 1
_SUMMARY_CHARS = 300


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = 120.0,
    backend: str = "gloo",
    threads: int = 1,
    wait_timeout: float | None = None,
) -> list[Any]:
    """Call ``fn(*args)`` in ``world_size`` processes joined in one default process group.

    Args:
        fn: an importable (module-level) function. Its return value travels through
            ``torch.save`` and comes back through ``torch.load(weights_only=True)``, so it may
            hold tensors, numbers, strings and containers of them.
        world_size: number of processes.
        timeout: seconds for the whole run; past it every child is killed. None: no limit
            (the run ends when every rank is done, one fails, or the caller is interrupted).
        backend: torch.distributed backend.
        threads: torch intra-op threads per child (1 keeps N processes from oversubscribing).
        wait_timeout: seconds a rank may wait for the others, at the rendezvous and at each
            collective, before it fails; default ``timeout``, or :data:`DEFAULT_WAIT` without one.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        DistributedRunError: naming the failing rank, as soon as any rank fails. A rank that
            died (a signal, an exit code) is blamed rather than the ranks that then lost their
            connection to it.
    """
    if wait_timeout is None:
        wait_timeout = timeout if timeout is not None else DEFAULT_WAIT
    ctx = mp.get_context("forkserver")
    # torch._dynamo is imported on first optimizer construction: ~1.6 s per child otherwise.
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "muonckpt"])
    store = groups.host_store(world_size, timedelta(seconds=wait_timeout))
    results: Reports = ctx.Queue()
    lifeline, keep = ctx.Pipe(duplex=False)  # children read; only this process holds ``keep``
    procs = [
        ctx.Process(
            target=_child,
            args=(
                fn,
                args,
                rank,
                world_size,
                store.port,
                backend,
                threads,
                wait_timeout,
                results,
                lifeline,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        lifeline.close()  # every child has its own copy now
        deadline = None if timeout is None else time.monotonic() + timeout
        return _collect(procs, results, world_size, deadline, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join(timeout=10)
        keep.close()
        lifeline.close()
        del store


def _collect(
    procs: list[Any],
    results: Reports,
    world_size: int,
    deadline: float | None,
    timeout: float | None,
) -> list[Any]:
    values: dict[int, Any] = {}
    failures: dict[int, tuple[str, str]] = {}
    quiet_exit: dict[int, float] = {}  # rank -> when it was seen exited 0 with no result yet
    while len(values) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for r, p in enumerate(procs) if r not in values):
                raise _failure(procs, results, failures, world_size) from None
            now = time.monotonic()
            for r, p in enumerate(procs):
                if p.exitcode == 0 and r not in values:
                    quiet_exit.setdefault(r, now)
            late = [r for r, since in quiet_exit.items() if r not in values and now - since > 5]
            if late:
                raise DistributedRunError(
                    f"rank {late[0]} of {world_size} exited without a result", rank=late[0]
                ) from None
            if deadline is not None and now > deadline:
                pending = sorted(set(range(world_size)) - set(values))
                raise DistributedRunError(
                    f"timed out after {timeout:.0f}s waiting for ranks {pending}"
                ) from None
            continue
        if not ok:
            failures[rank] = payload
            raise _failure(procs, results, failures, world_size)
        values[rank] = torch.load(io.BytesIO(payload), weights_only=True)
    return [values[r] for r in range(world_size)]


def _failure(
    procs: list[Any],
    results: Reports,
    failures: dict[int, tuple[str, str]],
    world_size: int,
    grace: float = 1.0,
) -> DistributedRunError:
    """The error of the first real failure, after ``grace`` seconds (or until every child has
    exited) for the other ranks' reports and exits to arrive: an error of its own in some rank
    first, then a death, then an error that only says a peer went away."""
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            rank, ok, payload = results.get(timeout=0.05)
        except queue.Empty:
            if all(p.exitcode is not None for p in procs):
                break
            continue
        if not ok:
            failures.setdefault(rank, payload)
    own = [r for r, (summary, _) in failures.items() if not collectives.PEER_LOST.search(summary)]
    if own:
        summary, details = failures[own[0]]
        return DistributedRunError(
            f"rank {own[0]} of {world_size} failed: {summary}", details, rank=own[0]
        )
    deaths = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    deaths = [(r, code) for r, code in deaths if r not in failures]
    if deaths:
        rank, code = deaths[0]
        how = f"exited with code {code}"
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        return DistributedRunError(
            f"rank {rank} of {world_size} {how}, without an error report", rank=rank
        )
    rank = next(iter(failures))
    summary, details = failures[rank]
    return DistributedRunError(f"rank {rank} of {world_size} failed: {summary}", details, rank=rank)


def _summary(exc: BaseException) -> str:
    """``Type: first line of the message``, at most :data:`_SUMMARY_CHARS` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__
    if len(text) > _SUMMARY_CHARS:
        text = text[: _SUMMARY_CHARS - 3] + "..."
    return text


def _die_with_parent(lifeline: Any) -> None:
    """Kill this child as soon as the launching process is gone (see the module docstring)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (AttributeError, OSError):  # not Linux: the lifeline alone
        pass

    def watch() -> None:
        try:
            while True:
                lifeline.recv_bytes()  # the parent never sends: this ends at end-of-file
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="muonckpt-lifeline", daemon=True).start()


def _finish_threads() -> None:
    """Wait for the threads ``fn`` left running that are not daemons (a background save in
    flight), as the interpreter does at exit: once this child has reported, the parent ends
    it."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    wait_timeout: float,
    results: Reports,
    lifeline: Any,
) -> None:
    _die_with_parent(lifeline)
    torch.set_num_threads(threads)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        store = groups.tcp_store(
            "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=wait_timeout)
        )
        groups.join_default_group(backend, store, rank, world_size, timedelta(seconds=wait_timeout))
        value = fn(*args)
        _finish_threads()
        groups.leave_default_group()
    except BaseException as exc:
        results.put((rank, False, (_summary(exc), traceback.format_exc())))
        return
    buffer = io.BytesIO()
    torch.save(value, buffer)
    results.put((rank, True, buffer.getvalue()))
