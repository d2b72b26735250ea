"""Writers where they cannot write, as ``python -m tests.writer_cases LIMIT CASES``: with
``LIMIT`` bytes a number, no file may grow past it (``RLIMIT_FSIZE``, a quota: a write past it
fails with EFBIG, SIGXFSZ ignored); with ``-``, no limit (the outputs' places say what fails: a
full or read-only tmpfs, a directory without permissions, a path too long).

``CASES`` is a JSON list of cases, each ``{"cli": [argv...]}`` (the command line, in this
process) or ``{"api": "module:function", "args": [...], "kwargs": {...}}``; the last line
printed is a JSON list of their outcomes: for the command line its exit code, stderr and the
exception that escaped it (a traceback), for the API the type and message of what it raised.
``tests.writer_cases:save`` saves the fixture model's optimizer (after 2 steps) with
``save``'s options, or ``async_save``'s with ``asynchronous``.
"""

from __future__ import annotations

import importlib
import json
import resource
import signal
import sys
from typing import Any

from typer.testing import CliRunner

import muonckpt
from muonckpt.cli import app

from .fixture_model import single_process_optimizer


def run(case: dict[str, Any]) -> dict[str, Any]:
    """One case's outcome."""
    if "cli" in case:
        try:
            result = CliRunner().invoke(app, case["cli"])
        except BaseException as exc:  # not an Exception: past the CliRunner too
            return {"code": None, "stderr": "", "escaped": repr(exc)[:300]}
        escaped = None if isinstance(result.exception, SystemExit) else repr(result.exception)
        return {"code": result.exit_code, "stderr": result.stderr, "escaped": escaped}
    module, name = case["api"].split(":")
    function = getattr(importlib.import_module(module), name)
    try:
        result = function(*case["args"], **case["kwargs"])
        if hasattr(result, "result"):  # async_save's future
            result.result()
    except BaseException as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None, "message": ""}


def save(path: str, *, asynchronous: bool = False, **options: Any) -> Any:
    """The fixture model's optimizer saved at ``path``, or its ``async_save`` future."""
    optimizer = single_process_optimizer(2)
    if asynchronous:
        return muonckpt.async_save(optimizer, path, **options)
    return muonckpt.save(optimizer, path, **options)


def main(limit: str, cases: str) -> None:
    if limit != "-":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), hard))
    print(json.dumps([run(case) for case in json.loads(cases)]))


if __name__ == "__main__":
    main(*sys.argv[1:])
