"""The signal dispositions of the processes the signal tests start: the ones a test sends, or
that a process sends itself, at their defaults however the test run was launched."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def default_stop_signals() -> None:
    """(``preexec_fn`` of a process a test signals or that interrupts itself) SIGINT, SIGTERM
    and SIGHUP at their defaults, whatever the test run inherited: a background job (``... &``)
    or a CI runner starts it with SIGINT ignored, ``nohup`` with SIGHUP ignored, an ignored
    disposition survives ``exec``, and Python (its KeyboardInterrupt) and the CLI (its
    handlers) install none for an ignored signal."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
