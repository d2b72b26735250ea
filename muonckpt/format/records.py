"""The records a manifest is made of: params, groups, pieces, files, piece indexes, and the
checksums packed as pieces keep them. Pure; :mod:`.manifest` builds the manifest from them
(and names every one of them too).
"""

from __future__ import annotations

import math
import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, overload

from ..layout.state_shapes import SAME, StateShape
from ..layout.topology import Region
from .names import PARAM_KEY, tensor_key

DIGEST_BYTES = 8
"""Bytes of one checksum packed (:func:`pack_checksums`): its digest, big-endian, as its hex
digits spell it."""


def pack_checksums(checksums: Iterable[str]) -> bytes:
    """Checksums (hex strings, as the manifest writes them) packed into one bytes object,
    :data:`DIGEST_BYTES` each: how pieces and written records keep them, since a tuple of
    strings per tensor took 36 MB at 100k params. :func:`unpack_checksums` gives them back."""
    return bytes.fromhex("".join(checksums))


def unpack_checksums(digests: bytes) -> tuple[str, ...]:
    """Packed checksums (:func:`pack_checksums`) as the manifest's hex strings."""
    text, width = digests.hex(), 2 * DIGEST_BYTES
    return tuple(text[i : i + width] for i in range(0, len(text), width))


DTYPE_BYTES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
"""Bytes per element of each safetensors dtype a checkpoint may hold."""

FLOAT_MAX: dict[str, float] = {
    "F64": sys.float_info.max,
    "F32": 3.4028234663852886e38,
    "BF16": 3.3895313892515355e38,
    "F16": 65504.0,
    "F8_E4M3": 448.0,
    "F8_E5M2": 57344.0,
}
"""The largest finite value of each floating dtype (a larger one would load as inf)."""


def fits(value: Any, dtype: str) -> bool:
    """Whether a 0-d tensor of safetensors ``dtype`` holds ``value`` as written: a bool of
    ``BOOL``, an int in an integer dtype's range, a number within a float dtype's finite
    range (a ``step`` of 1e308 is no F16 value: it would load as inf)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if dtype == "BOOL":
        return isinstance(value, bool)
    if dtype[0] in "IU":
        bits = 8 * DTYPE_BYTES[dtype]
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1)) if dtype[0] == "I" else (0, 2**bits)
        return number and isinstance(value, int) and low <= value < high
    return number and abs(value) <= FLOAT_MAX[dtype]


@dataclass(frozen=True, slots=True)
class Scalar:
    """A state value that is no tensor of 1 or more dims: a plain number, or a 0-d tensor
    (torch keeps AdamW's ``step`` so), stored in the manifest itself."""

    value: int | float | bool | str | None
    dtype: str | None = None
    """safetensors dtype of a 0-d tensor; None for a plain Python number."""


@dataclass(frozen=True, slots=True)
class ParamEntry:
    """One param of the optimizer that was saved."""

    name: str
    shape: tuple[int, ...]
    """Full (logical) shape of the param, and of each of its stored tensors but those of
    :attr:`state_shapes`."""
    tp_split_dim: int
    """Dimension split across TP ranks in the source run (-1: replicated)."""
    group: int
    """Index of its param group."""
    dtypes: Mapping[str, str]
    """safetensors dtype of each stored tensor, by key: its state tensors (shaped like the
    param, or as :attr:`state_shapes` says) and, when saved, its own values under
    :data:`PARAM_KEY`."""
    scalars: Mapping[str, Scalar] = field(default_factory=dict)
    """Its state values that are numbers or 0-d tensors, by key."""
    state_shapes: Mapping[str, StateShape] = field(default_factory=dict)
    """(version 5) Each state tensor not shaped like the param: its shape and rule
    (:mod:`muonckpt.layout.state_shapes`), by key; a key not here is shaped like the param."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def named(self, name: str) -> ParamEntry:
        """This entry for the param ``name`` (``dataclasses.replace``, at a third of its cost:
        a top level makes one per param, 70k of them for a Kimi-K2-shaped model)."""
        return ParamEntry(
            name,
            self.shape,
            self.tp_split_dim,
            self.group,
            self.dtypes,
            self.scalars,
            self.state_shapes,
        )

    def shape_of(self, key: str) -> tuple[int, ...]:
        """The full shape of stored tensor ``key`` (a state key or the values)."""
        stored = self.state_shapes.get(key)
        return self.shape if stored is None else stored.shape

    def view_of(self, key: str) -> tuple[tuple[int, ...], int]:
        """The shape and split dim its pieces' regions are of: the param's for a tensor that
        follows it element for element, else the state's own, unsplit (stored in flat ranges)."""
        stored = self.state_shapes.get(key)
        if stored is None or stored.rule == SAME:
            return self.shape, self.tp_split_dim
        return stored.shape, -1

    @property
    def state_keys(self) -> tuple[str, ...]:
        """Keys of its state tensors, sorted (empty: no tensor state)."""
        return tuple(sorted(k for k in self.dtypes if k != PARAM_KEY))

    @property
    def value_dtype(self) -> str | None:
        """dtype of the param's own saved values; None when they were not saved."""
        return self.dtypes.get(PARAM_KEY)

    @property
    def tensor_keys(self) -> tuple[str, ...]:
        """Keys of everything stored for the param: its state keys, then :data:`PARAM_KEY`."""
        return self.state_keys + ((PARAM_KEY,) if self.value_dtype is not None else ())

    def dtype_of(self, key: str) -> str:
        """The safetensors dtype of the stored tensor ``key`` (a state key or the values)."""
        return self.dtypes[key]


ValuePath = tuple[str | int, ...]
"""Where a value lies in a tree of settings or values: dict keys and list indices."""


@dataclass(frozen=True)
class GroupEntry:
    """One param group: its hyperparameters (step counter included) and its params' names."""

    hyperparams: dict[str, Any]
    params: tuple[str, ...]
    optimizer: dict[str, Any] = field(default_factory=dict)
    """What the group computed (:class:`muonckpt.format.kinds.GroupKind` as JSON: optimizer class,
    Muon or AdamW, momentum form, mu, nesterov, lr scale rule, where AdamW counts steps);
    empty when unknown (version 1)."""
    tuples: tuple[ValuePath, ...] = ()
    """(version 5) Where :attr:`hyperparams` held a tuple, which JSON writes as a list: each
    a path of keys and indices (``("betas",)``, ``("ns_coeffs", 0)``), outermost first."""

    def settings(self) -> dict[str, Any]:
        """The hyperparams with each recorded tuple a tuple again, as the optimizer had them."""
        settings: dict[str, Any] = with_tuples(self.hyperparams, self.tuples)
        return settings


def tuple_paths(value: Any, path: ValuePath = ()) -> list[ValuePath]:
    """Every path in ``value`` (a tree of dicts, lists and tuples) that holds a tuple,
    outermost first."""
    found: list[ValuePath] = [path] if isinstance(value, tuple) else []
    if isinstance(value, (list, tuple)):
        items: Iterable[tuple[str | int, Any]] = enumerate(value)
    elif isinstance(value, Mapping):
        items = ((str(k), v) for k, v in value.items())
    else:
        return found
    return found + [p for k, v in items for p in tuple_paths(v, (*path, k))]


def with_tuples(value: Any, paths: Iterable[ValuePath]) -> Any:
    """``value`` (JSON: dicts and lists) with the lists at ``paths`` made tuples again."""
    wanted = {tuple(p) for p in paths}

    def rebuilt(node: Any, path: ValuePath) -> Any:
        if isinstance(node, list):
            items = [rebuilt(v, (*path, i)) for i, v in enumerate(node)]
            return tuple(items) if path in wanted else items
        if isinstance(node, dict):
            return {k: rebuilt(v, (*path, k)) for k, v in node.items()}
        return node

    return rebuilt(value, ()) if wanted else value


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored tensor: a region of one param's state tensor, in one file."""

    param: str
    key: str
    file: str
    tensor: str
    """Key of the tensor inside the safetensors file."""
    region: Region
    """Which elements of the full tensor it holds, in its own (flat) order."""
    digests: bytes
    """Its checksums packed (:func:`pack_checksums`; :attr:`checksums` spells them out)."""
    chunk_bytes: int

    @property
    def checksums(self) -> tuple[str, ...]:
        """One checksum per ``chunk_bytes`` of the tensor's data, as the manifest lists them."""
        return unpack_checksums(self.digests)


_REFS, _NUMS = 4, 6
"""What a :class:`PieceTable` keeps per piece: 4 string refs (param, key, file, tensor; -1 for
the default tensor key) and 6 numbers (the region's five bounds, chunk_bytes)."""


class PieceTable(Sequence[Piece]):
    """Pieces kept column-wise: string refs and numbers in two arrays, each string once,
    checksums in one buffer, each :class:`Piece` made when it is asked for.

    About 80 bytes a piece against about 250 for a tuple of pieces (with their regions and
    checksums): what keeps a checkpoint of a million pieces (a Kimi-K2-shaped model at 512 x 8)
    within a few hundred MB in every tool that reads or writes all of them."""

    __slots__ = ("_ends", "_index", "_nums", "_refs", "_strings", "_sums")

    def __init__(self, pieces: Iterable[Piece] = ()) -> None:
        self._strings: list[str] = []
        self._index: dict[str, int] = {}
        self._refs = array("i")
        self._nums = array("q")
        self._sums = bytearray()
        self._ends = array("q")
        self.extend(pieces)

    def _ref(self, text: str) -> int:
        found = self._index.get(text)
        if found is None:
            found = self._index[text] = len(self._strings)
            self._strings.append(text)
        return found

    def append(self, piece: Piece) -> None:
        default = piece.tensor == tensor_key(piece.param, piece.key)
        tensor = -1 if default else self._ref(piece.tensor)
        self._refs.extend(
            (self._ref(piece.param), self._ref(piece.key), self._ref(piece.file), tensor)
        )
        r = piece.region
        self._nums.extend(
            (r.cols, r.block_start, r.block_width, r.start, r.stop, piece.chunk_bytes)
        )
        self._sums += piece.digests
        self._ends.append(len(self._sums))

    def extend(self, pieces: Iterable[Piece]) -> None:
        for piece in pieces:
            self.append(piece)

    def __len__(self) -> int:
        return len(self._ends)

    def _names(self, row: int) -> tuple[str, str, str, str]:
        """Row ``row``'s param, key, file and tensor key."""
        param, key, file, tensor = self._refs[row * _REFS : (row + 1) * _REFS]
        strings = self._strings
        name, key_name = strings[param], strings[key]
        stored = tensor_key(name, key_name) if tensor < 0 else strings[tensor]
        return name, key_name, strings[file], stored

    def _piece(self, row: int) -> Piece:
        *bounds, chunk_bytes = self._nums[row * _NUMS : (row + 1) * _NUMS]
        digests = bytes(self._sums[self._ends[row - 1] if row else 0 : self._ends[row]])
        return Piece(*self._names(row), Region(*bounds), digests, chunk_bytes)

    @overload
    def __getitem__(self, index: int) -> Piece: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Piece, ...]: ...
    def __getitem__(self, index: int | slice) -> Piece | tuple[Piece, ...]:
        if isinstance(index, slice):
            return tuple(self._piece(row) for row in range(len(self))[index])
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self._piece(index % len(self))

    def __iter__(self) -> Iterator[Piece]:
        return (self._piece(row) for row in range(len(self)))

    def placed(self) -> Iterator[tuple[str, str]]:
        """Each piece's (file, tensor key), in order, without making the pieces."""
        for row in range(len(self)):
            _, _, file, tensor = self._names(row)
            yield file, tensor

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return NotImplemented if not isinstance(other, Sequence) else False
        return all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(map(repr, islice(self, 2)))
        return f"PieceTable({len(self)} pieces: {shown}{', ...' if len(self) > 2 else ''})"


def placed(pieces: Sequence[Piece]) -> Iterator[tuple[str, str]]:
    """Each piece's (file, tensor key), from a :class:`PieceTable` without making the pieces."""
    if isinstance(pieces, PieceTable):
        return pieces.placed()
    return ((p.file, p.tensor) for p in pieces)


@dataclass(frozen=True)
class ModelFile:
    """What a consolidated save given the model (``save(..., model=model)``) adds to
    ``model.safetensors`` beyond the optimizer's params, so that it holds the model's whole
    ``state_dict()``."""

    tensors: tuple[ParamEntry, ...]
    """The model's other tensors (buffers, params no optimizer group holds), each stored
    whole under its name (group -1, never split)."""
    pieces: tuple[Piece, ...]
    """Where each of them is stored, with its checksums."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """state_dict names of tied tensors stored once: alias -> the stored name (as
    ``safetensors.torch.save_model`` records them in the file's metadata)."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    bytes: int


Spans = tuple[tuple[int, int], ...]
"""Half-open ranges ``[lo, hi)`` of positions in a manifest's ``params``, increasing."""


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One piece index (format version 3, :mod:`.piece_index`) as the top-level manifest
    records it: the file listing the pieces of one data file."""

    name: str
    file: str
    """The data file whose pieces it lists (a name of ``files``)."""
    bytes: int
    checksum: str
    """XXH3-64 of the index file's whole bytes, 16 lowercase hex digits."""
    pieces: int
    params: Spans
    """Which params it holds pieces of, as spans of their positions in ``params``: a reader
    opens only the indexes whose spans meet the params it needs."""

    def holds_any(self, positions: Sequence[int]) -> bool:
        """Whether any of the sorted ``positions`` lies in :attr:`params`."""
        for lo, hi in self.params:
            at = bisect_left(positions, lo)
            if at < len(positions) and positions[at] < hi:
                return True
        return False
