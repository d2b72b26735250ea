"""The training job's own state in a checkpoint: ``extra`` and ``rank_extra`` of save and load.

A tree of values (dicts with string keys, lists, JSON numbers, strings, booleans, None, and
tensors) is split into its JSON part, with ``null`` where each tensor was, and the tensors, each
with its path (:func:`take`); the manifest keeps the JSON, safetensors files the tensors
(:class:`muonckpt.format.manifest.Extra`). Objects with ``state_dict()`` and ``load_state_dict()``
(an LR scheduler, :class:`RNGState`) are saved as their state dict and restored through
``load_state_dict`` (:class:`Restore`). No pickle anywhere. No collectives, no file I/O.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import storage
from ..distributed.collectives import one_line
from ..errors import ArgumentError, CheckpointError
from ..format.manifest import EXTRA_DEPTH, EXTRA_JSON_BYTES, ValuePath


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


def missing(target: Mapping[str, Any], saved: Any, what: str, path: ValuePath = ()) -> list[str]:
    """What ``target`` asks for that ``saved`` cannot give: keys it lacks (a dict inside
    ``target`` is filled key by key, so its keys are asked for too), and stateful values saved
    as something other than a state dict."""
    if not isinstance(saved, dict):
        return [f"{shown(what, path)} is not a dict"]
    out = []
    for key, value in target.items():
        place = (*path, key)
        if key not in saved:
            out.append(f"{shown(what, place)} is missing")
        elif is_stateful(value) and not isinstance(saved[key], dict):
            kind = type(saved[key]).__name__
            out.append(
                f"{shown(what, place)} was saved as {kind} {saved[key]!r:.40}, not a state dict"
            )
        elif isinstance(value, MutableMapping) and not is_stateful(value):
            out += missing(value, saved[key], what, place)
    return out


class Restore:
    """The saved trees a load puts into ``extra`` / ``rank_extra`` (``(what, target, saved)``
    each, every asked-for key checked present by :func:`missing`), in two phases, so that a
    load is all or nothing: :meth:`load_objects`, each stateful value's ``load_state_dict`` of
    its saved state (which may refuse), before the optimizer changes; :meth:`assign`, the other
    values (a dict filled key by key, anything else replaced, keys only the checkpoint has
    added), which cannot fail, once nothing else can. :meth:`put_back` undoes the first.

    Each stateful value's ``state_dict()`` is copied first, so that it can be put back; a value
    whose state is still its copy after a refusal is not asked again (an object that refuses
    every state is left alone, as it was)."""

    def __init__(
        self, asked: Sequence[tuple[str, MutableMapping[str, Any], Mapping[str, Any]]]
    ) -> None:
        self.objects: list[_Stateful] = []
        """Each stateful value of the targets with its saved and its own previous state."""
        self.assignments: list[tuple[MutableMapping[str, Any], str, Any]] = []
        """(dict, key, value) of every other value."""
        self.asked = 0
        """How many of :attr:`objects` were handed their saved state (a refusal counts)."""
        for what, target, saved in asked:
            self._plan(target, saved, what, ())

    def _plan(
        self, target: MutableMapping[str, Any], saved: Mapping[str, Any], what: str, path: ValuePath
    ) -> None:
        for key, value in saved.items():
            current: Any = target.get(key)
            place = (*path, key)
            if is_stateful(current):
                name = shown(what, place)
                self.objects.append(_Stateful(name, current, value, _state_copy(current, name)))
            elif isinstance(current, MutableMapping) and isinstance(value, dict):
                self._plan(current, value, what, place)
            else:
                self.assignments.append((target, key, value))

    def load_objects(self) -> None:
        """Each stateful value's ``load_state_dict`` of its saved state, in order; the first
        refusal raised as a :class:`CheckpointError` naming the value (:meth:`put_back`
        undoes what was loaded)."""
        for each in self.objects:
            self.asked += 1  # (before the call: a refusal may have changed it all the same)
            try:
                each.value.load_state_dict(each.saved)
            except Exception as exc:
                raise CheckpointError(
                    f"{each.place}: its load_state_dict refused the saved state ({one_line(exc)})"
                ) from exc

    def put_back(self) -> list[str]:
        """Every stateful value handed its saved state back to its previous one (those whose
        ``state_dict()`` still equals it are left alone); what could not be put back, one
        message each, naming the value. Any other value is untouched until :meth:`assign`."""
        left = []
        for each in reversed(self.objects[: self.asked]):
            if _unchanged(each):
                continue
            try:
                each.value.load_state_dict(each.before)
            except Exception as exc:
                left.append(
                    f"{each.place} is left changed: its load_state_dict refused its own "
                    f"previous state too ({one_line(exc)})"
                )
        self.asked = 0
        return left

    def assign(self) -> None:
        """Every value that is not stateful put in place."""
        for target, key, value in self.assignments:
            target[key] = value


@dataclass
class _Stateful:
    """A stateful value of a load's target: where it is, its saved state, its own before."""

    place: str
    value: Any
    saved: Any
    before: Any


def _state_copy(value: Any, place: str) -> Any:
    """A deep copy of ``value.state_dict()``: what puts it back after a load changed it."""
    try:
        return copy.deepcopy(value.state_dict())
    except Exception as exc:
        raise CheckpointError(
            f"{place}: its state_dict() cannot be copied, so a failed load could not put it "
            f"back ({one_line(exc)}); nothing was changed"
        ) from exc


def _unchanged(each: _Stateful) -> bool:
    """Whether the value's ``state_dict()`` still equals its copy from before the load."""
    try:
        return _same(each.value.state_dict(), each.before)
    except Exception:
        return False  # (a state_dict() that fails now: put it back)


def _same(a: Any, b: Any) -> bool:
    """Equal trees: the same types, keys and values; tensors of one dtype, shape and device
    with the same bytes."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
            return False
        try:
            return torch.equal(_bytes_of(a), _bytes_of(b))
        except (RuntimeError, TypeError):  # (a layout without plain bytes)
            return False
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, as a flat uint8 tensor (NaNs and signed zeros compare as bytes)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class RNGState:
    """The process's torch random generators, as a stateful value for ``rank_extra``: the CPU
    generator's state, and each CUDA device's once CUDA is initialized (uint8 tensors).

    ``rank_extra={"rng": muonckpt.RNGState()}`` saves them; the same on ``load`` restores them.
    """

    def state_dict(self) -> dict[str, Any]:
        initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        cuda = torch.cuda.get_rng_state_all() if initialized else []
        return {"cpu": torch.get_rng_state(), "cuda": list(cuda)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if state["cuda"]:
            if len(state["cuda"]) != torch.cuda.device_count():
                raise CheckpointError(
                    f"rank_extra RNG state: {len(state['cuda'])} CUDA generators saved, "
                    f"{torch.cuda.device_count()} devices here"
                )
            torch.cuda.set_rng_state_all(state["cuda"])
