"""torchtitan's checkpoints of its DistMuon (``CheckpointManager``'s ``step-N`` DCP
directories), in and out at any world size, through :mod:`..dcp`.

Module: :mod:`.reader` (:func:`from_torchtitan`, :func:`to_torchtitan`).
Here: ``FORMAT``, the format as :mod:`..registry` holds it, with its options.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..foreign import ForeignFormat
from .reader import SOURCE, from_torchtitan, is_torchtitan, to_torchtitan

__all__ = [
    "FORMAT",
    "TorchtitanReadOptions",
    "TorchtitanWriteOptions",
    "from_torchtitan",
    "is_torchtitan",
    "to_torchtitan",
]


@dataclass(frozen=True)
class TorchtitanReadOptions:
    """:func:`from_torchtitan`'s options as ``convert`` passes them (``--model-buffers``,
    ``--split-experts``)."""

    model_buffers: bool = False
    split_experts: bool = False


@dataclass(frozen=True)
class TorchtitanWriteOptions:
    """:func:`to_torchtitan`'s options as ``convert`` passes them (``--merge-experts``)."""

    merge_experts: bool | None = None  # None: the recorded splits


FORMAT = ForeignFormat(
    name=SOURCE,
    title="torchtitan",
    detect=is_torchtitan,
    reader=from_torchtitan,
    read_options=TorchtitanReadOptions,
    writer=to_torchtitan,
    write_options=TorchtitanWriteOptions,
    sources=(SOURCE,),
    targets=(SOURCE,),
    records_source=True,
)
"""torchtitan in the registry (:mod:`muonckpt.interop.registry`)."""
