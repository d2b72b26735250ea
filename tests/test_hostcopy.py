"""``HostBuffers.start_snapshot``: host copies made on a worker thread while the caller goes on
(a background save's exchanges), complete once waited for, and usable after a fork."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from muonckpt.state import hostcopy
from muonckpt.state.hostcopy import HostBuffers


def _state() -> dict[str, torch.Tensor]:
    """Past the size copied in the caller's thread: two dtypes, a non-contiguous view."""
    return {
        "m": torch.randn(600, 700),
        "t": torch.randn(700, 600).t(),
        "h": torch.randn(1000).to(torch.bfloat16),
        "s": torch.ones(3),
    }


def test_a_snapshot_is_made_on_the_worker_and_complete_once_waited_for():
    state = _state()
    pending = HostBuffers().start_snapshot(state)
    assert hostcopy._Copier._here is not None, "the host copies did not go to the worker"
    # a daemon: an idle worker must not keep a launcher's rank (which joins the threads
    # that are not daemons) or an interpreter from ending
    assert [t.daemon for t in threading.enumerate() if t.name == "muonckpt-copy"] == [True]
    pending.wait()
    pending.wait()  # idempotent
    for key, tensor in state.items():
        assert torch.equal(pending.copies[key], tensor.reshape(-1)), key
        tensor.add_(1)  # the sources change: the copies do not
        assert not torch.equal(pending.copies[key], tensor.reshape(-1)), key


def test_a_small_snapshot_is_copied_in_the_callers_thread(monkeypatch):
    monkeypatch.setattr(hostcopy._Copier, "_here", None)
    pending = HostBuffers().start_snapshot({"s": torch.ones(8)})
    assert hostcopy._Copier._here is None
    assert torch.equal(pending.copies["s"], torch.ones(8))  # before any wait


@pytest.mark.dist
def test_a_forked_child_snapshots_without_its_parents_worker():
    """A child forked after the parent's threaded snapshot has no worker thread: it makes its
    own instead of queueing work for one that does not exist (which would never finish)."""
    HostBuffers().snapshot(_state())
    assert hostcopy._Copier._here is not None
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's exit code is the assertion
        source = torch.randn(600, 700)  # compared in numpy: torch's parallel ops may hang
        copy = HostBuffers().snapshot({"m": source})["m"]  # in a child forked from a test run
        os._exit(0 if np.array_equal(copy.numpy(), source.numpy().reshape(-1)) else 1)
    deadline = time.monotonic() + 60  # a child that hangs is killed, and the test fails
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        pytest.fail("the forked child's snapshot never finished")
    assert os.waitstatus_to_exitcode(done[1]) == 0
