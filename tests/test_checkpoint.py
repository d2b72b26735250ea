"""safetensors checkpoints: save at one dp x tp, load at another, continue bit for bit."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from ckpt_cases import load_phase, save_phase
from resume_cases import assemble, phase

import muonckpt
from muonckpt.launch import run_distributed

K, M = 3, 2


@pytest.fixture(scope="module")
def reference():
    return assemble(1, 1, run_distributed(phase, 1, 1, 1, None, None, 0, K + M, None, timeout=60))


def _save(tmp, dp, tp, consolidated):
    ckpt, params = tmp / "ckpt", tmp / "params.pt"
    shards = run_distributed(
        save_phase, dp * tp, dp, tp, K, str(ckpt), consolidated, None, timeout=120
    )
    torch.save(assemble(dp, tp, shards), params)
    return ckpt, params


@pytest.mark.parametrize("consolidated", [False, True])
@pytest.mark.parametrize(
    "src,dst", [((2, 2), (4, 2)), ((2, 2), (1, 1)), ((4, 2), (2, 4)), ((1, 1), (2, 2))]
)
def test_resume_from_checkpoint_is_bitwise(tmp_path, reference, src, dst, consolidated):
    ckpt, params = _save(tmp_path, *src, consolidated)
    assert muonckpt.verify(ckpt) == []
    shards = run_distributed(
        load_phase, dst[0] * dst[1], *dst, str(params), str(ckpt), K, M, timeout=120
    )
    full = assemble(*dst, shards)
    for name, value in reference.items():
        assert torch.equal(full[name], value), name


def test_consolidated_file_opens_with_safetensors(tmp_path):
    ckpt, _ = _save(tmp_path, 2, 2, True)
    tensors = safetensors.torch.load_file(ckpt / "optimizer.safetensors")
    assert tensors["state.w_in.momentum_buffer"].shape == (12, 20)
    assert tensors["state.embed.exp_avg_sq"].shape == (8, 12)
    manifest = muonckpt.read_manifest(ckpt)
    assert manifest.topology == {"dp": 2, "tp": 2}
    assert manifest.step == K
