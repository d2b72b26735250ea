"""torchtitan's checkpoints of its DistMuon (``CheckpointManager``'s ``step-N`` DCP
directories), in and out at any world size, through :mod:`..dcp`.

Module: :mod:`.reader` (:func:`from_torchtitan`, :func:`to_torchtitan`).
Here: ``FORMAT``, the format as :mod:`..registry` holds it, with its options.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..foreign import Conversion, ForeignFormat, NoOptions, Reading
from .reader import SOURCE, from_torchtitan, is_torchtitan, to_torchtitan

__all__ = ["FORMAT", "TorchtitanReadOptions", "from_torchtitan", "is_torchtitan", "to_torchtitan"]


@dataclass(frozen=True)
class TorchtitanReadOptions:
    """:func:`from_torchtitan`'s options as ``convert`` passes them (``--model-buffers``,
    ``--split-experts``)."""

    model_buffers: bool = False
    split_experts: bool = False


def _read(src: Path, dst: Path, reading: Reading, options: TorchtitanReadOptions) -> Conversion:
    return from_torchtitan(
        src,
        dst,
        source=reading.source,
        to=reading.to,
        model_buffers=options.model_buffers,
        split_experts=options.split_experts,
        overwrite=reading.overwrite,
        progress=reading.progress,
    )


def _write(src: Path, dst: Path, to: str, _: NoOptions) -> Conversion:
    return to_torchtitan(src, dst, to=to)


FORMAT = ForeignFormat(
    name=SOURCE,
    title="torchtitan",
    detect=is_torchtitan,
    read=_read,
    read_options=TorchtitanReadOptions,
    write=_write,
    write_options=NoOptions,
    sources=(SOURCE,),
    targets=(SOURCE,),
    records_source=True,
)
"""torchtitan in the registry (:mod:`muonckpt.interop.registry`)."""
