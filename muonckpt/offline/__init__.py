"""The offline tools: consolidate, reshard, convert, summarize (``inspect``) and diff a
checkpoint from its files alone, without an optimizer or a process group.

Modules: :mod:`.tools` (consolidate, reshard, convert; :mod:`._model` the model's other tensors
they carry), :mod:`.examine` (summarize, diff),
:mod:`.inspection` (pure: what they return).
"""

from __future__ import annotations

from ..files.pieces import open_checkpoint
from ..files.writing import Progress
from ..interop import (
    LAYOUTS,
    DcpConversion,
    DeepSpeedConversion,
    MegatronConversion,
    TrainerConversion,
    from_accelerate,
    from_dcp,
    from_deepspeed,
    from_lightning,
    from_megatron,
    is_accelerate,
    is_dcp,
    is_deepspeed,
    is_lightning,
    is_megatron,
    to_dcp,
    to_deepspeed,
    to_megatron,
)
from .examine import diff, iter_diff, summarize
from .inspection import DiffRow, Summary
from .tools import MAX_RANKS, WORKER_TIMEOUT, consolidate, convert, reshard

__all__ = [
    "LAYOUTS",
    "MAX_RANKS",
    "WORKER_TIMEOUT",
    "DcpConversion",
    "DeepSpeedConversion",
    "DiffRow",
    "MegatronConversion",
    "Progress",
    "Summary",
    "TrainerConversion",
    "consolidate",
    "convert",
    "diff",
    "from_accelerate",
    "from_dcp",
    "from_deepspeed",
    "from_lightning",
    "from_megatron",
    "is_accelerate",
    "is_dcp",
    "is_deepspeed",
    "is_lightning",
    "is_megatron",
    "iter_diff",
    "open_checkpoint",
    "reshard",
    "summarize",
    "to_dcp",
    "to_deepspeed",
    "to_megatron",
]
