"""The training job's own state in a checkpoint: ``extra`` and ``rank_extra`` of save and load.

A tree of values (dicts with string keys, lists, JSON numbers, strings, booleans, None, and
tensors) is split into its JSON part, with ``null`` where each tensor was, and the tensors, each
with its path (``take``, of :mod:`muonckpt.files.job_tree`); the manifest keeps the JSON,
safetensors files the tensors (:class:`muonckpt.format.manifest.Extra`). Objects with
``state_dict()`` and ``load_state_dict()`` (an LR scheduler, :class:`RNGState`) are saved as
their state dict and restored through ``load_state_dict`` (:class:`Restore`). No pickle
anywhere. No collectives, no file I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed.collectives import one_line
from ..errors import CheckpointError
from ..files.job_tree import Taken as Taken
from ..files.job_tree import is_stateful, shown
from ..files.job_tree import rebuild as rebuild
from ..files.job_tree import take as take
from ..format.manifest import ValuePath


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
