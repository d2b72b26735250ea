"""Foreign checkpoint formats in and out of muonckpt's own: one module each.

A change to how another trainer's files are read or written goes here. Modules: :mod:`.dcp`
(PyTorch DCP: FSDP2 / DTensor jobs, torchtitan).
"""

from __future__ import annotations

from .dcp import LAYOUTS, DcpConversion, from_dcp, is_dcp, to_dcp

__all__ = [
    "LAYOUTS",
    "DcpConversion",
    "from_dcp",
    "is_dcp",
    "to_dcp",
]
