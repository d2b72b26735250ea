"""The read seam of a whole checkpoint: its files as its readers reach them, wherever it is.

A reader (:mod:`muonckpt.files.pieces`: the manifest, the piece indexes, the data files)
asks a :class:`CheckpointFiles` for the manifest's text, a small file's bytes, a file's size
and an open :class:`~.safetensors_reader.SafetensorsReader`, by the file's name relative to
the checkpoint (``rank-00000-of-00004.safetensors``, or under the manifest's save prefix,
``s-<16 hex>/rank-...``). :func:`files_at` picks the one for a place, told apart once
at the entry point (:func:`.places.location`), and the reader hands it down:

* :class:`DirectoryFiles`, a local directory: exactly the calls every reader made before the
  seam (regular files of its own, never through a symlink; ``pread``).
* :class:`ObjectFiles`, a key prefix in S3: the manifest by one GET (the reader never lists:
  the manifest names every object it reads), an index by one GET, a data object by one GET
  of its first 64 KiB (its size and etag with them) and ranged GETs pinned to that etag
  (:class:`~.byte_source.ObjectSource`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..errors import CheckpointError
from ..format.names import MANIFEST_NAME
from . import access, byte_source
from .durable import MAX_TEXT_BYTES, file_size, read_small, read_text, read_text_chunks
from .ownership import is_ours
from .places import Location
from .s3 import ObjectInfo, S3Client, S3Url, shared_client
from .safetensors_reader import SafetensorsReader

LISTED_FROM = 16
"""Sizes of this many objects or more (``verify``, an offline tool's source, ``latest``'s
check; never a load's reads) are taken from one LIST of each prefix holding them (1000
objects a request) rather than a GET of each one's first bytes."""

WHOLE_MANIFEST_BYTES = 16 << 20
"""A manifest up to this size is parsed whole (the C decoder: a Kimi-K2-shaped top level of
2.6 MB in 0.05 s, against 0.5 s as a stream); a larger local one (a version 1 or 2 manifest
listing every piece) as a stream, never held whole."""


@runtime_checkable
class CheckpointFiles(Protocol):
    """A checkpoint's files, by name relative to it (the module's docstring)."""

    @property
    def location(self) -> Location:
        """Where the checkpoint is: its directory, or its URL."""
        ...

    def at(self, name: str) -> Location:
        """Where file ``name`` is (what messages name it by)."""
        ...

    def resolved(self) -> str:
        """The checkpoint as the ranks of one operation compare it: the directory's real
        path, or the URL."""
        ...

    def refusal(self) -> CheckpointError | None:
        """Why this is no place to read a checkpoint from (no such directory; a staging
        directory of an interrupted save), before anything else is read; else None."""
        ...

    def manifest_text(self, *, whole: bool = False) -> str | Iterator[str] | None:
        """The manifest's text: whole, or (a large local one, unless ``whole``) in chunks as
        it is read; None when there is no manifest."""
        ...

    def committed_ns(self) -> int:
        """When the manifest was written, in nanoseconds (``CheckpointError`` or ``OSError``
        when that cannot be told)."""
        ...

    def manifest_kept(self) -> bool:
        """Whether the manifest is certainly still the one first read (in S3: its etag, by
        one HEAD); False when that cannot be told so cheaply (a local file: read it again)."""
        ...

    def names(self, under: str = "") -> list[str] | None:
        """The names directly in the checkpoint (or in its subdirectory ``under``), sorted;
        None where the checkpoint is no directory of its own: a key prefix in S3, where an
        object no manifest names is garbage of a writer that did not commit, never read
        (``OSError`` when a directory cannot be listed)."""
        ...

    def symlinked(self, name: str) -> bool:
        """Whether ``name`` is a symlink (never, in S3)."""
        ...

    def size(self, name: str) -> int | None:
        """The size of file ``name``; None when it is no regular file (or no object)."""
        ...

    def sizes(self, names: list[str]) -> dict[str, int | None]:
        """:meth:`size` of each of ``names``."""
        ...

    def read_small(self, name: str) -> bytes:
        """The bytes of a small file (a piece index), at most
        :data:`~.durable.MAX_TEXT_BYTES`."""
        ...

    def small_text(self, name: str) -> str:
        """:meth:`read_small` of a UTF-8 text file, as text."""
        ...

    def reader(self, name: str) -> SafetensorsReader:
        """A reader of data file ``name``, its header checked."""
        ...


class DirectoryFiles:
    """A checkpoint in a local directory."""

    def __init__(self, directory: Path) -> None:
        self.location: Path = directory

    def at(self, name: str) -> Path:
        return self.location / name

    def resolved(self) -> str:
        return os.path.realpath(self.location)

    def refusal(self) -> CheckpointError | None:
        directory = self.location
        if not access.is_dir(directory):
            return CheckpointError("no checkpoint directory", path=directory)
        if is_ours(directory.name):
            return CheckpointError(
                "incomplete: a staging directory left by an interrupted save, not a checkpoint",
                path=directory,
            )
        return None

    def manifest_text(self, *, whole: bool = False) -> str | Iterator[str] | None:
        path = self.at(MANIFEST_NAME)
        if not access.is_file(path):
            return None
        try:
            large = not whole and file_size(path) > WHOLE_MANIFEST_BYTES
        except CheckpointError:  # read whole, which names what is wrong with it
            large = False
        return read_text_chunks(path) if large else read_text(path)

    def committed_ns(self) -> int:
        return access.modified_ns(self.at(MANIFEST_NAME))

    def manifest_kept(self) -> bool:
        return False

    def names(self, under: str = "") -> list[str]:
        return access.list_names(self.at(under) if under else self.location)

    def symlinked(self, name: str) -> bool:
        return access.is_symlink(self.at(name))

    def size(self, name: str) -> int | None:
        path = self.at(name)
        return file_size(path) if access.is_file(path) else None

    def sizes(self, names: list[str]) -> dict[str, int | None]:
        return {name: self.size(name) for name in names}

    def read_small(self, name: str) -> bytes:
        return read_small(self.at(name))

    def small_text(self, name: str) -> str:
        return read_text(self.at(name))

    def reader(self, name: str) -> SafetensorsReader:
        return SafetensorsReader(self.at(name))


class ObjectFiles:
    """A checkpoint at a key prefix in S3, read through ``client``. Each object is looked
    up once (by a GET of its first :data:`~.byte_source.HEAD_PREFETCH` bytes, kept for the
    reader that opens it next; or listed, :meth:`sizes`), and read only as it was then
    (``If-Match``)."""

    def __init__(self, client: S3Client, url: S3Url) -> None:
        self.client = client
        self.location: S3Url = url
        self._found: dict[str, ObjectInfo] = {}
        self._heads: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._manifest: ObjectInfo | None = None

    def at(self, name: str) -> S3Url:
        return self.location / name

    def resolved(self) -> str:
        return str(self.location)

    def refusal(self) -> CheckpointError | None:
        return None  # a prefix is there whatever it holds: the manifest tells

    def manifest_text(self, *, whole: bool = True) -> str | None:
        fetched = self._fetch(MANIFEST_NAME)
        if fetched is None:
            return None
        data, info = fetched
        self._manifest = self._manifest or info  # the first read: what readers read on from
        return _text(data, self.at(MANIFEST_NAME))

    def _fetch(self, name: str) -> tuple[bytes, ObjectInfo] | None:
        """A small object whole, with its size and etag (one GET); None when there is none."""
        url = self.at(name)
        fetched = self.client.fetch(url, MAX_TEXT_BYTES + 1)
        if fetched is not None and len(fetched[0]) > MAX_TEXT_BYTES:
            raise CheckpointError(f"more than {MAX_TEXT_BYTES} bytes", path=url)
        return fetched

    def committed_ns(self) -> int:
        if self._manifest is None:
            raise CheckpointError("the manifest was not read", path=self.at(MANIFEST_NAME))
        return self._manifest.modified_ns

    def manifest_kept(self) -> bool:
        if self._manifest is None:
            return False
        try:
            now = self.client.head(self.at(MANIFEST_NAME))
        except CheckpointError:
            return False
        return now is not None and now.etag == self._manifest.etag

    def names(self, under: str = "") -> None:
        return None

    def symlinked(self, name: str) -> bool:
        return False

    def size(self, name: str) -> int | None:
        with self._lock:
            info = self._found.get(name)
        if info is None:
            fetched = self.client.fetch(self.at(name), byte_source.HEAD_PREFETCH)
            if fetched is None:
                return None
            with self._lock:
                info = self._found.setdefault(name, fetched[1])
                if info is fetched[1]:
                    self._heads[name] = fetched[0]
        return info.size

    def sizes(self, names: list[str]) -> dict[str, int | None]:
        if len(names) < LISTED_FROM:
            return {name: self.size(name) for name in names}
        found: dict[str, ObjectInfo] = {}
        for under in sorted({name.rpartition("/")[0] for name in names}):
            listed = self.client.objects(self.at(under) if under else self.location)
            found |= {f"{under}/{n}" if under else n: info for n, info in listed.items()}
        with self._lock:  # each later read pinned to the etag listed
            self._found |= {name: found[name] for name in names if name in found}
        return {name: found[name].size if name in found else None for name in names}

    def read_small(self, name: str) -> bytes:
        fetched = self._fetch(name)
        if fetched is None:
            raise CheckpointError("cannot read: there is no such object", path=self.at(name))
        return fetched[0]

    def small_text(self, name: str) -> str:
        return _text(self.read_small(name), self.at(name))

    def reader(self, name: str) -> SafetensorsReader:
        url = self.at(name)
        with self._lock:
            info, head = self._found.get(name), self._heads.pop(name, None)
        return SafetensorsReader(
            str(url), source=byte_source.ObjectSource(self.client, url, info, head)
        )


def _text(data: bytes, url: S3Url) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise CheckpointError("not UTF-8 text", path=url) from None


def files_at(place: Location) -> CheckpointFiles:
    """The files of the checkpoint at ``place`` (:func:`.places.location`): a local
    directory's, or an S3 prefix's (through this process's client,
    :func:`~.s3.shared_client`)."""
    if isinstance(place, S3Url):
        return ObjectFiles(shared_client(), place)
    return DirectoryFiles(place)
