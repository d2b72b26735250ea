"""The one interface of a foreign checkpoint format: what :mod:`.registry` holds for each.

A format is a :class:`ForeignFormat` record made by its own module (``interop/dcp.py``'s
``FORMAT``): how to recognise its checkpoints, a reader that writes one as a consolidated
muonckpt checkpoint, and a writer that writes any muonckpt checkpoint as one; both report
what they did as a :class:`Conversion`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Conversion", "ForeignFormat"]


@dataclass(frozen=True)
class Conversion:
    """What a foreign format's reader or writer wrote, and what it left out."""

    path: Path
    layout: str
    """How the foreign checkpoint is laid out (its own words: DCP's ``torchtitan``)."""
    left_out: tuple[str, ...]
    """Items of the source that the output does not hold (schedulers, dataloaders, buffers)."""
    converted: tuple[str, ...]
    """The momentum conversions, one line per group."""


@dataclass(frozen=True)
class ForeignFormat:
    """A checkpoint format of another trainer, in and out of muonckpt's own.

    ``read(src, dst, *, source, to, overwrite=False, progress=None, **read_options)`` writes
    the foreign checkpoint ``src``, saved by the implementation ``source`` (one of
    :attr:`sources`: the files do not say), as a consolidated muonckpt checkpoint ``dst`` for
    the muonckpt family ``to`` (:data:`muonckpt.format.kinds.FAMILIES`).
    ``write(src, dst, *, to, **write_options)`` writes the muonckpt checkpoint ``src`` as a new
    foreign checkpoint ``dst`` for the implementation ``to`` (one of :attr:`targets`), never
    over an existing one. Both stream, and return a :class:`Conversion`.
    """

    name: str
    """What ``convert --format`` calls it: ``dcp``."""
    title: str
    """How messages call it: ``DCP``."""
    detect: Callable[[str | os.PathLike[str]], bool]
    """Whether a path is a checkpoint of this format (cheap: a file's presence, never a read)."""
    read: Callable[..., Conversion]
    write: Callable[..., Conversion]
    sources: tuple[str, ...]
    """The implementations whose checkpoints :attr:`read` takes (``convert --from``)."""
    targets: tuple[str, ...]
    """The implementations :attr:`write` writes for (``convert --to`` with ``--format``)."""
    read_options: tuple[str, ...] = ()
    """The keyword options of :attr:`read` beyond the common ones, as ``convert`` passes them
    (``model_prefix``: ``--model-prefix``)."""
    write_options: Mapping[str, tuple[str, ...] | None] = field(default_factory=dict)
    """The keyword options of :attr:`write` beyond ``to``, each with its choices, as
    ``convert`` passes and checks them (``layout``: ``--layout``); None: any value, which
    :attr:`write` checks (``world``: ``--world``)."""
    records_source: bool = False
    """Whether its checkpoints say which implementation wrote them (DeepSpeed's: its one
    :attr:`sources`): then ``--from`` may be left out, and without ``--to`` :attr:`read`
    keeps the state in that implementation's own form."""
