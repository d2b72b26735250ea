"""Two writers of one path in separate processes, meeting at a barrier right before the commit:
staged by hand (:func:`racer`) or by ``muonckpt.save`` (:func:`saving_racer`).

Kept free of torch so that the ``spawn`` children of :func:`racer` start in a fraction of a
second (those of :func:`saving_racer` are forked from a test that has torch and its
optimizers already).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from muonckpt import storage

DATA = "rank-00000-of-00001.safetensors"


def racer(who: str, root: str, trials: int, overwrite: bool, barrier: Any, results: Any) -> None:
    """For each trial: stage a tiny checkpoint at ``root/tNN`` (manifest and one data file,
    both naming ``who``), wait for the other writer, then commit; report the outcome."""
    for trial in range(trials):
        final = Path(root) / f"t{trial:03d}"
        try:
            staging = storage.make_staging(final, overwrite)
            try:
                (staging / DATA).write_text(who)
                body = {"format": "muonckpt", "writer": who}
                storage.write_text_atomic(staging / "manifest.json", json.dumps(body))
                barrier.wait(timeout=30)
                replaced = storage.swap_in(staging, final, overwrite=overwrite)
            except BaseException:
                storage.discard(staging)
                raise
            if replaced is not None:
                storage.retire(replaced)
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
