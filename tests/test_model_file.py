"""A consolidated ``model.safetensors`` that a model loads strictly: with ``save(...,
model=model)`` it holds the model's whole ``state_dict()`` (buffers included), tied weights
stored once with the alias in the file's metadata (as ``safetensors.torch.save_model`` has
it), so ``safetensors.torch.load_model`` loads it with ``strict=True`` and re-ties."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from safetensors import safe_open
from typer.testing import CliRunner

import muonckpt
from muonckpt.cli import app
from muonckpt.distributed.launch import run_distributed

from .tiny_gpt import TinyGPT, batch, optimizers, train


def _trained(steps: int = 2):
    model = TinyGPT(seed=0)
    opts = optimizers(list(model.named_parameters()))
    train(model, opts, 0, steps)
    return model, opts


def _assert_same_model(loaded: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert loaded.lm_head.weight is loaded.wte.weight  # still tied


@pytest.mark.parametrize("background", [False, True], ids=["save", "async_save"])
def test_a_tied_gpt_loads_strictly_from_the_consolidated_model_file(tmp_path, background):
    model, opts = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    if background:
        ckpt = muonckpt.async_save(opts, tmp_path / "full", consolidated=True, model=model)
        ckpt = ckpt.result(timeout=60)
    else:
        ckpt = muonckpt.save(opts, tmp_path / "full", consolidated=True, model=model)
    assert muonckpt.verify(ckpt) == []
    shown = CliRunner().invoke(app, ["inspect", str(ckpt)])
    assert "model file also holds: h.bias; tied names: lm_head.weight = wte.weight" in shown.stdout
    path = ckpt / "model.safetensors"
    with safe_open(path, "pt") as f:
        assert f.metadata()["lm_head.weight"] == "wte.weight"
        assert "lm_head.weight" not in set(f.keys()) and "h.bias" in set(f.keys())
    fresh = TinyGPT(seed=1)
    missing, unexpected = safetensors.torch.load_model(fresh, path, strict=True)
    assert (missing, unexpected) == (set(), [])
    _assert_same_model(fresh, expected)
    # the README's plain-torch form: the aliases from the metadata, then load_state_dict
    state = safetensors.torch.load_file(path)
    with safe_open(path, "pt") as f:
        state |= {alias: state[name] for alias, name in f.metadata().items() if name in state}
    plain = TinyGPT(seed=2)
    plain.load_state_dict(state, strict=True)
    _assert_same_model(plain, expected)
    # the optimizers still resume from it
    again = TinyGPT(seed=3)
    resumed = optimizers(list(again.named_parameters()))
    muonckpt.load(resumed, ckpt)
    for a, b in zip(opts, resumed, strict=True):
        for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True):
            assert torch.equal(p, q)
            assert all(torch.equal(a.state[p][k], b.state[q][k]) for k in a.state[p])


def test_without_the_model_the_file_holds_the_optimizers_params_only(tmp_path):
    model, opts = _trained()
    ckpt = muonckpt.save(opts, tmp_path / "full", consolidated=True)
    state = safetensors.torch.load_file(ckpt / "model.safetensors")
    assert sorted(state) == sorted(n for n, _ in model.named_parameters())
    missing, unexpected = TinyGPT(seed=1).load_state_dict(state, strict=False)
    assert sorted(missing) == ["h.bias", "lm_head.weight"] and unexpected == []


def test_a_damaged_buffer_is_found_by_verify(tmp_path):
    model, opts = _trained()
    ckpt = muonckpt.save(opts, tmp_path / "full", consolidated=True, model=model)
    damaged = shutil.copytree(ckpt, tmp_path / "damaged")
    raw = bytearray((damaged / "model.safetensors").read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    start = json.loads(raw[8 : 8 + length])["h.bias"]["data_offsets"][0]
    raw[8 + length + start] ^= 0xFF
    (damaged / "model.safetensors").write_bytes(bytes(raw))
    problems = muonckpt.verify(damaged)
    assert problems and any("h.bias" in str(p) for p in problems), problems


def test_model_mistakes_are_refused_before_anything_is_written(tmp_path):
    model, opts = _trained()
    with pytest.raises(muonckpt.CheckpointError, match="consolidated=True"):
        muonckpt.save(opts, tmp_path / "a", model=model)
    compiled = optimizers(list(torch.compile(model).named_parameters()))
    with pytest.raises(muonckpt.CheckpointError, match="_orig_mod"):
        muonckpt.save(compiled, tmp_path / "b", consolidated=True, model=model)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def packaged_save(path: str, dp: int, tp: int) -> dict[str, torch.Tensor]:
    """(In a gloo child.) The packaged Muon, ZeRO-1 over dp x tp, on the tied GPT replicated
    on every rank; a consolidated save with the model."""
    dp_group, tp_group = muonckpt.distributed.grid_groups(dp, tp)
    model = TinyGPT(seed=0)
    named = list(model.named_parameters())
    hidden = [(n, p) for n, p in named if p.ndim == 2 and n.startswith("h.")]
    sharded = muonckpt.optim.sharding.shard_for_groups(
        [
            {"params": hidden, "use_muon": True},
            {"params": [(n, p) for n, p in named if (n, p) not in hidden]},
        ],
        dp_group,
        tp_group,
    )
    opt = muonckpt.optim.muon.Muon(sharded.param_groups, lr=0.02)
    opt.enable_distributed_mode(sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas)
    for step in range(2):
        x, y = batch(step)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        model.zero_grad()
        loss.backward()
        sharded.grads_to_optimizer()
        opt.step()
        sharded.params_to_model()
    muonckpt.save(opt, path, consolidated=True, model=model)
    dist.barrier()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.dist
def test_the_packaged_muon_writes_a_whole_model_file_from_a_grid(tmp_path):
    ckpt = tmp_path / "full"
    states = run_distributed(packaged_save, 2, str(ckpt), 2, 1, timeout=120)
    assert muonckpt.verify(ckpt) == []
    fresh = TinyGPT(seed=1)
    safetensors.torch.load_model(fresh, ckpt / "model.safetensors", strict=True)
    _assert_same_model(fresh, states[0])


def test_the_readme_model_file_example_runs_as_written(tmp_path, monkeypatch):
    from .test_readme import example

    monkeypatch.chdir(tmp_path)
    model, opts = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    namespace = {"muonckpt": muonckpt, "model": model, "opts": opts}
    exec(compile(example("model-file"), "docs/usage.md", "exec"), namespace)
    _assert_same_model(model, expected)
    fresh = TinyGPT(seed=1)
    safetensors.torch.load_model(fresh, tmp_path / "ckpt/step-1000-model/model.safetensors")
    _assert_same_model(fresh, expected)


def test_rewrites_of_a_checkpoint_with_a_model_file_stay_consistent(tmp_path):
    """Renaming carries the model section's tensors and aliases along; ``convert`` (which
    keeps the model's other tensors, renamed with the params) writes an index of exactly what
    it wrote."""
    from muonckpt import offline
    from muonckpt.format.manifest_json import parse_manifest

    model, opts = _trained()
    ck = muonckpt.save(opts, tmp_path / "ck", consolidated=True, model=model, max_shard_size=400)
    renamed = muonckpt.read_manifest(ck).renamed({"": "module."})
    again = parse_manifest(renamed.to_json(), ck / "manifest.json")
    assert again.model is not None
    assert {t.name for t in again.model.tensors} == {"module.h.bias"}
    assert again.model.aliases == {"module.lm_head.weight": "module.wte.weight"}
    for out, settings in (("torch", {"to": "torch"}), ("named", {"rename": {"": "module."}})):
        done = offline.convert(ck, tmp_path / out, **settings)
        assert muonckpt.verify(done) == []
        index = json.loads((done / "model.safetensors.index.json").read_text())["weight_map"]
        stored = {}
        for name in set(index.values()):
            with safe_open(done / name, "pt") as f:
                stored.update(dict.fromkeys(f.keys(), name))
        assert index == stored


def test_offline_rewrites_carry_the_tied_names(tmp_path):
    """``reshard``, ``consolidate`` and ``convert`` keep the model's tied names, in the
    manifest and in a consolidated output's model file header, and its other tensors
    (tests/test_rewrites_carry_model.py checks their values)."""
    from muonckpt import offline

    model, opts = _trained()
    tied = {"lm_head.weight": "wte.weight"}
    ck = muonckpt.save(opts, tmp_path / "ck", consolidated=True, model=model)
    per_rank = offline.reshard(ck, tmp_path / "1x2", dp=1, tp=2)
    full = offline.consolidate(per_rank, tmp_path / "full")
    torch_form = offline.convert(full, tmp_path / "torch", to="torch")
    for out in (per_rank, full, torch_form):
        assert muonckpt.verify(out) == []
        manifest = muonckpt.read_manifest(out)
        assert manifest.model is not None and dict(manifest.model.aliases) == tied, out
        assert [t.name for t in manifest.model.tensors] == ["h.bias"], out
    for out in (full, torch_form):
        with safe_open(out / "model.safetensors", "pt") as f:
            assert f.metadata() == {**tied, "format": "muonckpt"}
    rows = {(r.param, r.key): r for r in offline.diff(ck, full)}
    assert rows["model", "aliases"].equal


def test_diff_sees_the_model_file_the_job_state_and_the_step(tmp_path):
    """Two checkpoints equal in every optimizer tensor but not in a buffer, ``extra`` or the
    recorded step: ``diff`` names each difference, and two copies of one are all equal."""
    from muonckpt import offline

    model, opts = _trained()
    a = muonckpt.save(opts, tmp_path / "a", consolidated=True, model=model, extra={"lr": 0.1})
    with torch.no_grad():
        model.h.bias.add_(1.0)
    b = muonckpt.save(
        opts, tmp_path / "b", consolidated=True, model=model, extra={"lr": 0.5, "step": 7}
    )
    rows = {(r.param, r.key): r for r in offline.diff(a, b)}
    assert not rows["h.bias", "param"].equal
    assert not rows["extra", "values"].equal
    assert not rows["checkpoint", "step"].equal
    assert rows["model", "aliases"].equal
    assert all(r.equal for r in offline.diff(a, shutil.copytree(a, tmp_path / "copy")))
