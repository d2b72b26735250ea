"""Every foreign format muonckpt reads and writes, and how one is found: by its name
(``convert --format``) or by its files (``convert SRC``).

Adding a format is one module in this package that makes its
:class:`~muonckpt.interop.foreign.ForeignFormat`, and its line in :data:`FORMATS`.
"""

from __future__ import annotations

import os

from ..errors import OptionError
from .accelerate import reader as accelerate
from .dcp import reader as dcp
from .deepspeed import reader as deepspeed
from .foreign import ForeignFormat
from .lightning import reader as lightning
from .megatron import reader as megatron
from .torchtitan import reader as torchtitan

__all__ = ["FORMATS", "detect", "format_named", "reading"]

FORMATS: tuple[ForeignFormat, ...] = (
    megatron.FORMAT,
    torchtitan.FORMAT,
    dcp.FORMAT,
    deepspeed.FORMAT,
    accelerate.FORMAT,
    lightning.FORMAT,
)
"""Every foreign format, in the order :func:`detect` asks them: a format built on another
(one whose checkpoints are also the other's) before that one."""


def format_named(name: str) -> ForeignFormat:
    """The foreign format called ``name`` (``dcp``, ``deepspeed``)."""
    for format_ in FORMATS:
        if format_.name == name:
            return format_
    names = ", ".join(f.name for f in FORMATS)
    raise OptionError(f"no foreign format {name!r}: choose one of {names}", "--format")


def detect(path: str | os.PathLike[str]) -> ForeignFormat | None:
    """The foreign format whose checkpoint ``path`` is, or None (a muonckpt checkpoint, or
    nothing muonckpt reads)."""
    return next((f for f in FORMATS if f.detect(path)), None)


def reading(path: str | os.PathLike[str], source: str) -> ForeignFormat | None:
    """The format that reads ``path``, saved by the implementation ``source``: the one that
    recognises it, else the first that reads checkpoints of ``source`` (which then says why
    ``path`` is not one of them: an unfinished save, say), else None. (A torchtitan ``step-N``
    directory is plain DCP: DCP's reader takes it with ``--from torchtitan``; its folder is
    torchtitan's.)"""
    return detect(path) or next((f for f in FORMATS if source in f.sources), None)
