"""The directory transaction: a checkpoint is written into a staging directory beside its
target and swapped in atomically, what it replaced retired; what may be replaced or deleted
(only muonckpt's own checkpoints and their files) is :mod:`.ownership`'s to say."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from ..errors import CheckpointError, CheckpointWarning
from ..format.names import MANIFEST_NAME
from . import lease, outputs
from .durable import RENAME_NOREPLACE, exchange, failing_as, fsync_dir, renameat2
from .ownership import STAGING_TAG, check_target, is_checkpoint_file, ownership_problem, shown

_INTENT: dict[str, bool] = {}
"""Staging directory -> its make_staging's ``overwrite``, for a swap_in not told."""


def staging_path(final: str | os.PathLike[str], token: str) -> Path:
    """The staging directory ``.NAME.staging-TOKEN`` of ``final``."""
    final = Path(final)
    return final.parent / f".{final.name}.{STAGING_TAG}-{token}"


def make_staging(
    final: str | os.PathLike[str],
    overwrite: bool,
    *,
    source: str | os.PathLike[str] | None = None,
    output: str | None = None,
) -> Path:
    """A fresh ``.NAME.staging-XXXXXXXX`` directory beside ``final``, holding only its lease
    (:mod:`.lease`), which this process holds until :func:`swap_in` or :func:`discard`; for
    the files of foreign format ``output`` (:data:`.outputs.OUTPUTS`), recorded in the lease.

    :func:`check_target` first (nothing is created when it refuses), then the missing parents
    and the staging directory itself.
    """
    final = Path(final)
    with failing_as("create the staging directory", final):  # a stat of check_target's too
        check_target(final, overwrite, source=source, output=output)
        staging = staging_path(final, uuid.uuid4().hex[:8])
        final.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    try:
        lease.take(staging, "staging", output)
    except BaseException:
        with contextlib.suppress(OSError):
            staging.rmdir()
        raise
    _INTENT[str(staging)] = overwrite
    return staging


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)


def _remove_ours(directory: Path, names: Sequence[str] | None = None) -> list[str]:
    """Delete the checkpoint files (``names``, or all) in ``directory``, then, without
    ``names``, the directory if that left it empty. Nothing else is ever deleted: no other
    file, no subdirectory, nothing through a symlink; the lease file last, so that what a
    crash leaves is still recognisably ours. Returns what could not be deleted, as
    ``"NAME (why)"``."""
    left = []
    try:
        listed = sorted(os.listdir(directory) if names is None else names, key=lease.deletion_order)
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [f"{directory} ({exc.strerror})"]
    for name in listed:
        path = directory / name
        if not is_checkpoint_file(name) or os.sep in name or path.is_symlink():
            if os.path.lexists(path):
                left.append(f"{name} (not a checkpoint file: kept)")
            continue
        try:
            if path.is_dir():
                left.append(f"{name} (a directory: kept)")
                continue
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            left.append(f"{name} ({exc.strerror})")
    if names is None and not left:
        try:
            directory.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            left.append(f"the directory itself ({exc.strerror})")
    return left


def discard(staging: str | os.PathLike[str], *, quiet: bool = False) -> list[str]:
    """Remove a staging directory that will never be committed, and stop holding its lease
    (its checkpoint files, or the files of the foreign format its lease records
    (:func:`.outputs.remove_written`), and the lease only; anything else found there is kept
    and, unless ``quiet``, named in a :class:`CheckpointWarning`). Returns what is kept, as
    ``"NAME (why)"``."""
    staging = Path(staging)
    _INTENT.pop(str(staging), None)
    if staging.is_symlink():  # never ours: staging directories are made by mkdir
        if not quiet:
            _warn(f"{staging} is a symlink, not a staging directory; left alone")
        return ["the symlink itself"]
    output = outputs.OUTPUTS.get(lease.recorded_output(staging) or "")
    try:
        if output is not None:
            left = outputs.remove_written(staging, output)
        else:
            left = _remove_ours(staging)
    finally:
        lease.release(staging)
    if left and not quiet:
        _warn(f"could not remove the staging directory {staging} entirely: {shown(left)}")
    return left


def retire(directory: str | os.PathLike[str], files: Sequence[str] | None = None) -> None:
    """Delete a checkpoint that :func:`swap_in` replaced (only its checkpoint files, never
    anything else in it).

    With ``files``, only those entries (so several ranks can share the work); without, all
    of them and then the directory. What cannot be deleted is named in a
    :class:`CheckpointWarning`: the new checkpoint is in place whatever happens here, and what
    is left is recognisably incomplete, since swap_in removed its manifest first.
    """
    directory = Path(directory)
    if directory.is_symlink():
        _warn(f"{directory} is a symlink, not a replaced checkpoint; left alone")
        return
    left = _remove_ours(directory, files)
    if files is None:
        lease.release(directory)
    if left:
        _warn(
            f"the new checkpoint is in place, but the one it replaced could not be deleted "
            f"entirely: {directory} still holds {shown(left)}"
        )


def _delete_manifest(directory: Path, what: str) -> bool:
    """Delete ``directory``'s manifest, the first step of deleting a checkpoint (what a crash
    leaves then reads as incomplete); False, with a warning that begins with ``what``, when it
    cannot be deleted (the checkpoint is then left whole)."""
    try:
        (directory / MANIFEST_NAME).unlink(missing_ok=True)
    except OSError as exc:
        _warn(f"{what}: its {MANIFEST_NAME} cannot be deleted ({exc.strerror}); it is left whole")
        return False
    return True


def remove_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Delete the committed checkpoint at ``directory`` (an old one a save's ``keep_last`` no
    longer keeps), crash-safe: its manifest first, so that whatever a crash leaves reads as
    incomplete, then its other checkpoint files and the directory, as :func:`retire` does
    (never anything else in it, never through a symlink).

    Returns whether it is gone entirely. What is left is named in a
    :class:`CheckpointWarning`: the manifest could not be deleted (the checkpoint is left
    whole), or other files could not (it is left incomplete).
    """
    directory = Path(directory)
    if directory.is_symlink():
        _warn(f"{directory} is a symlink, not a checkpoint directory; left alone")
        return False
    if not _delete_manifest(directory, f"cannot delete the old checkpoint {directory}"):
        return False
    left = _remove_ours(directory)
    if left:
        _warn(
            f"the old checkpoint {directory} was deleted only in part (its manifest is gone, so "
            f"it reads as incomplete): it still holds {shown(left)}"
        )
    return not left


_COMMIT_LOCK = threading.Lock()
"""Held by a :func:`swap_in` from its checks to its rename: one commit of this process at a
time."""


_COMMIT_WATCHERS: dict[str, list[tuple[str | None, Callable[[], None]]]] = {}
"""Target (absolute) -> (staging directory (absolute) or None, what to call) (see
watch_commit)."""
_WATCHERS_LOCK = threading.Lock()
"""Guards :data:`_COMMIT_WATCHERS`: two saves of one process to one path (in two threads)
watch and unwatch it at once."""


def watch_commit(
    final: str | os.PathLike[str],
    callback: Callable[[], None],
    *,
    staging: str | os.PathLike[str] | None,
) -> None:
    """Call ``callback()`` the moment a :func:`swap_in` of this process commits ``final`` from
    ``staging`` (another save of this process to the same path, committed first, is not this
    one's commit; None: any commit of ``final``, for a test's hook): right after the rename,
    inside the commit lock, before anything that could be interrupted. Whoever reports the
    outcome then knows a checkpoint was committed even if the process is interrupted or killed
    a moment later (it must never say "error" over a whole new one)."""
    with _WATCHERS_LOCK:
        watchers = _COMMIT_WATCHERS.setdefault(os.path.abspath(final), [])
        watchers.append((None if staging is None else os.path.abspath(staging), callback))


def unwatch_commit(final: str | os.PathLike[str], callback: Callable[[], None]) -> None:
    """Undo :func:`watch_commit` (a no-op when ``callback`` is not watching ``final``)."""
    key = os.path.abspath(final)
    with _WATCHERS_LOCK:
        watchers = [each for each in _COMMIT_WATCHERS.get(key, []) if each[1] is not callback]
        if watchers:
            _COMMIT_WATCHERS[key] = watchers
        else:
            _COMMIT_WATCHERS.pop(key, None)


def _watchers_of(final: Path, staging: Path) -> list[Callable[[], None]]:
    """The callbacks watching the commit of ``final`` from ``staging``."""
    mine = os.path.abspath(staging)
    with _WATCHERS_LOCK:
        watching = list(_COMMIT_WATCHERS.get(os.path.abspath(final), []))
    return [callback for watched, callback in watching if watched in (None, mine)]


def directory_identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the directory at ``path`` (a symlink is not followed), or None
    when there is none: what :func:`committed_as` compares."""
    try:
        found = os.lstat(path)
    except OSError:
        return None
    return (found.st_dev, found.st_ino) if stat.S_ISDIR(found.st_mode) else None


def committed_as(final: str | os.PathLike[str], staging: tuple[int, int] | None) -> bool:
    """Whether the staging directory whose :func:`directory_identity` was ``staging`` is now
    committed at ``final`` (a rename keeps the inode), its manifest in place: how a rank that
    did not perform the swap learns it happened when the one that did died a moment later."""
    return (
        staging is not None
        and directory_identity(final) == staging
        and os.path.isfile(Path(final) / MANIFEST_NAME)
    )


@contextlib.contextmanager
def watching(
    final: str | os.PathLike[str], staging: str | os.PathLike[str]
) -> Iterator[Callable[[], bool]]:
    """While in it, whether the save staged in ``staging`` is committed at ``final``: the
    commit of this process's :func:`swap_in` seen (:func:`watch_commit`), or the staging
    directory found at ``final`` with its manifest (:func:`committed_as`: another rank's swap,
    whose process died before it could tell)."""
    committed: list[bool] = []

    def mark() -> None:
        committed.append(True)

    watch_commit(final, mark, staging=staging)
    staged = directory_identity(staging)  # another rank's swap keeps it: committed_as
    try:
        yield lambda: bool(committed) or committed_as(final, staged)
    finally:
        unwatch_commit(final, mark)


def swap_in(
    staging: str | os.PathLike[str],
    final: str | os.PathLike[str],
    *,
    overwrite: bool | None = None,
    files: Mapping[str, int] | None = None,
) -> Path | None:
    """Make directory ``staging`` appear at ``final`` atomically.

    Right before the rename, under the commit lock, what is about to be published is checked:
    the staging directory's lease (:mod:`.lease`) is still the one this process took, and each
    of ``files`` (name -> size: every file the manifest lists, and the manifest) is a regular
    file of that size there; otherwise nothing is committed (a :class:`CheckpointError`: the
    directory was changed by another process, a ``clean`` that could not see the save's lease
    on a shared filesystem, say). Then the lease file is deleted, so that it is not published.

    Without ``overwrite`` the rename never replaces anything (``renameat2(RENAME_NOREPLACE)``):
    when another writer created ``final`` meanwhile, this raises and ``final`` keeps theirs.
    With it, an existing ``final`` (a muonckpt checkpoint, checked again here) is exchanged
    with ``staging`` in one step where the kernel allows it, so a crash at any moment leaves
    either the old or the new checkpoint at ``final``; a symlink at ``final`` is replaced by
    the directory and deleted, its target left untouched. ``overwrite=None`` takes the value
    :func:`make_staging` was given for ``staging`` (True for a directory it did not make).

    Returns the directory now holding the replaced checkpoint, its manifest already deleted so
    that it reads as incomplete, for the caller to :func:`retire`; None when nothing was
    replaced (or only a symlink). Raises :class:`CheckpointError` only when nothing was
    committed; a failure after the commit (deleting the old manifest, the final directory
    fsync) is a :class:`CheckpointWarning`.
    """
    staging, final = Path(staging), Path(final)
    if overwrite is None:
        overwrite = _INTENT.get(str(staging), True)
    with _COMMIT_LOCK:
        problem = lease.problem(staging) or _publish_problem(staging, files or {})
        if problem:
            raise CheckpointError(
                f"not committed: the staging directory {staging} was changed by another process "
                f"while this save ran ({problem}); the checkpoint at the path is as it was",
                path=final,
            )
        held, output = lease.holds(staging), lease.recorded_output(staging)
        lease.give_up(staging)
        try:
            replaced = _commit_rename(staging, final, overwrite)
        except BaseException:
            if held:  # still ours, to be discarded: marked again, in case that is cut short
                with contextlib.suppress(CheckpointError):
                    lease.take(staging, "staging", output)
            raise
        lease.release(staging)
        for callback in _watchers_of(final, staging):
            callback()
    _INTENT.pop(str(staging), None)
    return _after_commit(final, replaced)


def _after_commit(final: Path, replaced: Path | None) -> Path | None:
    """What follows the commit of :func:`swap_in`, which replaced ``replaced`` (None:
    nothing): the replaced checkpoint marked as ours and its manifest deleted (a replaced
    symlink deleted instead), then ``final``'s parent fsynced, each failure a warning. Returns
    the replaced directory, for :func:`retire`, or None."""
    if replaced is not None and not replaced.is_symlink():
        with contextlib.suppress(CheckpointError):  # without it, retire still deletes it
            lease.take(replaced, "replaced")
    if replaced is not None:
        if replaced.is_symlink():
            try:
                replaced.unlink()
            except OSError as exc:
                _warn(f"committed {final}, but cannot delete the replaced symlink: {exc}")
            replaced = None
        elif not _delete_manifest(replaced, f"committed {final}, but the replaced one {replaced}"):
            replaced = None
    try:
        fsync_dir(final.parent)
    except CheckpointError as exc:
        _warn(f"committed {final}, but {exc}")
    return replaced


def _publish_problem(staging: Path, files: Mapping[str, int]) -> str | None:
    """What is wrong with ``files`` (name -> size) in ``staging``: one missing, not a regular
    file, or of another size; None when nothing is."""
    for name, size in files.items():
        try:
            found = os.lstat(staging / name)
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as exc:
            return f"{name} cannot be checked ({exc.strerror})"
        if not stat.S_ISREG(found.st_mode):
            return f"{name} is not a regular file"
        if found.st_size != size:
            return f"{name} is {found.st_size} bytes, not {size}"
    return None


def _commit_rename(staging: Path, final: Path, overwrite: bool) -> Path | None:
    """The rename of :func:`swap_in`; returns where the replaced entry went, if any."""
    for _ in range(100):  # only a writer racing us, deleting and recreating final, loops
        try:
            if renameat2(staging, final, RENAME_NOREPLACE):
                return None
            if not os.path.lexists(final):  # no renameat2 here: check, then rename
                os.rename(staging, final)
                return None
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise CheckpointError(f"cannot commit the checkpoint: {exc}", path=final) from None
        _check_replaceable(final, overwrite)
        try:
            return _replace(staging, final)
        except FileNotFoundError:
            continue  # final vanished between the two steps: try the plain rename again
        except OSError as exc:
            raise CheckpointError(f"cannot commit the checkpoint: {exc}", path=final) from None
    raise CheckpointError("cannot commit: the target keeps changing", path=final)


def _check_replaceable(final: Path, overwrite: bool) -> None:
    """Raise :class:`CheckpointError` unless ``final``, found in the way of
    :func:`_commit_rename`, may be replaced: ``overwrite``, and a muonckpt checkpoint (or a
    symlink to one)."""
    if not overwrite:
        raise CheckpointError(
            "was created by another writer while this save ran; this save is discarded "
            "(pass overwrite=True to replace it)",
            path=final,
        )
    if final.is_symlink():
        if not final.exists():
            raise CheckpointError("became a dangling symlink while this save ran", path=final)
        problem = ownership_problem(final.resolve())
    else:
        problem = ownership_problem(final)
    if problem:
        raise CheckpointError(
            f"changed while this save ran and {problem}; not replaced", path=final
        )


def _replace(staging: Path, final: Path) -> Path | None:
    """``staging`` put at ``final`` in place of what is there: one exchange where the kernel
    has it, else two renames (the first undone when the second fails); returns where the
    replaced entry went."""
    if exchange(staging, final):
        return _checked_replaced(staging, final)
    replaced = final.with_name(f".{final.name}.old-{os.getpid()}")
    os.rename(final, replaced)
    try:
        os.rename(staging, final)
    except OSError:
        os.rename(replaced, final)
        raise
    return replaced


def _checked_replaced(staging: Path, final: Path) -> Path | None:
    """After an exchange: what came out of ``final`` (now at ``staging``) must be a checkpoint
    of ours or a symlink, or it goes straight back and nothing is committed."""
    if staging.is_symlink():
        return staging
    problem = ownership_problem(staging)
    if problem is None:
        return staging
    try:
        exchange(staging, final)
    except OSError as exc:
        _warn(f"{final} was replaced while it changed; what was there is now at {staging}: {exc}")
        return None
    raise CheckpointError(f"changed while this save ran and {problem}; not replaced", path=final)
