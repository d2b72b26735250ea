"""Emerging-Optimizers 0.3.0's ``AdaptiveMuon`` (``adamuon``, ``normuon``, ``namo``) and ``Muown``
(a cited port), as the package wrote them at world 2: ``tests/fixtures/emerging/KIND/checkpoint``
with the optimizer's state in memory at the save (``truth.safetensors``), both made by
``tests/fixtures/emerging/make_fixtures.py`` in the Python 3.12 venv the package needs.

Read here without the package: each shape rule recorded, and every state tensor (shape, dtype,
value) and non-tensor state equal to the truth after consolidate, and after a reshard to
``dp=1, tp=2`` (and back) where the rules allow; namo's scalar statistic of a whole matrix
refuses any reshard that cuts the matrix, in one line. That the package resumes from these
bit for bit is the trainers tier's (tests/test_trainers_emerging.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import muonckpt
from muonckpt import offline
from muonckpt.errors import LayoutError

FIXTURES = Path(__file__).parent / "fixtures" / "emerging"
KINDS = ("adamuon", "normuon", "namo", "muown")
ROWS = {"0.weight": 16, "2.weight": 24}
RESHARD = {
    "adamuon": {"0.weight": 0, "2.weight": 1},
    "normuon": {"0.weight": 1, "2.weight": 0},
    "muown": {"0.weight": 0, "2.weight": 0},
}
"""As make_fixtures.RESHARD: the ``dp=1, tp=2`` split each kind's shape rules allow."""


def _truth(kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    path = FIXTURES / kind / "truth.safetensors"
    with safe_open(str(path), "pt") as f:
        others = json.loads(f.metadata()["state"])
    return load_file(path), others


def assert_is_the_truth(kind: str, consolidated: Path) -> None:
    """Every tensor of the consolidated checkpoint is the truth's, bitwise with its shape and
    dtype, and it holds every tensor of the truth; non-tensor state (Muown's ``step``) too."""
    truth, others = _truth(kind)
    got = {
        k.removeprefix("state."): v
        for k, v in load_file(consolidated / "optimizer.safetensors").items()
    }
    got |= {f"{n}.param": v for n, v in load_file(consolidated / "model.safetensors").items()}
    assert got.keys() == truth.keys(), sorted(got.keys() ^ truth.keys())
    for key, want in truth.items():
        assert (got[key].shape, got[key].dtype) == (want.shape, want.dtype), key
        assert torch.equal(got[key], want), key
    manifest = muonckpt.read_manifest(consolidated)
    for name, state in others.items():
        for key, value in state.items():
            assert manifest.param(name).scalars[key].value == value, (name, key)


@pytest.mark.parametrize("kind", KINDS)
def test_consolidate_and_reshard_give_back_every_state_tensor_exactly(kind, tmp_path):
    saved = FIXTURES / kind / "checkpoint"
    assert muonckpt.verify(saved) == []
    whole = Path(offline.consolidate(saved, tmp_path / "whole"))
    assert_is_the_truth(kind, whole)
    if kind not in RESHARD:
        return
    tp2 = offline.reshard(saved, tmp_path / "tp2", dp=1, tp=2, tp_split_dims=RESHARD[kind])
    assert muonckpt.verify(tp2) == []
    assert_is_the_truth(kind, Path(offline.consolidate(tp2, tmp_path / "back")))


def test_each_shape_rule_is_recorded():
    def shapes(kind: str, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        manifest = muonckpt.read_manifest(FIXTURES / kind / "checkpoint")
        return {k: (s.rule, s.shape) for k, s in manifest.param(name).state_shapes.items()}

    assert shapes("adamuon", "0.weight") == {}  # moment2_buffer shaped like its param
    # normuon: the mean over the longer side
    assert shapes("normuon", "0.weight") == {"moment2_buffer": ("column", (1, 24))}
    assert shapes("normuon", "2.weight") == {"moment2_buffer": ("row", (24, 1))}
    assert shapes("namo", "2.weight") == {"moment2_buffer": ("scalar", (1,))}
    manifest = muonckpt.read_manifest(FIXTURES / "muown" / "checkpoint")
    for name, rows in ROWS.items():
        keys = ("g", "v_norm", "m_g", "v_g")
        assert shapes("muown", name) == dict.fromkeys(keys, ("row", (rows, 1)))
        entry = manifest.param(name)
        assert entry.dtype_of("param") == "BF16"
        assert {entry.dtype_of(k) for k in (*keys, "momentum_buffer")} == {"F32"}
        assert entry.scalars["step"].value == 3
    assert manifest.groups[0].optimizer["optimizer"] == (
        "emerging_optimizers.orthogonalized_optimizers.muown.Muown"
    )


def test_a_reshard_that_cuts_namos_scalar_statistic_is_refused_in_one_line(tmp_path):
    saved = FIXTURES / "namo" / "checkpoint"
    with pytest.raises(LayoutError) as refused:
        offline.reshard(saved, tmp_path / "tp2", dp=1, tp=2, tp_split_dims={"0.weight": 0})
    line = str(refused.value)
    assert "\n" not in line and "'0.weight'" in line and "'moment2_buffer'" in line
    assert "scalar" in line and "1 x 2 layout" in line and "nothing was written" in line
    assert not (tmp_path / "tp2").exists()
