"""Piece indexes (format version 3): the pieces of one data file, in a file of their own beside
it, so that the top-level manifest grows with the params and not with params x ranks, and a
rank that loads reads only the indexes of the files holding what it needs.

Pure: the index's text (:func:`index_chunks`) and its reading back with schema checks
(:func:`parse_index`); which indexes hold which params (:class:`IndexEntry.params`, spans of
positions in the manifest's ``params``). The bytes and the checksum of each index are recorded
in the top-level manifest (:class:`IndexEntry`); reading and checking them is
:mod:`muonckpt.files.pieces`. docs/format.md section 3a specifies the text.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from ..errors import CheckpointError
from ..layout.topology import Region, matrix_view
from .manifest import (
    DTYPE_BYTES,
    IndexEntry,
    ParamEntry,
    Piece,
    Spans,
    chunk_bytes_of,
    compact_json,
    pack_checksums,
)
from .names import tensor_key
from .strict_json import strict_json, valid_text

INDEX_FORMAT = "muonckpt-pieces"
"""The ``format`` field of every piece index."""
INDEX_SUFFIX = ".pieces.json"
"""A data file ``X.safetensors`` has its pieces listed in ``X.pieces.json``."""


def index_name(data_file: str) -> str:
    """The piece index of data file ``data_file`` (``rank-00003-of-00004.pieces.json``)."""
    stem = data_file.removesuffix(".safetensors")
    return f"{stem}{INDEX_SUFFIX}"


def spans_of(positions: Iterable[int]) -> Spans:
    """Sorted distinct ``positions`` as the fewest half-open spans."""
    spans: list[list[int]] = []
    for p in sorted(set(positions)):
        if spans and spans[-1][1] == p:
            spans[-1][1] = p + 1
        else:
            spans.append([p, p + 1])
    return tuple((lo, hi) for lo, hi in spans)


def index_chunks(
    file: str, pieces: Iterable[Piece], position: Mapping[str, int], names: Sequence[str]
) -> Iterator[str]:
    """The text of ``file``'s index: one compact JSON array per piece, ``[param position, key,
    tensor (null: the default key of :func:`~muonckpt.format.names.tensor_key`), [cols,
    block_start, block_width, start, stop], chunk_bytes, checksums joined]``. ``position``
    gives each param's position in ``params``, ``names`` each position's name as stored."""
    yield '{"format":"' + INDEX_FORMAT + '","file":' + compact_json(file) + ',"pieces":[\n'
    for number, piece in enumerate(pieces):
        at = position[piece.param]
        tensor = None if piece.tensor == tensor_key(names[at], piece.key) else piece.tensor
        r = piece.region
        row = [at, piece.key, tensor, [r.cols, r.block_start, r.block_width, r.start, r.stop]]
        text = compact_json([*row, piece.chunk_bytes, piece.digests.hex()])
        yield ("," if number else "") + text + "\n"
    yield "]}\n"


def parse_index(
    text: str | bytes, entry: IndexEntry, params: Sequence[ParamEntry], names: Sequence[str]
) -> tuple[Piece, ...]:
    """The pieces of an index's text, schema-checked against the manifest: the file it names,
    each param position within the index's recorded spans, each key one the param stores,
    each region inside the param (``check_region``, the manifest's own rule), the checksums
    as many as the piece's bytes need. ``params`` are the manifest's (renamed as asked),
    ``names`` the names as stored (for the default tensor keys). Raises CheckpointError."""
    try:
        body = strict_json(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"piece index is not valid JSON: {exc!r:.200}") from None
    _expect(isinstance(body, dict), "piece index is not a JSON object")
    _expect(
        set(body) == {"format", "file", "pieces"} and body["format"] == INDEX_FORMAT,
        f"not a piece index (fields {sorted(body)[:4]}, format {body.get('format')!r})",
    )
    _expect(body["file"] == entry.file, f"index names file {body['file']!r}, not {entry.file!r}")
    raw = body["pieces"]
    _expect(isinstance(raw, list), "pieces must be a list")
    _expect(len(raw) == entry.pieces, f"{len(raw)} pieces, the manifest says {entry.pieces}")
    file = sys.intern(entry.file)
    regions: dict[tuple[int, ...], Region] = {}
    pieces = []
    for item in raw:
        piece, param = _piece(item, file, entry, params, names, regions)
        check_region(param, piece.key, piece.region, piece.tensor)
        pieces.append(piece)
    return tuple(pieces)


def _piece(
    item: Any,
    file: str,
    entry: IndexEntry,
    params: Sequence[ParamEntry],
    names: Sequence[str],
    regions: dict[tuple[int, ...], Region],
) -> tuple[Piece, ParamEntry]:
    _expect(isinstance(item, list) and len(item) == 6, f"piece {item!r:.80} is not 6 fields")
    at, key, tensor, bounds, chunk_bytes, digests = item
    _expect(_int(at) and _within(at, entry.params), f"piece of param position {at!r} not held")
    param = params[at]
    _expect(isinstance(key, str) and key in param.dtypes, f"param {param.name!r}: key {key!r}")
    _expect(
        tensor is None or (isinstance(tensor, str) and valid_text(tensor)),
        f"tensor {tensor!r} is not a key",
    )
    _expect(
        isinstance(bounds, list) and len(bounds) == 5 and all(_int(b) and b >= 0 for b in bounds),
        f"param {param.name!r}: region {bounds!r} is not 5 non-negative ints",
    )
    chunk_bytes = chunk_bytes_of(chunk_bytes)
    _expect(
        isinstance(digests, str) and len(digests) % 16 == 0 and digests == digests.lower(),
        f"param {param.name!r}: checksums {digests!r:.40} are not 16-digit lowercase hex",
    )
    try:
        packed = pack_checksums([digests])
    except ValueError:
        raise CheckpointError(f"param {param.name!r}: checksums are not hex") from None
    region = regions.get(key_ := tuple(bounds))
    if region is None:
        region = regions[key_] = Region(*bounds)
    nbytes = region.numel * DTYPE_BYTES[param.dtypes[key]]
    _expect(
        len(packed) // 8 == -(-nbytes // chunk_bytes),
        f"param {param.name!r} {key!r}: {len(packed) // 8} checksums for {nbytes} bytes",
    )
    stored = sys.intern(tensor if tensor is not None else tensor_key(names[at], key))
    piece = Piece(param.name, sys.intern(key), file, stored, region, packed, chunk_bytes)
    return piece, param


def _within(at: int, spans: Spans) -> bool:
    return any(lo <= at < hi for lo, hi in spans)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckpointError(message)


def check_region(entry: ParamEntry, key: str, region: Region, tensor: str) -> None:
    """Refuse a piece whose region lies outside its stored tensor ``key`` of param ``entry``
    (the schema check of every piece, in a manifest or a piece index): a column block (a TP
    block) must be of the tensor's matrix view and hold whole slices of its split dim, as a TP
    split cuts it."""
    shape, split = entry.view_of(key)
    numel = math.prod(shape)
    ok = (
        (region.block_width > 0 or region.start == region.stop)
        and region.block_start + region.block_width <= region.cols
        and region.start <= region.stop
    )
    if ok and region.cols and region.numel:
        rows = numel // region.cols if numel % region.cols == 0 else -1
        ok = rows >= 0 and region.stop <= rows * region.block_width
    if ok and region.numel and region.block_width != region.cols:
        inner = math.prod(shape[split + 1 :]) if split >= 0 else 1
        ok = (
            region.cols == matrix_view(shape, split)[1]
            and region.block_start % inner == 0
            and region.block_width % inner == 0
        )
    if not ok:
        raise CheckpointError(
            f"piece {tensor!r}: region {asdict(region)} lies outside param shape {shape}"
        )
