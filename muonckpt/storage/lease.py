"""The lease file: what marks a directory beside a target as muonckpt's own, and as in use.

Every directory muonckpt makes beside a target (a staging directory; earlier versions also
the mailbox of a background save) and every replaced checkpoint it renames aside gets a lease
file, ``.muonckpt-lease``, written first thing (JSON: what the directory is, a random token, the
host, pid and time of its making). ``clean`` removes only directories holding one, so a
directory a user made with a look-alike name is never touched; and only those nobody uses:

* the process that made the directory holds an exclusive ``flock`` on its lease file until it
  is done with it (a lock the kernel drops when the process dies, however it dies);
* and refreshes the file's mtime every :data:`HEARTBEAT_S` seconds, a heartbeat for a
  ``clean`` on another host of a shared filesystem where locks may not reach (NFS mounted
  ``nolock``, Lustre without ``flock``): there a lease renewed within :data:`LEASE_S` seconds
  is in use, whatever the lock says.

The lease is locked before it takes its name (a temporary name, locked, then renamed), so a
``clean`` never finds it unlocked while its maker lives. Several ranks on several hosts may
write into one staging directory; the root, which made it and commits it, holds its lease.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..format.manifest import FORMAT_NAME
from .durable import failure

LEASE_NAME = ".muonckpt-lease"
LEASE_FILE = re.compile(rf"^{re.escape(LEASE_NAME)}(\.tmp-\d+)?$")
"""The lease file's name, and its temporary's before the rename."""
HEARTBEAT_S = 10.0
"""How often a held lease's mtime is refreshed."""
LEASE_S = 120.0
"""A lease whose mtime is this recent is in use, lock or no lock, when its maker's host is
another, or locks are not to be had here (a dozen heartbeats missed, clocks a minute apart)."""
_LOCK_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF}
_MAX_LEASE_BYTES = 4096

_HELD: dict[str, int] = {}
"""Directory (absolute) -> the descriptor of its lease file, locked, of those this process
holds."""
_GUARD = threading.Lock()
_BEATING: list[threading.Thread] = []


def deletion_order(name: str) -> tuple[bool, str]:
    """Sort key of the names in a directory being deleted: the lease after every other name,
    so that what a deletion cut short leaves is still recognisably muonckpt's."""
    return (LEASE_FILE.match(name) is not None, name)


def _key(directory: str | os.PathLike[str]) -> str:
    return os.path.abspath(directory)


def take(directory: str | os.PathLike[str], what: str, output: str | None = None) -> None:
    """(the process that made ``directory``) Write its lease, locked, and hold it (heartbeat
    included) until :func:`release`; ``output``, the foreign format written into it (see
    :func:`recorded_output`). A :class:`~muonckpt.errors.CheckpointError` when it cannot be
    written."""
    directory = Path(directory)
    tmp = directory / f"{LEASE_NAME}.tmp-{os.getpid()}"
    record: dict[str, object] = {
        FORMAT_NAME: what,
        "token": uuid.uuid4().hex,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "created": time.time(),
    }
    if output is not None:
        record["output"] = output
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(tmp, flags, 0o644)
    except OSError as exc:
        raise failure("write its lease", exc, directory) from None
    try:
        _try_lock(fd)  # a fresh file: nobody else has it open
        os.write(fd, json.dumps(record).encode())
        os.rename(tmp, directory / LEASE_NAME)
    except OSError as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise failure("write its lease", exc, directory) from None
    with _GUARD:
        previous = _HELD.pop(_key(directory), None)
        _HELD[_key(directory)] = fd
        if not _BEATING or not _BEATING[0].is_alive():
            _BEATING[:] = [threading.Thread(target=_beat, name="muonckpt lease", daemon=True)]
            _BEATING[0].start()
    if previous is not None:
        os.close(previous)


def _try_lock(fd: int) -> bool | None:
    """Lock ``fd`` exclusively, without waiting: True; False when another process holds it;
    None where this filesystem has no locks (the heartbeat then stands alone)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if exc.errno in _LOCK_UNSUPPORTED:
            return None
        raise
    return True


def _beat() -> None:
    """Refresh the mtime of every lease this process holds, every :data:`HEARTBEAT_S`; ends
    when it holds none."""
    while True:
        time.sleep(HEARTBEAT_S)
        with _GUARD:
            if not _HELD:
                _BEATING.clear()
                return
            for fd in _HELD.values():
                with contextlib.suppress(OSError):
                    os.utime(fd)


def recorded_output(directory: str | os.PathLike[str]) -> str | None:
    """The foreign format whose files ``directory`` was made for, as its lease records it
    (:func:`take`'s ``output``); None for a muonckpt checkpoint's, or when there is no lease
    muonckpt wrote."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(Path(directory) / LEASE_NAME, flags)
    except OSError:
        return None
    try:
        record = json.loads(os.read(fd, _MAX_LEASE_BYTES))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    output = record.get("output") if isinstance(record, dict) else None
    return output if isinstance(output, str) else None


def holds(directory: str | os.PathLike[str]) -> bool:
    """Whether this process holds ``directory``'s lease."""
    return _key(directory) in _HELD


def problem(directory: str | os.PathLike[str]) -> str | None:
    """(the holder) Why the lease this process holds on ``directory`` is no longer in place
    (removed or replaced by another process); None when it is, or this process holds none."""
    fd = _HELD.get(_key(directory))
    if fd is None:
        return None
    try:
        found = os.lstat(Path(directory) / LEASE_NAME)
        mine = os.fstat(fd)
    except OSError:
        return f"its {LEASE_NAME} is gone"
    if (found.st_dev, found.st_ino) != (mine.st_dev, mine.st_ino):
        return f"its {LEASE_NAME} was replaced"
    return None


def give_up(directory: str | os.PathLike[str]) -> None:
    """(the holder, right before the directory is published or renamed away) Delete the lease
    file; the lock stays held until :func:`release`."""
    if holds(directory):
        with contextlib.suppress(FileNotFoundError):
            (Path(directory) / LEASE_NAME).unlink()


def release(directory: str | os.PathLike[str]) -> None:
    """Stop holding ``directory``'s lease (the lock and the heartbeat); the file itself is
    left as it is (it goes with the directory's files). A no-op when not held."""
    with _GUARD:
        fd = _HELD.pop(_key(directory), None)
    if fd is not None:
        os.close(fd)


def _forget_in_child() -> None:
    """(a forked child) The parent's leases are the parent's: closing the child's copies of
    the descriptors keeps the parent's locks."""
    global _GUARD
    _GUARD = threading.Lock()
    for fd in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()
    _BEATING.clear()


os.register_at_fork(after_in_child=_forget_in_child)


@dataclass(frozen=True)
class Leftover:
    """What :func:`leftover` found in a directory: why it must be kept (None: it is
    muonckpt's and nobody uses it), and when it or its lease last changed."""

    kept_because: str | None
    changed: float


@contextlib.contextmanager
def leftover(directory: str | os.PathLike[str]) -> Iterator[Leftover]:
    """For ``clean``: whether ``directory`` is muonckpt's own and unused, and while this is
    open its lease stays locked by this process (so its maker cannot be alive meanwhile; a
    new save makes a new directory). Kept: no lease file (not muonckpt's: a look-alike name
    is not enough), a lease held by a live process, or one renewed within :data:`LEASE_S`
    seconds by another host (or where locks are not to be had)."""
    directory = Path(directory)
    path = directory / LEASE_NAME
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        changed = os.lstat(directory).st_mtime
        fd = os.open(path, flags)
    except OSError:
        yield Leftover(f"holds no {LEASE_NAME}, so muonckpt did not make it", 0.0)
        return
    try:
        yield _judge(fd, path, changed)
    finally:
        os.close(fd)


def _shown(value: object) -> str:
    """A lease field as ``clean`` prints it: a forged lease's newlines or terminal escapes
    must not make lines of their own."""
    text = str(value)
    return text if text.isprintable() and len(text) <= 255 else ascii(text[:255])


def _judge(fd: int, path: Path, changed: float) -> Leftover:
    """:func:`leftover` of a directory whose lease file ``path`` is open at ``fd``."""
    info = os.fstat(fd)
    record = None
    if stat.S_ISREG(info.st_mode) and info.st_size <= _MAX_LEASE_BYTES:
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(os.read(fd, _MAX_LEASE_BYTES))
    if not isinstance(record, dict) or not isinstance(record.get(FORMAT_NAME), str):
        return Leftover(f"its {LEASE_NAME} is not one muonckpt wrote", 0.0)
    changed = max(changed, info.st_mtime)
    maker = f"pid {_shown(record.get('pid'))} on {_shown(record.get('host'))}"
    try:
        locked = _try_lock(fd)
    except OSError as exc:
        return Leftover(f"its lease cannot be locked ({exc.strerror}): maybe in use", changed)
    if locked is False:
        return Leftover(f"in use: a running save holds its lease ({maker})", changed)
    # Its holder deletes the lease file before it lets go of the lock (to publish the
    # directory, or once done with it): a lock got on a file no longer there proves nothing.
    try:
        now = os.lstat(path)
    except OSError:
        now = None
    if now is None or (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
        return Leftover("in use: its lease was given up or renewed meanwhile", changed)
    renewed = time.time() - info.st_mtime
    if (locked is None or record.get("host") != socket.gethostname()) and renewed < LEASE_S:
        return Leftover(
            f"in use: its lease was renewed {renewed:.0f} s ago ({maker}; a lease of another "
            f"host, or without locks, is in use for {LEASE_S:g} s after its last renewal)",
            changed,
        )
    return Leftover(None, changed)
