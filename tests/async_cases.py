"""Background-save phases run inside gloo children, on the suite's fixture model."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import muonckpt
from muonckpt.distributed import launch
from muonckpt.files import writing

from .fixture_model import build, initial_params, train
from .world_signals import announce, await_event


def _trash(opt: muonckpt.optim.muon.Muon) -> None:
    """Every state tensor and param of ``opt`` overwritten in place, as steps would."""
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                p.fill_(math.nan)
                for value in opt.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        value.fill_(math.nan)


def snapshot_phase(
    dp: int, tp: int, steps: int, more: int, ref: str, ckpt: str, consolidated: bool
) -> str:
    """Train, save synchronously to ``ref``, start a background save to ``ckpt``, then go on
    training and overwrite everything in place before waiting for it."""
    opt, sharded, dp_rank, tp_rank = build(dp, tp, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, steps)
    muonckpt.save(opt, ref, consolidated=consolidated)
    future = muonckpt.async_save(opt, ckpt, consolidated=consolidated)
    train(opt, sharded, dp_rank, tp_rank, steps, more)
    _trash(opt)
    return str(future.result(timeout=60))


def failing_rank_phase(
    ckpt: str, failing_rank: int, how: str, timeout: float, overwrite: bool = True
) -> str:
    """Save once, then save in the background (over it with ``overwrite``, else beside it, to
    ``ckpt-new``) with one rank's write failing (``"raise"``: an OSError; ``"stall"``: it
    waits until the other rank has given up on it first); the error's message on this rank."""
    opt, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 1)
    muonckpt.save(opt, ckpt)
    train(opt, sharded, dp_rank, tp_rank, 1, 1)
    if dist.get_rank() == failing_rank:
        original = writing.write_files

        def write_files(*args, **kwargs):
            if how == "raise":
                raise OSError(28, "No space left on device")
            await_event("gave up on the stalled rank")
            return original(*args, **kwargs)

        writing.write_files = write_files
    target = ckpt if overwrite else f"{ckpt}-new"
    future = muonckpt.async_save(opt, target, overwrite=overwrite, timeout=timeout)
    try:
        future.result(timeout=60)
    except muonckpt.CheckpointError as exc:
        message = str(exc)
    else:
        message = "no error"
    if dist.get_rank() != failing_rank:
        announce("gave up on the stalled rank")
    dist.barrier()
    return message


def keep_last_phase(root: str, saves: int, keep_last: int) -> list[int]:
    """A background save after each step into ``root/step-N`` with ``keep_last``; the steps
    of the checkpoints left, as ``latest`` sees the newest."""
    opt, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
    futures = []
    for step in range(saves):
        train(opt, sharded, dp_rank, tp_rank, step, 1)
        futures.append(muonckpt.async_save(opt, f"{root}/step-{step + 1}", keep_last=keep_last))
    futures[-1].result(timeout=60)
    dist.barrier()
    newest = muonckpt.latest(root)
    return [muonckpt.read_manifest(newest).step, int(all(f.done() for f in futures))]


def unwaited_phase(ckpt: str) -> int:
    """Start a background save and return without waiting for it (as a job's last line); its
    write starts only once the launcher has this function's result and waits for the threads
    it left (``launch._finish_threads``)."""
    opt, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 2)
    original, finish_threads = writing.write_files, launch._finish_threads
    returned = threading.Event()

    def finishing_threads() -> None:
        returned.set()
        finish_threads()

    def write_files(*args, **kwargs):
        if not returned.wait(timeout=60):
            raise TimeoutError("the launcher did not wait for this save within 60 s")
        return original(*args, **kwargs)

    launch._finish_threads = finishing_threads
    writing.write_files = write_files
    muonckpt.async_save(opt, ckpt)
    return dist.get_rank()


def disagreeing_phase(ckpt: str, argument: str) -> str:
    """Save once, then save over it with rank 1 calling differently (``argument``); the
    error's message on this rank."""
    opt, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 1)
    muonckpt.save(opt, ckpt)
    train(opt, sharded, dp_rank, tp_rank, 1, 1)
    odd = dist.get_rank() == 1
    call, options = muonckpt.async_save, {"overwrite": True}
    if argument == "params":
        options["params"] = not odd
    elif argument == "path":
        ckpt = f"{ckpt}-rank1" if odd else ckpt
    elif argument == "consolidated":
        options["consolidated"] = odd
    elif argument == "call":
        call = muonckpt.save if odd else muonckpt.async_save
    elif argument == "overwrite":
        options["overwrite"] = not odd
    elif argument == "model given":  # the model on one rank only (a consolidated save)
        options["consolidated"] = True
        options["model"] = torch.nn.Module() if odd else None
    elif argument == "load" and odd:  # one rank saving while the other loads
        call, options = muonckpt.load, {}
    try:
        outcome = call(opt, ckpt, **options)
        if not isinstance(outcome, Path):
            outcome.result(timeout=60)
    except muonckpt.CheckpointError as exc:
        return str(exc)
    return "no error"


def store_keys_phase(root: str) -> list[Any]:
    """Two optimizers' background saves in flight together, then a third save of the first
    optimizer (which waits for its first): the steps of what each committed, and the keys of
    background saves left in the process group's store (none: the root deletes them)."""
    first, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
    train(first, sharded, dp_rank, tp_rank, 0, 1)
    second = build(2, 1, initial_params())[0]
    futures = [
        muonckpt.async_save(first, f"{root}/a", extra={"step": 1}),
        muonckpt.async_save(second, f"{root}/b", extra={"step": 0}),
    ]
    futures.append(muonckpt.async_save(first, f"{root}/c", extra={"step": 2}))
    steps = [muonckpt.read_manifest(f.result(timeout=60)).step for f in futures]
    for future in futures:  # the root deletes the keys after the outcome: once all have left
        future.thread.join(timeout=60)
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return [steps, [key for key in store.list_keys() if "muonckpt/async_save" in key]]
