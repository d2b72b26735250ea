"""What the writers of accelerate and Lightning share: any muonckpt checkpoint as the model's
tensors by name and the ``state_dict()`` of each torch optimizer a torch.optim.Muon job builds,
state keyed by param index (:func:`torch_job_state`), which ``optimizer.load_state_dict``
restores exactly.

The job is the one these trainers run Muon in (torch.optim.Muon takes 2-D params only): one
torch.optim.Muon over every Muon group, then one torch.optim.AdamW over every AdamW group, each
group's params in the checkpoint's order (a checkpoint read from accelerate or Lightning keeps
its groups and their order), so index ``i`` of an optimizer is the ``i``-th param of its
groups in turn. A checkpoint holding only Muon groups (or only AdamW ones) gives one
optimizer. A Muon param that is not 2-D is refused before anything is written, naming it
(:func:`muonckpt.interop._foreign_out.check_split`).

Trainer state (LR schedulers, RNG states, loop and data-loader positions) is not here: a
writer leaves it out and says so (:data:`TRAINER_STATE`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import storage
from ..errors import CheckpointError
from ..files.pieces import PieceReader
from ..files.progress import Counted, Meter, Progress
from ..format import kinds
from ..format.conversion import group_kind, step_scalar
from ..format.manifest import Manifest, ParamEntry, PieceIndex
from ..format.names import PARAM_KEY
from ._foreign_out import check_split, read_whole
from .dcp.writer import family_settings, step_tensor

__all__ = ["TRAINER_STATE", "TorchJobState", "torch_job_state"]

TORCH = kinds.DCP_FAMILIES["torch"]
TRAINER_STATE = (
    "the trainer's own state (LR schedulers, RNG states, loop and data-loader positions): "
    "not written; the job starts them afresh"
)
"""What the accelerate and Lightning writers say they leave out: where the trainer state a
conversion carries would go (the issue's trainer-state mechanism fills it)."""


@dataclass
class TorchJobState:
    """What a torch.optim.Muon job's save holds, read from a muonckpt checkpoint."""

    model: dict[str, Any] = field(default_factory=dict)
    """The model's tensors by name: each param's values and the model's other tensors
    (buffers)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """The model's tied names, each naming the tensor of :attr:`model` it shares."""
    optimizers: list[dict[str, Any]] = field(default_factory=list)
    """Each optimizer's ``state_dict()``: torch.optim.Muon's, then torch.optim.AdamW's."""
    classes: list[str] = field(default_factory=list)
    """Each optimizer's class, as messages name it."""
    notes: list[str] = field(default_factory=list)
    """The momentum conversions, one line per group."""
    left: list[str] = field(default_factory=list)
    """What of the checkpoint the job's save does not hold."""


def _puts_in_muon(name: str, shape: tuple[int, ...]) -> bool | None:
    """Where a torch.optim.Muon job may put a param: a param that is not 2-D only in AdamW."""
    return False if len(shape) != 2 else None


def torch_job_state(
    manifest: Manifest, reader: PieceReader, directory: Path, progress: Progress | None
) -> TorchJobState:
    """The model's tensors and the optimizers' state dicts of a torch.optim.Muon job for the
    checkpoint ``manifest`` (its files read through ``reader``): Muon momentum in torch's EMA
    form (sum-form momentum converted by ``1 - mu``), AdamW's moments and its step as torch
    keeps it (a float32 0-d tensor), every setting of torch's optimizers (its defaults where
    the checkpoint does not say; no ``param_names``: the job keeps its own). ``progress`` is
    told each tensor read.

    Raises:
        CheckpointError: before anything is read, for a group muonckpt does not convert, a
            param without saved values, or a Muon param that is not 2-D, naming them.
    """
    out = TorchJobState()
    group_kinds = [group_kind(group, g, directory) for g, group in enumerate(manifest.groups)]
    for g, kind in enumerate(group_kinds):
        if kind.role is None:
            raise CheckpointError(
                f"group {g}: {kind.optimizer} is not an optimizer muonckpt converts", path=directory
            )
    placed = [
        (name, kind.role == "muon")
        for group, kind in zip(manifest.groups, group_kinds, strict=True)
        for name in group.params
    ]
    check_split(
        manifest, placed, _puts_in_muon, "torch.optim.Muon takes 2-D params only", directory
    )
    planned = []
    for g, (group, kind) in enumerate(zip(manifest.groups, group_kinds, strict=True)):
        target = TORCH.target_kind(kind)
        mapping = kinds.state_mapping(kind, target, f"group {g}", None)
        if mapping.note:
            out.notes.append(f"{len(group.params)} Muon params: {mapping.note}")
        factor = mapping.keys.get("momentum_buffer", ("", 1.0))[1]
        settings = family_settings(TORCH, kind, target, group.settings())
        settings.pop("param_names", None)  # (the job's own, which its load keeps)
        planned.append((kind.role, group.params, settings, factor))
    unsaved = [n for n, _ in placed if manifest.param(n).value_dtype is None]
    if unsaved:
        raise CheckpointError(
            f"param {unsaved[0]!r} has no saved values: the job's model file needs every "
            "param's values",
            path=directory,
        )
    entries = [*manifest.params, *(manifest.model.tensors if manifest.model else ())]
    sizes = [_nbytes(entry, key) for entry in entries for key in entry.tensor_keys]
    meter = Meter(Counted(sum(sizes), len(sizes)), progress)
    model = manifest.model

    def read(entry: ParamEntry, key: str) -> Any:
        tensor = read_whole(reader, pieces, entry, key)
        meter.tick(_nbytes(entry, key))
        return tensor

    pieces = PieceIndex(manifest.pieces, model.pieces if model is not None else ())
    for role, optimizer in (("muon", TORCH.muon), ("adamw", TORCH.adamw)):
        groups = [(names, s, f) for r, names, s, f in planned if r == role]
        if groups:
            out.optimizers.append(_state_dict(manifest, read, groups, out.model))
            out.classes.append(optimizer)
    _other_tensors(manifest, read, out)
    return out


def _nbytes(entry: ParamEntry, key: str) -> int:
    return math.prod(entry.shape_of(key)) * storage.itemsize(entry.dtype_of(key))


Read = Callable[[ParamEntry, str], Any]
"""Reads a stored tensor (of a param or a model tensor) whole."""


def _state_dict(
    manifest: Manifest,
    read: Read,
    groups: list[tuple[tuple[str, ...], dict[str, Any], float]],
    model: dict[str, Any],
) -> dict[str, Any]:
    """One optimizer's ``state_dict()`` over ``groups`` (names, settings, momentum factor),
    indices counted over its groups in turn; each param's values go into ``model``."""
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    index = 0
    for names, settings, factor in groups:
        ids = []
        for name in names:
            entry = manifest.param(name)
            model[name] = read(entry, PARAM_KEY)
            held = {}
            for key in entry.state_keys:
                value = read(entry, key)
                held[key] = (
                    value.mul_(factor) if key == "momentum_buffer" and factor != 1 else value
                )
            step = step_scalar(TORCH.step_in, manifest.step_of(entry), name)
            if held and step is not None and "momentum_buffer" not in held:
                held["step"] = step_tensor(step)
            if held:
                state[index] = held
            ids.append(index)
            index += 1
        param_groups.append({**settings, "params": ids})
    return {"state": state, "param_groups": param_groups}


def _other_tensors(manifest: Manifest, read: Read, out: TorchJobState) -> None:
    """The model's tensors no optimizer holds (buffers, frozen params), and its tied names."""
    model_file = manifest.model
    if model_file is None:
        return
    for entry in model_file.tensors:
        out.model[entry.name] = read(entry, PARAM_KEY)
    for alias, stored in sorted(model_file.aliases.items()):
        if stored in out.model:
            out.aliases[alias] = stored
        else:
            out.left.append(f"{alias} (an alias of {stored}, which holds no values)")
