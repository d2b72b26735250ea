"""Run a function in N torch.distributed processes on this machine (gloo on CPU by default).

Used by the test suite and by ``muonckpt demo``. Children start from a forkserver that has
already imported torch, so a launch costs well under a second per process; the parent hosts
the rendezvous store on a free port chosen at run time. The first child that raises, dies or
outlives the timeout ends the whole run, and its traceback becomes the parent's error.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import MuonCkptError


class DistributedRunError(MuonCkptError, RuntimeError):
    """A child process raised, crashed or timed out."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    threads: int = 1,
) -> list[Any]:
    """Call ``fn(*args)`` in ``world_size`` processes joined in one default process group.

    Args:
        fn: an importable (module-level) function. Its return value travels through
            ``torch.save`` and comes back through ``torch.load(weights_only=True)``, so it may
            hold tensors, numbers, strings and containers of them.
        world_size: number of processes.
        timeout: seconds for the whole run; past it every child is killed.
        backend: torch.distributed backend.
        threads: torch intra-op threads per child (1 keeps N processes from oversubscribing).

    Returns:
        Each rank's return value, in rank order.

    Raises:
        DistributedRunError: with the failing rank's traceback, as soon as any rank fails.
    """
    ctx = mp.get_context("forkserver")
    # torch._dynamo is imported on first optimizer construction: ~1.6 s per child otherwise.
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "muonckpt"])
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )
    results: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, args, rank, world_size, store.port, backend, threads, timeout, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results, world_size, time.monotonic() + timeout, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        del store


def _collect(
    procs: list[Any], results: mp.Queue, world_size: int, deadline: float, timeout: float
) -> list[Any]:
    values: dict[int, Any] = {}
    while len(values) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [
                r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values
            ]
            if dead:
                _drain_then_raise(results, dead[0], f"exited with code {procs[dead[0]].exitcode}")
            if time.monotonic() > deadline:
                pending = sorted(set(range(world_size)) - set(values))
                raise DistributedRunError(
                    f"timed out after {timeout:.0f}s waiting for ranks {pending}"
                ) from None
            continue
        if not ok:
            raise DistributedRunError(f"rank {rank} of {world_size} failed:\n{payload}")
        values[rank] = torch.load(io.BytesIO(payload), weights_only=True)
    return [values[r] for r in range(world_size)]


def _drain_then_raise(results: mp.Queue, rank: int, why: str) -> None:
    """Prefer a traceback some rank already reported over a bare exit code."""
    try:
        while True:
            other, ok, payload = results.get(timeout=0.5)
            if not ok:
                raise DistributedRunError(f"rank {other} failed:\n{payload}")
    except queue.Empty:
        raise DistributedRunError(f"rank {rank} {why} without a traceback") from None


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    timeout: float,
    results: mp.Queue,
) -> None:
    torch.set_num_threads(threads)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout)
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        value = fn(*args)
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    buffer = io.BytesIO()
    torch.save(value, buffer)
    results.put((rank, True, buffer.getvalue()))
