"""The trainers tier for Megatron-Core: real Megatron-Core 0.19.2 (emerging-optimizers 0.3.0,
torch 2.13 on CPU through ``tests/fixtures/megatron/shim.py``) in a Python 3.12 venv of its own.

Run it with ``python -m pytest -m trainers -k megatron`` (not in the default run, not in CI).
The venv is ``$MUONCKPT_MEGATRON_VENV``, else the first of :data:`VENVS` that exists, made as
``tests/fixtures/megatron/make_fixtures.py`` says. Each Megatron run is world 2 on gloo
(``tests/fixtures/megatron/mc_load.py``): it loads a checkpoint root at a TP size, dumps the
optimizer's state right after the load and trains 2 steps.

It checks that:

- Megatron -> ``muonckpt convert --from megatron`` -> ``muonckpt convert --to megatron --tp T
  --dp D`` -> Megatron at the other layout (TP2 DP1 -> TP1 DP2 and back, from torch_dist and
  from the ``torch`` format) restores the source's state exactly (fp32 masters, Muon
  momentum, AdamW moments and step) and trains on with a finite loss;
- the same through the packaged Muon at 2 x 2 (``--to packaged``, resharded): the momentum
  within the rounding of its two form conversions (EMA to sum and back), the rest exactly;
- Megatron itself loads its own dp_reshardable checkpoint at the other layout
  (``dist_checkpointing.load``, the tensors being global): the state equal too;
- the producer, ``make_fixtures.py``, remakes every fixture (torch_dist in both optimizer
  formats, and ``--ckpt-format torch`` through ``megatron.training``'s own
  ``save_checkpoint``): the same files, params, shapes and groups as the committed one, and
  ``convert --from megatron`` of the new files is its new truth bitwise (the runs are not
  bitwise reproducible between processes, so the values are compared with the run's own truth);
- a whole job saved by ``megatron.training``'s ``save_checkpoint`` (``tp2_dp1_job``,
  ``tp1_dp2_job_torch``), converted in and out, resumes through ``pretrain_gpt.py``'s
  ``load_checkpoint`` with its LR scheduler and RNG states (``mc_job_load.py``) at the same
  and the other TP size: state, scheduler, iteration, consumed samples exactly, the RNG states
  exactly where the TP size is the saved one;
- ``benchmarks/bench_megatron.py`` runs (its smoke run).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from muonckpt import offline
from muonckpt.cli import app

pytestmark = [pytest.mark.trainers, pytest.mark.dist]

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "tests" / "fixtures" / "megatron"
VENVS = (Path("~/.cache/muonckpt/megatron-core-0.19.2").expanduser(), Path("/work/mcvenv"))
"""Where the Megatron venv is looked for when ``$MUONCKPT_MEGATRON_VENV`` is not set."""
STATE_KEYS = ("param", "momentum_buffer", "exp_avg", "exp_avg_sq", "step")
OTHER_TP = {"tp2_dp1": 1, "tp1_dp2": 2}
"""Fixture -> the TP size of the other layout (world 2: DP ``2 / TP``)."""


@pytest.fixture(scope="session")
def mc_python() -> Path:
    named = os.environ.get("MUONCKPT_MEGATRON_VENV")
    venvs = [Path(named).expanduser()] if named else list(VENVS)
    for venv in venvs:
        if (venv / "bin" / "python").is_file():
            return venv / "bin" / "python"
    pytest.skip(f"no Megatron-Core venv at {venvs}: make one as make_fixtures.py says")


def mc_load(python: Path, root: Path, out: Path, tp: int, script: str = "mc_load.py") -> dict:
    """``script`` (``mc_load.py``, ``mc_job_load.py``) of ``root`` at TP ``tp``; its
    result.json."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    args = [str(root), str(out), "--tp", str(tp), "--port", port]
    done = subprocess.run(
        [str(python), str(HERE / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    result = json.loads((out / "result.json").read_text())
    assert (done.returncode == 0) == result["ok"], done.stderr[-4000:]
    return result


def assert_same_state(
    loaded: dict[str, torch.Tensor], truth: dict[str, torch.Tensor], momentum_rtol: float = 0.0
) -> None:
    """Every ``param``, ``momentum_buffer``, ``exp_avg``, ``exp_avg_sq`` and ``step`` of the
    truth, bit for bit, in the loaded state (which holds no key the truth lacks); the momentum
    within ``momentum_rtol`` where that is not 0."""
    assert set(loaded) == set(truth), sorted(set(loaded) ^ set(truth))
    assert {k.rsplit(".", 1)[1] for k in truth} == set(STATE_KEYS)
    for key, expected in truth.items():
        got = loaded[key]
        assert got.shape == expected.shape and got.dtype == expected.dtype, key
        if momentum_rtol and key.endswith(".momentum_buffer"):
            torch.testing.assert_close(got, expected, rtol=momentum_rtol, atol=0.0, msg=key)
        else:
            assert torch.equal(got, expected), (key, (got - expected).abs().max().item())


def assert_trains_on(result: dict) -> None:
    assert result["ok"] and result["iteration"] == 3, result
    assert len(result["losses"]) == 2 and all(torch.isfinite(torch.tensor(result["losses"])))


def convert(*args: str) -> None:
    result = CliRunner().invoke(app, ["convert", *args])
    assert result.exit_code == 0, result.output


TORCH_FORMAT = {"tp2_dp1_torch": 1, "tp1_dp2_torch": 2}
"""The ``--ckpt-format torch`` fixtures -> the TP size of the other layout."""


@pytest.mark.parametrize("name", sorted(OTHER_TP) + sorted(TORCH_FORMAT))
def test_megatron_resumes_the_export_at_the_other_layout(mc_python, tmp_path, name) -> None:
    tp = {**OTHER_TP, **TORCH_FORMAT}[name]
    ours, back = tmp_path / "muonckpt", tmp_path / "megatron"
    convert(str(HERE / name / "checkpoint"), "-o", str(ours), "--from", "megatron")
    convert(str(ours), "-o", str(back), "--to", "megatron", "--tp", str(tp), "--dp", str(2 // tp))
    result = mc_load(mc_python, back, tmp_path / "run", tp)
    assert_trains_on(result)
    truth = load_file(HERE / name / "truth.safetensors")
    assert_same_state(load_file(tmp_path / "run" / "loaded.safetensors"), truth)


def test_megatron_resumes_the_packaged_muon_at_2x2(mc_python, tmp_path) -> None:
    packaged = tmp_path / "packaged"
    convert(str(HERE / "tp2_dp1" / "checkpoint"), "-o", str(packaged), "--to", "packaged")
    resharded = offline.reshard(packaged, tmp_path / "2x2", dp=2, tp=2)
    back = tmp_path / "megatron"
    convert(str(resharded), "-o", str(back), "--to", "megatron", "--tp", "1", "--dp", "2")
    result = mc_load(mc_python, back, tmp_path / "run", 1)
    assert_trains_on(result)
    truth = load_file(HERE / "tp2_dp1" / "truth.safetensors")
    loaded = load_file(tmp_path / "run" / "loaded.safetensors")
    assert_same_state(loaded, truth, momentum_rtol=1e-6)


@pytest.mark.parametrize(
    ("name", "tp"), [("tp2_dp1_job", 2), ("tp2_dp1_job", 1), ("tp1_dp2_job_torch", 1)]
)
def test_megatron_training_resumes_the_whole_job(mc_python, tmp_path, name, tp) -> None:
    """A job saved by ``megatron.training``'s ``save_checkpoint``, converted in and out at TP
    ``tp``, resumed by ``pretrain_gpt.py``'s ``load_checkpoint`` with its LR scheduler and RNG
    loading on (``mc_job_load.py``): the optimizer state, the scheduler's state dict, the
    iteration and the consumed samples as at the save, exactly; every TP rank's RNG states
    exactly at the TP size they were saved at (at another, Megatron ignores them itself, as at
    a TP change of its own checkpoints: the output's args say so); it trains on."""
    ours, back = tmp_path / "muonckpt", tmp_path / "megatron"
    convert(str(HERE / name / "checkpoint"), "-o", str(ours), "--from", "megatron")
    convert(str(ours), "-o", str(back), "--to", "megatron", "--tp", str(tp), "--dp", str(2 // tp))
    result = mc_load(mc_python, back, tmp_path / "run", tp, "mc_job_load.py")
    assert_trains_on(result)
    truth = json.loads((HERE / name / "truth.json").read_text())
    assert result["opt_param_scheduler"] == truth["opt_param_scheduler"]
    assert result["consumed_train_samples"] == truth["consumed_train_samples"]
    if tp == truth["tp"]:
        assert result["rng_state"] == truth["rng_state"]
    else:
        assert all(rank not in truth["rng_state"] for rank in result["rng_state"])
    loaded = load_file(tmp_path / "run" / "loaded.safetensors")
    assert_same_state(loaded, load_file(HERE / name / "truth.safetensors"))


@pytest.mark.parametrize("name", sorted(OTHER_TP))
def test_megatron_loads_its_own_checkpoint_at_the_other_layout(mc_python, tmp_path, name):
    """A fact muonckpt's docs state (docs/format.md section 12): the dp_reshardable torch_dist
    checkpoint of the layer-wise Muon is global, and ``dist_checkpointing.load`` reshards it.
    When this fails, Megatron changed: revisit that section."""
    result = mc_load(mc_python, HERE / name / "checkpoint", tmp_path / "run", OTHER_TP[name])
    assert_trains_on(result)
    truth = load_file(HERE / name / "truth.safetensors")
    assert_same_state(load_file(tmp_path / "run" / "loaded.safetensors"), truth)


FIXTURE_NAMES = sorted(p.parent.name for p in HERE.glob("*/truth.safetensors"))


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_the_producer_remakes_the_fixture(mc_python, tmp_path, name) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(mc_python), str(HERE / "make_fixtures.py"), str(tmp_path), "--only", name],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    new, old = tmp_path / name, HERE / name
    assert _files(new) == _files(old)
    new_truth, old_truth = (
        load_file(new / "truth.safetensors"),
        load_file(old / "truth.safetensors"),
    )
    assert {k: v.shape for k, v in new_truth.items()} == {k: v.shape for k, v in old_truth.items()}
    assert (
        json.loads((new / "truth.json").read_text())["params"]
        == json.loads((old / "truth.json").read_text())["params"]
    )
    convert(str(new / "checkpoint"), "-o", str(tmp_path / "ours"), "--from", "megatron")
    model = load_file(tmp_path / "ours" / "model.safetensors")
    state = load_file(tmp_path / "ours" / "optimizer.safetensors")
    for key, expected in new_truth.items():
        param, _, what = key.rpartition(".")
        if what == "step":
            continue
        got = model[param] if what == "param" else state[f"state.{param}.{what}"]
        assert torch.equal(got, expected), key


def test_the_megatron_benchmark_runs(mc_python: Path) -> None:
    """``benchmarks/bench_megatron.py`` at a tiny size (its smoke run; no time asserted)."""
    env = {**os.environ, "MUONCKPT_MEGATRON_VENV": str(mc_python.parent.parent)}
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "smoke.py"), "bench_megatron.py"],
        capture_output=True, text=True, timeout=900, env=env, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "| muonckpt to_megatron (TP 1, DP 2) |" in done.stdout, done.stdout
