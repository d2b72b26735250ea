"""The limits every foreign file is read under (another trainer's ``torch.save`` pickles, DCP's
stored values, JSON): what a small hostile file could otherwise make muonckpt build, hold or
write, bounded before anything of it is converted.

* :func:`check_archive`: a ``torch.save`` zip archive's members, from its central directory,
  before torch decompresses any: complete, each stored member holding the bytes it declares,
  compressed ones (``torch.save`` writes none) inflating to at most :data:`MAX_INFLATED_BYTES`,
  a compressed pickle to at most :data:`MAX_INFLATED_PICKLE`; and its pickle naming no global
  whose call allocates what its arguments ask (:data:`ALLOCATING`: torch's unpickler admits
  ``bytearray(2**31)``).
* :func:`read_json`: a foreign JSON file, parsed and walked as :func:`check_value` walks.
* :func:`check_value`: a loaded value, walked once by one bounded walker that never expands a
  shared reference (pickle's memo lets a few KB name a list of a billion items: each container
  is visited once, its expanded measures remembered by ``id``), for nesting depth, items per
  container, total values and characters as a conversion would expand them, and tensors:
  no stride-0 or overlapping view, storages of no more bytes than the file holds (a tensor
  made by its pickle, ``torch.Tensor(10**9)``, is not), and no more tensor bytes than those
  storages hold, :data:`MAX_TENSOR_REUSE` times over.

Every refusal is a :class:`~muonckpt.errors.CheckpointError` naming the file and the limit
(with its number, where it has one).
"""

from __future__ import annotations

import sys
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import CheckpointError
from .durable import read_text

__all__ = [
    "ALLOCATING",
    "MAX_DEPTH",
    "MAX_ELEMENTS",
    "MAX_INFLATED_BYTES",
    "MAX_INFLATED_PICKLE",
    "MAX_ITEMS",
    "MAX_TENSOR_REUSE",
    "MAX_TEXT",
    "check_archive",
    "check_value",
    "non_overlapping",
    "read_json",
]

MAX_DEPTH = 32
"""How deeply a foreign file's values may nest (containers in containers; a setting is stored
in a manifest, whose JSON nests at most 32 levels)."""
MAX_ITEMS = 1 << 20
"""The most items one container (a list, dict, tuple or set) may hold: a param group's
``params`` lists a million params."""
MAX_ELEMENTS = 1 << 22
"""The most values (containers, keys, numbers, strings, tensors) a file may hold, each shared
reference counted where it is used: what converting it would expand."""
MAX_TEXT = 1 << 26
"""The most characters (of strings and bytes) a file may hold, counted as :data:`MAX_ELEMENTS`."""
MAX_TENSOR_REUSE = 16
"""How many times over a file's tensors may use its stored bytes (tied weights share theirs):
each tensor's bytes counted where it is used, against the bytes of its distinct storages."""
MAX_INFLATED_BYTES = 1 << 26
"""The most bytes the compressed members of a ``torch.save`` archive may declare in all
(``torch.save`` stores its members uncompressed: a compressed one is a later re-zip)."""
MAX_INFLATED_PICKLE = 1 << 18
"""The most bytes a compressed pickle member (``data.pkl``) may declare. Unpickling builds up
to one object per byte (an ``EMPTY_SET`` opcode is one byte, its set 216), and the walk of
:func:`check_value` adds its own record of each: 256 KiB of such a pickle costs 115 MiB and
1.7 s of CPU, within a foreign file's bound of 256 MiB and 10 s; deflate at 1000:1 would otherwise
let a 64 KiB file build 64 MiB of pickle (GBs). A stored pickle is bounded by the file's own
size; trainers' pickles are KBs to a few MB, and stored."""

_ZIP_MAGIC = b"PK\x03\x04"


def check_archive(f: IO[bytes], path: Path, what: str = "") -> int:
    """Refuse a ``torch.save`` file (``f``, at its start) before torch reads it: a zip archive
    that is truncated, whose stored members declare more bytes than they hold, or whose
    compressed members would inflate past :data:`MAX_INFLATED_BYTES` (a pickle past
    :data:`MAX_INFLATED_PICKLE`; from its central directory: nothing inflated); and any whose
    pickle names a global of :data:`ALLOCATING`. Returns the bytes it holds (its members'
    declared sizes, or the file's size for a file of another kind, left to torch); ``f`` is
    left at its start."""
    named = f"{what}: " if what else ""
    size = f.seek(0, 2)
    f.seek(0)
    head = f.read(len(_ZIP_MAGIC))
    f.seek(0)
    if head != _ZIP_MAGIC:
        _check_pickle(f, path, named)
        f.seek(0)
        return size
    try:
        with zipfile.ZipFile(f) as archive:
            members = archive.infolist()
            _check_members(members, path, named)
            for member in members:
                if member.filename.endswith(".pkl"):
                    with archive.open(member) as pickled:
                        _check_pickle(pickled, path, named)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as exc:
        raise CheckpointError(
            f"{named}truncated or damaged: not a complete zip archive as torch.save writes "
            f"({size} bytes; {' '.join(str(exc).split())[:100]})",
            path=path,
        ) from None
    finally:
        f.seek(0)
    return sum(member.file_size for member in members)


def _check_members(members: list[zipfile.ZipInfo], path: Path, named: str) -> None:
    """Each stored member holds the bytes it declares; the compressed ones inflate to at most
    :data:`MAX_INFLATED_BYTES` in all, a compressed pickle to at most
    :data:`MAX_INFLATED_PICKLE`."""
    inflated = 0
    for member in members:
        if member.compress_type == zipfile.ZIP_STORED:
            if member.file_size != member.compress_size:
                raise CheckpointError(
                    f"{named}archive member {member.filename!r} declares {member.file_size} "
                    f"bytes but stores {member.compress_size}: damaged",
                    path=path,
                )
        else:
            if member.filename.endswith(".pkl") and member.file_size > MAX_INFLATED_PICKLE:
                raise CheckpointError(
                    f"{named}its pickle member {member.filename!r} is compressed and declares "
                    f"{member.file_size} bytes uncompressed, more than {MAX_INFLATED_PICKLE} "
                    "(torch.save stores its pickle uncompressed; unpickling builds an object "
                    "per byte): refused before inflating",
                    path=path,
                )
            inflated += member.file_size
            if inflated > MAX_INFLATED_BYTES:
                raise CheckpointError(
                    f"{named}its compressed archive members declare more than "
                    f"{MAX_INFLATED_BYTES} bytes uncompressed (torch.save compresses nothing): "
                    "refused before inflating",
                    path=path,
                )


ALLOCATING = ("bytearray",)
"""Globals torch's restricted unpickler admits whose call allocates what a few bytes of
arguments ask (``bytearray(2**31)``); no trainer's checkpoint holds one. (torch's unpickler
reads globals by its ``GLOBAL`` opcode only, so a name appears in the pickle as written.)"""


def _check_pickle(f: IO[bytes], path: Path, named: str) -> None:
    """Refuse a pickle (read from ``f`` a MiB at a time) that names a global of
    :data:`ALLOCATING`."""
    tail = b""
    while chunk := f.read(1 << 20):
        window, tail = tail + chunk, chunk[-32:]
        for name in ALLOCATING:
            if f"\n{name}\n".encode() in window:
                raise CheckpointError(
                    f"{named}its pickle names builtins.{name}, which no checkpoint holds and "
                    "whose call allocates what its arguments ask: refused before unpickling",
                    path=path,
                )


def read_json(path: Path, limit: int) -> Any:
    """The JSON value of the foreign file ``path`` (at most ``limit`` bytes), within the limits
    of :func:`check_value`.

    Raises:
        CheckpointError: naming ``path``, for a file that is unreadable, over ``limit`` bytes,
            not JSON (nested too deeply for the parser among that) or over a limit.
    """
    import json

    try:
        value = json.loads(read_text(path, limit=limit))
    except RecursionError:
        raise CheckpointError(
            f"is not JSON muonckpt reads: nested more than {MAX_DEPTH} levels deep", path=path
        ) from None
    except ValueError as exc:
        raise CheckpointError(f"is not JSON: {exc}", path=path) from None
    check_value(value, path)
    return value


def non_overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a strided view of ``shape`` and ``strides`` reaches each storage element at
    most once (in any order of its dimensions): never a stride-0 expansion or an overlapping
    view, so its elements are never more than its storage holds. A view of no element is."""
    if 0 in shape:
        return True
    reach = 0  # the furthest element the dimensions seen so far reach
    spans = sorted((p for p in zip(shape, strides, strict=True) if p[0] != 1), key=lambda p: p[1])
    for size, stride in spans:
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


class _Over(Exception):
    """A limit exceeded, with the keys from the value's top down to where (built unwinding)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why, self.keys = why, list[str]()


@dataclass
class _Measure:
    """What a value expands to: values, characters, tensor bytes, and how many levels of
    containers it is (a number 0, a list of numbers 1)."""

    elements: int = 1
    text: int = 0
    tensor_bytes: int = 0
    height: int = 0

    def add(self, other: _Measure) -> None:
        self.elements += other.elements
        self.text += other.text
        self.tensor_bytes += other.tensor_bytes
        self.height = max(self.height, other.height + 1)


_LEAF = _Measure()
_LEAVES = (int, float, complex, bool, type(None))


@dataclass
class _Walk:
    """One walk's memo (container or tensor ``id`` -> its measure; the objects kept alive so no
    ``id`` is reused), the containers being walked (a cycle), the storages seen (address ->
    bytes) and torch's tensor type (None when torch is not loaded: then no value is one)."""

    tensor: type | None
    seen: dict[int, _Measure] = field(default_factory=dict)
    kept: list[Any] = field(default_factory=list)
    open: set[int] = field(default_factory=set)
    storages: dict[int, int] = field(default_factory=dict)


def check_value(value: Any, path: Path, what: str = "", held: int | None = None) -> None:
    """Refuse ``value``, loaded from the foreign file ``path`` (``what``: the item of it), if
    converting it could expand past the limits of this module: its depth, a container's items,
    its values and characters counted as expanded (each container walked once: a shared one is
    never expanded), a stride-0 or overlapping tensor view, its tensors' storages holding more
    than the ``held`` bytes the file holds (a tensor made, not read: ``torch.Tensor(2**31)``),
    or its tensors using their storages' bytes more than :data:`MAX_TENSOR_REUSE` times over.

    Raises:
        CheckpointError: naming ``path``, the limit and its number, and where in the value.
    """
    torch = sys.modules.get("torch")
    walk = _Walk(None if torch is None else torch.Tensor)
    try:
        total = _measure(value, 0, walk)
        stored = sum(walk.storages.values())
        if held is not None and stored > held:
            raise _Over(
                f"its tensors hold {stored} bytes, more than the {held} bytes stored: made, "
                "not read"
            )
        if total.tensor_bytes > MAX_TENSOR_REUSE * stored:
            raise _Over(
                f"its tensors use {total.tensor_bytes} bytes of its {stored} stored bytes, more "
                f"than {MAX_TENSOR_REUSE} times over"
            )
    except _Over as over:
        at = "".join(reversed(over.keys))
        where = f" (at {at[:120]})" if at else ""
        named = f"{what}: " if what else ""
        raise CheckpointError(
            f"{named}{over.why}{where}: over muonckpt's limit for a foreign file, refused",
            path=path,
        ) from None


def _check_total(measure: _Measure) -> None:
    if measure.elements > MAX_ELEMENTS:
        raise _Over(
            f"holds more than {MAX_ELEMENTS} values (each shared reference counted where used)"
        )
    if measure.text > MAX_TEXT:
        raise _Over(
            f"holds more than {MAX_TEXT} characters of text (each shared reference counted "
            "where used)"
        )


def _measure(value: Any, depth: int, walk: _Walk) -> _Measure:
    """``value``'s expanded measure at ``depth`` containers down, each container and tensor
    measured once (by ``id``)."""
    if isinstance(value, _LEAVES):
        return _LEAF
    if isinstance(value, (str, bytes, bytearray)):
        return _Measure(text=len(value))
    known = walk.seen.get(id(value))
    if known is not None:
        if depth + known.height > MAX_DEPTH:
            raise _Over(f"nests more than {MAX_DEPTH} levels deep")
        return known
    if id(value) in walk.open:
        raise _Over("holds itself (a cycle)")
    if walk.tensor is not None and isinstance(value, walk.tensor):
        measure = _tensor_measure(value, walk)
    else:
        measure = _container_measure(value, depth, walk)
    walk.seen[id(value)] = measure
    walk.kept.append(value)
    return measure


def _items(value: Any) -> tuple[int, Iterable[tuple[Any, Any]]] | None:
    """A container's item count and its items as (where, value): a dict's keys and values, a
    sequence's or set's items, a stand-in object's attributes; None for any other value."""
    if isinstance(value, dict):
        pairs = (
            (k, v)
            for key, item in value.items()
            for k, v in ((("key", key), key), (("", key), item))
        )
        return len(value), pairs
    if isinstance(value, (list, tuple)):
        return len(value), ((("", i), v) for i, v in enumerate(value))
    if isinstance(value, (set, frozenset)):
        return len(value), ((("set", None), v) for v in value)
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):  # a stand-in of a foreign class: its attributes
        return len(attributes), (((".", k), v) for k, v in attributes.items())
    return None


def _shown(where: tuple[str, Any]) -> str:
    kind, key = where
    if kind == ".":
        return f".{str(key)[:40]}"
    if kind == "set":
        return "{...}"
    return f"[{kind + ' ' if kind else ''}{repr(key)[:40]}]"


def _container_measure(value: Any, depth: int, walk: _Walk) -> _Measure:
    held = _items(value)
    if held is None:
        return _LEAF
    count, items = held
    if depth + 1 > MAX_DEPTH:
        raise _Over(f"nests more than {MAX_DEPTH} levels deep")
    if count > MAX_ITEMS:
        raise _Over(f"a container holds {count} items, more than {MAX_ITEMS}")
    measure = _Measure(height=1)
    walk.open.add(id(value))
    for where, item in items:
        try:
            measure.add(_measure(item, depth + 1, walk))
            _check_total(measure)
        except _Over as over:
            over.keys.append(_shown(where))
            raise
    walk.open.discard(id(value))
    return measure


def _tensor_measure(value: Any, walk: _Walk) -> _Measure:
    """A tensor's measure (its bytes, its storage noted), refusing a stride-0 or overlapping
    view. Only a dense CPU tensor's bytes are counted (any other kind is refused where its
    kind is checked)."""
    import torch

    if value.layout != torch.strided or not value.is_cpu or value.is_nested:
        return _LEAF
    if not value.is_contiguous() and not non_overlapping(value.shape, value.stride()):
        raise _Over(
            f"a tensor of shape {list(value.shape)} is stored with strides "
            f"{list(value.stride())}: a stride-0 expansion or an overlapping view is refused"
        )
    storage = value.untyped_storage()
    walk.storages[storage.data_ptr()] = storage.nbytes()
    return _Measure(tensor_bytes=value.nbytes)
