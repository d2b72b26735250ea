"""PyTorch Distributed Checkpoint (DCP): the checkpoints of FSDP2 / DTensor Muons (torchtitan,
microsoft/dion, muon-fsdp2, a hand-rolled Muon under ``fully_shard``), in and out.

Modules: :mod:`.reader` (:func:`from_dcp`), :mod:`.writer` (:func:`to_dcp`), :mod:`.metadata`
(``.metadata`` read by a restricted unpickler and checked: :class:`~.metadata.DcpIndex`),
:mod:`.files` (each item's data read by its checked byte range; written by torch's own
``FileSystemWriter``), :mod:`._torch_writer` (torch's planner and storage writer, taught to
fetch each tensor when written and to write through the storage seam), :mod:`.model_items`
(which items are the model's). The other formats built on DCP (:mod:`..torchtitan`,
:mod:`..megatron`) read and write through these.
Here: ``FORMAT``, the format as :mod:`..registry` holds it, with its options.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import OptionError
from ...format import kinds
from ..foreign import ForeignFormat
from .reader import LAYOUTS, OPTIMIZER_PREFIX, from_dcp, is_dcp
from .writer import to_dcp

__all__ = [
    "FORMAT",
    "LAYOUTS",
    "DcpReadOptions",
    "DcpWriteOptions",
    "from_dcp",
    "is_dcp",
    "to_dcp",
]


@dataclass(frozen=True)
class DcpReadOptions:
    """:func:`from_dcp`'s options as ``convert`` passes them (``--model-prefix``,
    ``--optimizer-prefix``, ``--split-experts``)."""

    model_prefix: str | None = None
    optimizer_prefix: str = OPTIMIZER_PREFIX
    split_experts: bool = False


@dataclass(frozen=True)
class DcpWriteOptions:
    """:func:`to_dcp`'s options as ``convert`` passes them (``--layout``, one of
    :data:`LAYOUTS`; None: the layout the checkpoint was read as, else torchtitan's;
    ``--merge-experts``)."""

    layout: str | None = None
    merge_experts: bool | None = None  # None: the recorded splits

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout not in LAYOUTS:
            raise OptionError(f"choose one of {', '.join(LAYOUTS)}", "--layout")


FORMAT = ForeignFormat(
    name="dcp",
    title="DCP",
    detect=is_dcp,
    reader=from_dcp,
    read_options=DcpReadOptions,
    writer=to_dcp,
    write_options=DcpWriteOptions,
    sources=tuple(kinds.DCP_FAMILIES),
    targets=tuple(kinds.DCP_FAMILIES),
)
"""PyTorch DCP in the registry (:mod:`muonckpt.interop.registry`)."""
