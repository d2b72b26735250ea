"""accelerate and Lightning jobs of torch.optim.Muon + AdamW into muonckpt (issue 34), against
checkpoints the trainers wrote themselves (``tests/fixtures/accelerate/NAME/state``,
``tests/fixtures/lightning/NAME/checkpoints/*.ckpt``, made by the ``make_fixtures.py`` beside
them; neither trainer is needed here: the ``trainers`` tier, tests/test_trainers_hf.py, reruns
them).

Each fixture converts with every value bitwise its ``truth.safetensors`` (the optimizers'
state in memory at the save), keyed by the model's names, found from ``param_names``, the
model's order, or the names given; the output loads into torch.optim.Muon + AdamW built from
zeros exactly, and into the packaged Muon at 2 x 2 (momentum EMA -> sum within rounding; the
state then bitwise through a resave, and training on agrees with one process). Refusals: the
index of an unnamed param that its shape does not tell, names that do not fit, a hostile
pickle.
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
from muonckpt.interop._trainer_state import recorded
from muonckpt.layout.topology import LayoutOptions

FIXTURES = Path(__file__).parent / "fixtures"
CASES = (
    "accelerate/named",
    "accelerate/plain",
    "accelerate/bin",
    "lightning/named",
    "lightning/single",
)
UNNAMED = ("accelerate/plain", "accelerate/bin")
"""Jobs whose optimizers were built from bare params: converted with the names given."""
HOW = {
    "accelerate/named": "param_names",
    "accelerate/plain": "the names given",
    "accelerate/bin": "the names given",
    "lightning/named": "param_names (prefix 'model.' added)",
    "lightning/single": "the model's order",
}
MU = 0.95
LIGHTNING_STATE = (
    "global_step", "epoch", "loops", "lr_schedulers", "callbacks", "hparams_name",
    "hyper_parameters",
)  # fmt: skip
"""What Lightning's checkpoints hold of the job's own state, all of it carried."""


def _meta(case: str) -> dict:
    return json.loads((FIXTURES / case / "meta.json").read_text())


def _src(case: str) -> Path:
    if case.startswith("accelerate/"):
        return FIXTURES / case / "state"
    (ckpt,) = (FIXTURES / case / "checkpoints").glob("*.ckpt")
    return ckpt


def _convert(case: str, dst: Path, **options):
    read = interop.from_accelerate if case.startswith("accelerate/") else interop.from_lightning
    names = _meta(case)["index_names"] if case in UNNAMED else None
    return read(_src(case), dst, names=names, **options)


def _model_file(case: str) -> dict[str, torch.Tensor]:
    """The model's tensors as the trainer saved them (the test trusts its own fixtures)."""
    if case == "accelerate/bin":
        return torch.load(_src(case) / "pytorch_model.bin", weights_only=True)
    if case.startswith("accelerate/"):
        return load_file(_src(case) / "model.safetensors")
    return torch.load(_src(case), weights_only=True)["state_dict"]


def _truth(case: str) -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / case / "truth.safetensors")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each fixture converted in torch's own form (no ``to``), once, with its report."""
    root = tmp_path_factory.mktemp("hf")
    return {case: (root / case, _convert(case, root / case)) for case in CASES}


def _tensors(path: Path) -> tuple[dict, dict]:
    return load_file(path / "model.safetensors"), load_file(path / "optimizer.safetensors")


@pytest.mark.parametrize("case", CASES)
def test_every_value_is_the_truth_bitwise(converted, case):
    out, report = converted[case]
    assert report.layout.endswith(f"named by {HOW[case]}") or f"named by {HOW[case]}," in (
        report.layout
    ), report.layout
    truth, meta = _truth(case), _meta(case)
    model, state = _tensors(out)
    manifest = muonckpt.read_manifest(out)
    assert muonckpt.verify(out) == []
    names = [n for names in meta["index_names"] for n in names]
    assert [e.name for e in manifest.params] == names  # group by group, as the job held them
    seen = set()
    for key, expected in truth.items():
        param, _, what = key.rpartition(".")
        if what == "step":
            scalar = manifest.param(param).scalars["step"]
            assert scalar.value == expected.item() and scalar.dtype == "F32", key
            continue
        got = model[param] if what == "param" else state[f"state.{param}.{what}"]
        assert got.dtype == expected.dtype and torch.equal(got, expected), key
        seen.add(f"state.{param}.{what}")
    assert set(state) == seen - {f"state.{n}.param" for n in names}
    buffers = meta["buffers"]
    held = manifest.model.tensors if manifest.model is not None else ()
    assert [t.name for t in held] == buffers  # carried, not dropped
    for name in buffers:  # the model file's own values
        assert torch.equal(model[name], _model_file(case)[name]), name
    optimizers = [g.optimizer["optimizer"] for g in manifest.groups]
    settings = [s for groups in meta["settings"] for s in groups]
    assert len(optimizers) == len(settings)
    for group, saved, name in zip(manifest.groups, settings, optimizers, strict=True):
        assert name == ("torch.optim.Muon" if "ns_steps" in saved else "torch.optim.AdamW")
        assert group.hyperparams == json.loads(json.dumps(saved))
    if case.startswith("lightning/"):
        assert manifest.recorded_step == int(_src(case).stem.rsplit("=", 1)[1])
        assert report.left_out == ("pytorch-lightning_version",)  # the rest is carried
        trainer = recorded(manifest)
        assert trainer is not None and trainer["name"] == "lightning" and not trainer["ranks"]
        assert set(trainer["shared"]) == set(LIGHTNING_STATE)
        assert trainer["shared"]["lr_schedulers"] == meta.get("lr_schedulers", [])
    else:  # each process's RNG states, carried for the 2 processes that saved them
        assert report.left_out == ()
        trainer = recorded(manifest)
        assert trainer is not None and trainer["name"] == "accelerate"
        assert trainer["layout"] == {"processes": 2} and trainer["shared"] == {}
        assert len(trainer["ranks"]["random_states"]) == 2


def _torch_optimizers(manifest) -> tuple[list[torch.optim.Optimizer], dict]:
    """torch.optim.Muon and AdamW over params of zeros, grouped as the job grouped them."""
    params = {e.name: torch.nn.Parameter(torch.zeros(e.shape)) for e in manifest.params}
    muon, adamw = [], []
    for group in manifest.groups:
        hyper = {k: v for k, v in group.hyperparams.items() if k != "step"}
        pairs = [(n, params[n]) for n in group.params]
        if group.optimizer["role"] == "muon":
            hyper["ns_coefficients"] = tuple(hyper["ns_coefficients"])
            muon.append({"params": pairs, **hyper})
        else:
            hyper["betas"] = tuple(hyper["betas"])
            adamw.append({"params": pairs, **hyper})
    opts = [torch.optim.Muon(muon)] + ([torch.optim.AdamW(adamw)] if adamw else [])
    return opts, params


@pytest.mark.parametrize("case", CASES)
def test_it_loads_into_torch_muon_and_adamw_exactly(converted, case):
    out, _ = converted[case]
    truth = _truth(case)
    opts, params = _torch_optimizers(muonckpt.read_manifest(out))
    report = muonckpt.load(opts, out)
    assert not report.converted  # EMA into EMA: nothing to convert
    for n, p in params.items():
        assert torch.equal(p.detach(), truth[f"{n}.param"]), n
    checked = 0
    for opt in opts:
        for group in opt.param_groups:
            for n, p in zip(group["param_names"], group["params"], strict=True):
                assert set(opt.state[p]) == {
                    k.rpartition(".")[2] for k in truth if k.startswith(n + ".")
                } - {"param"}
                for key, value in opt.state[p].items():
                    assert value.dtype == truth[f"{n}.{key}"].dtype, (n, key)
                    assert torch.equal(value, truth[f"{n}.{key}"]), (n, key)
                    checked += 1
    assert checked == len(truth) - len(params)


def _toy(manifest) -> ToyModel:
    """The packaged Muon over the job's params, its matrices split over TP."""
    shapes = {e.name: e.shape for e in manifest.params}
    roles = {n: g.optimizer["role"] for g in manifest.groups for n in g.params}
    return ToyModel(
        muon_params={n: s for n, s in shapes.items() if roles[n] == "muon"},
        adamw_params={n: s for n, s in shapes.items() if roles[n] == "adamw"},
        tp_split_dims={n: 0 for n, s in shapes.items() if roles[n] == "muon"},
        layout=LayoutOptions(bucket_numel=256),
        seed=0,
        muon_hparams={"use_muon": True, "lr": 0.02, "momentum": MU, "weight_decay": 0.1},
        adamw_hparams={"lr": 3e-3, "weight_decay": 0.1},
    )


def _load_train_save(dp: int, tp: int, jobs: list[tuple[str, str]], steps: int) -> list[dict]:
    """(gloo child) For each (src, dst): the packaged Muon over the job's params, built from
    zeros, loaded, saved consolidated, then trained ``steps`` steps; its local params."""
    finals = []
    for src, dst in jobs:
        toy = _toy(muonckpt.read_manifest(src))
        opt, sharded, d, t = toy.build(dp, tp, toy.zeros())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConversionWarning)
            muonckpt.load(opt, src)
        muonckpt.save(opt, dst, consolidated=True)
        toy.train(opt, sharded, d, t, 3, steps)
        finals.append(local_params(opt))
    return finals


@pytest.mark.dist
def test_both_resume_in_the_packaged_muon_at_2x2(tmp_path):
    """accelerate's and Lightning's jobs, converted for the packaged Muon (momentum EMA ->
    sum: the truth / (1 - mu)), load at dp 2 x tp 2 from zeros: a resave is the conversion
    bitwise (params, momentum, AdamW moments), and two steps on agree with one process."""
    cases = ("accelerate/named", "lightning/named")
    jobs = []
    for case in cases:
        packaged = tmp_path / case / "packaged"
        report = _convert(case, packaged, to="packaged")
        assert report.converted == ("4 Muon params: ema -> sum (x 20, mu=0.95)",)
        truth = _truth(case)
        for key, value in _tensors(packaged)[1].items():
            if key.endswith(".momentum_buffer"):
                expected = truth[key[len("state.") :]] / (1 - MU)
                torch.testing.assert_close(value, expected, rtol=1e-6, atol=0)
        jobs.append((str(packaged), str(tmp_path / case / "resaved")))
    ranks = run_distributed(_load_train_save, 4, 2, 2, jobs, 2, timeout=240)
    for i, (packaged, resaved) in enumerate(jobs):
        rows = [r for r in offline.diff(packaged, resaved) if r.key not in ("hyperparams", "step")]
        tensors = [r for r in rows if r.max_abs is not None]
        assert len(tensors) == 2 * 4 + 3 * 10  # value + momentum, value + moments
        assert all(r.bitwise for r in tensors), [r for r in tensors if not r.bitwise]
        # the resave, of the optimizer alone in its two groups, has no buffer (nor the
        # trainer's own state, which the conversion carried in its extra)
        assert {(r.param, r.key) for r in rows if not r.bitwise} == {
            (_meta(cases[i])["buffers"][0], "param"),
            ("groups", None),
            ("extra", None),
        }
        toy = _toy(muonckpt.read_manifest(packaged))
        final = toy.assemble(2, 2, [rank[i] for rank in ranks])
        opt, _, _, _ = toy.build(1, 1, toy.zeros())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConversionWarning)
            muonckpt.load(opt, packaged)
        toy.train(opt, None, 0, 0, 3, 2)
        for n, p in local_params(opt).items():
            assert torch.equal(final[n], p), n


def _refused(case: str, src: Path, tmp_path: Path, match: str, named: Path, **options) -> None:
    dst = tmp_path / "dst"
    read = interop.from_accelerate if case.startswith("accelerate/") else interop.from_lightning
    with pytest.raises(CheckpointError, match=match) as info:
        read(src, dst, **options)
    assert "\n" not in str(info.value) and str(named) in str(info.value), str(info.value)
    assert not dst.exists() and not list(tmp_path.glob(".dst*"))


def test_unnamed_params_the_files_do_not_tell_are_refused(tmp_path):
    """accelerate's model.safetensors sorts its names and the blocks' params share shapes:
    an optimizer built from bare params needs the names."""
    src = _src("accelerate/plain")
    _refused(
        "accelerate/plain",
        src,
        tmp_path,
        r"param index 0 of shape \[16, 8\] could be any of \['blocks.0.fc1.weight', "
        r"'blocks.1.fc1.weight'\].*--names",
        src / "optimizer.bin",
    )
    names = _meta("accelerate/plain")["index_names"]
    listed = tmp_path / "names.json"
    listed.write_text(json.dumps([names[0], names[1][:-1]]))
    _refused(
        "accelerate/plain",
        src,
        tmp_path,
        "optimizer_1.bin: holds 10 params, the names given for it are 9",
        src / "optimizer_1.bin",
        names=listed,
    )
    swapped = [[names[0][1], names[0][0], *names[0][2:]], names[1]]
    listed.write_text(json.dumps(swapped))
    _refused(
        "accelerate/plain",
        src,
        tmp_path,
        r"param index 0 \('blocks.0.fc2.weight'\) has state of shape \[16, 8\], the "
        r"model's tensor \[8, 16\]",
        src / "optimizer.bin",
        names=listed,
    )
    bin_src = _src("accelerate/bin")  # pytorch_model.bin keeps the order: two optimizers
    _refused(
        "accelerate/bin",
        bin_src,
        tmp_path,
        r"param index 0 of shape \[16, 8\] could be any of .*\(2 unnamed params have that "
        r"shape; its optimizer",
        bin_src / "optimizer.bin",
    )
    listed.write_text(json.dumps([names[0], ["nowhere.weight", *names[1][1:]]]))
    _refused(
        "accelerate/plain", src, tmp_path, "names 'nowhere.weight', which the model does not",
        src / "optimizer_1.bin", names=listed,
    )  # fmt: skip


class _Hostile:
    marker: Path

    def __reduce__(self):
        return (os.system, (f"touch {_Hostile.marker}",))


@pytest.mark.parametrize("case", ["accelerate/named", "lightning/named"])
def test_a_hostile_pickle_is_refused_unrun(tmp_path, case):
    copy = tmp_path / "src"
    if case.startswith("accelerate/"):
        shutil.copytree(_src(case), copy)
        src, victim = copy, copy / "optimizer_1.bin"
    else:
        copy.mkdir()
        src = victim = copy / _src(case).name
    _Hostile.marker = tmp_path / "ran"
    victim.write_bytes(pickle.dumps({"state": _Hostile(), "param_groups": []}))
    _refused(case, src, tmp_path, "nothing of it was run", victim)
    torch.save({"state": {}, "param_groups": [], "x": _Hostile()}, victim)  # a zip file too
    _refused(case, src, tmp_path, "nothing of it was run.*GLOBAL posix.system", victim)
    assert not _Hostile.marker.exists()


def test_the_cli_reads_both(tmp_path):
    """``--from`` and ``--to`` as the README writes them; each format found by its files;
    ``--names FILE`` for the bare params."""
    runner = CliRunner()
    names = tmp_path / "names.json"
    names.write_text(json.dumps(_meta("accelerate/plain")["index_names"]))
    for args in (
        [
            str(_src("accelerate/plain")),
            "--from",
            "accelerate",
            "--to",
            "torch",
            "--names",
            str(names),
        ],
        [str(_src("accelerate/named"))],
        [str(_src("lightning/named")), "--from", "lightning", "--to", "packaged"],
        [str(_src("lightning/single"))],
    ):
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        result = runner.invoke(app, ["convert", args[0], "-o", str(out), *args[1:]])
        assert result.exit_code == 0, result.output
        assert muonckpt.verify(out) == []
        assert "params named by" in result.output  # (Lightning's version alone left out)
        assert ("left out" in result.output) == args[0].endswith(".ckpt"), result.output
    refused = runner.invoke(
        app, ["convert", str(_src("accelerate/plain")), "-o", str(tmp_path / "no")]
    )
    assert refused.exit_code != 0 and "--names" in refused.output
    wrong = runner.invoke(
        app,
        [
            "convert",
            str(_src("lightning/named")),
            "-o",
            str(tmp_path / "no"),
            "--from",
            "accelerate",
        ],
    )
    assert wrong.exit_code != 0 and "--from" in wrong.output
    assert not (tmp_path / "no").exists()
    ours = next(p for p in tmp_path.iterdir() if p.name.startswith("out"))
    for to, wrote in (("lightning", "last.ckpt"), ("accelerate", "optimizer.bin")):
        written = runner.invoke(app, ["convert", str(ours), "-o", str(tmp_path / to), "--to", to])
        assert written.exit_code == 0 and (tmp_path / to / wrote).is_file(), written.output
        # accelerate's RNG states: another trainer's to Lightning, no --world to accelerate
        assert "left out" in written.output and "random_states (" in written.output


@pytest.mark.dist
def test_readme_accelerate_and_lightning_commands_run_as_written(tmp_path):
    """The README's commands as written (``muonckpt`` spelled ``python -m muonckpt.cli``), on
    copies of the fixtures at ``accel/step-3`` and ``lightning/checkpoints``."""
    from .test_readme import run_cli_example

    shutil.copytree(_src("accelerate/plain"), tmp_path / "accel" / "step-3")
    (tmp_path / "accel" / "names.json").write_text(
        json.dumps(_meta("accelerate/plain")["index_names"])
    )
    shutil.copytree(_src("lightning/named").parent, tmp_path / "lightning" / "checkpoints")
    run_cli_example("hf-commands", tmp_path)
    for out, case in (("from-accel", "accelerate/plain"), ("from-lightning", "lightning/named")):
        assert muonckpt.verify(tmp_path / "ckpt" / out) == []
        rows = list(offline.diff(tmp_path / "ckpt" / out, tmp_path / "ckpt" / out))
        state = _tensors(tmp_path / "ckpt" / out)[1]
        truth = _truth(case)
        momentum = [k for k in state if k.endswith(".momentum_buffer")]
        assert len(momentum) == 4 and rows
        for key in momentum:
            expected = truth[key[len("state.") :]] / (1 - MU)
            torch.testing.assert_close(state[key], expected, rtol=1e-6, atol=0)


def test_a_lightning_checkpoint_that_does_not_tell_is_refused(tmp_path):
    """The named job's .ckpt, its param_names dropped: the blocks' params share shapes, so the
    index of each is unknown (two optimizers: the model's order does not apply); without
    ``optimizer_states`` (``save_weights_only``) there is nothing to convert."""
    top = torch.load(_src("lightning/named"), weights_only=True)
    for state in top["optimizer_states"]:
        for group in state["param_groups"]:
            del group["param_names"]
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "unnamed.ckpt"
    torch.save(top, src)
    _refused(
        "lightning/named", src, tmp_path, r"optimizer_states\[0\]: param index 0 of shape", src
    )
    names = tmp_path / "names.json"
    names.write_text(json.dumps(_meta("lightning/named")["index_names"]))
    out = tmp_path / "out"
    report = interop.from_lightning(src, out, names=names)
    assert "named by the names given" in report.layout
    model, state = _tensors(out)
    for key, expected in _truth("lightning/named").items():
        param, _, what = key.rpartition(".")
        if what != "step":
            got = model[param] if what == "param" else state[f"state.{param}.{what}"]
            assert torch.equal(got, expected), key
    del top["optimizer_states"]
    src.unlink()
    torch.save(top, src)
    _refused("lightning/named", src, tmp_path, "holds no 'optimizer_states'", src)


def _state_dicts(case: str) -> list[dict]:
    """Each optimizer's ``state_dict()`` as the trainer saved it."""
    if case.startswith("accelerate/"):
        files = sorted(_src(case).glob("optimizer*.bin"))
        return [torch.load(f, weights_only=True) for f in files]
    return torch.load(_src(case), weights_only=True)["optimizer_states"]


@pytest.mark.parametrize("case", CASES)
def test_written_back_it_is_the_trainers_own_state(converted, tmp_path, case):
    """``to_accelerate`` / ``to_lightning`` of each converted fixture: every optimizer's
    ``state_dict()`` is the one the trainer saved (each index's state bitwise, every group's
    settings, tuples too; ``param_names`` aside: the job's load keeps its own) and the model's
    tensors are the ones it saved, so the trainer's own load (the ``trainers`` tier) restores
    it exactly at any world size."""
    out = tmp_path / "back"
    if case.startswith("accelerate/"):
        report = interop.to_accelerate(converted[case][0], out, world=2)
        assert report.left_out == ()
        for rank in (0, 1):  # as saved: Python's, numpy's and torch's states, the step
            name = f"random_states_{rank}.pkl"
            ours = torch.load(out / name, weights_only=False)
            theirs = torch.load(_src(case) / name, weights_only=False)
            assert repr(ours) == repr(theirs) and torch.equal(
                ours["torch_manual_seed"], theirs["torch_manual_seed"]
            )
        model = load_file(out / "model.safetensors")
        written = [torch.load(f, weights_only=True) for f in sorted(out.glob("optimizer*.bin"))]
    else:
        report = interop.to_lightning(converted[case][0], out)
        top = torch.load(out / "last.ckpt", weights_only=True)
        source = torch.load(_src(case), weights_only=True)
        assert top["global_step"] == _meta(case)["global_step"]
        assert top["lr_schedulers"] == _meta(case).get("lr_schedulers", [])
        for key in LIGHTNING_STATE:  # the loops, schedule, callbacks (a tensor too): as saved
            assert repr(top[key]) == repr(source[key]), key
        assert report.left_out == ()
        model, written = top["state_dict"], top["optimizer_states"]
    saved = _model_file(case)
    assert set(model) == set(saved)
    assert all(torch.equal(model[n], saved[n]) and model[n].dtype == saved[n].dtype for n in saved)
    expected = _state_dicts(case)
    assert len(written) == len(expected) and report.converted == ()
    for ours, theirs in zip(written, expected, strict=True):
        groups = [
            {k: v for k, v in g.items() if k != "param_names"} for g in theirs["param_groups"]
        ]
        assert ours["param_groups"] == groups
        assert ours["state"].keys() == theirs["state"].keys()
        for index, state in theirs["state"].items():
            assert ours["state"][index].keys() == state.keys(), index
            for key, value in state.items():
                got = ours["state"][index][key]
                assert got.dtype == value.dtype and torch.equal(got, value), (index, key)


def test_accelerate_schedulers_go_back_and_rng_states_only_at_their_world(converted, tmp_path):
    """A ``scheduler.bin`` (a LinearLR's ``state_dict()``, as ``save_state`` writes it) is
    carried and written back as it was; each process's RNG states are written only at the
    number of processes that saved them (``--world 2``): at 1, or without ``--world``, they are
    left out by name, never handed to other ranks; to Lightning each value is listed."""
    src = tmp_path / "state"
    shutil.copytree(_src("accelerate/named"), src)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    schedule = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=5)
    for _ in range(3):
        opt.step()
        schedule.step()
    torch.save(schedule.state_dict(), src / "scheduler.bin")
    ours = tmp_path / "ours"
    assert interop.from_accelerate(src, ours).left_out == ()
    runner = CliRunner()
    back = tmp_path / "w2"
    done = runner.invoke(app, ["convert", str(ours), "-o", str(back), "--to", "accelerate",
                               "--world", "2"])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert torch.load(back / "scheduler.bin", weights_only=True) == schedule.state_dict()
    assert {p.name for p in back.glob("random_states_*.pkl")} == {
        "random_states_0.pkl",
        "random_states_1.pkl",
    }
    for world in (1, None):
        report = interop.to_accelerate(ours, tmp_path / f"w{world}", world=world)
        assert not list((tmp_path / f"w{world}").glob("random_states_*"))
        assert (tmp_path / f"w{world}" / "scheduler.bin").exists()
        (line,) = report.left_out
        assert line.startswith("random_states (per ") and "Could not load random states" in line
    report = interop.to_lightning(ours, tmp_path / "lightning")
    assert [line.split(" (")[0] for line in report.left_out] == [
        "accelerate's schedulers",
        "accelerate's random_states",
    ]
