"""DeepSpeed ZeRO-1/2/3 with its Muon (``MuonWithAuxAdam`` inside DeepSpeed's ZeRO
optimizers), in and out at any world size, the stage detected from the files and written back.

Modules: :mod:`.reader` (:func:`from_deepspeed`), :mod:`.writer`
(:func:`to_deepspeed`: DeepSpeed's own per-rank files for N ranks), :mod:`.partitions` (pure:
ZeRO's flat partition of a group over its ranks, for both directions), :mod:`.files` (the
checkpoint's files found, read by torch's restricted unpickler with stand-ins for DeepSpeed's
classes, and written with plain values only).
Here: ``FORMAT``, the format as :mod:`..registry` holds it, with its options.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..foreign import ForeignFormat, NoOptions
from .reader import from_deepspeed, is_deepspeed
from .writer import SOURCE, WORLD, to_deepspeed

__all__ = ["FORMAT", "DeepSpeedWriteOptions", "from_deepspeed", "is_deepspeed", "to_deepspeed"]


@dataclass(frozen=True)
class DeepSpeedWriteOptions:
    """:func:`to_deepspeed`'s options as ``convert`` passes them (``--world``, checked by the
    writer; ``--zero-stage``; ``--allow-large-world``)."""

    world: int | None = None
    zero_stage: int | None = None
    allow_large_world: bool = False


FORMAT = ForeignFormat(
    name="deepspeed",
    title="DeepSpeed",
    detect=is_deepspeed,
    reader=from_deepspeed,
    read_options=NoOptions,
    writer=to_deepspeed,
    write_options=DeepSpeedWriteOptions,
    write_requires={"world": WORLD},
    sources=(SOURCE,),
    targets=(SOURCE,),
    records_source=True,
)
"""DeepSpeed ZeRO-1/2/3 in the registry (:mod:`muonckpt.interop.registry`)."""
