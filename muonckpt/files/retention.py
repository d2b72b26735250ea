"""The checkpoints under a directory: the newest complete one, and deleting older ones.

For jobs that are preempted and resumed: :func:`latest` names the checkpoint to resume from,
:func:`prune` bounds the disk a run's checkpoints take. Both look only at the directories
directly under the root, and count only complete checkpoints: a directory (not a symlink,
not a staging name of ours) whose manifest parses and whose every listed file is there at its
size (:func:`muonckpt.files.pieces.size_problems`; no checksums are read). Anything else (a
save still in progress or interrupted, a half-deleted checkpoint, a damaged one, the user's own
files and directories) is skipped, never an error.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from .. import storage
from ..errors import ArgumentError, CheckpointError, CheckpointWarning
from ..events import logged
from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME
from ..storage import access
from ..storage.places import Location, location, target
from ..storage.s3 import S3Url
from ..storage.s3store import S3Store
from .pieces import load_pieces, read_manifest, size_problems


@dataclass(frozen=True)
class Found:
    """A complete checkpoint under a root, with what orders it among the others (by step,
    then commit time, then name)."""

    path: Location
    step: int | None
    committed_ns: int
    """The manifest's mtime: a save writes its manifest last, at the commit."""


@dataclass(frozen=True)
class _Committed:
    """A checkpoint whose manifest's top level parses: its files, that manifest, and when it
    was committed; whether it is complete, still to be told (:meth:`complete`)."""

    files: storage.CheckpointFiles
    manifest: Manifest
    committed_ns: int

    def order(self) -> tuple[bool, int, int, str]:
        """Sort key, oldest first: by step (none before any), then commit time, then name (so
        that the order is total)."""
        step = self.manifest.step
        return (step is not None, step or 0, self.committed_ns, self.files.location.name)

    def complete(self) -> bool:
        """Every piece index sound and every file listed there at its size (no checksums)."""
        try:
            manifest = load_pieces(self.files, self.manifest, None)
            return not size_problems(manifest, self.files)
        except (CheckpointError, OSError):
            return False


def _committed(files: storage.CheckpointFiles) -> _Committed | None:
    """The checkpoint of ``files``, when its manifest's top level parses (it refuses staging
    names and missing manifests); else None."""
    try:
        manifest = read_manifest(files, pieces=False)
        return _Committed(files, manifest, files.committed_ns())
    except (CheckpointError, OSError):
        return None


def _under(root: Location, store: storage.CheckpointStore) -> list[_Committed]:
    """The checkpoints directly under ``root`` whose manifests parse, oldest first (one
    listing, :meth:`~muonckpt.storage.CheckpointStore.directories`)."""
    names = store.directories(target(root))
    found = [_committed(storage.files_at(root / name)) for name in names]
    return sorted((f for f in found if f is not None), key=_Committed.order)


def complete_checkpoints(
    root: str | os.PathLike[str] | S3Url, store: storage.CheckpointStore
) -> list[Found]:
    """The complete checkpoints directly under ``root`` (a directory, or an ``s3://``
    prefix), oldest first; symlinks are skipped (a ``latest -> step-300`` link would list one
    checkpoint twice). A missing ``root`` has none; one that is not a directory or cannot be
    listed is a :class:`CheckpointError`
    (:meth:`~muonckpt.storage.CheckpointStore.directories`)."""
    return [
        Found(f.files.location, f.manifest.step, f.committed_ns)
        for f in _under(location(root), store)
        if f.complete()
    ]


def latest(root: str | os.PathLike[str]) -> Location | None:
    """The newest complete checkpoint directly under ``root``, to resume from; None when there
    is none, also when ``root`` does not exist yet (a job's first start). ``root`` is a
    directory, or an ``s3://bucket/prefix`` URL: then the checkpoint's URL is returned, found
    by one LIST of the prefixes directly under it and a GET of each one's manifest.

    Newest by the step the manifest records (a checkpoint without one counts as older than any
    with one), then by commit time. Only a cheap check is made (the manifest parses, every
    file it lists is there at its size); no checksums. Staging directories, directories
    without a manifest, symlinks, damaged checkpoints and anything not a checkpoint are
    skipped. A ``root`` that is not a directory, cannot be listed or is a checkpoint itself
    (``latest("ckpt/step-30")`` where ``latest("ckpt")`` was meant) is a
    :class:`CheckpointError`. When a save commits and prunes while it looks, so that it found
    nothing complete, it looks again (three times in all).
    """
    place = storage.location(root)
    if storage.files_at(place).size(MANIFEST_NAME) is not None:
        raise CheckpointError(
            "is a checkpoint itself; latest looks for checkpoints directly under a directory "
            "(pass its parent)",
            path=root,
        )
    store = storage.store_for(target(place))
    for _ in range(3):  # a save committing and pruning meanwhile can hide every entry once
        found = _under(place, store)
        newest = next((f.files.location for f in reversed(found) if f.complete()), None)
        if newest is not None:
            return newest
    return None


def check_keep_last(keep_last: object) -> None:
    """Raise :class:`ArgumentError` unless ``keep_last`` is an int of at least 1 (a save
    checks it before writing anything)."""
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ArgumentError(
            f"keep_last must be an int of at least 1 (the checkpoints to keep), got {keep_last!r}",
            argument="keep_last",
        )


_DIGIT_RUN = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Series:
    """The names of one run's checkpoints: ``prefix``, the step, ``suffix``. The step is
    written as a plain number, or zero-padded to ``padded`` digits when the name's was
    (``step-000400``)."""

    prefix: str
    suffix: str
    padded: int

    def name_at(self, step: int) -> str:
        """The name this series gives the checkpoint of ``step``."""
        digits = str(step).zfill(self.padded) if self.padded else str(step)
        return f"{self.prefix}{digits}{self.suffix}"

    def holds(self, found: Found) -> bool:
        """Whether ``found`` is of this series: its name is the series' name at the step its
        own manifest records."""
        return found.step is not None and found.path.name == self.name_at(found.step)


def series_of(name: str, step: int | None) -> Series | str:
    """The series of the checkpoint ``name`` whose manifest records ``step``: ``name`` with
    the one run of digits that is ``step`` (whole, not part of a longer number; leading
    zeros allowed) standing for any step. When there is no such run, or several, the series
    cannot be told: why, as a sentence, instead."""
    if step is None:
        return "its manifest records no step"
    runs = [run for run in _DIGIT_RUN.finditer(name) if int(run.group()) == step]
    if not runs:
        return f"its name does not hold its step {step}"
    if len(runs) > 1:
        return f"its name holds its step {step} {len(runs)} times"
    run = runs[0]
    digits = run.group()
    padded = len(digits) if len(digits) > 1 and digits.startswith("0") else 0
    return Series(name[: run.start()], name[run.end() :], padded)


def prune(
    root: str | os.PathLike[str] | S3Url,
    keep_last: int,
    keep: str | os.PathLike[str] | S3Url,
    store: storage.CheckpointStore,
) -> list[Location]:
    """Delete the complete checkpoints directly under ``root`` older than its ``keep_last``
    newest (in :func:`latest`'s order); for a save's ``keep_last``, after its commit.

    Only ``keep``'s run counts, its series (:func:`series_of`): the checkpoints whose names
    differ from ``keep``'s in its step alone, where a checkpoint's step is the one its own
    manifest records. ``seed1-step-400`` (step 400) has ``seed1-step-300`` (step 300) in its
    series, never ``seed2-step-300``, ``seed1-step-300`` recording another step, nor
    ``seed1-step-400-old``. So checkpoints of other runs, sweeps and models under the same
    root are never deleted. When ``keep`` records no step, or its name does not hold it
    exactly once (``final``; ``run-7-step-7``), its series cannot be told and nothing is
    deleted (a :class:`CheckpointWarning` says why).

    Never deleted either: ``keep`` (the checkpoint just written, kept even when a run
    restarted at a lower step makes it older than the newest), anything
    :func:`complete_checkpoints` does not count (staging directories, saves in progress, what
    is not a checkpoint, symlinks), and a checkpoint holding files of the user's
    (:func:`muonckpt.storage.ownership_problem`): it is left whole. So at most ``keep_last``
    checkpoints of the series remain besides those two kinds.

    Each is deleted manifest first (:func:`muonckpt.storage.remove_checkpoint`), so a crash
    leaves it incomplete, never something :func:`latest` picks. A failure (a file that cannot
    be deleted, a root that cannot be listed) is a :class:`CheckpointWarning`: the new
    checkpoint is committed whatever happens here. ``keep_last`` below 1 is a
    :class:`CheckpointError`.

    On S3 (an ``s3://`` root) a checkpoint counts by the same check as :func:`latest`'s, and
    is deleted manifest first, only the manifest that was read (``If-Match``), then the
    objects it names (:meth:`~muonckpt.storage.s3store.S3Store.remove_checkpoint`).

    Returns the checkpoints deleted entirely, oldest first.
    """
    check_keep_last(keep_last)
    keep, where = location(keep), location(root)
    try:
        found = complete_checkpoints(where, store)
    except CheckpointError as exc:
        warnings.warn(f"old checkpoints not deleted: {exc}", CheckpointWarning, stacklevel=2)
        return []
    kept = _identity(keep)
    new = next((f for f in found if _identity(f.path) == kept), None)
    series = series_of(keep.name, new.step) if new is not None else "it is not complete"
    if isinstance(series, str):
        warnings.warn(
            f"keep_last: no old checkpoint deleted beside {keep}: {series}, so which "
            "checkpoints are of its run cannot be told (keep_last deletes only those whose "
            "names differ from the new one's in its step alone)",
            CheckpointWarning,
            stacklevel=2,
        )
        return []
    found = [f for f in found if series.holds(f)]
    deleted = []
    for old in found[:-keep_last]:
        if _identity(old.path) == kept:
            continue
        if isinstance(old.path, Path) and storage.ownership_problem(old.path):
            continue
        try:
            gone = store.remove_checkpoint(target(old.path))
        except CheckpointError as exc:  # (S3: a request that failed; POSIX warns itself)
            warnings.warn(f"{old.path} not deleted: {exc}", CheckpointWarning, stacklevel=2)
            continue
        if gone:
            deleted.append(old.path)
    return deleted


def _identity(where: Location) -> str:
    """What tells two checkpoints apart: a local one's real path, an S3 one's URL."""
    return os.path.realpath(where) if isinstance(where, Path) else str(where)


@dataclass(frozen=True)
class Cleaned:
    """What :func:`clean` did under a root."""

    removed: list[Location]
    """The directories removed entirely (on S3: the save prefixes)."""
    skipped: list[tuple[Location, str]]
    """Every other directory named like muonckpt's, with why it was kept (whole, or in part)."""


@logged("clean")
def clean(root: str | os.PathLike[str], older_than: float) -> Cleaned:
    """Remove what interrupted saves left directly under ``root``, only what muonckpt made and
    no save uses: directories named like its own (``.NAME.staging-XXXXXXXX``,
    ``.NAME.old-PID``, the mailbox ``.NAME.steps-XXXXXXXX`` of earlier versions) that

    * hold muonckpt's lease file (:mod:`muonckpt.storage.lease`), which it writes first thing
      into every directory it makes: a look-alike name alone is never enough;
    * are not in use: a save in progress holds the lease locked (and, for a clean on another
      host of a shared filesystem, renews it every few seconds), whatever ``older_than`` says;
    * and have not changed (their lease included) for more than ``older_than`` seconds.

    Only their checkpoint files, messages and lease are deleted (in the staging directory of
    a conversion to a foreign format, whose lease names it, that format's files instead),
    nothing through a symlink, nothing else: a directory holding anything else keeps it.
    While it deletes, this holds the lease locked.

    On S3 (an ``s3://`` root) what interrupted saves leave is a save prefix
    ``<root>/<checkpoint>/s-<16 hex>/`` that no committed manifest names: it is removed (its
    objects, and its multipart uploads aborted) when its lease object is absent or was not
    renewed for two minutes (a running save renews it every 10 s) and nothing under it
    changed for more than ``older_than`` seconds
    (:meth:`~muonckpt.storage.s3store.S3Store.leftovers`); nothing else is deleted.

    Returns what was removed, and every other directory named like muonckpt's with why it
    was kept. A ``root`` that cannot be listed is a :class:`CheckpointError`; a negative
    ``older_than`` an :class:`ArgumentError`.
    """
    number = isinstance(older_than, (int, float)) and not isinstance(older_than, bool)
    if not (number and older_than >= 0):  # (NaN fails it)
        raise ArgumentError(
            f"older_than must be a number of seconds >= 0, got {older_than!r}",
            argument="older_than",
        )
    where = location(root)
    if isinstance(where, S3Url):
        gone, left = S3Store().leftovers(str(where), older_than)
        return Cleaned(list(gone), list(left))
    store, root = storage.store_for(where), where
    removed: list[Location] = []
    skipped: list[tuple[Location, str]] = []
    for name in filter(storage.is_ours, store.directories(root)):
        path = root / name
        with storage.leftover(path) as found:
            why = found.kept_because
            age = time.time() - found.changed
            if why is None and age <= older_than:
                why = f"changed {age:.0f} s ago, not older than {older_than:g} s"
            if why is None:
                if storage.is_mailbox(name):
                    kept = storage.remove_mailbox(path)
                else:
                    kept = store.discard(path, quiet=True)
                if not access.lexists(path):
                    removed.append(path)
                    continue
                why = f"kept in part: it holds {', '.join(kept) or 'what appeared meanwhile'}"
        skipped.append((path, why))
    return Cleaned(removed, skipped)
