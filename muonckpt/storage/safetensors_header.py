"""A safetensors file's header, checked: parsed member by member into compact records of its
tensors (a header of 300k tensors is 30 MB of JSON), each entry's dtype, shape and offsets
sound. :mod:`.safetensors_reader` reads the header's bytes and judges what this refuses."""

from __future__ import annotations

import bisect
import codecs
import itertools
import json
import math
import sys
from array import array
from collections.abc import Callable, Iterator
from typing import TypeGuard

from ..format.manifest import DTYPE_BYTES
from ..format.strict_json import TextWindow
from .checksums import CHUNK_BYTES
from .safetensors_format import DTYPE_CODES, DTYPES, METADATA_KEY, TensorRecord


def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


Entry = tuple[str, tuple[int, ...], int, int]
"""A tensor's header entry, checked: ``(dtype, shape, begin, end)``."""

_DTYPE_NAMES = {name: name for name in DTYPE_BYTES}


def tensor_entry(info: object) -> Entry | str:
    """A tensor's header entry as an :data:`Entry`, or what is wrong with it (its offsets
    against the file's size aside)."""
    if not isinstance(info, dict):
        return "tensor entry is not an object"
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        return f"unknown dtype {dtype!r}"
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(is_int(s) and s >= 0 for s in shape):
        return f"shape {shape!r} is not a list of non-negative ints"
    offsets = info.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        return f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end"
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != nbytes:
        return (
            f"data_offsets {offsets} span {end - begin} bytes, but {dtype} {shape} needs {nbytes}"
        )
    return _DTYPE_NAMES[dtype], tuple(shape), begin, end


HEADER_WINDOW = 4 << 20
"""Bytes of a header read and decoded at a time: a header of 300k tensors is 30 MB, which
whole, as bytes and as text, took 60 MB."""


def header_chunks(read: Callable[[int, int], bytes], start: int, length: int) -> Iterator[str]:
    """A header's text, :data:`HEADER_WINDOW` bytes at a time, decoded (UTF-8) as it comes."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    end = start + length
    while start < end:
        count = min(HEADER_WINDOW, end - start)
        data = read(start, count)
        start += count
        yield decoder.decode(data, final=start >= end)


def regular_header(
    text: TextWindow, data_start: int, data_size: int
) -> tuple[dict[str, str], Records] | None:
    """The metadata and records of a header that is a JSON object of sound entries, each
    within the ``data_size`` bytes of data, no key twice, read member by member (never the
    object whole, a dict of 300k entries, nor its text whole); None for anything else, which
    the full parse judges (naming the problem)."""
    scan = json.JSONDecoder(object_pairs_hook=compact_entries()).scan_once  # type: ignore[attr-defined]
    records, metadata = Records(), None
    try:
        if text.peek() != "{":
            return None
        text.pos += 1
        closing = text.peek() == "}"
        while not closing:
            key = text.scan(scan) if text.peek() == '"' else None
            if not isinstance(key, str) or text.peek() != ":":
                return None
            text.pos += 1
            text.peek()
            value = text.scan(scan)
            if key == METADATA_KEY and metadata is None and string_map(value):
                metadata = dict(value)
            elif key != METADATA_KEY and isinstance(value, tuple) and value[3] <= data_size:
                dtype, shape, begin, end = value
                records.add(key, dtype, shape, data_start + begin, end - begin)
            else:
                return None
            closing = text.peek() == "}"
            if not closing:
                if text.peek() != ",":
                    return None
                text.pos += 1
                text.peek()
        text.pos += 1
        if text.peek() or not records.seal():
            return None
    except (StopIteration, ValueError, RecursionError):  # UnicodeDecodeError included
        return None
    return metadata or {}, records


def string_map(value: object) -> TypeGuard[dict[str, str]]:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def compact_entries() -> Callable[[list[tuple[str, object]]], object]:
    """The ``object_pairs_hook`` of a header: each sound tensor entry becomes an
    :data:`Entry` (equal shapes one tuple) as soon as it is parsed, since a header of 300k
    tensors as dicts and lists takes several times the memory; anything else stays a dict
    (no key twice), checked where it is used."""
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}

    def compact(pairs: list[tuple[str, object]]) -> object:
        body = no_duplicates(pairs)
        entry = tensor_entry(body)
        if isinstance(entry, str):
            return body
        dtype, shape, begin, end = entry
        return dtype, shapes.setdefault(shape, shape), begin, end

    return compact


class Records:
    """The records of one file's tensors, compactly (300k :class:`TensorRecord` objects took
    50 MB): keys sorted, beside arrays of their offsets, sizes and dtypes and a list of their
    shapes (equal ones one tuple); a record is made when asked for."""

    def __init__(self) -> None:
        self._keys: list[str] = []
        self._shapes: list[tuple[int, ...]] = []
        self._offsets, self._sizes, self._dtypes = array("q"), array("q"), array("B")
        self.ordered, self._end = True, 0
        """Whether the data of the tensors added lies in their order (then none overlap)."""

    def add(self, key: str, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int) -> None:
        """One more tensor (then :meth:`seal`, once all are added)."""
        if nbytes:
            self.ordered = self.ordered and offset >= self._end
            self._end = offset + nbytes
        self._keys.append(sys.intern(key))  # the manifest's pieces name it too: one string
        self._shapes.append(shape)
        self._offsets.append(offset)
        self._sizes.append(nbytes)
        self._dtypes.append(DTYPE_CODES[dtype])

    def seal(self) -> bool:
        """Sort the tensors by key, for lookups; False when a key came twice."""
        keys = self._keys
        if all(a < b for a, b in itertools.pairwise(keys)):
            return True
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self._keys = [keys[i] for i in order]
        self._shapes = [self._shapes[i] for i in order]
        for name in ("_offsets", "_sizes", "_dtypes"):
            values = getattr(self, name)
            setattr(self, name, array(values.typecode, (values[i] for i in order)))
        return all(a < b for a, b in itertools.pairwise(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def _index(self, key: object) -> int | None:
        if not isinstance(key, str):
            return None
        index = bisect.bisect_left(self._keys, key)
        return index if index < len(self._keys) and self._keys[index] == key else None

    def __contains__(self, key: object) -> bool:
        return self._index(key) is not None

    def get(self, key: str) -> TensorRecord | None:
        index = self._index(key)
        return None if index is None else self._record(index)

    def _record(self, index: int) -> TensorRecord:
        return TensorRecord(
            key=self._keys[index],
            dtype=DTYPES[self._dtypes[index]],
            shape=self._shapes[index],
            offset=self._offsets[index],
            nbytes=self._sizes[index],
            digests=b"",
            chunk_bytes=CHUNK_BYTES,
        )

    def keys(self) -> list[str]:
        """Every key, sorted."""
        return list(self._keys)

    def all(self) -> Iterator[TensorRecord]:
        return (self._record(index) for index in range(len(self._keys)))
