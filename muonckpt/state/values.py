"""One param's state on one rank, each value classified once: a tensor (shaped like its param
and sharded with it, or following it by a shape rule, :mod:`muonckpt.layout.state_shapes`), a
0-d scalar, or a plain value; how each is reported to the other ranks and given back to an
optimizer. The collective that moves them is :mod:`.gather`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from ..errors import StateDictError
from ..layout.state_shapes import COLUMN, ROW, SAME, StateShape, shape_rule, state_region
from ..layout.topology import whole_region
from ..storage import unstorable_kind
from .paramnames import torch_dtype_name
from .sharding_model import ParamSharding, Sharding

HOST = torch.device("cpu")
"""Where gathered full tensors are assembled and delivered: host memory, as DCP's
``cpu_offload=True``, so a GPU never holds more than a piece or one param in flight."""


class _Kind(TypedDict):
    kind: str
    """``tensor``, ``scalar`` or ``value``."""


class ValueReport(_Kind, total=False):
    """A state value as the ranks report it to each other (JSON): its kind, then a tensor's
    dtype, shape and elements, or a scalar's dtype and value, or a plain value; ``digest``: a
    replicated tensor's fingerprint (:func:`muonckpt.state.gather.replica_digest`); ``rule``
    and ``full``: a tensor not shaped like its param, its rule and full shape."""

    dtype: str
    shape: list[int]
    numel: int
    value: Any
    digest: list[Any]
    rule: str
    full: list[int]


ParamReport = dict[str, ValueReport]
"""One param's state (or own values) on one rank, as reported: each key's :class:`ValueReport`."""


@dataclass(frozen=True)
class TensorValue:
    """A state tensor: sharded with its param (by its shape rule, where it is not shaped like
    it), gathered and stored as regions."""

    tensor: torch.Tensor
    stored: StateShape | None = None
    """Its full shape and rule where it is not shaped like its param (None: it is)."""

    def report(self) -> ValueReport:
        """How it travels, as the ranks report it to each other (JSON)."""
        t = self.tensor
        report: ValueReport = {
            "kind": "tensor",
            "dtype": torch_dtype_name(t.dtype),
            "shape": list(t.shape),
            "numel": t.numel(),
        }
        if self.stored is not None:
            report["rule"], report["full"] = self.stored.rule, list(self.stored.shape)
        return report

    def as_state(self) -> Any:
        """The value as an optimizer keeps it."""
        return self.tensor


@dataclass(frozen=True)
class ScalarValue:
    """A 0-d tensor of a param that is not 0-d (torch's AdamW ``step``): stored as a number
    with its dtype (torch's spelling, ``float32``) in the manifest's scalars."""

    value: Any
    dtype: str

    def report(self) -> ValueReport:
        return {"kind": "scalar", "dtype": self.dtype, "value": self.value}

    def as_state(self) -> Any:
        return torch.tensor(self.value, dtype=getattr(torch, self.dtype), device=HOST)


@dataclass(frozen=True)
class PlainValue:
    """A plain value (a number, a string, None), stored as it is in the manifest's scalars."""

    value: Any

    def report(self) -> ValueReport:
        return {"kind": "value", "value": self.value}

    def as_state(self) -> Any:
        return self.value


StateValue = TensorValue | ScalarValue | PlainValue
"""One state value of one param, classified once (:func:`state_value`)."""


@dataclass(frozen=True)
class ParamState:
    """One param's state on one rank, each value classified once, and the param's own values
    where a save takes them (stored under :data:`muonckpt.format.names.PARAM_KEY`)."""

    state: dict[str, StateValue]
    values: torch.Tensor | None = None


def param_states(
    sharding: Sharding,
    local_state: Mapping[int, Mapping[str, Any]],
    shapes: Sequence[tuple[int, ...]],
) -> dict[int, ParamState]:
    """This rank's state by its own flat param index, classified (each state tensor must hold
    this rank's share of its param, or its statistic by a shape rule); ``shapes``: the shape
    of each param tensor here, by the same index."""
    return {
        param.index_here: ParamState(
            {k: state_value(param, k, v, shapes[param.index_here]) for k, v in entry.items()}
        )
        for param in sharding.params  # in canonical order, as the ranks report
        if param.local_index is not None and (entry := local_state.get(param.local_index))
    }


def state_value(
    param: ParamSharding, key: str, value: Any, held: tuple[int, ...] | None = None
) -> StateValue:
    """How a state value travels and is stored: a tensor (shaped like the param and sharded
    with it, or following it by a shape rule, :func:`stored_shape`), a scalar (a 0-d tensor of
    a param that is not 0-d, such as torch's AdamW ``step``), or a plain value (a number,
    None). ``held``: the shape of this rank's param tensor (None: taken to be the state's,
    where it has the elements of this rank's share)."""
    if isinstance(value, torch.Tensor):
        if (kind := unstorable_kind(value)) is not None:
            raise StateDictError(
                f"param {param.name!r}: state {key!r} is {kind}, which muonckpt cannot store "
                "(dense tensors only)"
            )
        if value.dim() == 0 and len(param.full_shape) != 0:
            return ScalarValue(value.item(), torch_dtype_name(value.dtype))
        return TensorValue(value, stored_shape(param, key, tuple(value.shape), held))
    if value is None or isinstance(value, (bool, int, float, str)):
        return PlainValue(value)
    raise StateDictError(
        f"param {param.name!r}: state {key!r} is a {type(value).__name__}, which muonckpt "
        "cannot store (tensors, numbers, strings and None only)"
    )


def stored_shape(
    param: ParamSharding, key: str, shape: tuple[int, ...], held: tuple[int, ...] | None = None
) -> StateShape | None:
    """The full shape and rule of a state tensor of local ``shape`` (None: shaped like its
    param), from this rank's share of the param (:attr:`ParamSharding.local`) and its param
    tensor here (of shape ``held``): whole, any shape, its rule by
    :func:`muonckpt.layout.state_shapes.shape_rule`; a share, the param tensor's shape, the
    share's elements flat (``same``), or its rows' or columns' statistic. Refused where the
    layout cuts what its rule keeps whole, naming param, key and the share."""
    full = param.full_shape
    region = param.local or param.held or whole_region(math.prod(full))
    count = math.prod(shape)
    if region.numel == math.prod(full):
        return None if shape in (full, held) else StateShape(shape_rule(full, shape), shape)
    if held is None or shape == held:
        if count == region.numel:
            return None
    elif count == region.numel and len(shape) == 1:  # the share's elements, flat
        return StateShape(SAME, (math.prod(full),))
    stored = None
    if len(full) == 2 and shape == (count, 1):
        stored = StateShape(ROW, (full[0], 1))
    elif len(full) == 2 and shape == (1, count):
        stored = StateShape(COLUMN, (1, full[1]))
    kept = state_region(stored, full, region) if stored is not None else None
    if kept is None or kept.numel != count:
        what = f"{stored.rule} state of full shape {stored.shape}" if stored else "state"
        raise StateDictError(
            f"param {param.name!r}: state {key!r} has shape {shape} on this rank, which holds "
            f"elements [{region.start}, {region.stop}) of column block {region.block_start}+"
            f"{region.block_width} of the param's {full}: as {what} it would be cut or "
            "recombined by this layout (a statistic over rows or columns needs them whole)"
        )
    return stored


def reported_shape(info: ValueReport) -> StateShape | None:
    """A reported tensor's full shape and rule where it is not shaped like its param."""
    return StateShape(info["rule"], tuple(info["full"])) if "rule" in info else None


def reported_value(info: ValueReport) -> StateValue:
    """A scalar or plain value back from its report."""
    if info["kind"] == "scalar":
        return ScalarValue(info["value"], info["dtype"])
    return PlainValue(info["value"])
