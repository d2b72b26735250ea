"""The safetensors file format (https://github.com/huggingface/safetensors): its limits, and
where one tensor lies in a file.

The format is implemented here directly rather than through ``safetensors.torch``, so that

* writing makes no extra copy of contiguous tensors, fsyncs, renames atomically into place and
  checksums every ``chunk_bytes`` of each tensor's data from the very bytes it writes
  (:mod:`.safetensors_writer`), and
* reading fetches any flat element range, or strided rows, of a tensor with ``pread`` into a
  reused buffer, copying them straight into the caller's buffer after verifying the checksum
  chunks that cover them (:mod:`.safetensors_reader`).

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON (padded with
spaces to a multiple of 8) mapping each key to ``{"dtype", "shape", "data_offsets"}`` plus an
optional ``"__metadata__"`` str->str map, then the tensor data, offsets relative to the first
byte after the header. Checksums are not stored in the file; callers keep them (the manifest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..format.manifest import DTYPE_BYTES, unpack_checksums

MAX_HEADER_BYTES: int = 100_000_000
"""Largest safetensors JSON header accepted (the format's own limit)."""

METADATA_KEY = "__metadata__"

DTYPES = tuple(DTYPE_BYTES)
DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}
"""Each dtype as a small int, for arrays of many tensors' dtypes (and back)."""


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """Where one tensor lies in a safetensors file, and the checksums of its data."""

    key: str
    dtype: str
    """safetensors dtype string, e.g. ``"BF16"``."""
    shape: tuple[int, ...]
    offset: int
    """Absolute byte offset of the tensor's data in the file."""
    nbytes: int
    digests: bytes
    """One digest per ``chunk_bytes`` chunk of the data (last may be short), packed
    (:func:`muonckpt.format.manifest.pack_checksums`); empty for 0 bytes and for a record read from
    a file, which holds no checksums."""
    chunk_bytes: int

    @property
    def checksums(self) -> tuple[str, ...]:
        """:attr:`digests` as hex strings, as the manifest lists them."""
        return unpack_checksums(self.digests)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
