"""The only module of muonckpt that touches files: safetensors read/write, atomic text writes.

The safetensors format (https://github.com/huggingface/safetensors) is implemented here
directly rather than through ``safetensors.torch``, so that

* writing makes no extra copy of contiguous tensors, fsyncs, renames atomically into place and
  checksums every ``chunk_bytes`` of each tensor's data from the very bytes it writes, and
* reading fetches any flat element range, or strided rows, of a tensor from a read-only,
  prefaulted mapping of exactly those bytes (the page cache itself, no read copy), copying
  them straight into the caller's buffer after verifying the checksum chunks that cover them.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON (padded with
spaces to a multiple of 8) mapping each key to ``{"dtype", "shape", "data_offsets"}`` plus an
optional ``"__metadata__"`` str->str map, then the tensor data, offsets relative to the first
byte after the header. Checksums are not stored in the file; callers keep them (the manifest).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import json
import math
import os
import re
import struct
import threading
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash
from numpy.lib.stride_tricks import as_strided

from .errors import CheckpointError, CheckpointWarning
from .layout import Strided
from .manifest import CHECKSUM_ALGORITHM, FORMAT_NAME

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CHUNK_BYTES",
    "MAX_HEADER_BYTES",
    "SafetensorsReader",
    "TensorRecord",
    "checksum_chunks",
    "dtype_name",
    "fsync_dir",
    "itemsize",
    "tensor_of_bytes",
    "torch_dtype",
    "write_safetensors",
    "write_text_atomic",
]

CHUNK_BYTES: int = 4 << 20
"""Default checksum chunk: 4 MiB of a tensor's data."""
MAX_HEADER_BYTES: int = 100_000_000
"""Largest safetensors JSON header accepted (the format's own limit)."""

_METADATA_KEY = "__metadata__"
_OFFLOAD_BYTES = 1 << 20
"""Tensors at least this large are checksummed on a worker thread while they are written."""
_WRITE_BYTES = 1 << 20
"""Bytes per write call. On the benchmark VM, 1 GB written into the page cache in 32 MiB calls
took 0.35-3.7 s from run to run, in 1 MiB calls a steady 0.31-0.42 s."""

_VERIFY_WINDOW = 4 << 20
"""Bytes read at a time by :meth:`SafetensorsReader.verify`, with ``pread`` into one reused
buffer. On the benchmark VM, verify of a warm 305 MB checkpoint took 0.065 s so (min of 21
interleaved runs), 0.067 s with 8 MiB and 0.074 s with 16 MiB windows, against 0.052 s when
it hashed 64 MiB mappings, which a file truncated meanwhile turned into SIGBUS."""

_ITEMSIZE: dict[str, int] = {
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
"""Bytes per element of each safetensors dtype this module reads and writes. The module works
in bytes and imports torch only where a caller hands over or asks for a tensor, so that the
offline tools run without it."""

_TORCH_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype string -> torch dtype, for those this torch has."""
    import torch

    return {
        name: getattr(torch, attr) for name, attr in _TORCH_NAMES.items() if hasattr(torch, attr)
    }


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {dt: name for name, dt in _torch_dtypes().items()}


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lies in a safetensors file, and the checksums of its data."""

    key: str
    dtype: str
    """safetensors dtype string, e.g. ``"BF16"``."""
    shape: tuple[int, ...]
    offset: int
    """Absolute byte offset of the tensor's data in the file."""
    nbytes: int
    checksums: tuple[str, ...]
    """One digest per ``chunk_bytes`` chunk of the data (last may be short); empty for 0 bytes."""
    chunk_bytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string."""
    try:
        return _torch_dtypes()[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"unknown safetensors dtype {name!r}") from None


def itemsize(name: str) -> int:
    """Bytes per element of a safetensors dtype string."""
    try:
        return _ITEMSIZE[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"unknown safetensors dtype {name!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors dtype string of a torch dtype."""
    try:
        return _dtype_names()[dtype]
    except (KeyError, TypeError):
        raise CheckpointError(f"dtype {dtype} cannot be stored in a safetensors file") from None


def checksum_chunks(
    data: bytes | memoryview | np.ndarray, chunk_bytes: int = CHUNK_BYTES
) -> tuple[str, ...]:
    """Checksums of consecutive ``chunk_bytes`` chunks of a C-contiguous byte buffer."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    view = memoryview(data).cast("B")
    digest = xxhash.xxh3_64_hexdigest
    return tuple(digest(view[i : i + chunk_bytes]) for i in range(0, len(view), chunk_bytes))


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that a rename inside it survives a crash (no-op where unsupported)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if os.name == "nt":  # directories cannot be opened, nor need fsync, on Windows
            return
        raise CheckpointError(f"cannot open directory for fsync: {e}", path=path) from e
    try:
        os.fsync(fd)
    except OSError as e:
        raise CheckpointError(f"cannot fsync directory: {e}", path=path) from e
    finally:
        os.close(fd)


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _commit(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: temp file, fsync, rename, fsync the dir."""
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        _commit(tmp, path)
    except BaseException as e:
        _remove_quietly(tmp)
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write: {e}", path=path) from e
        raise


def _payload(
    data: torch.Tensor | np.ndarray, dtype: str, shape: Sequence[int], path: Path, key: str
) -> memoryview:
    """The bytes to write for a tensor declared ``dtype`` x ``shape``.

    ``data`` is a tensor of that dtype and element count (any shape or device; copied only if
    not a contiguous CPU tensor), or its raw bytes as a 1-D uint8 numpy array (what the
    offline tools move, without torch).
    """
    nbytes = math.prod(shape) * _ITEMSIZE[dtype]
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1 or data.nbytes != nbytes:
            raise CheckpointError(
                f"raw data is {data.dtype} x {data.size}, declared {dtype} {tuple(shape)} "
                f"needs {nbytes} bytes",
                path=path,
                param=key,
            )
        return memoryview(np.ascontiguousarray(data))
    if _dtype_names().get(data.dtype) != dtype or data.numel() != math.prod(shape):
        raise CheckpointError(
            f"tensor is {data.dtype} x {data.numel()} elements, declared {dtype} {tuple(shape)}",
            path=path,
            param=key,
        )
    return byte_view(data.detach().cpu().contiguous().view(-1))


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[str, TensorRecord]:
    """Write ``tensors`` to a safetensors file at ``path`` atomically and durably.

    The data goes to a temporary name in the same directory, is fsynced, renamed over ``path``
    and the directory fsynced. Tensors of any supported dtype, layout and size (0 elements too)
    are accepted; data is packed in key order. Returns each key's :class:`TensorRecord`, with
    checksums computed from the bytes written. Raises :class:`CheckpointError` on bad input or
    an OSError.
    """
    import torch

    specs = {}
    for key, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"not a tensor: {type(tensor).__name__}", path=path, param=key)
        if tensor.dtype not in _dtype_names():
            raise CheckpointError(
                f"dtype {tensor.dtype} cannot be stored in a safetensors file", path=path, param=key
            )
        specs[key] = (_dtype_names()[tensor.dtype], tuple(tensor.shape))
    with SafetensorsWriter(path, specs, metadata, chunk_bytes=chunk_bytes) as writer:
        for key in writer.pending:
            writer.write(key, tensors[key])
        return writer.commit()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset``, :data:`_WRITE_BYTES` per call."""
    position = 0
    while position < len(view):
        position += os.pwrite(fd, view[position : position + _WRITE_BYTES], offset + position)


def _write_and_checksum(
    fd: int, view: memoryview, offset: int, chunk_bytes: int
) -> tuple[str, ...]:
    """Write bytes ``view`` at ``offset`` and return their chunk checksums, overlapping the two
    when large.

    A large tensor also starts the kernel's writeback of the file so far, so the disk works
    while the next tensor is copied and the final fsync has little left to do.
    """
    if len(view) < _OFFLOAD_BYTES:
        _pwrite_all(fd, view, offset)
        return checksum_chunks(view, chunk_bytes)
    # xxhash and file writes both release the GIL: overlap them.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(checksum_chunks, view, chunk_bytes)
        _pwrite_all(fd, view, offset)
        _start_writeback(fd)
        return pending.result()


def _start_writeback(fd: int) -> None:
    """Ask the kernel to start writing ``fd``'s dirty pages now, without waiting (Linux only).

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` over the whole file; a no-op where the call does
    not exist. Durability still comes from the fsync at commit.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SafetensorsReader:
    """Reads tensors, or flat element ranges of them, from one safetensors file.

    The header is fully validated on open; any damage raises :class:`CheckpointError` naming
    the file. Reads are positional, so one reader may serve several threads. Use it as a
    context manager, or call :meth:`close`.
    """

    path: Path
    metadata: dict[str, str]

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.metadata = {}
        self._records: dict[str, TensorRecord] = {}
        self._fd: int | None = None
        self._scratch = threading.local()
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            self._opened = os.fstat(self._fd)
        except OSError as e:
            if self._fd is not None:
                self.close()
            raise CheckpointError(f"cannot open: {e}", path=self.path) from e
        try:
            self._parse_header()
        except BaseException:
            self.close()
            raise

    def _fail(self, message: str, param: str | None = None) -> CheckpointError:
        return CheckpointError(message, path=self.path, param=param)

    def changed(self) -> str | None:
        """How the file changed since this reader opened it (its size or modification time,
        or the file its path names), or None when it did not."""
        try:
            now = os.fstat(self._check_open())
        except (OSError, CheckpointError):
            return None
        was = self._opened
        if (now.st_size, now.st_mtime_ns) != (was.st_size, was.st_mtime_ns):
            return f"it was modified ({was.st_size} bytes when opened, now {now.st_size})"
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return "it was deleted"
        except OSError:
            return None
        if (there.st_dev, there.st_ino) != (was.st_dev, was.st_ino):
            return "another file was put in its place"
        return None

    def _manifest_moved_on(self, digest: str) -> bool:
        """Whether the manifest beside the file exists but no longer lists checksum ``digest``:
        then the checkpoint directory was replaced after the caller read its manifest."""
        try:
            return digest not in read_text(self.path.parent / MANIFEST_FILE)
        except CheckpointError:
            return False

    def _changed_error(self, why: str, param: str | None) -> CheckpointError:
        return self._fail(
            f"the checkpoint changed while reading: {why} (another process wrote it meanwhile); "
            "read it again",
            param,
        )

    def _truncated(self, message: str, param: str | None = None) -> CheckpointError:
        why = self.changed()
        if why is None:
            return self._fail(f"file truncated: {message}", param)
        return self._fail(
            f"file truncated: {message}; the checkpoint changed while reading: {why}", param
        )

    def _parse_header(self) -> None:
        try:
            size = os.fstat(self._fd).st_size  # type: ignore[arg-type]
        except OSError as e:
            raise self._fail(f"cannot stat: {e}") from e
        if size < 8:
            raise self._fail(
                f"not a safetensors file: {size} bytes, shorter than the 8-byte prefix"
            )
        (length,) = struct.unpack("<Q", self._pread(0, 8, what="header length"))
        if length > MAX_HEADER_BYTES:
            raise self._fail(f"header length {length} exceeds the {MAX_HEADER_BYTES}-byte limit")
        if 8 + length > size:
            raise self._fail(f"header length {length} runs past the end of the {size}-byte file")
        raw = self._pread(8, length, what="header")
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise self._fail(f"header is not valid UTF-8 JSON: {e}") from e
        if not isinstance(header, dict):
            raise self._fail(f"header is a JSON {type(header).__name__}, not an object")

        meta = header.pop(_METADATA_KEY, None)
        if meta is not None:
            if not isinstance(meta, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
            ):
                raise self._fail("__metadata__ is not a map of strings to strings")
            self.metadata = dict(meta)

        data_start = 8 + length
        data_size = size - data_start
        spans: list[tuple[int, int, str]] = []
        for key, info in header.items():
            if not isinstance(info, dict):
                raise self._fail("tensor entry is not an object", key)
            dtype = info.get("dtype")
            if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
                raise self._fail(f"unknown dtype {dtype!r}", key)
            shape = info.get("shape")
            if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
                raise self._fail(f"shape {shape!r} is not a list of non-negative ints", key)
            offsets = info.get("data_offsets")
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]
            ):
                raise self._fail(
                    f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end", key
                )
            begin, end = offsets
            nbytes = math.prod(shape) * _ITEMSIZE[dtype]
            if end - begin != nbytes:
                raise self._fail(
                    f"data_offsets {offsets} span {end - begin} bytes, but {dtype} {shape} "
                    f"needs {nbytes}",
                    key,
                )
            if end > data_size:
                raise self._fail(
                    f"data_offsets {offsets} run past the end of the data ({data_size} bytes)", key
                )
            if nbytes:
                spans.append((begin, end, key))
            self._records[key] = TensorRecord(
                key=key,
                dtype=dtype,
                shape=tuple(shape),
                offset=data_start + begin,
                nbytes=nbytes,
                checksums=(),
                chunk_bytes=CHUNK_BYTES,
            )
        spans.sort()
        for (_, prev_end, prev_key), (begin, _, key) in itertools.pairwise(spans):
            if begin < prev_end:
                raise self._fail(f"tensors {prev_key!r} and {key!r} overlap")

    def _pread(self, offset: int, n: int, what: str) -> bytes:
        fd = self._check_open()
        data = b""
        try:
            while len(data) < n:
                more = os.pread(fd, n - len(data), offset + len(data))
                if not more:
                    raise self._truncated(f"{what} needs bytes up to {offset + n}")
                data += more
        except OSError as e:
            raise self._fail(f"cannot read {what}: {e}") from e
        return data

    def _check_open(self) -> int:
        if self._fd is None:
            raise self._fail("reader is closed")
        return self._fd

    def keys(self) -> list[str]:
        """Tensor keys, sorted."""
        return sorted(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def record(self, key: str) -> TensorRecord:
        """Dtype, shape, absolute offset and size of ``key`` (``checksums`` is empty)."""
        try:
            return self._records[key]
        except KeyError:
            raise self._fail("no such tensor in file", key) from None

    def read(
        self,
        key: str,
        start: int = 0,
        stop: int | None = None,
        *,
        checksums: Sequence[str] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> torch.Tensor:
        """Flat elements ``[start, stop)`` of tensor ``key``, as a new 1-D tensor of its dtype
        (checksum arguments as in :meth:`read_groups`)."""
        rec = self.record(key)
        stop = rec.numel if stop is None else stop
        if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= rec.numel):
            raise self._fail(f"element range [{start}, {stop}) outside [0, {rec.numel})", key)
        import torch

        out = torch.empty(stop - start, dtype=torch_dtype(rec.dtype))
        run = Strided(src=start, dst=0, length=stop - start, count=1, src_step=0, dst_step=0)
        self.read_groups(key, byte_view(out), [run], checksums=checksums, chunk_bytes=chunk_bytes)
        return out

    def read_groups(
        self,
        key: str,
        out: memoryview,
        groups: Sequence[Strided],
        *,
        checksums: Sequence[str] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        """Copy strided groups of tensor ``key``'s elements into the byte buffer ``out``.

        Offsets, lengths and steps of ``groups`` count elements of the tensor's dtype: ``src``
        in the tensor, ``dst`` in ``out``. The span of the file they cover is read by ``pread``
        into a reused buffer (never mapped: a file shrunk by another process meanwhile is a
        :class:`CheckpointError`, not SIGBUS), and each group is placed by one 2-D copy. With
        ``checksums`` (the writer's, per ``chunk_bytes`` chunk of the tensor's data) the whole
        chunks covering the span are verified first: a mismatch raises and ``out`` is untouched.
        """
        rec = self.record(key)
        size = _ITEMSIZE[rec.dtype]
        groups = [g for g in groups if g.length and g.count]
        if not groups:
            return
        lo = min(g.src for g in groups) * size
        hi = max(g.src + (g.count - 1) * g.src_step + g.length for g in groups) * size
        reach = max(g.dst + (g.count - 1) * g.dst_step + g.length for g in groups) * size
        if not (
            all(_is_int(x) and x >= 0 for g in groups for x in astuple(g))
            and hi <= rec.nbytes
            and reach <= len(out)
        ):
            raise self._fail(
                f"copy groups outside the tensor's {rec.nbytes} bytes or the {len(out)}-byte "
                "output",
                key,
            )
        if checksums is not None:
            lo, hi = self._chunk_span(key, rec, lo, hi, checksums, chunk_bytes)
        data = self._span(key, rec.offset + lo, hi - lo)
        if checksums is not None:
            self._verify(key, rec, data, lo, checksums, chunk_bytes)
        target = np.frombuffer(out, dtype=np.uint8)
        for g in groups:
            shape = (g.count, g.length * size)
            dst = target[g.dst * size :]
            src = data[g.src * size - lo :]
            np.copyto(
                as_strided(dst, shape, (g.dst_step * size, 1)),
                as_strided(src, shape, (g.src_step * size, 1), writeable=False),
            )

    def verify(self, key: str, checksums: Sequence[str], chunk_bytes: int = CHUNK_BYTES) -> None:
        """Check every checksum chunk of tensor ``key``, reading at most :data:`_VERIFY_WINDOW`
        bytes at a time with ``pread`` into one reused buffer (bounded memory for any tensor
        size; no mapping, so a file truncated meanwhile raises instead of killing the process
        with SIGBUS); a mismatch raises :class:`CheckpointError`."""
        rec = self.record(key)
        self._chunk_span(key, rec, 0, rec.nbytes, checksums, chunk_bytes)
        window = max(chunk_bytes, _VERIFY_WINDOW // chunk_bytes * chunk_bytes)
        buffer = self._buffer(min(window, rec.nbytes))
        for lo in range(0, rec.nbytes, window):
            hi = min(lo + window, rec.nbytes)
            data = self._read_into(key, buffer[: hi - lo], rec.offset + lo)
            self._verify(key, rec, data, lo, checksums, chunk_bytes)

    def _buffer(self, nbytes: int) -> np.ndarray:
        """This thread's reused scratch buffer, at least ``nbytes`` long."""
        buffer = getattr(self._scratch, "buffer", None)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self._scratch.buffer = np.empty(nbytes, dtype=np.uint8)
        return buffer[:nbytes]

    def _read_into(self, key: str, buffer: np.ndarray, offset: int) -> np.ndarray:
        """Fill ``buffer`` with the file's bytes from ``offset``; a short file raises."""
        fd = self._check_open()
        view = memoryview(buffer)
        done = 0
        try:
            while done < len(view):
                got = os.preadv(fd, [view[done:]], offset + done)
                if not got:
                    raise self._truncated(
                        f"the tensor needs bytes up to {offset + len(view)}, the file has "
                        f"{offset + done}",
                        key,
                    )
                done += got
        except OSError as e:
            raise self._fail(f"cannot read bytes [{offset}, {offset + len(view)}): {e}", key) from e
        return buffer

    def _check_size(self, key: str, end: int) -> None:
        """Raise unless the file still holds bytes up to ``end``."""
        try:
            size = os.fstat(self._check_open()).st_size
        except OSError as e:
            raise self._fail(f"cannot stat: {e}", key) from e
        if end > size:
            raise self._truncated(f"the tensor needs bytes up to {end}, the file has {size}", key)

    def _chunk_span(
        self,
        key: str,
        rec: TensorRecord,
        lo: int,
        hi: int,
        checksums: Sequence[str],
        chunk_bytes: int,
    ) -> tuple[int, int]:
        """Bytes ``[lo, hi)`` widened to the checksum chunks that cover them."""
        if chunk_bytes <= 0:
            raise self._fail(f"chunk_bytes must be positive, got {chunk_bytes}", key)
        expected = -(-rec.nbytes // chunk_bytes)
        if len(checksums) != expected:
            raise self._fail(
                f"{len(checksums)} checksums given, but {rec.nbytes} bytes in {chunk_bytes}-byte "
                f"chunks need {expected}",
                key,
            )
        return lo - lo % chunk_bytes, min(-(-hi // chunk_bytes) * chunk_bytes, rec.nbytes)

    def _verify(
        self,
        key: str,
        rec: TensorRecord,
        data: np.ndarray,
        lo: int,
        checksums: Sequence[str],
        chunk_bytes: int,
    ) -> None:
        """Check the checksum chunks held by ``data`` (tensor bytes from ``lo``)."""
        first = lo // chunk_bytes
        for i, position in enumerate(range(0, len(data), chunk_bytes), start=first):
            got = xxhash.xxh3_64_hexdigest(data[position : position + chunk_bytes])
            if got != checksums[i]:
                why = self.changed() or (
                    "the manifest beside it no longer lists this data"
                    if self._manifest_moved_on(checksums[i])
                    else None
                )
                if why is not None:
                    raise self._changed_error(f"{why}; chunk {i} no longer matches", key)
                raise self._fail(
                    f"checksum mismatch in chunk {i} (bytes [{i * chunk_bytes}, "
                    f"{min((i + 1) * chunk_bytes, rec.nbytes)}) of the tensor): "
                    f"{CHECKSUM_ALGORITHM} {got}, expected {checksums[i]}",
                    key,
                )

    def _span(self, key: str, offset: int, length: int) -> np.ndarray:
        """File bytes ``[offset, offset + length)``, read by ``pread`` into this thread's reused
        buffer (valid until its next read). Not a mapping: touching a mapping of a file another
        process shrinks meanwhile kills the process (SIGBUS), where a short read raises."""
        self._check_size(key, offset + length)
        return self._read_into(key, self._buffer(length), offset)

    def read_tensor(
        self, key: str, *, checksums: Sequence[str] | None = None, chunk_bytes: int = CHUNK_BYTES
    ) -> torch.Tensor:
        """The whole tensor ``key``, in its shape (checksum arguments as in :meth:`read`)."""
        rec = self.record(key)
        return self.read(key, checksums=checksums, chunk_bytes=chunk_bytes).view(rec.shape)

    def close(self) -> None:
        """Close the file; further reads raise :class:`CheckpointError`. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsReader({str(self.path)!r}, {len(self._records)} tensors)"


def tensor_of_bytes(data: np.ndarray, dtype: str) -> torch.Tensor:
    """A 1-D tensor of safetensors dtype ``dtype`` sharing the raw bytes ``data`` (1-D uint8)."""
    import torch

    if data.size == 0:  # numpy gives empty arrays a stride torch cannot view
        return torch.empty(0, dtype=torch_dtype(dtype))
    return torch.from_numpy(data).view(torch_dtype(dtype))


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's data."""
    import torch

    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def read_text(path: str | os.PathLike[str], *, limit: int = MAX_HEADER_BYTES) -> str:
    """A small UTF-8 text file (a manifest); :class:`CheckpointError` if unreadable or huge."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror}", path=path) from None
    if len(data) > limit:
        raise CheckpointError(f"larger than {limit} bytes", path=path)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise CheckpointError("not UTF-8 text", path=path) from None


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _libc_function(name: str, argtypes: list[type]) -> Any:
    """``name`` from the C library with ``argtypes``, or None where it does not exist."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError, TypeError):
        return None
    function.argtypes = argtypes
    return function


_SYNC_FILE_RANGE = _libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
_SYNC_FILE_RANGE_WRITE = 2
_RENAMEAT2 = _libc_function(
    "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
)


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """renameat2(a, b, flags): True when done, False where the kernel or filesystem lacks it;
    any other failure raises OSError (FileExistsError for RENAME_NOREPLACE onto a name)."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


STAGING_TAG = "staging"
_STAGING_SUFFIX_BYTES = len(f"..{STAGING_TAG}-") + 8
"""What ``.NAME.staging-XXXXXXXX`` adds to NAME: a target name may have NAME_MAX minus this."""
_OURS_NAME = re.compile(rf"^\..+\.({STAGING_TAG}-[0-9a-f]{{8}}|old-\d+)$", re.DOTALL)
"""A directory of ours beside a target: ``.NAME.staging-XXXXXXXX`` (a save in progress, or the
checkpoint an exchange replaced) or ``.NAME.old-PID`` (the rename fallback's replaced one)."""
_CHECKPOINT_FILE = re.compile(
    r"^(manifest\.json|[^.].*\.safetensors|[^.].*\.index\.json)$", re.DOTALL
)
"""Names of the files a checkpoint directory holds."""
_TEMPORARY_FILE = re.compile(r"^\.(?P<name>.+)\.(part|tmp-\d+)$", re.DOTALL)
"""Names of muonckpt's temporary files (``.FILE.part``, ``.FILE.tmp-PID``) of such files."""
MANIFEST_FILE = "manifest.json"
_OUR_MANIFEST_HEAD = re.compile(rb'\s*\{\s*"format"\s*:\s*"muonckpt"\s*,')
"""How every manifest muonckpt writes begins (``Manifest.to_json`` puts the format first)."""


def file_size(path: str | os.PathLike[str]) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise CheckpointError(f"cannot stat: {exc.strerror}", path=path) from None


def _is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is a file muonckpt writes into a checkpoint (or a temporary of one)."""
    if _CHECKPOINT_FILE.match(name):
        return True
    temporary = _TEMPORARY_FILE.match(name)
    return temporary is not None and _CHECKPOINT_FILE.match(temporary["name"]) is not None


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def foreign_entries(directory: str | os.PathLike[str]) -> list[str]:
    """What in ``directory`` no checkpoint holds: descriptions such as ``"user file README.md"``
    or ``"directory data"``; empty when every entry is a regular file of a checkpoint's."""
    found = []
    with os.scandir(directory) as listing:
        for entry in sorted(listing, key=lambda e: e.name):
            if entry.is_symlink():
                found.append(f"symlink {entry.name}")
            elif entry.is_dir(follow_symlinks=False):
                found.append(f"directory {entry.name}")
            elif not entry.is_file(follow_symlinks=False):
                found.append(f"special file {entry.name}")
            elif not _is_checkpoint_file(entry.name):
                found.append(f"user file {entry.name}")
    return found


def ownership_problem(directory: str | os.PathLike[str]) -> str | None:
    """Why ``directory`` is not a muonckpt checkpoint that may be replaced; None when it is.

    Replaceable: a directory (not a symlink) holding only regular files with the names a
    checkpoint has (``*.safetensors``, ``manifest.json``, ``*.index.json`` and muonckpt's
    temporaries of them), and either a ``manifest.json`` whose JSON says ``"format":
    "muonckpt"``, or no manifest but a name of ours (``.NAME.staging-XXXXXXXX``,
    ``.NAME.old-PID``: an interrupted save, or a replaced checkpoint). An empty directory is
    replaceable too: nothing in it can be lost.
    """
    directory = Path(directory)
    try:
        if directory.is_symlink():
            return "is a symlink"
        if not directory.is_dir():
            return "is not a directory"
        foreign = foreign_entries(directory)
    except OSError as exc:
        return f"cannot be listed: {exc.strerror}"
    if foreign:
        return f"is not a muonckpt checkpoint: holds {_shown(foreign)}"
    manifest = directory / MANIFEST_FILE
    if not manifest.exists():
        if _OURS_NAME.match(directory.name) or not any(directory.iterdir()):
            return None
        return "is not a muonckpt checkpoint: it has no manifest.json"
    try:
        with open(manifest, "rb") as f:
            head = f.read(256)
    except OSError as exc:
        return f"cannot be read: {exc.strerror}"
    if _OUR_MANIFEST_HEAD.match(head):  # as muonckpt writes it: no need to parse megabytes
        return None
    try:
        body = json.loads(read_text(manifest))
    except (CheckpointError, ValueError, RecursionError):
        return "is not a muonckpt checkpoint: its manifest.json is not valid JSON"
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        return 'is not a muonckpt checkpoint: its manifest.json has no "format": "muonckpt"'
    return None


def _name_max(directory: Path) -> int:
    """NAME_MAX of the filesystem holding ``directory`` (its nearest existing ancestor)."""
    for candidate in (directory, *directory.parents):
        try:
            return os.pathconf(candidate, "PC_NAME_MAX")
        except (OSError, ValueError):
            if candidate.exists():
                break
    return 255


def _overlap_problem(final: Path, source: str | os.PathLike[str]) -> str | None:
    """Why writing ``final`` would write into, over or around ``source``; None if it would not
    (also when the two are the same directory: an in-place rewrite, staged beside it)."""
    src = Path(os.path.realpath(source))
    where = Path(os.path.realpath(final.parent)) / final.name
    targets = {where, Path(os.path.realpath(final))}
    if src in targets:
        return None
    for target in targets:
        if target.is_relative_to(src):
            return f"is inside the source checkpoint {source}"
        if src.is_relative_to(target):
            return f"contains the source checkpoint {source}"
    return None


def check_target(
    final: str | os.PathLike[str],
    overwrite: bool,
    *,
    source: str | os.PathLike[str] | None = None,
) -> None:
    """Raise :class:`CheckpointError` unless a checkpoint can be written at ``final``.

    Refused, before anything is written: a name that cannot work (empty, ``.`` or ``..``, one
    shaped like muonckpt's own staging names, or too long for ``.NAME.staging-XXXXXXXX``); an
    existing ``final`` without ``overwrite``; with it, anything but a muonckpt checkpoint (see
    :func:`ownership_problem`), or a symlink to one (then the link is replaced, its target
    left alone); a parent that is not a directory; and, with ``source``, a target inside the
    source checkpoint or containing it (the very same directory is allowed: rewritten in
    place).
    """
    final = Path(final)
    name = final.name
    if name in ("", ".", ".."):
        raise CheckpointError("is not a name a checkpoint directory can have", path=final)
    if _OURS_NAME.match(name):
        raise CheckpointError(
            "is named like a muonckpt staging directory (.NAME.staging-XXXXXXXX or "
            ".NAME.old-PID), which readers refuse as unfinished; choose another name",
            path=final,
        )
    limit = _name_max(final.parent) - _STAGING_SUFFIX_BYTES
    if len(os.fsencode(name)) > limit:
        raise CheckpointError(
            f"the name is {len(os.fsencode(name))} bytes; at most {limit} fit in its staging "
            f"directory's name .NAME.{STAGING_TAG}-XXXXXXXX",
            path=final,
        )
    if source is not None and (problem := _overlap_problem(final, source)):
        raise CheckpointError(problem, path=final)
    for parent in (final.parent, *final.parent.parents):
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise CheckpointError("is not a directory", path=parent)
            break
    if not os.path.lexists(final):
        return
    if not overwrite:
        raise CheckpointError(
            "already exists; pass overwrite=True (--force) to replace it", path=final
        )
    if final.is_symlink():
        if not final.exists():
            raise CheckpointError("is a dangling symlink; remove it or write elsewhere", path=final)
        problem = ownership_problem(final.resolve())
        if problem:
            raise CheckpointError(
                f"is a symlink to {os.readlink(final)}, which {problem}; refusing to replace it",
                path=final,
            )
        return
    if not final.is_dir():
        raise CheckpointError("exists and is not a checkpoint directory", path=final)
    problem = ownership_problem(final)
    if problem:
        raise CheckpointError(
            f"{problem}; refusing to replace it (--force replaces only muonckpt checkpoints)",
            path=final,
        )


_INTENT: dict[str, bool] = {}
"""Staging directory -> its make_staging's ``overwrite``, for a swap_in not told."""
_PRESET_TOKENS: dict[str, str] = {}
"""Target (absolute) -> the suffix its next staging directory takes (see preset_staging)."""


def staging_path(final: str | os.PathLike[str], token: str) -> Path:
    """The staging directory ``.NAME.staging-TOKEN`` of ``final``."""
    final = Path(final)
    return final.parent / f".{final.name}.{STAGING_TAG}-{token}"


def preset_staging(final: str | os.PathLike[str], token: str) -> Path:
    """Make this process's next :func:`make_staging` for ``final`` use the suffix ``token``
    (8 hex digits), so that whoever started it knows the staging path in advance (to remove
    it if this process is killed). Returns that path."""
    if not re.fullmatch(r"[0-9a-f]{8}", token):
        raise ValueError(f"a staging token is 8 hex digits, got {token!r}")
    _PRESET_TOKENS[os.path.abspath(final)] = token
    return staging_path(final, token)


def make_staging(
    final: str | os.PathLike[str],
    overwrite: bool,
    *,
    source: str | os.PathLike[str] | None = None,
) -> Path:
    """A fresh, empty ``.NAME.staging-XXXXXXXX`` directory beside ``final``.

    :func:`check_target` first (nothing is created when it refuses), then the missing parents
    and the staging directory itself.
    """
    final = Path(final)
    check_target(final, overwrite, source=source)
    token = _PRESET_TOKENS.pop(os.path.abspath(final), None) or uuid.uuid4().hex[:8]
    staging = staging_path(final, token)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as exc:
        raise CheckpointError(f"cannot create the staging directory: {exc}", path=staging) from None
    _INTENT[str(staging)] = overwrite
    return staging


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)


def _remove_ours(directory: Path, names: Sequence[str] | None = None) -> list[str]:
    """Delete the checkpoint files (``names``, or all) in ``directory``, then, without
    ``names``, the directory if that left it empty. Nothing else is ever deleted: no other
    file, no subdirectory, nothing through a symlink. Returns what could not be deleted, as
    ``"NAME (why)"``."""
    left = []
    try:
        listed = sorted(os.listdir(directory)) if names is None else list(names)
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [f"{directory} ({exc.strerror})"]
    for name in listed:
        path = directory / name
        if not _is_checkpoint_file(name) or os.sep in name or path.is_symlink():
            if os.path.lexists(path):
                left.append(f"{name} (not a checkpoint file: kept)")
            continue
        try:
            if path.is_dir():
                left.append(f"{name} (a directory: kept)")
                continue
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            left.append(f"{name} ({exc.strerror})")
    if names is None and not left:
        try:
            directory.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            left.append(f"the directory itself ({exc.strerror})")
    return left


def discard(staging: str | os.PathLike[str]) -> None:
    """Remove a staging directory that will never be committed (its checkpoint files only;
    anything else found there is kept and named in a :class:`CheckpointWarning`)."""
    staging = Path(staging)
    _INTENT.pop(str(staging), None)
    if staging.is_symlink():  # never ours: staging directories are made by mkdir
        _warn(f"{staging} is a symlink, not a staging directory; left alone")
        return
    left = _remove_ours(staging)
    if left:
        _warn(f"could not remove the staging directory {staging} entirely: {_shown(left)}")


@contextlib.contextmanager
def staged(
    final: str | os.PathLike[str],
    overwrite: bool,
    *,
    source: str | os.PathLike[str] | None = None,
) -> Iterator[Path]:
    """A staging directory for ``final``: swapped in when the block succeeds, else removed."""
    staging = make_staging(final, overwrite, source=source)
    try:
        yield staging
        fsync_dir(staging)
        replaced = swap_in(staging, final, overwrite=overwrite)
    except BaseException:
        discard(staging)
        raise
    if replaced is not None:
        retire(replaced)


def retire(directory: str | os.PathLike[str], files: Sequence[str] | None = None) -> None:
    """Delete a checkpoint that :func:`swap_in` replaced (only its checkpoint files, never
    anything else in it).

    With ``files``, only those entries (so several ranks can share the work); without, all
    of them and then the directory. What cannot be deleted is named in a
    :class:`CheckpointWarning`: the new checkpoint is in place whatever happens here, and what
    is left is recognisably incomplete, since swap_in removed its manifest first.
    """
    directory = Path(directory)
    if directory.is_symlink():
        _warn(f"{directory} is a symlink, not a replaced checkpoint; left alone")
        return
    left = _remove_ours(directory, files)
    if left:
        _warn(
            f"the new checkpoint is in place, but the one it replaced could not be deleted "
            f"entirely: {directory} still holds {_shown(left)}"
        )


def entries(directory: str | os.PathLike[str]) -> list[str]:
    """Sorted names in ``directory``; empty when it cannot be listed."""
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


_COMMIT_LOCK = threading.Lock()
_ABANDONED: list[bool] = [False]
"""Set by :func:`abandon_commits`: no swap_in of this process commits any more."""


def abandon_commits() -> None:
    """From now on every :func:`swap_in` of this process fails, and none is under way when
    this returns (for a worker whose launcher died: it must never commit)."""
    with _COMMIT_LOCK:
        _ABANDONED[0] = True


def swap_in(
    staging: str | os.PathLike[str],
    final: str | os.PathLike[str],
    *,
    overwrite: bool | None = None,
) -> Path | None:
    """Make directory ``staging`` appear at ``final`` atomically.

    Without ``overwrite`` the rename never replaces anything (``renameat2(RENAME_NOREPLACE)``):
    when another writer created ``final`` meanwhile, this raises and ``final`` keeps theirs.
    With it, an existing ``final`` (a muonckpt checkpoint, checked again here) is exchanged
    with ``staging`` in one step where the kernel allows it, so a crash at any moment leaves
    either the old or the new checkpoint at ``final``; a symlink at ``final`` is replaced by
    the directory and deleted, its target left untouched. ``overwrite=None`` takes the value
    :func:`make_staging` was given for ``staging`` (True for a directory it did not make).

    Returns the directory now holding the replaced checkpoint, its manifest already deleted so
    that it reads as incomplete, for the caller to :func:`retire`; None when nothing was
    replaced (or only a symlink). Raises :class:`CheckpointError` only when nothing was
    committed; a failure after the commit (deleting the old manifest, the final directory
    fsync) is a :class:`CheckpointWarning`.
    """
    staging, final = Path(staging), Path(final)
    if overwrite is None:
        overwrite = _INTENT.get(str(staging), True)
    with _COMMIT_LOCK:
        if _ABANDONED[0]:
            raise CheckpointError("not committed: this process was told to stop", path=final)
        replaced = _commit_rename(staging, final, overwrite)
    _INTENT.pop(str(staging), None)
    if replaced is not None:
        if replaced.is_symlink():
            try:
                replaced.unlink()
            except OSError as exc:
                _warn(f"committed {final}, but cannot delete the replaced symlink: {exc}")
            replaced = None
        else:
            try:
                (replaced / MANIFEST_FILE).unlink(missing_ok=True)
            except OSError as exc:
                _warn(
                    f"committed {final}, but cannot delete the replaced checkpoint's manifest "
                    f"({exc.strerror}): it is left whole at {replaced}"
                )
                replaced = None
    try:
        fsync_dir(final.parent)
    except CheckpointError as exc:
        _warn(f"committed {final}, but {exc}")
    return replaced


def _commit_rename(staging: Path, final: Path, overwrite: bool) -> Path | None:
    """The rename of :func:`swap_in`; returns where the replaced entry went, if any."""
    for _ in range(100):  # only a writer racing us, deleting and recreating final, loops
        try:
            if _renameat2(staging, final, _RENAME_NOREPLACE):
                return None
            if not os.path.lexists(final):  # no renameat2 here: check, then rename
                os.rename(staging, final)
                return None
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise CheckpointError(f"cannot commit the checkpoint: {exc}", path=final) from None
        if not overwrite:
            raise CheckpointError(
                "was created by another writer while this save ran; this save is discarded "
                "(pass overwrite=True, --force, to replace it)",
                path=final,
            )
        if final.is_symlink():
            if not final.exists():
                raise CheckpointError("became a dangling symlink while this save ran", path=final)
            problem = ownership_problem(final.resolve())
        else:
            problem = ownership_problem(final)
        if problem:
            raise CheckpointError(
                f"changed while this save ran and {problem}; not replaced", path=final
            )
        try:
            if _exchange(staging, final):
                return _checked_replaced(staging, final)
            replaced = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.rename(final, replaced)
            try:
                os.rename(staging, final)
            except OSError:
                os.rename(replaced, final)
                raise
            return replaced
        except FileNotFoundError:
            continue  # final vanished between the two steps: try the plain rename again
        except OSError as exc:
            raise CheckpointError(f"cannot commit the checkpoint: {exc}", path=final) from None
    raise CheckpointError("cannot commit: the target keeps changing", path=final)


def _checked_replaced(staging: Path, final: Path) -> Path | None:
    """After an exchange: what came out of ``final`` (now at ``staging``) must be a checkpoint
    of ours or a symlink, or it goes straight back and nothing is committed."""
    if staging.is_symlink():
        return staging
    problem = ownership_problem(staging)
    if problem is None:
        return staging
    try:
        _exchange(staging, final)
    except OSError as exc:
        _warn(f"{final} was replaced while it changed; what was there is now at {staging}: {exc}")
        return None
    raise CheckpointError(f"changed while this save ran and {problem}; not replaced", path=final)


def _plan_header(
    path: Path,
    specs: Mapping[str, tuple[str, Sequence[int]]],
    metadata: Mapping[str, str] | None,
) -> tuple[bytes, dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """The padded header bytes, and each key's (dtype, shape, begin, nbytes), in key order."""
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(f"metadata must map str to str, got {k!r}: {v!r}", path=path)
    header: dict[str, object] = {_METADATA_KEY: meta} if meta else {}
    plan: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    position = 0
    for key in specs:
        if not isinstance(key, str) or key == _METADATA_KEY:
            raise CheckpointError(f"invalid tensor key {key!r}", path=path)
    for key in sorted(specs):
        name, shape = specs[key]
        if name not in _ITEMSIZE:
            raise CheckpointError(f"unknown safetensors dtype {name!r}", path=path, param=key)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise CheckpointError(f"negative size in shape {shape}", path=path, param=key)
        nbytes = math.prod(shape) * _ITEMSIZE[name]
        header[key] = {
            "dtype": name,
            "shape": list(shape),
            "data_offsets": [position, position + nbytes],
        }
        plan[key] = (name, shape, position, nbytes)
        position += nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return encoded, plan


class SafetensorsWriter:
    """Streams tensors into a safetensors file one at a time, in bounded memory.

    The header is written up front from the declared ``specs`` (key -> (dtype string, shape));
    :meth:`write` then takes each tensor in sorted key order and checksums the bytes it writes
    (every ``chunk_bytes``, as :func:`write_safetensors` does). :meth:`commit` fsyncs and
    renames the temporary file into place and returns the records. Leaving the ``with`` block
    without a commit (or on an exception) removes the temporary file. Any OSError surfaces as
    :class:`CheckpointError` naming the file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        specs: Mapping[str, tuple[str, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
        *,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.path = Path(path)
        if chunk_bytes <= 0:
            raise CheckpointError(f"chunk_bytes must be positive, got {chunk_bytes}", path=path)
        self.chunk_bytes = chunk_bytes
        header, self._plan = _plan_header(self.path, specs, metadata)
        self._data_start = 8 + len(header)
        self._order = list(self._plan)
        self._next = 0
        self._records: dict[str, TensorRecord] = {}
        self._tmp = _tmp_path(self.path)
        self._file = None
        try:
            self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed by commit/abort
            self._file.write(struct.pack("<Q", len(header)))
            self._file.write(header)
            self._file.flush()  # the data goes in by positional writes
        except OSError as e:
            self.abort()
            raise CheckpointError(f"cannot write: {e}", path=self.path) from e

    @property
    def pending(self) -> list[str]:
        """Keys still to write, in the order :meth:`write` expects them."""
        return self._order[self._next :]

    def write(self, key: str, tensor: torch.Tensor | np.ndarray) -> TensorRecord:
        """Write the next tensor (``key`` must be the next in sorted order): a tensor of its
        declared dtype and element count, any shape, or its raw bytes (1-D uint8 numpy)."""
        if self._file is None:
            raise CheckpointError("writer is closed", path=self.path, param=key)
        if self._next >= len(self._order) or self._order[self._next] != key:
            want = self._order[self._next] if self._next < len(self._order) else None
            raise CheckpointError(
                f"tensors must be written in sorted key order: got {key!r}, expected {want!r}",
                path=self.path,
            )
        name, shape, begin, nbytes = self._plan[key]
        view = _payload(tensor, name, shape, self.path, key)
        sums: tuple[str, ...] = ()
        try:
            if nbytes:
                sums = _write_and_checksum(
                    self._file.fileno(), view, self._data_start + begin, self.chunk_bytes
                )
        except OSError as e:
            self.abort()
            raise CheckpointError(f"cannot write: {e}", path=self.path) from e
        record = TensorRecord(
            key=key,
            dtype=name,
            shape=shape,
            offset=self._data_start + begin,
            nbytes=nbytes,
            checksums=sums,
            chunk_bytes=self.chunk_bytes,
        )
        self._records[key] = record
        self._next += 1
        return record

    def commit(self) -> dict[str, TensorRecord]:
        """fsync, rename into place, fsync the directory; every declared tensor must be written."""
        if self._file is None:
            raise CheckpointError("writer is closed", path=self.path)
        if self.pending:
            missing = self.pending
            self.abort()
            raise CheckpointError(
                f"{len(missing)} declared tensor(s) never written, first {missing[0]!r}",
                path=self.path,
            )
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            _commit(self._tmp, self.path)
        except OSError as e:
            self.abort()
            raise CheckpointError(f"cannot write: {e}", path=self.path) from e
        return dict(self._records)

    def abort(self) -> None:
        """Close and remove the temporary file (idempotent)."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()
        _remove_quietly(self._tmp)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._file is not None:
            self.abort()


class SharedSafetensorsFile:
    """A safetensors file that several processes write at once, each tensor at its offset.

    Every process builds the same instance from the same ``specs`` and ``metadata`` (the header,
    and so every tensor's offset, is planned up front as :class:`SafetensorsWriter` plans it,
    giving byte-identical files; checksums per :data:`CHUNK_BYTES`). One process calls
    :meth:`create` before any write; then any process may :meth:`write` any tensors (each
    exactly once, in any order, with ``os.pwrite`` into the shared temporary file
    ``.NAME.part``) and :meth:`close` when done; after all of them, one process calls
    :meth:`commit`. OSErrors surface as :class:`CheckpointError`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        specs: Mapping[str, tuple[str, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.chunk_bytes = CHUNK_BYTES
        self._header, self._plan = _plan_header(self.path, specs, metadata)
        self._data_start = 8 + len(self._header)
        self.size = self._data_start + sum(nbytes for *_, nbytes in self._plan.values())
        """Length of the finished file."""
        self._part = self.path.with_name(f".{self.path.name}.part")
        self._fd: int | None = None

    def record(self, key: str, checksums: Sequence[str] = ()) -> TensorRecord:
        """Where ``key`` lies in the file, with the given checksums of its data."""
        try:
            name, shape, begin, nbytes = self._plan[key]
        except KeyError:
            raise CheckpointError("no such tensor planned", path=self.path, param=key) from None
        return TensorRecord(
            key, name, shape, self._data_start + begin, nbytes, tuple(checksums), self.chunk_bytes
        )

    def create(self) -> None:
        """Write the header and give the temporary file its full length (the data still holes)."""
        try:
            with open(self._part, "xb") as file:
                file.write(struct.pack("<Q", len(self._header)))
                file.write(self._header)
                file.truncate(self.size)
        except OSError as e:
            raise CheckpointError(f"cannot create: {e}", path=self.path) from e

    def write(self, key: str, tensor: torch.Tensor | np.ndarray) -> TensorRecord:
        """Write ``key``'s data (as :meth:`SafetensorsWriter.write` takes it) at its offset,
        checksumming the bytes written on a thread meanwhile."""
        record = self.record(key)
        view = _payload(tensor, record.dtype, record.shape, self.path, key)
        if not record.nbytes:
            return record
        try:
            if self._fd is None:
                self._fd = os.open(self._part, os.O_WRONLY | getattr(os, "O_BINARY", 0))
            sums = _write_and_checksum(self._fd, view, record.offset, self.chunk_bytes)
        except OSError as e:
            raise CheckpointError(f"cannot write: {e}", path=self.path, param=key) from e
        return self.record(key, sums)

    def close(self) -> None:
        """Close this process's handle of the temporary file (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def commit(self) -> None:
        """fsync the temporary file, rename it into place and fsync the directory; to be called
        once, after every process has written its tensors and closed."""
        try:
            fd = os.open(self._part, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            _commit(self._part, self.path)
        except OSError as e:
            raise CheckpointError(f"cannot write: {e}", path=self.path) from e
