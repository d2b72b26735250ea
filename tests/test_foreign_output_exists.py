"""A foreign format's output over an existing path (issue 50, round 2, M5): its writers never
write over anything, so the refusal says so and does not advise ``--force`` (which each of them
refuses too); nothing is written into the existing directory. Megatron's writer goes through
the same staging (``interop/_foreign_out.staged_output``) but needs a Megatron-read source."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from muonckpt.cli import app

WRITERS = {
    "deepspeed": ["--to", "deepspeed", "--world", "2"],
    "dcp": ["--format", "dcp", "--to", "torch"],
    "accelerate": ["--to", "accelerate"],
    "lightning": ["--to", "lightning"],
}


@pytest.mark.parametrize("output", WRITERS)
def test_an_existing_output_is_refused_without_advising_force(single_ckpt, tmp_path, output):
    runner = CliRunner()
    (tmp_path / "out").mkdir()
    args = ["convert", str(single_ckpt(2)), "-o", str(tmp_path / "out"), *WRITERS[output]]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2, refused.output
    error = refused.stderr.strip()
    assert error.startswith("error: already exists; ") and "--force" not in error, error
    assert f"{output} output is never written over an existing path" in error, error
    forced = runner.invoke(app, [*args, "--force"])
    assert forced.exit_code != 0 and "never written over an existing directory" in forced.output
    assert not any((tmp_path / "out").iterdir())
