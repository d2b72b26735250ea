"""The checksums of tensor data: one XXH3-64 digest per ``chunk_bytes`` chunk.

Checksums are not stored in the safetensors files; callers keep them (the manifest).
"""

from __future__ import annotations

import numpy as np
import xxhash

from ..format.manifest import unpack_checksums

CHUNK_BYTES: int = 4 << 20
"""Default checksum chunk: 4 MiB of a tensor's data."""
chunk_digest = xxhash.xxh3_64_hexdigest
"""The checksum of one chunk: 16 hex digits (``manifest.CHECKSUM_ALGORITHM`` names it)."""


def chunk_digests(data: bytes | memoryview | np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> bytes:
    """Checksums of consecutive ``chunk_bytes`` chunks of a C-contiguous byte buffer, packed
    (:func:`muonckpt.format.manifest.pack_checksums`: each chunk's 8-byte digest, in order)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    view = (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")
    digest = xxhash.xxh3_64_digest
    return b"".join(digest(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes))


def checksum_chunks(
    data: bytes | memoryview | np.ndarray, chunk_bytes: int = CHUNK_BYTES
) -> tuple[str, ...]:
    """Checksums of consecutive ``chunk_bytes`` chunks of a C-contiguous byte buffer, as hex
    strings (:func:`chunk_digests` spelled out)."""
    return unpack_checksums(chunk_digests(data, chunk_bytes))
