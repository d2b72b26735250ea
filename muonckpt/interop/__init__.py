"""Foreign checkpoint formats in and out of muonckpt's own: one module each, one registry.

A change to how another trainer's files are read or written goes in that format's module.
Modules: :mod:`.foreign` (the interface every format fills in: :class:`ForeignFormat`, and the
:class:`Conversion` it reports), :mod:`.registry` (:data:`FORMATS`, found by name or by their
files), :mod:`.routes` (which conversion ``muonckpt convert``'s options ask for), and the
formats: :mod:`.dcp` (PyTorch DCP: FSDP2 / DTensor jobs, torchtitan) and :mod:`.deepspeed`
(DeepSpeed ZeRO-1/2 with its Muon, at any world size; its writer in :mod:`._deepspeed_out`)
and :mod:`.megatron` (Megatron-Core's torch_dist, its layer-wise Muon at any TP and DP; its
writer in :mod:`._megatron_out`), and, read only, :mod:`.accelerate` (Hugging Face accelerate's
``save_state``) and :mod:`.lightning` (Lightning's ``.ckpt``) of torch.optim.Muon + AdamW jobs,
both through :mod:`._torch_optim`. What the readers share is :mod:`._consolidated`'s, what the
writers share :mod:`._foreign_out`'s.
"""

from __future__ import annotations

from ._torch_optim import TrainerConversion
from .accelerate.reader import from_accelerate, is_accelerate
from .dcp.reader import LAYOUTS, DcpConversion, from_dcp, is_dcp, to_dcp
from .deepspeed.reader import DeepSpeedConversion, from_deepspeed, is_deepspeed, to_deepspeed
from .foreign import Conversion, ForeignFormat
from .lightning.reader import from_lightning, is_lightning
from .megatron.reader import MegatronConversion, from_megatron, is_megatron, to_megatron
from .registry import FORMATS, detect, format_named, reading
from .routes import MUONCKPT, Route, route

__all__ = [
    "FORMATS",
    "LAYOUTS",
    "MUONCKPT",
    "Conversion",
    "DcpConversion",
    "DeepSpeedConversion",
    "ForeignFormat",
    "MegatronConversion",
    "Route",
    "TrainerConversion",
    "detect",
    "format_named",
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
    "reading",
    "route",
    "to_dcp",
    "to_deepspeed",
    "to_megatron",
]
