"""Provenance of a Muon checkpoint (issue 55 item 5): the momentum form of an optimizer muonckpt
does not know is recorded as ``unknown``, and a conversion that needs it refuses naming the
param; the compute view a trainer states (Megatron's ``muon_split_qkv``, dion's ``num_heads``
in its DCP groups) is recorded, and a conversion or a load into a Muon that orthogonalizes
whole matrices says so, naming both."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import muonckpt
from muonckpt import interop
from muonckpt.errors import StateDictError
from muonckpt.interop.megatron import reader as megatron

from .dion_normuon import NorMuon as DionNorMuon

MEGATRON = Path(__file__).parent / "fixtures" / "megatron" / "tp2_dp1" / "checkpoint"


def test_an_unknown_optimizers_momentum_form_is_unknown_and_no_form_is_guessed(tmp_path):
    w = torch.nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(1)))
    dion = DionNorMuon([("w", w)], lr=0.02)
    w.grad = torch.ones(8, 4)
    dion.step()
    saved = muonckpt.read_manifest(muonckpt.save(dion, tmp_path / "dion"))
    assert saved.groups[0].optimizer["momentum_form"] == "unknown"
    assert saved.groups[0].optimizer["role"] is None

    muon = torch.optim.Muon([("w", w)], lr=0.02)
    muon.step()
    ckpt = muonckpt.save(muon, tmp_path / "torch")
    with pytest.raises(StateDictError) as refused:  # into dion's NorMuon: its form is unknown
        muonckpt.load(DionNorMuon([("w", torch.nn.Parameter(torch.zeros(8, 4)))]), ckpt)
    line = str(refused.value)
    assert "\n" not in line and "param 'w'" in line and "momentum_form=" in line


def _torch_optimizers(out: Path) -> list[torch.optim.Optimizer]:
    manifest = muonckpt.read_manifest(out)
    model = load_file(out / "model.safetensors")
    opts: list[torch.optim.Optimizer] = []
    for group in manifest.groups:
        named = [(n, torch.nn.Parameter(torch.zeros_like(model[n]))) for n in group.params]
        h = group.hyperparams
        if group.optimizer["role"] == "muon":
            opts.append(torch.optim.Muon(named, lr=h["lr"], momentum=h["momentum"]))
        else:
            opts.append(torch.optim.AdamW(named, lr=h["lr"], betas=tuple(h["betas"])))
    return opts


def test_megatrons_split_qkv_is_recorded_and_a_whole_matrix_muon_is_told(tmp_path):
    as_kept = megatron.from_megatron(MEGATRON, tmp_path / "megatron")
    groups = muonckpt.read_manifest(as_kept.path).groups
    assert [g.optimizer.get("compute_view") for g in groups] == ["split_qkv", None, None]

    packaged = megatron.from_megatron(MEGATRON, tmp_path / "packaged", to="packaged")
    (note,) = [c for c in packaged.converted if "split_qkv" in c]
    assert "TensorParallelMuon orthogonalized a fused QKV matrix as its Q, K and V" in note
    assert "the target muonckpt.Muon each matrix whole" in note

    with pytest.warns(muonckpt.ConversionWarning) as caught:
        muonckpt.load(_torch_optimizers(as_kept.path), as_kept.path)
    told = [str(w.message) for w in caught if "split_qkv" in str(w.message)]
    assert told and "torch.optim.Muon each matrix whole" in told[0]


def test_dions_per_head_setting_read_from_dcp_is_told_by_a_conversion(tmp_path):
    from . import dcp_cases

    adam = {"exp_avg": "momentum", "exp_avg_sq": "variance", "settings": {"algorithm": "adamw"}}
    settings = {"algorithm": "muon", "num_heads": 2}
    dcp_cases.single_process_dcp(tmp_path / "dcp", "momentum", "mu", settings, adam)
    packaged = interop.from_dcp(tmp_path / "dcp", tmp_path / "packaged", source="dion")
    (note,) = [c for c in packaged.converted if "per_head" in c]
    assert "dion.Muon orthogonalized each attention head's block apart (per_head)" in note


def test_the_version_5_values_are_left_out_of_an_older_version_and_refused_in_one(tmp_path):
    import dataclasses
    import json

    from muonckpt.errors import CheckpointError
    from muonckpt.format.manifest_json import parse_manifest

    w = torch.nn.Parameter(torch.zeros(4, 4))
    w.grad = torch.ones(4, 4)
    sgd = torch.optim.SGD([("w", w)], lr=0.1, momentum=0.9)
    sgd.step()
    manifest = muonckpt.read_manifest(muonckpt.save(sgd, tmp_path / "sgd"))
    assert manifest.groups[0].optimizer["momentum_form"] == "unknown"
    older = dataclasses.replace(manifest, format_version=4, environment=None).to_json()
    assert json.loads(older)["groups"][0]["optimizer"]["momentum_form"] is None
    with pytest.raises(CheckpointError, match="version 4 manifest's group optimizer has no"):
        parse_manifest(older.replace('"momentum_form":null', '"momentum_form":"unknown"'), "x")


def test_a_known_optimizer_recording_an_unknown_form_is_refused_naming_the_group(tmp_path):
    from muonckpt.errors import CheckpointError
    from muonckpt.format.manifest_json import parse_manifest

    w = torch.nn.Parameter(torch.zeros(4, 4))
    muon = torch.optim.Muon([("w", w)], lr=0.02)
    text = (muonckpt.save(muon, tmp_path / "torch") / "manifest.json").read_text()
    assert '"momentum_form":"ema"' in text
    with pytest.raises(CheckpointError, match=r"group 0: optimizer 'torch.optim.Muon' is one"):
        parse_manifest(text.replace('"momentum_form":"ema"', '"momentum_form":"unknown"'), "x")
