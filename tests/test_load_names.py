"""Names as real training scripts have them: DDP's ``module.`` and torch.compile's
``_orig_mod.`` prefixes, mapped by ``load(..., rename=...)`` and ``convert --rename``, and
named in the error when they are the only difference."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

import muonckpt
from muonckpt.cli import app
from muonckpt.distributed.launch import run_distributed
from muonckpt.format.renames import names_hint, prefix_fix

from .tiny_gpt import TinyGPT, optimizers, train

K, M = 3, 2


def _state(opts: list[torch.optim.Optimizer], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every param's values and state tensors, by the model's own param name."""
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for opt in opts:
        for p, state in opt.state.items():
            out[names[p]] = p.detach().clone()
            for key, value in state.items():
                out[f"{names[p]}/{key}"] = value.clone()
    return out


def _compiled_checkpoint(path, **options) -> tuple[dict[str, torch.Tensor], object]:
    """A checkpoint of optimizers built from a torch.compile'd model's names (``_orig_mod.*``),
    and what it holds."""
    model = TinyGPT(seed=0)
    compiled = torch.compile(model)  # never called: only its names matter here
    opts = optimizers(list(compiled.named_parameters()))
    train(model, opts, 0, K)
    return _state(opts, model), muonckpt.save(opts, path, **options)


def test_torch_compile_names_load_with_rename_and_the_error_names_the_prefix(tmp_path):
    saved, ckpt = _compiled_checkpoint(tmp_path / "ckpt")
    assert muonckpt.read_manifest(ckpt).params[0].name.startswith("_orig_mod.")
    model = TinyGPT(seed=1)
    opts = optimizers(list(model.named_parameters()))
    with pytest.raises(muonckpt.CheckpointError) as caught:
        muonckpt.load(opts, ckpt)
    message = str(caught.value)
    assert "'_orig_mod.'" in message and "torch.compile" in message
    assert "rename={'_orig_mod.': ''}" in message
    muonckpt.load(opts, ckpt, rename={"_orig_mod.": ""})
    loaded = _state(opts, model)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_an_optimizer_without_names_is_told_to_use_named_parameters(tmp_path):
    _, ckpt = _compiled_checkpoint(tmp_path / "ckpt")
    model = TinyGPT(seed=1)
    unnamed = [torch.optim.AdamW(model.parameters())]
    with pytest.raises(muonckpt.CheckpointError, match=r"named_parameters\(\)"):
        muonckpt.load(unnamed, ckpt)


def test_a_function_renames_too_and_collisions_are_refused(tmp_path):
    saved, ckpt = _compiled_checkpoint(tmp_path / "ckpt")
    model = TinyGPT(seed=1)
    opts = optimizers(list(model.named_parameters()))
    muonckpt.load(opts, ckpt, rename=lambda name: name.removeprefix("_orig_mod."))
    assert all(torch.equal(_state(opts, model)[k], saved[k]) for k in saved)
    with pytest.raises(muonckpt.CheckpointError, match="one name 'x'"):
        muonckpt.load(opts, ckpt, rename=lambda name: "x")


def test_adding_a_prefix_is_named_and_mapped(tmp_path):
    model = TinyGPT(seed=0)
    opts = optimizers(list(model.named_parameters()))
    train(model, opts, 0, K)
    saved, ckpt = _state(opts, model), muonckpt.save(opts, tmp_path / "ckpt")
    wrapped = torch.nn.Module()
    wrapped.model = TinyGPT(seed=1)
    targets = optimizers(list(wrapped.named_parameters()))
    with pytest.raises(muonckpt.CheckpointError, match=r"rename=\{'': 'model\.'\}"):
        muonckpt.load(targets, ckpt)
    muonckpt.load(targets, ckpt, rename={"": "model."})
    assert all(torch.equal(_state(targets, wrapped.model)[k], saved[k]) for k in saved)


def ddp_train_and_save(path: str, steps: int) -> dict[str, torch.Tensor]:
    """(In a gloo child.) The model wrapped in DDP, its optimizers built from the wrapper's
    names (``module.*``), as a DDP script has them."""
    model = TinyGPT(seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opts = optimizers(list(ddp.named_parameters()))
    train(ddp, opts, 0, steps)
    muonckpt.save(opts, path)
    return {n: p.detach() for n, p in model.named_parameters()}


def resume_unwrapped(path: str | None, first: int, steps: int) -> dict[str, torch.Tensor]:
    """(In a gloo child.) A plain model from other initial weights, loaded from a DDP
    checkpoint by stripping ``module.``, trained on (``path`` None: from the start)."""
    model = TinyGPT(seed=0 if path is None else 1)
    opts = optimizers(list(model.named_parameters()))
    if path is not None:
        muonckpt.load(opts, path, rename={"module.": ""})
    train(model, opts, first, steps)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.dist
def test_a_ddp_checkpoint_resumes_unwrapped_bitwise(tmp_path):
    ckpt = tmp_path / "ddp"
    run_distributed(ddp_train_and_save, 1, str(ckpt), K, timeout=120)
    assert all(e.name.startswith("module.") for e in muonckpt.read_manifest(ckpt).params)
    (resumed,) = run_distributed(resume_unwrapped, 1, str(ckpt), K, M, timeout=120)
    (expected,) = run_distributed(resume_unwrapped, 1, None, 0, K + M, timeout=120)
    assert resumed.keys() == expected.keys()
    assert all(torch.equal(resumed[n], expected[n]) for n in expected)
    model = TinyGPT(seed=1)
    with pytest.raises(muonckpt.CheckpointError, match="DDP"):
        muonckpt.load(optimizers(list(model.named_parameters())), ckpt)


@pytest.mark.parametrize("consolidated", [False, True], ids=["per-rank", "consolidated"])
def test_convert_renames_offline(tmp_path, consolidated):
    shards = {"consolidated": True, "max_shard_size": 600} if consolidated else {}
    saved, src = _compiled_checkpoint(tmp_path / "src", **shards)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["convert", str(src), "-o", str(out), "--rename", "_orig_mod.="]
    )
    assert result.exit_code == 0, result.output
    assert muonckpt.verify(out) == []
    if consolidated:  # the HF index lists the renamed keys, each in the file that holds it
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(n for n, _ in TinyGPT().named_parameters())
        from safetensors import safe_open

        for key, file in index["weight_map"].items():
            with safe_open(out / file, "pt") as f:
                assert key in set(f.keys())
    fresh = TinyGPT(seed=1)
    targets = optimizers(list(fresh.named_parameters()))
    muonckpt.load(targets, out)
    loaded = _state(targets, fresh)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    bad = CliRunner().invoke(app, ["convert", str(src), "-o", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--rename" in bad.output


NAME = st.lists(st.sampled_from("abcxyz_0"), min_size=1, max_size=4).map("".join)


@given(
    names=st.lists(
        st.lists(NAME, min_size=1, max_size=3).map(".".join), min_size=1, max_size=6, unique=True
    ),
    prefix=st.sampled_from(["module.", "_orig_mod.", "model.", "_orig_mod.module.", "a.b."]),
)
def test_prefix_fix_finds_the_prefix_that_maps_one_list_onto_the_other(names, prefix):
    prefixed = [prefix + n for n in names]
    assert prefix_fix(prefixed, names) is not None
    for saved, current in ((prefixed, names), (names, prefixed)):
        (fix,) = [prefix_fix(saved, current)]
        mapped = sorted(muonckpt.format.renames.renamer(fix)(n) for n in saved)
        assert mapped == sorted(current)
    assert names_hint(names, names) is None
    assert names_hint(names, [n + "x" for n in names]) is None or len(names) == 1


@pytest.mark.dist
def test_the_readme_rename_example_runs_as_written(tmp_path, monkeypatch):
    from .test_readme import example

    monkeypatch.chdir(tmp_path)
    (saved,) = run_distributed(ddp_train_and_save, 1, "ckpt/ddp-step-1000", K, timeout=120)
    model = TinyGPT(seed=1)
    opts = optimizers(list(model.named_parameters()))
    exec(compile(example("rename"), "docs/usage.md", "exec"), {"muonckpt": muonckpt, "opts": opts})
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
