"""What a trainer saves beside its optimizer (its LR scheduler, step counters, data-loader
position, RNG states), carried through ``convert``: a reader hands it to
:func:`~._consolidated.write_consolidated` as a :class:`TrainerState`, stored in the muonckpt
checkpoint's ``extra`` under ``"trainer"`` (with ``extra["step"]``, the job's step); the writer
of the same trainer takes it back into the trainer's own places (:func:`carried`). Values for the
whole job travel as they are. Per-rank values (an RNG state per TP rank, a data loader's position
per DP rank) travel only to the layout they were saved at (:attr:`TrainerState.layout`): at any
other they are left out, never handed to other ranks. What a target does not take is listed by
name with how its job restores it (:func:`left_out`).

In ``extra`` (JSON, tensors in ``extra.safetensors``)::

    {"step": 3, "trainer": {"name": "megatron", "shared": {...}, "layout": {"tp": 2, "pp": 1},
     "ranks": {"rng_state": [rank 0's, rank 1's]}, "restore": {"rng_state": "..."}}}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..files import job_tree
from ..files.pieces import PieceReader
from ..format.manifest import Manifest
from ..storage import CheckpointFiles

__all__ = [
    "KEY",
    "Carried",
    "Found",
    "TrainerState",
    "carried",
    "is_plain",
    "left_out",
    "recorded",
]

KEY = "trainer"
"""The key of ``extra`` that holds a conversion's trainer state."""


@dataclass(frozen=True)
class TrainerState:
    """A trainer's own state, as a reader found it."""

    name: str
    """The trainer that saved it (a format's name: ``megatron``, ``torchtitan``)."""
    shared: Mapping[str, Any]
    """Its values for the whole job by the trainer's names (``opt_param_scheduler``,
    ``iteration``): JSON values and tensors."""
    layout: Mapping[str, int] = field(default_factory=dict)
    """The ranks its per-rank values belong to, in the trainer's words: Megatron's
    ``{"pp": 1, "tp": 2}``, torchtitan's ``{"dp": 2}``."""
    ranks: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    """Per-rank values by name, each one value per rank of :attr:`layout`, in the trainer's
    rank order."""
    restore: Mapping[str, str] = field(default_factory=dict)
    """How a job restores each per-rank value that a target of the same trainer leaves out
    (at another layout), by name."""

    def extra(self, step: int | None) -> dict[str, Any]:
        """The ``extra`` tree a conversion stores: this state under :data:`KEY`, and ``step``
        (the job's step, what the manifest records) where known."""
        tree = {
            "name": self.name,
            "shared": dict(self.shared),
            "layout": dict(self.layout),
            "ranks": {k: list(v) for k, v in self.ranks.items()},
            "restore": dict(self.restore),
        }
        return {KEY: tree} if step is None else {"step": step, KEY: tree}


@dataclass(frozen=True)
class Found:
    """What a reader found of a trainer's own state."""

    state: TrainerState
    step: int | None
    """The job's step, where the checkpoint records it."""
    items: frozenset[str]
    """The foreign checkpoint's items it was read from (not left out)."""
    left: tuple[str, ...]
    """Items of the trainer's state not carried, one line each naming it and why."""


def is_plain(value: Any, *, tensors: bool = False) -> bool:
    """Whether ``value`` is JSON data (finite floats): what ``extra`` stores as it is; with
    ``tensors``, dense CPU tensors among it too (stored in ``extra.safetensors``)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v, tensors=tensors) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v, tensors=tensors) for k, v in value.items())
    return tensors and isinstance(value, torch.Tensor) and value.layout == torch.strided


@dataclass(frozen=True)
class Carried:
    """What of a checkpoint's trainer state a target takes (:func:`carried`)."""

    shared: Mapping[str, Any]
    """The values for the whole job (none where the trainer differs)."""
    ranks: Mapping[str, Sequence[Any]]
    """The per-rank values, for the layout they were saved at (none at another)."""
    left: tuple[str, ...]
    """What is left out, one line each, naming it and how to restore it."""


def recorded(manifest: Manifest) -> Mapping[str, Any] | None:
    """The trainer state ``manifest``'s ``extra`` records, its JSON values only (a tensor is
    ``None``); None where a conversion stored none (or ``extra["trainer"]`` is a job's own
    value of another form)."""
    shared = manifest.extra.shared if manifest.extra is not None else None
    values = shared.values if shared is not None else None
    state = values.get(KEY) if isinstance(values, dict) else None
    if not isinstance(state, dict) or not isinstance(state.get("name"), str):
        return None
    parts = ("shared", "layout", "ranks", "restore")
    return state if all(isinstance(state.get(part), dict) for part in parts) else None


def carried(
    files: CheckpointFiles,
    manifest: Manifest,
    trainer: str,
    layout: Mapping[str, int] | None = None,
) -> Carried:
    """What the writer of ``trainer`` at ``layout`` takes of ``manifest``'s trainer state, its
    tensors read and verified: all of it where ``trainer`` saved it and the layout is the one
    its per-rank values were saved at (None: a writer that does not know the layout its output
    is loaded at, for a trainer that checks it itself: as saved); the values for the whole job
    only at another layout (the per-rank ones left out); nothing from another trainer (all left
    out)."""
    state = recorded(manifest)
    if state is None or state["name"] != trainer:
        return Carried({}, {}, left_out(manifest))
    assert manifest.extra is not None and manifest.extra.shared is not None
    with PieceReader(files, manifest) as reader:
        whole = job_tree.read(reader, manifest.extra.shared, "extra")[KEY]
    if layout is None or dict(state["layout"]) == dict(layout) or not state["ranks"]:
        return Carried(whole["shared"], whole["ranks"], ())
    saved = _layout(state["layout"])
    left = tuple(
        f"{name} (per rank, saved at {saved}; written at {_layout(layout)}: not handed to "
        f"other ranks): {state['restore'].get(name, 'the job starts it afresh')}"
        for name in state["ranks"]
    )
    return Carried(whole["shared"], {}, left)


def left_out(manifest: Manifest) -> tuple[str, ...]:
    """The trainer state of ``manifest`` by name, for a target that takes none of it (another
    trainer's: its scheduler and counters differ), each with how its job restores it."""
    state = recorded(manifest)
    if state is None:
        return ()
    return tuple(
        f"{state['name']}'s {name} (another trainer's: kept in the checkpoint's "
        f"extra['{KEY}'], which muonckpt.load(..., extra=) gives back; the job builds its own)"
        for name in (*state["shared"], *state["ranks"])
    )


def _layout(layout: Mapping[str, Any]) -> str:
    return " ".join(f"{k.upper()} {v}" for k, v in sorted(layout.items())) or "one rank"
