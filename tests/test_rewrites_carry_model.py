"""Every offline rewrite carries the model's other tensors (issue 34, "reshard drops
buffers"): a checkpoint holding buffers, params no optimizer holds and a tied name (a
consolidated ``save(..., model=model)``, and the committed torchtitan fixture read with its
buffers) goes through ``reshard`` (2 x 2, 1 x 1), ``consolidate`` and ``convert`` (``to``,
``rename``, either kind), and every such tensor is still there, bit for bit with its dtype,
read from the files its manifest names; ``verify``, ``inspect``, ``diff`` and ``load`` take the
outputs, and a strict ``dcp.load`` of ``to_torchtitan`` after a reshard finds the buffers."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from typer.testing import CliRunner

import muonckpt
from muonckpt import offline
from muonckpt.cli import app
from muonckpt.distributed.launch import run_distributed
from muonckpt.format.names import rank_file
from muonckpt.interop.dcp import files as dcp_files
from muonckpt.interop.dcp import metadata as dcp_metadata
from muonckpt.interop.torchtitan import reader as torchtitan

from .test_torchtitan import SOURCES
from .tiny_gpt import TinyGPT, optimizers, train

TIED = {"lm_head.weight": "wte.weight"}
OTHERS = {"h.bias", "scale", "ln_f.weight", "ln_f.bias"}  # buffers, and params no group holds


def _model(seed: int) -> TinyGPT:
    """TinyGPT with a bf16 buffer besides its float mask, and ``ln_f`` frozen."""
    model = TinyGPT(seed=seed)
    model.register_buffer("scale", torch.zeros(5, dtype=torch.bfloat16))
    model.ln_f.requires_grad_(False)
    return model


def _job(seed: int):
    model = _model(seed)
    return model, optimizers([(n, p) for n, p in model.named_parameters() if p.requires_grad])


def _saved(path: Path):
    model, opts = _job(seed=0)
    train(model, opts, 0, 2)
    with torch.no_grad():  # values of their own, so that a copy of another tensor would show
        model.h.bias.copy_(torch.randn_like(model.h.bias))
        model.scale.copy_(torch.randn(5).to(torch.bfloat16))
        model.ln_f.weight.add_(torch.randn(model.ln_f.weight.shape))
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return muonckpt.save(opts, path, consolidated=True, model=model), opts, expected


def _model_values(out: Path) -> dict[str, torch.Tensor]:
    """Each model tensor of the checkpoint at ``out``, read from where its manifest says."""
    manifest = muonckpt.read_manifest(out)
    assert manifest.model is not None
    entries = {t.name: t for t in manifest.model.tensors}
    values = {}
    for piece in manifest.model.pieces:
        entry = entries[piece.param]
        assert piece.region.numel == entry.numel  # stored whole, once
        with safe_open(out / piece.file, "pt") as f:
            values[piece.param] = f.get_tensor(piece.tensor).reshape(entry.shape)
    assert values.keys() == entries.keys()
    return values


def _check(out: Path, expected: dict[str, torch.Tensor], prefix: str = "") -> None:
    assert muonckpt.verify(out) == [], out
    manifest = muonckpt.read_manifest(out)
    assert manifest.model is not None
    assert dict(manifest.model.aliases) == {prefix + a: prefix + n for a, n in TIED.items()}
    values = _model_values(out)
    assert set(values) == {prefix + n for n in OTHERS}, out
    for name in OTHERS:
        got, want = values[prefix + name], expected[name]
        assert got.dtype == want.dtype and torch.equal(got, want), (out, name)
    if manifest.kind == "per-rank":
        first = rank_file(0, len(manifest.files))
        assert {p.file for p in manifest.model.pieces} == {first}
    summary = offline.summarize(out)
    assert summary.model is not None and set(summary.model.tensors) == set(values)


def test_reshard_consolidate_and_convert_keep_the_model_tensors(tmp_path):
    ck, opts, expected = _saved(tmp_path / "ck")
    _check(ck, expected)
    r22 = offline.reshard(ck, tmp_path / "2x2", dp=2, tp=2)
    r11 = offline.reshard(r22, tmp_path / "1x1", dp=1, tp=1)
    full = offline.consolidate(r11, tmp_path / "full")
    packed = offline.convert(r22, tmp_path / "packed", to="packaged", rename={"": "module."})
    named = offline.convert(full, tmp_path / "named", rename={"": "module."})
    torch_form = offline.convert(full, tmp_path / "torch", to="packaged")
    for out in (r22, r11, full, torch_form):
        _check(out, expected)
    for out in (packed, named):
        _check(out, expected, "module.")
    fresh = _model(seed=1)  # the model file of a rewrite loads strictly, tied weights re-tied
    safetensors.torch.load_model(fresh, full / "model.safetensors")
    assert fresh.lm_head.weight is fresh.wte.weight
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    with safe_open(full / "model.safetensors", "pt") as f:
        assert f.metadata() == {**TIED, "format": "muonckpt"}
    rows = {(r.param, r.key): r for r in offline.diff(ck, r22)}
    assert all(rows[name, "param"].bitwise for name in OTHERS)
    assert rows["model", "aliases"].equal
    _, again = _job(seed=1)  # a load of the per-rank output meets the model section unharmed
    muonckpt.load(again, r22)
    for old, new in zip(opts, again, strict=True):
        for p, q in zip(old.param_groups[0]["params"], new.param_groups[0]["params"], strict=True):
            for key, value in old.state[p].items():
                assert torch.equal(new.state[q][key], value), key


def test_a_sharded_consolidated_source_keeps_its_model_index_exact(tmp_path):
    """``consolidate`` past ``max_shard_size`` spreads the model tensors over ``model-*``
    files with the params; ``convert --rename`` rebuilds the index of exactly what it wrote."""
    ck, _, expected = _saved(tmp_path / "ck")
    sharded = offline.consolidate(ck, tmp_path / "sharded", max_shard_size=400)
    assert len({p.file for p in muonckpt.read_manifest(sharded).model.pieces}) > 1
    _check(sharded, expected)
    result = CliRunner().invoke(
        app, ["convert", str(sharded), "-o", str(tmp_path / "n"), "--rename", "=module."]
    )
    assert result.exit_code == 0, result.output
    _check(tmp_path / "n", expected, "module.")
    index = (tmp_path / "n" / "model.safetensors.index.json").read_text()
    assert '"module.h.bias"' in index and '"h.bias"' not in index


def test_torchtitan_loads_the_buffers_strictly_after_a_reshard(tmp_path):
    """The torchtitan fixture read with its buffers, resharded to 2 x 2 (the buffers in rank
    0's file), written back as torchtitan's layout: a strict ``dcp.load`` of every tensor the
    source has finds each, bitwise (``gate_scale`` included)."""
    ours = torchtitan.from_torchtitan(SOURCES["manager"], tmp_path / "ours", model_buffers=True)
    resharded = offline.reshard(ours.path, tmp_path / "2x2", dp=2, tp=2)
    assert muonckpt.verify(resharded) == []
    assert {"layers.0.gate_scale", "layers.1.gate_scale"} <= set(_model_values(resharded))
    back = tmp_path / "checkpoint" / "step-3"
    back.parent.mkdir()
    torchtitan.to_torchtitan(resharded, back)
    theirs = dcp_metadata.read_index(SOURCES["manager"] / "step-3")
    truth = {f: dcp_files.read_tensor(theirs, t) for f, t in theirs.tensors.items()}
    assert "layers.1.gate_scale" in truth
    state = {f: torch.zeros_like(t) for f, t in truth.items()}
    dcp.load(state, checkpoint_id=str(back))  # strict: a missing key fails
    for fqn, value in truth.items():
        assert state[fqn].dtype == value.dtype and torch.equal(state[fqn], value), fqn


def _same_files(expected: Path, actual: Path) -> None:
    names = sorted(p.name for p in expected.iterdir())
    assert sorted(p.name for p in actual.iterdir()) == names
    for name in names:
        assert (actual / name).read_bytes() == (expected / name).read_bytes(), name


def _shared(operation: str, src: str, dst: str, options: dict) -> str:
    """(each rank) ``operation`` shared among the ranks of the default group."""
    return str(getattr(offline, operation)(src, dst, collective=True, **options))


@pytest.mark.dist
def test_ranks_sharing_the_writing_write_the_model_tensors_byte_for_byte_alike(tmp_path):
    """Two processes share the writing (``collective``), the model tensors among the planned
    tensors: the output is the single process's, every file byte for byte."""
    ck, _, expected = _saved(tmp_path / "ck")
    single = offline.reshard(ck, tmp_path / "r1", dp=2, tp=2)
    options = {"dp": 2, "tp": 2}
    shared = Path(run_distributed(_shared, 2, "reshard", str(ck), str(tmp_path / "r2"), options)[0])
    _same_files(single, shared)
    options = {"max_shard_size": 400}
    full = run_distributed(_shared, 2, "consolidate", str(single), str(tmp_path / "c2"), options)
    full = Path(full[0])
    _same_files(offline.consolidate(single, tmp_path / "c1", max_shard_size=400), full)
    _check(full, expected)
