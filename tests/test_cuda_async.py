"""``async_save`` of state in CUDA memory (skipped without a GPU): the snapshot goes through
pinned host buffers reused between saves, and the checkpoint loads back bitwise onto the GPU."""

from __future__ import annotations

import pytest
import torch

import muonckpt
from muonckpt.checkpoint.api import _HOST_BUFFERS

pytestmark = pytest.mark.cuda


def _cuda_adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(16, 32, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_cuda_state_snapshots_through_pinned_buffers_and_loads_back(tmp_path):
    model, opt = _cuda_adamw()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    future = muonckpt.async_save(opt, tmp_path / "a")
    # Training goes on at once, on another stream (which the copy's stream order would not
    # protect): the checkpoint keeps the values at the call.
    with torch.no_grad(), torch.cuda.stream(torch.cuda.Stream()):
        for p in model.parameters():
            p.add_(1.0)
        for state in opt.state.values():
            state["exp_avg"].fill_(float("nan"))
    assert future.result(timeout=60) == tmp_path / "a"
    arena = _HOST_BUFFERS[opt]._buffers["snapshot"]
    assert arena.is_pinned()
    muonckpt.async_save(opt, tmp_path / "b").result(timeout=60)
    assert _HOST_BUFFERS[opt]._buffers["snapshot"].data_ptr() == arena.data_ptr()

    fresh_model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)).cuda()
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=1e-2)
    muonckpt.load(fresh, tmp_path / "a")
    for (name, p), value in zip(fresh_model.named_parameters(), expected.values(), strict=True):
        assert p.is_cuda and torch.equal(p, value), name
    for state, moment in zip(fresh.state.values(), moments, strict=True):
        assert state["exp_avg"].is_cuda and torch.equal(state["exp_avg"], moment)
