"""The packaged Muon against an independent oracle of the seed's math (tests/seed_oracle.py),
bit for bit: in one process with a Muon and an AdamW group, and distributed at 2x2 and 4x2 with
the seed's own ``distribute_params``, after every step.

tests/test_seed.py compares the distributed packaged Muon with the single-process packaged Muon;
this compares both with math that does not come from the package.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from muonckpt.distributed.launch import run_distributed
from muonckpt.optim.muon import Muon

from .seed_oracle import OracleGroup, oracle_step
from .seed_port import SEED_TP_DIMS, distribute_params, gen_param_and_grads, make_groups
from .test_seed import SMALL_SHAPES

STEPS = 4
MUON = {"lr": 0.1, "momentum": 0.9, "nesterov": True, "ns_steps": 5, "weight_decay": 0.1}
ADAMW = {"lr": 0.01, "weight_decay": 0.05, "adamw_betas": (0.9, 0.99), "adamw_eps": 1e-8}


def _tensors(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def test_single_process_matches_the_oracle_bitwise():
    matrices = _tensors([(12, 20), (24, 8), (16, 16)], 1)
    others = _tensors([(16,), (5, 3), (7,)], 2)
    packaged = Muon(
        [
            {"params": [t.clone() for t in matrices], "use_muon": True, **MUON},
            {"params": [t.clone() for t in others], "use_muon": False, **ADAMW},
        ]
    )
    oracle = [
        OracleGroup([t.clone() for t in matrices], use_muon=True, **MUON),
        OracleGroup([t.clone() for t in others], use_muon=False, **ADAMW),
    ]
    for step in range(STEPS):
        grads = [_tensors([tuple(p.shape) for p in g.params], 100 + 10 * step + i)
                 for i, g in enumerate(oracle)]  # fmt: skip
        for group, group_grads in zip(packaged.param_groups, grads, strict=True):
            for p, g in zip(group["params"], group_grads, strict=True):
                p.grad = g.clone()
        packaged.step()
        oracle_step(oracle, grads)
        for ours, theirs in zip(packaged.param_groups, oracle, strict=True):
            for i, (p, q) in enumerate(zip(ours["params"], theirs.params, strict=True)):
                assert torch.equal(p, q), f"step {step}, muon={theirs.use_muon}, param {i}"


def distributed_against_oracle(dp: int, tp: int) -> int:
    """(in dp x tp gloo ranks) The seed's test with the oracle as the reference: each rank's
    ZeRO-1 slices of its TP shards equal the oracle's full params, sliced the same way."""
    dist_group, tp_group = make_groups(dp, tp)
    full, grads = gen_param_and_grads(SMALL_SHAPES, STEPS)
    local, local_grads, buffer_size, metas = distribute_params(
        [t.clone() for t in full], grads, SEED_TP_DIMS, dist_group, tp_group
    )
    packaged = Muon([{"params": local, "use_muon": True, **MUON}])
    packaged.enable_distributed_mode([[(buffer_size, 0)]], dist_group, tp_group, metas)
    oracle = [OracleGroup(full, use_muon=True, **MUON)]
    checked = 0
    for step in range(STEPS):
        for p, g in zip(local, local_grads[step], strict=True):
            p.grad = g.clone()
        packaged.step()
        oracle_step(oracle, [grads[step]])
        expected, *_ = distribute_params(oracle[0].params, [], SEED_TP_DIMS, dist_group, tp_group)
        for i, (p, q) in enumerate(zip(local, expected, strict=True)):
            assert torch.equal(p, q), f"rank {dist.get_rank()} slice {i} step {step}"
            checked += 1
    return checked


@pytest.mark.dist
@pytest.mark.parametrize("dp,tp", [(2, 2), (4, 2)])
def test_distributed_matches_the_oracle_bitwise(dp, tp):
    checked = run_distributed(distributed_against_oracle, dp * tp, dp, tp, timeout=180)
    assert all(c > 0 for c in checked)
