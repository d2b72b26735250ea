"""docs/hooks.md's upstream KellerJordan example, run as written against ``muon-optimizer``.

The script is the docs' ``kj_train.py`` block byte for byte, launched by the docs' commands
(``torchrun`` spelled ``python -m torch.distributed.run``, the same launcher).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import muonckpt

pytestmark = pytest.mark.dist

DOC = Path(__file__).parents[1] / "docs" / "hooks.md"


def example(name: str) -> str:
    match = re.search(
        rf"<!-- docs-example: {re.escape(name)} -->\n```\w+\n(.*?)```", DOC.read_text(), re.S
    )
    assert match, f"no docs-example {name!r} in docs/hooks.md"
    return match.group(1)


def run(command: str, cwd: Path) -> str:
    argv = shlex.split(command)
    assert argv[0] == "torchrun"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *argv[1:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_hooks_doc_upstream_example_saves_everything_and_resumes_at_another_world(tmp_path):
    (tmp_path / "kj_train.py").write_text(example("kj_train.py"))
    first, resume = example("kj-commands").strip().splitlines()
    out = run(first, tmp_path)
    (loss_a, count) = re.search(r"loss ([0-9.]+), state for (\d+) params", out).groups()
    assert int(count) == 8  # every momentum buffer and AdamW entry, not only rank 0's
    sd = torch.load(tmp_path / "optim.pt", weights_only=True)
    assert sd["muonckpt"]["complete"] is True and len(sd["state"]) == 8
    assert muonckpt.verify(tmp_path / "ckpt" / "a") == []
    out = run(resume, tmp_path)
    loss_b = float(re.search(r"loss ([0-9.]+),", out).group(1))
    assert loss_b < float(loss_a)  # it went on from the checkpoint, not from scratch
    assert muonckpt.read_manifest(tmp_path / "ckpt" / "b").topology == {"dp": 2, "tp": 1}
