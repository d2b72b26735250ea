"""DCP checkpoints of FSDP2 / DTensor Muons in and out of muonckpt (issue 23).

An FSDP2 job (``fully_shard`` on CPU, gloo, world 2) with a DTensor Muon of torch.optim.Muon's
math trains and writes DCP in DCP's recipe layout and torchtitan's; converted to the packaged
Muon it loads at 2 x 2 and 4 x 1. A packaged 2 x 2 checkpoint converted to DCP is loaded by an
FSDP2 job at world 4, which trains on as torch.optim.Muon + AdamW do from the same state.
Single-process DCP checkpoints in dion's (sum form) and muon-fsdp2's (EMA) conventions, and
the refusals: no ``--from``, a pickled foreign class, a truncated ``.distcp``, a key that
maps to no param.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from typer.testing import CliRunner

import muonckpt
from muonckpt import CheckpointError, interop, offline
from muonckpt.cli import app
from muonckpt.distributed.launch import run_distributed

from . import dcp_cases
from .fixture_model import ADAMW_PARAMS, MUON_HPARAMS, MUON_PARAMS, build, initial_params, train

MU = MUON_HPARAMS["momentum"]
K = 3


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """The FSDP2 job's DCP checkpoints (both layouts) and its full state after K steps."""
    root = tmp_path_factory.mktemp("fsdp")
    paths = {"recipe": str(root / "recipe"), "torchtitan": str(root / "titan")}
    states = run_distributed(dcp_cases.train_and_save, 2, initial_params(), K, paths, timeout=180)
    return paths, states[0]


def _converted(out) -> tuple[dict, dict]:
    return load_file(out / "model.safetensors"), load_file(out / "optimizer.safetensors")


def _assert_matches_job(out, job) -> None:
    """Params bitwise, momentum EMA / (1 - mu) within rounding, AdamW state and step exact."""
    model, state = _converted(out)
    for name in MUON_PARAMS:
        assert torch.equal(model[name], job[name]), name
        torch.testing.assert_close(
            state[f"state.{name}.momentum_buffer"],
            job[f"{name}.momentum_buffer"] / (1 - MU),
            rtol=1e-6,
            atol=1e-7,
        )
    for name in ADAMW_PARAMS:
        assert torch.equal(model[name], job[name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[f"state.{name}.{key}"], job[f"{name}.{key}"]), (name, key)
    manifest = muonckpt.read_manifest(out)
    adamw = next(g for g in manifest.groups if g.optimizer["role"] == "adamw")
    assert adamw.hyperparams["step"] == K  # the packaged Muon counts AdamW steps per group
    muon = next(g for g in manifest.groups if g.optimizer["role"] == "muon")
    assert muon.optimizer["momentum"] == MU and muon.optimizer["converted_from"]


def _load_and_resave(dp: int, tp: int, src: str, dst: str) -> None:
    """(gloo child) The packaged Muon built from zeros, loaded, saved consolidated."""
    opt, _, _, _ = build(dp, tp, {n: torch.zeros_like(t) for n, t in initial_params().items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", muonckpt.ConversionWarning)
        muonckpt.load(opt, src)
    muonckpt.save(opt, dst, consolidated=True)


@pytest.mark.dist
@pytest.mark.parametrize("layout,dp,tp", [("recipe", 2, 2), ("torchtitan", 4, 1)])
def test_fsdp2_dcp_into_the_packaged_muon(fsdp_run, tmp_path, layout, dp, tp):
    paths, job = fsdp_run
    out = tmp_path / "packaged"
    report = interop.from_dcp(paths[layout], out, source="torch", to="packaged")
    assert report.layout == layout
    assert any("ema -> sum" in line for line in report.converted)
    if layout == "torchtitan":
        assert {line.split()[0] for line in report.left_out} == {
            "lr_scheduler",
            "dataloader",
            "train_state",
        }
    assert muonckpt.verify(out) == []
    _assert_matches_job(out, job)
    resaved = tmp_path / "resaved"
    run_distributed(_load_and_resave, dp * tp, dp, tp, str(out), str(resaved), timeout=180)
    rows = [r for r in offline.diff(out, resaved) if r.key != "hyperparams"]
    assert rows and all(r.bitwise for r in rows if r.key != "step"), rows


def _save_packaged_2x2(path: str) -> None:
    opt, sharded, d, t = build(2, 2, initial_params())
    train(opt, sharded, d, t, 0, K)
    muonckpt.save(opt, path)


@pytest.mark.dist
def test_packaged_2x2_into_an_fsdp2_job_at_world_4(tmp_path):
    src = tmp_path / "packaged"
    run_distributed(_save_packaged_2x2, 4, str(src), timeout=180)
    out = tmp_path / "dcp"
    result = CliRunner().invoke(
        app, ["convert", str(src), "-o", str(out), "--to", "torch", "--format", "dcp"]
    )
    assert result.exit_code == 0, result.output
    assert "sum -> ema" in result.output
    zeros = {n: torch.zeros_like(t) for n, t in initial_params().items()}
    ranks = run_distributed(dcp_cases.load_and_continue, 4, zeros, str(out), K, 2, timeout=180)
    loaded, trained = ranks[0]["loaded"], ranks[0]["trained"]
    consolidated = offline.consolidate(src, tmp_path / "c")
    model, state = _converted(consolidated)
    for name in MUON_PARAMS:
        assert torch.equal(loaded[name], model[name]), name
        torch.testing.assert_close(
            loaded[f"{name}.momentum_buffer"], state[f"state.{name}.momentum_buffer"] * (1 - MU)
        )
    for name in ADAMW_PARAMS:
        assert torch.equal(loaded[name], model[name]), name
        assert torch.equal(loaded[f"{name}.exp_avg"], state[f"state.{name}.exp_avg"]), name
        assert float(loaded[f"{name}.step"]) == K
    assert ranks[0]["settings"]["adjust_lr_fn"] == "match_rms_adamw"
    assert ranks[0]["settings"]["momentum"] == MU
    # It continues as torch.optim.Muon + AdamW continue from the same checkpoint.
    from .test_convert import BUILD, fresh, step_all

    params = fresh(zeros=True)
    opts = BUILD["torch"](params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", muonckpt.ConversionWarning)
        muonckpt.load(opts, src)
    step_all(opts, params, K, 2)
    for name, value in params.items():
        torch.testing.assert_close(trained[name], value.detach(), rtol=1e-5, atol=1e-6)
        assert not torch.equal(trained[name], loaded[name]), name


@pytest.mark.parametrize(
    "family,momentum_key,mu_setting,extra,adam,form",
    [
        (
            "dion",
            "momentum",
            "mu",
            {"algorithm": "muon"},
            {"exp_avg": "momentum", "exp_avg_sq": "variance", "settings": {"algorithm": "adamw"}},
            "sum",
        ),
        (
            "muon-fsdp2",
            "m",
            "momentum",
            {"use_muon": True},
            {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "step": 4,
             "settings": {"use_muon": False}},
            "ema",
        ),
    ],
)  # fmt: skip
def test_sum_and_ema_sources(tmp_path, family, momentum_key, mu_setting, extra, adam, form):
    src = tmp_path / "dcp"
    w, b, m, a, v = dcp_cases.single_process_dcp(src, momentum_key, mu_setting, extra, adam)
    for to, expected in (("packaged", "sum"), ("torch", "ema")):
        out = interop.from_dcp(src, tmp_path / to, source=family, to=to).path
        model, state = _converted(out)
        assert torch.equal(model["w"], w) and torch.equal(model["b"], b)
        factor = 1.0 if form == expected else (1 - 0.9 if expected == "ema" else 1 / (1 - 0.9))
        if factor == 1.0:
            assert torch.equal(state["state.w.momentum_buffer"], m)
        else:
            torch.testing.assert_close(state["state.w.momentum_buffer"], m * factor)
        assert torch.equal(state["state.b.exp_avg"], a)
        assert torch.equal(state["state.b.exp_avg_sq"], v)
        manifest = muonckpt.read_manifest(out)
        assert manifest.step_of(manifest.param("b")) == 4


@pytest.mark.dist
def test_convert_of_dcp_without_from_is_refused_naming_the_choices(fsdp_run, tmp_path):
    paths, _ = fsdp_run
    out = tmp_path / "x"
    result = CliRunner().invoke(
        app, ["convert", paths["recipe"], "-o", str(out), "--to", "packaged"]
    )
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "--from" in text and "dion" in text and "muon-fsdp2" in text and "torchtitan" in text
    assert not out.exists()
    result = CliRunner().invoke(
        app,
        ["convert", paths["recipe"], "-o", str(out), "--to", "packaged", "--from", "torch"],
    )
    assert result.exit_code == 0, result.output
    assert "ema -> sum" in result.output


class _Payload:
    """Unpickled, it would create the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_foreign_class_in_the_metadata_is_refused_unrun(tmp_path):
    src = tmp_path / "dcp"
    dcp_cases.single_process_dcp(src, "momentum_buffer", "momentum", {}, {"exp_avg": "exp_avg",
                        "exp_avg_sq": "exp_avg_sq"})  # fmt: skip
    marker = tmp_path / "was-run"
    (src / ".metadata").write_bytes(pickle.dumps({"state": _Payload(str(marker))}))
    with pytest.raises(CheckpointError, match=r"pathlib.*not a class DCP metadata"):
        interop.from_dcp(src, tmp_path / "out", source="torch")
    assert not marker.exists() and not (tmp_path / "out").exists()
    pickle.loads((src / ".metadata").read_bytes())  # the payload is live: plain pickle runs it
    assert marker.exists()


def test_a_truncated_distcp_is_refused(tmp_path):
    src = tmp_path / "dcp"
    dcp_cases.single_process_dcp(src, "momentum_buffer", "momentum", {}, {"exp_avg": "exp_avg",
                        "exp_avg_sq": "exp_avg_sq"})  # fmt: skip
    (data,) = [p for p in src.iterdir() if p.suffix == ".distcp"]
    os.truncate(data, data.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=r"past the end of the file .* truncated"):
        interop.from_dcp(src, tmp_path / "out", source="torch")
    assert not (tmp_path / "out").exists()


def test_a_key_that_maps_to_no_param_is_refused_naming_it(tmp_path):
    src = tmp_path / "dcp"
    extra = {"state.ghost.momentum_buffer": torch.ones(2, 2)}
    dcp.save(
        {
            "model": {"w": torch.ones(2, 2)},
            "optimizer": {
                "state.w.momentum_buffer": torch.ones(2, 2),
                "param_groups.w.momentum": 0.9,
                **extra,
            },
        },
        checkpoint_id=str(src),
    )
    with pytest.raises(
        CheckpointError, match=r"'optimizer\.state\.ghost\.momentum_buffer' maps to"
    ):
        interop.from_dcp(src, tmp_path / "out", source="torch")
    assert not (tmp_path / "out").exists()


def test_to_dcp_in_the_recipe_layout_loads_in_one_process(tmp_path):
    """dion's sum form through muonckpt into torch's DCP, DCP's recipe layout: loaded by
    ``dcp.load`` into a ``{"model": ..., "optimizer": ...}`` state dict as written."""
    src = tmp_path / "dion"
    adam = {"exp_avg": "momentum", "exp_avg_sq": "variance", "settings": {"algorithm": "adamw"}}
    w, b, m, a, v = dcp_cases.single_process_dcp(src, "momentum", "mu", {"algorithm": "muon"}, adam)
    packaged = interop.from_dcp(src, tmp_path / "packaged", source="dion").path
    assert muonckpt.read_manifest(packaged).dcp_layout == "recipe"  # the layout read
    out = interop.to_dcp(packaged, tmp_path / "torch", to="torch")  # the way back keeps it
    assert out.layout == "recipe" and any("sum -> ema" in line for line in out.converted)
    refused = CliRunner().invoke(app, ["inspect", str(src)])  # (issue 57) named, with the way in
    said = " ".join(refused.output.split())
    assert refused.exit_code == 2 and "is a DCP checkpoint, not a muonckpt one" in said, said
    assert "--from WRITER (one of packaged, torch, torchtitan, keller-jordan, dion" in said
    with pytest.raises(CheckpointError, match="already exists"):
        interop.to_dcp(packaged, tmp_path / "torch", to="torch")
    groups = {
        "w": {k: v for k, v in torch.optim.Muon([torch.zeros(2, 2)]).param_groups[0].items()},
        "b": {k: v for k, v in torch.optim.AdamW([torch.zeros(2)]).param_groups[0].items()},
    }
    optimizer = {
        "state.w.momentum_buffer": torch.zeros(6, 4),
        "state.b.exp_avg": torch.zeros(5),
        "state.b.exp_avg_sq": torch.zeros(5),
        "state.b.step": torch.tensor(0.0),
    }
    for name, group in groups.items():
        optimizer.update({f"param_groups.{name}.{k}": x for k, x in group.items() if k != "params"})
    state = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(5)}, "optimizer": optimizer}
    dcp.load(state, checkpoint_id=str(out.path))
    assert torch.equal(state["model"]["w"], w) and torch.equal(state["model"]["b"], b)
    torch.testing.assert_close(state["optimizer"]["state.w.momentum_buffer"], m * (1 - 0.9))
    assert torch.equal(state["optimizer"]["state.b.exp_avg"], a)
    assert torch.equal(state["optimizer"]["state.b.exp_avg_sq"], v)
    assert float(state["optimizer"]["state.b.step"]) == 4
    assert state["optimizer"]["param_groups.w.momentum"] == 0.9
    assert state["optimizer"]["param_groups.b.betas"] == (0.9, 0.95)


@pytest.mark.dist
def test_the_cli_reports_what_it_left_out_and_prefixes_can_be_given(fsdp_run, tmp_path):
    paths, _ = fsdp_run

    def convert(out: str, *options: str):
        argv = ["convert", paths["torchtitan"], "-o", str(tmp_path / out), "--to", "packaged"]
        result = CliRunner().invoke(app, [*argv, "--from", "torchtitan", *options])
        return result.exit_code, " ".join(result.output.split())  # unwrapped

    code, output = convert("p")
    assert code == 0, output
    for item in ("lr_scheduler", "dataloader", "train_state"):
        assert f"left out {item}" in output
    assert "DCP layout torchtitan" in output
    code, output = convert("q", "--model-prefix", "net.")
    assert code == 2 and "'net.w_in'" in output and "model_prefix" in output, output
    code, output = convert("r", "--model-prefix", "")
    assert code == 0 and "DCP layout torchtitan" in output, output


def test_to_dcp_carries_the_model_file_and_reports_the_jobs_state(tmp_path):
    """A checkpoint with a whole model file and the job's own state: the model's other tensor
    and the tied alias are written as model tensors; the extra state, which DCP output does
    not carry, is named as left out, never dropped silently."""
    from .tiny_gpt import TinyGPT, optimizers, train

    model = TinyGPT(seed=0)
    opts = optimizers(list(model.named_parameters()))
    train(model, opts, 0, 1)
    ck = muonckpt.save(opts, tmp_path / "ck", consolidated=True, model=model, extra={"step": 1})
    out = interop.to_dcp(ck, tmp_path / "dcp", to="torch", layout="recipe")
    assert out.left_out == ("extra / rank_extra (the job's own state, saved with the optimizer)",)
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(out.path))  # strict: every model key is found
    for name, value in model.state_dict().items():
        assert torch.equal(state["model"][name], value), name
