"""What the readers of foreign formats share: a source manifest's tensors written as a
consolidated muonckpt checkpoint, each read by the format's own function, and the lines of
their reports."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..checkpoint import writing
from ..checkpoint.writing import Progress
from ..format import kinds
from ..format.manifest import Manifest
from ..format.writeplan import TensorWrite, consolidated_plan

__all__ = ["conversion_notes", "summarized", "write_consolidated"]


def write_consolidated(
    source: Path,
    target: Manifest,
    scales: Sequence[float],
    read: Callable[[str, str], Any],
    dst: str | os.PathLike[str],
    *,
    overwrite: bool,
    progress: Progress | None,
) -> Path:
    """Write ``target``'s tensors, each ``read(param, key)`` from the foreign checkpoint at
    ``source`` as a whole tensor of its param's shape (momentum then scaled by its group's
    factor), as a consolidated muonckpt checkpoint at ``dst``."""
    items = [((e.name, k, e.dtype_of(k)), e.shape) for e in target.params for k in e.tensor_keys]
    plan = consolidated_plan(items, None)

    def fetch(w: TensorWrite) -> Any:
        tensor = read(w.param, w.key)
        if w.key == "momentum_buffer" and (scale := scales[target.param(w.param).group]) != 1.0:
            tensor = tensor.mul_(scale)
        return tensor

    def finished(reports: writing.Reports) -> Manifest:
        return replace(target, files=tuple(reports.files), pieces=tuple(reports.pieces))

    return writing.write_checkpoint(
        writing.LocalSteps(),
        dst,
        overwrite=overwrite,
        write=lambda staging: writing.write_files(plan, staging, fetch, progress),
        manifest=finished,
        source=source,
    )


def summarized(fqns: list[str]) -> tuple[str, ...]:
    """Left-out items by their first name component: ``lr_scheduler (3 items)``."""
    counts: dict[str, int] = {}
    for fqn in fqns:
        head = fqn.split(".", 1)[0]
        counts[head] = counts.get(head, 0) + 1
    return tuple(f"{head} ({n} item{'s' * (n != 1)})" for head, n in counts.items())


def conversion_notes(source: Manifest, target: Manifest) -> tuple[str, ...]:
    """One line per Muon group whose momentum changed form: how many params, by what."""
    notes = []
    for a, b in zip(source.groups, target.groups, strict=True):
        was, now = kinds.GroupKind.from_json(a.optimizer), kinds.GroupKind.from_json(b.optimizer)
        if was.role == "muon":
            note = kinds.state_mapping(was, now, f"group of {a.params[0]!r}", None).note
            if note is not None:
                notes.append(f"{len(a.params)} Muon params: {note}")
    return tuple(notes)
