"""File primitives: durable writes (fsync, atomic rename), positional write loops, small
reads, the libc calls Python lacks (``renameat2``, ``sync_file_range``), and the one mapping of
a system error to the library's one-line error that every writer uses (:func:`failing_as`)."""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CheckpointError
from .safetensors_format import MAX_HEADER_BYTES

_WRITE_BYTES = 1 << 20
"""Bytes per write call. On the benchmark VM, 1 GB written into the page cache in 32 MiB calls
took 0.35-3.7 s from run to run, in 1 MiB calls a steady 0.31-0.42 s."""


def system_error(exc: BaseException) -> OSError | None:
    """The system's error that ``exc`` is or was raised over, else None: torch's zip writer
    (``torch.save``) meets a full disk with a RuntimeError ("unexpected pos") raised while the
    OSError of its write is being handled."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, RuntimeError) and isinstance(exc.__context__, OSError):
        return exc.__context__
    return None


def failure(doing: str, exc: OSError, path: object, param: str | None = None) -> CheckpointError:
    """The one line for a file operation the system refused: ``cannot <doing>: <its reason>``
    (no space left on device, read-only file system, ...), naming the file the system names,
    else ``path``, and ``param`` if given."""
    return CheckpointError(
        f"cannot {doing}: {exc.strerror or exc}",
        path=exc.filename if exc.filename is not None else path,
        param=param,
    )


@contextmanager
def failing_as(doing: str, path: object) -> Iterator[None]:
    """Any OSError of the block (or a library's error over one, :func:`system_error`) raised
    as :func:`failure`'s :class:`CheckpointError`; every other exception goes on as it is."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        cause = system_error(exc)
        if cause is None:
            raise
        raise failure(doing, cause, path) from exc


def make_directory(path: str | os.PathLike[str]) -> Path:
    """Create the new directory ``path`` (its parent exists); :class:`CheckpointError` if the
    system refuses."""
    with failing_as("create", path):
        os.mkdir(path)
    return Path(path)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that a rename inside it survives a crash (no-op where unsupported)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if os.name == "nt":  # directories cannot be opened, nor need fsync, on Windows
            return
        raise failure("open directory for fsync", e, path) from e
    try:
        os.fsync(fd)
    except OSError as e:
        raise failure("fsync directory", e, path) from e
    finally:
        os.close(fd)


def temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def replace_durably(tmp: Path, path: Path) -> None:
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _utf8(text: str, path: Path) -> bytes:
    """``text`` as UTF-8, or a :class:`CheckpointError` naming ``path`` and the text around
    a lone surrogate, which UTF-8 cannot hold."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        around = exc.object[max(exc.start - 40, 0) : exc.end + 10]
        raise CheckpointError(f"cannot write {around!r}: not valid Unicode", path=path) from None


def write_text_atomic(
    path: str | os.PathLike[str], text: str | Iterable[str], *, limit: int | None = None
) -> int:
    """Write ``text`` (UTF-8: a str, or its consecutive pieces, each written as it comes) to
    ``path`` atomically: temp file, fsync, rename, fsync the dir. Returns its size in bytes;
    past ``limit`` bytes nothing is written (the rest is only counted) and ``path`` is left as
    it was."""
    path = Path(path)
    tmp = temporary_path(path)
    size = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in [text] if isinstance(text, str) else text:
                data = _utf8(chunk, path)
                size += len(data)
                if limit is None or size <= limit:
                    f.write(data)
            f.flush()
            if limit is None or size <= limit:
                os.fsync(f.fileno())
        if limit is not None and size > limit:
            remove_quietly(tmp)
            return size
        replace_durably(tmp, path)
    except BaseException as e:
        remove_quietly(tmp)
        if isinstance(e, OSError):
            raise failure("write", e, path) from e
        raise
    return size


SYNC_THREADS = 32
"""How many fsyncs :func:`sync_files` and :func:`write_texts_durably` keep in flight: on a
shared filesystem each waits on the server, so thousands in a row are thousands of round
trips; in parallel they overlap (the kernel and the server batch them)."""


def sync_files(directory: str | os.PathLike[str], names: Iterable[str]) -> None:
    """fsync every file ``names`` in ``directory``, :data:`SYNC_THREADS` at a time, then the
    directory once: what was written and renamed there without a sync of its own is then as
    durable as a file written by :func:`write_text_atomic` (the order of the fsyncs among the
    files does not matter; all are done before this returns, so before a commit)."""
    directory = Path(directory)

    def sync(name: str) -> None:
        try:
            fd = os.open(directory / name, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except OSError as exc:
            raise CheckpointError(
                f"cannot open for fsync: {exc.strerror}", path=directory / name
            ) from None
        try:
            os.fsync(fd)
        except OSError as exc:
            raise CheckpointError(f"cannot fsync: {exc.strerror}", path=directory / name) from exc
        finally:
            os.close(fd)

    listed = list(names)
    if len(listed) <= 1:
        for name in listed:
            sync(name)
    else:
        with ThreadPoolExecutor(min(SYNC_THREADS, len(listed))) as pool:
            for _ in pool.map(sync, listed):
                pass
    fsync_dir(directory)


def write_texts_durably(
    directory: str | os.PathLike[str], texts: Mapping[str, Iterable[str]], *, limit: int
) -> dict[str, tuple[int, str]]:
    """Write each text of ``texts`` (name -> its UTF-8 pieces) into ``directory``: every file
    written and renamed into place first, then all fsynced together (:func:`sync_files`), so
    that thousands of small files (the piece indexes of thousands of ranks) cost one pass of
    parallel fsyncs rather than one serial fsync each. Returns each file's size and XXH3-64
    (16 hex digits, as :func:`muonckpt.storage.checksums.chunk_digest` gives). A text past
    ``limit`` bytes is refused (:class:`CheckpointError` naming it) before anything is synced."""
    directory = Path(directory)
    written: dict[str, tuple[int, str]] = {}
    for name, chunks in texts.items():
        path = directory / name
        tmp = temporary_path(path)
        hasher, size = xxhash.xxh3_64(), 0
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    data = _utf8(chunk, path)
                    size += len(data)
                    if size > limit:
                        raise CheckpointError(
                            f"would be more than the {limit} bytes a reader accepts", path=path
                        )
                    hasher.update(data)
                    f.write(data)
            os.replace(tmp, path)
        except BaseException as e:
            remove_quietly(tmp)
            if isinstance(e, OSError):
                raise failure("write", e, path) from e
            raise
        written[name] = (size, hasher.hexdigest())
    sync_files(directory, written)
    return written


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset``, :data:`_WRITE_BYTES` per call."""
    position = 0
    while position < len(view):
        position += os.pwrite(fd, view[position : position + _WRITE_BYTES], offset + position)


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing ``fd``'s dirty pages now, without waiting (Linux only).

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` over the whole file; a no-op where the call does
    not exist. Durability still comes from the fsync at commit.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the regular file at ``path``, never through a symlink at its
    last component (``O_NOFOLLOW``: a checkpoint's files are its own) and never blocking on a
    FIFO or device put in its place (``O_NONBLOCK``, then ``fstat``); ``OSError`` otherwise."""
    flags = os.O_RDONLY | getattr(os, "O_BINARY", 0)
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_failure(exc: OSError) -> str:
    """Why :func:`open_regular` failed, in words: a symlink, not a regular file, or the
    system's own reason."""
    return "a symlink" if exc.errno == errno.ELOOP else exc.strerror or str(exc)


MAX_TEXT_BYTES = MAX_HEADER_BYTES
"""The largest text file (a manifest, an index) a reader accepts."""


def read_small(path: str | os.PathLike[str], *, limit: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of a small file (a manifest, a piece index); :class:`CheckpointError` if
    unreadable, not a regular file of its own (:func:`open_regular`) or over ``limit``."""
    path = Path(path)
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            # as many bytes as the file has (a read of ``limit`` would allocate all of it)
            data = f.read(min(os.fstat(f.fileno()).st_size, limit) + 1)
            if len(data) <= limit and len(data) > os.fstat(f.fileno()).st_size:  # it grew
                data += f.read(limit + 1 - len(data))
    except OSError as exc:
        raise CheckpointError(f"cannot read: {open_failure(exc)}", path=path) from None
    if len(data) > limit:
        raise CheckpointError(f"larger than {limit} bytes", path=path)
    return data


def read_text(path: str | os.PathLike[str], *, limit: int = MAX_TEXT_BYTES) -> str:
    """A small UTF-8 text file (a manifest); :class:`CheckpointError` if unreadable, not a
    regular file of its own (:func:`open_regular`) or huge."""
    path = Path(path)
    data = read_small(path, limit=limit)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise CheckpointError("not UTF-8 text", path=path) from None


def read_text_chunks(
    path: str | os.PathLike[str], *, limit: int = MAX_TEXT_BYTES, chunk_bytes: int = 1 << 20
) -> Iterator[str]:
    """The text of :func:`read_text`, a chunk at a time (``chunk_bytes`` read at once), so
    that a large manifest is never held whole; the same errors, met as the reading gets there."""
    path = Path(path)
    try:
        fd = open_regular(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {open_failure(exc)}", path=path) from None
    decoder = codecs.getincrementaldecoder("utf-8")()
    total = 0
    with os.fdopen(fd, "rb") as f:
        while True:
            try:
                data = f.read(chunk_bytes)
            except OSError as exc:
                raise CheckpointError(f"cannot read: {exc.strerror}", path=path) from None
            total += len(data)
            if total > limit:
                raise CheckpointError(f"larger than {limit} bytes", path=path)
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError:
                raise CheckpointError("not UTF-8 text", path=path) from None
            if text:
                yield text
            if not data:
                return


_AT_FDCWD = -100
RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _libc_function(name: str, argtypes: list[type]) -> Any:
    """``name`` from the C library with ``argtypes``, or None where it does not exist."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError, TypeError):
        return None
    function.argtypes = argtypes
    return function


_SYNC_FILE_RANGE = _libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
_SYNC_FILE_RANGE_WRITE = 2
_RENAMEAT2 = _libc_function(
    "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
)


def renameat2(a: Path, b: Path, flags: int) -> bool:
    """renameat2(a, b, flags): True when done, False where the kernel or filesystem lacks it;
    any other failure raises OSError (FileExistsError for RENAME_NOREPLACE onto a name)."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
    return renameat2(a, b, _RENAME_EXCHANGE)


def file_size(path: str | os.PathLike[str]) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise CheckpointError(f"cannot stat: {exc.strerror}", path=path) from None


def entries(directory: str | os.PathLike[str]) -> list[str]:
    """Sorted names in ``directory``; empty when it cannot be listed."""
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []
