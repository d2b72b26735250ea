"""A model's weights through ZeRO-1 + TP: grads in, params out, and right on every rank after
a load at another dp x tp, for models replicated on every rank and for TP-sharded models."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

import muonckpt
from muonckpt.distributed.launch import run_distributed
from muonckpt.layout.topology import tp_local_shape

pytestmark = pytest.mark.dist

SHAPES = {"up": (12, 8), "down": (8, 12), "bias": (12,)}
SPLITS = {"up": 0, "down": 1, "bias": 0}


def make_model(seed: int, tp: int = 1, tp_rank: int = 0) -> dict[str, torch.nn.Parameter]:
    """Full params from ``seed``; with tp > 1, this rank's TP shard of each (a TP model)."""
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in SHAPES.items():
        full = torch.randn(shape, generator=gen)
        if tp > 1:
            full = full.chunk(tp, dim=SPLITS[name])[tp_rank].clone()
        params[name] = torch.nn.Parameter(full)
    return params


def build(dp: int, tp: int, tp_local: bool, seed: int):
    dp_group, tp_group = muonckpt.distributed.grid_groups(dp, tp)
    model = make_model(seed, tp if tp_local else 1, dist.get_rank(tp_group))
    sharded = muonckpt.optim.sharding.shard_for_groups(
        [
            {"params": [(n, model[n]) for n in ("up", "down")], "use_muon": True},
            {"params": [("bias", model["bias"])]},
        ],
        dp_group,
        tp_group,
        tp_split_dims=SPLITS,
        tp_local=tp_local,
    )
    opt = muonckpt.optim.muon.Muon(sharded.param_groups, lr=0.05)
    opt.enable_distributed_mode(sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas)
    return model, sharded, opt


def loss_of(model, tp: int, tp_local: bool, tp_group, step: int) -> torch.Tensor:
    """A loss that depends on every element of every param (gathered when TP-local)."""
    gen = torch.Generator().manual_seed(100 + step)
    total = 0.0
    for name, p in model.items():
        full = p
        if tp_local and tp > 1:
            parts = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(parts, p.detach(), group=tp_group)
            parts[dist.get_rank(tp_group)] = p  # keep this rank's part in the graph
            full = torch.cat(parts, dim=SPLITS[name])
        total = (
            total + (full * torch.randn(SHAPES[name], generator=gen)).sum() + full.square().sum()
        )
    return total


def train_and_save(dp, tp, tp_local, ckpt):
    model, sharded, opt = build(dp, tp, tp_local, seed=0)
    for step in range(3):
        for p in model.values():
            p.grad = None
        loss_of(model, tp, tp_local, sharded.tp_group, step).backward()
        sharded.grads_to_optimizer()
        opt.step()
        sharded.params_to_model()
    muonckpt.save(opt, ckpt, consolidated=True)
    return {n: p.detach().clone() for n, p in model.items()}


def load_into_fresh_model(dp, tp, tp_local, ckpt, copy_after=True):
    """A model and optimizer from another seed; after load (and, with ``copy_after``, the
    ``params_to_model`` call scripts made before load made it itself) every rank's model must
    hold the checkpoint's weights (its TP shard of them, for a TP model). Returns the names that
    differ."""
    model, sharded, opt = build(dp, tp, tp_local, seed=7)
    muonckpt.load(opt, ckpt)
    if copy_after:
        sharded.params_to_model()
    tp_rank = dist.get_rank(sharded.tp_group)
    saved = safetensors.torch.load_file(f"{ckpt}/model.safetensors")
    wrong = []
    for name, p in model.items():
        want = saved[name]
        if tp_local and tp > 1:
            want = want.chunk(tp, dim=SPLITS[name])[tp_rank]
        if not torch.equal(p.detach(), want):
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("tp_local", [False, True])
def test_model_weights_equal_the_checkpoint_on_every_rank_after_load(tmp_path, tp_local):
    ckpt = str(tmp_path / "ckpt")
    trained = run_distributed(train_and_save, 4, 2, 2, tp_local, ckpt, timeout=120)
    saved = safetensors.torch.load_file(f"{ckpt}/model.safetensors")
    for name, shape in SHAPES.items():
        assert saved[name].shape == shape
        assert not torch.equal(saved[name], make_model(0)[name].detach())  # it trained
        if not tp_local:  # every rank's replicated model holds the same, saved weights
            assert all(torch.equal(t[name], saved[name]) for t in trained)
        else:
            local = tp_local_shape(name, shape, SPLITS[name], 2)
            assert all(t[name].shape == local for t in trained)
    for dp, tp in ((1, 4), (4, 1)):
        assert (
            run_distributed(load_into_fresh_model, 4, dp, tp, tp_local, ckpt, timeout=120)
            == [[]] * 4
        )


@pytest.mark.parametrize("tp_local", [False, True])
def test_load_gives_the_model_the_checkpoint_weights_by_itself(tmp_path, tp_local):
    """Issue 21 item 3: a forgotten ``sharded.params_to_model()`` after ``load`` used to leave
    the model with its fresh weights (training then drifted, silently)."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train_and_save, 2, 2, 1, tp_local, ckpt, timeout=120)
    loaded = run_distributed(load_into_fresh_model, 2, 1, 2, tp_local, ckpt, False, timeout=120)
    assert loaded == [[]] * 2
