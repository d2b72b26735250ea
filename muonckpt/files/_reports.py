"""(internal) What the ranks of a write report to the root: each rank's :class:`Written`,
merged into :class:`Reports`, which complete the producer's :class:`Draft` of the manifest
(:func:`complete`; :mod:`muonckpt.files.writing`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from .. import storage
from ..format.manifest import (
    Extra,
    FileEntry,
    Manifest,
    ParamEntry,
    Piece,
    PieceTable,
    Scalar,
    piece_to_json,
    state_shapes_to_json,
)
from ..format.manifest_json import extra_from_json, piece_from_json, state_shapes_from_json
from ..format.writeplan import Plan, TensorWrite
from ..layout.state_shapes import StateShape


@dataclass
class Written:
    """What one rank wrote: its files (in order) and the pieces in them."""

    files: list[str]
    pieces: Sequence[Piece]
    dtypes: Mapping[tuple[str, str], str]
    """(param, key) -> safetensors dtype, of every piece."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Each safetensors file's size as planned (header and data), which the manifest lists:
    never what a file measures after the write, so that a file cut short under the save is
    refused by the commit's check instead of listed at its cut size."""
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The scalar state values this rank holds, param -> key -> ``{"value", "dtype"}``."""
    extra: dict[str, Any] | None = None
    """This rank's part of the job's own state (:class:`Extra` as JSON), files written."""
    shapes: Mapping[str, Mapping[str, StateShape]] = field(default_factory=dict)
    """The state tensors it wrote not shaped like their param: param -> key -> shape, rule."""

    def to_json(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "pieces": [piece_to_json(p) for p in self.pieces],
            "dtypes": [[param, key, dtype] for (param, key), dtype in self.dtypes.items()],
            "sizes": self.sizes,
            "scalars": self.scalars,
            "extra": self.extra,
            "shapes": {name: state_shapes_to_json(s) for name, s in self.shapes.items()},
        }

    @classmethod
    def of(
        cls,
        files: list[str],
        writes: Plan | Sequence[TensorWrite],
        pieces: Sequence[Piece],
        sizes: dict[str, int],
    ) -> Written:
        """The report of ``writes`` (a plan's, or a share of them) into ``files``: their dtypes
        read from them when first asked for."""
        each = writes if isinstance(writes, Sequence) else writes.iter_writes()
        dtypes = _Lazy(lambda: {(w.param, w.key): w.dtype for w in each})
        return cls(files, pieces, dtypes, sizes=sizes)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Written:
        return cls(
            list(raw["files"]),
            PieceTable(piece_from_json(p) for p in raw["pieces"]),
            {(param, key): dtype for param, key, dtype in raw["dtypes"]},
            dict(raw["sizes"]),
            raw["scalars"],
            raw["extra"],
            {name: state_shapes_from_json(s) for name, s in raw["shapes"].items()},
        )


@dataclass
class Reports:
    """Every rank's :class:`Written`, merged on the root: files in order, the pieces in
    (file, tensor key) order, each file's size in the staging directory."""

    files: list[FileEntry]
    pieces: PieceTable
    dtypes: Mapping[tuple[str, str], str]
    scalars: list[dict[str, dict[str, Any]]]
    extras: list[dict[str, Any] | None]
    shapes: dict[str, Mapping[str, StateShape]] = field(default_factory=dict)

    @classmethod
    def merged(cls, reports: Sequence[Written], staging: Path) -> Reports:
        """Every rank's report (in the order of the ranks) as one; a file no report sized is
        measured in ``staging``."""
        names = dict.fromkeys(name for r in reports for name in r.files)
        sizes = {name: size for r in reports for name, size in r.sizes.items()}
        files = [
            FileEntry(name, sizes[name] if name in sizes else storage.file_size(staging / name))
            for name in names
        ]
        pieces = reports[0].pieces if len(reports) == 1 else ()
        if not isinstance(pieces, PieceTable):  # (one process's own table is not copied)
            pieces = PieceTable(p for report in reports for p in report.pieces)
        order = {name: n for n, name in enumerate(names)}
        if any(a > b for a, b in pairwise((order[f], t) for f, t in pieces.placed())):
            keys = [(order[f], t) for f, t in pieces.placed()]  # ranks shared files out of order
            pieces = PieceTable(
                pieces[row] for row in sorted(range(len(keys)), key=keys.__getitem__)
            )
        return cls(
            files,
            pieces,
            _Lazy(lambda: {k: v for r in reports for k, v in r.dtypes.items()}),
            [r.scalars for r in reports],
            [r.extra for r in reports],
            {name: shapes for r in reports for name, shapes in r.shapes.items()},
        )


@dataclass(frozen=True)
class Draft:
    """A checkpoint's manifest as its producer knows it before the write: ``manifest`` without
    files and pieces (its params' dtypes and scalars where the producer knows them; the model
    section's tensors and tied names), which the root completes from the ranks' reports
    (:func:`complete`)."""

    manifest: Manifest
    record_step: bool = False
    """Record the step the complete manifest holds (a save: the optimizer's own count, known
    only from every rank's scalars, where ``manifest`` records none); else ``manifest``'s."""


def complete(draft: Draft, reports: Reports) -> Manifest:
    """``draft``'s manifest with what the ranks wrote: the files; the pieces, those of the
    model section's tensors in it; each param's scalars the ranks report, and the dtypes of
    its pieces where the draft has none (keys sorted); the job's own state the ranks wrote
    (else the draft's)."""
    manifest, model = draft.manifest, draft.manifest.model
    others = {t.name for t in model.tensors} if model is not None else set()
    pieces = reports.pieces
    if model is not None and others:
        model = replace(model, pieces=tuple(p for p in pieces if p.param in others))
        pieces = PieceTable(p for p in pieces if p.param not in others)
    done = replace(
        manifest,
        params=_entries(manifest.params, pieces, reports),
        files=tuple(reports.files),
        pieces=pieces,
        model=model,
        extra=_merged_extra(reports.extras) or manifest.extra,
    )
    return replace(done, recorded_step=done.step) if draft.record_step else done


def _entries(
    params: Sequence[ParamEntry], pieces: PieceTable, reports: Reports
) -> tuple[ParamEntry, ...]:
    """``params`` with the scalars the ranks report (the first rank's of each, in rank
    order) and, where an entry has no dtypes, those of its pieces."""
    scalars: dict[str, dict[str, Scalar]] = {}
    for report in reports.scalars:
        for name, values in report.items():
            for key, item in values.items():
                scalars.setdefault(name, {}).setdefault(key, Scalar(item["value"], item["dtype"]))
    bare = {e.name for e in params if not e.dtypes}
    keys: dict[str, set[str]] = {}
    for piece in pieces if bare else ():
        if piece.param in bare:
            keys.setdefault(piece.param, set()).add(piece.key)
    if not scalars and not keys and not reports.shapes:
        return tuple(params)
    return tuple(
        replace(
            e,
            dtypes=e.dtypes or {k: reports.dtypes[e.name, k] for k in sorted(keys.get(e.name, ()))},
            scalars={**e.scalars, **scalars.get(e.name, {})},
            state_shapes={**e.state_shapes, **reports.shapes.get(e.name, {})},
        )
        for e in params
    )


def _merged_extra(parts: Sequence[dict[str, Any] | None]) -> Extra | None:
    """Every rank's part of the job's own state (in rank order) as one: the root's
    ``extra``, each rank's ``rank_extra``, all their files."""
    found = [extra_from_json(part) for part in parts if part is not None]
    if not found:
        return None
    shared = next((e.shared for e in found if e.shared is not None), None)
    ranks = tuple(tree for e in found for tree in e.ranks)
    return Extra(shared, ranks, tuple(f for e in found for f in e.files))


class _Lazy(Mapping[tuple[str, str], str]):
    """A mapping made when first read: the offline tools' commit never reads the dtypes of
    300k written tensors, and a dict of them was 30 MB alive at the commit."""

    def __init__(self, make: Callable[[], dict[tuple[str, str], str]]) -> None:
        self._make: Callable[[], dict[tuple[str, str], str]] | None = make
        self._made: dict[tuple[str, str], str] = {}

    def _mapping(self) -> dict[tuple[str, str], str]:
        if self._make is not None:
            self._made, self._make = self._make(), None
        return self._made

    def __getitem__(self, item: tuple[str, str]) -> str:
        return self._mapping()[item]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())
