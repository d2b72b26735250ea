"""A lower bound on the bytes of a manifest's text, counted before it is made: so that a write
whose manifest no reader would take is refused before any data is written.

Pure. It follows :meth:`muonckpt.format.manifest.Manifest.json_chunks` line for line: a change
to the manifest's JSON text changes it too (tests/test_refusals.py checks the two agree).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..layout.topology import Region
from .manifest import (
    CONSOLIDATED,
    Manifest,
    ParamEntry,
    Piece,
    compact_json,
    param_to_json,
    piece_to_json,
)


class ManifestSize:
    """A lower bound on the bytes of a manifest's text, counted from what its lines will hold
    without making them (:meth:`Manifest.json_chunks` takes seconds at 100k params): each
    param's and each piece's line exactly, and each param's name in its group's list; of the
    groups nothing else, nor of ``extra``. So that a write whose manifest no reader would take
    is refused before any data is written, naming the counts that make it large."""

    def __init__(self) -> None:
        self.params = 0
        self.pieces = 0
        empty = Manifest(CONSOLIDATED, {}, (), (), (), ())
        self.bytes = sum(len(chunk) for chunk in empty.json_chunks())
        blank = Region(0, 0, 0, 0, 0)
        self._piece_line = len(compact_json(piece_to_json(Piece("", "", "", "", blank, b"", 0))))
        self._texts: dict[str, int] = {}
        self._last = ("", 0)
        """The last piece's param and its text."""
        self._regions: dict[Region, int] = {}
        self._alike: dict[tuple[Any, ...], int] = {}
        """A param's line without its name, by everything else it holds."""
        self._groups: set[int] = set()

    def add_param(self, entry: ParamEntry) -> None:
        """One entry of ``params``, exactly (+2: its ``,\\n`` or the list's brackets), and its
        name in its group's ``params`` (+3: quotes and a comma, but one per group)."""
        # (each value's type too: 1, 1.0 and True are equal keys but different JSON)
        scalars = tuple((k, type(v.value), v.value, v.dtype) for k, v in entry.scalars.items())
        alike = (entry.shape, entry.tp_split_dim, entry.group, tuple(entry.dtypes.items()), scalars)
        if (rest := self._alike.get(alike)) is None:  # params differ mostly by their names
            rest = self._alike[alike] = len(compact_json(param_to_json(replace(entry, name=""))))
        listed = 3 - (entry.group not in self._groups)
        self._groups.add(entry.group)
        self.params += 1
        self.bytes += rest + 2 + 2 * _text(entry.name) + listed

    def add_piece(
        self, param: str, key: str, file: str, tensor: str, region: Region, nbytes: int, chunk: int
    ) -> None:
        """One entry of ``pieces``: ``nbytes`` of data, a checksum per ``chunk`` bytes."""
        texts = self._texts
        if (named := texts.get(key)) is None:
            named = texts[key] = _text(key)
        if (filed := texts.get(file)) is None:
            filed = texts[file] = _text(file)
        if param != self._last[0]:  # a param's pieces come together
            self._last = (param, _text(param))
        if (spans := self._regions.get(region)) is None:
            ints = (region.cols, region.block_start, region.block_width, region.start)
            spans = self._regions[region] = sum(len(str(i)) - 1 for i in (*ints, region.stop))
        checksums = -(-nbytes // chunk)
        self.pieces += 1
        self.bytes += (
            self._piece_line
            + 2
            + self._last[1]
            + named
            + filed
            + _text(tensor)
            + spans
            + (19 * checksums - 1 if checksums else 0)
            + len(str(chunk))
            - 1
        )


_quoted: Callable[[str], str] = json.encoder.encode_basestring_ascii
"""A string as :func:`compact_json` writes it (quoted, escaped, ASCII), at C speed."""


def _text(value: str) -> int:
    """The characters ``value`` takes inside its quotes in the manifest."""
    return len(_quoted(value)) - 2
