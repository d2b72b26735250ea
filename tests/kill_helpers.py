"""What the SIGKILL tests share: a helper process that imports torch once and forks a child
per trial, reading its lines with a timeout, and loading what a trial left behind."""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import muonckpt

from .fixture_model import build, initial_params

REPO = Path(__file__).resolve().parents[1]

PREAMBLE = r"""
import os, select, signal, sys, threading
import torch
torch.set_num_threads(1)  # no OpenMP pool to inherit across fork
import muonckpt
from tests.fixture_model import build, initial_params, train

opt, sharded, dp_rank, tp_rank = build(1, 1, initial_params())
train(opt, sharded, dp_rank, tp_rank, 0, 1)
tensors = [v for state in opt.state.values() for v in state.values()]

def fill(value):
    for t in tensors:
        t.fill_(value)

def pause(where):
    print("at", where, flush=True)
    threading.Event().wait()  # until the test has this child SIGKILLed
"""
"""The start of every helper script: the fixture optimizer after one step, ``fill(value)`` to
give all its state tensors one value (which a loaded checkpoint then shows), and
``pause(where)``, for a forked child to say where it stopped and wait there to be killed."""


def start_helper(script: str, *args: str) -> subprocess.Popen:
    """``python -c PREAMBLE + script *args`` in the repository (it imports ``tests.*``)."""
    return subprocess.Popen(
        [sys.executable, "-c", PREAMBLE + script, *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def running_helper(script: str) -> Iterator[subprocess.Popen]:
    """(the body of a module-scoped fixture) The helper of ``script``, once it is ready;
    killed after the module's trials."""
    proc = start_helper(script)
    assert readline(proc) == "ready"
    yield proc
    proc.kill()
    proc.wait()


def kill_at(helper: subprocess.Popen, request: str, moment: str) -> None:
    """Have the helper start a trial (``request``: its line of arguments), wait until the
    trial's child reports it reached ``moment``, and SIGKILL it there."""
    helper.stdin.write(f"{request}\n")
    helper.stdin.flush()
    where = readline(helper)
    helper.stdin.write("kill\n")
    helper.stdin.flush()
    assert readline(helper) == "killed"
    assert where == f"at {moment}"


def readline(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The helper's next line; an AssertionError if it stays silent or dies."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"helper process silent for {timeout}s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"helper process died: {proc.stderr.read()}")
    return line.strip()


def loaded_value(path: Path) -> int:
    """Load ``path`` into a fresh optimizer; the one value all its state tensors hold."""
    opt, *_ = build(1, 1, initial_params())
    muonckpt.load(opt, path)
    values = {x for s in opt.state.values() for v in s.values() for x in v.unique().tolist()}
    assert len(values) == 1, f"state mixes saves: {sorted(values)}"
    (value,) = values
    assert value == int(value) and value >= 0
    return int(value)
