"""Settings are bounded and paths are local (issue 30, items 7, 9 and the new user's URL and
``max_shard_size`` reports): every numeric setting out of range, and a URL where a directory
is expected, is a one-line library error naming it, raised before anything is started or
written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

import muonckpt
from muonckpt import offline, settings
from muonckpt.distributed.launch import run_distributed

from .fixture_model import build, initial_params, single_process_optimizer, train

REPO = Path(__file__).resolve().parents[1]
RUN_S = 150.0
URLS = ["s3://bucket/x", "gs://b/ckpt/step-1", "hf://org/model", "az://c/x", "https://h/x"]


def _cli(cwd: Path, *args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed command, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "muonckpt.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# --- URLs are not paths ----------------------------------------------------------------------


@pytest.mark.parametrize("url", URLS)
def test_a_url_is_refused_by_every_entry_point_and_nothing_is_written(
    tmp_path, monkeypatch, single_ckpt, url
):
    """save(opt, "s3://bucket/x") wrote ./s3:/bucket/x before (issue 52 made it a URL every
    entry point takes; ``Path("s3://bucket/x")``, which is ``s3:/bucket/x``, is refused)."""
    src = single_ckpt(1)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    opt = single_process_optimizer(1)
    calls = {
        "save": lambda p: muonckpt.save(opt, p),
        "save consolidated": lambda p: muonckpt.save(opt, p, consolidated=True),
        "async_save": lambda p: muonckpt.async_save(opt, p).result(),
        "load": lambda p: muonckpt.load(opt, p),
        "latest": muonckpt.latest,
        "clean": lambda p: muonckpt.clean(p, 0),
        "read_manifest": muonckpt.read_manifest,
        "summarize": offline.summarize,
        "consolidate to": lambda p: offline.consolidate(src, p),
        "consolidate from": lambda p: offline.consolidate(p, work / "out"),
        "reshard to": lambda p: offline.reshard(src, p, dp=2, tp=1),
        "convert to": lambda p: offline.convert(src, p, to="torch"),
        "diff": lambda p: offline.diff(src, p),
    }
    for what, call in calls.items():
        for given in (url, Path(url)):  # Path("s3://b/x") is s3:/b/x
            if given == url and url.startswith("s3://"):
                continue  # every entry point takes one (tests/test_s3_*.py)
            with pytest.raises(muonckpt.CheckpointError, match=r"URL, not a local path") as err:
                call(given)
            assert "\n" not in str(err.value), what
            assert url.split(":")[0] + "://" in str(err.value), what
    if not url.startswith("s3://"):
        assert muonckpt.verify(url)[0].args[0].startswith(repr(url))
    assert _tree(work) == []


def test_a_local_name_with_a_colon_is_still_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    opt = single_process_optimizer(1)
    saved = muonckpt.save(opt, "a:b")
    assert muonckpt.latest(".") == Path("a:b")
    assert muonckpt.verify(saved) == []
    assert muonckpt.save(opt, Path("run:7") / "step-1").is_dir()


@pytest.mark.dist
@pytest.mark.parametrize(
    "args",
    [
        ["consolidate", "SRC", "-o", "gs://bucket/x"],
        ["reshard", "az://bucket/x", "--dp", "2", "--tp", "1", "-o", "out"],
        ["latest", "gs://bucket"],
        ["clean", "hf://org/model"],
        ["inspect", "https://host/ckpt"],
        ["convert", "SRC", "-o", "az://c/x", "--to", "torch"],
    ],
)
def test_the_cli_refuses_a_url_in_one_line_and_writes_nothing(tmp_path, single_ckpt, args):
    work = tmp_path / "cwd"
    work.mkdir()
    src = single_ckpt(1)
    done = _cli(work, *[src if a == "SRC" else a for a in args])
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert line.startswith("error: '") and "URL, not a local path" in line, line
    assert "\n" not in line
    assert _tree(work) == []


# --- processes the CLI starts --------------------------------------------------------------

COUNT_STARTS = """
import multiprocessing.process
import os

_start = multiprocessing.process.BaseProcess.start


def start(self):
    with open(os.environ["MUONCKPT_TEST_STARTS"], "a") as f:
        f.write(f"{self.name}\\n")
    return _start(self)


multiprocessing.process.BaseProcess.start = start
"""
"""A ``sitecustomize`` that records every multiprocessing.Process the CLI starts (the forkserver
and resource tracker are no Process), one line each."""


def _counted_cli(tmp_path: Path, *args: object) -> tuple[subprocess.CompletedProcess[str], int]:
    """The CLI as a user runs it, and how many processes it started."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(COUNT_STARTS)
    starts = tmp_path / "starts"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]),
        "MUONCKPT_TEST_STARTS": str(starts),
    }
    done = subprocess.run(
        [sys.executable, "-m", "muonckpt.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    return done, len(starts.read_text().splitlines()) if starts.exists() else 0


# --- max_shard_size as the CLI and Hugging Face write it -------------------------------------


def test_max_shard_size_takes_the_strings_the_cli_and_hugging_face_take(tmp_path):
    """save(..., max_shard_size="100KB") failed with an internal TypeError."""
    opt = single_process_optimizer(1)
    by_int = muonckpt.save(opt, tmp_path / "int", consolidated=True, max_shard_size=1000)
    by_text = muonckpt.save(opt, tmp_path / "text", consolidated=True, max_shard_size="1KB")
    by_kib = muonckpt.save(opt, tmp_path / "kib", consolidated=True, max_shard_size="1KiB")
    names = sorted(p.name for p in by_int.iterdir())
    assert len([n for n in names if n.startswith("optimizer-")]) > 1
    assert sorted(p.name for p in by_text.iterdir()) == names
    for name in names:
        if name != "manifest.json":
            assert (by_text / name).read_bytes() == (by_int / name).read_bytes(), name
    assert muonckpt.verify(by_kib) == []
    big = muonckpt.save(opt, tmp_path / "big", consolidated=True, max_shard_size="100KB")
    assert "optimizer.safetensors" in {p.name for p in big.iterdir()}
    fut = muonckpt.async_save(opt, tmp_path / "async", consolidated=True, max_shard_size="1KB")
    assert sorted(p.name for p in fut.result().iterdir()) == names
    out = offline.consolidate(by_int, tmp_path / "c", max_shard_size="1KB")
    assert sorted(p.name for p in out.iterdir()) == names


def test_sizes_read_as_hugging_face_reads_them():
    assert settings.parse_size("5GB") == 5 * 10**9
    assert settings.parse_size("5GiB") == 5 * 2**30
    assert settings.parse_size("500MB") == 500 * 10**6
    assert settings.parse_size("100KB") == 100_000
    assert settings.parse_size("1.5GB") == 1_500_000_000
    assert settings.parse_size("1024") == 1024
    with pytest.raises(muonckpt.ArgumentError) as refused:
        settings.parse_size("\u0661\u0662\u0663")  # digits, but not ASCII ones
    assert refused.value.argument == "size"
    with pytest.raises(muonckpt.ArgumentError, match="whole number of bytes"):
        settings.parse_size("1.5B", "max_shard_size")  # once silently 1 byte
    assert settings.parse_size("1.5KB") == 1500


@pytest.mark.parametrize("bad", ["5 parsecs", "0KB", "", "-1MB", 0, -5, True, 1.5, [1]])
def test_a_bad_max_shard_size_is_refused_naming_it_before_anything_is_written(tmp_path, bad):
    opt = single_process_optimizer(1)
    with pytest.raises(muonckpt.CheckpointError, match="max_shard_size") as err:
        muonckpt.save(opt, tmp_path / "x", consolidated=True, max_shard_size=bad)
    assert "\n" not in str(err.value)
    with pytest.raises(muonckpt.CheckpointError, match="max_shard_size"):
        muonckpt.async_save(opt, tmp_path / "y", max_shard_size=bad)
    assert list(tmp_path.iterdir()) == []


# --- the rendezvous timeout ------------------------------------------------------------------


def huge_timeout_phase(path: str, how: str) -> str:
    """Every rank of a 2 x 1 packaged Muon job sets the rendezvous timeout to 1e99 (the
    environment, or set_rendezvous_timeout) and saves; the library error each rank got."""
    optimizer, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
    train(optimizer, sharded, dp_rank, tp_rank, 0, 1)
    try:
        if how == "env":
            os.environ["MUONCKPT_RENDEZVOUS_TIMEOUT"] = "1e99"
        else:
            muonckpt.distributed.set_rendezvous_timeout(1e99)
        muonckpt.save(optimizer, path)
    except muonckpt.MuonCkptError as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = "saved"
    finally:
        os.environ.pop("MUONCKPT_RENDEZVOUS_TIMEOUT", None)
    dist.barrier()
    return error


@pytest.mark.dist
@pytest.mark.parametrize("how", ["env", "call"])
def test_a_huge_rendezvous_timeout_is_one_line_on_every_rank(tmp_path, how):
    """MUONCKPT_RENDEZVOUS_TIMEOUT=1e99 was accepted, then every collective raised a raw
    OverflowError on every rank."""
    errors = run_distributed(huge_timeout_phase, 2, str(tmp_path / "ckpt"), how, timeout=RUN_S)
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("CollectiveError: "), errors
    assert "\n" not in errors[0]
    named = "MUONCKPT_RENDEZVOUS_TIMEOUT='1e99'" if how == "env" else "rendezvous timeout"
    assert named in errors[0] and "604800" in errors[0], errors[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [1e99, 10**12, settings.MAX_WAIT_S + 1])
def test_timeouts_past_a_week_are_refused(monkeypatch, bad):
    monkeypatch.delenv("MUONCKPT_RENDEZVOUS_TIMEOUT", raising=False)
    with pytest.raises(muonckpt.CollectiveError, match="the rendezvous timeout"):
        muonckpt.distributed.set_rendezvous_timeout(bad)
    assert muonckpt.distributed.set_rendezvous_timeout(settings.MAX_WAIT_S) == 60.0
    muonckpt.distributed.set_rendezvous_timeout(None)


# --- the other numeric settings --------------------------------------------------------------


@pytest.mark.parametrize("bad", [1e99, settings.MAX_WAIT_S * 2, float("nan"), 0])
def test_an_async_save_timeout_past_a_week_is_refused_by_the_call(tmp_path, bad):
    opt = single_process_optimizer(1)
    with pytest.raises(muonckpt.CheckpointError, match="timeout must be more than 0 and at most"):
        muonckpt.async_save(opt, tmp_path / "x", timeout=bad)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, "0.1", True, 10**400])
def test_diff_tolerances_are_finite_numbers(single_ckpt, bad):
    """A NaN tolerance made every element differ; an infinite one, every element agree."""
    src = single_ckpt(1)
    for name in ("atol", "rtol"):
        with pytest.raises(muonckpt.CheckpointError, match=f"^{name} must be"):
            offline.diff(src, src, **{name: bad})


@pytest.mark.parametrize("bad", ["60", None, True, float("nan"), -1])
def test_clean_older_than_is_a_number_of_seconds(tmp_path, bad):
    """clean(root, "60") and clean(root, None) were raw TypeErrors; True passed for 1 s."""
    staging = tmp_path / ".x.staging-0123abcd"
    staging.mkdir()
    with pytest.raises(muonckpt.CheckpointError, match=r"^older_than must be a number of seconds"):
        muonckpt.clean(tmp_path, bad)
    assert staging.exists()


@pytest.mark.dist
def test_demo_refuses_more_processes_than_the_cores_bear(tmp_path):
    """demo --dp 1000 would start 1000 training processes, then 2000 more."""
    done, started = _counted_cli(tmp_path, "demo", "--dp", "1000", "--tp", "1")
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert line.startswith("error: dp x tp=1000 is more than 4 processes per CPU core"), line
    assert started == 0
    assert settings.local_workers(np.int64(2), 1) == 2  # a numpy int is a count too
