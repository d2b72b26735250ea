"""DeepSpeed ZeRO-1/2 with its Muon (``MuonWithAuxAdam`` inside ``DeepSpeedZeroOptimizer``),
in and out at any world size.

Modules: :mod:`.reader` (:func:`from_deepspeed`), :mod:`.writer`
(:func:`to_deepspeed`: DeepSpeed's own per-rank files for N ranks), :mod:`.partitions` (pure:
ZeRO's flat partition of a group over its ranks, for both directions), :mod:`.files` (the
checkpoint's files found, read by torch's restricted unpickler with stand-ins for DeepSpeed's
classes, and written with plain values only).
Here: ``FORMAT``, the format as :mod:`..registry` holds it, with its options.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..foreign import Conversion, ForeignFormat, NoOptions, Reading
from .reader import from_deepspeed, is_deepspeed
from .writer import SOURCE, to_deepspeed

__all__ = ["FORMAT", "DeepSpeedWriteOptions", "from_deepspeed", "is_deepspeed", "to_deepspeed"]


@dataclass(frozen=True)
class DeepSpeedWriteOptions:
    """:func:`to_deepspeed`'s options as ``convert`` passes them (``--world``, checked by the
    writer; ``--allow-large-world``)."""

    world: int | None = None
    allow_large_world: bool = False


def _read(src: Path, dst: Path, reading: Reading, _: NoOptions) -> Conversion:
    return from_deepspeed(
        src,
        dst,
        source=reading.source,
        to=reading.to,
        overwrite=reading.overwrite,
        progress=reading.progress,
    )


def _write(src: Path, dst: Path, to: str, options: DeepSpeedWriteOptions) -> Conversion:
    return to_deepspeed(
        src, dst, to=to, world=options.world, allow_large_world=options.allow_large_world
    )


FORMAT = ForeignFormat(
    name="deepspeed",
    title="DeepSpeed",
    detect=is_deepspeed,
    read=_read,
    read_options=NoOptions,
    write=_write,
    write_options=DeepSpeedWriteOptions,
    sources=(SOURCE,),
    targets=(SOURCE,),
    records_source=True,
)
"""DeepSpeed ZeRO-1/2 in the registry (:mod:`muonckpt.interop.registry`)."""
