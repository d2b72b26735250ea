"""(issue 20) A 2-rank save whose root is SIGKILLed the moment it has swapped the new checkpoint
in, before it could tell the other rank: that rank reports the commit (a warning, the path
returned), never an error over a whole new checkpoint.

The ranks are plain processes joined as torchrun joins them: a store hosted outside the ranks
(here, by the test, as torchrun's agent hosts it), each rank a client of it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

import muonckpt

from .kill_helpers import REPO

pytestmark = pytest.mark.dist

RANK_SCRIPT = r"""
import json, os, signal, sys, warnings
from datetime import timedelta
import torch
import torch.distributed as dist
torch.set_num_threads(1)
import muonckpt
from muonckpt import storage
from tests.fixture_model import build, initial_params, train

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
opt, sharded, d, t = build(2, 1, initial_params())
train(opt, sharded, d, t, 0, 1)
if rank == 0:  # killed right after its rename put the new checkpoint in place
    storage.watch_commit(out, lambda: os.kill(os.getpid(), signal.SIGKILL), staging=None)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        outcome = {"returned": str(muonckpt.save(opt, out))}
    except Exception as exc:
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
outcome["warnings"] = [str(w.message) for w in caught]
print(json.dumps(outcome), flush=True)
os._exit(0)  # the group lost its root: no orderly teardown
"""


def test_a_rank_whose_root_died_after_the_swap_reports_the_commit(tmp_path):
    out = tmp_path / "ckpt"
    store = dist.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), str(store.port), str(out)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        results = [proc.communicate(timeout=150) for proc in procs]  # the hang guard
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert procs[0].returncode == -signal.SIGKILL, results[0][1]
    assert procs[1].returncode == 0, results[1][1]
    outcome = json.loads(results[1][0].strip().splitlines()[-1])
    assert outcome.get("returned") == str(out), outcome
    assert any(w.startswith(f"committed {out}, but then:") for w in outcome["warnings"]), outcome
    assert muonckpt.verify(out) == []
    assert muonckpt.read_manifest(out).topology == {"dp": 2, "tp": 1}
