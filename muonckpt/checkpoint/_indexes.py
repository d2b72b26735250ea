"""(internal) The piece indexes of a commit (format version 3): one per data file holding
pieces, written and made durable before the manifest that records them; for
:func:`muonckpt.checkpoint.writing.commit`."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from .. import storage
from ..errors import CheckpointError
from ..format.manifest import FORMAT_VERSION, IndexEntry, Manifest, Piece, PieceTable
from ..format.piece_index import index_chunks, index_name, spans_of


def write_indexes(staging: Path, manifest: Manifest, final: Path) -> Manifest:
    """(format version 3) One piece index per data file holding pieces, written into
    ``staging`` and made durable before the manifest that records their sizes and checksums
    (:func:`muonckpt.storage.write_texts_durably`: all written, then fsynced in one parallel
    pass); the manifest as it is committed."""
    by_file: dict[str, array[int]] = {}  # rows: a million pieces are not made at once
    for row, (file, _) in enumerate(_placed(manifest.pieces)):
        by_file.setdefault(file, array("q")).append(row)
    names = tuple(entry.name for entry in manifest.params)
    position = {name: at for at, name in enumerate(names)}

    def pieces_in(file: str) -> Iterator[Piece]:  # (made as the index's text is written)
        return map(manifest.pieces.__getitem__, by_file[file])

    texts = {
        index_name(file): index_chunks(file, pieces_in(file), position, names) for file in by_file
    }
    try:
        written = storage.write_texts_durably(staging, texts, limit=storage.MAX_TEXT_BYTES)
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; nothing was committed", path=final) from None
    indexes = tuple(
        IndexEntry(
            index_name(file),
            file,
            *written[index_name(file)],
            len(by_file[file]),
            spans_of(position[p.param] for p in pieces_in(file)),
        )
        for file in by_file
    )
    return replace(
        manifest, format_version=FORMAT_VERSION, indexes=indexes, complete=True, stored_names=()
    )


def _placed(pieces: Sequence[Piece]) -> Iterator[tuple[str, str]]:
    """Each piece's (file, tensor key), from a :class:`PieceTable` without making the pieces."""
    if isinstance(pieces, PieceTable):
        return pieces.placed()
    return ((p.file, p.tensor) for p in pieces)
