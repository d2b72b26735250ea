"""The most ranks an output is written for (issue 50, finding 4): ``--to deepspeed --world``,
``--to megatron --tp`` and ``reshard --dp x --tp`` are capped at
:data:`muonckpt.settings.MAX_WORLD` unless ``--allow-large-world`` is passed, and refused past
the cap before anything is read or written, in one line naming the option, the cap and the
override."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from muonckpt import interop, settings
from muonckpt.cli import app
from muonckpt.errors import OptionError

DEEPSPEED = Path(__file__).parent / "fixtures" / "deepspeed" / "w2_z1_torchadam_fp32" / "ckpt"
MEGATRON = Path(__file__).parent / "fixtures" / "megatron" / "tp2_dp1" / "checkpoint"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """A muonckpt checkpoint read from DeepSpeed, and one read from Megatron."""
    root = tmp_path_factory.mktemp("caps")
    interop.from_deepspeed(DEEPSPEED, root / "ds")
    interop.from_megatron(MEGATRON, root / "mcore")
    return {"deepspeed": root / "ds", "megatron": root / "mcore"}


def test_the_cap_is_taken_and_one_past_it_refused_naming_the_override():
    cap = settings.MAX_WORLD
    assert settings.world_size(cap, "--world", "one rank file", allow_large=False) == cap
    with pytest.raises(OptionError, match="--allow-large-world") as info:
        settings.world_size(cap + 1, "--world", "one rank file", allow_large=False)
    assert info.value.option == "--world" and f"more than {cap}" in str(info.value)
    large = settings.MAX_LARGE_WORLD
    assert settings.world_size(cap + 1, "--world", "one rank file", allow_large=True) == cap + 1
    assert settings.world_size(large, "--world", "one rank file", allow_large=True) == large
    with pytest.raises(OptionError, match=f"more than {large}"):
        settings.world_size(large + 1, "--world", "one rank file", allow_large=True)


def _refused(args: list[str], dst: Path, option: str) -> None:
    result = CliRunner().invoke(app, [*args, "-o", str(dst)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    message = result.output.strip()
    assert "\n" not in message and "Traceback" not in message, message
    assert option in message and str(settings.MAX_WORLD) in message, message
    assert "--allow-large-world" in message, message
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}*"))


def test_each_output_past_the_cap_is_refused_before_anything_is_written(sources, tmp_path):
    ds, mcore, past = sources["deepspeed"], sources["megatron"], str(settings.MAX_WORLD + 1)
    _refused(["convert", str(ds), "--to", "deepspeed", "--world", past], tmp_path / "a", "--world")
    _refused(
        ["convert", str(ds), "--to", "deepspeed", "--world", "100000"], tmp_path / "b", "--world"
    )
    _refused(
        ["convert", str(mcore), "--to", "megatron", "--tp", past, "--dp", "1"],
        tmp_path / "c",
        "--tp",
    )
    _refused(["reshard", str(ds), "--dp", past, "--tp", "1"], tmp_path / "d", "--dp")
    with pytest.raises(OptionError, match="allow_large_world=True"):
        interop.to_deepspeed(ds, tmp_path / "e", world=settings.MAX_WORLD + 1)
    assert not (tmp_path / "e").exists()


def test_the_override_is_taken_by_the_writers_that_need_it_only(sources, tmp_path):
    ds = sources["deepspeed"]
    runner = CliRunner()
    taken = runner.invoke(
        app,
        ["convert", str(ds), "-o", str(tmp_path / "w"), "--to", "deepspeed", "--world", "2",
         "--allow-large-world"],
    )  # fmt: skip
    assert taken.exit_code == 0, taken.output
    not_taken = runner.invoke(
        app, ["convert", str(ds), "-o", str(tmp_path / "t"), "--to", "torch", "--allow-large-world"]
    )
    assert not_taken.exit_code == 2 and "--allow-large-world" in not_taken.output
    assert not (tmp_path / "t").exists()


def test_a_megatron_output_caps_its_tp_only(sources, tmp_path):
    """Megatron's torch_dist files hold global tensors in one chunk per TP rank, whatever the
    DP size: a DP of 100,000 costs nothing and is taken, as a real job's DP of thousands is."""
    listed = []
    for dp in ("1", "100000"):
        out = tmp_path / dp
        args = ["convert", str(sources["megatron"]), "-o", str(out), "--to", "megatron"]
        done = CliRunner().invoke(app, [*args, "--tp", "1", "--dp", dp])
        assert done.exit_code == 0, done.output
        listed.append(sorted(str(p.relative_to(out)) for p in out.rglob("*")))
    assert listed[0] == listed[1]
