"""200 save/load cycles in a row leak no file handles and leave no temporary files."""

import os

import torch

import muonckpt

from .fixture_model import N_PARAMS, build, initial_params, train


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_200_save_load_cycles_leak_nothing(tmp_path):
    opt, _, _, _ = build(1, 1, initial_params())
    train(opt, None, 0, 0, 0, 1)
    target = tmp_path / "ckpt"
    fds_before = None
    for cycle in range(200):
        muonckpt.save(opt, target, overwrite=cycle > 0, consolidated=cycle % 2 == 1)
        muonckpt.load(opt, target)
        if cycle == 9:
            fds_before = _open_fds()
    assert _open_fds() == fds_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in target.iterdir()) == [
        "manifest.json",
        "model.pieces.json",
        "model.safetensors",
        "optimizer.pieces.json",
        "optimizer.safetensors",
    ]
    fresh, _, _, _ = build(1, 1, initial_params())
    muonckpt.load(fresh, target)
    assert len(fresh.state) == len(opt.state) == N_PARAMS
    for p, q in zip(opt.state.values(), fresh.state.values()):
        for key in p:
            assert torch.equal(p[key], q[key])
