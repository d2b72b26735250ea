"""Megatron-Core's tensor-parallel split of a GPT's params and the DCP chunks its torch_dist
checkpoints store them in, pure (ints and names only).

A torch_dist checkpoint holds each key as one global tensor in chunks: one per TP rank along
the param's partition dim (``ColumnParallelLinear``: dim 0; ``RowParallelLinear``: dim 1;
replicated params: one), and, for the decoder's layers stacked on a leading axis, one per
layer too (``TransformerBlock``'s sharded offsets). Which dim a param is split on follows
from its name in Megatron's GPT (``megatron/core/tensor_parallel/layers.py``,
``megatron/core/models/gpt``): :func:`partition_dim`.
"""

from __future__ import annotations

import itertools

from ...errors import LayoutError

__all__ = ["EXTRA_STATE_MODULES", "Region", "chunks", "partition_dim"]

Region = tuple[tuple[int, ...], tuple[int, ...]]
"""A chunk: its offsets in the global tensor and its sizes."""
COLUMN_PARALLEL = (
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "linear_fc1.bias",
    "word_embeddings.weight",
    "output_layer.weight",
)
"""Name endings of the params split on dim 0 (``ColumnParallelLinear``, the vocab-parallel
embedding)."""
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
"""Name endings of the params split on dim 1 (``RowParallelLinear``'s weight)."""
REPLICATED = (
    "layer_norm_weight",
    "layer_norm_bias",
    "layernorm.weight",
    "layernorm.bias",
    "linear_proj.bias",
    "linear_fc2.bias",
    "position_embeddings.weight",
)
"""Name endings of the params every TP rank holds whole (norms, a row-parallel bias)."""
EXTRA_STATE_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The decoder layers' linear modules, whose (empty) ``_extra_state`` Megatron saves per layer."""


def partition_dim(name: str) -> int | None:
    """The dim of the param ``name`` (one layer's tensor) that TP splits, or None where every
    TP rank holds it whole; a :class:`~muonckpt.errors.LayoutError` for a name that is none of
    Megatron's GPT params."""
    if name.endswith(COLUMN_PARALLEL):
        return 0
    if name.endswith(ROW_PARALLEL):
        return 1
    if name.endswith(REPLICATED):
        return None
    raise LayoutError(
        f"param {name!r}: not one of Megatron's GPT params, so its tensor-parallel split is not "
        "known"
    )


def chunks(shape: tuple[int, ...], layers: int | None, dim: int | None, tp: int) -> list[Region]:
    """The chunks of a key whose per-layer tensor has ``shape``, stacked ``layers`` deep on a
    leading axis (None: not stacked), split ``tp`` ways along its dim ``dim`` (None: whole):
    TP rank-major, then layer, as Megatron's ranks write them. A
    :class:`~muonckpt.errors.LayoutError` where ``tp`` does not divide that dim."""
    sizes = list(shape)
    if dim is not None and tp > 1:
        if shape[dim] % tp:
            raise LayoutError(f"dim {dim} of {list(shape)} does not split into {tp} TP chunks")
        sizes[dim] //= tp
    ranks = tp if dim is not None else 1
    out = []
    for rank, layer in itertools.product(range(ranks), range(layers or 1)):
        offsets = [0] * len(shape)
        if dim is not None:
            offsets[dim] = rank * sizes[dim]
        if layers is None:
            out.append((tuple(offsets), tuple(sizes)))
        else:
            out.append(((layer, *offsets), (1, *sizes)))
    return out
