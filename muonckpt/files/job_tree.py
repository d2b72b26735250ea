"""A tree of the training job's own values (``extra``, a rank's ``rank_extra``, the trainer
state a conversion carries) as a checkpoint stores it: split into its JSON part, with ``null``
where each tensor was, and the tensors, each with its path (:func:`take`), and put back together
(:func:`rebuild`, :func:`read`). Used by a save and a load (:mod:`muonckpt.state.trainstate`) and
by the foreign formats' conversions (:mod:`muonckpt.interop`). No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import storage
from ..errors import ArgumentError, CheckpointError
from ..format.manifest import EXTRA_DEPTH, EXTRA_JSON_BYTES, ExtraValues, ValuePath
from .pieces import PieceReader


def is_stateful(value: Any) -> bool:
    """Whether ``value`` saves and restores itself (``state_dict`` / ``load_state_dict``)."""
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def shown(what: str, path: ValuePath) -> str:
    """``extra['sched']['last_epoch']``: a value's place, as errors name it."""
    return what + "".join(f"[{step!r}]" for step in path)


@dataclass
class Taken:
    """A tree of values as a save stores it: the JSON part and the tensors (host copies)."""

    values: Any
    tensors: list[tuple[ValuePath, torch.Tensor]] = field(default_factory=list)

    def digest(self) -> str:
        """A digest of the whole tree, tensors' bytes included: equal trees, equal digests."""
        h = hashlib.blake2b(digest_size=8)
        h.update(json.dumps(self.values, sort_keys=True).encode())
        for path, tensor in self.tensors:
            h.update(json.dumps([list(path), str(tensor.dtype), list(tensor.shape)]).encode())
            if tensor.numel():
                h.update(storage.byte_view(tensor.reshape(-1)))
        return h.hexdigest()


def take(tree: Mapping[str, Any], what: str) -> Taken:
    """``tree`` (``extra`` or ``rank_extra``) split into JSON values and tensors, copied to host
    memory now (the save holds the values at its call).

    Raises:
        ArgumentError: naming the value, for a key that is not a string, a float that is
            not finite, an object that is neither JSON, a tensor nor stateful, a tensor of a
            dtype safetensors has no name for, a tree nested deeper than
            :data:`~muonckpt.format.manifest.EXTRA_DEPTH`, an ``extra["step"]`` that is not a
            non-negative int, or values whose JSON exceeds
            :data:`~muonckpt.format.manifest.EXTRA_JSON_BYTES`.
    """
    if not isinstance(tree, Mapping):
        raise ArgumentError(
            f"{what} must be a dict of values, got {type(tree).__name__}", argument=what
        )
    taken = Taken(None)
    taken.values = _take(tree, (), what, taken.tensors)
    step = tree.get("step")
    if what == "extra" and "step" in tree and not _step(step):
        raise ArgumentError(
            f"extra['step'] must be the training step, a non-negative int; got {step!r}",
            argument=what,
        )
    size = len(json.dumps(taken.values))
    if size > EXTRA_JSON_BYTES:
        raise ArgumentError(
            f"{what}'s values take {size} bytes of JSON, more than {EXTRA_JSON_BYTES}: "
            "put large data in tensors",
            argument=what,
        )
    return taken


def _step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _take(
    value: Any, path: ValuePath, what: str, tensors: list[tuple[ValuePath, torch.Tensor]]
) -> Any:
    if len(path) > EXTRA_DEPTH:
        raise ArgumentError(
            f"{shown(what, path)}: nested deeper than {EXTRA_DEPTH} levels", argument=what
        )
    if isinstance(value, torch.Tensor):
        if (kind := storage.unstorable_kind(value)) is not None:
            raise ArgumentError(
                f"{shown(what, path)}: {kind} cannot be stored (dense only)", argument=what
            )
        try:
            storage.dtype_name(value.dtype)
        except CheckpointError as exc:
            raise ArgumentError(f"{shown(what, path)}: {exc}", argument=what) from None
        tensors.append((path, value.detach().to("cpu", copy=True).contiguous()))
        return None
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ArgumentError(
                    f"{shown(what, path)}: key {key!r} is not a string (JSON keys are strings)",
                    argument=what,
                )
            out[key] = _take(item, (*path, key), what, tensors)
        return out
    if isinstance(value, (list, tuple)):
        return [_take(item, (*path, i), what, tensors) for i, item in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        raise ArgumentError(f"{shown(what, path)}: {value} cannot be stored in JSON", argument=what)
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if is_stateful(value):
        return _take(value.state_dict(), path, what, tensors)
    raise ArgumentError(
        f"{shown(what, path)}: a {type(value).__name__} is neither a JSON value, a tensor nor "
        "an object with state_dict() and load_state_dict() (muonckpt stores no pickle)",
        argument=what,
    )


def rebuild(values: Any, tensors: Mapping[ValuePath, torch.Tensor]) -> Any:
    """The saved tree: ``values`` with each tensor put back at its path."""
    tree = json.loads(json.dumps(values))  # a fresh copy the caller may keep and change
    for path, tensor in tensors.items():
        holder = tree
        for step in path[:-1]:
            holder = holder[step]
        holder[path[-1]] = tensor
    return tree


def read(reader: PieceReader, tree: ExtraValues, what: str) -> Any:
    """The stored tree ``tree`` (``what``: ``extra``, ``rank_extra[3]``) whole: its tensors read
    and verified by ``reader``, each put back at its path."""
    tensors = {
        t.path: storage.tensor_of_bytes(reader.read_extra(t, what), t.dtype).reshape(t.shape)
        for t in tree.tensors
    }
    return rebuild(tree.values, tensors)
