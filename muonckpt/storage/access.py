"""The file system as the layers above see it: whether a path is there and what it is, a
directory's names, a new file to write into, a file renamed or removed, directories made, a
temporary directory.

Every module outside ``storage/`` reaches files through these and the other storage
functions (``tests/test_file_access.py`` holds them to it), so that a foreign format's folder
parses what it is handed and an object store can stand behind it later.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .durable import failing_as, replace_durably

__all__ = [
    "exists",
    "is_dir",
    "is_file",
    "is_symlink",
    "lexists",
    "list_names",
    "make_directories",
    "modified_ns",
    "new_file",
    "remove",
    "rename",
    "temporary_directory",
    "tree_size",
]


def exists(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is there (through a symlink: a dangling one is not)."""
    return os.path.exists(path)


def lexists(path: str | os.PathLike[str]) -> bool:
    """Whether an entry of any kind is at ``path`` (a dangling symlink too)."""
    return os.path.lexists(path)


def is_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file (through a symlink)."""
    return os.path.isfile(path)


def is_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory (through a symlink)."""
    return os.path.isdir(path)


def modified_ns(path: str | os.PathLike[str]) -> int:
    """When ``path`` last changed, in nanoseconds (an ``OSError`` when it cannot be told)."""
    return os.stat(path).st_mtime_ns


def is_symlink(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a symlink."""
    return os.path.islink(path)


def list_names(directory: str | os.PathLike[str]) -> list[str]:
    """The names in ``directory``, sorted; ``OSError`` as the system raises it."""
    return sorted(os.listdir(directory))


def tree_size(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """The regular files under ``directory`` (not through symlinks): how many, and their bytes."""
    files = size = 0
    for folder, _, names in os.walk(directory):
        for name in names:
            info = os.lstat(os.path.join(folder, name))
            if stat.S_ISREG(info.st_mode):
                files, size = files + 1, size + info.st_size
    return files, size


@contextmanager
def new_file(path: str | os.PathLike[str], *, sync: bool = True) -> Iterator[IO[bytes]]:
    """The new file ``path`` (never an existing one, nor through a symlink), open for writing
    in binary; flushed and fsynced when the block ends (``sync``: else the writer fsyncs it, as
    torch's DCP writer does before it closes the file). A failure of the system is a
    :class:`~muonckpt.errors.CheckpointError` naming the path."""
    with failing_as("write", path):  # a full disk: torch's zip writer raises over the OSError
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o666)  # as open() makes a file: the umask decides
        with os.fdopen(fd, "wb") as f:
            yield f
            if sync:
                f.flush()
                os.fsync(f.fileno())


def rename(path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
    """Rename ``path`` to ``new_path`` (replacing a file there) and make it durable."""
    replace_durably(Path(path), Path(new_path))


def remove(path: str | os.PathLike[str]) -> None:
    """Remove the file ``path``; ``OSError`` as the system raises it."""
    os.unlink(path)


def make_directories(path: str | os.PathLike[str]) -> Path:
    """The directory ``path``, made with its parents where missing."""
    os.makedirs(path, exist_ok=True)
    return Path(path)


@contextmanager
def temporary_directory(prefix: str) -> Iterator[Path]:
    """A new temporary directory, removed with what it holds when the block ends."""
    with tempfile.TemporaryDirectory(prefix=prefix) as name:
        yield Path(name)
