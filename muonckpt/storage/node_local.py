"""The files of the node-local tier (:class:`muonckpt.LocalTier`): each node's directory of
local steps, a share's files read in chunks to copy them to a peer, a copy received and
checked, and the staging directory of a node other than the save root's.

A local step is a checkpoint directory like any other (``root/NAME``, published by the
swap of :mod:`.transaction`), except that each node's holds only the files of its own ranks
and the replicas it keeps of other nodes' ranks; the manifest, the same on every node, names
them all (docs/format.md, "The node-local tier").
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import xxhash

from ..errors import CheckpointError
from . import lease
from .backend import PosixStore, StrPath
from .durable import failing_as, failure, fsync_dir, open_regular, pwrite_all, remove_quietly

COPY_CHUNK_BYTES = 16 << 20
"""The size of each message of a copy between nodes (the last of a file may be shorter)."""


class NodeStore(PosixStore):
    """:class:`~.backend.PosixStore` whose staging directory is per node: the save root
    creates its own beside its node's local step, every other node's ranks write into one of
    the same name beside theirs (:meth:`join_staging`), whose lease the node's ``leader``
    (the rank that publishes it) holds, so that ``clean`` knows a killed save's leftover."""

    def __init__(self, leader: bool = False) -> None:
        self.leader = leader

    def join_staging(self, staging: str, rank: int, final: StrPath) -> Path:
        """The directory named as the root's ``staging``, beside this node's ``final``; made
        by the first of the node's ranks to come (the root's own is itself, its lease the
        root's)."""
        here = Path(final).parent / Path(staging).name
        with failing_as("create the staging directory", here):
            here.mkdir(parents=True, exist_ok=True)
        if self.leader and not lease.holds(here):
            lease.take(here, "staging")
        return here


def file_chunks(path: StrPath, chunk_bytes: int = COPY_CHUNK_BYTES) -> Iterator[np.ndarray]:
    """The bytes of the regular file at ``path``, front to back, ``chunk_bytes`` a chunk."""
    try:
        fd = open_regular(path)
    except OSError as exc:
        raise failure("read", exc, path) from None
    try:
        size = os.fstat(fd).st_size
        for offset in range(0, size, chunk_bytes):
            data = bytearray(min(chunk_bytes, size - offset))  # writable: torch takes it as is
            if os.preadv(fd, [data], offset) != len(data):
                raise CheckpointError("was cut short while it was copied", path=path)
            yield np.frombuffer(data, dtype=np.uint8)
    finally:
        os.close(fd)


class Digest:
    """The XXH3-64 of bytes that come in chunks (16 hex digits, as
    :func:`muonckpt.storage.checksums.chunk_digest` gives of them whole): a file copied to
    another node, at both ends."""

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_64()

    def update(self, chunk: np.ndarray) -> None:
        self._hasher.update(chunk.data)

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


class ReceivedFile:
    """A copy of another node's file arriving in chunks into ``directory/name``: written to a
    temporary name, hashed as it comes, then fsynced and renamed into place
    (:meth:`close`), whose XXH3-64 the save's root compares with the sender's. ``sync``
    False: no fsync of its own, for a copy into a staging directory whose publish fsyncs
    every file it holds and the directory (``sync_files``), so that no copy is synced twice."""

    def __init__(self, directory: StrPath, name: str, *, sync: bool = True) -> None:
        if os.sep in name or name.startswith("."):
            raise CheckpointError(f"a replica may not be named {name!r}", path=directory)
        self.path = Path(directory) / name
        self._tmp = self.path.with_name(f".{name}.copy-{os.getpid()}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        with failing_as("write", self.path):
            self._fd = os.open(self._tmp, flags, 0o644)
        self._digest = Digest()
        self._offset = 0
        self._sync = sync

    def write(self, chunk: np.ndarray) -> None:
        self._digest.update(chunk)
        with failing_as("write", self.path):
            pwrite_all(self._fd, chunk.data.cast("B"), self._offset)
        self._offset += chunk.nbytes

    def close(self) -> str:
        """fsync, the rename into place and its directory's fsync (without ``sync``, the
        rename alone); the digest of the bytes received."""
        try:
            with failing_as("write", self.path):
                if self._sync:
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1
                os.replace(self._tmp, self.path)
                if self._sync:
                    fsync_dir(self.path.parent)
        finally:
            self.abandon()
        return self._digest.hexdigest()

    def abandon(self) -> None:
        """(a copy that failed) Its temporary file removed."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        remove_quietly(self._tmp)


def present(directory: StrPath, sizes: Sequence[tuple[str, int]]) -> list[str]:
    """The names of ``sizes`` (name, size) that are regular files of that size in
    ``directory``."""
    found = []
    for name, size in sizes:
        try:
            if os.stat(Path(directory) / name, follow_symlinks=False).st_size == size:
                found.append(name)
        except OSError:
            continue
    return found


NODE_MARK = ".muonckpt-node-{job}-{node}"
"""The empty file a node's leader leaves in its tier root while the job's nodes look for a
root that two of them share (:func:`nodes_marked`)."""


def mark_node(root: StrPath, job: str, node: int, present: bool) -> None:
    """(a node's leader) Leave (``present``) or take away this node's mark of ``job`` in
    ``root`` (made when missing)."""
    mark = Path(root) / NODE_MARK.format(job=job, node=node)
    with failing_as("mark the node-local root", mark):
        if present:
            Path(root).mkdir(parents=True, exist_ok=True)
            mark.touch()
        else:
            mark.unlink(missing_ok=True)


def nodes_marked(root: StrPath, job: str) -> list[int]:
    """The nodes whose mark of ``job`` is in ``root``: more than one, a root they share."""
    prefix = NODE_MARK.format(job=job, node="")
    with failing_as("list", root):
        names = os.listdir(root)
    return sorted(int(name[len(prefix) :]) for name in names if name.startswith(prefix))
