"""Two writers of one path in separate processes, meeting at a barrier right before the commit.

Kept free of torch so that the ``spawn`` children start in a fraction of a second.
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
