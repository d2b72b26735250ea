"""The one interface of a foreign checkpoint format: what :mod:`.registry` holds for each.

A format is a :class:`ForeignFormat` record made by its own folder (``interop/dcp/``'s
``FORMAT``): how to recognise its checkpoints, a reader that writes one as a consolidated
muonckpt checkpoint, and a writer that writes any muonckpt checkpoint as one, each with its
options as a frozen dataclass of that format whose fields are its function's keywords; both
report what they did as a :class:`Conversion`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Generic, TypeVar

from ..events import Event
from ..files.progress import Progress
from ..storage import access

__all__ = ["Conversion", "ForeignFormat", "NoOptions", "Reading"]

R = TypeVar("R")
W = TypeVar("W")


@dataclass(frozen=True)
class Conversion:
    """What a foreign format's reader or writer wrote, and what it left out."""

    path: Path
    layout: str
    """How the foreign checkpoint is laid out, in its format's words: DCP's ``torchtitan``,
    ``recipe`` or ``prefixes MODEL / OPTIMIZER``; DeepSpeed's ``ZeRO-S, world N``; Megatron's
    sharding format (``dp_reshardable``, ``fully_reshardable``) and, written, its TP and DP;
    accelerate's and Lightning's optimizers and how their params were named."""
    left_out: tuple[str, ...]
    """Items of the source that the output does not hold (schedulers, dataloaders, buffers)."""
    converted: tuple[str, ...]
    """The momentum conversions, one line per group."""
    written: tuple[int, int] | None = None
    """(a foreign checkpoint written, by :meth:`ForeignFormat.write`) Its files: how many, and
    their bytes."""


@dataclass(frozen=True)
class NoOptions:
    """The options of a reader or writer that takes none beyond the common ones."""


@dataclass(frozen=True)
class Reading:
    """What every reader is asked beside its format's own options: ``source``, the
    implementation that saved the checkpoint (one of :attr:`ForeignFormat.sources`: the files
    do not say), ``to``, the muonckpt family it is converted for
    (:data:`muonckpt.format.FAMILIES`; None: the source's own form where the format keeps
    it), whether ``dst`` may be replaced, and a progress callback."""

    source: str
    to: str | None
    overwrite: bool = False
    progress: Progress | None = None


@dataclass(frozen=True)
class ForeignFormat(Generic[R, W]):
    """A checkpoint format of another trainer, in and out of muonckpt's own, with ``R`` and
    ``W`` its reader's and writer's options (frozen dataclasses whose fields are named as
    ``convert``'s options: ``world`` is ``--world``).

    :meth:`read` writes a foreign checkpoint as a consolidated muonckpt checkpoint, and
    :meth:`write` a muonckpt checkpoint as a new foreign one, never over an existing one,
    each by calling the format's public function (:attr:`reader`, :attr:`writer`: ``from_dcp``,
    ``to_dcp``) with its options' fields as keywords. Both stream, and return a
    :class:`Conversion`.
    """

    name: str
    """What ``convert --format`` calls it: ``dcp``."""
    title: str
    """How messages call it: ``DCP``."""
    detect: Callable[[str | os.PathLike[str]], bool]
    """Whether a path is a checkpoint of this format (cheap: a file's presence, never a read)."""
    reader: Callable[..., Conversion]
    """``reader(src, dst, source=, to=, overwrite=, progress=, **options)``: the fields of
    :class:`Reading` and of :attr:`read_options` as keywords."""
    read_options: type[R]
    """The reader's options; a choice outside those a field takes raises
    :class:`~muonckpt.errors.OptionError` when made."""
    sources: tuple[str, ...]
    """The implementations whose checkpoints :attr:`read` takes (``convert --from``)."""
    writer: Callable[..., Conversion] | None = None
    """``writer(src, dst, to=, progress=, **options)``, the fields of :attr:`write_options` as
    keywords;
    None: muonckpt reads the format but does not write it."""
    write_options: type[W] | None = None
    write_requires: Mapping[str, str] = field(default_factory=dict)
    """The fields of :attr:`write_options` a write must be given (their default None is no
    value), and what each is: ``{"world": "the number of ranks DeepSpeed loads the output
    at"}``."""
    targets: tuple[str, ...] = ()
    """The implementations :attr:`write` writes for (``convert --to`` with ``--format``)."""
    records_source: bool = False
    """Whether its checkpoints say which implementation wrote them (DeepSpeed's: its one
    :attr:`sources`): then ``--from`` may be left out, and without ``--to`` :attr:`read`
    keeps the state in that implementation's own form."""

    def read(self, src: Path, dst: Path, reading: Reading, options: R) -> Conversion:
        """Write the foreign checkpoint ``src`` as a consolidated muonckpt checkpoint ``dst``."""
        with Event(f"convert from {self.name}", f"{src} -> {dst}"):
            return self.reader(src, dst, **vars(reading), **vars(options))

    def write(
        self, src: Path, dst: Path, to: str, options: W, progress: Progress | None = None
    ) -> Conversion:
        """Write the muonckpt checkpoint ``src`` as a new foreign checkpoint ``dst`` for the
        implementation ``to`` (one of :attr:`targets`), telling ``progress`` what it reads."""
        assert self.writer is not None  # the router refuses to write a read-only format
        with Event(f"convert to {self.name}", f"{src} -> {dst}"):
            report = self.writer(src, dst, to=to, progress=progress, **vars(options))
        return replace(report, written=access.tree_size(report.path))
