"""Uploading a file to S3 while its writer is still writing it (issue 52's save speed).

A save to S3 writes each rank's files into a scratch directory of its host, whose copy exists
only to be uploaded. Uploading it after the writer has finished leaves the network idle while
the writer works, and the writer idle while the upload runs. A :class:`StreamedUpload`
follows the writer instead: the writer says how far the file is final (:meth:`advance`: it
writes front to back), a thread of the upload's own sends each part as soon as the writer has
passed it, through the client's multipart upload (:meth:`.S3Client.upload`: bounded parts in
flight, retries, the upload aborted on any failure), and :meth:`finish` hands it the length.
The parts are read back from the file (the page cache), so memory stays part size x
concurrency whatever the writer's pace.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator

from ..errors import CheckpointError
from .s3 import S3Client, S3Url


class _Abandoned(Exception):
    """Raised into the upload by an abandoned file (the upload aborts, nothing is kept)."""


class StreamedUpload:
    """Object ``url`` uploaded from the file open as ``fd`` (owned: closed here) as it is
    written (module docstring); created only where no object is there (``If-None-Match``).
    A :class:`~.safetensors_writer.WriteFollower`."""

    def __init__(self, client: S3Client, url: S3Url, fd: int) -> None:
        self.url = url
        self._client, self._fd = client, fd
        self._changed = threading.Condition()
        self._ready = 0
        self._size: int | None = None
        self._abandoned = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"muonckpt-s3-upload {url.name}", daemon=True
        )
        self._thread.start()

    def advance(self, end: int) -> None:
        with self._changed:
            self._ready = max(self._ready, end)
            self._changed.notify()

    def finish(self, size: int) -> None:
        with self._changed:
            self._ready, self._size = size, size
            self._changed.notify()

    def abandon(self) -> None:
        with self._changed:
            self._abandoned = True
            self._changed.notify()
        self._close()

    def wait(self) -> None:
        """Until the object is stored (an abandoned file: until its upload has stopped); the
        upload's failure, if any, raised. A file neither finished nor abandoned is abandoned
        and refused."""
        with self._changed:
            unfinished = self._size is None and not self._abandoned
        if unfinished:
            self.abandon()
            raise CheckpointError(f"{self.url}: its file was never finished; nothing stored")
        self._close()
        if self._error is not None:
            raise self._error

    def _close(self) -> None:
        self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _run(self) -> None:
        try:
            self._client.upload(self.url, self._parts(), if_none_match=True)
        except _Abandoned:
            pass
        except BaseException as exc:  # handed to wait(), on the writer's thread
            self._error = exc

    def _parts(self) -> Iterator[bytes]:
        """The file a part at a time, each once the writer has passed its end."""
        part = self._client.settings.part_size
        start = 0
        while True:
            with self._changed:
                self._changed.wait_for(functools.partial(self._passed, start + part))
                if self._abandoned:
                    raise _Abandoned
                end = start + part if self._size is None else min(start + part, self._size)
            if end <= start and start > 0:
                return
            yield self._read(start, end - start)
            if end - start < part:
                return
            start = end

    def _passed(self, end: int) -> bool:
        """Whether the writer has passed byte ``end`` (or finished, or given up)."""
        return self._abandoned or self._size is not None or self._ready >= end

    def _read(self, offset: int, length: int) -> bytes:
        data = os.pread(self._fd, length, offset)
        while len(data) < length:  # a short read (rare on a regular file): the rest
            more = os.pread(self._fd, length - len(data), offset + len(data))
            if not more:
                raise CheckpointError(f"{self.url}: its file ended at {offset + len(data)} bytes")
            data += more
        return data
