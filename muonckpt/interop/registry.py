"""Every foreign format muonckpt reads and writes, and how one is found: by its name
(``convert --format``) or by its files (``convert SRC``).

Adding a format is one folder in this package whose ``FORMAT`` is its
:class:`~muonckpt.interop.foreign.ForeignFormat`, and its line in :data:`FORMATS`.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import OptionError
from . import accelerate, dcp, deepspeed, lightning, megatron, torchtitan
from .foreign import ForeignFormat

__all__ = ["FORMATS", "detect", "format_named"]

FORMATS: tuple[ForeignFormat[Any, Any], ...] = (
    megatron.FORMAT,
    torchtitan.FORMAT,
    dcp.FORMAT,
    deepspeed.FORMAT,
    accelerate.FORMAT,
    lightning.FORMAT,
)
"""Every foreign format, in the order :func:`detect` asks them: a format built on another
(one whose checkpoints are also the other's) before that one."""


def format_named(name: str) -> ForeignFormat[Any, Any]:
    """The foreign format called ``name`` (``dcp``, ``deepspeed``)."""
    for format_ in FORMATS:
        if format_.name == name:
            return format_
    names = ", ".join(f.name for f in FORMATS)
    raise OptionError(f"no foreign format {name!r}: choose one of {names}", "--format")


def detect(path: str | os.PathLike[str]) -> ForeignFormat[Any, Any] | None:
    """The foreign format whose checkpoint ``path`` is, or None (a muonckpt checkpoint, or
    nothing muonckpt reads)."""
    return next((f for f in FORMATS if f.detect(path)), None)
