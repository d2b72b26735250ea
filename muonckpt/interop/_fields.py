"""The fields of a foreign trainer's ``torch.save`` file that the readers take as tensors or
step counts, checked as they are taken: a meta or sparse tensor (which no copy can read), or a
step of NaN, infinity, ``True`` or ``'3'``, is refused in one line naming the file and the
field, never met later as a traceback or committed as a wrong value."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..storage.dtypes import dtype_name

__all__ = ["count", "listed_state", "shown", "step_count", "tensor"]


def shown(value: Any) -> str:
    """``value`` for a message: its repr, cut at 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def tensor(value: Any, where: Path, what: str) -> Any:
    """``value`` where it is a tensor whose data is in memory: dense (strided), on the CPU;
    refused naming the file ``where`` and the field ``what`` otherwise (a meta tensor, a
    sparse one, a nested or quantized one, or no tensor)."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{what} is a {type(value).__name__}, not a tensor", path=where)
    kind = (
        "meta" if value.is_meta
        else str(value.layout).removeprefix("torch.") if value.layout != torch.strided
        else "nested" if value.is_nested
        else "quantized" if value.is_quantized
        else value.device.type if value.device.type != "cpu"
        else None
    )  # fmt: skip
    if kind is not None:
        raise CheckpointError(f"{what} is a {kind} tensor, not one holding its data", path=where)
    return value


def step_count(value: Any, where: Path, what: str) -> tuple[int | float, str | None]:
    """A step count as a trainer saves it (a Python int or float, or a one-element tensor)
    and the tensor's dtype (None for a Python number): a tensor's count as its dtype holds it,
    an int of an integer tensor (``tensor(3)``: 3, not 3.0); refused naming the file and the field
    where it is not a finite count of at least 0: a bool (``True`` is no step 1), NaN,
    infinity, a negative number, a string."""
    import torch

    dtype = None
    if isinstance(value, torch.Tensor):
        tensor(value, where, what)
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise CheckpointError(
                f"{what} is a {value.dtype} tensor of shape {list(value.shape)}, not a step count",
                path=where,
            )
        dtype, value = dtype_name(value.dtype), value.item()
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise CheckpointError(f"{what} {shown(value)} is not a step count", path=where)
    return value, dtype


def count(value: Any, where: Path, what: str) -> int | None:
    """:func:`step_count` as an int, None for None (no step saved)."""
    return None if value is None else int(step_count(value, where, what)[0])


def listed_state(state: Mapping[Any, Any], listed: Iterable[Any], where: Path, what: str) -> None:
    """Refuse an optimizer's ``state`` (by param id) holding an id that none of its param
    groups ``listed``: that state would be dropped unread (an id saved as ``'1'`` for ``1``,
    say); refused naming the file ``where``, the optimizer ``what`` and the id."""
    stray = sorted(set(state) - set(listed), key=str)
    if stray:
        raise CheckpointError(
            f"{what}: holds state of param index {stray[0]!r}, which no param group lists",
            path=where,
        )
