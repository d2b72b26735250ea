"""Two writers of one path in separate processes, meeting at a barrier right before the commit:
staged by hand (:func:`racer`) or by ``muonckpt.save`` (:func:`saving_racer`).

Kept free of torch so that the ``spawn`` children of :func:`racer` start in a fraction of a
second (those of :func:`saving_racer` are forked from a test that has torch and its
optimizers already).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from muonckpt.storage import durable, transaction

DATA = "rank-00000-of-00001.safetensors"


def racer(who: str, root: str, trials: int, overwrite: bool, barrier: Any, results: Any) -> None:
    """For each trial: stage a tiny checkpoint at ``root/tNN`` (manifest and one data file,
    both naming ``who``), wait for the other writer, then commit; report the outcome."""
    for trial in range(trials):
        final = Path(root) / f"t{trial:03d}"
        try:
            staging = transaction.make_staging(final, overwrite)
            try:
                (staging / DATA).write_text(who)
                body = {"format": "muonckpt", "writer": who}
                durable.write_text_atomic(staging / "manifest.json", json.dumps(body))
                barrier.wait(timeout=30)
                replaced = transaction.swap_in(staging, final, overwrite=overwrite)
            except BaseException:
                transaction.discard(staging)
                raise
            if replaced is not None:
                transaction.retire(replaced)
            results.put((trial, who, "ok"))
        except Exception as exc:  # every outcome goes back to the test
            results.put((trial, who, f"{type(exc).__name__}: {exc}"))


def saving_racer(
    who: int, optimizer: Any, root: str, trials: int, fallback_from: int, barrier: Any, results: Any
) -> None:
    """(a forked child) For each trial: ``muonckpt.save`` of ``optimizer`` to ``root/tNN``,
    meeting the other process right before the commit (``swap_in``); report the outcome: "ok",
    or the error's type and message. From trial ``fallback_from`` on the commit takes the
    rename fallback of a kernel without ``renameat2``."""
    import muonckpt
    from muonckpt.storage import backend, transaction

    original = backend.swap_in

    def swap_in_together(*args: Any, **kwargs: Any) -> Any:
        barrier.wait(timeout=60)
        return original(*args, **kwargs)

    backend.swap_in = swap_in_together
    for trial in range(trials):
        final = Path(root) / f"t{trial:03d}"
        if trial == fallback_from:
            transaction.renameat2 = lambda *args: False
        try:
            muonckpt.save(optimizer, final)
            results.put((trial, who, "ok"))
        except Exception as exc:  # every outcome goes back to the test
            results.put((trial, who, f"{type(exc).__name__}: {exc}"))


def race(
    ctx: Any, target: Callable[..., None], args: list[tuple[Any, ...]], results: Any, trials: int
) -> dict[int, dict[Any, str]]:
    """Run ``target(*a)`` in a process of ``ctx`` for each ``a`` of ``args`` (writers that put
    ``(trial, who, outcome)`` on ``results`` for each of ``trials``); each trial's outcome by
    writer, once every writer has exited 0 (a stuck one is killed, and fails the test)."""
    procs = [ctx.Process(target=target, args=a) for a in args]
    for proc in procs:
        proc.start()
    try:
        outcomes: dict[int, dict[Any, str]] = {}
        for _ in range(len(procs) * trials):
            trial, who, outcome = results.get(timeout=120)
            outcomes.setdefault(trial, {})[who] = outcome
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert [p.exitcode for p in procs] == [0] * len(procs)
    return outcomes
