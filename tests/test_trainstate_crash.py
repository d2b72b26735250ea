"""SIGKILL during a save that carries the job's own state: the optimizer's state and ``extra``
/ ``rank_extra`` are one commit, so a checkpoint never holds one save's optimizer state with
another save's trainer state.

A helper process (the fixture optimizer, torch imported once) forks a child per trial that
saves everything filled with 1 (state tensors, ``extra["step"]``, an ``extra`` tensor and a
``rank_extra`` tensor), then saves everything filled with 2 over it, ``save`` or
``async_save``, and is SIGKILLed at the trial's moment of that second save.
"""

from __future__ import annotations

import pytest
import torch

import muonckpt

from .fixture_model import build, initial_params
from .kill_helpers import kill_at, running_helper

pytestmark = pytest.mark.dist

HELPER = r"""
from muonckpt import storage
from muonckpt.storage import backend
from muonckpt.files import writing
from muonckpt.storage import safetensors_writer

def stop_at(moment):
    if moment.startswith("tensor-"):
        wanted = moment.removeprefix("tensor-")
        original = safetensors_writer.SafetensorsWriter.write
        def write(self, key, *args, **kwargs):
            if key == wanted or (wanted == "state" and not key.startswith("extra.")):
                pause(moment)
            return original(self, key, *args, **kwargs)
        safetensors_writer.SafetensorsWriter.write = write
    elif moment == "before-manifest":
        original = writing.publish
        writing.publish = lambda *a: (pause(moment), original(*a))[1]
    elif moment in ("before-swap", "after-swap"):
        original = backend.PosixStore.publish
        def swap_in(*a, **kw):
            if moment == "before-swap":
                pause(moment)
            original(*a, **kw)
            pause(moment)
        backend.PosixStore.publish = swap_in

def job(value):
    extra = {"step": value, "marker": torch.full((4,), float(value))}
    return extra, {"pos": torch.full((2,), value)}

print("ready", flush=True)
for line in sys.stdin:
    ckpt, moment, background = line.split()
    pid = os.fork()
    if pid == 0:
        try:
            fill(1)
            extra, rank_extra = job(1)
            muonckpt.save(opt, ckpt, extra=extra, rank_extra=rank_extra)
            fill(2)
            extra, rank_extra = job(2)
            stop_at(moment)
            if background == "1":
                muonckpt.async_save(
                    opt, ckpt, overwrite=True, extra=extra, rank_extra=rank_extra
                ).result()
            else:
                muonckpt.save(opt, ckpt, overwrite=True, extra=extra, rank_extra=rank_extra)
            print("finished", flush=True)
            threading.Event().wait()
        finally:
            os._exit(1)
    sys.stdin.readline()
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("killed", flush=True)
"""

# (moment, async_save?, the one value the checkpoint must hold everywhere after the kill)
TRIALS = [
    ("tensor-state", False, 1),
    ("tensor-extra.marker", False, 1),
    ("tensor-extra.pos", False, 1),
    ("before-manifest", False, 1),
    ("before-swap", False, 1),
    ("after-swap", False, 2),
    ("tensor-extra.marker", True, 1),
    ("tensor-extra.pos", True, 1),
    ("before-swap", True, 1),
    ("after-swap", True, 2),
]


@pytest.fixture(scope="module")
def helper():
    yield from running_helper(HELPER)


@pytest.mark.parametrize("moment,background,expected", TRIALS)
def test_sigkill_keeps_the_optimizer_and_the_job_state_together(
    tmp_path, helper, moment, background, expected
):
    ckpt = tmp_path / "ckpt"
    kill_at(helper, f"{ckpt} {moment} {int(background)}", moment)

    assert muonckpt.verify(ckpt) == []
    opt, *_ = build(1, 1, initial_params())
    extra, rank_extra = {}, {}
    muonckpt.load(opt, ckpt, extra=extra, rank_extra=rank_extra)
    state = {x for s in opt.state.values() for v in s.values() for x in v.unique().tolist()}
    assert state == {expected}
    assert extra["step"] == expected
    assert torch.equal(extra["marker"], torch.full((4,), float(expected)))
    assert torch.equal(rank_extra["pos"], torch.full((2,), expected))
