"""Replicated optimizers under DDP (issue 21, item 1): torch.optim optimizers whose state is
the same on every rank save and load with no hooks, a list of them as one checkpoint, written
once (the ranks sharing the writing), read by every rank, at any world size."""

from __future__ import annotations

import pytest
import torch

import muonckpt
from muonckpt.distributed.launch import run_distributed

from .ddp_cases import (
    Net,
    ddp_resume_phase,
    ddp_save_phase,
    diverged_save_phase,
    optimizers_of,
)

pytestmark = pytest.mark.dist


def test_a_ddp_job_with_torch_muon_and_adamw_resumes_at_another_world_size_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = run_distributed(ddp_save_phase, 2, str(ckpt), 3, timeout=180)
    assert saved[0].keys() == saved[1].keys()
    assert any(".momentum_buffer" in k for k in saved[0]) and any(".exp_avg" in k for k in saved[0])
    # Written once, the ranks sharing the writing: each param's state and values in one file.
    manifest = muonckpt.read_manifest(ckpt)
    written = [(piece.param, piece.key) for piece in manifest.pieces]
    tensors = [key for key, value in saved[0].items() if value.dim()]  # (steps: in the manifest)
    assert len(written) == len(set(written)) == len(tensors)
    assert {piece.file for piece in manifest.pieces} == {
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    }
    assert muonckpt.verify(ckpt) == []
    resumed = run_distributed(ddp_resume_phase, 3, str(ckpt), 3, 2, timeout=180)
    for rank in resumed:  # every rank of the new world holds exactly what was saved
        assert rank["loaded"].keys() == saved[0].keys()
        for key, value in saved[0].items():
            assert torch.equal(rank["loaded"][key], value), key
    for key, value in resumed[0]["trained"].items():  # and they step on as replicas
        assert all(torch.equal(rank["trained"][key], value) for rank in resumed[1:]), key
    # One process reads the same checkpoint (a per-rank save of replicas) as well.
    net = Net()
    muon, adamw = optimizers_of(net)
    muonckpt.load([muon, adamw], ckpt)
    assert torch.equal(net.head.weight, saved[0]["param.head.weight"])
    momentum = muon.state[net.head.weight]["momentum_buffer"]
    assert torch.equal(momentum, saved[0]["opt0.head.weight.momentum_buffer"])


def test_replicas_that_differ_are_refused_at_save(tmp_path):
    """The cheap replica check: each rank's digest of its replicated state, compared."""
    ckpt = tmp_path / "ckpt"
    said = run_distributed(diverged_save_phase, 2, str(ckpt), timeout=180)
    assert said[0] == said[1], said
    assert "param 'embed.weight': state 'exp_avg' differs between ranks 0 and 1" in said[0], said
    assert not ckpt.exists()
