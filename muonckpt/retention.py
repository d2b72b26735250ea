"""The checkpoints under a directory: the newest complete one, and deleting older ones.

For jobs that are preempted and resumed: :func:`latest` names the checkpoint to resume from,
:func:`prune` bounds the disk a run's checkpoints take. Both look only at the directories
directly under the root, and count only complete checkpoints: a directory (not a symlink,
not a staging name of ours) whose manifest parses and whose every listed file is there at its
size (:func:`muonckpt.pieces.size_problems`; no checksums are read). Anything else (a save
still in progress or interrupted, a half-deleted checkpoint, a damaged one, the user's own
files and directories) is skipped, never an error.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import settings, storage
from .errors import CheckpointError, CheckpointWarning
from .manifest import MANIFEST_NAME
from .pieces import read_manifest, size_problems


@dataclass(frozen=True)
class Found:
    """A complete checkpoint under a root, with what orders it among the others."""

    path: Path
    step: int | None
    committed_ns: int
    """The manifest's mtime: a save writes its manifest last, at the commit."""

    def order(self) -> tuple[bool, int, int, str]:
        """Sort key, oldest first: by step (none before any), then commit time, then name (so
        that the order is total)."""
        return (self.step is not None, self.step or 0, self.committed_ns, self.path.name)


def _complete(directory: Path) -> Found | None:
    """``directory`` as a complete checkpoint; None when it is not one (or is damaged)."""
    try:
        committed = (directory / MANIFEST_NAME).stat().st_mtime_ns
        manifest = read_manifest(directory)  # refuses staging names and missing manifests
        if size_problems(manifest, directory):
            return None
    except (CheckpointError, OSError):
        return None
    return Found(directory, manifest.step, committed)


def complete_checkpoints(root: str | os.PathLike[str]) -> list[Found]:
    """The complete checkpoints directly under ``root``, oldest first; symlinks are skipped
    (a ``latest -> step-300`` link would list one checkpoint twice). A missing ``root`` has
    none; one that is not a directory or cannot be listed is a :class:`CheckpointError`."""
    root = Path(root)
    try:
        with os.scandir(root) as listing:
            names = sorted(e.name for e in listing if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise CheckpointError("is not a directory of checkpoints", path=root) from None
    except OSError as exc:
        raise CheckpointError(f"cannot be listed: {exc.strerror}", path=root) from None
    found = [_complete(root / name) for name in names]
    return sorted((f for f in found if f is not None), key=Found.order)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directly under ``root``, to resume from; None when there
    is none, also when ``root`` does not exist yet (a job's first start).

    Newest by the step the manifest records (a checkpoint without one counts as older than any
    with one), then by commit time. Only a cheap check is made (the manifest parses, every
    file it lists is there at its size); no checksums. Staging directories, directories
    without a manifest, symlinks, damaged checkpoints and anything not a checkpoint are
    skipped. A ``root`` that is not a directory, cannot be listed or is a checkpoint itself
    (``latest("ckpt/step-30")`` where ``latest("ckpt")`` was meant) is a
    :class:`CheckpointError`. When a save commits and prunes while it looks, so that it found
    nothing complete, it looks again (three times in all).
    """
    root = settings.local_path(root)
    if (root / MANIFEST_NAME).exists():
        raise CheckpointError(
            "is a checkpoint itself; latest looks for checkpoints directly under a directory "
            "(pass its parent)",
            path=root,
        )
    for _ in range(3):  # a save committing and pruning meanwhile can hide every entry once
        found = complete_checkpoints(root)
        if found:
            return found[-1].path
    return None


def check_keep_last(keep_last: object) -> None:
    """Raise :class:`CheckpointError` unless ``keep_last`` is an int of at least 1 (a save
    checks it before writing anything)."""
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise CheckpointError(
            f"keep_last must be an int of at least 1 (the checkpoints to keep), got {keep_last!r}"
        )


def _series(name: str) -> re.Pattern[str]:
    """The names of ``name``'s series: ``name`` with any digits where it has digits."""
    return re.compile(r"\d+".join(re.escape(part) for part in re.split(r"\d+", name)))


def prune(root: str | os.PathLike[str], keep_last: int, keep: str | os.PathLike[str]) -> list[Path]:
    """Delete the complete checkpoints directly under ``root`` older than its ``keep_last``
    newest (in :func:`latest`'s order); for a save's ``keep_last``, after its commit.

    Only ``keep``'s series counts: the checkpoints whose names are ``keep``'s with other
    numbers (``step-10`` and ``step-20`` beside ``step-30``; ``final`` has no other), so that
    checkpoints of other runs or models under the same root are never deleted. Never deleted
    either: ``keep`` (the checkpoint just written, kept even when a run restarted at a lower
    step makes it older than the newest), anything :func:`complete_checkpoints` does not
    count (staging directories, saves in progress, what is not a checkpoint, symlinks), and a
    checkpoint holding files of the user's (:func:`muonckpt.storage.ownership_problem`): it is
    left whole. So at most ``keep_last`` checkpoints remain besides those two kinds.

    Each is deleted manifest first (:func:`muonckpt.storage.remove_checkpoint`), so a crash
    leaves it incomplete, never something :func:`latest` picks. A failure (a file that cannot
    be deleted, a root that cannot be listed) is a :class:`CheckpointWarning`: the new
    checkpoint is committed whatever happens here. ``keep_last`` below 1 is a
    :class:`CheckpointError`.

    Returns the checkpoints deleted entirely, oldest first.
    """
    check_keep_last(keep_last)
    try:
        found = complete_checkpoints(root)
    except CheckpointError as exc:
        warnings.warn(f"old checkpoints not deleted: {exc}", CheckpointWarning, stacklevel=2)
        return []
    series = _series(Path(keep).name)
    found = [f for f in found if series.fullmatch(f.path.name)]
    kept = os.path.realpath(keep)
    deleted = []
    for old in found[:-keep_last]:
        if os.path.realpath(old.path) == kept or storage.ownership_problem(old.path):
            continue
        if storage.remove_checkpoint(old.path):
            deleted.append(old.path)
    return deleted


def clean(root: str | os.PathLike[str], older_than: float) -> list[Path]:
    """Remove what interrupted saves left directly under ``root``: muonckpt's own staging
    directories (``.NAME.staging-XXXXXXXX``, ``.NAME.old-PID``) and background-save
    mailboxes (``.NAME.steps-XXXXXXXX``) last changed more than ``older_than`` seconds ago (a
    save still running changes them; choose longer than your longest save). Only their
    checkpoint files and messages are deleted, nothing through a symlink, nothing else: a
    directory holding anything else keeps it (and a :class:`CheckpointWarning` names it).

    Returns the directories removed entirely. A ``root`` that cannot be listed is a
    :class:`CheckpointError`; a negative ``older_than`` too.
    """
    if not older_than >= 0:
        raise CheckpointError(f"older_than must be a number of seconds >= 0, got {older_than!r}")
    root = settings.local_path(root)
    try:
        with os.scandir(root) as listing:
            entries = sorted(
                (e for e in listing if storage.is_ours(e.name) and e.is_dir(follow_symlinks=False)),
                key=lambda e: e.name,
            )
            ages = {e.name: time.time() - e.stat(follow_symlinks=False).st_mtime for e in entries}
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(f"cannot be listed: {exc.strerror}", path=root) from None
    removed = []
    for entry in entries:
        if ages[entry.name] <= older_than:
            continue
        path = root / entry.name
        if storage.is_mailbox(entry.name):
            storage.Mailbox(path).remove()
        else:
            storage.discard(path)
        if not os.path.lexists(path):
            removed.append(path)
    return removed
