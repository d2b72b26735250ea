"""The trainers tier for torchtitan: real torchtitan 0.3.0 (torch 2.13 CPU, DistMuon with the
two CPU patches of ``tests/fixtures/torchtitan/tt_common.py``) in a venv of its own.

Run it with ``python -m pytest -m trainers -k torchtitan`` (not in the default run, not in CI;
about 2 minutes on 2 cores). The venv is ``$MUONCKPT_TITAN_VENV``, else
``~/.cache/muonckpt/torchtitan-0.3.0``, made as ``tests/fixtures/torchtitan/make_fixtures.py``
says.

It checks that:

- torchtitan (world 2) -> ``muonckpt convert --model-buffers`` -> ``muonckpt convert --to
  torchtitan`` -> torchtitan's ``CheckpointManager.load`` at world 1 and 4 restores the
  source's state bit for bit (params, DistMuon momentum incl. the 3-D experts, AdamW moments
  and steps) and trains on with finite losses;
- the same through ``muonckpt reshard --dp 2 --tp 2`` and the packaged Muon (``--to
  packaged``), at world 4, the buffers carried by both rewrites: the momentum
  within the rounding of its two form conversions (EMA to sum and back), the rest exactly;
- the producer makes the same fixtures again.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from muonckpt.cli import app

pytestmark = [pytest.mark.trainers, pytest.mark.dist]

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "tests" / "fixtures" / "torchtitan"
VENV = Path("~/.cache/muonckpt/torchtitan-0.3.0").expanduser()


@pytest.fixture(scope="session")
def tt_python() -> Path:
    venv = Path(os.environ.get("MUONCKPT_TITAN_VENV", VENV)).expanduser()
    if not (venv / "bin" / "python").is_file():
        pytest.fail(
            f"no torchtitan venv at {venv}: python3 -m venv {venv} && {venv}/bin/pip install "
            "torch==2.13.0 torchtitan==0.3.0 (or set MUONCKPT_TITAN_VENV)"
        )
    return venv / "bin" / "python"


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run(python: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(python), str(HERE / script), *args, "--port", _port()],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )


def tt_load(python: Path, step_dir: Path, out: Path, world: int, *flags: str) -> dict:
    done = run(python, "tt_load.py", str(step_dir), str(out), "--world", str(world), *flags)
    result = json.loads((out / "result.json").read_text())
    assert done.returncode == 0 and result["ok"], done.stderr[-4000:]
    assert result["loaded"] and len(result["losses"]) == 2, result
    assert all(torch.isfinite(torch.tensor(result["losses"]))), result
    return result


def assert_same_state(loaded: dict, truth: dict, momentum_rtol: float = 0.0) -> None:
    assert set(loaded) == set(truth), sorted(set(loaded) ^ set(truth))
    for key, expected in truth.items():
        got = loaded[key]
        assert got.shape == expected.shape and got.dtype == expected.dtype, key
        if momentum_rtol and key.endswith(".momentum_buffer"):
            torch.testing.assert_close(got, expected, rtol=momentum_rtol, atol=1e-12, msg=key)
        else:
            assert torch.equal(got, expected), (key, (got - expected).abs().max().item())


def convert(*args: str) -> None:
    result = CliRunner().invoke(app, ["convert", *args])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("world", [1, 4])
def test_torchtitan_resumes_the_export_at_another_world_size(tt_python, tmp_path, world):
    ours, back = tmp_path / "muonckpt", tmp_path / "checkpoint" / "step-3"
    convert(str(HERE / "checkpoint"), "-o", str(ours), "--model-buffers")
    back.parent.mkdir()
    convert(str(ours), "-o", str(back), "--to", "torchtitan")
    tt_load(tt_python, back, tmp_path / "run", world)
    truth = load_file(HERE / "truth.safetensors")
    assert_same_state(load_file(tmp_path / "run" / "loaded.safetensors"), truth)


@pytest.mark.parametrize("world", [2, 4])
def test_torchtitan_resumes_its_lr_schedule_from_the_export(tt_python, tmp_path, world):
    """The LR schedulers loaded too (only the data loader excluded): from the export, at the
    world it was saved at and another (the schedule is one for the whole job), torchtitan's
    schedulers and every group's lr right after the load and after 2 more steps are what they
    are when it loads its own checkpoint: its warmup does not restart."""
    ours, back = tmp_path / "muonckpt", tmp_path / "checkpoint" / "step-3"
    convert(str(HERE / "checkpoint"), "-o", str(ours), "--model-buffers")
    back.parent.mkdir()
    convert(str(ours), "-o", str(back), "--to", "torchtitan")
    mine = tt_load(tt_python, back, tmp_path / "run", world, "--load-scheduler")
    own = HERE / "checkpoint" / "step-3"
    theirs = tt_load(tt_python, own, tmp_path / "own", world, "--load-scheduler")
    assert mine["lr_scheduler"] == theirs["lr_scheduler"] and mine["lr_scheduler"]
    assert mine["lrs"] == theirs["lrs"] and mine["lrs_after"] == theirs["lrs_after"]
    assert_same_state(
        load_file(tmp_path / "run" / "loaded.safetensors"), load_file(HERE / "truth.safetensors")
    )


def test_torchtitan_resumes_the_split_experts_merged_back(tt_python, tmp_path):
    """(issue 53) Experts split into one 2-D param each (``--split-experts``, as torch.optim.Muon
    holds them), then written back with ``--merge-experts``: torchtitan's DistMuon job, its
    experts stacked, loads it at world 2 with the saved state exactly, and trains on."""
    ours, back = tmp_path / "split", tmp_path / "checkpoint" / "step-3"
    convert(str(HERE / "checkpoint"), "-o", str(ours), "--model-buffers", "--split-experts")
    back.parent.mkdir()
    convert(str(ours), "-o", str(back), "--to", "torchtitan", "--merge-experts")
    tt_load(tt_python, back, tmp_path / "run", 2)
    truth = load_file(HERE / "truth.safetensors")
    assert_same_state(load_file(tmp_path / "run" / "loaded.safetensors"), truth)


def test_torchtitan_resumes_through_the_packaged_muon(tt_python, tmp_path):
    """Through a real ``reshard`` to 2 x 2 (the buffers, which torchtitan's strict load asks
    for, stored once in rank 0's file) and the packaged form, then back to torchtitan."""
    ours, resharded = tmp_path / "muonckpt", tmp_path / "2x2"
    convert(str(HERE / "checkpoint"), "-o", str(ours), "--model-buffers")
    args = ["reshard", str(ours), "-o", str(resharded), "--dp", "2", "--tp", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    packaged = tmp_path / "packaged"
    convert(str(resharded), "-o", str(packaged), "--to", "packaged")
    back = tmp_path / "checkpoint" / "step-3"
    back.parent.mkdir()
    convert(str(packaged), "-o", str(back), "--to", "torchtitan")
    tt_load(tt_python, back, tmp_path / "run", 4)
    truth = load_file(HERE / "truth.safetensors")
    assert_same_state(load_file(tmp_path / "run" / "loaded.safetensors"), truth, 1e-6)


def test_the_producer_makes_the_same_fixtures_again(tt_python, tmp_path):
    done = run(tt_python, "make_fixtures.py", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    old, new = load_file(HERE / "truth.safetensors"), load_file(tmp_path / "truth.safetensors")
    assert set(old) == set(new)
    for key, value in old.items():
        assert torch.equal(new[key], value), key
    old_json = json.loads((HERE / "truth.json").read_text())
    assert json.loads((tmp_path / "truth.json").read_text()) == old_json
    for name in ("checkpoint/step-3", "getsd"):
        found = sorted(p.name for p in (tmp_path / name).iterdir())
        assert found == sorted(p.name for p in (HERE / name).iterdir()), name
