"""What every foreign format's reader shares: the consolidated muonckpt checkpoint it writes
(:func:`consolidated` plans it, :func:`write_consolidated` writes it through the write engine's
calls, pulling the tensors the reader hands it, with the trainer's own state a reader found:
:mod:`._trainer_state`), stacked experts split checked
against the model's other tensors (:func:`split_experts_of`), and the lines saying how its
momentum was converted (:func:`conversion_notes`) and what it left out (:func:`summarized`)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import settings, storage
from ..files import job_tree, writing
from ..files.attempt import Attempt
from ..files.progress import Progress
from ..format import kinds
from ..format.manifest import Extra, Manifest, ModelFile, ParamEntry
from ..format.names import EXTRA_FILE, PARAM_KEY
from ..format.stacked import Part, split_stacked
from ..format.writeplan import Plan, consolidated_plan
from ._trainer_state import TrainerState


@dataclass(frozen=True)
class Consolidated:
    """The consolidated checkpoint a reader writes, planned before any tensor is read:
    :attr:`reads` is what the reader hands :func:`write_consolidated`, in that order."""

    manifest: Manifest
    plan: Plan
    parts: Mapping[str, Part]
    reads: tuple[tuple[str, str], ...]
    """Each (name, key) the output's tensors come from, in the order they are written: a
    split param's stacked tensor once per key, where its first matrix is written."""


def consolidated(
    target: Manifest,
    *,
    aliases: Mapping[str, str] | None = None,
    model_tensors: Sequence[ParamEntry] = (),
    parts: Mapping[str, Part] | None = None,
) -> Consolidated:
    """The plan of ``target``'s tensors as a consolidated muonckpt checkpoint: tied names
    (``aliases``: alias -> stored name) go into the model files' metadata; ``model_tensors``
    (the model's other tensors: buffers, params no optimizer holds, each read as
    ``(name, PARAM_KEY)``) and the aliases go into the manifest's :class:`ModelFile`.
    ``parts``: ``target``'s params split from stacked ones
    (:func:`muonckpt.format.stacked.split_stacked`), each written as its matrix of the
    stacked tensor, which is read once per key."""
    items = [
        ((e.name, k, e.dtype_of(k)), e.shape_of(k)) for e in target.params for k in e.tensor_keys
    ]
    items += [((t.name, PARAM_KEY, t.dtype_of(PARAM_KEY)), t.shape) for t in model_tensors]
    plan = consolidated_plan(items, None, dict(aliases) if aliases else None)
    model = target.model
    if model_tensors or (aliases and model is None):
        model = ModelFile(tuple(model_tensors), (), dict(aliases or {}))
    parts = parts or {}
    reads = dict.fromkeys(
        (parts[w.param].stacked if w.param in parts else w.param, w.key)
        for w in writing.in_order(plan)
    )
    return Consolidated(replace(target, model=model), plan, parts, tuple(reads))


def write_consolidated(
    planned: Consolidated,
    scales: Sequence[float],
    tensors: Iterable[Any],
    dst: str | os.PathLike[str],
    *,
    overwrite: bool,
    progress: Progress | None,
    source: Path,
    trainer: TrainerState | None = None,
    step: int | None = None,
) -> Path:
    """Write ``planned`` at ``dst``, its tensors pulled from ``tensors`` (one of
    :attr:`Consolidated.reads` each, in that order, a tensor of its own: momentum is
    multiplied in place by its group's factor of ``scales``), with the ``trainer``'s own state
    (where the reader found one) in ``extra`` and ``step``, the job's step, recorded."""
    where = settings.local_path(dst)  # (a foreign format's files: staged locally first)
    store, steps = storage.store_for(where), writing.LocalSteps()
    staging = writing.stage(steps, store, where, overwrite=overwrite, source=source)
    pulled = _scaled(planned, scales, iter(tensors))
    manifest = planned.manifest
    try:
        written = Attempt(writing.write_files(store, planned.plan, staging, pulled, progress))
        if trainer is not None:
            manifest = _with_trainer_state(manifest, trainer, step, staging)
    except BaseException as exc:
        written = Attempt(failure=exc)
    draft = writing.Draft(manifest)
    replaced = writing.commit(steps, store, staging, where, written, draft, source=source)
    writing.retire(steps, store, replaced, where)
    return where


def _with_trainer_state(
    manifest: Manifest, trainer: TrainerState, step: int | None, staging: Path
) -> Manifest:
    """``manifest`` with ``trainer``'s state as its ``extra`` (its tensors written into
    ``staging``'s ``extra.safetensors``, as a save writes them) and ``step`` recorded (None:
    the manifest's own)."""
    taken = job_tree.take(trainer.extra(step), "extra")
    tensors = [(path, storage.dtype_name(t.dtype), tuple(t.shape), t) for path, t in taken.tensors]
    tree, entry = writing.write_extra(staging, EXTRA_FILE, taken.values, tensors)
    extra = Extra(tree, (), () if entry is None else (entry,))
    return replace(
        manifest, extra=extra, recorded_step=manifest.recorded_step if step is None else step
    )


def _scaled(
    planned: Consolidated, scales: Sequence[float], tensors: Iterator[Any]
) -> writing.Tensors:
    """Each tensor of ``planned`` as it is written: a split param's matrix of its stacked
    tensor (held until its last matrix is written), momentum multiplied in place by its
    group's factor of ``scales`` (the model's other tensors are values only)."""
    count = Counter(
        (part.stacked, w.key)
        for w in writing.in_order(planned.plan)
        if (part := planned.parts.get(w.param))
    )
    held: dict[tuple[str, str], Any] = {}
    for w in writing.in_order(planned.plan):
        part = planned.parts.get(w.param)
        if part is None:
            tensor = next(tensors)
        else:
            slot = (part.stacked, w.key)
            if slot not in held:
                stacked = next(tensors)
                held[slot] = stacked.reshape(-1, *stacked.shape[-2:])
            tensor = held[slot][part.index]
            count[slot] -= 1
            if not count[slot]:
                del held[slot]
        momentum = w.key == "momentum_buffer"
        scale = scales[planned.manifest.param(w.param).group] if momentum else 1.0
        yield w, tensor.mul_(scale) if scale != 1.0 else tensor


def split_experts_of(
    target: Manifest, others: Sequence[ParamEntry], aliases: Mapping[str, str]
) -> tuple[Manifest, Mapping[str, Part]]:
    """:func:`split_stacked` of ``target``, checked against the model's other tensors and tied
    names the output will carry (a split name they take, or a tie to a split param, refused
    before anything is written)."""
    known = replace(target, model=ModelFile(tuple(others), (), dict(aliases)))
    split, parts = split_stacked(known)
    return replace(split, model=target.model), parts


def conversion_notes(source: Manifest, target: Manifest) -> tuple[str, ...]:
    """One line per Muon group whose momentum changed form between ``source`` and ``target``
    (the same groups, rewritten), and one per group whose target orthogonalizes other blocks
    (:func:`~muonckpt.format.kinds.compute_view_notes`)."""
    notes = []
    for a, b in zip(source.groups, target.groups, strict=True):
        was, now = kinds.GroupKind.from_json(a.optimizer), kinds.GroupKind.from_json(b.optimizer)
        if was.role == "muon":
            note = kinds.state_mapping(was, now, f"group of {a.params[0]!r}", None).note
            if note is not None:
                notes.append(f"{len(a.params)} Muon params: {note}")
            notes += [
                f"{len(a.params)} Muon params: {n}" for n in kinds.compute_view_notes(was, now)
            ]
    return tuple(notes)


def summarized(
    fqns: list[str], named_prefix: str = "", named: Callable[[str], bool] | None = None
) -> tuple[str, ...]:
    """Left-out items: those under ``named_prefix`` (the model's, say), or those ``named``
    holds, by name, the others by their first name component: ``lr_scheduler (3 items)``."""

    def by_name(fqn: str) -> bool:
        return bool(named_prefix and fqn.startswith(named_prefix)) or bool(named and named(fqn))

    counts: dict[str, int] = {}
    for fqn in fqns:
        if not by_name(fqn):
            head = fqn.split(".", 1)[0]
            counts[head] = counts.get(head, 0) + 1
    shown = [fqn for fqn in fqns if by_name(fqn)]
    return (*shown, *(f"{head} ({n} item{'s' * (n != 1)})" for head, n in counts.items()))
