"""Checkpoint save/load phases run inside gloo children, on the suite's fixture model."""

from __future__ import annotations

import torch

import muonckpt

from .fixture_model import build, initial_params, local_params, train


def save_phase(
    dp: int, tp: int, steps: int, ckpt: str, consolidated: bool
) -> dict[str, torch.Tensor]:
    opt, sharded, dp_rank, tp_rank = build(dp, tp, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, steps)
    muonckpt.save(opt, ckpt, consolidated=consolidated)
    return local_params(opt)


def load_phase(dp: int, tp: int, ckpt: str, first_step: int, steps: int) -> dict[str, torch.Tensor]:
    """Resume from the checkpoint alone: the optimizer is built from zeros."""
    zeros = {name: torch.zeros_like(value) for name, value in initial_params().items()}
    opt, sharded, dp_rank, tp_rank = build(dp, tp, zeros)
    muonckpt.load(opt, ckpt)
    train(opt, sharded, dp_rank, tp_rank, first_step, steps)
    return local_params(opt)


def overwrite_phase(dp: int, tp: int, ckpt: str) -> int:
    """Save after 1 step, then save over it after 2 steps: per-rank, then consolidated."""
    opt, sharded, dp_rank, tp_rank = build(dp, tp, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 1)
    muonckpt.save(opt, ckpt)
    train(opt, sharded, dp_rank, tp_rank, 1, 1)
    muonckpt.save(opt, ckpt, consolidated=True, overwrite=True)
    return opt.param_groups[0]["step"]
