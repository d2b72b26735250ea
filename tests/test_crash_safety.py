"""SIGKILL a process that is saving, at seeded random moments: the checkpoint always survives.

A helper process started with ``python -c`` imports torch once (seconds on a busy machine) and
then, per trial, forks a child that saves the same small single-process state over one path in
a loop (``overwrite=True``), every state tensor filled with the save's number, and SIGKILLs it
after the trial's delay. Afterwards the path must hold one complete checkpoint, old or new, that
verifies clean and loads with every tensor from the same save; a staging directory left beside
it must be recognisably unfinished (no manifest) or be a whole checkpoint in itself.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

import muonckpt
from muonckpt import CheckpointError

from .fixture_model import build, initial_params
from .kill_helpers import loaded_value, readline, start_helper

pytestmark = pytest.mark.dist

TRIALS = 12
"""Kills in the default tier; the ``slow`` tier runs ``SLOW_TRIALS`` (the first ``TRIALS``
the same: one seed)."""
SLOW_TRIALS = 24
SEED = 20240611
MAX_DELAY_S = 0.6

HELPER = r"""
fill(0)
muonckpt.save(opt, sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    path, delay = line.split()
    pid = os.fork()
    if pid == 0:
        try:
            i = 0
            while True:
                i += 1
                fill(i)
                muonckpt.save(opt, path, overwrite=True)
        finally:
            os._exit(1)
    child = os.pidfd_open(pid)  # readable once the child has ended (it never should)
    ended, _, _ = select.select([child], [], [], float(delay))  # until the trial's kill moment
    os.close(child)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("ended by itself" if ended else "killed", flush=True)
"""


def _check_leftover(staging: Path) -> str:
    """A leftover staging directory must be reported incomplete and refused by load."""
    problems = muonckpt.verify(staging)
    assert len(problems) == 1 and "incomplete" in str(problems[0]), problems
    with pytest.raises(CheckpointError, match="incomplete"):
        muonckpt.load(build(1, 1, initial_params())[0], staging)
    return "manifest" if (staging / "manifest.json").exists() else "no manifest"


@pytest.mark.parametrize(
    "trials", [TRIALS, pytest.param(SLOW_TRIALS, marks=pytest.mark.slow)], ids=str
)
def test_sigkill_during_save_never_breaks_the_checkpoint(tmp_path, trials):
    template = tmp_path / "template"
    helper = start_helper(HELPER, str(template))
    try:
        assert readline(helper) == "ready"
        rng = random.Random(SEED)
        values, leftovers = [], []
        for trial in range(trials):
            root = tmp_path / f"trial{trial:02d}"
            root.mkdir()
            ckpt = root / "ckpt"
            shutil.copytree(template, ckpt)
            helper.stdin.write(f"{ckpt} {rng.uniform(0, MAX_DELAY_S):.4f}\n")
            helper.stdin.flush()
            assert readline(helper) == "killed"

            assert muonckpt.verify(ckpt) == []
            values.append(loaded_value(ckpt))
            for entry in root.iterdir():
                if entry.name == "ckpt":
                    continue
                assert entry.name.startswith(".ckpt.staging-"), entry.name
                leftovers.append(_check_leftover(entry))
    finally:
        helper.kill()
        helper.wait()
    # kills must land both after some commits and inside a save, else the test proves little
    assert max(values) > 0, values
    assert leftovers, "no kill landed inside a save"
    print(f"loaded save numbers {values}; leftovers {leftovers}")
