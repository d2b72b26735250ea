"""Reading safetensors files: validated headers (parsed by :mod:`.safetensors_header`),
element ranges and strided groups read with ``pread`` (never a mapping), or from an object in
S3 by ranged GETs (the read seam, :mod:`.byte_source`), checksums verified on the way."""

from __future__ import annotations

import errno
import itertools
import json
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..errors import CheckpointError
from ..format.manifest import CHECKSUM_ALGORITHM, DTYPE_BYTES
from ..format.names import MANIFEST_NAME
from ..format.piece_index import index_name
from ..format.strict_json import TextWindow
from ..layout.topology import Strided
from .byte_source import ByteSource, FileSource
from .checksums import CHUNK_BYTES, chunk_digest
from .dtypes import byte_view, torch_dtype
from .durable import read_text
from .safetensors_format import MAX_HEADER_BYTES, METADATA_KEY, TensorRecord
from .safetensors_header import (
    Records,
    compact_entries,
    header_chunks,
    is_int,
    no_duplicates,
    regular_header,
    string_map,
    tensor_entry,
)

if TYPE_CHECKING:
    import torch

_VERIFY_WINDOW = 4 << 20
"""Bytes read at a time by :meth:`SafetensorsReader.verify`, with ``pread`` into one reused
buffer. On the benchmark VM, verify of a warm 305 MB checkpoint took 0.065 s so (min of 21
interleaved runs), 0.067 s with 8 MiB and 0.074 s with 16 MiB windows, against 0.052 s when
it hashed 64 MiB mappings, which a file truncated meanwhile turned into SIGBUS."""

_DIRECT_BYTES = 64 << 10
"""A read of one contiguous run whose whole checksum chunks hold at least this many bytes
reads them by ``pread`` straight into the output (a load's arena, a rewrite's output buffer),
saving the copy out of the scratch buffer; a partly needed chunk at either end goes through
the scratch buffer."""


class SafetensorsReader:
    """Reads tensors, or flat element ranges of them, from one safetensors file.

    The header is fully validated on open; any damage raises :class:`CheckpointError` naming
    the file. Reads are positional, so one reader may serve several threads. Use it as a
    context manager, or call :meth:`close`.

    ``source``: where the bytes come from when not the local file ``path``
    (:class:`~.byte_source.ObjectSource`: an object in S3; ``path`` is then what messages
    name it by, its URL).
    """

    path: Path
    metadata: dict[str, str]

    def __init__(self, path: str | os.PathLike[str], *, source: ByteSource | None = None) -> None:
        self.path = Path(path)
        self._where: object = self.path if source is None else path
        self.metadata = {}
        self._records = Records()
        self._source: ByteSource | None = source
        self._scratch = threading.local()
        if source is None:
            try:
                self._source = FileSource(self.path)
            except OSError as e:
                why = "it is a symlink" if e.errno == errno.ELOOP else str(e)
                raise CheckpointError(f"cannot open: {why}", path=self.path) from e
        try:
            self._parse_header()
        except BaseException:
            self.close()
            raise

    def identity(self) -> tuple[object, ...]:
        """What tells the file or object this reader opened from another put in its place
        (:meth:`~.byte_source.ByteSource.identity`)."""
        return self._check_open().identity()

    def _fail(self, message: str, param: str | None = None) -> CheckpointError:
        return CheckpointError(message, path=self._where, param=param)

    def changed(self) -> str | None:
        """How the file changed since this reader opened it (its size or modification time,
        or the file its path names; an object's etag), or None when it did not."""
        return None if self._source is None else self._source.changed()

    def _manifest_moved_on(self, digest: str) -> bool:
        """Whether the manifest beside the file exists but no longer lists checksum ``digest``
        (in version 3, in the file's piece index): then the checkpoint directory was replaced
        after the caller read its manifest."""
        if not isinstance(self._source, FileSource):
            return False  # an object: its etag tells (changed)
        try:
            text = read_text(self.path.parent / MANIFEST_NAME)
            if f'"{index_name(self.path.name)}"' in text:
                text = read_text(self.path.parent / index_name(self.path.name))
            return digest not in text
        except CheckpointError:
            return False

    def changed_error(self, why: str, param: str | None = None) -> CheckpointError:
        """The error of a read that found the file changed since it was opened (``why``)."""
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
            size = self._check_open().size()
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
        data_start = 8 + length
        read = lambda at, count: self._pread(at, count, what="header")  # noqa: E731
        window = TextWindow(header_chunks(read, 8, length))
        regular = regular_header(window, data_start, size - data_start)
        del window
        if regular is None:  # anything else: read whole, then judged entry by entry
            raw = self._pread(8, length, what="header")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise self._fail(f"header is not valid UTF-8 JSON: {e}") from e
            del raw
            self._judge_header(text, data_start, size - data_start)
        else:
            self.metadata, self._records = regular
        if not self._records.ordered:  # data not in header order (written by others)
            self._check_overlaps()

    def _judge_header(self, text: str, data_start: int, data_size: int) -> None:
        try:
            header = json.loads(text, object_pairs_hook=compact_entries())
            if not isinstance(header, dict):  # a header that is one entry: judged as it is
                header = json.loads(text, object_pairs_hook=no_duplicates)
        except (ValueError, RecursionError) as e:
            raise self._fail(f"header is not valid UTF-8 JSON: {e}") from e
        if not isinstance(header, dict):
            raise self._fail(f"header is a JSON {type(header).__name__}, not an object")

        meta = header.pop(METADATA_KEY, None)
        if meta is not None:
            if not string_map(meta):
                raise self._fail("__metadata__ is not a map of strings to strings")
            self.metadata = dict(meta)

        for key, info in header.items():
            entry = info if isinstance(info, tuple) else tensor_entry(info)
            if isinstance(entry, str):
                raise self._fail(entry, key)
            dtype, shape, begin, end = entry
            if end > data_size:
                raise self._fail(
                    f"data_offsets {[begin, end]} run past the end of the data ({data_size} bytes)",
                    key,
                )
            self._records.add(key, dtype, shape, data_start + begin, end - begin)
        self._records.seal()

    def _check_overlaps(self) -> None:
        spans = sorted((r.offset, r.offset + r.nbytes, r.key) for r in self._records.all())
        spans = [span for span in spans if span[1] > span[0]]
        for (_, prev_end, prev_key), (begin, _, key) in itertools.pairwise(spans):
            if begin < prev_end:
                raise self._fail(f"tensors {prev_key!r} and {key!r} overlap")

    def _pread(self, offset: int, n: int, what: str) -> bytes:
        source = self._check_open()
        data = bytearray(n)
        try:
            got = source.read_into(memoryview(data), offset)
        except OSError as e:
            raise self._fail(f"cannot read {what}: {e}") from e
        if got < n:
            raise self._truncated(f"{what} needs bytes up to {offset + n}")
        return bytes(data)

    def _check_open(self) -> ByteSource:
        if self._source is None:
            raise self._fail("reader is closed")
        return self._source

    def keys(self) -> list[str]:
        """Tensor keys, sorted."""
        return self._records.keys()

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def record(self, key: str) -> TensorRecord:
        """Dtype, shape, absolute offset and size of ``key`` (no checksums: ``digests`` is
        empty)."""
        record = self._records.get(key)
        if record is None:
            raise self._fail("no such tensor in file", key)
        return record

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
        if not (is_int(start) and is_int(stop) and 0 <= start <= stop <= rec.numel):
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
        :class:`CheckpointError`, not SIGBUS), and each group is placed by one 2-D copy; one
        contiguous run is read straight into ``out`` instead (:data:`_DIRECT_BYTES`). With
        ``checksums`` (the writer's, per ``chunk_bytes`` chunk of the tensor's data) every chunk
        covering the span is verified: a mismatch raises, and the bytes of ``out`` this call
        was to fill are then undefined (a load reads into buffers it discards on an error).
        """
        rec = self.record(key)
        size = DTYPE_BYTES[rec.dtype]
        groups = [g for g in groups if g.length and g.count]
        if not groups:
            return
        lo = min(g.src for g in groups) * size
        hi = max(g.src + (g.count - 1) * g.src_step + g.length for g in groups) * size
        reach = max(g.dst + (g.count - 1) * g.dst_step + g.length for g in groups) * size
        if not (
            all(
                is_int(x) and x >= 0
                for g in groups
                for x in (g.src, g.dst, g.length, g.count, g.src_step, g.dst_step)
            )
            and hi <= rec.nbytes
            and reach <= len(out)
        ):
            raise self._fail(
                f"copy groups outside the tensor's {rec.nbytes} bytes or the {len(out)}-byte "
                "output",
                key,
            )
        target = np.frombuffer(out, dtype=np.uint8)
        if len(groups) == 1 and groups[0].count == 1:
            self._read_run(key, rec, target[groups[0].dst * size :], lo, hi, checksums, chunk_bytes)
            return
        if checksums is not None:
            lo, hi = self._chunk_span(key, rec, lo, hi, checksums, chunk_bytes)
        data = self._span(key, rec.offset + lo, hi - lo)
        if checksums is not None:
            self._verify(key, rec, data, lo, checksums, chunk_bytes)
        for g in groups:
            dst = target[g.dst * size :]
            src = data[g.src * size - lo :]
            if g.count == 1:  # one run: a plain slice (as_strided costs more than the copy)
                run = g.length * size
                dst[:run] = src[:run]
                continue
            shape = (g.count, g.length * size)
            np.copyto(
                as_strided(dst, shape, (g.dst_step * size, 1)),
                as_strided(src, shape, (g.src_step * size, 1), writeable=False),
            )

    def _read_run(
        self,
        key: str,
        rec: TensorRecord,
        target: np.ndarray,
        lo: int,
        hi: int,
        checksums: Sequence[str] | None,
        chunk_bytes: int,
    ) -> None:
        """Tensor bytes ``[lo, hi)`` into ``target``'s first ``hi - lo`` bytes, verified: the
        whole checksum chunks inside the run read straight into ``target``
        (:data:`_DIRECT_BYTES`), a chunk the run needs only part of through the scratch buffer."""
        if checksums is None:
            begin, end, span_hi = lo, hi, hi
        else:
            span_hi = self._chunk_span(key, rec, lo, hi, checksums, chunk_bytes)[1]
            begin = -(-lo // chunk_bytes) * chunk_bytes
            end = hi if hi == span_hi else hi - hi % chunk_bytes
        if end - begin < _DIRECT_BYTES:
            begin = end = hi  # all through the scratch buffer
        self._check_size(key, rec.offset + span_hi)
        for a, b in ((lo, begin), (end, hi)):  # the partly needed chunks at the ends
            if a == b:
                continue
            first, last = (a, b)
            if checksums is not None:
                first, last = self._chunk_span(key, rec, a, b, checksums, chunk_bytes)
            data = self._read_into(key, self._buffer(last - first), rec.offset + first)
            if checksums is not None:
                self._verify(key, rec, data, first, checksums, chunk_bytes)
            target[a - lo : b - lo] = data[a - first : b - first]
        if begin < end:
            direct = self._read_into(key, target[begin - lo : end - lo], rec.offset + begin)
            if checksums is not None:
                self._verify(key, rec, direct, begin, checksums, chunk_bytes)

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
        source = self._check_open()
        view = buffer.data
        try:
            done = source.read_into(view, offset)
        except OSError as e:
            raise self._fail(f"cannot read bytes [{offset}, {offset + len(view)}): {e}", key) from e
        if done < len(view):
            raise self._truncated(
                f"the tensor needs bytes up to {offset + len(view)}, the file has {offset + done}",
                key,
            )
        return buffer

    def _check_size(self, key: str, end: int) -> None:
        """Raise unless the file still holds bytes up to ``end``."""
        try:
            size = self._check_open().size()
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
            got = chunk_digest(data[position : position + chunk_bytes].data)
            if got != checksums[i]:
                why = self.changed() or (
                    "the manifest beside it no longer lists this data"
                    if self._manifest_moved_on(checksums[i])
                    else None
                )
                if why is not None:
                    raise self.changed_error(f"{why}; chunk {i} no longer matches", key)
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
        source, self._source = self._source, None
        if source is not None:
            source.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsReader({str(self._where)!r}, {len(self._records)} tensors)"
