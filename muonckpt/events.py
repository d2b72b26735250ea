"""Start, end and failure events of every operation, on the ``muonckpt`` logger.

Silent by default (the logger has a :class:`logging.NullHandler`, as libraries do): a job that
configures logging sees one record per event, from rank 0 only unless the environment sets
``MUONCKPT_LOG_RANKS=all``. Each record's message is one line, and its fields are also on the
record (``record.muonckpt``: ``event`` ``"start"`` / ``"end"`` / ``"failed"``, ``operation``,
``path``, ``rank``, ``ranks``, and at the end ``duration_s`` and ``bytes`` (None where not
counted), or at a failure ``duration_s`` and ``error``) for handlers that report structured
events.

Every entry point logs through one :class:`Event`: ``with Event(...)`` around the operation,
:meth:`Event.end` / :meth:`Event.fail` called where one ends elsewhere (``async_save``'s
commit, on its own thread), or an offline tool decorated with :func:`logged`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

LOGGER = logging.getLogger("muonckpt")
"""The library's logger (its :class:`logging.NullHandler` is added by ``muonckpt/__init__``)."""

RANKS_VARIABLE = "MUONCKPT_LOG_RANKS"
"""The environment variable that asks for the events of every rank (``all``), not rank 0's."""


class Event:
    """One operation between its start (logged when made) and its end, as the logger reports
    it; as a context manager, ended when its block ends, or failed by its exception."""

    def __init__(self, operation: str, path: object, *, rank: int = 0, ranks: int = 1) -> None:
        self.operation, self.path, self.rank, self.ranks = operation, str(path), rank, ranks
        self.bytes: int | None = None
        """The bytes this rank read or wrote, where the operation counts them (set as it
        learns them)."""
        self.started = time.perf_counter()
        self._emit("start", f"{self.path} ({ranks} rank{'s' if ranks != 1 else ''})")

    def end(self) -> None:
        """The operation succeeded."""
        seconds = time.perf_counter() - self.started
        size = "" if self.bytes is None else f", {self.bytes} bytes"
        self._emit(
            "end", f"{self.path} in {seconds:.3f} s{size}", duration_s=seconds, bytes=self.bytes
        )

    def fail(self, error: BaseException) -> None:
        """The operation failed with ``error``."""
        seconds = time.perf_counter() - self.started
        line = " ".join(f"{type(error).__name__}: {error}".split())
        self._emit(
            "failed",
            f"{self.path} after {seconds:.3f} s: {line}",
            duration_s=seconds,
            error=line,
        )

    def __enter__(self) -> Event:
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if error is None:
            self.end()
        else:
            self.fail(error)

    def _emit(self, event: str, text: str, **fields: Any) -> None:
        if self.rank != 0 and os.environ.get(RANKS_VARIABLE, "") != "all":
            return
        level = logging.ERROR if event == "failed" else logging.INFO
        if not LOGGER.isEnabledFor(level):
            return
        record = {
            "event": event,
            "operation": self.operation,
            "path": self.path,
            "rank": self.rank,
            "ranks": self.ranks,
            **fields,
        }
        LOGGER.log(
            level, "muonckpt.%s %s: %s", self.operation, event, text, extra={"muonckpt": record}
        )


P = ParamSpec("P")
R = TypeVar("R")


def logged(operation: str, paths: int = 1) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """An offline tool whose calls are :class:`Event` s of ``operation``, on the paths its
    first ``paths`` parameters name (given by position or by keyword); a ``collective=True``
    call as the rank and world torchrun gives it (``RANK``, ``WORLD_SIZE``), any other as one
    process."""

    def decorate(tool: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(tool)
        named = list(signature.parameters)[:paths]

        @functools.wraps(tool)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            given = signature.bind_partial(*args, **kwargs).arguments
            where = " -> ".join(str(given[name]) for name in named if name in given)
            rank = ranks = None
            if kwargs.get("collective"):
                rank, ranks = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
            with Event(operation, where, rank=int(rank or 0), ranks=int(ranks or 1)):
                return tool(*args, **kwargs)

        return call

    return decorate
