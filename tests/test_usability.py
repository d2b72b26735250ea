"""Small things a new user meets first: full names in ``inspect``, a folder that is not a
checkpoint named as such, ``grid_groups`` checking its arguments, a demo that leaves nothing
behind, and the thread count beside every "bitwise" claim."""

from __future__ import annotations

import io
import re

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

import muonckpt
from muonckpt.cli import app
from muonckpt.demo import run_demo
from muonckpt.distributed.launch import run_distributed

from .conftest import REPO

LONG = "_orig_mod.module.transformer.h.11.attention.query_key_value.weight_with_a_long_tail"


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_inspect_shows_whole_names(tmp_path):
    params = [
        (LONG, torch.nn.Parameter(torch.ones(3, 2))),
        ("b", torch.nn.Parameter(torch.ones(2))),
    ]
    opt = torch.optim.AdamW(params)
    for _, p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    wide = cli("inspect", ckpt, "--wide")
    assert wide.exit_code == 0, wide.output
    assert any(line.strip().startswith(LONG) for line in wide.stdout.splitlines())
    narrow = cli("inspect", ckpt)  # 80 columns: wrapped, never cut
    assert narrow.exit_code == 0 and "…" not in narrow.stdout
    first_column = [
        line.split("│")[0].strip() for line in narrow.stdout.splitlines() if "│" in line
    ]
    assert LONG in "".join(first_column)


def test_a_hugging_face_folder_is_not_called_an_interrupted_save(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    safetensors.torch.save_file({"wte.weight": torch.zeros(4, 2)}, folder / "model.safetensors")
    (folder / "config.json").write_text("{}")
    for result in (cli("inspect", folder), cli("verify", folder)):
        assert result.exit_code in (1, 2), result.output
        assert "not a muonckpt checkpoint (a Hugging Face model folder" in result.output
        assert "interrupted" not in result.output
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(4, 2))])
    with pytest.raises(muonckpt.CheckpointError, match="not a muonckpt checkpoint"):
        muonckpt.load(opt, folder)


def test_a_muonckpt_folder_without_manifest_is_still_called_incomplete(single_ckpt, tmp_path):
    import shutil

    copy = shutil.copytree(single_ckpt(2), tmp_path / "copy")
    (copy / "manifest.json").unlink()
    result = cli("inspect", copy)
    assert result.exit_code == 2 and "incomplete checkpoint" in result.output


def wrong_grid(dp: int, tp: int) -> str:
    """(In a gloo child.) The error of grid_groups(dp, tp)."""
    try:
        muonckpt.distributed.grid_groups(dp, tp)
    except muonckpt.LayoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.dist
def test_grid_groups_checks_its_arguments_on_every_rank():
    messages = run_distributed(wrong_grid, 2, 2, 2, timeout=60)
    assert len(set(messages)) == 1
    assert "dp=2 x tp=2 = 4 ranks" in messages[0] and "has 2" in messages[0]
    (zero,) = set(run_distributed(wrong_grid, 2, 0, 2, timeout=60))
    assert "dp must be a positive int" in zero


@pytest.mark.dist
def test_the_demo_removes_its_temporary_directory(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = run_demo(dp=1, tp=1, to_dp=1, to_tp=1, steps=1)
    assert result.ok and not result.kept
    assert list(tmp_path.iterdir()) == []


@pytest.mark.dist
def test_the_demo_keeps_what_it_writes_under_dir(tmp_path):
    out = cli(
        "demo", "--dp", 1, "--tp", 1, "--to-dp", 1, "--to-tp", 1, "--steps", 1, "--dir", tmp_path
    )
    assert out.exit_code == 0, out.output
    assert muonckpt.verify(tmp_path / "ckpt") == [] and f"checkpoints in {tmp_path}" in out.stdout


def test_bitwise_claims_name_the_thread_count():
    readme = (REPO / "README.md").read_text()
    assert re.search(
        r"[Bb]itwise[^\n]*\n?[^\n]*OMP_NUM_THREADS|OMP_NUM_THREADS[^#]{0,400}bitwise", readme
    )


def test_save_async_save_and_load_report_progress_and_lines_report_it_to_a_log(tmp_path):
    """(issue 57, item 4) ``progress=`` on save, async_save and load, the offline tools' own
    callback; ProgressLines prints it at a steady interval and once done."""
    params = [(f"w{i}", torch.nn.Parameter(torch.ones(8, 8))) for i in range(3)]
    opt = torch.optim.AdamW(params)
    for _, p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    calls: dict[str, list[tuple[int, int, int, int]]] = {"save": [], "async": [], "load": []}
    muonckpt.save(opt, tmp_path / "a", progress=lambda *a: calls["save"].append(a))
    muonckpt.async_save(opt, tmp_path / "b", progress=lambda *a: calls["async"].append(a)).result()
    muonckpt.load(opt, tmp_path / "a", progress=lambda *a: calls["load"].append(a))
    for what, seen in calls.items():
        total, tensors = seen[0][1], seen[0][3]
        assert seen[0] == (0, total, 0, tensors) and seen[-1] == (total, total, tensors, tensors)
        assert tensors == 3 * 3 and total >= 3 * 3 * 8 * 8 * 4, (what, seen)  # param + 2 moments
    lines, now = io.StringIO(), [0.0]
    report = muonckpt.ProgressLines("reshard", every=10.0, stream=lines, clock=lambda: now[0])
    for done, seconds in ((0, 0.0), (1 << 20, 5.0), (3 << 20, 10.0), (4 << 20, 16.0)):
        now[0] = seconds
        report(done, 4 << 20, done >> 20, 4)
    assert lines.getvalue().splitlines() == [
        "reshard: 75% 3.0 MiB of 4.0 MiB, 3 of 4 tensors, 307.2 KiB/s",
        "reshard: done, 4.0 MiB, 4 tensors in 16.0 s, 256.0 KiB/s",
    ]


def test_the_cli_reports_progress_in_lines_where_stderr_is_no_terminal(single_ckpt, tmp_path):
    result = cli("reshard", single_ckpt(2), "--dp", "2", "--tp", "1", "-o", tmp_path / "r")
    assert result.exit_code == 0, result.output
    done = [line for line in result.stderr.splitlines() if line.startswith("reshard: done, ")]
    assert len(done) == 1 and done[0].endswith("/s"), result.stderr
    quiet = cli("-q", "reshard", single_ckpt(2), "--dp", "2", "--tp", "1", "-o", tmp_path / "q")
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr


def test_the_foreign_writers_report_progress(single_ckpt, tmp_path):
    """(issue 57, item 4) Every offline tool takes ``progress=``, the foreign writers too: DCP
    (torchtitan's and Megatron's go through its writer) and DeepSpeed, each from a start to
    every byte; ``convert`` prints their lines where stderr is no terminal."""
    src = single_ckpt(2)
    for name, write in {
        "dcp": lambda progress: muonckpt.interop.to_dcp(
            src, tmp_path / "dcp", to="torch", progress=progress
        ),
        "deepspeed": lambda progress: muonckpt.interop.to_deepspeed(
            src, tmp_path / "ds", world=2, progress=progress
        ),
    }.items():
        seen: list[tuple[int, int, int, int]] = []
        write(lambda *a, seen=seen: seen.append(a))
        total, tensors = seen[0][1], seen[0][3]
        assert seen[0] == (0, total, 0, tensors) and seen[-1] == (total, total, tensors, tensors)
        assert len(seen) == tensors + 1 and total > 0, (name, seen)
    result = cli("convert", src, "--format", "dcp", "--to", "torch", "-o", tmp_path / "cli")
    assert result.exit_code == 0, result.output
    assert [line for line in result.stderr.splitlines() if line.startswith("convert: done, ")]


def _spec(package):
    import importlib.machinery

    return importlib.machinery.ModuleSpec("torch", None, origin=str(package / "__init__.py"))


def test_an_older_torch_is_one_line_at_import(monkeypatch, tmp_path):
    """(issue 57, item 1) torch 2.4 failed deep inside (``optimizer can only optimize Tensors``);
    now ``import muonckpt`` names the version needed, from torch's version file alone."""
    assert muonckpt._torch_too_old("2.13.0+cpu") is None
    assert muonckpt._torch_too_old("2.14.0.dev20260101") is None
    old = tmp_path / "torch"  # an installed torch 2.4.1, as far as its version file says
    old.mkdir()
    (old / "__init__.py").write_text("")
    (old / "version.py").write_text("__version__ = '2.4.1'\n")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: _spec(old))
    with pytest.raises(ImportError) as refused:
        muonckpt._check_torch()
    assert str(refused.value) == (
        "muonckpt needs torch>=2.13, and torch 2.4.1 is installed: pip install 'torch>=2.13'"
    )
    monkeypatch.setenv("MUONCKPT_ALLOW_OLD_TORCH", "1")  # the job that tries a lower floor
    muonckpt._check_torch()
