"""A tiny two-group model trained with the packaged Muon at any dp x tp (run inside gloo children).

Full params and grads are generated identically on every rank, so a run at any topology is
comparable, bit for bit, with a single-process run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from seed_port import make_groups

from muonckpt import Muon
from muonckpt.layout import Topology
from muonckpt.regions import extract, insert_
from muonckpt.sharding import shard_param_groups

MUON_PARAMS = {"w_in": (12, 20), "w_out": (16, 12), "w_mid": (10, 14)}
ADAMW_PARAMS = {"bias": (7,), "norm": (16,), "embed": (8, 12)}
TP_SPLIT_DIMS = {"w_in": 0, "w_out": 1, "norm": 0, "embed": 1}
MUON_HPARAMS = {"use_muon": True, "lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}
ADAMW_HPARAMS = {"lr": 0.01, "weight_decay": 0.01}


def initial_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    shapes = {**MUON_PARAMS, **ADAMW_PARAMS}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def full_grad(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step * 1000 + sum(map(ord, name)))
    return torch.randn(shape, generator=gen)


def groups_of(params: dict[str, torch.Tensor]) -> list[dict]:
    return [
        {"params": [(n, params[n]) for n in MUON_PARAMS], **MUON_HPARAMS},
        {"params": [(n, params[n]) for n in ADAMW_PARAMS], **ADAMW_HPARAMS},
    ]


def build(dp: int, tp: int, params: dict[str, torch.Tensor], bucket_numel: int | None = 150):
    """(optimizer, sharded params, dp_rank, tp_rank) on this rank of a dp x tp grid."""
    if dp * tp == 1:  # the plain single-process optimizer, not a 1 x 1 grid
        opt = Muon(
            [{**g, "params": [(n, t.clone()) for n, t in g["params"]]} for g in groups_of(params)]
        )
        return opt, None, 0, 0
    dp_group, tp_group = make_groups(dp, tp)
    dp_rank, tp_rank = dist.get_rank(dp_group), dist.get_rank(tp_group)
    sharded = shard_param_groups(
        groups_of(params),
        Topology(dp, tp),
        dp_rank,
        tp_rank,
        tp_split_dims=TP_SPLIT_DIMS,
        bucket_numel=bucket_numel,
    )
    opt = Muon(sharded.param_groups)
    opt.enable_distributed_mode(sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas)
    return opt, sharded, dp_rank, tp_rank


def train(opt: Muon, sharded, dp_rank: int, tp_rank: int, first_step: int, steps: int) -> None:
    for step in range(first_step, first_step + steps):
        for group in opt.param_groups:
            for name, p in zip(group["param_names"], group["params"], strict=True):
                grad = full_grad(name, _full_shape(name), step)
                if sharded is not None:
                    region = sharded.layout.region(sharded.index(name), dp_rank, tp_rank)
                    grad = extract(grad, region)
                p.grad = grad.reshape(p.shape)
        opt.step()


def _full_shape(name: str) -> tuple[int, ...]:
    return {**MUON_PARAMS, **ADAMW_PARAMS}[name]


def local_params(opt: Muon) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone()
        for g in opt.param_groups
        for n, p in zip(g["param_names"], g["params"], strict=True)
    }


def assemble(dp: int, tp: int, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full params from every rank's local shards (rank order), by the layout of dp x tp."""
    if dp * tp == 1:
        return shards[0]
    params = initial_params()
    sharded = shard_param_groups(
        groups_of(params), Topology(dp, tp), 0, 0, tp_split_dims=TP_SPLIT_DIMS, bucket_numel=150
    )
    full = {name: torch.empty_like(t) for name, t in params.items()}
    for rank, shard in enumerate(shards):
        d, t = Topology(dp, tp).coords(rank)
        for name, piece in shard.items():
            insert_(full[name], sharded.layout.region(sharded.index(name), d, t), piece)
    return full


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
