"""``muonckpt.clean(root, 0)`` in one process while another saves over and over into the same
root (issue 30): a save never loses to the clean. Before, once in about 3,000 saves, ``save``
returned without an error while the committed checkpoint lacked its data files and the one it
replaced was gone; far more often the clean removed a save's staging directory under it.

Real processes, real saves (per rank and consolidated, in the foreground and the background,
each with ``overwrite=True`` over the last), a clean in a loop that never waits. Every save
must succeed and leave a complete checkpoint of its step at the path, which then verifies; the
clean must have met saves in progress, and removed none.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import muonckpt
from muonckpt.format.names import rank_file
from muonckpt.storage import backend

ROUNDS = 60
"""Saves racing the clean in the default tier; the ``slow`` tier runs ``SLOW_ROUNDS``."""
SLOW_ROUNDS = 150

SAVER = r"""
import json, sys
import torch
import muonckpt

root, rounds = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(128, 128)) for _ in range(4)]
opt = torch.optim.AdamW(params, lr=1e-3)
path = f"{root}/ckpt"
outcomes = []
for step in range(1, rounds + 1):
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    how = dict(overwrite=True, consolidated=step % 2 == 0, extra={"step": step})
    try:
        if step % 4 < 2:
            muonckpt.save(opt, path, **how)
        else:
            muonckpt.async_save(opt, path, **how).result()
        outcome = {"step": step, "saved": True}
    except Exception as exc:
        outcome = {"step": step, "saved": False, "error": f"{type(exc).__name__}: {exc}"}
    # what is at the path now: the new checkpoint, or (after a failure) the one before
    try:
        outcome["at_path"] = muonckpt.read_manifest(path).step
        outcome["problems"] = [str(p) for p in muonckpt.verify(path)]
    except muonckpt.CheckpointError as exc:
        outcome["at_path"], outcome["problems"] = None, [str(exc)]
    outcomes.append(outcome)
print(json.dumps(outcomes), flush=True)
"""

CLEANER = r"""
import json, os, sys
import muonckpt

root, stop = sys.argv[1], sys.argv[2]
removed, in_use, rounds = [], 0, 0
print("ready", flush=True)
while not os.path.exists(stop):
    cleaned = muonckpt.clean(root, 0)
    removed += [str(p) for p in cleaned.removed]
    in_use += sum(why.startswith("in use") for _, why in cleaned.skipped)
    rounds += 1
print(json.dumps({"removed": removed, "in_use": in_use, "rounds": rounds}), flush=True)
"""


@pytest.mark.dist
@pytest.mark.parametrize(
    "rounds", [ROUNDS, pytest.param(SLOW_ROUNDS, marks=pytest.mark.slow)], ids=str
)
def test_clean_racing_saves_never_costs_a_checkpoint(tmp_path: Path, rounds: int) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    stop = tmp_path / "stop"
    cleaner = subprocess.Popen(
        [sys.executable, "-c", CLEANER, str(root), str(stop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert cleaner.stdout is not None and cleaner.stdout.readline() == "ready\n"
        saver = subprocess.run(
            [sys.executable, "-c", SAVER, str(root), str(rounds)],
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        stop.touch()
        out, err = cleaner.communicate(timeout=120)
    assert saver.returncode == 0, saver.stderr
    assert cleaner.returncode == 0, err
    outcomes = json.loads(saver.stdout)
    last = None
    for outcome in outcomes:  # a save that failed left the one before it, whole
        last = outcome["step"] if outcome["saved"] else last
        whole = (last, []) if last is not None else (None, outcome["problems"])
        assert (outcome["at_path"], outcome["problems"]) == whole, outcome
    failed = [o for o in outcomes if not o["saved"]]
    assert failed == [], f"{len(failed)} of {rounds} saves failed, the first: {failed[0]}"
    cleaning = json.loads(out)
    assert cleaning["removed"] == []  # nothing was left over: every directory was in use
    assert cleaning["in_use"] > 0, cleaning  # it did meet saves in progress


@pytest.mark.parametrize("taken", ["data file", "lease"])
def test_a_save_never_commits_a_staging_directory_changed_under_it(tmp_path, monkeypatch, taken):
    """What a clean that cannot see the save's lock would do (on another host of a filesystem
    whose locks do not reach it, once the heartbeat seems stale): delete the staging
    directory's files, data first, lease last, between the last write and the commit. The
    commit checks what it publishes: the save fails, naming what is missing, and the previous
    checkpoint stays whole. Before, the save reported success over a checkpoint without its
    data file."""
    params = [torch.nn.Parameter(torch.randn(8, 8))]
    opt = torch.optim.AdamW(params)
    params[0].grad = torch.ones(8, 8)
    opt.step()
    path = muonckpt.save(opt, tmp_path / "ckpt", extra={"step": 1})
    before = {f.name: f.read_bytes() for f in path.iterdir()}
    opt.step()
    publish = backend.PosixStore.publish

    def intruder(store, staging, final, **options):  # right before the commit's publish
        victim = ".muonckpt-lease" if taken == "lease" else rank_file(0, 1)
        (Path(staging) / victim).unlink()
        return publish(store, staging, final, **options)

    monkeypatch.setattr(backend.PosixStore, "publish", intruder)
    gone = "its .muonckpt-lease is gone" if taken == "lease" else f"{rank_file(0, 1)} is missing"
    with pytest.raises(muonckpt.CheckpointError, match=f"not committed: .*{gone}"):
        muonckpt.save(opt, path, extra={"step": 2}, overwrite=True)
    assert {f.name: f.read_bytes() for f in path.iterdir()} == before
    assert muonckpt.verify(path) == [] and muonckpt.read_manifest(path).step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
