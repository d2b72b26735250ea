"""Progress of the work that moves a checkpoint's bytes (``save``, ``async_save``, ``load``,
every offline tool and foreign reader), the one way for all: the caller's callback
(:data:`Progress`), fed by a :class:`Meter` as tensors are written or read; and
:class:`ProgressLines`, the callback that reports it as plain lines at a steady interval, for
a log (what ``muonckpt`` prints when stderr is not a terminal).

Pure: no files, no torch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TextIO

from ..settings import human_size

__all__ = ["Counted", "Meter", "Progress", "ProgressLines", "Totals"]

Progress = Callable[[int, int, int, int], None]
"""``progress(done_bytes, total_bytes, done_tensors, total_tensors)``, called once at the start
(``0, total, 0, tensors``) and after each tensor is written or read: the caller's own progress
report. Each process reports its own share (under torchrun, each rank its own)."""


class Totals(Protocol):
    """What a piece of work amounts to: its bytes and its tensors (a write plan, a load's
    reads), asked for only when there is a progress to report (a plan made one file at a time
    counts them in a pass)."""

    @property
    def total_bytes(self) -> int: ...

    @property
    def count(self) -> int: ...


@dataclass(frozen=True)
class Counted:
    """:class:`Totals` already counted."""

    total_bytes: int
    count: int


class Meter:
    """Counts what was written or read of ``work`` for ``progress``."""

    def __init__(self, work: Totals, progress: Progress | None) -> None:
        self.total, self.tensors = (work.total_bytes, work.count) if progress else (0, 0)
        self.progress = progress
        self.done = self.counted = 0
        if progress is not None:
            progress(0, self.total, 0, self.tensors)

    def tick(self, nbytes: int) -> None:
        """One tensor of ``nbytes`` done."""
        self.done += nbytes
        self.counted += 1
        if self.progress is not None:
            self.progress(self.done, self.total, self.counted, self.tensors)


class ProgressLines:
    """A :data:`Progress` that writes plain lines a log reads well: every ``every`` seconds
    ``WHAT: 42% 1.2 GiB of 2.9 GiB, 120 of 300 tensors, 310.5 MiB/s``, and when the work is
    done ``WHAT: done, 2.9 GiB, 300 tensors in 9.4 s, 312.0 MiB/s``. Nothing for work done
    within the first interval but that last line. One object reports one operation at a time;
    a new start (``0, total, 0, tensors``) begins the next.

    ``muonckpt.save(opt, path, progress=muonckpt.ProgressLines("save"))`` in a batch job.
    """

    def __init__(
        self,
        what: str,
        *,
        every: float = 10.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.every, self.clock = what, every, clock
        self.stream = stream
        self._start = self._last = 0.0
        self._done = True  # until a start

    def __call__(self, done: int, total: int, done_tensors: int, total_tensors: int) -> None:
        now = self.clock()
        if done == done_tensors == 0 or self._done:
            self._start = self._last = now
            self._done = False
        if done >= total and done_tensors >= total_tensors:
            self._done = True
            seconds = now - self._start
            self._line(
                f"done, {human_size(done)}, {done_tensors} tensors in {seconds:.1f} s, "
                f"{self._rate(done, seconds)}"
            )
        elif now - self._last >= self.every:
            self._last = now
            percent = 100 * done // max(total, 1)
            self._line(
                f"{percent}% {human_size(done)} of {human_size(total)}, {done_tensors} of "
                f"{total_tensors} tensors, {self._rate(done, now - self._start)}"
            )

    @staticmethod
    def _rate(done: int, seconds: float) -> str:
        return f"{human_size(int(done / seconds))}/s" if seconds > 0 else "- B/s"

    def _line(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        print(f"{self.what}: {text}", file=stream, flush=True)
