"""The training job's own state in Lightning's ``.ckpt``, in and out
(:mod:`muonckpt.interop._trainer_state`).

Lightning's ``dump_checkpoint`` saves beside the model and the optimizers ``global_step``,
``epoch``, ``loops`` (the fit loop's progress: batches, optimizer steps, epochs),
``lr_schedulers`` (each scheduler's ``state_dict()``), ``callbacks`` (each callback's state by
its state key) and the module's ``hyper_parameters``. :func:`read` takes each that is JSON
data and tensors (ModelCheckpoint's ``kth_value`` is one), as it is; the writer
(:func:`~.writer.to_lightning`) gives them back under the same keys, which
``Trainer.fit(ckpt_path=...)`` restores: the schedule and the step go on where they were. The
file holds no per-rank state: every rank reads the same one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._trainer_state import Found, TrainerState, is_plain

__all__ = ["NAME", "SHARED", "read"]

NAME = "lightning"
SHARED = (
    "global_step", "epoch", "loops", "lr_schedulers", "callbacks", "hparams_name",
    "hyper_parameters",
)  # fmt: skip
"""The checkpoint's keys carried as they are, where they hold JSON data and tensors only."""


def read(top: Mapping[str, Any], step: int | None) -> Found:
    """The job's own state of Lightning's checkpoint ``top`` (``step``: its ``global_step``)."""
    shared = {key: top[key] for key in SHARED if key in top and is_plain(top[key], tensors=True)}
    left = tuple(
        f"{key} (not JSON data and tensors)" for key in SHARED if key in top and key not in shared
    )
    return Found(TrainerState(NAME, shared), step, frozenset(shared), left)
