"""(internal) The piece indexes of a commit (format version 3): one per data file holding
pieces, written and made durable before the manifest that records them; for
:func:`muonckpt.checkpoint.writing.commit`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .. import storage
from ..errors import CheckpointError
from ..format.manifest import FORMAT_VERSION, IndexEntry, Manifest, Piece
from ..format.piece_index import index_chunks, index_name, spans_of


def write_indexes(staging: Path, manifest: Manifest, final: Path) -> Manifest:
    """(format version 3) One piece index per data file holding pieces, written into
    ``staging`` and made durable before the manifest that records their sizes and checksums
    (:func:`muonckpt.storage.write_texts_durably`: all written, then fsynced in one parallel
    pass); the manifest as it is committed."""
    by_file: dict[str, list[Piece]] = {}
    for piece in manifest.pieces:
        by_file.setdefault(piece.file, []).append(piece)
    names = tuple(entry.name for entry in manifest.params)
    position = {name: at for at, name in enumerate(names)}
    texts = {
        index_name(file): index_chunks(file, pieces, position, names)
        for file, pieces in by_file.items()
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
            len(pieces),
            spans_of(position[p.param] for p in pieces),
        )
        for file, pieces in by_file.items()
    )
    return replace(
        manifest, format_version=FORMAT_VERSION, indexes=indexes, complete=True, stored_names=()
    )
