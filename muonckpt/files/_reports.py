"""(internal) What the ranks of a write report to the root: each rank's :class:`Written`,
merged into :class:`Reports`, from which the root builds the manifest
(:mod:`muonckpt.files.writing`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from .. import storage
from ..format.manifest import FileEntry, Piece, PieceTable, piece_to_json
from ..format.manifest_json import piece_from_json
from ..format.writeplan import TensorWrite


@dataclass
class Written:
    """What one rank wrote: its files (in order) and the pieces in them."""

    files: list[str]
    pieces: Sequence[Piece]
    dtypes: Mapping[tuple[str, str], str]
    """(param, key) -> safetensors dtype, of every piece."""
    extra: Any = None
    """Anything else the caller reports to the root (JSON)."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Each safetensors file's size as planned (header and data), which the manifest lists:
    never what a file measures after the write, so that a file cut short under the save is
    refused by the commit's check instead of listed at its cut size."""

    def to_json(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "pieces": [piece_to_json(p) for p in self.pieces],
            "dtypes": [[param, key, dtype] for (param, key), dtype in self.dtypes.items()],
            "extra": self.extra,
            "sizes": self.sizes,
        }

    @classmethod
    def of(
        cls,
        files: list[str],
        writes: Callable[[], Iterable[TensorWrite]],
        pieces: Sequence[Piece],
        sizes: dict[str, int],
    ) -> Written:
        """The report of ``writes()`` into ``files`` (their dtypes read from the plan when
        first asked for)."""
        dtypes = _Lazy(lambda: {(w.param, w.key): w.dtype for w in writes()})
        return cls(files, pieces, dtypes, sizes=sizes)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Written:
        return cls(
            list(raw["files"]),
            PieceTable(piece_from_json(p) for p in raw["pieces"]),
            {(param, key): dtype for param, key, dtype in raw["dtypes"]},
            raw["extra"],
            dict(raw["sizes"]),
        )


@dataclass
class Reports:
    """Every rank's :class:`Written`, merged on the root: files in order, the pieces in
    (file, tensor key) order, each file's size in the staging directory."""

    files: list[FileEntry]
    pieces: PieceTable
    dtypes: Mapping[tuple[str, str], str]
    extras: list[Any]

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
            [r.extra for r in reports],
        )


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
