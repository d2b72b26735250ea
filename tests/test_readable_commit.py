"""(issue 50, finding 5) Nothing committed that its own readers refuse: odd values in a foreign
checkpoint (a Lightning ``.ckpt``'s AdamW ``step`` of ``'abc'`` or -3, a param group value
nested one level past :data:`~muonckpt.format.manifest.EXTRA_DEPTH`, a DeepSpeed
``global_steps`` of -3) or a ``--rename`` onto a tied alias are refused before the commit,
naming the source and what is wrong: the Python API raises a CheckpointError, the CLI exits
2, and the output path does not exist (nor its staging). The Lightning reader refuses its
cases as it takes the values (``interop/_fields``, ``json_safe``); the DeepSpeed step and the
rename reach the commit, whose read-back of the manifest refuses them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import muonckpt
from muonckpt import CheckpointError, interop, offline
from muonckpt.cli import app
from muonckpt.format.manifest import EXTRA_DEPTH

FIXTURES = Path(__file__).parent / "fixtures"
LIGHTNING = next((FIXTURES / "lightning" / "named" / "checkpoints").glob("*.ckpt"))
DEEPSPEED = FIXTURES / "deepspeed" / "w2_z1_torchadam_fp32" / "ckpt"


def _steps(value):
    def edit(top: dict) -> None:
        for state in top["optimizer_states"][1]["state"].values():  # the AdamW's
            state["step"] = value

    return edit


def _nested(levels: int):
    """A param group value nested ``levels`` lists deep (the innermost list at depth
    ``levels`` of the group's settings, which ``json_safe`` admits below EXTRA_DEPTH)."""

    def edit(top: dict) -> None:
        deep: object = 1.0
        for _ in range(levels):
            deep = [deep]
        top["optimizer_states"][1]["param_groups"][0]["schedule"] = deep

    return edit


EDITS = {
    "step-abc": (_steps("abc"), "the state 'step' of param index 0 'abc' is not a step count"),
    "step-minus-3": (_steps(torch.tensor(-3.0)), "-3.0 is not a step count"),
    f"nested-{EXTRA_DEPTH}": (_nested(EXTRA_DEPTH), f"nests more than {EXTRA_DEPTH} levels deep"),
}
READ_BACK = "verify and load refuse"
"""How the commit's read-back of the manifest words its refusal."""


def _edited(tmp_path: Path, edit) -> Path:
    top = torch.load(LIGHTNING, weights_only=True)
    edit(top)
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "odd.ckpt"
    torch.save(top, src)
    return src


def _refused_by_both(
    src: Path, out: Path, why: str, api, cli_args: list[str], match: str = ""
) -> None:
    """The API raises, naming ``src`` and ``why``; the CLI exits 2 saying so; neither commits
    anything or leaves a staging directory beside ``out``."""
    before = sorted(os.listdir(out.parent))
    with pytest.raises(CheckpointError, match=match) as info:
        api()
    message = str(info.value)
    assert why in message and str(src) in message and "\n" not in message, message
    assert not out.exists() and sorted(os.listdir(out.parent)) == before
    result = CliRunner().invoke(app, ["convert", str(src), "-o", str(out), *cli_args])
    assert result.exit_code == 2, result.output
    assert why in result.output and "Traceback" not in result.output, result.output
    assert not out.exists() and sorted(os.listdir(out.parent)) == before


@pytest.mark.parametrize("case", sorted(EDITS))
def test_a_lightning_checkpoint_with_odd_values_commits_nothing(tmp_path, case):
    edit, why = EDITS[case]
    src = _edited(tmp_path, edit)
    out = tmp_path / "out"
    api = lambda: interop.from_lightning(src, out)  # noqa: E731
    _refused_by_both(src, out, why, api, ["--from", "lightning"])


def test_a_value_nested_to_the_readers_limit_is_committed_and_reads(tmp_path):
    """EXTRA_DEPTH - 1 levels in the group, the reader's limit (one more is refused above)."""
    src = _edited(tmp_path, _nested(EXTRA_DEPTH - 1))
    out = interop.from_lightning(src, tmp_path / "out").path
    assert muonckpt.verify(out) == []
    assert muonckpt.read_manifest(out).groups


def test_a_deepspeed_global_steps_of_minus_3_commits_nothing(tmp_path):
    src = tmp_path / "ds"
    shutil.copytree(DEEPSPEED, src)
    model = src / "global_step3" / "mp_rank_00_model_states.pt"
    states = torch.load(model, weights_only=True)
    states["global_steps"] = -3
    torch.save(states, model)
    out = tmp_path / "out"
    api = lambda: interop.from_deepspeed(src, out)  # noqa: E731
    why = "step must be a non-negative int, got -3"
    _refused_by_both(src, out, why, api, [], match=READ_BACK)


def test_a_rename_onto_a_tied_alias_commits_nothing(tmp_path):
    src = interop.from_deepspeed(DEEPSPEED, tmp_path / "ckpt").path  # lm_head.weight is tied
    out = tmp_path / "out"
    api = lambda: offline.convert(src, out, rename={"embed.": "lm_head."})  # noqa: E731
    why = "aliases must map other names to stored tensors"
    _refused_by_both(src, out, why, api, ["--rename", "embed.=lm_head."], match=READ_BACK)
