"""torchtitan's DistMuon in and out: the committed fixtures (written by torchtitan 0.3.0 itself,
``tests/fixtures/torchtitan/make_fixtures.py``: its CheckpointManager's ``step-3`` and
``get_state_dict`` + ``dcp.save``) read without torchtitan, every value checked bitwise against
the optimizers' in-memory state, then loaded into torch.optim.Muon + AdamW; and written back as
torchtitan's layout. That torchtitan loads the output at world 1 and 4 is the trainers tier's
(tests/test_trainers_torchtitan.py)."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import muonckpt
from muonckpt import CheckpointError, ConversionWarning, interop, offline
from muonckpt.cli import app
from muonckpt.format.manifest_json import parse_manifest
from muonckpt.interop import registry
from muonckpt.interop.dcp import files as dcp_files
from muonckpt.interop.dcp import metadata as dcp_metadata
from muonckpt.interop.torchtitan import reader as torchtitan

FIXTURES = Path(__file__).parent / "fixtures" / "torchtitan"
SOURCES = {"manager": FIXTURES / "checkpoint", "get_state_dict": FIXTURES / "getsd"}
TRUTH = load_file(FIXTURES / "truth.safetensors")
EXPERTS = ("layers.0.experts", "layers.1.experts")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each fixture converted as DistMuon keeps it (no ``to``), buffers carried, once."""
    root = tmp_path_factory.mktemp("titan")
    return {
        name: torchtitan.from_torchtitan(src, root / name, model_buffers=True).path
        for name, src in SOURCES.items()
    }


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_value_is_the_truth_bitwise(converted, name):
    out = converted[name]
    model, state = load_file(out / "model.safetensors"), load_file(out / "optimizer.safetensors")
    manifest = muonckpt.read_manifest(out)
    for key, expected in TRUTH.items():
        param, _, what = key.rpartition(".")
        if what == "step":
            assert manifest.param(param).scalars["step"].value == expected.item(), key
            continue
        got = model[param] if what == "param" else state[f"state.{param}.{what}"]
        assert got.dtype == expected.dtype and torch.equal(got, expected), key
    assert model["layers.0.experts"].shape == (4, 8, 16)
    assert torch.equal(model["layers.1.gate_scale"], torch.linspace(0.5, 1.5, 4))
    assert muonckpt.verify(out) == []
    muon = [g for g in manifest.groups if g.optimizer["role"] == "muon"]
    assert [g.optimizer["optimizer"] for g in muon] == ["torchtitan.DistMuon"]
    assert muon[0].optimizer["momentum_form"] == "ema" and muon[0].optimizer["nesterov"] is True
    assert muon[0].optimizer["lr_rule"] == "moonlight" and set(EXPERTS) <= set(muon[0].params)
    settings = json.loads((FIXTURES / "truth.json").read_text())["params"]
    assert muon[0].hyperparams["lr"] == settings["layers.0.wq.weight"]["lr"]


def test_what_is_left_out_is_named_and_the_lr_schedule_is_carried(tmp_path):
    """The buffers are named as left out; the LR schedulers' state (torchtitan 0.3.0 saves
    their ``last_epoch``) and the step travel in ``extra`` (the job saved no data loader)."""
    report = torchtitan.from_torchtitan(SOURCES["manager"], tmp_path / "a")
    assert report.left_out == ("layers.0.gate_scale", "layers.1.gate_scale")
    manifest = muonckpt.read_manifest(report.path)
    assert manifest.step == 3 and manifest.extra.shared.values["step"] == 3
    trainer = manifest.extra.shared.values["trainer"]
    assert trainer["name"] == "torchtitan" and trainer["ranks"] == {}
    assert trainer["shared"] == {"lr_scheduler": {"last_epoch": 3}}
    assert "gate_scale" not in str(load_file(tmp_path / "a" / "model.safetensors").keys())
    report = torchtitan.from_torchtitan(SOURCES["get_state_dict"], tmp_path / "b")
    assert report.left_out == ("model.layers.0.gate_scale", "model.layers.1.gate_scale")


def _torch_opts(out: Path) -> tuple[list[torch.optim.Optimizer], dict]:
    """torch.optim.Muon for the 2-D DistMuon params, AdamW for the rest, built from zeros, as
    the checkpoint's groups say."""
    manifest = muonckpt.read_manifest(out)
    shapes = {p.name: p.shape for p in manifest.params}
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in shapes.items() if n not in EXPERTS}
    opts: list[torch.optim.Optimizer] = []
    for group in manifest.groups:
        h, named = group.hyperparams, [(n, params[n]) for n in group.params if n in params]
        if group.optimizer["role"] == "muon":
            opts.append(
                torch.optim.Muon(
                    named, lr=h["lr"], momentum=h["momentum"], adjust_lr_fn=h["adjust_lr_fn"]
                )
            )
        else:
            opts.append(torch.optim.AdamW(named, lr=h["lr"], betas=tuple(h["betas"]), eps=h["eps"]))
    return opts, params


def test_torch_muon_takes_no_3d_expert_and_the_load_says_so(converted):
    """torch.optim.Muon refuses 3-D params when built, so DistMuon's experts have no place in
    it; a load without them is refused naming them, never a silent partial resume."""
    with pytest.raises(ValueError):
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(4, 8, 16))])
    opts, _ = _torch_opts(converted["manager"])
    with pytest.raises(CheckpointError, match=r"layers\.0\.experts"):
        muonckpt.load(opts, converted["manager"])


def test_to_torchtitan_writes_the_source_back(converted, tmp_path):
    back = tmp_path / "checkpoint" / "step-3"
    back.parent.mkdir()
    torchtitan.to_torchtitan(converted["manager"], back)
    mine = dcp_metadata.read_index(back)
    theirs = dcp_metadata.read_index(SOURCES["manager"] / "step-3")
    assert set(mine.tensors) == set(theirs.tensors)
    for fqn, item in theirs.tensors.items():
        got = dcp_files.read_tensor(mine, mine.tensors[fqn])
        assert torch.equal(got, dcp_files.read_tensor(theirs, item)), fqn
    optimizer = {f for f in theirs.values if f.startswith("optimizer.")}
    assert optimizer | {"lr_scheduler.last_epoch"} == set(mine.values)
    for fqn in [*optimizer, "lr_scheduler.last_epoch"]:
        got, want = (dcp_files.read_value(i, i.values[fqn]) for i in (mine, theirs))
        assert got == want or list(got) == list(want), fqn


def test_the_cli_finds_the_format_and_the_newest_step(tmp_path):
    assert registry.detect(SOURCES["manager"]) is interop.torchtitan.FORMAT
    runner = CliRunner()
    for i, args in enumerate(
        [
            [str(SOURCES["manager"])],
            [str(SOURCES["manager"] / "step-3"), "--from", "torchtitan", "--to", "torch"],
        ]
    ):
        result = runner.invoke(app, ["convert", *args, "-o", str(tmp_path / f"o{i}")])
        assert result.exit_code == 0, result.output
        assert "left out" in result.output
        # carried from torchtitan's folder; named as left out by the plain DCP route
        assert ("left out lr_scheduler" in result.output) == (i == 1), result.output
    result = runner.invoke(app, ["convert", str(tmp_path / "o0"), "-o", str(tmp_path / "t")])
    assert result.exit_code != 0
    args = ["convert", str(tmp_path / "o0"), "-o", str(tmp_path / "t"), "--to", "torchtitan"]
    assert runner.invoke(app, args).exit_code == 0
    assert dcp_metadata.is_dcp(tmp_path / "t")


def test_an_unknown_lr_rule_is_refused_naming_it(tmp_path):
    src = tmp_path / "step-3"
    shutil.copytree(SOURCES["manager"] / "step-3", src)
    index = dcp_metadata.read_index(src)
    values = {f: dcp_files.read_value(index, v) for f, v in index.values.items()}
    values["optimizer.param_groups.layers.0.wq.weight.adjust_lr_fn"] = "spectral_unclamped"
    shapes = {f: (tuple(t.shape), t.dtype) for f, t in index.tensors.items()}
    tensors = {f: dcp_files.read_tensor(index, t) for f, t in index.tensors.items()}
    fresh = tmp_path / "fresh" / "step-3"
    dcp_files.write_dcp(fresh, shapes, values, lambda f, _: tensors[f])
    with pytest.raises(CheckpointError, match="spectral_unclamped"):
        torchtitan.from_torchtitan(fresh, tmp_path / "x")


def test_split_experts_resume_bitwise_in_torch_muon_and_adamw(tmp_path):
    """The DistMuon job, 3-D experts and all, resumes bit for bit in torch.optim.Muon + AdamW
    built from zeros: with ``--split-experts`` each expert's (8, 16) matrix is a 2-D param of
    its own, ``layers.<l>.experts.<e>``, which DistMuon's batched Newton-Schulz treats as one
    matrix too."""
    out = tmp_path / "split"
    args = [str(SOURCES["manager"]), "-o", str(out), "--to", "torch", "--split-experts"]
    result = CliRunner().invoke(app, ["convert", *args])
    assert result.exit_code == 0, result.output
    manifest = muonckpt.read_manifest(out)
    names = [p.name for p in manifest.params]
    for stacked in EXPERTS:
        assert stacked not in names
        split = [n for n in names if n.startswith(stacked + ".")]
        assert split == [f"{stacked}.{e}" for e in range(4)]
        assert {manifest.param(n).shape for n in split} == {(8, 16)}
    opts, params = _torch_opts(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        muonckpt.load(opts, out)

    def truth(name: str, what: str) -> torch.Tensor:
        stacked, _, e = name.rpartition(".")
        if stacked in EXPERTS:
            return TRUTH[f"{stacked}.{what}"][int(e)]
        return TRUTH[f"{name}.{what}"]

    for n, p in params.items():
        assert torch.equal(p.detach(), truth(n, "param")), n
    experts = 0
    for opt in opts:
        for group in opt.param_groups:
            for n, p in zip(group["param_names"], group["params"], strict=True):
                experts += n.rpartition(".")[0] in EXPERTS
                for key, value in opt.state[p].items():
                    assert torch.equal(value.float(), truth(n, key).float()), (n, key)
    assert experts == 8
    assert muonckpt.verify(out) == []


@pytest.mark.dist
def test_the_readme_split_command_runs_as_written(tmp_path):
    from .test_readme import run_cli_example

    shutil.copytree(SOURCES["manager"], tmp_path / "OUTPUTS" / "checkpoint")
    run_cli_example("torchtitan-split", tmp_path)
    names = [p.name for p in muonckpt.read_manifest(tmp_path / "DST").params]
    assert "layers.0.experts.3" in names and "layers.0.experts" not in names


def test_split_experts_refuses_a_tie_to_an_expert_before_writing(tmp_path):
    """A model tensor tied to a stacked expert (its alias would name a param the split
    removes) is refused naming the alias, and nothing is written: never a committed
    checkpoint that readers refuse."""
    index = dcp_metadata.read_index(SOURCES["manager"] / "step-3")
    values = {f: dcp_files.read_value(index, v) for f, v in index.values.items()}
    shapes = {f: (tuple(t.shape), t.dtype) for f, t in index.tensors.items()}
    items = dict(index.tensors, shared_experts=index.tensors["layers.0.experts"])
    shapes["shared_experts"] = shapes["layers.0.experts"]
    src = tmp_path / "tied" / "step-3"
    dcp_files.write_dcp(src, shapes, values, lambda f, _: dcp_files.read_tensor(index, items[f]))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="shared_experts"):
        torchtitan.from_torchtitan(src, out, model_buffers=True, split_experts=True)
    assert not out.exists()
    assert torchtitan.from_torchtitan(src, out, model_buffers=True).path == out


def test_a_reader_switch_the_route_does_not_take_is_refused(converted, tmp_path):
    """``--split-experts`` on a muonckpt checkpoint (no reader runs) is refused naming it, not
    ignored into a checkpoint whose experts are still 3-D."""
    args = [str(converted["manager"]), "-o", str(tmp_path / "x"), "--to", "torch"]
    result = CliRunner().invoke(app, ["convert", *args, "--split-experts"])
    assert result.exit_code != 0 and "--split-experts" in result.output
    assert not (tmp_path / "x").exists()
    assert CliRunner().invoke(app, ["convert", *args]).exit_code == 0


def test_a_data_loaders_positions_travel_per_rank_as_torchtitan_saved_them(tmp_path):
    """``ParallelAwareDataloader``'s state (``dp_rank_{r}``: pickled bytes, never unpickled
    here; ``world_size``) read per rank and given back as the same items; a rank missing is
    left out, named, not read."""
    from muonckpt.interop._trainer_state import Carried
    from muonckpt.interop.torchtitan import job_state

    values = {"dataloader.dp_rank_0": b"\x80\x04zero", "dataloader.dp_rank_1": b"\x80\x04one"}
    values |= {"dataloader.world_size": 2, "train_state.step": 3}
    tensors = {"w": ((2,), "F32")}
    dcp_files.write_dcp(tmp_path / "a", tensors, values, lambda fqn, region: torch.zeros(2))
    index = dcp_metadata.read_index(tmp_path / "a")
    found = job_state.read(index, 3)
    assert found.state.layout == {"dp": 2} and found.left == () and found.items == set(values)
    assert found.state.shared == {"train_state": {"step": 3}}
    carried = Carried(found.state.shared, found.state.ranks, ())
    assert job_state.values(carried) == values
    lacking = {k: v for k, v in index.values.items() if k != "dataloader.dp_rank_1"}
    found = job_state.read(replace(index, values=lacking), 3)
    assert found.state.ranks == {} and found.left[0].startswith("dataloader (positions of DP")


def test_merge_experts_writes_back_the_stacked_job(converted, tmp_path):
    """(issue 53) ``--split-experts`` reverses: ``--to torchtitan --merge-experts`` stacks each
    expert's matrices ``layers.<l>.experts.<e>`` into the (4, 8, 16) param DistMuon's job
    holds again, param and momentum; the DCP holds exactly the tensors torchtitan saved, and
    read back every value is bitwise the original's. ``--to torchtitan`` merges them without
    the switch too (a torchtitan model names no param ``.<e>``). Without a split param to
    merge, and for a writer that does not take it, the switch is refused."""
    runner = CliRunner()
    split, back = tmp_path / "split", tmp_path / "checkpoint" / "step-3"
    args = [str(SOURCES["manager"]), "-o", str(split), "--split-experts", "--model-buffers"]
    assert runner.invoke(app, ["convert", *args]).exit_code == 0
    assert muonckpt.read_manifest(split).split_experts == EXPERTS  # the split is recorded
    result = runner.invoke(
        app, ["convert", str(split), "-o", str(back), "--to", "torchtitan", "--merge-experts"]
    )
    assert result.exit_code == 0, result.output
    index = dcp_metadata.read_index(back)
    original = dcp_metadata.read_index(SOURCES["manager"] / "step-3")
    assert set(index.tensors) == set(original.tensors)
    for stacked in EXPERTS:
        for fqn in (stacked, f"optimizer.state.{stacked}.momentum_buffer"):
            assert tuple(index.tensors[fqn].shape) == (4, 8, 16), fqn
    again = tmp_path / "again"
    torchtitan.from_torchtitan(back, again, model_buffers=True)
    rows = list(offline.diff(converted["manager"], again))
    assert rows and all(r.bitwise for r in rows), [r for r in rows if not r.bitwise]
    auto = tmp_path / "auto" / "step-3"
    assert (
        runner.invoke(app, ["convert", str(split), "-o", str(auto), "--to", "torchtitan"]).exit_code
        == 0
    )
    assert tuple(dcp_metadata.read_index(auto).tensors[EXPERTS[0]].shape) == (4, 8, 16)
    nothing = runner.invoke(
        app,
        ["convert", str(converted["manager"]), "-o", str(tmp_path / "x"), "--to", "torchtitan",
         "--merge-experts"],
    )  # fmt: skip
    assert nothing.exit_code != 0 and "nothing to merge" in " ".join(nothing.output.split())
    other = runner.invoke(
        app,
        ["convert", str(split), "-o", str(tmp_path / "y"), "--to", "deepspeed", "--world", "2",
         "--merge-experts"],
    )  # fmt: skip
    assert other.exit_code == 2 and "--merge-experts" in other.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.parametrize("shapes", [((8, 8), (8, 8)), ((4, 8), (8, 8))])
def test_params_only_named_like_split_experts_are_merged_only_when_asked(shapes, tmp_path):
    """(review 3) A ParameterList's ``blocks.0``, ``blocks.1``: no split is recorded, so
    ``to_torchtitan`` and ``to_dcp`` keep them as they are (whatever their shapes); an explicit
    ``merge_experts=True`` merges those alike by their names and says so."""
    model = torch.nn.Module()
    model.blocks = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*s)) for s in shapes])
    opt = torch.optim.Muon(list(model.named_parameters()), lr=0.02)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    src = muonckpt.save(opt, tmp_path / "src", model=model, consolidated=True)
    for n, write in enumerate((interop.to_torchtitan, interop.to_dcp)):
        kw = {} if write is interop.to_torchtitan else {"to": "torch"}
        kept = write(src, tmp_path / f"kept{n}", **kw)
        assert kept.converted == ()
        written = dcp_metadata.read_index(tmp_path / f"kept{n}").tensors
        assert {"blocks.0", "blocks.1"} <= set(written)
        if shapes[0] == shapes[1]:
            merged = write(src, tmp_path / f"merged{n}", merge_experts=True, **kw)
            (note,) = merged.converted
            assert "merged 2 experts into 'blocks' (2, 8, 8) (no split recorded" in note
        assert write(src, tmp_path / f"never{n}", merge_experts=False, **kw).converted == ()

    manifest = muonckpt.read_manifest(src)
    text = manifest.to_json()
    recorded = replace(manifest, split_experts=("blocks",))
    assert parse_manifest(recorded.to_json(), "x").split_experts == ("blocks",)
    with pytest.raises(CheckpointError, match="sorted, each name once"):
        parse_manifest(text.replace('"kind"', '"split_experts":["b","a"],"kind"', 1), "x")
    assert recorded.renamed({"blocks.0": "mlp.0", "blocks.1": "mlp.1"}).split_experts == ("mlp",)
    assert recorded.renamed({"blocks.0": "w1", "blocks.1": "w2"}).split_experts == ()
    older = replace(recorded, format_version=4, environment=None).to_json()
    assert '"split_experts"' not in older  # an older version is written without it


def test_a_muon_param_torch_muon_cannot_hold_is_refused_before_writing(converted, tmp_path):
    """(issue 53) torch.optim.Muon takes 2-D params only: DistMuon's stacked (E, m, n) experts
    are refused for accelerate and Lightning before anything is written, naming them, by the
    split check the DeepSpeed writer makes too (``_foreign_out.check_split``)."""
    for write in (interop.to_accelerate, interop.to_lightning):
        with pytest.raises(CheckpointError, match=r"takes 2-D params only, so 2 param\(s\)") as e:
            write(converted["manager"], tmp_path / "out")
        assert "'layers.0.experts' (Muon here, Adam there)" in str(e.value)
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
