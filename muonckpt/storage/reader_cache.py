"""A bounded cache of open :class:`SafetensorsReader` s: no tool holds one descriptor per file.

A checkpoint of a large job has a file per rank (10,000 and more), beyond the open-file limit
of most processes (``ulimit -n``: 1024, often less). Readers are kept open least recently used
first, at most ``limit`` of them; one evicted is closed and opened again when asked for, and a
file reopened must be the one first opened (its source's identity: a local file's device,
inode, size and modification time, an object's URL, etag and size), else the checkpoint
changed while it was read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from .safetensors_reader import SafetensorsReader

OPEN_FILES_SHARE = 4
"""A cache keeps at most this fraction (1/n) of the process's open-file limit open."""
MAX_OPEN_FILES = 256
"""...and never more than this many files."""
MIN_OPEN_FILES = 4


def default_limit() -> int:
    """Files one cache keeps open: a quarter of ``RLIMIT_NOFILE`` (the soft limit), within
    [:data:`MIN_OPEN_FILES`, :data:`MAX_OPEN_FILES`]; so two caches (``diff``) and the rest of
    the process stay well inside the limit."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        return MAX_OPEN_FILES // 4
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_FILES
    return max(MIN_OPEN_FILES, min(MAX_OPEN_FILES, soft // OPEN_FILES_SHARE))


class ReaderCache:
    """Open readers by name, least recently used closed first past ``limit``; ``opener``
    opens the reader of a name (a file of a checkpoint:
    :meth:`~.checkpoint_files.CheckpointFiles.reader`; a local path by default).

    Thread-safe. A reader returned stays usable until ``limit`` other files were asked for
    since, so a caller uses it right away (as :class:`muonckpt.files.pieces.PieceReader` does,
    one piece at a time) and asks again for the next read.
    """

    def __init__(
        self,
        limit: int | None = None,
        opener: Callable[[str], SafetensorsReader] = SafetensorsReader,
    ) -> None:
        self.limit = default_limit() if limit is None else max(1, limit)
        self._opener = opener
        self._open: OrderedDict[str, SafetensorsReader] = OrderedDict()
        self._first: dict[str, tuple[object, ...]] = {}
        self._lock = threading.Lock()
        self.opens = 0
        """Files opened so far, reopenings included (for tests and benchmarks)."""

    def get(self, name: str) -> SafetensorsReader:
        """The open reader of ``name`` (opened, or reopened and checked, when not cached)."""
        with self._lock:
            reader = self._open.get(name)
            if reader is not None:
                self._open.move_to_end(name)
                return reader
            while len(self._open) >= self.limit:
                _, evicted = self._open.popitem(last=False)
                evicted.close()
            reader = self._opener(name)
            self.opens += 1
            now = reader.identity()
            first = self._first.setdefault(name, now)
            if now != first:
                reader.close()
                raise reader.changed_error("another file was put in its place")
            self._open[name] = reader
            return reader

    def close(self) -> None:
        """Close every open reader. Idempotent."""
        with self._lock:
            while self._open:
                self._open.popitem()[1].close()

    def __enter__(self) -> ReaderCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
