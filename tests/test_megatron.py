"""Megatron-Core's layer-wise Muon in and out: the committed torch_dist fixtures (written by
Megatron itself, ``tests/fixtures/megatron/make_fixtures.py``) read without Megatron, every value
checked bitwise against the optimizer's in-memory state, then loaded into torch.optim.Muon +
AdamW; and written back at the other layout, checked against what Megatron wrote there."""

from __future__ import annotations

import json
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
from muonckpt.errors import ArgumentError, OptionError
from muonckpt.interop.dcp import files as dcp_files
from muonckpt.interop.dcp import metadata as dcp_metadata
from muonckpt.interop.megatron import reader as megatron

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


JOBS = ("tp2_dp1_job", "tp1_dp2_job_torch")
"""The fixtures of whole jobs, saved by ``megatron.training``'s ``save_checkpoint``."""


def _trainer(path: Path) -> dict:
    """The trainer state a conversion stored in ``path``'s ``extra``, its tensors read."""
    from muonckpt.files import job_tree
    from muonckpt.files.pieces import PieceReader, open_checkpoint

    files, manifest = open_checkpoint(path)
    with PieceReader(files, manifest) as reader:
        return job_tree.read(reader, manifest.extra.shared, "extra")["trainer"]


def _digest(tree: dict) -> dict:
    """One rank's carried RNG states as make_fixtures.py's ``rng_digest`` records them."""
    import hashlib

    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    py, np_state = tree["random_rng_state"], tree["np_rng_state"]
    words = (py["version"], tuple(py["words"]), py["gauss"])
    return {
        "random_rng_state": sha(repr(words).encode()),
        "np_rng_state": [np_state["name"], sha(np_state["key"].numpy().tobytes()),
                         np_state["pos"], np_state["has_gauss"], np_state["cached_gaussian"]],
        "torch_rng_state": sha(tree["torch_rng_state"].numpy().tobytes()),
        "cuda_rng_state": sha(tree["cuda_rng_state"].numpy().tobytes()),
        "rng_tracker_states": {
            k: sha(v.numpy().tobytes()) for k, v in sorted(tree["rng_tracker_states"].items())
        },
    }  # fmt: skip


@pytest.mark.parametrize("name", JOBS)
def test_a_jobs_own_state_is_carried_exactly(converted, name):
    """The scheduler, the iteration, the data position (``consumed_train_samples``) and every
    TP rank's RNG states, as Megatron held them at the save, in the output's ``extra``."""
    truth = json.loads((FIXTURES / name / "truth.json").read_text())
    trainer = _trainer(converted[name])
    shared = trainer["shared"]
    assert trainer["name"] == "megatron" and muonckpt.read_manifest(converted[name]).step == 3
    assert shared["iteration"] == 3 and shared["num_floating_point_operations_so_far"] == 1234.5
    assert shared["opt_param_scheduler"] == truth["opt_param_scheduler"]
    assert shared["args"]["consumed_train_samples"] == truth["consumed_train_samples"] == 12
    assert "attention_backend" not in shared["args"]  # (an enum: listed as left out)
    assert trainer["layout"] == {"pp": 1, "tp": truth["tp"]}
    assert [_digest(per_dp[0]) for per_dp in trainer["ranks"]["rng_state"]] == truth["rng_state"]


def test_the_job_state_goes_back_to_megatron_where_its_ranks_are(converted, tmp_path):
    """Written back at its TP size, every RNG item as it was saved (at another:
    test_the_whole_job_commands_run_as_written). Another trainer's writer lists the whole
    job state by name."""
    source = converted["tp2_dp1_job"]
    same = megatron.to_megatron(source, tmp_path / "same", tp=2, dp=1)
    assert same.left_out == ()
    index = _index(same.path)
    rng = sorted(fqn for fqn in index.values if fqn.startswith("rng_state/"))
    assert rng == ["rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2"]
    again = megatron.from_megatron(same.path, tmp_path / "again").path
    first, second = _trainer(source), _trainer(again)
    assert [[_digest(t) for t in r] for r in first["ranks"]["rng_state"]] == [
        [_digest(t) for t in r] for r in second["ranks"]["rng_state"]
    ]
    assert first["shared"] == second["shared"]
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    rng = manifest["extra"]["global"]["values"]["trainer"]["ranks"]["rng_state"]
    del rng[0][0]["random_rng_state"]
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"extra\['trainer'\] is not Megatron's") as info:
        megatron.to_megatron(broken, tmp_path / "no", tp=2, dp=1)
    assert "KeyError: 'random_rng_state'" in str(info.value) and not (tmp_path / "no").exists()
    dcp = interop.to_dcp(source, tmp_path / "dcp", to="torch")
    assert [line.split(" (")[0] for line in dcp.left_out] == [
        f"megatron's {name}" for name in (*first["shared"], "rng_state")
    ]


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


def test_pipeline_and_expert_parallel_checkpoints_are_refused_naming_the_size(tmp_path):
    """PP and EP layouts of the layer-wise optimizer are not read: one line naming the size the
    training args record (the torch format's ``mp_rank_XX_YYY`` names are refused too:
    test_megatron_torch.py)."""
    from argparse import Namespace

    from .test_foreign_limits import _megatron_dist_common

    args = Namespace(pipeline_model_parallel_size=2, tensor_model_parallel_size=1)
    root = _megatron_dist_common(tmp_path / "c", lambda c: [{**c[0], "args": args}])
    with pytest.raises(CheckpointError, match="the training args say pipeline_model_par") as info:
        megatron.from_megatron(root, tmp_path / "o")
    assert "\n" not in str(info.value) and ".metadata" in str(info.value)
    read = megatron.Namespace()  # (as the reader reads args)
    read.expert_model_parallel_size = 4
    with pytest.raises(CheckpointError, match="expert_model_parallel_size 4: the layer-wise"):
        megatron._check_parallelism(read, tmp_path)


def test_the_whole_job_commands_run_as_written(tmp_path, monkeypatch):
    """The README's whole-job commands, in process, on a copy of ``tp2_dp1_job``: at TP 1
    the RNG states (saved per TP rank at TP 2) are left out, named, and the args say
    ``no_save_rng`` (Megatron then ignores them itself); the scheduler, iteration and args go
    back, the args' sizes the output's."""
    import shlex

    from .test_readme import example

    shutil.copytree(_ckpt("tp2_dp1_job"), tmp_path / "mcore" / "job")
    monkeypatch.chdir(tmp_path)
    outputs = []
    for command in example("megatron-job-commands").strip().splitlines():
        result = CliRunner().invoke(app, shlex.split(command)[1:])
        assert result.exit_code == 0, result.output
        outputs.append(" ".join(result.output.split()))
    assert "left out args attention_backend, exit_signal" in outputs[0]
    assert "left out rng_state (per rank, saved at PP 1 TP 2; written at PP 1 TP 1" in outputs[1]
    index = _index(tmp_path / "mcore" / "job-tp1-dp2")
    assert not [fqn for fqn in index.values if fqn.startswith("rng_state/")]
    common = _common(index)
    args = vars(common["args"])
    assert (args["tensor_model_parallel_size"], args["data_parallel_size"]) == (1, 2)
    assert args["no_save_rng"] is True and args["consumed_train_samples"] == 12
    truth = json.loads((FIXTURES / "tp2_dp1_job" / "truth.json").read_text())
    assert common["opt_param_scheduler"] == truth["opt_param_scheduler"]
    assert common["iteration"] == 3


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
    assert megatron.is_megatron(tmp_path / "mcore" / "ckpt-tp1-dp2")
    assert muonckpt.read_manifest(tmp_path / "ckpt" / "from-mcore-2x2").topology == {
        "dp": 2,
        "tp": 2,
    }


OTHER_LAYOUT = {"tp2_dp1": ("tp1_dp2", 1, 2), "tp1_dp2": ("tp2_dp1", 2, 1)}
"""Fixture -> the fixture Megatron wrote at the other layout, and that layout's TP and DP."""


@pytest.fixture(scope="module")
def exported(converted, tmp_path_factory):
    """Each dp_reshardable fixture, converted, written back at the other layout, once."""
    root = tmp_path_factory.mktemp("mcore-out")
    return {
        name: megatron.to_megatron(converted[name], root / name, tp=tp, dp=dp).path
        for name, (_, tp, dp) in OTHER_LAYOUT.items()
    }


def _index(root: Path) -> dcp_metadata.DcpIndex:
    return dcp_metadata.read_index(megatron.iteration_dir(root))


def _common(index: dcp_metadata.DcpIndex) -> dict:
    value = dcp_files.read_value(
        index, index.values[megatron.COMMON + "/shard_0_1"], megatron.ADMITTED
    )
    return value[0]


@pytest.mark.parametrize("name", sorted(OTHER_LAYOUT))
def test_the_export_is_what_megatron_writes_at_that_layout(exported, name):
    """Keys, shapes, dtypes and DCP chunks as Megatron wrote them at the target layout; every
    tensor the source's bitwise (the bf16 weights too); the same common state."""
    mine, theirs = _index(exported[name]), _index(_ckpt(OTHER_LAYOUT[name][0]))
    source = _index(_ckpt(name))
    assert set(mine.tensors) == set(theirs.tensors) and set(mine.values) == set(theirs.values)
    for fqn, ours in mine.tensors.items():
        other = theirs.tensors[fqn]
        assert (ours.shape, ours.dtype) == (other.shape, other.dtype), fqn
        chunks = sorted((c.offsets, c.sizes) for c in ours.chunks)
        assert chunks == sorted((c.offsets, c.sizes) for c in other.chunks), fqn
        expected = dcp_files.read_tensor(source, source.tensors[fqn])
        assert torch.equal(dcp_files.read_tensor(mine, ours), expected), fqn
    for fqn in mine.values:
        if fqn != megatron.COMMON + "/shard_0_1":
            assert dcp_files.read_value(mine, mine.values[fqn]) == [None], fqn
    common, expected = _common(mine), _common(source)
    args, saved = vars(common.pop("args")), vars(expected.pop("args"))
    sizes = {"tensor_model_parallel_size": OTHER_LAYOUT[name][1], "data_parallel_size": 1}
    sizes["data_parallel_size"] = OTHER_LAYOUT[name][2]
    written = {"pipeline_model_parallel_size": 1, "world_size": 2, "ckpt_format": "torch_dist"}
    written.update(use_dist_ckpt=True, no_save_rng=True)
    assert args == {**saved, **sizes, **written}
    assert common.pop("content_metadata")["distrib_optim_sharding_type"] == "dp_reshardable"
    assert repr(common) == repr(expected)
    assert (exported[name] / megatron.LATEST).read_text() == "3"


@pytest.mark.parametrize("name", sorted(OTHER_LAYOUT))
def test_in_out_in_gives_back_every_tensor_bitwise(converted, exported, tmp_path, name):
    again = megatron.from_megatron(exported[name], tmp_path / "again").path
    for file in ("model.safetensors", "optimizer.safetensors"):
        first, second = load_file(converted[name] / file), load_file(again / file)
        assert set(first) == set(second), file
        assert all(torch.equal(first[k], second[k]) for k in first), file
    assert muonckpt.read_manifest(again).groups == muonckpt.read_manifest(converted[name]).groups


def test_a_packaged_checkpoint_at_2x2_goes_back_within_rounding(tmp_path):
    """Converted for the packaged Muon (sum form) and resharded, then written for Megatron: the
    momentum back in EMA form within float rounding, everything else bitwise."""
    packaged = megatron.from_megatron(_ckpt("tp2_dp1"), tmp_path / "p", to="packaged").path
    resharded = offline.reshard(packaged, tmp_path / "r", dp=2, tp=2)
    report = interop.to_megatron(resharded, tmp_path / "m", tp=1, dp=2)
    assert report.converted == ("8 Muon params: sum -> ema (x 0.05, mu=0.95)",)
    mine, source = _index(report.path), _index(_ckpt("tp2_dp1"))
    for fqn, item in source.tensors.items():
        got, expected = (
            dcp_files.read_tensor(mine, mine.tensors[fqn]),
            dcp_files.read_tensor(source, item),
        )
        if ".momentum_buffer." in fqn:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        else:
            assert torch.equal(got, expected), fqn


def test_output_refusals_name_the_flag_or_the_file(converted, tmp_path):
    with pytest.raises(OptionError, match="does not split into 3 TP chunks") as info:
        megatron.to_megatron(converted["tp2_dp1"], tmp_path / "a", tp=3, dp=1)
    assert info.value.option == "--tp" and not (tmp_path / "a").exists()
    with pytest.raises(ArgumentError, match="dp must be the data-parallel size") as info:
        megatron.to_megatron(converted["tp2_dp1"], tmp_path / "b", tp=1, dp=0)
    assert info.value.argument == "dp"  # the API speaks in arguments, the CLI in flags
    deepspeed = FIXTURES.parent / "deepspeed" / "w2_z1_fused_fp32" / "ckpt"
    foreign = interop.from_deepspeed(deepspeed, tmp_path / "ds").path
    with pytest.raises(CheckpointError, match="no Megatron param group") as info:
        megatron.to_megatron(foreign, tmp_path / "c", tp=1, dp=1)
    assert "\n" not in str(info.value) and str(foreign) in str(info.value)
    result = CliRunner().invoke(
        app, ["convert", str(converted["tp2_dp1"]), "-o", str(tmp_path / "d"), "--to", "megatron"]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "Megatron-Core output needs --tp" in " ".join(result.output.split())


RESUMED = ("tp2_dp1", "tp1_dp2")
"""The fixtures the packaged Muon resumes at 2 x 2 (each layout Megatron saved at)."""
EMA_TO_SUM_RTOL = 2.0**-23
"""The EMA -> sum conversion multiplies the fp32 momentum by ``1 / (1 - mu)`` (20 for mu = 0.95,
exact in fp32): one fp32 rounding of the product (half an ulp, 2**-24 relative) plus the
factor's own rounding from float64 to fp32 (below 1e-15); 2**-23 bounds both."""


def _packaged_groups(manifest) -> list[dict]:
    """The packaged Muon's groups over zero params, the manifest's groups in its order, each
    with the settings the checkpoint records (Megatron's Muon: no Nesterov)."""
    shapes = {e.name: e.shape for e in manifest.params}
    groups = []
    for group in manifest.groups:
        h, kind = group.hyperparams, group.optimizer
        params = [(n, torch.zeros(shapes[n])) for n in group.params]
        if kind["role"] == "muon":
            settings = {"use_muon": True, "lr": h["lr"], "momentum": h["momentum"],
                        "nesterov": kind["nesterov"], "weight_decay": h["weight_decay"],
                        "matched_adamw_rms": kind["matched_adamw_rms"]}  # fmt: skip
        else:
            settings = {"lr": h["lr"], "weight_decay": h["weight_decay"],
                        "adamw_betas": tuple(h["betas"]), "adamw_eps": h["eps"]}  # fmt: skip
        groups.append({"params": params, **settings})
    return groups


def _split_dims(manifest) -> dict[str, int]:
    """Megatron's own TP split of each param (``interop.megatron.tp_chunks``)."""
    from muonckpt.interop.megatron.tp_chunks import partition_dim

    dims = {e.name: partition_dim(e.name) for e in manifest.params}
    return {n: d for n, d in dims.items() if d is not None}


def _grad(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=gen)


def _resume_packaged(sources: list[str]) -> list[dict]:
    """(gloo child, world 4) Per source: the packaged Muon at dp 2 x tp 2 over zero params,
    loaded from the source alone; this rank's params and state right after the load, and its
    params after one step on fixed gradients (each rank its cut of them)."""
    from muonckpt.distributed import collectives
    from muonckpt.distributed.groups import grid_groups
    from muonckpt.layout.topology import Topology
    from muonckpt.optim.muon import Muon
    from muonckpt.optim.sharding import shard_param_groups
    from muonckpt.state.regions import extract

    dp_group, tp_group = grid_groups(2, 2)
    d, t = collectives.group_rank(dp_group), collectives.group_rank(tp_group)
    out = []
    for src in sources:
        manifest = muonckpt.read_manifest(src)
        sharded = shard_param_groups(
            _packaged_groups(manifest), Topology(2, 2), d, t, tp_split_dims=_split_dims(manifest)
        )
        opt = Muon(sharded.param_groups)
        opt.enable_distributed_mode(
            sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConversionWarning)
            muonckpt.load(opt, src)
        steps = torch.tensor([float(g.get("step", -1)) for g in opt.param_groups])
        loaded: dict[str, torch.Tensor] = {}
        for group in opt.param_groups:
            for n, p in zip(group["param_names"], group["params"], strict=True):
                loaded[f"{n}.param"] = p.detach().clone()
                loaded.update({f"{n}.{k}": v.clone() for k, v in opt.state[p].items()})
                full = _grad(n, manifest.param(n).shape)
                p.grad = extract(full, sharded.layout.region(sharded.index(n), d, t)).reshape(
                    p.shape
                )
        opt.step()
        stepped = {n: p.detach().clone() for g in opt.param_groups
                   for n, p in zip(g["param_names"], g["params"], strict=True)}  # fmt: skip
        out.append({"coords": torch.tensor([d, t]), "loaded": loaded, "stepped": stepped,
                    "steps": steps})  # fmt: skip
    return out


def _assemble(manifest, ranks: list[dict], what: str) -> dict[str, torch.Tensor]:
    """Whole tensors from the ranks' local pieces (``NAME.KEY`` or ``NAME``); NaN where no
    rank holds an element, so that it fails every comparison."""
    from muonckpt.layout.topology import Topology
    from muonckpt.optim.sharding import shard_param_groups
    from muonckpt.state.regions import insert_

    groups = _packaged_groups(manifest)
    layout = shard_param_groups(groups, Topology(2, 2), 0, 0, tp_split_dims=_split_dims(manifest))
    full: dict[str, torch.Tensor] = {}
    for rank in ranks:
        d, t = rank["coords"].tolist()
        for key, piece in rank[what].items():
            name = key.rsplit(".", 1)[0] if what == "loaded" else key
            shape = manifest.param(name).shape
            target = full.setdefault(key, torch.full(shape, float("nan")))
            insert_(target, layout.layout.region(layout.index(name), d, t), piece)
    return full


@pytest.mark.dist
def test_it_resumes_in_the_packaged_muon_at_2x2_from_the_converted_checkpoint(tmp_path):
    """``convert --from megatron --to packaged``, then the packaged Muon at 2 x 2 over zero
    params loads it: the fp32 masters and AdamW's moments bitwise the source's, Muon's
    momentum its EMA / (1 - mu) within :data:`EMA_TO_SUM_RTOL`; one step on, every param
    finite, moved, and bitwise what the same load gives at 1 x 1."""
    from muonckpt.distributed.launch import run_distributed
    from muonckpt.optim.muon import Muon

    sources = []
    for name in RESUMED:
        dst = tmp_path / name
        args = ["convert", str(_ckpt(name)), "-o", str(dst), "--from", "megatron"]
        result = CliRunner().invoke(app, [*args, "--to", "packaged"])
        assert result.exit_code == 0 and "ema -> sum" in result.output, result.output
        sources.append(str(dst))
    ranks = run_distributed(_resume_packaged, 4, sources, timeout=240)
    for i, (name, src) in enumerate(zip(RESUMED, sources, strict=True)):
        manifest, truth = (
            muonckpt.read_manifest(src),
            load_file(FIXTURES / name / "truth.safetensors"),
        )
        mu = {n: g.hyperparams["momentum"] for g in manifest.groups if "momentum" in g.hyperparams
              for n in g.params}  # fmt: skip
        loaded = _assemble(manifest, [r[i] for r in ranks], "loaded")
        for g, group in enumerate(manifest.groups):  # AdamW's step, kept per group
            if group.optimizer["role"] == "adamw":
                expected = {truth[f"{n}.step"].item() for n in group.params}
                assert {r[i]["steps"][g].item() for r in ranks} == expected == {3.0}, g
        assert set(loaded) == {k for k in truth if not k.endswith(".step")}
        for key, got in loaded.items():
            expected = truth[key]
            if key.endswith(".momentum_buffer"):
                expected = expected / (1 - mu[key.rsplit(".", 1)[0]])
                torch.testing.assert_close(got, expected, rtol=EMA_TO_SUM_RTOL, atol=0.0, msg=key)
            else:
                assert torch.equal(got, expected), key
        with warnings.catch_warnings():  # the same load and step in one process
            warnings.simplefilter("ignore", ConversionWarning)
            alone = Muon(_packaged_groups(manifest))
            muonckpt.load(alone, src)
        for group in alone.param_groups:
            for n, p in zip(group["param_names"], group["params"], strict=True):
                p.grad = _grad(n, p.shape)
        alone.step()
        stepped = _assemble(manifest, [r[i] for r in ranks], "stepped")
        for group in alone.param_groups:
            for n, p in zip(group["param_names"], group["params"], strict=True):
                got = stepped[n]
                assert torch.isfinite(got).all() and not torch.equal(got, truth[f"{n}.param"]), n
                assert torch.equal(got, p.detach()), (name, n)
