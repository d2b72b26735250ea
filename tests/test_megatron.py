"""Megatron-Core's layer-wise Muon in: the committed torch_dist fixtures (written by Megatron
itself, ``tests/fixtures/megatron/make_fixtures.py``) read without Megatron, every value checked
bitwise against the optimizer's in-memory state, then loaded into torch.optim.Muon + AdamW."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import muonckpt
from muonckpt import CheckpointError, ConversionWarning, offline
from muonckpt.cli import app
from muonckpt.interop import megatron

FIXTURES = Path(__file__).parent / "fixtures" / "megatron"
NAMES = sorted(p.parent.name for p in FIXTURES.glob("*/truth.safetensors"))


def _ckpt(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each fixture converted as Megatron keeps it (no --to), once."""
    root = tmp_path_factory.mktemp("mcore")
    return {name: megatron.from_megatron(_ckpt(name), root / name).path for name in NAMES}


def test_the_fixtures_are_here():
    assert {"tp2_dp1", "tp1_dp2", "tp2_dp1_reshardable", "tp1_dp2_reshardable"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_value_is_the_truth_bitwise(converted, name):
    out, truth = converted[name], load_file(FIXTURES / name / "truth.safetensors")
    model = load_file(out / "model.safetensors")
    state = load_file(out / "optimizer.safetensors")
    manifest = muonckpt.read_manifest(out)
    for key, expected in truth.items():
        param, _, what = key.rpartition(".")
        if what == "step":
            assert manifest.param(param).scalars["step"].value == expected.item(), key
            continue
        got = model[param] if what == "param" else state[f"state.{param}.{what}"]
        assert got.dtype == expected.dtype and torch.equal(got, expected), key
    assert {k.rpartition(".")[0] for k in truth} == set(model)
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in model
    assert muonckpt.verify(out) == []
    muon = [g.optimizer for g in manifest.groups if g.optimizer["role"] == "muon"]
    assert muon and all(g["momentum_form"] == "ema" for g in muon)
    assert all(g["optimizer"] == "megatron.core.optimizer.TensorParallelMuon" for g in muon)


def _torch_opts(model: dict, manifest) -> tuple[list[torch.optim.Optimizer], dict]:
    params = {n: torch.nn.Parameter(torch.zeros_like(t)) for n, t in model.items()}
    opts: list[torch.optim.Optimizer] = []
    for group in manifest.groups:
        h, named = group.hyperparams, [(n, params[n]) for n in group.params]
        if group.optimizer["role"] == "muon":
            nesterov = bool(group.optimizer.get("nesterov"))
            opts.append(
                torch.optim.Muon(named, lr=h["lr"], momentum=h["momentum"], nesterov=nesterov)
            )
        else:
            betas = tuple(h["betas"])
            opts.append(torch.optim.AdamW(named, lr=h["lr"], betas=betas, eps=h["eps"]))
    return opts, params


@pytest.mark.parametrize("name", ["tp2_dp1", "tp1_dp2_reshardable"])
def test_it_loads_into_torch_muon_and_adamw_exactly(converted, name):
    out, truth = converted[name], load_file(FIXTURES / name / "truth.safetensors")
    opts, params = _torch_opts(load_file(out / "model.safetensors"), muonckpt.read_manifest(out))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        muonckpt.load(opts, out)
    for n, p in params.items():
        assert torch.equal(p.detach(), truth[f"{n}.param"]), n
    for opt in opts:
        for group in opt.param_groups:
            for n, p in zip(group["param_names"], group["params"], strict=True):
                for key, value in opt.state[p].items():
                    expected = truth[f"{n}.{key}"]
                    if key == "step":
                        assert float(value) == float(expected), n
                    else:
                        assert torch.equal(value, expected.to(value.dtype)), (n, key)


def test_converted_for_the_packaged_muon_it_reshards_and_diffs(tmp_path):
    out = megatron.from_megatron(_ckpt("tp2_dp1"), tmp_path / "p", to="packaged").path
    assert muonckpt.verify(out) == []
    resharded = offline.reshard(out, tmp_path / "r", dp=2, tp=2)
    rows = offline.diff(out, resharded)
    assert rows and all(r.bitwise for r in rows if r.key != "hyperparams"), rows


def test_the_cli_reads_the_root_and_the_iteration(tmp_path):
    runner = CliRunner()
    for i, src in enumerate([_ckpt("tp1_dp2"), _ckpt("tp1_dp2") / "iter_0000003"]):
        dst = tmp_path / f"o{i}"
        args = ["convert", str(src), "-o", str(dst), "--from", "megatron", "--to", "torch"]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert muonckpt.verify(dst) == []
    for args in (["inspect", str(tmp_path / "o0")], ["diff", str(tmp_path / "o0"), str(dst)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output


def test_refusals_are_one_line_naming_the_file(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(_ckpt("tp2_dp1"), root)
    (root / megatron.LATEST).write_text("12")
    with pytest.raises(CheckpointError, match="iter_0000012 is not a directory") as info:
        megatron.from_megatron(root, tmp_path / "x")
    assert "\n" not in str(info.value) and megatron.LATEST in str(info.value)
    (root / megatron.LATEST).write_text("3")
    (root / "iter_0000003" / megatron.DIST_METADATA).write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(CheckpointError, match="torch_dist only") as info:
        megatron.from_megatron(root, tmp_path / "y")
    assert megatron.DIST_METADATA in str(info.value)


def test_readme_megatron_commands_run_as_written(tmp_path, monkeypatch):
    """The README's Megatron commands as written, in process, on a copy of a fixture."""
    import shlex

    from .test_readme import example

    shutil.copytree(_ckpt("tp2_dp1"), tmp_path / "mcore" / "ckpt")
    monkeypatch.chdir(tmp_path)
    for command in example("megatron-commands").strip().splitlines():
        argv = shlex.split(command)
        assert argv[0] == "muonckpt"
        result = CliRunner().invoke(app, argv[1:])
        assert result.exit_code == 0, result.output
    assert muonckpt.verify(tmp_path / "ckpt" / "from-mcore-2x2") == []
    assert muonckpt.read_manifest(tmp_path / "ckpt" / "from-mcore-2x2").topology == {
        "dp": 2,
        "tp": 2,
    }
