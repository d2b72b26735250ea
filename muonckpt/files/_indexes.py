"""(internal) A manifest's checks before a write and a commit (:func:`check_manifest_fits`,
:func:`check_readable`) and the piece indexes of a commit (format version 3): one per data
file holding pieces, written and made durable before the manifest that records them; for
:mod:`muonckpt.files.writing`."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from .. import storage
from ..errors import CheckpointError
from ..format.manifest import FORMAT_VERSION, IndexEntry, Manifest, ParamEntry, Piece
from ..format.manifest_json import parse_manifest_chunks
from ..format.manifest_size import ManifestSize
from ..format.piece_index import index_chunks, index_name, spans_of
from ..format.records import placed
from ..format.writeplan import TensorWrite


def write_indexes(staging: Path, manifest: Manifest, final: object) -> Manifest:
    """(format version 3) One piece index per data file holding pieces, written into
    ``staging`` and made durable before the manifest that records their sizes and checksums
    (:func:`muonckpt.storage.write_texts_durably`: all written, then fsynced in one parallel
    pass); the manifest as it is committed."""
    by_file: dict[str, array[int]] = {}  # rows: a million pieces are not made at once
    for row, (file, _) in enumerate(placed(manifest.pieces)):
        by_file.setdefault(file, array("q")).append(row)
    names = tuple(entry.name for entry in manifest.params)
    position = {name: at for at, name in enumerate(names)}

    def pieces_in(file: str) -> Iterator[Piece]:  # (made as the index's text is written)
        return (manifest.pieces[row] for row in by_file[file])

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


def check_manifest_fits(
    params: Iterable[ParamEntry], writes: Iterable[TensorWrite], final: object
) -> None:
    """Refuse, before any data is written, a write whose manifest, or a piece index of it,
    would be more than a reader accepts (:data:`muonckpt.storage.MAX_TEXT_BYTES`): counted
    from its ``params`` and its planned ``writes``
    (:class:`~muonckpt.format.manifest_size.ManifestSize`: the indexes exactly, the top level
    a lower bound, since groups, files and ``extra`` are not counted;
    :func:`~muonckpt.files.writing.publish` checks every text again), naming the counts."""
    size = ManifestSize()
    for entry in params:
        size.add_param(entry)
    chunk = storage.CHUNK_BYTES
    for w in writes:
        size.add_piece(w.param, w.key, w.file, w.tensor, w.region, w.nbytes, chunk)
    limit = storage.MAX_TEXT_BYTES
    file, largest = size.largest_index
    if size.bytes > limit:
        raise CheckpointError(
            f"its manifest would be at least {size.bytes} bytes, more than the {limit} a reader "
            f"accepts: {size.params} params and {size.pieces} pieces (stored tensors); about "
            f"{size.bytes // max(size.params, 1)} bytes a param; nothing was written",
            path=final,
        )
    if largest > limit:
        raise CheckpointError(
            f"the piece index of {file} would be {largest} bytes, more than the {limit} a "
            f"reader accepts: {size.params} params and {size.pieces} pieces (stored tensors) "
            "in all; nothing was written. Store fewer, larger tensors per file (params=False "
            "leaves out the pieces of the params' own values; max_shard_size splits a "
            "consolidated file)",
            path=final,
        )


def check_readable(manifest: Path, source: object, final: object) -> None:
    """Refuse, before the commit, the ``manifest`` file written into the staging directory when
    the reader ``verify`` and ``load`` use refuses it (read as a stream,
    :func:`~muonckpt.format.manifest_json.parse_manifest_chunks`): odd values a rewrite took
    from ``source`` (a ``step`` of ``'abc'``, nesting past the reader's depth) commit nothing
    rather than a checkpoint nothing can read."""
    try:
        parse_manifest_chunks(storage.read_text_chunks(manifest), None)
    except CheckpointError as exc:
        raise CheckpointError(
            f"would give a checkpoint that verify and load refuse: {exc}; nothing was "
            f"committed at {final}",
            path=source,
        ) from None
