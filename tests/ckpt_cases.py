"""Checkpoint save/load phases run inside gloo children (built on resume_cases' tiny model)."""

from __future__ import annotations

import torch
from resume_cases import build, initial_params, local_params, train

import muonckpt


def save_phase(
    dp: int, tp: int, steps: int, ckpt: str, consolidated: bool, params_path: str | None
) -> dict[str, torch.Tensor]:
    opt, sharded, dp_rank, tp_rank = build(dp, tp, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, steps)
    muonckpt.save(opt, ckpt, consolidated=consolidated)
    return local_params(opt)


def load_phase(
    dp: int, tp: int, params_path: str, ckpt: str, first_step: int, steps: int
) -> dict[str, torch.Tensor]:
    opt, sharded, dp_rank, tp_rank = build(dp, tp, torch.load(params_path, weights_only=True))
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
