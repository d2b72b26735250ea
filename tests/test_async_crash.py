"""SIGKILL a process while its background save runs, at controlled moments: nothing is lost.

A helper process imports torch once and, per trial, forks a child that saves a small state
(every state tensor filled with 1) to ``ckpt``, then starts ``async_save`` of the same state
filled with 2 over it (``overwrite=True``, ``keep_last=2`` beside an older checkpoint). The
child stops at the trial's moment of the background work (a function of the write path
replaced by one that says where it is and sleeps) and is SIGKILLed there. Afterwards ``ckpt``
must be one whole checkpoint, the old or the new as the moment implies, anything left beside it
must be recognisably muonckpt's unfinished work, and ``latest`` must pick a sound checkpoint.
"""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

import pytest

import muonckpt
from muonckpt import storage

from .fixture_model import build, initial_params

HELPER = r"""
import os, signal, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)  # no OpenMP pool to inherit across fork
import muonckpt
from muonckpt import storage, writing
from muonckpt.storage import safetensors_writer
from tests.fixture_model import build, initial_params, train

opt, sharded, dp_rank, tp_rank = build(1, 1, initial_params())
train(opt, sharded, dp_rank, tp_rank, 0, 1)
tensors = [v for state in opt.state.values() for v in state.values()]

def fill(value):
    for t in tensors:
        t.fill_(value)

def pause(where):
    print("at", where, flush=True)
    time.sleep(3600)

def stop_at(moment):
    '''Make the background save stop at ``moment``.'''
    if moment.startswith("tensor-"):
        n, calls = int(moment.split("-")[1]), [0]
        original = safetensors_writer.SafetensorsWriter.write
        def write(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                pause(moment)
            return original(self, *args, **kwargs)
        safetensors_writer.SafetensorsWriter.write = write
    elif moment == "before-manifest":
        original = writing.commit
        writing.commit = lambda *a: (pause(moment), original(*a))[1]
    elif moment in ("before-swap", "after-swap"):
        original = storage.swap_in
        def swap_in(*a, **kw):
            if moment == "before-swap":
                pause(moment)
            replaced = original(*a, **kw)
            pause(moment)
        storage.swap_in = swap_in
    elif moment == "retiring":
        original = storage.retire
        def retire(directory, files=None):
            names = sorted(os.listdir(directory))
            os.unlink(Path(directory) / names[0])  # one file of the replaced checkpoint gone
            pause(moment)
        storage.retire = retire
    elif moment == "pruning":
        def remove_checkpoint(directory):
            (Path(directory) / "manifest.json").unlink()
            pause(moment)
        storage.remove_checkpoint = remove_checkpoint

print("ready", flush=True)
for line in sys.stdin:
    root, moment, consolidated = line.split()
    consolidated = consolidated == "1"
    pid = os.fork()
    if pid == 0:
        try:
            fill(0)
            muonckpt.save(opt, f"{root}/older", consolidated=consolidated)
            fill(1)
            muonckpt.save(opt, f"{root}/ckpt", consolidated=consolidated)
            fill(2)
            stop_at(moment)
            future = muonckpt.async_save(
                opt, f"{root}/ckpt", overwrite=True, keep_last=1, consolidated=consolidated
            )
            fill(3)  # training goes on: must not reach the checkpoint
            if moment == "returned":
                pause(moment)
            future.result()
            print("finished", flush=True)
            time.sleep(3600)
        finally:
            os._exit(1)
    sys.stdin.readline()  # the test has seen where the child stopped
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("killed", flush=True)
"""

# (moment, consolidated, the value the checkpoint at ckpt must hold after the kill)
TRIALS = [
    ("returned", False, 1),
    ("tensor-1", False, 1),
    ("tensor-4", False, 1),
    ("tensor-9", False, 1),
    ("before-manifest", False, 1),
    ("before-swap", False, 1),
    ("after-swap", False, 2),
    ("retiring", False, 2),
    ("pruning", False, 2),
    ("tensor-2", True, 1),
    ("before-swap", True, 1),
    ("after-swap", True, 2),
    ("pruning", True, 2),
]


def _readline(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"helper process silent for {timeout}s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"helper process died: {proc.stderr.read()}")
    return line.strip()


def _loaded_value(path: Path) -> int:
    """Load ``path`` into a fresh optimizer; the one value all its state tensors hold."""
    opt, *_ = build(1, 1, initial_params())
    muonckpt.load(opt, path)
    values = {x for s in opt.state.values() for v in s.values() for x in v.unique().tolist()}
    assert len(values) == 1, f"state mixes saves: {sorted(values)}"
    return int(values.pop())


@pytest.fixture(scope="module")
def helper():
    proc = subprocess.Popen(
        [sys.executable, "-c", HELPER],
        cwd=Path(__file__).resolve().parents[1],  # imports tests.fixture_model
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert _readline(proc) == "ready"
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("moment,consolidated,expected", TRIALS)
def test_sigkill_in_the_background_write_loses_nothing(
    tmp_path, helper, moment, consolidated, expected
):
    helper.stdin.write(f"{tmp_path} {moment} {int(consolidated)}\n")
    helper.stdin.flush()
    where = _readline(helper)
    helper.stdin.write("kill\n")
    helper.stdin.flush()
    assert _readline(helper) == "killed"
    assert where == f"at {moment}"

    ckpt = tmp_path / "ckpt"
    assert muonckpt.verify(ckpt) == []
    assert _loaded_value(ckpt) == expected
    for entry in tmp_path.iterdir():
        if entry.name in ("ckpt", "older"):
            continue
        # unfinished work of ours (a staging directory, the replaced checkpoint), which
        # verify and load refuse by its name, manifest or not
        assert storage.is_ours(entry.name), entry.name
        assert len(muonckpt.verify(entry)) == 1
        with pytest.raises(muonckpt.CheckpointError):
            muonckpt.load(build(1, 1, initial_params())[0], entry)
    older = tmp_path / "older"
    if moment == "pruning":  # half deleted, manifest first: incomplete, never picked
        assert not (older / "manifest.json").exists()
    else:
        assert muonckpt.verify(older) == [] and _loaded_value(older) == 0
    newest = muonckpt.latest(tmp_path)
    assert newest == ckpt, newest
