"""DeepSpeed directories muonckpt must not read as the ZeRO-1/2 save it reads, each named in one
line (the fifth adversarial pass, F2 and F4), and the odd but sound values it must read (M3,
M6), each built from DeepSpeed's own files (tests/fixtures/deepspeed), converted through the
command line.

F2: a save with tensor or pipeline parallelism (``mp_rank_01_*`` files, ``mp_world_size`` or
``checkpoint_parallel_dimensions`` above 1) was converted from ``mp_rank_00`` alone, exit 0.
F4: two files for one rank (``zero_pp_rank_1_...`` and ``zero_pp_rank_01_...``): the one
listed last was used. M3: NaN momentum equal on both ranks was called "differs". M4: a
``latest`` FIFO or a missing rank 0 file was a usage error about ``--to``. M6: an int64 step
tensor became 3.0 and was refused at the read-back."""

from __future__ import annotations

import math
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import muonckpt
from muonckpt import ConversionWarning
from muonckpt.cli import app
from muonckpt.interop.deepspeed import files as deepspeed_files

from .hostile_files import DEEPSPEED, copy, refused, resave

TAG = "global_step3"
MOMENTUM = "blocks.2.fc2.weight"
"""A Muon matrix both ranks of the fixture hold the whole momentum of."""


def _source(tmp: Path) -> tuple[Path, Path]:
    src = copy(DEEPSPEED, tmp / "src")
    return src, src / TAG


def _optim(top: dict[str, Any]) -> dict[str, Any]:
    return top["optimizer_state_dict"]


def _masters(change: Any) -> Any:
    return lambda top: [change(t.data) for t in _optim(top)["single_partition_of_fp32_groups"]]


def _converts(src: Path, dst: Path) -> None:
    result = CliRunner().invoke(app, ["convert", str(src), "-o", str(dst)])
    assert result.exit_code == 0, result.output


def test_the_files_of_a_second_model_parallel_rank_are_refused(tmp_path):
    """DeepSpeed's files of TP rank 1 beside rank 0's (other masters: the other half of each
    matrix): refused naming a file of model-parallel rank 1 (before: exit 0, rank 0's shard
    written as the whole param)."""
    src, tag = _source(tmp_path)
    for name in (deepspeed_files.MODEL_STATES, *(deepspeed_files.rank_file(r) for r in (0, 1))):
        other = shutil.copy(tag / name, tag / name.replace("mp_rank_00", "mp_rank_01"))
        if "optim" in name:
            resave(Path(other), _masters(lambda t: t.mul_(-1)))
    message = refused([str(src)], tmp_path / "out", str(tag / "mp_rank_01_"))
    assert "model-parallel rank 1" in message and "does not read" in message, message


@pytest.mark.parametrize(
    ("record", "said"),
    [
        ({"mp_world_size": 2}, "mp_world_size is 2"),
        (
            {"checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 2}},
            "checkpoint_parallel_dimensions['tp_degree'] is 2",
        ),
        (
            {"checkpoint_parallel_dimensions": {"pp_degree": 2, "tp_degree": 1}},
            "checkpoint_parallel_dimensions['pp_degree'] is 2",
        ),
        ({"mp_world_size": True}, "mp_world_size is True"),
    ],
)
def test_model_parallelism_recorded_in_the_model_states_is_refused(record, said, tmp_path):
    """Only the mp_rank_00 files there (the others not copied), the degree recorded as
    DeepSpeed records it: refused naming the model states and the degree."""
    src, tag = _source(tmp_path)
    model = resave(tag / deepspeed_files.MODEL_STATES, lambda top: top.update(record))
    refused([str(src)], tmp_path / "out", str(model), said, "tensor or pipeline parallelism")


def test_two_files_for_one_rank_are_refused_naming_both(tmp_path):
    """A stray ``zero_pp_rank_01_...`` (other masters) beside rank 1's own file (before: the
    one listed last was used, exit 0)."""
    src, tag = _source(tmp_path)
    own = tag / deepspeed_files.rank_file(1)
    stray = Path(shutil.copy(own, tag / "zero_pp_rank_01_mp_rank_00_optim_states.pt"))
    resave(stray, _masters(lambda t: t.add_(1000.0)))
    message = refused([str(src)], tmp_path / "out", str(stray), own.name, "two files for one")
    assert "rank 1's optimizer file" in message, message


@pytest.mark.parametrize(
    "name",
    [
        "zero_pp_rank_01_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_0_optim_states.pt",
        "zero_pp_rank_\u0661_mp_rank_00_optim_states.pt",  # an Arabic-Indic 1: int() reads it
    ],
)
def test_a_rank_file_not_named_as_deepspeed_names_it_is_refused(name, tmp_path):
    """Rank 1's file under a name DeepSpeed never writes, its own name gone: refused naming it
    and the name DeepSpeed gives it (before: read as rank 1's, exit 0)."""
    src, tag = _source(tmp_path)
    (tag / deepspeed_files.rank_file(1)).rename(tag / name)
    message = refused([str(src)], tmp_path / "out", str(tag / name))
    assert f"({deepspeed_files.rank_file(1)})" in message, message


def test_nan_momentum_the_same_on_both_ranks_is_read(tmp_path):
    """Both ranks hold the whole momentum of a matrix, NaN on both (before: 'differs between
    rank 0 and rank 1'); the copies are compared bit for bit, and NaN is carried."""
    src, tag = _source(tmp_path)

    def poison(top: dict[str, Any]) -> None:
        _optim(top)["base_optimizer_state"]["state"][0]["momentum_buffer"].fill_(math.nan)

    for rank in (0, 1):
        resave(tag / deepspeed_files.rank_file(rank), poison)
    _converts(src, tmp_path / "out")
    momentum = load_file(tmp_path / "out" / "optimizer.safetensors")[
        f"state.{MOMENTUM}.momentum_buffer"
    ]
    assert momentum.isnan().all()


def test_momentum_that_differs_between_ranks_is_still_refused(tmp_path):
    """The bitwise comparison still refuses copies that differ (rank 1's all one more)."""
    src, tag = _source(tmp_path)
    rank1 = tag / deepspeed_files.rank_file(1)
    resave(
        rank1,
        lambda top: _optim(top)["base_optimizer_state"]["state"][0]["momentum_buffer"].add_(1.0),
    )
    refused([str(src)], tmp_path / "out", str(rank1), "differs between rank 0 and rank 1")


def test_a_latest_fifo_is_named(tmp_path):
    """``latest`` a FIFO (before: not taken as DeepSpeed, a usage error about --to); refused
    naming it without blocking on it."""
    src, _ = _source(tmp_path)
    (src / deepspeed_files.LATEST).unlink()
    os.mkfifo(src / deepspeed_files.LATEST)
    refused([str(src)], tmp_path / "out", str(src / deepspeed_files.LATEST), "not a regular file")


def test_a_missing_rank_0_file_is_named(tmp_path):
    """Rank 0's optimizer file gone, rank 1's and the model states there (before: a usage
    error about --to)."""
    src, tag = _source(tmp_path)
    (tag / deepspeed_files.rank_file(0)).unlink()
    rank0 = tag / deepspeed_files.rank_file(0)
    refused([str(src)], tmp_path / "out", str(rank0), "rank 0's optimizer file is missing")


def test_an_int64_step_tensor_is_read_as_that_int(tmp_path):
    """AdamW's step saved as ``tensor(3)`` (int64) on both ranks: read as the int 3 of an I64
    tensor (before: turned into 3.0 and refused at the read-back, blaming the output); it
    loads into torch's Muon and AdamW, and steps."""
    src, tag = _source(tmp_path)

    def int_step(top: dict[str, Any]) -> None:
        _optim(top)["base_optimizer_state"]["state"][1]["step"] = torch.tensor(3)

    for rank in (0, 1):
        resave(tag / deepspeed_files.rank_file(rank), int_step)
    out = tmp_path / "out"
    _converts(src, out)
    manifest = muonckpt.read_manifest(out)
    adam = manifest.groups[1]
    steps = {manifest.step_of(e) for e in manifest.params if e.name in adam.params}
    assert steps == {3} and all(type(s) is int for s in steps), steps
    params = {e.name: torch.nn.Parameter(torch.zeros(e.shape)) for e in manifest.params}
    muon = manifest.groups[0]
    opts = [
        torch.optim.Muon([(n, params[n]) for n in muon.params], momentum=0.95, nesterov=True),
        torch.optim.AdamW([(n, params[n]) for n in adam.params], lr=1e-3),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        muonckpt.load(opts, out)
    first = params[adam.params[0]]
    step = opts[1].state[first]["step"]
    assert float(step) == 3, step  # (as torch's AdamW keeps it)
    for p in params.values():
        p.grad = torch.ones_like(p)
    opts[1].step()
    assert int(opts[1].state[first]["step"]) == 4 and first.isfinite().all()
