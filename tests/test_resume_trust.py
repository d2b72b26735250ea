"""Trust at resume (issue 54): the field failures where a resume silently restored the wrong
state, each reproduced and shown caught by muonckpt (a load's check, its environment warning)
or flagged by ``muonckpt doctor``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import muonckpt
from muonckpt.errors import EnvironmentWarning
from muonckpt.format.manifest import ENVIRONMENT_KEYS


def _adamw(steps: int = 1) -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.arange(12.0).reshape(4, 3))
    opt = torch.optim.AdamW([p], lr=0.1)
    for _ in range(steps):
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    return opt


def test_the_manifest_records_the_environment_and_a_load_under_another_warns_once(
    tmp_path, monkeypatch
):
    """The thread-count trap: a resume is bitwise only under the save's intra-op thread count
    (a one-process torchrun leaves OMP_NUM_THREADS unset); the load says what differs."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        path = muonckpt.save(_adamw(), tmp_path / "ckpt")
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((path / "manifest.json").read_text())
    assert saved["format_version"] == 5
    assert list(saved["environment"]) == list(ENVIRONMENT_KEYS)
    assert saved["environment"]["intra_op_threads"] == 1
    assert saved["environment"]["torch"] == torch.__version__
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(2)
    try:
        with pytest.warns(EnvironmentWarning) as said:
            report = muonckpt.load(_adamw(), path)
    finally:
        torch.set_num_threads(threads)
    assert len(said) == 1
    message = str(said[0].message)
    assert "intra_op_threads 1 -> 2" in message and "OMP_NUM_THREADS '1' -> None" in message
    assert report.environment == ["intra_op_threads 1 -> 2", "OMP_NUM_THREADS '1' -> None"]
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", EnvironmentWarning)
            assert muonckpt.load(_adamw(), path).environment == []
    finally:
        torch.set_num_threads(threads)
