"""The README's training example, run as written: its script, launched by its torchrun commands.

The script is the README's ``train.py`` block, byte for byte; the commands are the README's
bash block, with ``torchrun`` spelled ``python -m torch.distributed.run`` (the same launcher)
so that the test uses this interpreter.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import muonckpt

from .fixture_model import build, initial_params, train

pytestmark = pytest.mark.dist

README = Path(__file__).parents[1] / "README.md"
DOCS = [README, README.parent / "docs" / "usage.md", README.parent / "docs" / "interop.md"]
"""The README and the pages its reference moved to: their examples run here alike."""


def _text() -> str:
    return "\n".join(doc.read_text() for doc in DOCS)


def example(name: str) -> str:
    """The fenced block that follows ``<!-- readme-example: NAME -->`` in the README (or the
    pages of :data:`DOCS`)."""
    text = _text()
    match = re.search(rf"<!-- readme-example: {re.escape(name)} -->\n```\w+\n(.*?)```", text, re.S)
    assert match, f"no readme-example {name!r} in README.md or docs/"
    return match.group(1)


def run_cli_example(name: str, cwd: Path) -> None:
    """Run each ``muonckpt ...`` line of the README example ``name`` in ``cwd``, as written."""
    for command in example(name).strip().splitlines():
        argv = shlex.split(command)
        assert argv[0] == "muonckpt", command
        done = subprocess.run(
            [sys.executable, "-m", "muonckpt.cli", *argv[1:]],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, command + "\n" + done.stdout + done.stderr


def run(command: str, cwd: Path) -> list[float]:
    argv = shlex.split(command)
    assert argv[0] == "torchrun"
    argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [float(m) for m in re.findall(r"^step \d+ loss ([0-9.]+)$", done.stdout, re.M)]


def test_readme_quickstart_saves_every_10_steps_and_resumes_on_another_number_of_ranks(tmp_path):
    """The README's quickstart as written: a plain torch optimizer under DDP saved by 2
    processes (the 2 newest kept) and resumed by 3 from the newest, at its step."""
    (tmp_path / "quickstart.py").write_text(example("quickstart.py"))
    first, resume = example("quickstart-commands").strip().splitlines()
    losses = run(first, tmp_path)
    assert len(losses) == 30 and losses[-1] < losses[0], losses
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-20", "step-30"]
    assert muonckpt.read_manifest(ckpt / "step-30").recorded_step == 30
    resumed = run(resume, tmp_path)
    assert len(resumed) == 20  # steps 31 to 50: from step 30's state and weights
    assert resumed[0] < losses[0], (losses, resumed)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-40", "step-50"]
    assert muonckpt.read_manifest(ckpt / "step-50").topology == {"dp": 3, "tp": 1}
    assert muonckpt.verify(ckpt / "step-50") == []


def test_readme_training_loop_trains_saves_and_resumes(tmp_path):
    (tmp_path / "train.py").write_text(example("train.py"))
    first, resume = example("commands").strip().splitlines()
    losses = run(first, tmp_path)
    assert len(losses) == 30
    assert losses[-1] < 0.8 * losses[0], losses  # it trains
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    ckpt = tmp_path / "ckpt"
    # saved in the background at steps 10, 20 and 30; keep_last=2 deleted step-10
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-20", "step-30"]
    assert muonckpt.verify(ckpt / "step-30") == []
    assert muonckpt.read_manifest(ckpt / "step-30").step == 30
    assert muonckpt.read_manifest(ckpt / "step-30").recorded_step == 30  # extra={"step": 30}
    assert muonckpt.latest(ckpt) == ckpt / "step-30"
    resumed = run(resume, tmp_path)
    assert len(resumed) == 10  # steps 31 to 40: it went on from step 30
    # The resumed model is the saved one (not its fresh initialisation): it starts where the
    # first run ended and keeps improving.
    assert resumed[0] < losses[-1] and resumed[-1] < resumed[0], (losses[-1], resumed)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-30", "step-40"]
    assert muonckpt.read_manifest(ckpt / "step-40").topology == {"dp": 4, "tp": 1}
    assert muonckpt.verify(ckpt / "step-40") == []


SINGLE = "# in one process"


def fragments(single: bool = False) -> list[str]:
    """The README's (and :data:`DOCS`') other Python blocks: fragments that use ``opt`` and
    ``rank`` in a 2 x 2 run, or (``single``) those marked to run in one process, which use
    ``model``."""
    text = _text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    scripts = set(re.findall(r"<!-- readme-example: [^>]*-->\n```\w+\n(.*?)```", text, re.S))
    return [b for b in blocks if b not in scripts and b.startswith(SINGLE) == single]


def fragments_phase(workdir: str) -> bool:
    """(gloo child, 2 x 2) Each fragment as written, on the fixture model's optimizer; where a
    fragment says "later", every rank waits for the others first."""
    import os

    import torch
    import torch.distributed as dist

    os.chdir(workdir)
    opt, sharded, d, t = build(2, 2, initial_params())
    train(opt, sharded, d, t, 0, 2)
    for block in fragments():
        at = block.find("# ... later")
        now, later = (block, "") if at < 0 else (block[:at], block[at:])
        namespace = {"opt": opt, "rank": dist.get_rank(), "torch": torch, "muonckpt": muonckpt}
        exec(compile(now, "README.md", "exec"), namespace)
        dist.barrier()
        exec(compile(later, "README.md", "exec"), namespace)
        dist.barrier()
        if "recovered" in namespace:  # the node-local tier's fragment: its own local step
            recovered = namespace["recovered"]
            assert recovered.tier == "local" and recovered.refused == [], recovered
    return namespace["problems"] == []


def test_readme_fragments_run_as_written(tmp_path, monkeypatch):
    import warnings

    import torch

    from muonckpt.distributed.launch import run_distributed

    assert len(fragments()) >= 2 and len(fragments(single=True)) >= 1
    assert run_distributed(fragments_phase, 4, str(tmp_path), timeout=120) == [True] * 4
    assert muonckpt.verify(tmp_path / "ckpt" / "step-1000-full") == []
    model = torch.nn.Module()
    for name, value in initial_params().items():
        model.register_parameter(name, torch.nn.Parameter(torch.zeros_like(value)))
    monkeypatch.chdir(tmp_path)
    for block in fragments(single=True):
        namespace = {"model": model, "torch": torch, "muonckpt": muonckpt}
        with warnings.catch_warnings(record=True):
            exec(compile(block, "README.md", "exec"), namespace)
        assert any("sum -> ema" in line for line in namespace["report"].converted)
        assert all(p.abs().sum() > 0 for p in model.parameters())  # the checkpoint's params


def test_readme_dcp_commands_move_an_fsdp2_checkpoint_into_the_packaged_muon_and_back(tmp_path):
    """The README's DCP commands as written (``muonckpt`` spelled ``python -m muonckpt.cli``),
    on a torchtitan-layout checkpoint of the tests' FSDP2 job; the packaged job resumes from
    the first output at 2 x 2, and an FSDP2 job loads the second."""
    import torch

    from muonckpt.distributed.launch import run_distributed

    from . import dcp_cases
    from .test_dcp import _load_and_resave

    job = run_distributed(
        dcp_cases.train_and_save,
        2,
        initial_params(),
        3,
        {"torchtitan": str(tmp_path / "titan" / "step-300")},
        timeout=180,
    )[0]
    run_cli_example("dcp-commands", tmp_path)
    assert muonckpt.verify(tmp_path / "ckpt" / "step-300") == []
    run_distributed(
        _load_and_resave, 4, 2, 2, str(tmp_path / "ckpt" / "step-300"), str(tmp_path / "r"),
        timeout=180,
    )  # fmt: skip
    zeros = {n: torch.zeros_like(t) for n, t in initial_params().items()}
    back = str(tmp_path / "titan" / "step-300-back")
    loaded = run_distributed(dcp_cases.load_and_continue, 2, zeros, back, 3, 1, timeout=180)
    loaded = loaded[0]["loaded"]
    for key, value in job.items():
        if key.endswith("momentum_buffer"):  # EMA -> sum -> EMA: x 1/(1-mu), then x (1-mu)
            torch.testing.assert_close(loaded[key], value, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(loaded[key], value), key


@pytest.mark.slow  # the quickstart's test runs the same path (2 processes, then 3) by default
def test_readme_ddp_recipe_saves_once_and_resumes_at_another_world_size(tmp_path):
    """The README's DDP recipe, run as written: torch.optim.Muon + AdamW replicas with no
    hooks, saved by 2 processes (written once) and resumed by 3."""
    (tmp_path / "ddp_train.py").write_text(example("ddp_train.py"))
    first, resume = example("ddp-commands").strip().splitlines()
    losses = run(first, tmp_path)
    assert len(losses) == 20 and losses[-1] < losses[0], losses
    ckpt = tmp_path / "ddp-ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-10", "step-20"]
    manifest = muonckpt.read_manifest(ckpt / "step-20")
    assert manifest.topology == {"dp": 2, "tp": 1}
    written = [(piece.param, piece.key) for piece in manifest.pieces]
    assert len(written) == len(set(written))  # each state tensor once, not once per rank
    assert muonckpt.verify(ckpt / "step-20") == []
    resumed = run(resume, tmp_path)
    assert len(resumed) == 10  # steps 21 to 30, from the saved model and state
    assert resumed[0] < losses[0] and resumed[-1] < resumed[0], (losses, resumed)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-20", "step-30"]
    assert muonckpt.read_manifest(ckpt / "step-30").topology == {"dp": 3, "tp": 1}


def test_readme_s3_commands_save_to_and_resume_from_a_bucket(tmp_path, s3_server):
    """The README's S3 commands, as written, against the tests' S3 server (found through
    ``AWS_ENDPOINT_URL``, as a job finds an S3-compatible server): the DDP script saves to
    ``s3://my-bucket/ddp`` on 2 processes, keeping 2, and resumes from it on 3."""
    client = s3_server.client()
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket="my-bucket")
    for item in client.list_objects_v2(Bucket="my-bucket").get("Contents", []):
        client.delete_object(Bucket="my-bucket", Key=item["Key"])
    (tmp_path / "ddp_train.py").write_text(example("ddp_train.py"))
    first, resume = example("s3-commands").strip().splitlines()

    def checkpoints() -> list[str]:
        listed = client.list_objects_v2(Bucket="my-bucket", Prefix="ddp/", Delimiter="/")
        return sorted(p["Prefix"] for p in listed.get("CommonPrefixes", []))

    losses = run(first, tmp_path)
    assert len(losses) == 20 and losses[-1] < losses[0], losses
    assert checkpoints() == ["ddp/step-10/", "ddp/step-20/"]
    assert muonckpt.verify("s3://my-bucket/ddp/step-20") == []
    assert muonckpt.read_manifest("s3://my-bucket/ddp/step-20").topology == {"dp": 2, "tp": 1}
    resumed = run(resume, tmp_path)
    assert len(resumed) == 10  # steps 21 to 30, from the saved model and state
    assert resumed[0] < losses[0] and resumed[-1] < resumed[0], (losses, resumed)
    assert checkpoints() == ["ddp/step-20/", "ddp/step-30/"]  # step-10 wholly deleted
    assert str(muonckpt.latest("s3://my-bucket/ddp")) == "s3://my-bucket/ddp/step-30"
    assert muonckpt.read_manifest("s3://my-bucket/ddp/step-30").topology == {"dp": 3, "tp": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp_train.py"]  # nothing local
