"""The muonckpt CLI: exit codes, output, error lines, --force, and the demo."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import muonckpt
from muonckpt import offline
from muonckpt.cli import app
from muonckpt.distributed.launch import run_distributed
from muonckpt.format.names import rank_file
from muonckpt.settings import parse_size

from .ckpt_cases import load_phase
from .fixture_model import (
    N_GROUPS,
    N_PARAMS,
    N_STATE_TENSORS,
    PARAM_NAMES,
    TP_SPLIT_DIMS,
    assemble,
    build,
    initial_params,
    local_params,
    shape_text,
    split_params_indivisible_by,
    train,
)

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def ckpts(single_ckpt):
    """Single-process checkpoints of the fixture model after 2 and 3 steps (read only)."""
    return {"a": single_ckpt(2), "b": single_ckpt(3)}


def _one_error_line(result):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.dist
def test_installed_script_help():
    done = subprocess.run(["muonckpt", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for command in ("consolidate", "reshard", "inspect", "verify", "latest", "diff", "demo"):
        assert command in done.stdout


def test_inspect_table_and_json(ckpts):
    result = cli("inspect", ckpts["a"])
    assert result.exit_code == 0, result.output
    first = PARAM_NAMES[0]
    for text in ("per-rank", "step 2", first, shape_text(first), "momentum_buffer", "exp_avg_sq"):
        assert text in result.stdout
    assert "F32" in result.stdout
    wide = cli("inspect", ckpts["a"], "--wide").stdout.splitlines()  # 80 columns: not a terminal
    total = [line for line in wide if line.startswith("total: ")]
    assert len(total) == 1 and total[0].endswith("pieces)") and len(total[0]) > 80, wide
    assert all(line.startswith("group ") for line in wide if "weight_decay" in line)
    result = cli("inspect", ckpts["a"], "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["step"] == 2 and info["topology"] == {"dp": 1, "tp": 1}
    assert info["totals"]["params"] == N_PARAMS
    assert info["totals"]["tensors"] == N_STATE_TENSORS
    assert [p["name"] for p in info["params"]] == PARAM_NAMES


def test_reshard_consolidate_and_force(ckpts, tmp_path):
    out = tmp_path / "r"
    result = cli("reshard", ckpts["a"], "--dp", "2", "--tp", "2", "-o", out)
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stderr
    assert sorted(p.name for p in out.glob("rank-*.safetensors")) == [
        rank_file(r, 4) for r in range(4)
    ]
    line = _one_error_line(cli("reshard", ckpts["a"], "--dp", "2", "--tp", "2", "-o", out))
    assert "already exists; pass --force to replace it" in line and "overwrite" not in line
    with pytest.raises(muonckpt.CheckpointError, match="pass overwrite=True to replace it"):
        offline.reshard(ckpts["a"], out, dp=2, tp=2)  # the API speaks in arguments
    result = cli("--quiet", "reshard", ckpts["a"], "--dp", "1", "--tp", "2", "-o", out, "--force")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert muonckpt.read_manifest(out).topology == {"dp": 1, "tp": 2}
    result = cli(
        "reshard",
        ckpts["a"],
        "--dp",
        "1",
        "--tp",
        "2",
        "--tp-split",
        "w_in=0",
        "-o",
        out,
        "-f",
        "-q",  # the command's own --quiet, after it
    )
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert muonckpt.read_manifest(out).param("w_in").tp_split_dim == 0
    assert any(
        p.param == "w_in" and p.file == rank_file(1, 2) for p in muonckpt.read_manifest(out).pieces
    )

    full = tmp_path / "c"
    result = cli("consolidate", out, "-o", full, "--max-shard-size", "1KB")
    assert result.exit_code == 0, result.output
    assert (full / "optimizer.safetensors.index.json").is_file()
    assert cli("verify", full).exit_code == 0
    assert cli("diff", ckpts["a"], full).exit_code == 0


def test_bad_usage_exits_2(ckpts, tmp_path):
    bad = split_params_indivisible_by(3)[0]
    result = cli("consolidate", ckpts["a"], "-o", tmp_path / "c", "--max-shard-size", "5XB")
    assert result.exit_code == 2
    assert "5XB" in result.output
    assert cli("reshard", ckpts["a"], "--dp", "0", "--tp", "1", "-o", tmp_path / "x").exit_code == 2
    line = _one_error_line(
        cli(
            "reshard",
            ckpts["a"],
            "--dp",
            "1",
            "--tp",
            "3",
            "--tp-split",
            f"{bad}={TP_SPLIT_DIMS[bad]}",
            "-o",
            tmp_path / "y",
        )
    )
    assert f"param '{bad}'" in line and "tp=3" in line
    assert not (tmp_path / "y").exists()
    assert (
        cli(
            "reshard",
            ckpts["a"],
            "--dp",
            "1",
            "--tp",
            "1",
            "--tp-split",
            bad,  # no dim
            "-o",
            tmp_path / "z",
        ).exit_code
        == 2
    )
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1024") == 1024


def _same_files(a, b) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


@pytest.mark.dist
@pytest.mark.parametrize(
    "args, options",
    [
        (
            ["--bucket-numel", "40", "--param-alignment", "4", "--bucket-alignment", "8"],
            muonckpt.layout.topology.LayoutOptions(
                bucket_numel=40, param_alignment=4, bucket_alignment=8
            ),
        ),
        (
            ["--param-alignment", "4", "--buffers-by", "group"],
            muonckpt.layout.topology.LayoutOptions(param_alignment=4, buffers_by="group"),
        ),
    ],
)
def test_reshard_layout_options_are_the_library_s_and_load_back(ckpts, tmp_path, args, options):
    out = tmp_path / "cli"
    result = cli("reshard", ckpts["a"], "--dp", "2", "--tp", "1", *args, "-o", out)
    assert result.exit_code == 0, result.output
    library = offline.reshard(ckpts["a"], tmp_path / "lib", dp=2, tp=1, options=options)
    assert _same_files(library, out)
    # each option given changes which rank holds what, so the comparison above sees any one of
    # them dropped on the way
    default = muonckpt.layout.topology.LayoutOptions()
    for field in dataclasses.fields(options):
        if getattr(options, field.name) != getattr(default, field.name):
            without = dataclasses.replace(options, **{field.name: getattr(default, field.name)})
            other = offline.reshard(ckpts["a"], tmp_path / field.name, dp=2, tp=1, options=without)
            assert not _same_files(other, out), field.name

    # loads back at 2 x 1 (into the fixture model's own layout) and trains on bitwise
    reference, sharded, dp_rank, tp_rank = build(1, 1, initial_params())
    train(reference, sharded, dp_rank, tp_rank, 0, 3)
    shards = run_distributed(load_phase, 2, 2, 1, str(out), 2, 1, timeout=180)
    full = assemble(2, 1, shards)
    for name, value in local_params(reference).items():
        assert torch.equal(full[name], value), name


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bucket-numel", "0"], "bucket_numel must be positive, got 0"),
        (["--param-alignment", "0"], "param_alignment must be positive, got 0"),
        (["--bucket-alignment", "-8"], "bucket_alignment must be positive, got -8"),
        (["--buffers-by", "dtype"], "buffers_by must be one of 'none', 'group', got 'dtype'"),
    ],
)
def test_reshard_bad_layout_options_are_one_error_line(ckpts, tmp_path, args, message):
    line = _one_error_line(
        cli("reshard", ckpts["a"], "--dp", "2", "--tp", "1", *args, "-o", tmp_path / "x")
    )
    assert line == f"error: {message}"
    assert list(tmp_path.iterdir()) == []


def test_reshard_help_names_every_layout_option():
    result = cli("reshard", "--help")
    assert result.exit_code == 0
    for flag in ("--bucket-numel", "--param-alignment", "--bucket-alignment", "--buffers-by"):
        assert flag in result.stdout
    assert "none|group" in result.stdout


def test_unreadable_input_exits_2_with_one_line(ckpts, tmp_path):
    line = _one_error_line(cli("inspect", tmp_path / "missing"))
    assert "missing" in line
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")
    assert "not valid JSON" in _one_error_line(cli("diff", ckpts["a"], broken))
    assert "missing" in _one_error_line(cli("verify", tmp_path / "missing"))


def test_debug_adds_the_traceback_and_keeps_the_exit_code(tmp_path):
    for args in (["inspect", tmp_path / "missing"], ["verify", tmp_path / "missing"]):
        plain = cli(*args)
        debug = cli("--debug", *args)
        assert plain.exit_code == debug.exit_code == 2, debug.output
        assert "Traceback" in debug.stderr and "CheckpointError" in debug.stderr
        assert debug.stderr.strip().splitlines()[-1] == plain.stderr.strip()


def test_verify_sound_and_damaged(ckpts, tmp_path):
    result = cli("verify", ckpts["a"])
    assert result.exit_code == 0 and "ok" in result.stdout
    damaged = shutil.copytree(ckpts["a"], tmp_path / "d")
    data = damaged / rank_file(0, 1)
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    (damaged / "stray.bin").write_bytes(b"x")
    result = cli("verify", damaged)
    assert result.exit_code == 1, result.output
    assert "checksum mismatch" in result.stdout
    assert "unknown file" in result.stdout and "stray.bin" in result.stdout
    assert "2 problem(s)" in result.stdout


def test_a_missing_root_exits_1_for_clean_as_for_latest(tmp_path):
    for command in ("clean", "latest"):
        result = cli(command, tmp_path / "no" / "such")
        assert result.exit_code == 1, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and "no/such" in result.stderr
    assert cli("clean", tmp_path).exit_code == 0  # nothing to clean in an existing ROOT


def test_diff_exit_codes(ckpts):
    result = cli("diff", ckpts["a"], ckpts["b"])
    assert result.exit_code == 1, result.output
    assert "NO" in result.stdout and "differ" in result.stdout
    # Within the tolerance every tensor matches; the step counts (2 and 3) still differ.
    result = cli("diff", ckpts["a"], ckpts["b"], "--atol", "1e6")
    assert result.exit_code == 1 and "['step']" in result.stdout
    tensors = N_STATE_TENSORS + N_PARAMS  # the params are saved too
    rows = tensors + N_GROUPS + 1  # a row per group's settings, one for the checkpoint's step
    assert f"{N_GROUPS + 1} of {rows} row(s) differ" in result.stdout  # the steps
    result = cli("diff", ckpts["a"], ckpts["a"])
    assert result.exit_code == 0 and "bitwise" in result.stdout


@pytest.mark.dist
def test_demo_small(tmp_path):
    result = cli(
        "demo",
        "--dp",
        "1",
        "--tp",
        "2",
        "--to-dp",
        "2",
        "--to-tp",
        "1",
        "--steps",
        "2",
        "--dir",
        tmp_path,
    )
    assert result.exit_code == 0, result.output
    from muonckpt.demo import SHAPES as DEMO_SHAPES  # the demo's own model, not the fixture

    assert "bitwise equal" in result.stdout
    for name, shape in DEMO_SHAPES.items():
        assert name in result.stdout and "x".join(map(str, shape)) in result.stdout
    assert "NO" not in result.stdout
    assert muonckpt.read_manifest(tmp_path / "resharded").topology == {"dp": 2, "tp": 1}


@pytest.mark.dist
def test_help_and_usage_errors_do_not_import_torch():
    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from muonckpt.cli import app\n"
        "assert CliRunner().invoke(app, ['--help']).exit_code == 0\n"
        "assert CliRunner().invoke(app, ['reshard']).exit_code == 2\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.dist
def test_single_process_consolidate_reshard_inspect_verify_do_not_import_torch(ckpts, tmp_path):
    src, out = ckpts["a"], tmp_path
    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from muonckpt.cli import app\n"
        "run = CliRunner().invoke\n"
        f"assert run(app, ['-q', 'consolidate', {str(src)!r}, '-o', {str(out / 'c')!r}])"
        ".exit_code == 0\n"
        f"assert run(app, ['-q', 'reshard', {str(src)!r}, '--dp', '1', '--tp', '2', '-o', "
        f"{str(out / 'r')!r}]).exit_code == 0\n"
        f"assert run(app, ['inspect', {str(out / 'r')!r}, '--json']).exit_code == 0\n"
        f"assert run(app, ['verify', {str(out / 'c')!r}]).exit_code == 0\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"
    # What they wrote without torch compares equal, tensor by tensor, to the source.
    assert cli("diff", src, out / "c").exit_code == 0
    assert cli("diff", out / "r", out / "c").exit_code == 0


def test_lazy_public_names_all_resolve():
    assert set(muonckpt.__all__) <= set(dir(muonckpt))
    for name in muonckpt.__all__:
        assert getattr(muonckpt, name) is not None
    with pytest.raises(AttributeError):
        muonckpt.not_a_name  # noqa: B018


def test_inspect_of_many_params_prints_plain_lines(ckpts, monkeypatch):
    from muonckpt.cli import output

    monkeypatch.setattr(output, "TABLE_ROWS", 2)
    result = cli("inspect", ckpts["a"])
    assert result.exit_code == 0, result.output
    lines = [line.split("\t") for line in result.stdout.splitlines() if "\t" in line]
    assert lines[0][0] == "param" and len(lines) == 1 + N_PARAMS
    assert [line[:2] for line in lines[1:]] == [[n, shape_text(n)] for n in PARAM_NAMES]


def test_reshard_to_an_absurd_topology_is_refused_at_once(ckpts, tmp_path):
    result = cli(
        "reshard", ckpts["a"], "--dp", "1000000000", "--tp", "1000000", "-o", tmp_path / "x"
    )
    line = _one_error_line(result)
    assert "more than 4096" in line and "--allow-large-world" in line and "65536" in line
    assert not (tmp_path / "x").exists()
    large = ("--dp", "1000000000", "--tp", "1000000", "--allow-large-world")
    line = _one_error_line(cli("reshard", ckpts["a"], *large, "-o", tmp_path / "x"))
    assert "more than 65536" in line and not (tmp_path / "x").exists()


def test_names_read_from_a_checkpoint_cannot_drive_the_terminal(tmp_path):
    """(issue 20) A param named with a terminal escape code (or rich markup) was printed raw by
    inspect and diff: it is shown as escapes, as written."""
    evil = "evil\x1b[2J[red]name"
    p = torch.nn.Parameter(torch.ones(2, 2))
    opt = torch.optim.AdamW([(evil, p)])
    p.grad = torch.ones_like(p)
    opt.step()
    ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    for args in (("diff", ckpt, ckpt), ("inspect", ckpt)):
        result = cli(*args)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.output
        assert "evil\\x1b[2" in result.output, result.output  # shown (inspect cuts long names)
    assert "evil\\x1b[2J[red]name" in cli("diff", ckpt, ckpt).output  # markup shown as written


def test_diff_differences_prints_only_the_differences_and_the_summary(ckpts):
    """(issue 21, item 7) diff printed every row even when all were equal. (issue 57) The flag
    is --differences: -q means "no progress bar" in every command, and diff has none."""
    assert cli("diff", ckpts["a"], ckpts["a"], "-q").exit_code == 2  # no such option
    result = cli("diff", ckpts["a"], ckpts["a"], "--differences")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1].startswith("all ")
    assert "bitwise" not in result.stdout and len(result.stdout.strip().splitlines()) == 1
    full = cli("diff", ckpts["a"], ckpts["b"], "--atol", "1e6")  # only the steps differ
    quiet = cli("diff", ckpts["a"], ckpts["b"], "--atol", "1e6", "-d")
    assert quiet.exit_code == full.exit_code == 1, quiet.output
    assert "['step']" in quiet.stdout and "yes" in full.stdout and "yes" not in quiet.stdout
    assert quiet.stdout.strip().splitlines()[-1] == full.stdout.strip().splitlines()[-1]
    assert len(quiet.stdout.splitlines()) < len(full.stdout.splitlines())


def _readme_exit_codes() -> list[tuple[str, str]]:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = text.split("| code | meaning |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    rows = [line.strip("|").split("|", 1) for line in section.splitlines()]
    return [(code.strip(), meaning.strip()) for code, meaning in rows]


def test_the_readme_exit_codes_are_the_cli_s_table():
    from muonckpt.cli.exits import EXIT_CODES

    assert _readme_exit_codes() == [(row.code, row.meaning) for row in EXIT_CODES]
    for row in EXIT_CODES:  # every error type that ends in a code is named where it is told
        for error in row.errors:
            assert f"`{error.__name__}`" in row.meaning, (row.code, error)
    assert len({row.code for row in EXIT_CODES}) == len(EXIT_CODES)


def test_a_write_the_system_refuses_exits_2_as_the_table_says(ckpts, tmp_path):
    """A write the system refuses (here: the output's parent is a file) is one error line and
    exit code 2, as a refused read is."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = cli("consolidate", ckpts["a"], "-o", blocker / "out")
    assert result.exit_code == 2, result.output
    assert "error: " in result.output
