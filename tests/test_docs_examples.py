"""The docs hold: docs/hooks.md's upstream KellerJordan example, run as written against
``muon-optimizer``, and every test the docs cite by name exists.

The script is the docs' ``kj_train.py`` block byte for byte, launched by the docs' commands
(``torch.distributed.run``, the same launcher as ``torchrun``).
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import muonckpt

pytestmark = pytest.mark.dist

REPO = Path(__file__).parents[1]
DOC = REPO / "docs" / "hooks.md"


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


_CITED = re.compile(r"(tests/\w+\.py)|`::([\w*]+)|`(test_\w+(?:\.py)?)`")
"""``tests/x.py`` (a ``tests/test_x.py`` is the file later ``::name`` citations on its line
refer to), ``::name`` and a bare ``test_name`` or ``test_x.py``."""


def _tests_by_file() -> dict[str, set[str]]:
    return {
        f"tests/{path.name}": set(
            re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M)
        )
        for path in (REPO / "tests").glob("*.py")
    }


def test_every_test_the_docs_cite_exists():
    """A renamed test cited by its old name in docs/reliability.md went unnoticed: every
    ``tests/test_x.py::name`` (``::name`` after it on the same line), bare ``test_name`` and
    ``test_x.py`` (or ``test_x``) in README.md and docs/*.md names a file and a test that are
    there (``*`` matches as in a glob)."""
    tests = _tests_by_file()
    every_test = set().union(*tests.values())
    wrong = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), start=1):
            where, current = f"{doc.relative_to(REPO)}:{number}", None
            for path, name, bare in _CITED.findall(line):
                if path:
                    current = path if path.startswith("tests/test_") else current
                    if path not in tests:
                        wrong.append(f"{where}: no {path}")
                elif name and current in tests:
                    if not fnmatch.filter(tests[current], name):
                        wrong.append(f"{where}: no {current}::{name}")
                elif bare.endswith(".py"):
                    if f"tests/{bare}" not in tests:
                        wrong.append(f"{where}: no tests/{bare}")
                elif (
                    bare
                    and f"tests/{bare}.py" not in tests
                    and not fnmatch.filter(every_test, bare)
                ):
                    wrong.append(f"{where}: no test {bare}")
    assert not wrong, "\n".join(wrong)
