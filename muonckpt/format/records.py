"""The records a manifest is made of: params, groups, pieces, files, piece indexes, and the
checksums packed as pieces keep them. Pure; :mod:`.manifest` builds the manifest from them
(and names every one of them too).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..layout.topology import Region
from .names import PARAM_KEY

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


@dataclass(frozen=True, slots=True)
class Scalar:
    """A state value that is not a tensor shaped like its param: a plain number, or a 0-d tensor
    (torch keeps AdamW's ``step`` so), stored in the manifest itself."""

    value: int | float | bool | str | None
    dtype: str | None = None
    """safetensors dtype of a 0-d tensor; None for a plain Python number."""


@dataclass(frozen=True, slots=True)
class ParamEntry:
    """One param of the optimizer that was saved."""

    name: str
    shape: tuple[int, ...]
    """Full (logical) shape of the param, and of each of its stored tensors."""
    tp_split_dim: int
    """Dimension split across TP ranks in the source run (-1: replicated)."""
    group: int
    """Index of its param group."""
    dtypes: Mapping[str, str]
    """safetensors dtype of each stored tensor, by key: its state tensors (shaped like the
    param) and, when saved, its own values under :data:`PARAM_KEY`."""
    scalars: Mapping[str, Scalar] = field(default_factory=dict)
    """Its state values that are numbers or 0-d tensors, by key."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

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


@dataclass(frozen=True)
class GroupEntry:
    """One param group: its hyperparameters (step counter included) and its params' names."""

    hyperparams: dict[str, Any]
    params: tuple[str, ...]
    optimizer: dict[str, Any] = field(default_factory=dict)
    """What the group computed (:class:`muonckpt.format.kinds.GroupKind` as JSON: optimizer class,
    Muon or AdamW, momentum form, mu, nesterov, lr scale rule, where AdamW counts steps);
    empty when unknown (version 1)."""


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
