"""safetensors checkpoints: save at one dp x tp, load at another, continue bit for bit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch

import muonckpt
from muonckpt.distributed.launch import run_distributed

from .ckpt_cases import load_phase, overwrite_phase, save_phase
from .fixture_model import SHAPES, STATE_KEYS, assemble, build, initial_params, train

K, M = 3, 2


@pytest.fixture(scope="module")
def reference(reference_params):
    return reference_params(K + M)


def save_both(dp: int, tp: int, root: str) -> None:
    """(gloo child) Both kinds, saved after the same K steps, from one launch."""
    for consolidated in (False, True):
        save_phase(dp, tp, K, f"{root}/{_kind(consolidated)}", consolidated)


def _kind(consolidated: bool) -> str:
    return "consolidated" if consolidated else "per-rank"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Callable[[tuple[int, int], bool], Path]:
    """``saved((dp, tp), consolidated)``: the checkpoint of K steps at dp x tp, both kinds
    saved by one launch the first time either is asked for. Shared: only read it."""
    launched: dict[tuple[int, int], Path] = {}

    def get(topology: tuple[int, int], consolidated: bool) -> Path:
        if topology not in launched:
            root = tmp_path_factory.mktemp(f"saved-{topology[0]}x{topology[1]}")
            run_distributed(save_both, topology[0] * topology[1], *topology, str(root), timeout=120)
            launched[topology] = root
        return launched[topology] / _kind(consolidated)

    return get


@pytest.mark.dist
@pytest.mark.parametrize("consolidated", [False, True])
@pytest.mark.parametrize(
    "src,dst", [((2, 2), (4, 2)), ((2, 2), (1, 1)), ((4, 2), (2, 4)), ((1, 1), (2, 2))]
)
def test_resume_from_checkpoint_is_bitwise(saved, reference, src, dst, consolidated):
    ckpt = saved(src, consolidated)
    assert muonckpt.verify(ckpt) == []
    shards = run_distributed(load_phase, dst[0] * dst[1], *dst, str(ckpt), K, M, timeout=120)
    full = assemble(*dst, shards)
    for name, value in reference.items():
        assert torch.equal(full[name], value), name


@pytest.mark.dist
def test_distributed_save_over_a_checkpoint_replaces_it_whole(tmp_path):
    ckpt = tmp_path / "ckpt"
    steps = run_distributed(overwrite_phase, 4, 2, 2, str(ckpt), timeout=120)
    assert steps == [2] * 4
    # The four ranks deleted the replaced per-rank files between them: nothing is left over.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "manifest.json",
        "model.pieces.json",
        "model.safetensors",
        "optimizer.pieces.json",
        "optimizer.safetensors",
    ]
    assert muonckpt.read_manifest(ckpt).step == 2 and muonckpt.verify(ckpt) == []


@pytest.mark.dist
def test_consolidated_file_opens_with_safetensors(saved):
    ckpt = saved((2, 2), True)
    tensors = safetensors.torch.load_file(ckpt / "optimizer.safetensors")
    # Every state tensor at its full shape, however the 2 x 2 run had sharded it.
    assert set(tensors) == {f"state.{n}.{k}" for n, keys in STATE_KEYS.items() for k in keys}
    for name, keys in STATE_KEYS.items():
        for key in keys:
            assert tensors[f"state.{name}.{key}"].shape == SHAPES[name], (name, key)
    manifest = muonckpt.read_manifest(ckpt)
    assert manifest.topology == {"dp": 2, "tp": 2}
    assert manifest.step == K


def test_consolidated_save_shards_past_max_shard_size(tmp_path):
    opt, _, _, _ = build(1, 1, initial_params())
    train(opt, None, 0, 0, 0, 2)
    ckpt = muonckpt.save(opt, tmp_path / "ckpt", consolidated=True, max_shard_size=1024)
    index = json.loads((ckpt / "optimizer.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 1 and files[0] == f"optimizer-00001-of-{len(files):05d}.safetensors"
    tensors = {}
    for file in files:
        tensors.update(safetensors.torch.load_file(ckpt / file))
    assert set(tensors) == set(index["weight_map"])
    names = [n for g in opt.param_groups for n in g["param_names"]]
    flat = [p for g in opt.param_groups for p in g["params"]]
    for name, p in zip(names, flat):
        for key, value in opt.state[p].items():
            assert torch.equal(tensors[f"state.{name}.{key}"], value)
    assert muonckpt.verify(ckpt) == []
    fresh, _, _, _ = build(1, 1, initial_params())
    muonckpt.load(fresh, ckpt)
    for p, q in zip(flat, [p for g in fresh.param_groups for p in g["params"]]):
        assert all(torch.equal(opt.state[p][k], fresh.state[q][k]) for k in opt.state[p])
