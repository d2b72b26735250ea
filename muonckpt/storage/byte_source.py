"""The read seam: where a reader's bytes come from. :class:`~.SafetensorsReader` reads
through a :class:`ByteSource`: a local file by ``pread`` (:class:`FileSource`, what it always
did), or an object in S3 by ranged GETs of exactly the bytes asked for, pinned to the etag the
object had when it was opened (:class:`ObjectSource`): a reader never mixes two versions of a
file, and one replaced or deleted meanwhile reads as changed."""

from __future__ import annotations

import errno
import os
from typing import Protocol

from ..errors import CheckpointError, PreconditionFailed
from .durable import open_regular
from .s3 import ObjectInfo, S3Client, S3Url

HEAD_PREFETCH = 64 << 10
"""Bytes of an object read by its first GET: a safetensors header of this size or less costs
no second request."""


class ByteSource(Protocol):
    """Positional reads of one file or object, the way ``pread`` does them."""

    def size(self) -> int:
        """Its size in bytes now (``OSError`` or ``CheckpointError`` when that cannot be
        known)."""
        ...

    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from byte ``offset``; the bytes read, fewer only at the end."""
        ...

    def changed(self) -> str | None:
        """How it changed since it was opened, in words; None when it did not (or that
        cannot be told)."""
        ...

    def identity(self) -> tuple[object, ...]:
        """What tells the file or object opened from another put in its place: a reader
        opened again must find the same (:class:`~.reader_cache.ReaderCache`)."""
        ...

    def close(self) -> None:
        """Release it; idempotent."""
        ...


class FileSource:
    """A regular local file, opened never through a symlink (:func:`.durable.open_regular`),
    read by ``preadv``; changed when its size, modification time or the file its path names
    differ from when it was opened."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self.fd: int | None = open_regular(path)
        try:
            self.opened = os.fstat(self.fd)
        except BaseException:
            self.close()
            raise

    def _open_fd(self) -> int:
        if self.fd is None:
            raise OSError(errno.EBADF, "the file is closed")
        return self.fd

    def size(self) -> int:
        return os.fstat(self._open_fd()).st_size

    def read_into(self, view: memoryview, offset: int) -> int:
        fd = self._open_fd()
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if not got:
                break
            done += got
        return done

    def identity(self) -> tuple[object, ...]:
        """Device, inode, size and modification time when opened."""
        was = self.opened
        return (was.st_dev, was.st_ino, was.st_size, was.st_mtime_ns)

    def changed(self) -> str | None:
        try:
            now = os.fstat(self._open_fd())
        except OSError:
            return None
        was = self.opened
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

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


class ObjectSource:
    """An object in S3: its size and etag taken when opened, with its first
    :data:`HEAD_PREFETCH` bytes (one GET; ``If-Match`` the etag of ``info`` when the caller
    looked the object up already, none when it also read them: ``head``), every later read a
    ranged GET ``If-Match`` that etag. A read of an object replaced or deleted meanwhile
    raises, saying so."""

    def __init__(
        self,
        client: S3Client,
        url: S3Url,
        info: ObjectInfo | None = None,
        head: bytes | None = None,
    ) -> None:
        self.client = client
        self.url = url
        try:
            if info is None:
                head, info = client.fetch(url, HEAD_PREFETCH) or (None, None)
            elif head is None:
                head = client.get(url, 0, min(info.size, HEAD_PREFETCH), if_match=info.etag)
        except PreconditionFailed:
            raise CheckpointError(f"cannot open {url}: it was replaced while opening") from None
        if head is None or info is None:
            raise CheckpointError(f"cannot open {url}: there is no such object")
        self.etag = info.etag
        self._size = info.size
        self._head = head

    def size(self) -> int:
        return self._size

    def read_into(self, view: memoryview, offset: int) -> int:
        n = max(0, min(len(view), self._size - offset))
        if offset + n <= len(self._head):
            view[:n] = self._head[offset : offset + n]
            return n
        try:
            self.client.read_into(self.url, offset, view[:n], if_match=self.etag)
        except PreconditionFailed:
            raise CheckpointError(
                f"cannot read {self.url}: another object was put in its place since it was "
                "opened (the checkpoint changed while reading); read it again"
            ) from None
        return n

    def identity(self) -> tuple[object, ...]:
        """Its URL, etag and size when opened."""
        return (str(self.url), self.etag, self._size)

    def changed(self) -> str | None:
        try:
            info = self.client.head(self.url)
        except CheckpointError:
            return None
        if info is None:
            return "it was deleted"
        if info.etag != self.etag:
            return "another object was put in its place"
        return None

    def close(self) -> None:
        self._head = b""
