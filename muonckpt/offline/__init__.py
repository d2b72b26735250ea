"""The offline tools: consolidate, reshard, convert, summarize (``inspect``) and diff a
checkpoint from its files alone, without an optimizer or a process group. (Foreign formats in
and out are :mod:`muonckpt.interop`'s.)

Modules: :mod:`.tools` (consolidate, reshard, convert; :mod:`._model` the model's other tensors
they carry), :mod:`.examine` (summarize, diff), :mod:`.doctor` (what the values show:
``muonckpt.doctor``),
:mod:`.inspection` (pure: what they return).
"""

from __future__ import annotations

from ..files.pieces import open_checkpoint
from ..files.progress import Progress
from .examine import diff, iter_diff, summarize
from .inspection import (
    Compared,
    Diagnosis,
    DiffRow,
    Finding,
    ModelCompared,
    Summary,
    TensorHealth,
)
from .tools import WORKER_TIMEOUT, consolidate, convert, reshard

__all__ = [
    "WORKER_TIMEOUT",
    "Compared",
    "Diagnosis",
    "DiffRow",
    "Finding",
    "ModelCompared",
    "Progress",
    "Summary",
    "TensorHealth",
    "consolidate",
    "convert",
    "diff",
    "iter_diff",
    "open_checkpoint",
    "reshard",
    "summarize",
]
