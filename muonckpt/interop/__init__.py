"""Foreign checkpoint formats in and out of muonckpt's own: one folder each, one registry.

A change to how another trainer's files are read or written goes in that format's folder,
which holds its file parsing, its partition math, its reader and its writer:
:mod:`.dcp` (PyTorch DCP: FSDP2 / DTensor jobs), :mod:`.torchtitan` (torchtitan's DistMuon,
through DCP), :mod:`.deepspeed` (DeepSpeed ZeRO-1/2/3 with its Muon, at any world size),
:mod:`.megatron` (Megatron-Core's torch_dist and torch formats, its layer-wise Muon at any TP
and DP), :mod:`.accelerate` (Hugging Face accelerate's ``save_state``) and
:mod:`.lightning` (Lightning's ``.ckpt``) of torch.optim.Muon + AdamW jobs. Shared by them:
:mod:`.foreign` (the interface each fills in: :class:`ForeignFormat` with its options as a
dataclass, the :class:`Conversion` it reports), :mod:`.registry` (:data:`FORMATS`, found by
name or by their files), what the readers write through (:mod:`._consolidated`), what the
writers share (:mod:`._foreign_out`), the values taken from a foreign pickle (:mod:`._fields`)
and torch optimizers' state dicts by param index, in (:mod:`._torch_optim`) and out
(:mod:`._torch_optim_out`).
"""

from __future__ import annotations

from .accelerate import from_accelerate, is_accelerate, to_accelerate
from .dcp import LAYOUTS, from_dcp, is_dcp, to_dcp
from .deepspeed import from_deepspeed, is_deepspeed, to_deepspeed
from .foreign import Conversion, ForeignFormat, NoOptions, Reading
from .lightning import from_lightning, is_lightning, to_lightning
from .megatron import from_megatron, is_megatron, to_megatron
from .registry import FORMATS, detect, format_named
from .torchtitan import from_torchtitan, is_torchtitan, to_torchtitan

__all__ = [
    "FORMATS",
    "LAYOUTS",
    "Conversion",
    "ForeignFormat",
    "NoOptions",
    "Reading",
    "detect",
    "format_named",
    "from_accelerate",
    "from_dcp",
    "from_deepspeed",
    "from_lightning",
    "from_megatron",
    "from_torchtitan",
    "is_accelerate",
    "is_dcp",
    "is_deepspeed",
    "is_lightning",
    "is_megatron",
    "is_torchtitan",
    "to_accelerate",
    "to_dcp",
    "to_deepspeed",
    "to_lightning",
    "to_megatron",
    "to_torchtitan",
]
