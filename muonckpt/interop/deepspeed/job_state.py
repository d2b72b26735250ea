"""The training job's own state in DeepSpeed's checkpoints, in and out
(:mod:`muonckpt.interop._trainer_state`).

DeepSpeed's ``save_checkpoint`` writes the engine's counters (``global_steps``,
``global_samples``, ``skipped_steps``) and its LR scheduler's ``state_dict()``
(``lr_scheduler``, ``None`` without one) into the model states file (at ZeRO-3 every rank's,
the same in each); :func:`read` takes those that are JSON data as they are, :func:`values`
gives them back for the model states files a writer makes, where ``load_checkpoint`` restores
the scheduler and the step. Nothing per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._trainer_state import Carried, Found, TrainerState, is_plain

__all__ = ["NAME", "SHARED", "read", "values"]

NAME = "deepspeed"
SHARED = ("lr_scheduler", "global_steps", "global_samples", "skipped_steps")
"""The model states' keys carried as they are, where they hold JSON data (and tensors)."""


def read(model: Mapping[str, Any], step: int | None) -> Found:
    """The job's own state of DeepSpeed's model states ``model`` (rank 0's)."""
    shared = {k: model[k] for k in SHARED if k in model and is_plain(model[k], tensors=True)}
    left = tuple(
        f"{k} (not JSON data and tensors)" for k in SHARED if k in model and k not in shared
    )
    return Found(TrainerState(NAME, shared), step, frozenset(shared), left)


def values(state: Carried) -> dict[str, Any]:
    """The model states' keys of a carried DeepSpeed job state."""
    return {k: state.shared[k] for k in SHARED if k in state.shared}
