"""Resume phases run inside gloo children, on the suite's fixture model.

The model, its deterministic full gradients and the per-topology build come from
:mod:`tests.fixture_model`, so every run at any topology is comparable bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .fixture_model import build, initial_params, local_params, train


def phase(
    dp: int,
    tp: int,
    params_path: str | None,
    state_path: str | None,
    first_step: int,
    steps: int,
    save_to: str | None,
) -> dict[str, torch.Tensor]:
    """Build at dp x tp, optionally resume from files, train, optionally save the state dict."""
    params = initial_params()
    if params_path is not None:
        params = torch.load(params_path, weights_only=True)
    opt, sharded, dp_rank, tp_rank = build(dp, tp, params)
    if state_path is not None:
        opt.load_state_dict(torch.load(state_path, weights_only=True))
    train(opt, sharded, dp_rank, tp_rank, first_step, steps)
    if save_to is not None:
        sd = opt.state_dict()
        if dist.get_rank() == 0:
            torch.save(sd, save_to)
    return local_params(opt)
