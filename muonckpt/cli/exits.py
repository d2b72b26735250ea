"""How a command ends: its exit code (:data:`EXIT_CODES`, the one table, which the README's
exit codes section repeats: tests/test_cli.py checks), its errors and warnings as one line
each on stderr, and the signals that interrupt it."""

from __future__ import annotations

import signal
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import typer
from typer.core import TyperGroup

from ..errors import ArgumentError, CheckpointWarning, InterruptedAfterCommit, MuonCkptError
from .output import stderr_line

OK, PROBLEM, USAGE, COMMITTED, INTERRUPTED = 0, 1, 2, 3, 128


@dataclass(frozen=True)
class ExitCode:
    code: str
    meaning: str
    errors: tuple[type[Exception], ...] = ()
    """The exceptions a command ends with that exit with this code, as one ``error: ...`` line
    (the traceback before it with ``--debug``, which never changes the code)."""


EXIT_CODES = (
    ExitCode(
        str(OK),
        "success (with a `warning: committed ...` line when something failed after the commit)",
    ),
    ExitCode(
        str(PROBLEM),
        "a problem found (`verify`, `doctor`, `diff`, `demo`), or nothing there: no checkpoint "
        "(`latest`), no ROOT directory (`latest`, `clean`); also an "
        "exception muonckpt does not expect (a bug), shown with its traceback",
    ),
    ExitCode(
        str(USAGE),
        "the command could not run: bad usage (with the usage message), or one `error: ...` "
        "line for an `ArgumentError` (a value an option cannot take), another `MuonCkptError` "
        "(an input that is missing, incomplete, damaged or not a muonckpt checkpoint, a "
        "refused output, a failed worker) or an `OSError` from the system, reading or writing "
        "alike (a file missing or unreadable, permission denied, disk full, a read-only "
        "filesystem)",
        (ArgumentError, MuonCkptError, OSError),
    ),
    ExitCode(
        str(COMMITTED),
        "committed: the output is a whole new checkpoint, but the command was interrupted while "
        "cleaning up after the commit (an `InterruptedAfterCommit`); prints `committed: ...`; "
        "`muonckpt clean` removes what is left of a replaced checkpoint",
    ),
    ExitCode(
        f"{INTERRUPTED} + signal",
        "interrupted before the commit (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP): one line, its "
        "staging removed, nothing committed",
    ),
)
"""Every exit code of the command line, what it means, and the errors that end in it."""

_ERROR_CODES = {error: int(row.code) for row in EXIT_CODES for error in row.errors}

FLAGS = {"overwrite=True": "--force"}
"""The library's arguments as its messages name them, and the flags that give them: an error
line speaks in flags."""


def in_flags(message: str) -> str:
    """A library message as the command line says it: each argument (:data:`FLAGS`) its flag."""
    for argument, flag in FLAGS.items():
        message = message.replace(argument, flag)
    return message


class Group(TyperGroup):
    """The one place where errors become ``error: ...`` lines and their exit codes
    (:data:`EXIT_CODES`).

    Also: an interruption (Ctrl-C, or SIGTERM / SIGHUP under :func:`catch_stop_signals`)
    becomes ``error: interrupted`` and exit code 128 + the signal's number (130, 143, 129),
    after the command's own cleanup has run (its staging directory removed, its worker
    processes killed); after the commit, ``committed: ...`` and exit code 3 (the output is
    whole); a :class:`~muonckpt.errors.CheckpointWarning` becomes one ``warning: ...`` line.
    ``--debug`` shows the tracebacks as well.
    """

    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]  # click passes typer's
        def debug() -> bool:  # ctx.obj is set by the global callback, inside super().invoke
            return bool((ctx.obj or {}).get("debug"))

        try:
            with _warnings_as_lines():
                return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            if debug():
                traceback.print_exc()
            if isinstance(exc, InterruptedAfterCommit):
                stderr_line(
                    f"committed: {exc.path} is complete; interrupted while cleaning up "
                    "(muonckpt clean removes what is left of a replaced checkpoint)"
                )
                ctx.exit(COMMITTED)
            stderr_line("error: interrupted")
            ctx.exit(INTERRUPTED + getattr(exc, "signum", signal.SIGINT))
        except tuple(_ERROR_CODES) as exc:
            if debug():  # the traceback too; the exit code stays the same
                traceback.print_exc()
            # a worker's failure carries its traceback after a one-line summary
            text = getattr(exc, "summary", None) or str(exc)
            message = " ".join(text.split()) or type(exc).__name__
            stderr_line(f"error: {in_flags(message)}")
            ctx.exit(next(code for error, code in _ERROR_CODES.items() if isinstance(exc, error)))


@contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """CheckpointWarnings as ``warning: ...`` lines on stderr while the block runs."""
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if issubclass(category, CheckpointWarning):
                stderr_line(f"warning: {' '.join(str(message).split())}")
            else:
                shown(message, category, *args, **kwargs)

        warnings.simplefilter("always", CheckpointWarning)
        warnings.showwarning = show
        yield


class _Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so that every cleanup on the way out runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None))


def _stop(signum: int, frame: Any) -> None:
    """The first stop signal interrupts the command; later ones are ignored, so that they
    cannot cut short the cleanup the first one started."""
    for other in _STOP_SIGNALS:
        if other is not None:
            signal.signal(other, signal.SIG_IGN)
    raise _Interrupted(signum)


def catch_stop_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP (unless ignored, as under ``nohup``) interrupt the command as
    Ctrl-C does (see :class:`Group`)."""
    for signum in _STOP_SIGNALS:
        if signum is not None and signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _stop)
