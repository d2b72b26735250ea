"""SIGKILL a process while its background save runs, at controlled moments: nothing is lost.

A helper process imports torch once and, per trial, forks a child that saves a small state
(every state tensor filled with 1) to ``step-2``, then starts ``async_save`` of the same state
filled with 2 over it (``overwrite=True``, ``keep_last=1`` beside an older ``step-1``). The
child stops at the trial's moment of the background work (a function of the write path
replaced by one that says where it is and waits) and is SIGKILLed there. Afterwards ``step-2``
must be one whole checkpoint, the old or the new as the moment implies, anything left beside it
must be recognisably muonckpt's unfinished work, and ``latest`` must pick a sound checkpoint.
Then two ranks of a save: one of them killed, the other must end with an error in bounded time
that says what is known.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import muonckpt
from muonckpt import storage

from .fixture_model import build, initial_params
from .kill_helpers import REPO, kill_at, loaded_value, running_helper

pytestmark = pytest.mark.dist

HELPER = r"""
from pathlib import Path
from muonckpt import storage
from muonckpt.storage import backend
from muonckpt.files import writing
from muonckpt.storage import safetensors_writer

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
        original = writing.publish
        writing.publish = lambda *a: (pause(moment), original(*a))[1]
    elif moment in ("before-swap", "after-swap"):
        original = backend.PosixStore.publish
        def swap_in(*a, **kw):
            if moment == "before-swap":
                pause(moment)
            replaced = original(*a, **kw)
            pause(moment)
        backend.PosixStore.publish = swap_in
    elif moment == "retiring":
        def retire(directory, files=None):
            names = sorted(os.listdir(directory))
            os.unlink(Path(directory) / names[0])  # one file of the replaced checkpoint gone
            pause(moment)
        backend.PosixStore.retire = staticmethod(retire)
    elif moment == "pruning":
        def remove_checkpoint(directory):
            (Path(directory) / "manifest.json").unlink()
            pause(moment)
        backend.PosixStore.remove_checkpoint = staticmethod(remove_checkpoint)

print("ready", flush=True)
for line in sys.stdin:
    root, moment, consolidated = line.split()
    consolidated = consolidated == "1"
    pid = os.fork()
    if pid == 0:
        try:
            fill(0)
            muonckpt.save(opt, f"{root}/step-1", consolidated=consolidated, extra={"step": 1})
            fill(1)
            muonckpt.save(opt, f"{root}/step-2", consolidated=consolidated, extra={"step": 2})
            fill(2)
            stop_at(moment)
            future = muonckpt.async_save(
                opt,
                f"{root}/step-2",
                overwrite=True,
                keep_last=1,
                consolidated=consolidated,
                extra={"step": 2},  # keep_last prunes the names differing in this step
            )
            fill(3)  # training goes on: must not reach the checkpoint
            if moment == "returned":
                pause(moment)
            future.result()
            print("finished", flush=True)
            threading.Event().wait()
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


@pytest.fixture(scope="module")
def helper():
    yield from running_helper(HELPER)


@pytest.mark.parametrize("moment,consolidated,expected", TRIALS)
def test_sigkill_in_the_background_write_loses_nothing(
    tmp_path, helper, moment, consolidated, expected
):
    kill_at(helper, f"{tmp_path} {moment} {int(consolidated)}", moment)

    ckpt = tmp_path / "step-2"
    assert muonckpt.verify(ckpt) == []
    assert loaded_value(ckpt) == expected
    for entry in tmp_path.iterdir():
        if entry.name in ("step-1", "step-2"):
            continue
        # unfinished work of ours (a staging directory, the replaced checkpoint), which
        # verify and load refuse by its name, manifest or not
        assert storage.is_ours(entry.name), entry.name
        assert len(muonckpt.verify(entry)) == 1
        with pytest.raises(muonckpt.CheckpointError):
            muonckpt.load(build(1, 1, initial_params())[0], entry)
    older = tmp_path / "step-1"
    if moment == "pruning":  # half deleted, manifest first: incomplete, never picked
        assert not (older / "manifest.json").exists()
    else:
        assert muonckpt.verify(older) == [] and loaded_value(older) == 0
    newest = muonckpt.latest(tmp_path)
    assert newest == ckpt, newest


RANK_SCRIPT = r"""
import os, signal, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
import muonckpt
from muonckpt import storage
from muonckpt.storage import backend
from muonckpt.files import writing
from tests.fixture_model import build, initial_params, train

ckpt, victim = sys.argv[1], sys.argv[2]
# file://PATH, or tcp://127.0.0.1:PORT: a store that rank 0 hosts, gone with it
dist.init_process_group("gloo", init_method=sys.argv[3], rank=int(os.environ["RANK"]),
                        world_size=2)
rank = dist.get_rank()
opt, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
train(opt, sharded, dp_rank, tp_rank, 0, 1)
muonckpt.save(opt, ckpt)
train(opt, sharded, dp_rank, tp_rank, 1, 1)
if victim == f"rank {rank} writing":
    writing.write_files = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if victim == "rank 0 after the swap" and rank == 0:
    original = backend.PosixStore.publish
    def swap_in(*a, **k):
        original(*a, **k)
        os.kill(os.getpid(), signal.SIGKILL)
    backend.PosixStore.publish = swap_in
future = muonckpt.async_save(opt, ckpt, overwrite=True, timeout=1.0)
try:
    print("result", future.result(), flush=True)
except muonckpt.CheckpointError as exc:
    print("error", exc, flush=True)
os._exit(0)  # a peer is dead: no orderly teardown of the group
"""


@pytest.mark.parametrize(
    "victim,survivor,expected_step,message,store",
    [
        # the survivor is the root: it fails the step after the timeout, nothing committed
        (
            "rank 1 writing",
            0,
            1,
            "error async_save (write): rank(s) [1] did not finish within 1 s",
            "file",
        ),
        # the root died after committing, before its outcome: the survivor finds its staging
        # directory committed at the path (issue 20; it said "gave no outcome" before)
        ("rank 0 after the swap", 1, 2, "result ", "file"),
        # the same, the store gone with the root (issue 52: the messages go through it)
        ("rank 0 after the swap", 1, 2, "result ", "tcp"),
        # the root and its store gone before the commit: the survivor says so at once
        (
            "rank 0 writing",
            1,
            1,
            "error async_save (write): looking for messages in the process group's store failed",
            "tcp",
        ),
    ],
)
def test_sigkill_of_one_rank_in_a_background_save(
    tmp_path, victim, survivor, expected_step, message, store
):
    ckpt = tmp_path / "ckpt"
    if store == "tcp":
        with socket.socket() as probe:  # a free port for rank 0's store
            probe.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    else:
        init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(ckpt), victim, init],
            cwd=REPO,
            env={**os.environ, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert procs[1 - survivor].returncode == -9  # the victim was killed
    out, err = outputs[survivor]
    assert procs[survivor].returncode == 0, err[-2000:]
    assert message in out, out + err[-2000:]
    if store == "tcp" and expected_step == 1:
        assert "the process group's store at 127.0.0.1:" in out, out
        assert "is gone: the process that hosts it (rank 0" in out, out
    assert muonckpt.verify(ckpt) == [] and muonckpt.read_manifest(ckpt).step == expected_step
    for entry in tmp_path.iterdir():
        if entry.name not in ("ckpt", "rendezvous"):
            assert storage.is_ours(entry.name), entry.name  # unfinished work, never a checkpoint
    assert muonckpt.latest(tmp_path) == ckpt
