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
  every value bitwise their own truth, as the committed ones do;
- written back (``convert --to accelerate`` / ``--to lightning``), the committed fixtures
  resume in the trainer's own load at world 1 (``hf_resume.py``) with every optimizer value
  bitwise the truth, and train on.
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

from muonckpt import interop

pytestmark = [pytest.mark.trainers, pytest.mark.dist]

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
VENV = Path(os.environ.get("MUONCKPT_HF_VENV", "~/.cache/muonckpt/hf-trainers")).expanduser()
TRAINERS = {"accelerate": ("named", "plain", "bin"), "lightning": ("named", "single")}


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="session")
def hf_python() -> Path:
    """The trainers' venv's python, the venv made first if it lacks them."""
    done = subprocess.run(
        ["bash", str(FIXTURES / "setup_hf_venv.sh"), str(VENV)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return VENV / "bin" / "python"


@pytest.fixture(scope="session")
def remade(hf_python, tmp_path_factory) -> Path:
    """Both producers rerun into one directory (``accelerate/NAME``, ``lightning/NAME``)."""
    root = tmp_path_factory.mktemp("hf-remade")
    env = ENV
    for trainer in TRAINERS:
        done = subprocess.run(
            [str(hf_python), str(FIXTURES / trainer / "make_fixtures.py"),
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


def _cli(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from muonckpt.cli import main; main()", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.parametrize(
    "case", ["accelerate/named", "accelerate/plain", "lightning/named", "lightning/single"]
)
def test_written_back_the_trainer_resumes_it_exactly(hf_python, tmp_path, case):
    """The committed fixture (world 2) -> ``convert`` -> ``convert --to accelerate`` / ``--to
    lightning`` -> the trainer's own load at world 1 (``accelerator.load_state``,
    ``Trainer.fit(ckpt_path=...)``, in ``hf_resume.py``, the producer's own job): the
    optimizers' state in memory is the fixture's truth bitwise, and it trains on."""
    trainer, name = case.split("/")
    meta = _meta(FIXTURES, case)
    ours, back, out = tmp_path / "muonckpt", tmp_path / "back", tmp_path / "resumed"
    if trainer == "accelerate":
        src = FIXTURES / case / "state"
        names = [] if meta["named"] else ["--names", str(tmp_path / "names.json")]
        (tmp_path / "names.json").write_text(json.dumps(meta["index_names"]))
        _cli("convert", str(src), "-o", str(ours), *names)
        # (--world 2: the RNG states go back as saved; process 0 of this job reads rank 0's)
        _cli("convert", str(ours), "-o", str(back), "--to", "accelerate", "--world", "2")
        resume_from = back
    else:
        (ckpt,) = (FIXTURES / case / "checkpoints").glob("*.ckpt")
        _cli("convert", str(ckpt), "-o", str(ours))
        _cli("convert", str(ours), "-o", str(back), "--to", "lightning")
        resume_from = back / "last.ckpt"
    done = subprocess.run(
        [str(hf_python), str(FIXTURES / "hf_resume.py"), trainer, name, str(resume_from),
         str(out)],
        capture_output=True, text=True, timeout=900, env=ENV, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    loaded = load_file(out / "loaded.safetensors")
    truth = load_file(FIXTURES / case / "truth.safetensors")
    assert set(loaded) == set(truth)
    for key, value in truth.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    losses = json.loads((out / "result.json").read_text())["losses"]
    assert len(losses) == 2 and all(x == x for x in losses), losses
    if trainer == "accelerate":  # load_state restored rank 0's RNG states as saved
        saved = torch.load(FIXTURES / case / "state" / "random_states_0.pkl", weights_only=False)
        rng = load_file(out / "rng.safetensors")
        assert torch.equal(rng["torch"], saved["torch_manual_seed"])
        assert torch.equal(rng["numpy"], torch.from_numpy(saved["numpy_random_seed"][1]))
    if trainer == "lightning":  # its step, epoch and schedule go on where they were
        resumed = json.loads((out / "resumed.json").read_text())
        assert resumed == {
            "global_step": meta["global_step"],
            "epoch": 1,
            "lr_schedulers": meta.get("lr_schedulers", []),
        }
