"""One distributed load reads one checkpoint (issue 20): ranks that opened different
checkpoints, or one path replaced between their reads, fail together and change nothing."""

from __future__ import annotations

import pytest

from muonckpt.distributed.launch import run_distributed

from .ckpt_cases import save_phase
from .load_cases import mixed_load_phase

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("how", ["paths", "replaced"])
def test_ranks_of_one_load_read_one_checkpoint_or_none(tmp_path, how):
    first, second = tmp_path / "a", tmp_path / "b"
    run_distributed(save_phase, 2, 2, 1, 1, str(first), False, timeout=120)
    run_distributed(save_phase, 2, 2, 1, 2, str(second), False, timeout=120)
    ranks = run_distributed(mixed_load_phase, 2, str(first), str(second), how, timeout=120)
    errors = [r["error"] for r in ranks]
    assert errors[0] == errors[1], errors
    expected = (
        "load (rendezvous): the ranks disagree on path: "
        if how == "paths"
        else "load (open): the ranks of one load disagree on manifest: "
    )
    assert errors[0].startswith(expected), errors
    assert all(r["kept"] for r in ranks)  # neither optimizer took anything


def test_a_read_that_fails_on_one_rank_changes_no_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_distributed(save_phase, 2, 2, 1, 1, str(ckpt), False, timeout=120)
    data = ckpt / "rank-00001-of-00002.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # the last byte of rank 1's data: only rank 1 reads it at 2x1
    data.write_bytes(bytes(raw))
    ranks = run_distributed(mixed_load_phase, 2, str(ckpt), "", "damaged", timeout=120)
    errors = [r["error"] for r in ranks]
    assert errors[0] == errors[1] and errors[0].startswith("load (read): rank 1: "), errors
    assert "checksum" in errors[0]
    assert all(r["kept"] for r in ranks)  # rank 0 read its share fine, and took none of it


def test_ranks_that_map_names_differently_fail_together(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_distributed(save_phase, 2, 2, 1, 1, str(ckpt), False, timeout=120)
    ranks = run_distributed(mixed_load_phase, 2, str(ckpt), "", "rename", timeout=120)
    errors = [r["error"] for r in ranks]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("load (rendezvous): the ranks disagree on rename: "), errors
    assert all(r["kept"] for r in ranks)
