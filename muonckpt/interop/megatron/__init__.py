"""Megatron-Core's checkpoints of its layer-wise Muon (``LayerWiseDistributedOptimizer``),
in at any TP and DP and out for another.

Modules: :mod:`.reader` (:func:`from_megatron`: ``--ckpt-format torch_dist``, DCP
underneath), :mod:`.torch_format` (``--ckpt-format torch``'s per-rank pickles),
:mod:`.writer` (:func:`to_megatron`: a torch_dist checkpoint for TP T, DP D),
:mod:`.tp_chunks` (pure: the TP split of a GPT's params and the DCP chunks it is stored in),
:mod:`.groups` (its param groups' roles and settings), :mod:`.files` (the checkpoint's files
found and read safely).
Here: ``FORMAT``, the format as :mod:`..registry` holds it, with its options.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..foreign import ForeignFormat, NoOptions
from .reader import from_megatron, is_megatron
from .writer import SIZES, to_megatron

__all__ = ["FORMAT", "MegatronWriteOptions", "from_megatron", "is_megatron", "to_megatron"]


@dataclass(frozen=True)
class MegatronWriteOptions:
    """:func:`to_megatron`'s options as ``convert`` passes them (``--tp``, ``--dp``, checked
    by the writer; ``--allow-large-world``)."""

    tp: int | None = None
    dp: int | None = None
    allow_large_world: bool = False


FORMAT = ForeignFormat(
    name="megatron",
    title="Megatron-Core",
    detect=is_megatron,
    reader=from_megatron,
    read_options=NoOptions,
    writer=to_megatron,
    write_options=MegatronWriteOptions,
    write_requires={"tp": SIZES.format("tensor"), "dp": SIZES.format("data")},
    sources=("megatron",),
    targets=("megatron",),
    records_source=True,
)
"""Megatron-Core's torch_dist format in the registry (:mod:`muonckpt.interop.registry`)."""
