"""(internal) The manifest of a save: a :class:`ManifestDraft` of what is known at the call
(made by :func:`muonckpt.checkpoint.saving.plan`), completed on the root at the commit from the
ranks' reports of what they wrote (:func:`complete`, called by
:func:`muonckpt.checkpoint.saving.commit`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..format.manifest import (
    Extra,
    GroupEntry,
    Manifest,
    ModelFile,
    ParamEntry,
    PieceTable,
    Scalar,
    model_tensor,
)
from ..format.manifest_json import extra_from_json
from ..format.names import PARAM_KEY

if TYPE_CHECKING:
    from ..files.writing import Reports
    from ..state.model_state import ModelTensors
    from ..state.sharding_model import Sharding


@dataclass(frozen=True)
class ManifestDraft:
    """What a save's manifest holds before anything is written: the groups as taken at the
    save's start, the params from the grid, its kind, ``model``'s other tensors, and the step
    ``extra["step"]`` gave (None: the optimizer's count, where it keeps one)."""

    groups: Sequence[GroupEntry]
    sharding: Sharding
    kind: str
    model: ModelTensors | None = None
    given_step: int | None = None


def complete(draft: ManifestDraft, reports: Reports) -> Manifest:
    """The manifest of a save: ``draft`` with the files, pieces, dtypes, scalars and the job's
    own state from the ranks' reports (``model``'s other tensors apart, in
    :class:`ModelFile`); the step ``given_step``, else the optimizer's count where it keeps
    one."""
    scalars: dict[str, dict[str, Scalar]] = {}
    for report in reports.extras:
        for name, values in report["scalars"].items():
            for key, item in values.items():
                scalars.setdefault(name, {}).setdefault(key, Scalar(item["value"], item["dtype"]))
    model = draft.model
    extras = model.extras if model is not None else {}
    pieces = PieceTable(p for p in reports.pieces if p.param not in extras)
    dtypes = reports.dtypes
    keys: dict[str, set[str]] = {}
    for piece in pieces:
        keys.setdefault(piece.param, set()).add(piece.key)
    entries = []
    for param in draft.sharding.params:
        entries.append(
            ParamEntry(
                name=param.name,
                shape=tuple(param.full_shape),
                group=param.group,
                tp_split_dim=param.tp_split_dim,
                dtypes={k: dtypes[param.name, k] for k in sorted(keys.get(param.name, ()))},
                scalars=dict(scalars.get(param.name, {})),
            )
        )
    model_file = None
    if model is not None:
        model_file = ModelFile(
            tensors=tuple(
                model_tensor(name, t.shape, dtypes[name, PARAM_KEY]) for name, t in extras.items()
            ),
            pieces=tuple(p for p in reports.pieces if p.param in extras),
            aliases=dict(model.aliases),
        )
    manifest = Manifest(
        kind=draft.kind,
        topology=dict(draft.sharding.topology),
        groups=tuple(draft.groups),
        params=tuple(entries),
        files=tuple(reports.files),
        pieces=pieces,
        model=model_file,
        extra=_merged_extra([report["extra"] for report in reports.extras]),
    )
    step = draft.given_step if draft.given_step is not None else manifest.step
    return replace(manifest, recorded_step=step)


def _merged_extra(parts: Sequence[dict[str, Any] | None]) -> Extra | None:
    """Every rank's part of the job's own state (in grid order) as one: the root's ``extra``,
    each rank's ``rank_extra``, all their files."""
    found = [extra_from_json(part) for part in parts if part is not None]
    if not found:
        return None
    shared = next((e.shared for e in found if e.shared is not None), None)
    ranks = tuple(tree for e in found for tree in e.ranks)
    return Extra(shared, ranks, tuple(f for e in found for f in e.files))
