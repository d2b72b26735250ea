"""What every foreign format's reader shares: the consolidated muonckpt checkpoint it writes
(:func:`write_consolidated`, through the write engine's calls), stacked experts split checked
against the model's other tensors (:func:`split_experts_of`), and the lines saying how its
momentum was converted (:func:`conversion_notes`) and what it left out (:func:`summarized`)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import storage
from ..files import writing
from ..files.attempt import Attempt
from ..files.writing import Progress
from ..format import kinds
from ..format.manifest import Manifest, ModelFile, ParamEntry
from ..format.names import PARAM_KEY
from ..format.stacked import Part, split_stacked
from ..format.writeplan import Plan, consolidated_plan


def write_consolidated(
    target: Manifest,
    scales: Sequence[float],
    read: Callable[[str, str], Any],
    dst: str | os.PathLike[str],
    *,
    overwrite: bool,
    progress: Progress | None,
    source: Path,
    aliases: Mapping[str, str] | None = None,
    model_tensors: Sequence[ParamEntry] = (),
    parts: Mapping[str, Part] | None = None,
) -> Path:
    """Write ``target``'s tensors, each ``read(param, key)`` (a tensor of its own, read once:
    momentum is multiplied in place by its group's factor of ``scales``), as a consolidated
    muonckpt checkpoint at ``dst``; tied names (``aliases``: alias -> stored name) go into
    the model files' metadata. ``model_tensors`` (the model's other tensors: buffers, params
    no optimizer holds, each ``read(name, PARAM_KEY)``) and the aliases go into the manifest's
    :class:`ModelFile`. ``parts``: ``target``'s params split from stacked ones
    (:func:`muonckpt.format.stacked.split_stacked`), each read as its matrix of the stacked
    tensor ``read`` gives, which is read once per key."""
    if parts:
        read = _reading_parts(read, parts)
    items = [((e.name, k, e.dtype_of(k)), e.shape) for e in target.params for k in e.tensor_keys]
    items += [((t.name, PARAM_KEY, t.dtype_of(PARAM_KEY)), t.shape) for t in model_tensors]
    plan = consolidated_plan(items, None, dict(aliases) if aliases else None)
    model = target.model
    if model_tensors or (aliases and model is None):
        model = ModelFile(tuple(model_tensors), (), dict(aliases or {}))
    draft = writing.Draft(replace(target, model=model))
    store, steps = storage.store_for(dst), writing.LocalSteps()
    staging = writing.stage(steps, store, dst, overwrite=overwrite, source=source)
    tensors = _scaled(target, scales, read, plan, {t.name for t in model_tensors})
    try:
        written = Attempt(writing.write_files(store, plan, staging, tensors, progress))
    except BaseException as exc:
        written = Attempt(failure=exc)
    replaced = writing.commit(steps, store, staging, dst, written, draft, source=source)
    return writing.retire(steps, store, replaced, dst)


def _scaled(
    target: Manifest,
    scales: Sequence[float],
    read: Callable[[str, str], Any],
    plan: Plan,
    others: set[str],
) -> writing.Tensors:
    """Each tensor of ``plan`` as it is written, ``read(param, key)``: momentum multiplied in
    place by its group's factor of ``scales``; the model's ``others`` as they are."""
    for w in writing.in_order(plan):
        tensor = read(w.param, w.key)
        momentum = w.param not in others and w.key == "momentum_buffer"
        if momentum and (scale := scales[target.param(w.param).group]) != 1.0:
            tensor = tensor.mul_(scale)
        yield w, tensor


def split_experts_of(
    target: Manifest, others: Sequence[ParamEntry], aliases: Mapping[str, str]
) -> tuple[Manifest, Mapping[str, Part]]:
    """:func:`split_stacked` of ``target``, checked against the model's other tensors and tied
    names the output will carry (a split name they take, or a tie to a split param, refused
    before anything is written)."""
    known = replace(target, model=ModelFile(tuple(others), (), dict(aliases)))
    split, parts = split_stacked(known)
    return replace(split, model=target.model), parts


def _reading_parts(
    read: Callable[[str, str], Any], parts: Mapping[str, Part]
) -> Callable[[str, str], Any]:
    """``read`` that gives each split param's matrix of its stacked tensor, the stacked tensor
    read once per key and held until its last matrix is taken (the writer fetches one tensor
    at a time, in whatever order its files sort the names)."""
    count = Counter(part.stacked for part in parts.values())
    held: dict[tuple[str, str], tuple[Any, list[int]]] = {}

    def read_part(name: str, key: str) -> Any:
        part = parts.get(name)
        if part is None:
            return read(name, key)
        slot = (part.stacked, key)
        if slot not in held:
            tensor = read(part.stacked, key)
            held[slot] = (tensor.reshape(-1, *tensor.shape[-2:]), [count[part.stacked]])
        matrices, left = held[slot]
        left[0] -= 1
        if not left[0]:
            del held[slot]
        return matrices[part.index]

    return read_part


def conversion_notes(source: Manifest, target: Manifest) -> tuple[str, ...]:
    """One line per Muon group whose momentum changed form between ``source`` and ``target``
    (the same groups, rewritten)."""
    notes = []
    for a, b in zip(source.groups, target.groups, strict=True):
        was, now = kinds.GroupKind.from_json(a.optimizer), kinds.GroupKind.from_json(b.optimizer)
        if was.role == "muon":
            note = kinds.state_mapping(was, now, f"group of {a.params[0]!r}", None).note
            if note is not None:
                notes.append(f"{len(a.params)} Muon params: {note}")
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
