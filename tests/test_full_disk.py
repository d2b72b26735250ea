"""Every writer on a full disk (issue 50): one ``error: cannot write: ...`` line naming the file
and the system's reason, exit code 2 (a CheckpointError from the API), the staging directory
removed, nothing published, the source untouched; never a traceback. A quota (RLIMIT_FSIZE)
runs everywhere; a real full disk (a small tmpfs) where this process may mount one."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from muonckpt.interop import deepspeed, megatron

from .conftest import REPO

FIXTURES = Path(__file__).parent / "fixtures"
DEEPSPEED = FIXTURES / "deepspeed" / "w2_z1_fused_fp32" / "ckpt"


@pytest.fixture(scope="module")
def sources(single_ckpt, tmp_path_factory) -> dict[str, Path]:
    """The checkpoints the writers read: the fixture model's per-rank one, one read from
    Megatron (what ``--to megatron`` writes from), one read from DeepSpeed (whose rank files
    are larger than one write of ``torch.save``: a full disk meets it inside its zip writer)
    and DeepSpeed's own files."""
    root = tmp_path_factory.mktemp("sources")
    mcore = megatron.from_megatron(FIXTURES / "megatron" / "tp2_dp1" / "checkpoint", root / "mg")
    ds = deepspeed.from_deepspeed(DEEPSPEED, root / "ds")
    return {
        "muonckpt": single_ckpt(2),
        "megatron": mcore.path,
        "from-deepspeed": ds.path,
        "deepspeed": DEEPSPEED,
    }


def _cases(sources: dict[str, Path], out: Path) -> dict[str, dict]:
    """Each writer, by the name of its output under ``out``: the command line and the API."""
    ours, mcore, ds = (str(sources[name]) for name in ("muonckpt", "megatron", "from-deepspeed"))

    def cli(name: str, *argv: str) -> dict:
        return {"cli": [argv[0], argv[1], "-o", str(out / name), *argv[2:]]}

    def api(name: str, function: str, src: str | None, **kwargs: object) -> dict:
        args = [str(out / name)] if src is None else [src, str(out / name)]
        return {"api": function, "args": args, "kwargs": kwargs}

    return {
        "dcp": cli("dcp", "convert", ours, "--to", "torch", "--format", "dcp"),
        "megatron": cli("megatron", "convert", mcore, "--to", "megatron", "--tp", "1", "--dp", "1"),
        "deepspeed": cli("deepspeed", "convert", ds, "--to", "deepspeed", "--world", "2"),
        "consolidate": cli("consolidate", "consolidate", ours),
        "reshard": cli("reshard", "reshard", ours, "--dp", "2", "--tp", "1"),
        "convert": cli("convert", "convert", ours, "--to", "torch"),
        "from-deepspeed": cli(
            "from-deepspeed", "convert", str(sources["deepspeed"]), "--from", "deepspeed"
        ),
        "api-dcp": api("api-dcp", "muonckpt.interop:to_dcp", ours, to="torch"),
        "api-megatron": api("api-megatron", "muonckpt.interop:to_megatron", mcore, tp=1, dp=1),
        "api-deepspeed": api("api-deepspeed", "muonckpt.interop:to_deepspeed", ds, world=2),
        "api-consolidate": api("api-consolidate", "muonckpt.offline:consolidate", ours),
        "save": api("save", "tests.full_disk_cases:save", None),
        "save-consolidated": api(
            "save-consolidated", "tests.full_disk_cases:save", None, consolidated=True
        ),
        "async_save": api("async_save", "tests.full_disk_cases:save", None, asynchronous=True),
    }


def _digest(directory: Path) -> str:
    """Every file under ``directory``, its name and bytes, as one digest."""
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        digest.update(str(path.relative_to(directory)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _check_full_disk(sources: dict[str, Path], out: Path, limit: str, reason: str) -> None:
    """Every writer of :func:`_cases` fails on a full ``out`` as the module says."""
    before = {name: _digest(path) for name, path in sources.items()}
    cases = _cases(sources, out)
    done = subprocess.run(
        [sys.executable, "-m", "tests.full_disk_cases", limit, json.dumps(list(cases.values()))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    outcomes = dict(zip(cases, json.loads(done.stdout.splitlines()[-1]), strict=True))
    print(json.dumps(outcomes, indent=1))  # shown when it fails
    for name, outcome in outcomes.items():
        staging = f"{out}{os.sep}.{name}.staging-"
        if "cli" in cases[name]:
            assert outcome["escaped"] is None, (name, outcome)
            assert outcome["code"] == 2, (name, outcome)
            lines = outcome["stderr"].splitlines()
            assert len(lines) == 1 and "Traceback" not in outcome["stderr"], (name, outcome)
            assert lines[0].startswith(f"error: cannot write: {reason} (file {staging}"), lines
        else:
            assert outcome["raised"] == "CheckpointError", (name, outcome)
            assert f"cannot write: {reason} (file {staging}" in outcome["message"], outcome
            assert "\n" not in outcome["message"], (name, outcome)
    assert sorted(os.listdir(out)) == []  # nothing published, every staging directory removed
    assert {name: _digest(path) for name, path in sources.items()} == before


@pytest.mark.dist
def test_every_writer_over_a_quota(sources, tmp_path):
    """No file may grow past 4 KiB: each writer's first data file fails with EFBIG (DeepSpeed's
    inside ``torch.save``'s zip writer, which raises a RuntimeError over the OSError; DCP's
    writer wraps it in its own CheckpointException: both were tracebacks before)."""
    out = tmp_path / "out"
    out.mkdir()
    _check_full_disk(sources, out, str(4 << 10), "File too large")


@contextlib.contextmanager
def _small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where``; the test is skipped where mounting is not
    permitted (not root, or in a container without the capability)."""
    where.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as exc:  # no mount command
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True, timeout=30)


@pytest.mark.dist
def test_every_writer_on_a_full_disk(sources, tmp_path):
    """A real full disk (ENOSPC) of 8 KiB, the same way."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with _small_tmpfs(tmp_path / "full", "8k") as out:
        _check_full_disk(sources, out, "-", "No space left on device")
