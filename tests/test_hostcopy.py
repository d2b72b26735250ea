"""``HostBuffers.start_snapshot``: host copies made at once, CUDA ones issued at once and
waited for later (a background save's exchange in between), all complete once waited for."""

from __future__ import annotations

import pytest
import torch

from muonckpt.state.hostcopy import HostBuffers


def _state(device: str = "cpu") -> dict[str, torch.Tensor]:
    """Two dtypes and a non-contiguous view."""
    return {
        "m": torch.randn(60, 70, device=device),
        "t": torch.randn(70, 60, device=device).t(),
        "h": torch.randn(100, device=device).to(torch.bfloat16),
    }


def _check(device: str) -> None:
    state = _state(device)
    pending = HostBuffers().start_snapshot(state)
    pending.wait()
    pending.wait()  # idempotent
    for key, tensor in state.items():
        copy = pending.copies[key]
        assert copy.device.type == "cpu" and torch.equal(copy, tensor.reshape(-1).cpu()), key
        tensor.add_(1)  # the sources change: the copies do not
        assert not torch.equal(copy, tensor.reshape(-1).cpu()), key


def test_a_snapshot_is_complete_once_waited_for_and_stays_as_taken():
    _check("cpu")


@pytest.mark.cuda
def test_a_cuda_snapshot_is_complete_once_waited_for_and_stays_as_taken():
    _check("cuda")
