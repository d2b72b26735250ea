"""safetensors dtype strings: their sizes, and their torch dtypes where a tensor crosses.

The storage modules work in bytes and import torch only where a caller hands over or asks for
a tensor (the functions below that take or return one), so that the offline tools run without
it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from ..errors import CheckpointError
from ..format.manifest import DTYPE_BYTES

if TYPE_CHECKING:
    import torch


_TORCH_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype string -> torch dtype, for those this torch has."""
    import torch

    return {
        name: getattr(torch, attr) for name, attr in _TORCH_NAMES.items() if hasattr(torch, attr)
    }


@functools.cache
def torch_dtype_names() -> dict[torch.dtype, str]:
    return {dt: name for name, dt in _torch_dtypes().items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string."""
    try:
        return _torch_dtypes()[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"unknown safetensors dtype {name!r}") from None


def itemsize(name: str) -> int:
    """Bytes per element of a safetensors dtype string."""
    try:
        return DTYPE_BYTES[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"unknown safetensors dtype {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype."""
    try:
        return torch_dtype_names()[dtype]
    except (KeyError, TypeError):
        raise CheckpointError(f"dtype {dtype} cannot be stored in a safetensors file") from None


def unstorable_kind(tensor: torch.Tensor) -> str | None:
    """What makes ``tensor`` a kind a safetensors file cannot hold, as words (``"a nested
    tensor"``), or None for a dense one: nested, sparse (any layout but strided), meta (no
    data) and quantized tensors are named as such, wherever a tensor is stored (state,
    params, ``extra``), rather than failing later on their dtype or their bytes."""
    import torch

    if tensor.is_nested:
        return "a nested tensor"
    if tensor.layout != torch.strided:
        return f"a sparse tensor ({tensor.layout})"
    if tensor.is_meta:
        return "a meta tensor (it has no data)"
    if tensor.is_quantized:
        return f"a quantized tensor ({tensor.dtype})"
    return None


def tensor_of_bytes(data: np.ndarray, dtype: str) -> torch.Tensor:
    """A 1-D tensor of safetensors dtype ``dtype`` sharing the raw bytes ``data`` (1-D uint8)."""
    import torch

    if data.size == 0:  # numpy gives empty arrays a stride torch cannot view
        return torch.empty(0, dtype=torch_dtype(dtype))
    return torch.from_numpy(data).view(torch_dtype(dtype))


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's data."""
    import torch

    return tensor.view(torch.uint8).numpy().data.cast("B")
