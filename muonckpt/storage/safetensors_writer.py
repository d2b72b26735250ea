"""Writing safetensors files: one process streaming tensors in key order
(:class:`SafetensorsWriter`, :func:`write_safetensors`), or several processes writing one file
at planned offsets (:class:`SharedSafetensorsFile`); checksums come from the bytes written."""

from __future__ import annotations

import bisect
import concurrent.futures.thread
import contextlib
import itertools
import json
import math
import os
import struct
import sys
from array import array
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar

import numpy as np

from ..errors import CheckpointError
from ..format.manifest import DTYPE_BYTES
from ..format.strict_json import valid_text
from .checksums import CHUNK_BYTES, chunk_digests
from .dtypes import byte_view, torch_dtype_names
from .durable import (
    failure,
    pwrite_all,
    remove_quietly,
    replace_durably,
    start_writeback,
    temporary_path,
)
from .safetensors_format import DTYPE_CODES, DTYPES, METADATA_KEY, TensorRecord

_T = TypeVar("_T")
_R = TypeVar("_R")

if TYPE_CHECKING:
    import torch

_OFFLOAD_BYTES = 1 << 20
"""Tensors at least this large are checksummed on a worker thread while they are written."""


def _payload(
    data: torch.Tensor | np.ndarray, dtype: str, shape: Sequence[int], path: Path, key: str
) -> memoryview:
    """The bytes to write for a tensor declared ``dtype`` x ``shape``.

    ``data`` is a tensor of that dtype and element count (any shape or device; copied only if
    not a contiguous CPU tensor), or its raw bytes as a 1-D uint8 numpy array (what the
    offline tools move, without torch).
    """
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1 or data.nbytes != nbytes:
            raise CheckpointError(
                f"raw data is {data.dtype} x {data.size}, declared {dtype} {tuple(shape)} "
                f"needs {nbytes} bytes",
                path=path,
                param=key,
            )
        return np.ascontiguousarray(data).data
    if torch_dtype_names().get(data.dtype) != dtype or data.numel() != math.prod(shape):
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
) -> Mapping[str, TensorRecord]:
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
        if tensor.dtype not in torch_dtype_names():
            raise CheckpointError(
                f"dtype {tensor.dtype} cannot be stored in a safetensors file", path=path, param=key
            )
        specs[key] = (torch_dtype_names()[tensor.dtype], tuple(tensor.shape))
    with SafetensorsWriter(path, specs, metadata, chunk_bytes=chunk_bytes) as writer:
        for key in writer.pending:
            writer.write(key, tensors[key])
        return writer.commit()


def _write_and_checksum(
    fd: int, view: memoryview, offset: int, chunk_bytes: int, *, writeback: bool = True
) -> bytes:
    """Write bytes ``view`` at ``offset`` and return their chunk checksums (packed:
    :func:`.checksums.chunk_digests`), overlapping the two when large.

    A large tensor also starts the kernel's writeback of the file so far (with
    ``writeback``), so the disk works while the next tensor is copied and the final fsync has
    little left to do.
    """
    if len(view) < _OFFLOAD_BYTES:
        pwrite_all(fd, view, offset)
        return chunk_digests(view, chunk_bytes)
    # xxhash and file writes both release the GIL: overlap them.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = beside(pool, chunk_digests, view, chunk_bytes)
        pwrite_all(fd, view, offset)
        if writeback:
            start_writeback(fd)
        return pending.result()


def beside(pool: ThreadPoolExecutor, work: Callable[..., _T], *args: Any) -> Future[_T]:
    """``pool.submit(work, *args)``; where the pool refuses new work because the interpreter
    is exiting (concurrent.futures' exit hook has run: a save finished by
    ``_finish_saves_at_exit``, or started from an atexit handler), ``work`` runs here, now,
    and its outcome is the future's: slower, never lost."""
    try:
        return pool.submit(work, *args)
    except RuntimeError:
        if not (sys.is_finalizing() or getattr(concurrent.futures.thread, "_shutdown", False)):
            raise
    done: Future[_T] = Future()
    try:
        done.set_result(work(*args))
    except BaseException as exc:
        done.set_exception(exc)
    return done


def prefetched(source: Iterator[_T], count: int) -> Generator[_T, None, None]:
    """The next ``count`` items of ``source`` (fewer where it ends first), the next one pulled
    on a thread meanwhile.

    Reading (page-cache copies, xxhash) and writing (write, xxhash) both release the GIL, so a
    reader one tensor ahead of the writer keeps two cores busy. At most two pulled values are
    alive, and item ``i + 2`` is pulled only once the consumer is done with item ``i``: a
    :class:`~muonckpt.files.pieces.PieceReader` with ``reuse_outputs=2`` can produce them.
    """
    if not count:
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = beside(pool, next, source)
        for index in range(count):
            try:
                value = pending.result()
            except StopIteration:  # fewer than count: the caller names what did not come
                return
            if index + 1 < count:
                pending = beside(pool, next, source)
            yield value
            del value


def _plan_header(
    path: Path,
    specs: Mapping[str, tuple[str, Sequence[int]]],
    metadata: Mapping[str, str] | None,
) -> _Header:
    """The header of a file of these tensors (checked), and where each tensor goes. Equal
    shapes are one tuple."""
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(f"metadata must map str to str, got {k!r}: {v!r}", path=path)
        if not valid_text(k + v):
            raise CheckpointError(f"metadata {k!r}: {v!r} is not valid Unicode", path=path)
    plan = _Layout()
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    position = 0
    for key in specs:
        if not isinstance(key, str) or key == METADATA_KEY:
            raise CheckpointError(f"invalid tensor key {key!r}", path=path)
        if not valid_text(key):
            raise CheckpointError(
                f"tensor key {key!r} is not valid Unicode: it holds a lone surrogate", path=path
            )
    for key in sorted(specs):
        name, shape = specs[key]
        if name not in DTYPE_BYTES:
            raise CheckpointError(f"unknown safetensors dtype {name!r}", path=path, param=key)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise CheckpointError(f"negative size in shape {shape}", path=path, param=key)
        shape = shapes.setdefault(shape, shape)
        nbytes = math.prod(shape) * DTYPE_BYTES[name]
        plan.add(key, name, shape, position, nbytes)
        position += nbytes
    return _Header(meta, plan)


class _Header:
    """A planned file's header: its metadata, where each tensor goes (:attr:`layout`) and its
    length. Its text, ``json.dumps`` of the format's object (compact, not ASCII-escaped,
    padded with spaces), is made again entry by entry each time it is measured or written:
    300k tensors as dicts and lists took 120 MB, their text whole, beside its bytes, 60 MB."""

    _BATCH = 4096
    """Entries encoded and written at a time."""

    def __init__(self, meta: dict[str, str], layout: _Layout) -> None:
        self.meta, self.layout = meta, layout
        self._unpadded = sum(map(len, self._text()))
        self.length = self._unpadded + -self._unpadded % 8
        """Bytes of the padded header (after the 8-byte length)."""

    def write(self, file: BinaryIO) -> None:
        """The length prefix and the padded header, at the file's position."""
        file.write(struct.pack("<Q", self.length))
        for chunk in self._text():
            file.write(chunk)
        file.write(b" " * (self.length - self._unpadded))

    def _text(self) -> Iterator[bytes]:
        """The unpadded header, UTF-8, :attr:`_BATCH` entries at a time."""
        entries = self._entries()
        yield b"{"
        separator = ""
        while batch := list(itertools.islice(entries, self._BATCH)):
            yield (separator + ",".join(batch)).encode("utf-8")
            separator = ","
        yield b"}"

    def _entries(self) -> Iterator[str]:
        if self.meta:
            yield f"{_json(METADATA_KEY)}:{_json(self.meta)}"
        for index, key in enumerate(self.layout.keys):
            name, shape, begin, nbytes = self.layout.entry(index)
            yield (
                f'{_json(key)}:{{"dtype":{_json(name)},"shape":[{",".join(map(str, shape))}],'
                f'"data_offsets":[{begin},{begin + nbytes}]}}'
            )


class _Layout:
    """Where each tensor of a planned file goes, by key (sorted, as the data is packed),
    compactly: beside the keys, arrays of dtypes, offsets (from the data's start) and sizes,
    and a list of shapes (equal ones one tuple); 300k planned tensors as tuples took 45 MB."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self._shapes: list[tuple[int, ...]] = []
        self._dtypes, self._begins, self._sizes = array("B"), array("q"), array("q")

    def add(self, key: str, dtype: str, shape: tuple[int, ...], begin: int, nbytes: int) -> None:
        """The next tensor (in key order)."""
        self.keys.append(key)
        self._shapes.append(shape)
        self._dtypes.append(DTYPE_CODES[dtype])
        self._begins.append(begin)
        self._sizes.append(nbytes)

    def index(self, key: str) -> int | None:
        """The position of ``key`` in key order (None: not planned)."""
        index = bisect.bisect_left(self.keys, key)
        return index if index < len(self.keys) and self.keys[index] == key else None

    def entry(self, index: int) -> tuple[str, tuple[int, ...], int, int]:
        """Tensor ``index``'s (dtype, shape, begin, nbytes)."""
        return (
            DTYPES[self._dtypes[index]],
            self._shapes[index],
            self._begins[index],
            self._sizes[index],
        )

    @property
    def nbytes(self) -> int:
        """Bytes of all the data."""
        return sum(self._sizes)


class WrittenRecords(Mapping[str, TensorRecord]):
    """What :meth:`SafetensorsWriter.commit` returns: each written tensor's
    :class:`TensorRecord`, made when asked for from the file's layout and each tensor's packed
    checksums (:attr:`TensorRecord.digests`)."""

    def __init__(
        self, layout: _Layout, digests: list[bytes], data_start: int, chunk_bytes: int
    ) -> None:
        self._layout, self._digests = layout, digests
        self._data_start, self._chunk_bytes = data_start, chunk_bytes

    def __getitem__(self, key: str) -> TensorRecord:
        index = self._layout.index(key)
        if index is None or index >= len(self._digests):
            raise KeyError(key)
        name, shape, begin, nbytes = self._layout.entry(index)
        return TensorRecord(
            key=self._layout.keys[index],
            dtype=name,
            shape=shape,
            offset=self._data_start + begin,
            nbytes=nbytes,
            digests=self._digests[index],
            chunk_bytes=self._chunk_bytes,
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout.keys[: len(self._digests)])

    def __len__(self) -> int:
        return len(self._digests)


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class WriteFollower(Protocol):
    """What a :class:`SafetensorsWriter` tells whoever follows the file
    it writes front to back: the file is a scratch copy of what the follower stores
    elsewhere, so the writer neither fsyncs it nor starts its writeback."""

    def advance(self, end: int) -> None:
        """Bytes ``[0, end)`` of the file are written and will not change."""
        ...

    def finish(self, size: int) -> None:
        """The file is complete at ``size`` bytes."""
        ...

    def abandon(self) -> None:
        """The file will never be complete: stop, leaving nothing stored of it."""
        ...


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
        sync: bool = True,
        follow: Callable[[Path, int], WriteFollower | None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.sync = sync
        """fsync at :meth:`commit` (False: the caller syncs the file before it commits a
        checkpoint, :func:`muonckpt.storage.sync_files`)."""
        if chunk_bytes <= 0:
            raise CheckpointError(f"chunk_bytes must be positive, got {chunk_bytes}", path=path)
        self.chunk_bytes = chunk_bytes
        header = _plan_header(self.path, specs, metadata)
        self._plan = header.layout
        self._data_start = 8 + header.length
        self.size = self._data_start + self._plan.nbytes
        """Length of the finished file."""
        self._order = self._plan.keys
        self._next = 0
        self._digests: list[bytes] = []
        self._tmp = temporary_path(self.path)
        self._file = None
        self._follower: WriteFollower | None = None
        """Who stores the file elsewhere as it is written (``follow(path, a descriptor of
        the file it owns)``, None: nobody); the file is then its scratch copy."""
        try:
            # (readable too: a follower reads the file back while it is written)
            self._file = open(self._tmp, "w+b")  # noqa: SIM115 - closed by commit/abort
            header.write(self._file)
            self._file.flush()  # the data goes in by positional writes
            if follow is not None:
                self._follower = _followed(follow, self.path, self._file.fileno())
        except OSError as e:
            self.abort()
            raise failure("write", e, self.path) from e
        if self._follower is not None:
            self.sync = False
            self._follower.advance(self._data_start)

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
        name, shape, begin, nbytes = self._plan.entry(self._next)
        view = _payload(tensor, name, shape, self.path, key)
        sums = b""
        try:
            if nbytes:
                sums = _write_and_checksum(
                    self._file.fileno(),
                    view,
                    self._data_start + begin,
                    self.chunk_bytes,
                    writeback=self._follower is None,
                )
        except OSError as e:
            self.abort()
            raise failure("write", e, self.path) from e
        self._digests.append(sums)
        self._next += 1
        if self._follower is not None:
            self._follower.advance(self._data_start + begin + nbytes)
        return self._records()[key]

    def _records(self) -> WrittenRecords:
        return WrittenRecords(self._plan, self._digests, self._data_start, self.chunk_bytes)

    def commit(self) -> WrittenRecords:
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
            if self.sync:
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            if self.sync:
                replace_durably(self._tmp, self.path)
            else:
                os.replace(self._tmp, self.path)
        except OSError as e:
            self.abort()
            raise failure("write", e, self.path) from e
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.finish(self.size)
        return self._records()

    def abort(self) -> None:
        """Close and remove the temporary file, and abandon its follower (idempotent)."""
        file, self._file = self._file, None
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.abandon()
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()
        remove_quietly(self._tmp)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self.abort()


def _followed(
    follow: Callable[[Path, int], WriteFollower | None], path: Path, fd: int
) -> WriteFollower | None:
    """``follow(path, a duplicate of fd)``: the follower owns the duplicate (it may read the
    file after the writer has closed it); closed here when nobody follows."""
    own = os.dup(fd)
    try:
        follower = follow(path, own)
    except BaseException:
        os.close(own)
        raise
    if follower is None:
        os.close(own)
    return follower


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
        self._header = _plan_header(self.path, specs, metadata)
        self._plan = self._header.layout
        self._data_start = 8 + self._header.length
        self.size = self._data_start + self._plan.nbytes
        """Length of the finished file."""
        self._part = self.path.with_name(f".{self.path.name}.part")
        self._fd: int | None = None

    def record(self, key: str, digests: bytes = b"") -> TensorRecord:
        """Where ``key`` lies in the file, with the given (packed) checksums of its data."""
        index = self._plan.index(key)
        if index is None:
            raise CheckpointError("no such tensor planned", path=self.path, param=key)
        name, shape, begin, nbytes = self._plan.entry(index)
        return TensorRecord(
            key, name, shape, self._data_start + begin, nbytes, digests, self.chunk_bytes
        )

    def create(self) -> None:
        """Write the header and give the temporary file its full length (the data still holes)."""
        try:
            with open(self._part, "xb") as file:
                self._header.write(file)
                file.truncate(self.size)
        except OSError as e:
            raise failure("create", e, self.path) from e

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
            raise failure("write", e, self.path, key) from e
        return self.record(key, sums)

    def close(self) -> None:
        """Close this process's handle of the temporary file (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def commit(self, *, sync: bool = True) -> None:
        """fsync the temporary file, rename it into place and fsync the directory; to be called
        once, after every process has written its tensors and closed. Without ``sync``, the
        rename alone (the caller syncs the file before a commit,
        :func:`muonckpt.storage.sync_files`)."""
        try:
            if not sync:
                os.replace(self._part, self.path)
                return
            fd = os.open(self._part, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            replace_durably(self._part, self.path)
        except OSError as e:
            raise failure("write", e, self.path) from e
