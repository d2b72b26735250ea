"""A lower bound on the bytes of a manifest's text, counted before it is made: so that a write
whose manifest no reader would take is refused before any data is written.

Pure. It follows :meth:`muonckpt.format.manifest.Manifest.json_chunks` and
:func:`muonckpt.format.piece_index.index_chunks` line for line: a change to either text changes
it too (tests/test_refusals.py checks the two agree).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from ..layout.topology import Region
from .manifest import (
    CONSOLIDATED,
    Manifest,
    ParamEntry,
    compact_json,
    front_coded,
    param_to_json,
)
from .names import tensor_key


class ManifestSize:
    """The bytes of a manifest's text (format version 3), counted from what its lines will hold
    without making them (:meth:`Manifest.json_chunks` takes seconds at 100k params): the top
    level's params and their kinds exactly (:attr:`bytes`; of the groups, files, indexes and
    ``extra`` nothing, so a lower bound), and each data file's piece index exactly
    (:attr:`index_bytes`), so that a write whose manifest or an index of it no reader would
    take is refused before any data is written, naming the counts that make it large."""

    def __init__(self) -> None:
        self.params = 0
        self.pieces = 0
        self.bytes = _empty_manifest_bytes()
        self.index_bytes: dict[str, int] = {}
        """Each piece index's size, by its data file."""
        self._kinds: dict[tuple[Any, ...], int] = {}
        """Each kind's position, by everything a param holds but its name."""
        self._texts: dict[str, int] = {}
        self._positions: dict[str, int] = {}
        self._regions: dict[Region, int] = {}
        self._previous = ""
        """The last param's name (each name is written as what it shares with it and the rest)."""

    def add_param(self, entry: ParamEntry) -> None:
        """One entry of ``params`` (``[shared,"rest",kind]`` and its ``,\n``, or the list's
        brackets) and, the first time, its kind in ``param_kinds``."""
        # (each value's type too: 1, 1.0 and True are equal keys but different JSON)
        scalars = tuple((k, type(v.value), v.value, v.dtype) for k, v in entry.scalars.items())
        alike = (entry.shape, entry.tp_split_dim, entry.group, tuple(entry.dtypes.items()), scalars)
        kind = self._kinds.get(alike)
        if kind is None:
            kind = self._kinds[alike] = len(self._kinds)
            line = param_to_json(entry)
            del line["name"]
            self.bytes += len(compact_json(line)) + (2 if kind else 0)
        self._positions[entry.name] = self.params
        self.params += 1
        shared, self._previous = front_coded(self._previous, entry.name), entry.name
        rest = _text(entry.name[shared:])
        self.bytes += rest + 6 + len(str(shared)) + len(str(kind)) + 2  # the line and its comma

    def add_piece(
        self, param: str, key: str, file: str, tensor: str, region: Region, nbytes: int, chunk: int
    ) -> None:
        """One line of ``file``'s piece index: ``nbytes`` of data, a checksum per ``chunk``
        bytes (its params added first)."""
        texts = self._texts
        if (named := texts.get(key)) is None:
            named = texts[key] = _text(key)
        stored = 4 if tensor == tensor_key(param, key) else _text(tensor) + 2
        if (spans := self._regions.get(region)) is None:
            ints = (region.cols, region.block_start, region.block_width, region.start)
            spans = self._regions[region] = sum(len(str(i)) for i in (*ints, region.stop)) + 4
        checksums = -(-nbytes // chunk)
        size = self.index_bytes.get(file)
        if size is None:
            head = len(compact_json(file)) + len('{"format":"muonckpt-pieces","file":,"pieces":[')
            size = head + 1 + 3  # the newline after the header, "]}\n" at the end
        else:
            size += 1  # the comma that begins every line but the first
        line = 1 + len(str(self._positions[param])) + 1 + named + 2 + 1 + stored + 1
        line += 1 + spans + 1 + 1 + len(str(chunk)) + 1 + 16 * checksums + 2 + 1 + 1
        self.index_bytes[file] = size + line
        self.pieces += 1

    @property
    def largest_index(self) -> tuple[str, int]:
        """The data file whose piece index is largest, and its bytes (("", 0): none)."""
        return max(self.index_bytes.items(), key=lambda item: item[1], default=("", 0))


@functools.cache
def _empty_manifest_bytes() -> int:
    """The text of a manifest of nothing (made once: each save counts from it)."""
    return sum(len(chunk) for chunk in Manifest(CONSOLIDATED, {}, (), (), (), ()).json_chunks())


_quoted: Callable[[str], str] = json.encoder.encode_basestring_ascii
"""A string as :func:`compact_json` writes it (quoted, escaped, ASCII), at C speed."""


def _text(value: str) -> int:
    """The characters ``value`` takes inside its quotes in the manifest."""
    return len(_quoted(value)) - 2
