"""Declared shapes before allocation (issue 50, finding 3's second half and finding 4): a
stacked param declared empty, (1000000, 0, 16) with ``--split-experts`` or Megatron's stacked
layers of (N, 0, 0), is refused at once naming the param, never split into a million empty
params; DeepSpeed's ``param_shapes`` claiming 16384 x 16384 is refused on the rank files'
sizes before its 1 GiB is allocated."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from muonckpt.interop.deepspeed import files as deepspeed_files

from .hostile_files import DEEPSPEED, MCORE, PEAK_RSS, TITAN, refused, rewrite_dcp


def test_an_empty_stacked_expert_is_refused_naming_it(tmp_path):
    shapes = {
        "layers.0.experts": (1000000, 0, 16),
        "optimizer.state.layers.0.experts.momentum_buffer": (1000000, 0, 16),
    }
    src = rewrite_dcp(TITAN, tmp_path / "titan" / "step-3", shapes)
    args = [str(src), "--from", "torchtitan", "--to", "torch", "--split-experts"]
    refused(args, tmp_path / "out", "'layers.0.experts'", "[1000000, 0, 16]", "no elements")


def test_megatron_stacked_layers_of_no_elements_are_refused_naming_them(tmp_path):
    item = "decoder.layers.self_attention.linear_proj.weight"
    keys = [
        item,
        *(f"chained_0.optimizer.state.{k}.{item}" for k in ("momentum_buffer", "fp32_param")),
    ]
    root = tmp_path / "mcore"
    iteration = rewrite_dcp(
        MCORE / "iter_0000003",
        root / "iter_0000003",
        dict.fromkeys(keys, (100000000, 0, 0)),
        lambda values: values["common_state/shard_0_1"][0].pop("args"),
    )
    shutil.copy(MCORE / "iter_0000003" / "metadata.json", iteration)
    shutil.copy(MCORE / "latest_checkpointed_iteration.txt", root)
    refused([str(root), "--to", "torch"], tmp_path / "out", repr(item), "no elements")


def _claiming(tmp_path: Path, rows: int, cols: int) -> Path:
    """The DeepSpeed fixture, its model states' first param declared ``rows`` x ``cols``."""
    src = Path(shutil.copytree(DEEPSPEED, tmp_path / "src"))
    model_file = src / "global_step3" / deepspeed_files.MODEL_STATES
    model = deepspeed_files.load(model_file)
    name = next(iter(model["param_shapes"][0]))
    model["param_shapes"][0][name] = torch.Size([rows, cols])
    model_file.unlink()
    torch.save(model, model_file)
    return src


def test_deepspeed_param_shapes_past_the_bytes_present_are_refused_before_allocating(tmp_path):
    """16384 x 16384 (1 GiB of fp32) and 2**31 x 2 (an allocator error before) in a file of a
    few KB: refused on the rank files' sizes, the process's peak memory far below the claim."""
    for rows, cols in ((16384, 16384), (2**31, 2)):
        src = _claiming(tmp_path / f"{rows}", rows, cols)
        message = refused([str(src)], tmp_path / f"{rows}" / "out", "param_shapes declares")
        assert deepspeed_files.MODEL_STATES in message


@pytest.mark.dist
def test_deepspeed_s_refusal_of_a_claim_stays_far_below_its_size(tmp_path):
    """The process's peak memory refusing 16384 x 16384 (1 GiB): torch's own, not the claim's."""
    probe = PEAK_RSS + (
        "import sys\n"
        "from muonckpt import CheckpointError, interop\n"
        "try:\n    interop.from_deepspeed(sys.argv[1], sys.argv[2])\n"
        "except CheckpointError:\n    pass\n"
        "print(peak_rss())\n"
    )
    src = _claiming(tmp_path / "rss", 16384, 16384)
    peak = subprocess.run(
        [sys.executable, "-c", probe, str(src), str(tmp_path / "rss" / "out")],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    assert int(peak) < 512 << 20, peak  # torch itself (~230 MiB); the claim is 1 GiB
