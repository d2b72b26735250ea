"""The trainers tier for DeepSpeed: real DeepSpeed 0.19.8 in a virtual environment of its own.

Run it with ``python -m pytest -m trainers`` (not in the default run, not in CI). The venv is
``$MUONCKPT_DS_VENV`` (default ``~/.cache/muonckpt/deepspeed-0.19.8``), made once by
``tests/fixtures/deepspeed/setup_venv.sh`` if it does not import DeepSpeed 0.19.8 (that needs
PyPI); DeepSpeed JIT-builds its CPU ops into ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/muonckpt/torch-extensions``), about 10 minutes the first time on 2 cores.

It checks that:

- the fixture producer, rerun, writes files of the same structure as the committed fixtures,
  with the same partition facts and ground truth within float rounding;
- DeepSpeed reloads each committed fixture at its own world size with exactly the recorded
  state (so the fixtures and ``ds_load.py``'s dump agree with DeepSpeed);
- DeepSpeed itself cannot resume a Muon checkpoint at another world size, by either route
  (tests/fixtures/deepspeed/LOADING.md): the native files are refused, the universal
  conversion fails on the Muon group (DeepSpeed #8608);
- DeepSpeed -> ``muonckpt convert --from deepspeed`` -> ``muonckpt convert --to deepspeed
  --world N`` -> DeepSpeed at N = 1 and 3 restores the source's state exactly and trains on;
- DeepSpeed ZeRO-1/3 -> muonckpt -> DeepSpeed at another world size, at the stage it was
  saved at or the one ``--zero-stage`` chooses, restores the source's state exactly;
- DeepSpeed -> the packaged Muon (``--to packaged``) resharded to 2 x 2 -> DeepSpeed at 3
  restores it too: params and Adam state exactly, the momentum within the rounding of its
  two form conversions (EMA to sum and back).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.trainers, pytest.mark.dist]

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "tests" / "fixtures" / "deepspeed"
FIXTURES = sorted(p.name for p in HERE.iterdir() if (p / "meta.json").is_file())
CACHE = Path("~/.cache/muonckpt").expanduser()
VENV = Path(os.environ.get("MUONCKPT_DS_VENV", CACHE / "deepspeed-0.19.8")).expanduser()
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR", str(CACHE / "torch-extensions"))
STATE_KEYS = ("param", "momentum_buffer", "exp_avg", "exp_avg_sq", "step")


def meta(name: str) -> dict:
    return json.loads((HERE / name / "meta.json").read_text())


@pytest.fixture(scope="session")
def ds_python() -> Path:
    """The DeepSpeed venv's python, the venv made first if it lacks DeepSpeed 0.19.8."""
    done = subprocess.run(
        ["bash", str(HERE / "setup_venv.sh"), str(VENV)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return VENV / "bin" / "python"


def ds_run(python: Path, script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": EXTENSIONS}
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [str(python), str(HERE / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def tree(python: Path, root: Path, out: Path) -> dict:
    done = ds_run(python, "ds_tree.py", str(root), str(out), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def ds_load(python: Path, ckpt: Path, out: Path, world: int, like: str, *more: str) -> dict:
    """``ds_load.py`` at ``world`` with fixture ``like``'s stage, aux Adam and dtype; its
    result.json."""
    spec = meta(like)
    args = [str(ckpt), str(out), "--world", str(world), "--stage", str(spec["stage"])]
    args += ["--aux", spec["aux"], "--dtype", spec["dtype"], "--timeout", "1500", *more]
    done = ds_run(python, "ds_load.py", *args, timeout=1800)
    result = json.loads((out / "result.json").read_text())
    assert (done.returncode == 0) == result["ok"], done.stderr[-4000:]
    return result


def assert_same_state(
    loaded: dict[str, torch.Tensor], truth: dict[str, torch.Tensor], momentum_rtol: float = 0.0
) -> None:
    """Every ``param``, ``momentum_buffer``, ``exp_avg``, ``exp_avg_sq`` and ``step`` of the
    truth, bit for bit, in the loaded state (which holds no such key the truth lacks); the
    momentum within ``momentum_rtol`` of it where that is not 0."""
    want = {k for k in truth if k.rsplit(".", 1)[1] in STATE_KEYS}
    have = {k for k in loaded if k.rsplit(".", 1)[1] in STATE_KEYS}
    assert have == want, (sorted(have - want), sorted(want - have))
    for key in sorted(want):
        a, b = loaded[key], truth[key]
        if key.endswith(".step"):
            assert float(a) == float(b), (key, a, b)
            continue
        if key.endswith(".momentum_buffer") and b.dtype == torch.bfloat16:
            # a bf16 run's momentum, as saved; torch's load_state_dict casts it to the flat
            # param's fp32 (torch/optim/optimizer.py, LOADING.md), exactly
            b = b.float()
        assert a.shape == b.shape and a.dtype == b.dtype, (key, a.shape, a.dtype, b.shape, b.dtype)
        if momentum_rtol and key.endswith(".momentum_buffer"):
            torch.testing.assert_close(a, b, rtol=momentum_rtol, atol=0.0, msg=key)
            continue
        assert torch.equal(a, b), (key, (a.float() - b.float()).abs().max().item())


def as_loaded(groups: list[dict]) -> list[dict]:
    """The partition facts of a save as DeepSpeed holds them right after loading it: a bf16
    momentum buffer is fp32 then (torch's ``load_state_dict`` casts a state to its param's
    dtype, the fp32 flat partition; the next step casts it back)."""
    groups = json.loads(json.dumps(groups))
    for group in groups:
        for rank in group["per_rank"]:
            if rank.get("momentum_dtype") == "torch.bfloat16":  # (ZeRO-3's facts have none)
                rank["momentum_dtype"] = "torch.float32"
                form = rank["state_forms"]["momentum_buffer"]
                rank["state_forms"]["momentum_buffer"] = form.replace("bfloat16", "float32")
    return groups


@pytest.fixture(scope="session")
def fresh(ds_python: Path, tmp_path_factory) -> Path:
    """Every fixture made again by make_fixtures.py, in a temporary directory."""
    out = tmp_path_factory.mktemp("ds-fixtures")
    done = ds_run(ds_python, "make_fixtures.py", str(out), "--timeout", "1500", timeout=3600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    return out


def test_fixtures_are_committed() -> None:
    assert len(FIXTURES) >= 8, FIXTURES
    worlds = {
        (meta(n)["world"], meta(n)["stage"], meta(n)["aux"], meta(n)["dtype"]) for n in FIXTURES
    }
    assert {w for w, *_ in worlds} == {2, 3}
    assert {s for _, s, _, _ in worlds} == {1, 2, 3}
    assert {a for _, _, a, _ in worlds} == {"torch_adam", "fused_adam"}
    assert "bf16" in {d for *_, d in worlds}


@pytest.mark.parametrize("name", FIXTURES)
def test_the_producer_makes_the_same_files_again(ds_python, fresh, tmp_path, name) -> None:
    committed = tree(ds_python, HERE / name / "ckpt", tmp_path / "committed.json")
    assert tree(ds_python, fresh / name / "ckpt", tmp_path / "fresh.json") == committed
    old, new = meta(name), json.loads((fresh / name / "meta.json").read_text())
    for key in ("world", "stage", "aux", "dtype", "params", "groups", "optimizer", "config"):
        assert new[key] == old[key], key
    assert sorted(new["files"]) == sorted(old["files"])
    truth_old = load_file(HERE / name / "truth.safetensors")
    truth_new = load_file(fresh / name / "truth.safetensors")
    assert sorted(truth_new) == sorted(truth_old)
    loose = meta(name)["dtype"] == "bf16"
    for key, value in truth_old.items():
        other = truth_new[key]
        assert other.dtype == value.dtype and other.shape == value.shape, key
        torch.testing.assert_close(
            other.float(), value.float(), rtol=1e-2 if loose else 1e-4, atol=1e-2 if loose else 1e-5
        )


@pytest.mark.parametrize("name", FIXTURES)
def test_deepspeed_reloads_each_fixture_as_recorded(ds_python: Path, tmp_path, name) -> None:
    spec = meta(name)
    result = ds_load(ds_python, HERE / name / "ckpt", tmp_path, spec["world"], name)
    assert result["ok"], result
    assert_same_state(
        load_file(tmp_path / "loaded.safetensors"), load_file(HERE / name / "truth.safetensors")
    )
    loaded = json.loads((tmp_path / "loaded.json").read_text())
    assert loaded["groups"] == as_loaded(spec["groups"])
    assert len(result["losses"]) == 2 and all(x == x for x in result["losses"]), result


def test_deepspeed_refuses_its_own_files_at_another_world_size(ds_python: Path, tmp_path) -> None:
    name = "w2_z1_torchadam_fp32"
    result = ds_load(ds_python, HERE / name / "ckpt", tmp_path, 3, name)
    assert not result["ok"]
    assert "Automatic adjustment of ZeRO's optimizer state partitioning" in result["error"], result


def test_deepspeeds_universal_conversion_fails_on_muon(ds_python: Path, tmp_path) -> None:
    """DeepSpeed #8608: ``ds_to_universal`` reads ``exp_avg`` from every param group; the Muon
    group has only ``momentum_buffer``. When this fails, DeepSpeed fixed it: revisit LOADING.md."""
    name = "w2_z1_torchadam_fp32"
    ckpt = HERE / name / "ckpt" / meta(name)["tag"]
    done = subprocess.run(
        [
            str(ds_python),
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(ckpt),
            "--output_folder",
            str(tmp_path / "universal"),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            # A checkpoint of a plain (non-Megatron) model has no universal_checkpoint_info;
            # without this, the conversion stops at that (ds_to_universal.py:1088).
            "--inject_missing_state",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": EXTENSIONS},
    )
    assert done.returncode != 0
    assert "KeyError: 'exp_avg'" in done.stdout + done.stderr, done.stderr[-3000:]


def muonckpt_cli(*args: str) -> subprocess.CompletedProcess:
    probe = "import sys; from muonckpt.cli import main; sys.argv[0] = 'muonckpt'; main()"
    return subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("name", ["w2_z1_torchadam_fp32", "w2_z2_fused_fp32"])
@pytest.mark.parametrize("world", [1, 3])
def test_round_trip_to_deepspeed_at_another_world_size(ds_python, tmp_path, name, world) -> None:
    """DeepSpeed (world 2) -> muonckpt -> DeepSpeed at ``world``: the same state, and it trains.

    The commands are the README's: ``convert SRC -o DST --from deepspeed`` and ``convert SRC
    -o DST --to deepspeed --world N``."""
    src = HERE / name / "ckpt"
    ours, back, out = tmp_path / "muonckpt", tmp_path / f"ds-world{world}", tmp_path / "loaded"
    done = muonckpt_cli("convert", str(src), "-o", str(ours), "--from", "deepspeed")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    done = muonckpt_cli(
        "convert",
        str(ours),
        "-o",
        str(back),
        "--to",
        "deepspeed",
        "--world",
        str(world),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = ds_load(ds_python, back, out, world, name)
    assert result["ok"], result
    assert_same_state(
        load_file(out / "loaded.safetensors"), load_file(HERE / name / "truth.safetensors")
    )
    loaded = json.loads((out / "loaded.json").read_text())
    assert (
        loaded["groups"][0]["per_rank"][0]["partition_id"] == 0
        and len(loaded["groups"][0]["per_rank"]) == world
    )
    assert len(result["losses"]) == 2 and all(x == x for x in result["losses"]), result


@pytest.mark.parametrize(
    ("name", "world", "stage", "like"),
    [
        ("w2_z3_torchadam_fp32", 3, None, "w2_z3_torchadam_fp32"),
        ("w3_z3_fused_fp32", 1, None, "w3_z3_fused_fp32"),
        ("w2_z1_torchadam_fp32", 3, "3", "w2_z3_torchadam_fp32"),
        ("w3_z3_fused_fp32", 2, "2", "w2_z2_fused_fp32"),
    ],
)
def test_written_back_at_its_zero_stage_or_the_chosen_one(
    ds_python, tmp_path, name, world, stage, like
) -> None:
    """DeepSpeed -> muonckpt -> DeepSpeed at ``world``, at the ZeRO stage the source was
    saved at (ZeRO-3 stays ZeRO-3: a model states file per rank, each param's partitions) or
    the one ``--zero-stage`` chooses (ZeRO-1 as ZeRO-3, ZeRO-3 as ZeRO-2): DeepSpeed's own
    ``load_checkpoint`` in a job of fixture ``like``'s stage restores the source's state
    exactly, and it trains."""
    src = HERE / name / "ckpt"
    ours, back, out = tmp_path / "muonckpt", tmp_path / "ds", tmp_path / "loaded"
    done = muonckpt_cli("convert", str(src), "-o", str(ours))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    chosen = ["--zero-stage", stage] if stage else []
    args = ["convert", str(ours), "-o", str(back), "--to", "deepspeed", "--world", str(world)]
    done = muonckpt_cli(*args, *chosen)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    said = " ".join((done.stdout + done.stderr).split())
    assert f"ZeRO-{meta(like)['stage']}, world {world}" in said, said
    result = ds_load(ds_python, back, out, world, like)
    assert result["ok"], result
    assert_same_state(
        load_file(out / "loaded.safetensors"), load_file(HERE / name / "truth.safetensors")
    )
    assert len(result["losses"]) == 2 and all(x == x for x in result["losses"]), result


def test_round_trip_through_the_packaged_muon_at_2x2(ds_python, tmp_path) -> None:
    """DeepSpeed (world 2) -> the packaged Muon (sum form) -> resharded to dp 2 x tp 2 ->
    DeepSpeed at 3: the params and Adam state exactly, the momentum within the rounding of
    EMA -> sum -> EMA (two float32 scalings by 1 - mu and its inverse), and it trains."""
    name = "w2_z1_torchadam_fp32"
    packaged, resharded = tmp_path / "packaged", tmp_path / "packaged-2x2"
    back, out = tmp_path / "ds-world3", tmp_path / "loaded"
    src = str(HERE / name / "ckpt")
    steps = [
        ("convert", src, "-o", str(packaged), "--from", "deepspeed", "--to", "packaged"),
        ("reshard", str(packaged), "--dp", "2", "--tp", "2", "-o", str(resharded)),
        ("convert", str(resharded), "-o", str(back), "--to", "deepspeed", "--world", "3"),
    ]
    for command in steps:
        done = muonckpt_cli(*command)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    result = ds_load(ds_python, back, out, 3, name)
    assert result["ok"], result
    truth = load_file(HERE / name / "truth.safetensors")
    assert_same_state(load_file(out / "loaded.safetensors"), truth, momentum_rtol=1e-6)
    assert len(result["losses"]) == 2 and all(x == x for x in result["losses"]), result


def test_the_deepspeed_benchmark_runs(ds_python: Path) -> None:
    """``benchmarks/bench_deepspeed.py`` at a tiny size (its smoke run; no time asserted)."""
    env = {**os.environ, "MUONCKPT_DS_VENV": str(VENV), "TORCH_EXTENSIONS_DIR": EXTENSIONS}
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "smoke.py"), "bench_deepspeed.py"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "| muonckpt to_deepspeed (world 3) |" in done.stdout, done.stdout
