"""One param's state on one rank, each value classified once: a tensor shaped like its param
(sharded with it), a 0-d scalar, or a plain value; how each is reported to the other ranks and
given back to an optimizer. The collective that moves them is :mod:`.gather`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from ..errors import StateDictError
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
    replicated tensor's fingerprint (:func:`muonckpt.state.gather.replica_digest`)."""

    dtype: str
    shape: list[int]
    numel: int
    value: Any
    digest: list[Any]


ParamReport = dict[str, ValueReport]
"""One param's state (or own values) on one rank, as reported: each key's :class:`ValueReport`."""


@dataclass(frozen=True)
class TensorValue:
    """State shaped like its param: sharded with it, gathered and stored as regions."""

    tensor: torch.Tensor

    def report(self) -> ValueReport:
        """How it travels, as the ranks report it to each other (JSON)."""
        t = self.tensor
        return {
            "kind": "tensor",
            "dtype": torch_dtype_name(t.dtype),
            "shape": list(t.shape),
            "numel": t.numel(),
        }

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
    sharding: Sharding, local_state: Mapping[int, Mapping[str, Any]]
) -> dict[int, ParamState]:
    """This rank's state by its own flat param index, classified (each state tensor must hold
    this rank's share of its param)."""
    return {
        param.index_here: ParamState(
            {k: state_value(param, k, v, param.held_numel) for k, v in entry.items()}
        )
        for param in sharding.params  # in canonical order, as the ranks report
        if param.local_index is not None and (entry := local_state.get(param.local_index))
    }


def state_value(param: ParamSharding, key: str, value: Any, numel: int | None = None) -> StateValue:
    """How a state value travels and is stored: a tensor shaped like the param (sharded with
    it), a scalar (a 0-d tensor of a param that is not 0-d, such as torch's AdamW ``step``), or
    a plain value (a number, None). ``numel``: the elements of this rank's param tensor, which
    a state tensor must have (refused otherwise: muonckpt shards state with its param)."""
    if isinstance(value, torch.Tensor):
        if (kind := unstorable_kind(value)) is not None:
            raise StateDictError(
                f"param {param.name!r}: state {key!r} is {kind}, which muonckpt cannot store "
                "(dense tensors only)"
            )
        if value.dim() == 0 and len(param.full_shape) != 0:
            return ScalarValue(value.item(), torch_dtype_name(value.dtype))
        if numel is not None and value.numel() != numel:
            raise StateDictError(
                f"param {param.name!r}: state {key!r} has shape {tuple(value.shape)}, neither "
                "the param's shape nor a 0-d scalar: muonckpt stores only state shaped like "
                "its param (factored state such as Adafactor's is not supported)"
            )
        return TensorValue(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return PlainValue(value)
    raise StateDictError(
        f"param {param.name!r}: state {key!r} is a {type(value).__name__}, which muonckpt "
        "cannot store (tensors, numbers, strings and None only)"
    )


def reported_value(info: ValueReport) -> StateValue:
    """A scalar or plain value back from its report."""
    if info["kind"] == "scalar":
        return ScalarValue(info["value"], info["dtype"])
    return PlainValue(info["value"])
