"""The test suite's own model: two groups of named params, sharded at any dp x tp.

Owned by the tests, independent of ``muonckpt/demo.py`` (the demo may change its model freely).
Every kind of param the layout and the checkpoint code treat differently is here once:

========  ========  ======  ================================================
name      shape     group   TP
========  ========  ======  ================================================
w_in      (16, 20)  Muon    split on dim 0 (rows)
w_out     (12, 24)  Muon    split on dim 1 (columns)
w_mid     (10, 14)  Muon    replicated (and not square, so a swapped shape differs)
bias      (7,)      AdamW   replicated, 1-D, of odd size
norm      (20,)     AdamW   split on dim 0, 1-D
embed     (6, 16)   AdamW   split on dim 1
========  ========  ======  ================================================

Every split dim is divisible by 1, 2 and 4 (the tp sizes the tests run); tp=3 divides only
w_out's (see :func:`split_params_indivisible_by`). ``BUCKET_NUMEL`` makes several buckets of
one ZeRO-1 buffer at every topology the tests use, so params of several buckets, and buckets
some DP ranks hold nothing of, are covered.

Full params and gradients are generated identically on every rank from fixed seeds, so runs at
any topology are comparable element for element. Counts the tests assert (params, state
tensors) are derived here from the tables, never written out by hand.
"""

from __future__ import annotations

import math

import torch

from muonckpt import Muon, collectives
from muonckpt.layout import LayoutOptions, Topology
from muonckpt.regions import extract, insert_
from muonckpt.sharding import ShardedParams, shard_param_groups

MUON_PARAMS: dict[str, tuple[int, ...]] = {"w_in": (16, 20), "w_out": (12, 24), "w_mid": (10, 14)}
ADAMW_PARAMS: dict[str, tuple[int, ...]] = {"bias": (7,), "norm": (20,), "embed": (6, 16)}
SHAPES: dict[str, tuple[int, ...]] = {**MUON_PARAMS, **ADAMW_PARAMS}
"""Every param, in the optimizer's order (the Muon group first)."""
TP_SPLIT_DIMS: dict[str, int] = {"w_in": 0, "w_out": 1, "norm": 0, "embed": 1}
"""Params absent here are TP-replicated."""
MUON_HPARAMS = {"use_muon": True, "lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}
ADAMW_HPARAMS = {"lr": 0.01, "weight_decay": 0.01}
BUCKET_NUMEL = 150
LAYOUT = LayoutOptions(bucket_numel=BUCKET_NUMEL)
"""The layout the tests shard at: buckets closed at ``BUCKET_NUMEL`` elements."""

MUON_STATE_KEYS = ("momentum_buffer",)
ADAMW_STATE_KEYS = ("exp_avg", "exp_avg_sq")
STATE_KEYS: dict[str, tuple[str, ...]] = {
    **{name: MUON_STATE_KEYS for name in MUON_PARAMS},
    **{name: ADAMW_STATE_KEYS for name in ADAMW_PARAMS},
}
"""The state tensors the packaged Muon keeps per param after a step."""

PARAM_NAMES: list[str] = list(SHAPES)
N_PARAMS: int = len(SHAPES)
N_GROUPS: int = 2
N_STATE_TENSORS: int = sum(len(keys) for keys in STATE_KEYS.values())
"""State tensors in a checkpoint (params not counted)."""


def numel(name: str) -> int:
    return math.prod(SHAPES[name])


def shape_text(name: str) -> str:
    """A shape as ``muonckpt inspect`` prints it: ``16x20``."""
    return "x".join(map(str, SHAPES[name]))


def split_params_indivisible_by(tp: int) -> list[str]:
    """Names of the TP-split params whose split dim ``tp`` does not divide, in order."""
    return [n for n, d in TP_SPLIT_DIMS.items() if SHAPES[n][d] % tp]


def initial_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2468)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def full_grad(name: str, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step * 1000 + sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=gen)


def param_groups(params: dict[str, torch.Tensor]) -> list[dict]:
    """The two groups, as ``(name, tensor)`` pairs, with their hyperparameters."""
    return [
        {"params": [(n, params[n]) for n in MUON_PARAMS], **MUON_HPARAMS},
        {"params": [(n, params[n]) for n in ADAMW_PARAMS], **ADAMW_HPARAMS},
    ]


def shard(params: dict[str, torch.Tensor], dp: int, tp: int, d: int, t: int) -> ShardedParams:
    return shard_param_groups(
        param_groups(params),
        Topology(dp, tp),
        d,
        t,
        tp_split_dims=TP_SPLIT_DIMS,
        options=LAYOUT,
    )


def build(dp: int, tp: int, params: dict[str, torch.Tensor]):
    """(optimizer, sharded params or None, dp_rank, tp_rank); 1 x 1 is the plain optimizer.

    At 1 x 1 no process group is needed; otherwise call it in a gloo child of dp * tp ranks.
    """
    if dp * tp == 1:
        groups = [
            {**g, "params": [(n, p.clone()) for n, p in g["params"]]} for g in param_groups(params)
        ]
        return Muon(groups), None, 0, 0
    dp_group, tp_group = collectives.grid_groups(dp, tp)
    d, t = collectives.group_rank(dp_group), collectives.group_rank(tp_group)
    sharded = shard(params, dp, tp, d, t)
    opt = Muon(sharded.param_groups)
    opt.enable_distributed_mode(sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas)
    return opt, sharded, d, t


def train(opt: Muon, sharded, d: int, t: int, first: int, steps: int) -> None:
    """Steps ``first .. first+steps-1`` with each rank's cut of the same full gradients."""
    for step in range(first, first + steps):
        for group in opt.param_groups:
            for name, p in zip(group["param_names"], group["params"], strict=True):
                grad = full_grad(name, step)
                if sharded is not None:
                    grad = extract(grad, sharded.layout.region(sharded.index(name), d, t))
                p.grad = grad.reshape(p.shape)
        opt.step()


def local_params(opt: Muon) -> dict[str, torch.Tensor]:
    """This rank's params by name (copies)."""
    return {
        n: p.detach().clone()
        for g in opt.param_groups
        for n, p in zip(g["param_names"], g["params"], strict=True)
    }


def assemble(dp: int, tp: int, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full params from every rank's local shards (rank order)."""
    if dp * tp == 1:
        return shards[0]
    sharded = shard(initial_params(), dp, tp, 0, 0)
    full = {name: torch.full(shape, float("nan")) for name, shape in SHAPES.items()}
    for rank, piece_of in enumerate(shards):
        d, t = Topology(dp, tp).coords(rank)
        for name, piece in piece_of.items():
            insert_(full[name], sharded.layout.region(sharded.index(name), d, t), piece)
    return full


def single_process_optimizer(steps: int) -> Muon:
    """The plain (1 x 1) optimizer after ``steps`` steps; no process group needed."""
    opt, sharded, d, t = build(1, 1, initial_params())
    train(opt, sharded, d, t, 0, steps)
    return opt
