"""DeepSpeed ZeRO-1/2 Muon checkpoints in and out of muonckpt (issue 32), against checkpoints
DeepSpeed 0.19.8 wrote itself (``tests/fixtures/deepspeed/NAME/ckpt``, made by
``make_fixtures.py`` beside them; DeepSpeed is not needed here).

Each fixture converts with every value bitwise its ``truth.safetensors`` (DeepSpeed's state in
memory before the save); the output loads into torch.optim.Muon + AdamW exactly, into the
packaged Muon at 2 x 2 and 4 x 1 (momentum EMA -> sum within rounding, the state then bitwise
through a resave), and through inspect / verify / reshard / consolidate / diff. Written back
for N = 1, 2, 3 ranks it reads in again as the same checkpoint. Refusals: a hostile pickle, a
missing rank file, a ``latest`` naming nothing, partitions that do not add up.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import muonckpt
from muonckpt import CheckpointError, ConversionWarning, interop, offline
from muonckpt.cli import app
from muonckpt.demo import ToyModel, local_params
from muonckpt.distributed.launch import run_distributed
from muonckpt.interop.deepspeed import files as deepspeed_files
from muonckpt.interop.deepspeed.writer import uses_muon
from muonckpt.layout.topology import LayoutOptions

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
NAMES = sorted(p.parent.name for p in FIXTURES.glob("*/truth.safetensors"))
FIRST = "w2_z1_torchadam_fp32"
Z3 = "w3_z3_fused_fp32"
TIED = {"lm_head.weight": "embed.weight"}


def _ckpt(name: str) -> Path:
    return FIXTURES / name / "ckpt"


def _truth(name: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / name / "truth.safetensors")


def _meta(name: str) -> dict:
    return json.loads((FIXTURES / name / "meta.json").read_text())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each fixture converted as DeepSpeed keeps it (no --to), once."""
    root = tmp_path_factory.mktemp("ds")
    out = {}
    for name in NAMES:
        out[name] = root / name
        interop.from_deepspeed(_ckpt(name), out[name])
    return out


def _tensors(path: Path) -> tuple[dict, dict]:
    return load_file(path / "model.safetensors"), load_file(path / "optimizer.safetensors")


def test_the_fixtures_are_here():
    assert FIRST in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_value_is_the_truth_bitwise(converted, name):
    out, truth = converted[name], _truth(name)
    model, state = _tensors(out)
    manifest = muonckpt.read_manifest(out)
    seen = set()
    for key, expected in truth.items():
        param, _, what = key.rpartition(".")
        if what == "param":
            got = model[param]
        elif what == "module":
            if expected.dtype == torch.float32:  # a bf16 run's model is the masters rounded
                assert torch.equal(model[param], expected), key
            continue
        elif what == "step":
            scalar = manifest.param(param).scalars["step"]
            assert scalar.value == expected.item(), key
            assert (scalar.dtype == "F32") == (expected.dtype == torch.float32), key
            continue
        else:
            got = state[f"state.{param}.{what}"]
        assert got.dtype == expected.dtype and torch.equal(got, expected), key
        seen.add(f"{param}.{what}")
    assert {k for k in state} == {f"state.{k}" for k in seen if not k.endswith(".param")}
    assert manifest.model is not None and dict(manifest.model.aliases) == TIED
    assert muonckpt.verify(out) == []
    groups = [g.optimizer for g in manifest.groups]
    assert [g["role"] for g in groups] == ["muon", "adamw"]
    assert (
        groups[0]["momentum_form"] == "ema"
        and groups[0]["optimizer"] == "deepspeed.MuonWithAuxAdam"
    )
    meta = _meta(name)
    step_in = "tensor" if meta["aux"] == "torch_adam" else "int"
    assert groups[1]["step_in"] == step_in


def _torch_pair(model: dict, manifest) -> tuple[list[torch.optim.Optimizer], dict]:
    muon, adam = manifest.groups
    params = {n: torch.nn.Parameter(torch.zeros_like(t)) for n, t in model.items()}
    hyper = muon.hyperparams
    return [
        torch.optim.Muon(
            [(n, params[n]) for n in muon.params],
            lr=hyper["lr"],
            momentum=hyper["momentum"],
            weight_decay=hyper["weight_decay"],
            nesterov=True,
        ),
        torch.optim.AdamW(
            [(n, params[n]) for n in adam.params],
            lr=adam.hyperparams["lr"],
            betas=tuple(adam.hyperparams["betas"]),
            eps=adam.hyperparams["eps"],
            weight_decay=adam.hyperparams["weight_decay"],
        ),
    ], params


@pytest.mark.parametrize("name", NAMES)
def test_it_loads_into_torch_muon_and_adamw_exactly(converted, name):
    out, truth = converted[name], _truth(name)
    model, _ = _tensors(out)
    opts, params = _torch_pair(model, muonckpt.read_manifest(out))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        report = muonckpt.load(opts, out)
    assert not report.converted  # EMA into EMA: nothing to convert
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


def _toy(manifest) -> ToyModel:
    """The packaged Muon over the fixture's params (matrices split over TP where 2 and 4 divide)."""
    muon, adam = manifest.groups
    shapes = {e.name: e.shape for e in manifest.params}
    splits = {n: 0 for n in muon.params if shapes[n][0] % 4 == 0}
    return ToyModel(
        muon_params={n: shapes[n] for n in muon.params},
        adamw_params={n: shapes[n] for n in adam.params},
        tp_split_dims=splits,
        layout=LayoutOptions(bucket_numel=512),
        seed=0,
        muon_hparams={"use_muon": True, "lr": 0.02, "momentum": 0.95, "weight_decay": 0.1},
        adamw_hparams={"lr": 1e-3, "weight_decay": 0.1},
    )


def _load_train_save(dp: int, tp: int, src: str, dst: str, steps: int) -> dict:
    """(gloo child) The packaged Muon over the fixture's params, loaded, saved consolidated,
    then trained ``steps`` steps; its local params."""
    toy = _toy(muonckpt.read_manifest(src))
    opt, sharded, d, t = toy.build(dp, tp, toy.zeros())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        muonckpt.load(opt, src)
    muonckpt.save(opt, dst, consolidated=True)
    toy.train(opt, sharded, d, t, 3, steps)
    return local_params(opt)


@pytest.mark.dist
@pytest.mark.parametrize(  # (a bf16 run's bf16 momentum resaves as the packaged Muon's fp32)
    "name", [n for n in NAMES if n.startswith(("w2_z1", "w2_z2")) and n.endswith("torchadam_fp32")]
)
def test_it_resumes_in_the_packaged_muon_at_2x2_and_4x1(converted, tmp_path, name):
    packaged = tmp_path / "packaged"
    report = interop.from_deepspeed(_ckpt(name), packaged, to="packaged")
    assert any("ema -> sum" in line for line in report.converted)
    truth = _truth(name)
    _, state = _tensors(packaged)
    mu = 0.95
    for key, value in state.items():
        if key.endswith(".momentum_buffer"):
            param = key[len("state.") : -len(".momentum_buffer")]
            torch.testing.assert_close(value, truth[f"{param}.momentum_buffer"] / (1 - mu))
    finals = {}
    for dp, tp in [(2, 2), (4, 1)]:
        resaved = tmp_path / f"resaved-{dp}x{tp}"
        ranks = run_distributed(
            _load_train_save, dp * tp, dp, tp, str(packaged), str(resaved), 2, timeout=240
        )
        rows = [  # the resave, from the optimizer alone, has no tied names (nor DeepSpeed's
            # own state, which the conversion carried in its extra)
            r
            for r in offline.diff(packaged, resaved)
            if r.key not in ("hyperparams", "step") and r.param not in ("model", "extra")
        ]
        assert rows and all(r.bitwise for r in rows), [r for r in rows if not r.bitwise]
        toy = _toy(muonckpt.read_manifest(packaged))
        finals[dp, tp] = toy.assemble(dp, tp, ranks)
    # one uninterrupted packaged run from the same state, in one process
    toy = _toy(muonckpt.read_manifest(packaged))
    opt, _, _, _ = toy.build(1, 1, toy.zeros())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        muonckpt.load(opt, packaged)
    toy.train(opt, None, 0, 0, 3, 2)
    alone = local_params(opt)
    for final in finals.values():
        for n, p in alone.items():
            assert torch.equal(final[n], p), n


def test_the_offline_tools_take_it(converted, tmp_path):
    out = converted[FIRST]
    summary = offline.summarize(out)
    assert summary is not None
    assert muonckpt.verify(out) == []
    consolidated = offline.consolidate(out, tmp_path / "consolidated")
    resharded = offline.reshard(out, tmp_path / "resharded", dp=2, tp=1)
    for other in (consolidated, resharded):  # neither carries the model's tied names
        rows = [r for r in offline.diff(out, other) if r.param != "model"]
        assert rows and all(r.bitwise for r in rows if r.key != "hyperparams"), rows
    runner = CliRunner()
    for args in (
        ["inspect", str(out)],
        ["verify", str(out)],
        ["diff", str(out), str(out)],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("name", "world", "stage"),
    [(FIRST, 1, None), (FIRST, 2, None), (FIRST, 3, None), (FIRST, 3, 3), (Z3, 1, None),
     (Z3, 4, None), (Z3, 2, 2)],
)  # fmt: skip
def test_written_for_n_ranks_it_reads_back_the_same(converted, tmp_path, name, world, stage):
    """Written for ``world`` ranks at the ZeRO stage it was read at (``stage`` None; ZeRO-1
    stays 1, ZeRO-3 stays 3) or the one chosen, it reads back as the same checkpoint."""
    src = converted[name]
    assert muonckpt.read_manifest(src).zero_stage == _meta(name)["stage"]
    stage = stage or _meta(name)["stage"]
    ds = tmp_path / "ds"
    report = interop.to_deepspeed(src, ds, world=world, zero_stage=stage)
    assert report.layout == f"ZeRO-{stage}, world {world}"
    tag = (ds / "latest").read_text()
    assert tag == "global_step3"
    files = deepspeed_files.rank_files(ds / tag)
    assert len(files) == world
    assert deepspeed_files.load(files[-1])["optimizer_state_dict"]["zero_stage"] == stage
    model = deepspeed_files.load(deepspeed_files.model_states(ds / tag, stage))
    assert model["dp_world_size"] == world and model["shared_params"] == TIED
    if stage == 3:  # its weights are the optimizer files' partitions, as DeepSpeed saves them
        assert all(t.numel() == 0 for t in model["module"].values())
        assert len(list((ds / tag).glob("zero_pp_rank_*_model_states.pt"))) == world
    else:
        assert torch.equal(model["module"]["lm_head.weight"], model["module"]["embed.weight"])
    back = tmp_path / "back"
    assert interop.from_deepspeed(ds, back).layout == f"ZeRO-{stage}, world {world}"
    rows = list(offline.diff(src, back))
    assert rows and all(r.bitwise for r in rows), [r for r in rows if not r.bitwise]
    assert dict(muonckpt.read_manifest(back).model.aliases) == TIED
    assert muonckpt.read_manifest(back).zero_stage == stage


def test_a_checkpoint_whose_split_deepspeed_would_change_is_refused(tmp_path):
    """DeepSpeed's Muon job puts every 2-D param whose name holds neither "embed" nor
    "lm_head" in Muon: a checkpoint with such a param in AdamW (a token embedding named
    ``wte``, as a Lightning or torch job may keep it) is refused before anything is written,
    naming the param, instead of files DeepSpeed's load refuses with a layout error."""
    from .fixture_model import ADAMW_HPARAMS, LAYOUT, MUON_HPARAMS, MUON_PARAMS

    model = ToyModel(
        muon_params=MUON_PARAMS,
        adamw_params={"bias": (7,), "norm": (20,), "wte": (6, 16)},
        tp_split_dims={},
        layout=LAYOUT,
        seed=2468,
        muon_hparams=MUON_HPARAMS,
        adamw_hparams=ADAMW_HPARAMS,
    )
    opt, sharded, dp_rank, tp_rank = model.build(1, 1, model.initial_params())
    model.train(opt, sharded, dp_rank, tp_rank, 0, 1)
    src = tmp_path / "packaged"
    muonckpt.save(opt, src, consolidated=True)
    with pytest.raises(CheckpointError, match=r"1 param\(s\) would change optimizer: 'wte'"):
        interop.to_deepspeed(src, tmp_path / "ds", world=2)
    assert not (tmp_path / "ds").exists()
    assert [uses_muon(n, s) for n, s in [("blocks.0.w", (4, 4)), ("embed.weight", (6, 16))]] == [
        True,
        False,
    ]
    assert not uses_muon("lm_head.weight", (6, 16)) and not uses_muon("experts", (2, 4, 4))


def test_a_packaged_checkpoint_written_for_deepspeed(tmp_path):
    """Another trainer's checkpoint: DeepSpeed's grouping (Muon params largest first), its
    momentum in EMA form."""
    from .fixture_model import MUON_HPARAMS, single_process_optimizer

    src = tmp_path / "packaged"
    muonckpt.save(single_process_optimizer(3), src, consolidated=True)  # embed: Adam in both
    ds = tmp_path / "ds"
    report = interop.to_deepspeed(src, ds, world=3)
    assert any("sum -> ema" in line for line in report.converted)
    back = tmp_path / "back"
    interop.from_deepspeed(ds, back)
    manifest = muonckpt.read_manifest(back)
    muon = manifest.groups[0]
    shapes = [manifest.param(n).shape for n in muon.params]
    assert shapes == sorted(shapes, reverse=True)
    mu = MUON_HPARAMS["momentum"]
    (a_model, a_state), (b_model, b_state) = _tensors(src), _tensors(back)
    assert all(torch.equal(a_model[n], b_model[n]) for n in a_model)
    for key, value in a_state.items():
        expected = value * (1 - mu) if key.endswith("momentum_buffer") else value
        torch.testing.assert_close(b_state[key], expected, rtol=1e-6, atol=1e-7)


def test_the_cli_in_and_out(tmp_path):
    runner = CliRunner()
    out, ds = tmp_path / "out", tmp_path / "ds"
    result = runner.invoke(
        app, ["convert", str(_ckpt(FIRST)), "-o", str(out), "--from", "deepspeed", "--to", "torch"]
    )
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        app, ["convert", str(out), "-o", str(ds), "--to", "deepspeed", "--world", "3"]
    )
    assert result.exit_code == 0, result.output
    assert f"wrote {ds}: DeepSpeed, " in " ".join(result.output.split())
    assert len(deepspeed_files.rank_files(ds / "global_step3")) == 3
    assert "ZeRO-1, world 3" in result.output  # (the stage it was read at)
    chosen = runner.invoke(
        app,
        ["convert", str(out), "-o", str(tmp_path / "z3"), "--to", "deepspeed", "--world", "2",
         "--zero-stage", "3"],
    )  # fmt: skip
    assert chosen.exit_code == 0 and "ZeRO-3, world 2" in chosen.output, chosen.output
    again = runner.invoke(
        app, ["convert", str(out), "-o", str(ds), "--to", "deepspeed", "--world", "3"]
    )
    assert again.exit_code != 0  # never over an existing directory
    no_world = runner.invoke(
        app, ["convert", str(out), "-o", str(tmp_path / "x"), "--to", "deepspeed"]
    )
    assert no_world.exit_code == 2, no_world.output
    said = " ".join(no_world.output.split())
    assert "DeepSpeed output needs --world" in said and "None" not in said
    assert not (tmp_path / "x").exists()
    detected = runner.invoke(
        app, ["convert", str(_ckpt(FIRST) / "global_step3"), "-o", str(tmp_path / "y")]
    )
    assert detected.exit_code == 0, detected.output
    assert "--from deepspeed: inferred (DeepSpeed files record it)" in detected.output
    for command in ("inspect", "verify"):  # (issue 57) a foreign checkpoint is named as such
        refused = runner.invoke(app, [command, str(_ckpt(FIRST))])
        said = " ".join(refused.output.split())
        assert refused.exit_code == 2 and "is a DeepSpeed checkpoint, not a muonckpt one" in said
        assert f"muonckpt convert {_ckpt(FIRST)} -o OUT" in said and "--from" not in said


def _copy(tmp_path: Path, name: str = FIRST) -> Path:
    return Path(shutil.copytree(_ckpt(name), tmp_path / "src"))


def _refused(src: Path, tmp_path: Path, match: str, named: Path) -> None:
    dst = tmp_path / "dst"
    with pytest.raises(CheckpointError, match=match) as info:
        interop.from_deepspeed(src, dst)
    assert "\n" not in str(info.value) and str(named) in str(info.value), str(info.value)
    assert not dst.exists() and not list(tmp_path.glob(".dst*"))


class _Hostile:
    def __reduce__(self):
        return (os.system, (f"touch {_Hostile.marker}",))


def test_a_hostile_pickle_is_refused_unrun(tmp_path):
    src = _copy(tmp_path)
    victim = src / "global_step3" / deepspeed_files.rank_file(1)
    _Hostile.marker = tmp_path / "ran"
    victim.write_bytes(pickle.dumps({"optimizer_state_dict": _Hostile()}))
    _refused(src, tmp_path, "nothing of it was run", victim)
    assert not _Hostile.marker.exists()
    torch.save({"optimizer_state_dict": _Hostile()}, victim)  # a zip file too
    _refused(src, tmp_path, "nothing of it was run", victim)
    assert not _Hostile.marker.exists()


def test_a_missing_rank_file_is_refused_naming_it(tmp_path):
    src = _copy(tmp_path)
    first, second = (src / "global_step3" / deepspeed_files.rank_file(r) for r in (0, 1))
    kept = first.read_bytes()
    first.unlink()
    _refused(src, tmp_path, "rank 0's optimizer file is missing", first)
    first.write_bytes(kept)
    second.unlink()  # rank 0 alone: its partition_count says 2, and the missing one is named
    _refused(src, tmp_path, "rank 1's optimizer file is missing: partition_count is 2", second)


def test_a_latest_naming_nothing_is_refused(tmp_path):
    src = _copy(tmp_path)
    (src / "latest").write_text("global_step9")
    _refused(src, tmp_path, "names 'global_step9', which is not a directory", src / "latest")


def test_partitions_that_do_not_add_up_are_refused(tmp_path):
    src = _copy(tmp_path)
    model_file = src / "global_step3" / "mp_rank_00_model_states.pt"
    model = deepspeed_files.load(model_file)
    name = next(iter(model["param_shapes"][0]))
    rows, cols = model["param_shapes"][0][name]
    model["param_shapes"][0][name] = torch.Size([rows - 1, cols])
    model_file.unlink()
    torch.save(model, model_file)
    _refused(
        src, tmp_path, "fp32 partition holds", src / "global_step3" / deepspeed_files.rank_file(0)
    )


def test_zero3_partitions_that_do_not_add_up_are_refused(tmp_path):
    """ZeRO-3: a param shape that does not give the partitions the rank files hold, and a
    rank file of another stage beside rank 0's, are refused naming the file."""
    src = _copy(tmp_path, Z3)
    tag = src / "global_step3"
    model_file = tag / deepspeed_files.rank_model_file(0)
    model = deepspeed_files.load(model_file)
    saved = {k: dict(v) for k, v in enumerate(model["param_shapes"])}
    name = next(iter(model["param_shapes"][0]))
    rows, cols = model["param_shapes"][0][name]
    model["param_shapes"][0][name] = torch.Size([rows - 3, cols])
    model_file.unlink()
    torch.save(model, model_file)
    _refused(
        src, tmp_path, "sub-group 0: its fp32 partition holds", tag / deepspeed_files.rank_file(0)
    )
    model["param_shapes"] = [saved[k] for k in sorted(saved)]
    model_file.unlink()
    torch.save(model, model_file)
    rank1 = tag / deepspeed_files.rank_file(1)
    top = deepspeed_files.load(rank1)
    top["optimizer_state_dict"]["zero_stage"] = 2
    rank1.unlink()
    deepspeed_files.save(rank1, top)  # (its loss scaler pickled under DeepSpeed's name again)
    _refused(src, tmp_path, "zero_stage is 2, rank 0's 3", rank1)


@pytest.mark.dist
def test_readme_deepspeed_commands_run_as_written(tmp_path):
    """The README's DeepSpeed commands as written (``muonckpt`` spelled ``python -m
    muonckpt.cli``), on a copy of a fixture at ``ds/ckpt``."""
    from .test_readme import run_cli_example

    shutil.copytree(_ckpt(FIRST), tmp_path / "ds" / "ckpt")
    run_cli_example("deepspeed-commands", tmp_path)
    assert muonckpt.verify(tmp_path / "ckpt" / "from-ds") == []
    back = tmp_path / "back"
    interop.from_deepspeed(tmp_path / "ds" / "ckpt-world3", back)
    rows = [r for r in offline.diff(tmp_path / "ckpt" / "from-ds", back) if r.max_abs is not None]
    assert rows and all(r.max_rel < 1e-6 for r in rows), [r for r in rows if r.max_rel >= 1e-6]


def test_the_routes_of_deepspeed(tmp_path):
    """``--to deepspeed`` is ``--format deepspeed``, ``--world`` passes to its writer, and a
    DeepSpeed checkpoint needs neither ``--from`` nor ``--to``."""
    from muonckpt import interop
    from muonckpt.cli import routes
    from muonckpt.errors import OptionError
    from muonckpt.interop import NoOptions
    from muonckpt.interop.deepspeed import DeepSpeedWriteOptions

    ds = interop.format_named("deepspeed")
    options = {"layout": "torchtitan", "world": 3, "model_prefix": None, "optimizer_prefix": ""}

    def route(src, **given):
        asked = {"to": None, "source": None, "output_format": "muonckpt", "renamed": False}
        return routes.route(src, **{**asked, **given}, overwrite=False, options=options)

    ours = tmp_path / "ours"
    ours.mkdir()
    assert route(ours, to="deepspeed") == routes.Route(
        writes=ds, options=DeepSpeedWriteOptions(world=3)
    )
    assert route(ours, to="deepspeed", output_format="deepspeed").writes is ds
    tag = tmp_path / "ds" / "global_step3"
    tag.mkdir(parents=True)
    (tag / deepspeed_files.rank_file(0)).write_bytes(b"")
    (tmp_path / "ds" / "latest").write_text("global_step3")
    inferred = routes.Route(reads=ds, options=NoOptions(), source="deepspeed", inferred=True)
    for src in (tmp_path / "ds", tag):
        assert interop.detect(src) is ds
        assert route(src) == inferred  # (issue 57) the CLI says what it inferred
    with pytest.raises(OptionError, match="choose one of deepspeed") as refused:
        route(tmp_path / "ds", source="torch")
    assert refused.value.option == "--from"
    with pytest.raises(OptionError, match="a DeepSpeed checkpoint already"):
        route(tmp_path / "ds", to="deepspeed")


def test_the_scheduler_and_counters_go_back_to_deepspeed(tmp_path):
    """The model states' ``lr_scheduler`` (WarmupLR's ``state_dict()``, put into each ZeRO-3
    rank's model states as DeepSpeed's engine saves it) and counters travel in ``extra`` and
    go back into every model states file ``to_deepspeed`` writes, at another world; into
    another trainer each is listed as left out, by name."""
    src = tmp_path / "ckpt"
    shutil.copytree(_ckpt("w2_z3_torchadam_fp32"), src)
    schedule = {"last_batch_iteration": 2}
    for path in (src / "global_step3").glob("*model_states.pt"):
        model = torch.load(path, weights_only=False)
        torch.save({**model, "lr_scheduler": schedule}, path)
    ours = tmp_path / "ours"
    assert interop.from_deepspeed(src, ours).left_out == ()
    assert muonckpt.read_manifest(ours).recorded_step == 3
    ds = tmp_path / "ds"
    interop.to_deepspeed(ours, ds, world=3)
    written = sorted((ds / "global_step3").glob("*model_states.pt"))
    assert len(written) == 3
    for path in written:
        model = deepspeed_files.load(path)
        assert model["lr_scheduler"] == schedule, path
        assert (model["global_steps"], model["global_samples"], model["skipped_steps"]) == (
            3,
            12,
            0,
        )
    report = interop.to_lightning(ours, tmp_path / "lightning")
    assert [line.split(" (")[0] for line in report.left_out] == [
        f"deepspeed's {key}"
        for key in ("lr_scheduler", "global_steps", "global_samples", "skipped_steps")
    ]
