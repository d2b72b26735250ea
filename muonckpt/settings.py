"""The bounds of the numeric settings, sizes as people write them (``"5GB"``), and paths that
must be local (a URL refused): one place that the library's entry points and the command
line both check with, so that a value out of range is a one-line error naming the setting,
raised before anything starts or is written. Pure: no torch, no files."""

from __future__ import annotations

import math
import operator
import os
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

from .errors import ArgumentError, CheckpointError, MuonCkptError, OptionError

__all__ = [
    "MAX_LARGE_WORLD",
    "MAX_WAIT_S",
    "MAX_WORLD",
    "SIZE_UNITS",
    "WORKERS_PER_CORE",
    "available_cores",
    "human_size",
    "local_path",
    "local_workers",
    "parse_size",
    "seconds",
    "shard_size",
    "tolerance",
    "world_size",
]

MAX_WAIT_S = 7 * 24 * 3600.0
"""The longest wait a timeout may set, a week: a rank waiting longer for another is hung, and
past about 1e13 s a ``datetime.timedelta`` (what torch.distributed takes) overflows."""

MAX_WORLD = 4096
"""The most ranks an output is written for unless ``allow_large_world`` is passed: ``reshard``'s
``--dp`` x ``--tp`` (one file per rank), ``convert --to deepspeed``'s ``--world`` (one rank
file each, every one holding every group's settings) and ``--to megatron``'s ``--tp`` x
``--dp``. 4,096 GPUs is past the ZeRO-1/2 and TP x DP jobs these outputs serve; a slip of
the keyboard (``--world 100000``) would otherwise write tens of thousands of files before
anyone noticed."""

MAX_LARGE_WORLD = 1 << 16
"""The most ranks even with ``allow_large_world``: planning an output costs ranks x params,
and each rank is at least one file."""

WORKERS_PER_CORE = 4
"""The most local worker processes per CPU core an offline tool starts: more only share the
same cores (and each holds a copy of the plan and its buffers)."""

SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
"""Size suffixes as Hugging Face reads them: ``5GB`` is 5 * 10**9 bytes, ``5GiB`` 5 * 2**30."""

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", re.IGNORECASE | re.ASCII)


def parse_size(text: str, name: str = "size") -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``"1024"`` -> 1024: a
    positive whole number of bytes (:data:`SIZE_UNITS`).

    Raises:
        ArgumentError: for anything else, its :attr:`~ArgumentError.argument` ``name`` (the
            message names the text alone: a command line option's parser adds the option).
    """
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ArgumentError(
            f"{text!r} is not a size like 5GB, 500MB, 64MiB or 1048576", argument=name
        )
    try:
        exact = Decimal(match.group(1)) * SIZE_UNITS[(match.group(2) or "").upper()]
    except InvalidOperation as exc:  # (the pattern admits decimal digits only)
        raise ArgumentError(f"{text!r} is not a size", argument=name) from exc
    if exact != exact.to_integral_value():  # "1.5B" is no size, never silently 1 byte
        raise ArgumentError(f"{text!r} is not a whole number of bytes", argument=name)
    size = int(exact)
    if size <= 0:
        raise ArgumentError(f"{text!r} is not a positive size", argument=name)
    return size


def human_size(n: int) -> str:
    """``n`` bytes as a person reads them (binary units): ``512 B``, ``1.5 MiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def shard_size(value: object, name: str = "max_shard_size") -> int | None:
    """``max_shard_size`` as bytes: None (no split), a positive int, or a string
    :func:`parse_size` reads (``"5GB"``, ``"100KB"``, as the CLI and Hugging Face take it).

    Raises:
        ArgumentError: naming the setting, for anything else.
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return parse_size(value, name)
        except ArgumentError as exc:
            raise ArgumentError(f"{name}: {exc}", argument=name) from None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ArgumentError(
            f"{name} must be a positive number of bytes (an int, or a string like '5GB', "
            f"'500MB', '100KB'), got {value!r}",
            argument=name,
        )
    return value


def seconds(
    value: object,
    name: str,
    error: type[MuonCkptError] | None = None,
    *,
    zero: bool = False,
) -> float:
    """``value`` as a number of seconds: more than 0 (``zero``: at least 0) and at most
    :data:`MAX_WAIT_S`; NaN, infinities, bools and non-numbers refused.

    Raises:
        ``error`` (default :class:`ArgumentError`): naming the setting ``name``.
    """

    def refused(message: str) -> MuonCkptError:
        return ArgumentError(message, argument=name) if error is None else error(message)

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refused(f"{name} must be a number of seconds, got {value!r}")
    low = value >= 0 if zero else value > 0
    if not (low and value <= MAX_WAIT_S):  # (NaN fails both)
        floor = "at least 0" if zero else "more than 0"
        raise refused(f"{name} must be {floor} and at most {MAX_WAIT_S:g} seconds, got {value!r}")
    return float(value)


def tolerance(value: object, name: str) -> float:
    """``value`` as a comparison tolerance: a finite number of at least 0 (NaN would make
    every element differ, infinity every element agree).

    Raises:
        ArgumentError: naming the setting ``name``, for anything else.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(f"{name} must be a number, got {value!r}", argument=name)
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf
    if not (0 <= number < math.inf):
        raise ArgumentError(f"{name} must be finite and at least 0, got {value!r}", argument=name)
    return number


def world_size(value: int, option: str, what: str, *, allow_large: bool) -> int:
    """``value`` ranks (``--world``, or ``--dp`` x ``--tp``: ``option`` as the command line
    spells it) of an output that writes ``what`` per rank, checked against :data:`MAX_WORLD`
    (:data:`MAX_LARGE_WORLD` with ``allow_large``), before anything is read or written.

    Raises:
        OptionError: naming the option, the cap and the override.
    """
    cap = MAX_LARGE_WORLD if allow_large else MAX_WORLD
    if value <= cap:
        return value
    more = (
        "muonckpt plans no more"
        if allow_large
        else f"pass --allow-large-world (allow_large_world=True) for up to {MAX_LARGE_WORLD}"
    )
    raise OptionError(
        f"{option} gives {value} ranks, more than {cap} ({what} each): {more}",
        option.split()[0],
    )


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def local_workers(requested: object, cores: int, name: str = "workers") -> int:
    """``requested`` local processes, checked: a positive int of at most
    :data:`WORKERS_PER_CORE` per core of the ``cores`` this process may run on.

    Raises:
        ArgumentError: naming the setting ``name``, for anything else (``--dp 1000``
            on a laptop), before any process starts.
    """
    count = 0 if isinstance(requested, bool) else _whole(requested)  # a numpy int too
    if count < 1:
        raise ArgumentError(f"{name} must be a positive int, got {requested!r}", argument=name)
    most = WORKERS_PER_CORE * max(cores, 1)
    if count > most:
        raise ArgumentError(
            f"{name}={count} is more than {WORKERS_PER_CORE} processes per CPU core "
            f"({max(cores, 1)} here: at most {most})",
            argument=name,
        )
    return count


def _whole(value: object) -> int:
    """``value`` as an int where it is one (``operator.index``), else 0."""
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return 0


_URL = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://")
"""A URL's start: a scheme (RFC 3986) and ``//``."""
_SCHEME_PART = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*):")
"""A URL made a ``Path`` (``Path("s3://b/x")`` is ``s3:/b/x``): its first part, the scheme
and a colon, alone."""


def local_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a :class:`~pathlib.Path`, unless it is a URL: a string starting with a
    scheme and ``//`` (``s3://``, ``gs://``, ``hf://``, ``https://``), or a relative path
    whose first part is a scheme and a colon alone (such a URL made a ``Path``). A local name
    with a colon (``a:b``, ``run:1/step-10``) is a path.

    Raises:
        CheckpointError: for a URL, naming it and what is supported (not an
            :class:`ArgumentError`, which the command line's option parsers would take for a
            value of the wrong form): an ``s3://`` URL where only a local directory will do
            (a foreign format's files), or any other scheme.
    """
    text = os.fsdecode(os.fspath(path))
    url = _URL.match(text)
    first = Path(text).parts[:1]
    if url is None and not (first and _SCHEME_PART.fullmatch(first[0])):
        return Path(text)
    scheme = url.group(1) if url is not None else first[0][:-1]
    if url is not None and scheme == "s3":
        raise CheckpointError(
            f"{text!r} is an s3:// URL, not a local path: this takes a local directory only "
            "(stage the files locally, e.g. aws s3 cp --recursive); nothing was read or written"
        )
    raise CheckpointError(
        f"{text!r} is a {scheme}:// URL, not a local path: muonckpt reads and writes local "
        "directories and s3:// URLs only; nothing was read or written"
    )
