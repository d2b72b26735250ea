"""The storage seam: where a checkpoint's bytes go, behind one small protocol.

A checkpoint is written into a *staging* location beside its target and *published* there in
one step; what a publish replaced, what a save abandoned and what ``keep_last`` no longer
keeps are removed, only ever muonckpt's own. :class:`CheckpointStore` names these operations;
:class:`PosixStore` does them on a POSIX filesystem with the guarantees of :mod:`.durable`,
:mod:`.transaction` and :mod:`.lease`; :class:`~.s3store.S3Store` on S3-compatible object
storage, where the manifest is the commit. Each entry point takes the store of its target
from :func:`store_for` and hands it down to every call that stages, publishes, lists or
removes.

On a POSIX filesystem the staging location is a directory every rank writing the checkpoint
can reach: the ranks write the tensor files into it with positional writes, several
processes into one file (:class:`~muonckpt.storage.SharedSafetensorsFile`). On object
storage each rank writes into a scratch directory of its own host (:meth:`~CheckpointStore.
join_staging`) and uploads its own files (:meth:`~CheckpointStore.send`) before the root
commits; files several ranks write together cannot go there from several hosts.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from ..errors import CheckpointError
from ..settings import local_path
from .durable import entries, fsync_dir, sync_files, write_text_atomic
from .s3 import is_s3_url
from .safetensors_writer import WriteFollower
from .transaction import discard, make_staging, remove_checkpoint, retire, swap_in, watching

StrPath = str | os.PathLike[str]


class CheckpointStore(Protocol):
    """Where checkpoints are written: staging, durable writes, an atomic publish, listing,
    and removing (only muonckpt's own)."""

    def create_staging(
        self,
        final: StrPath,
        overwrite: bool,
        *,
        source: StrPath | None = None,
        output: str | None = None,
    ) -> Path:
        """A fresh staging directory for a checkpoint at ``final`` (or for the files of
        foreign format ``output``: what a discard, or ``clean`` after a crash, then deletes),
        marked as this process's own until it is published or discarded; a
        :class:`~muonckpt.errors.CheckpointError`, with nothing created, when no checkpoint may
        be written there (it exists without ``overwrite``, it is not a muonckpt checkpoint, it
        overlaps ``source``, ...)."""
        ...

    def join_staging(self, staging: str, rank: int, final: StrPath) -> Path:
        """The staging directory rank ``rank`` writes into for the checkpoint at ``final``,
        from what :meth:`create_staging` returned on the root (sent to every rank)."""
        ...

    def follow(self, path: Path, fd: int) -> WriteFollower | None:
        """Who stores data file ``path`` (open as ``fd``, theirs to close) elsewhere while
        it is written into a staging directory (:class:`~.safetensors_writer.WriteFollower`),
        or None: nobody, the file in the staging directory is the one published."""
        ...

    def send(
        self, staging: StrPath, final: StrPath, *, upload: bool = True, last: bool = True
    ) -> None:
        """(every rank, when its files are written, before it reports them) Put what this
        rank wrote into ``staging`` where the root's :meth:`publish` finds it (without
        ``upload``: its write failed, drop it); with ``last``, this rank writes no more
        there."""
        ...

    def sync_files(self, directory: StrPath, names: Iterable[str]) -> None:
        """(the root, before the piece indexes and the manifest) Make the data files
        ``names`` of the staging ``directory`` durable."""
        ...

    def watching(
        self, final: StrPath, staging: StrPath
    ) -> contextlib.AbstractContextManager[Callable[[], bool]]:
        """While in it, a call telling whether the save staged in ``staging`` is committed
        at ``final`` (by this process, or by a root that died right after): what a failure
        in the ``write`` step is, an error or a warning after the commit."""
        ...

    def put_text(
        self, path: StrPath, text: str | Iterable[str], *, limit: int | None = None
    ) -> int:
        """Write ``text`` (UTF-8, a str or its pieces) to ``path`` durably and atomically: a
        crash leaves the old file or the whole new one. Returns its size in bytes; past
        ``limit`` bytes nothing is written."""
        ...

    def publish(
        self,
        staging: StrPath,
        final: StrPath,
        *,
        files: Mapping[str, int] | None = None,
        overwrite: bool | None = None,
    ) -> Path | None:
        """Make everything written into ``staging`` durable and put it at ``final`` in one
        step (a crash leaves the old checkpoint or the new one), after checking that each of
        ``files`` (name -> size) is there at its size and that ``staging`` is still this
        process's. Returns where a checkpoint it replaced now is, for :meth:`retire`; None
        when none was. Raises only when nothing was published."""
        ...

    def entries(self, directory: StrPath) -> list[str]:
        """The sorted names in ``directory``; empty when it cannot be listed."""
        ...

    def directories(self, root: StrPath) -> list[str]:
        """The sorted names of the directories directly under ``root`` (not symlinks): where
        checkpoints are looked for; none when ``root`` does not exist, a
        :class:`~muonckpt.errors.CheckpointError` when it is no directory or cannot be
        listed."""
        ...

    def discard(self, staging: StrPath, *, quiet: bool = False) -> list[str]:
        """Remove a staging directory that will never be published (its checkpoint files, or
        its foreign format's, and marks only). Returns what is kept, as ``"NAME (why)"``."""
        ...

    def retire(self, directory: StrPath, files: Sequence[str] | None = None) -> None:
        """Delete the checkpoint a :meth:`publish` replaced: ``files`` of it (a rank's share),
        or all of it and then the directory; what cannot be deleted is a warning."""
        ...

    def remove_checkpoint(self, directory: StrPath) -> bool:
        """Delete a published checkpoint, its manifest first (what a crash leaves reads as
        incomplete). Returns whether it is gone entirely."""
        ...


class PosixStore:
    """:class:`CheckpointStore` on a POSIX filesystem: a staging directory
    ``.NAME.staging-XXXXXXXX`` beside the target holding muonckpt's lease; fsync, then
    rename, for every write; the publish an fsync of the staging directory and an atomic
    ``renameat2`` (exchanging with a checkpoint it replaces); removal of only muonckpt's
    checkpoint files, never through a symlink. Its operations are those of :mod:`.durable` and
    :mod:`.transaction` themselves."""

    create_staging = staticmethod(make_staging)
    sync_files = staticmethod(sync_files)
    watching = staticmethod(watching)
    put_text = staticmethod(write_text_atomic)
    entries = staticmethod(entries)
    discard = staticmethod(discard)
    retire = staticmethod(retire)
    remove_checkpoint = staticmethod(remove_checkpoint)

    def join_staging(self, staging: str, rank: int, final: StrPath) -> Path:
        """``staging`` itself: every rank writes into the one directory beside the target."""
        return Path(staging)

    def follow(self, path: Path, fd: int) -> None:
        """Nobody: the staging directory's files are published as they are."""

    def send(
        self, staging: StrPath, final: StrPath, *, upload: bool = True, last: bool = True
    ) -> None:
        """Nothing: the files are in place in the staging directory the ranks share."""

    def directories(self, root: StrPath) -> list[str]:
        try:
            with os.scandir(root) as listing:
                return sorted(e.name for e in listing if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise CheckpointError("is not a directory of checkpoints", path=root) from None
        except OSError as exc:
            raise CheckpointError(f"cannot be listed: {exc.strerror}", path=root) from None

    def publish(
        self,
        staging: StrPath,
        final: StrPath,
        *,
        files: Mapping[str, int] | None = None,
        overwrite: bool | None = None,
    ) -> Path | None:
        """fsync the staging directory, then :func:`~.transaction.swap_in`."""
        fsync_dir(staging)
        return swap_in(staging, final, overwrite=overwrite, files=files)


def store_for(target: StrPath) -> CheckpointStore:
    """The store that holds ``target``: an ``s3://bucket/prefix`` URL's bucket
    (:class:`~.s3store.S3Store`, on this process's one client), a local path's filesystem
    (:class:`PosixStore`); any other URL is refused in one line
    (:func:`muonckpt.settings.local_path`)."""
    if is_s3_url(target):
        from .s3store import S3Store  # (boto3 itself only when its first request is made)

        return S3Store()
    local_path(target)
    return PosixStore()
