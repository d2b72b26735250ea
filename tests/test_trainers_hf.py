"""The trainers tier for accelerate and Lightning: the real trainers in a venv of their own.

Run it with ``python -m pytest -m trainers tests/test_trainers_hf.py`` (not in the default
run, not in CI; about 1.5 minutes on 2 cores). The venv is ``$MUONCKPT_HF_VENV`` (default
``~/.cache/muonckpt/hf-trainers``), made once by ``tests/fixtures/setup_hf_venv.sh`` if it
does not import accelerate, lightning and torch 2.13 (that needs a package index).

It reruns both fixture producers (accelerate under torchrun, Lightning ``ddp`` on CPU, world 2)
into a temporary directory and checks that:

- they write the files of the committed fixtures (names; the same sizes where nothing but
  the state is in them), with the same param names per index, settings and buffers, and a
  ground truth of the same keys, dtypes and shapes, its values equal to the committed within
  float rounding;
- the files written now convert (``convert --from accelerate`` / ``--from lightning``) with
  every value bitwise their own truth, as the committed ones do.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from muonckpt import interop

pytestmark = [pytest.mark.trainers, pytest.mark.dist]

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
VENV = Path(os.environ.get("MUONCKPT_HF_VENV", "~/.cache/muonckpt/hf-trainers")).expanduser()
TRAINERS = {"accelerate": ("named", "plain", "bin"), "lightning": ("named", "single")}


@pytest.fixture(scope="session")
def remade(tmp_path_factory) -> Path:
    """Both producers rerun into one directory (``accelerate/NAME``, ``lightning/NAME``)."""
    done = subprocess.run(
        ["bash", str(FIXTURES / "setup_hf_venv.sh"), str(VENV)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    root = tmp_path_factory.mktemp("hf-remade")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for trainer in TRAINERS:
        done = subprocess.run(
            [str(VENV / "bin" / "python"), str(FIXTURES / trainer / "make_fixtures.py"),
             str(root / trainer)],
            capture_output=True, text=True, timeout=900, env=env, cwd=REPO,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return root


CASES = [f"{trainer}/{name}" for trainer, names in TRAINERS.items() for name in names]


def _meta(root: Path, case: str) -> dict:
    return json.loads((root / case / "meta.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_the_producers_remake_the_fixtures(remade, case):
    new, old = _meta(remade, case), _meta(FIXTURES, case)
    for field in ("index_names", "settings", "buffers", "optimizers", "world", "steps"):
        assert new[field] == old[field], field
    assert set(new["files"]) == set(old["files"])
    if case.startswith("accelerate/"):  # (a .ckpt holds the directory it was saved to)
        state = {n: s for n, s in new["files"].items() if not n.startswith("random_states")}
        assert state == {n: old["files"][n] for n in state}
    a, b = (
        load_file(remade / case / "truth.safetensors"),
        load_file(FIXTURES / case / "truth.safetensors"),
    )
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_what_they_write_now_converts_bitwise(remade, tmp_path, case):
    meta = _meta(remade, case)
    if case.startswith("accelerate/"):
        names = None if meta["named"] else meta["index_names"]
        interop.from_accelerate(remade / case / "state", tmp_path / "out", names=names)
    else:
        (ckpt,) = (remade / case / "checkpoints").glob("*.ckpt")
        interop.from_lightning(ckpt, tmp_path / "out")
    model = load_file(tmp_path / "out" / "model.safetensors")
    state = load_file(tmp_path / "out" / "optimizer.safetensors")
    truth = load_file(remade / case / "truth.safetensors")
    for key, expected in truth.items():
        param, _, what = key.rpartition(".")
        if what == "step":
            continue
        got = model[param] if what == "param" else state[f"state.{param}.{what}"]
        assert torch.equal(got, expected), key
