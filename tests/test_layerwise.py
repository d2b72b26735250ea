"""Megatron-Core's layer-wise layout: each TP shard of each matrix owned whole by one DP rank.

The optimizer below is written the way Megatron-Core's LayerWiseDistributedOptimizer runs
Muon: every rank holds its TP shard of every param; params are given to DP ranks by a balanced
rule (largest first, to the least loaded rank); the owning DP row all-gathers its momentum over
TP for Newton-Schulz, updates its shards, and broadcasts them over DP. muonckpt is told the
layout through ``install_hooks(owner=..., group=dp_group, tp_group=..., tp_split_dims=...)``.
Saved at 2 x 2, resumed from zeros at 4 x 1, 1 x 4, 2 x 2 and in one process: bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import muonckpt
import muonckpt.offline
from muonckpt.distributed.launch import run_distributed

SHAPES = {"attn.qkv": (12, 8), "attn.out": (8, 12), "mlp.up": (16, 8), "mlp.down": (8, 16)}
SPLITS = {"attn.qkv": 0, "attn.out": 1, "mlp.up": 0}
"""mlp.down stays unsplit (TP-replicated)."""
K, M = 3, 2


def balanced_owners(numels: list[int], dp: int) -> list[int]:
    """Largest first, each to the DP rank with the least work so far (ties: lowest rank)."""
    load, owners = [0] * dp, [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        owners[index] = min(range(dp), key=lambda r: (load[r], r))
        load[owners[index]] += numels[index]
    return owners


class LayerWiseMuon(torch.optim.Optimizer):
    """Muon over TP shards, each param's update done by its owner DP row, then broadcast."""

    def __init__(self, named_shards, dp_group=None, tp_group=None, lr=0.05, momentum=0.9):
        super().__init__([{"params": list(named_shards)}], dict(lr=lr, momentum=momentum))
        self.dp_group, self.tp_group = dp_group, tp_group
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        params = self.param_groups[0]["params"]
        self.owners = balanced_owners([p.numel() for p in params], self.dp)

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        dp_rank = dist.get_rank(self.dp_group) if self.dp_group is not None else 0
        for name, p, owner in zip(group["param_names"], group["params"], self.owners):
            split = SPLITS.get(name, -1) if self.tp > 1 else -1
            if owner == dp_rank:
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                full = buf
                if split >= 0:
                    parts = [torch.empty_like(buf) for _ in range(self.tp)]
                    dist.all_gather(parts, buf, group=self.tp_group)
                    full = torch.cat(parts, dim=split)
                update = muonckpt.optim.muon.newton_schulz(full.bfloat16(), steps=5)
                if split >= 0:
                    update = update.chunk(self.tp, dim=split)[dist.get_rank(self.tp_group)]
                p.add_(update.to(p.dtype), alpha=-group["lr"])
            if self.dp > 1:
                src = dist.get_process_group_ranks(self.dp_group)[owner]
                dist.broadcast(p, src=src, group=self.dp_group)


def full_grad(name: str, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step * 1000 + sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=gen)


def initial(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=gen)


def tp_shard(full: torch.Tensor, name: str, tp: int, tp_rank: int) -> torch.Tensor:
    split = SPLITS.get(name, -1)
    return full if split < 0 or tp == 1 else full.chunk(tp, dim=split)[tp_rank].clone()


def build(dp: int, tp: int, zeros: bool):
    groups = muonckpt.distributed.grid_groups(dp, tp) if dp * tp > 1 else (None, None)
    dp_group, tp_group = groups
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    shards = {
        n: torch.nn.Parameter(tp_shard(torch.zeros(s) if zeros else initial(n), n, tp, tp_rank))
        for n, s in SHAPES.items()
    }
    opt = LayerWiseMuon(shards.items(), dp_group, tp_group)
    muonckpt.install_hooks(
        opt,
        owner=lambda index, p: opt.owners[index],
        group=dp_group,
        tp_group=tp_group,
        tp_split_dims=SPLITS,
    )
    return opt, shards, tp, tp_rank


def train(opt, shards, tp, tp_rank, first, steps):
    for step in range(first, first + steps):
        for name, p in shards.items():
            p.grad = tp_shard(full_grad(name, step), name, tp, tp_rank)
        opt.step()


def save_phase(dp, tp, root):
    opt, shards, tp, tp_rank = build(dp, tp, zeros=False)
    train(opt, shards, tp, tp_rank, 0, K)
    muonckpt.save(opt, f"{root}/per-rank")
    muonckpt.save(opt, f"{root}/consolidated", consolidated=True)
    return opt.owners


def resume_phase(dp, tp, ckpt):
    """From zeros: the full params after M more steps, as this rank sees them."""
    opt, shards, tp, tp_rank = build(dp, tp, zeros=True)
    muonckpt.load(opt, ckpt)
    train(opt, shards, tp, tp_rank, K, M)
    full = {}
    for name, p in shards.items():
        split = SPLITS.get(name, -1)
        if split >= 0 and tp > 1:
            parts = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(parts, p.detach(), group=opt.tp_group)
            full[name] = torch.cat(parts, dim=split)
        else:
            full[name] = p.detach().clone()
    return full


def reference(steps: int) -> dict[str, torch.Tensor]:
    opt, shards, tp, tp_rank = build(1, 1, zeros=False)
    train(opt, shards, tp, tp_rank, 0, steps)
    return {n: p.detach().clone() for n, p in shards.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("layerwise")
    owners = run_distributed(save_phase, 4, 2, 2, str(root), timeout=120)
    return root, owners


@pytest.mark.dist
def test_layout_gives_whole_shards_to_different_dp_ranks(saved):
    root, owners = saved
    assert set(owners[0]) == {0, 1}  # the work is spread, each shard whole on one DP rank
    manifest = muonckpt.read_manifest(root / "per-rank")
    assert manifest.topology == {"dp": 2, "tp": 2}
    for piece in manifest.pieces:
        whole_block = piece.region.stop - piece.region.start
        assert piece.region.start == 0 and whole_block * (2 if piece.param in SPLITS else 1) == (
            manifest.param(piece.param).numel
        )


@pytest.mark.dist
@pytest.mark.parametrize("dp,tp", [(4, 1), (1, 4), (2, 2), (1, 1)])
@pytest.mark.parametrize("ckpt", ["per-rank", "consolidated"])
def test_resume_across_dp_and_tp_is_bitwise(saved, dp, tp, ckpt):
    root, _ = saved
    assert muonckpt.verify(root / ckpt) == []
    expected = reference(K + M)
    if dp * tp == 1:
        results = [resume_phase(1, 1, str(root / ckpt))]
    else:
        results = run_distributed(resume_phase, dp * tp, dp, tp, str(root / ckpt), timeout=120)
    for full in results:
        for name, value in expected.items():
            assert torch.equal(full[name], value), name


@pytest.mark.dist
def test_offline_reshard_of_a_layerwise_checkpoint_loads(saved, tmp_path):
    root, _ = saved
    out = muonckpt.offline.reshard(root / "per-rank", tmp_path / "r", dp=1, tp=4)
    assert muonckpt.verify(out) == []
    expected = reference(K + M)
    for full in run_distributed(resume_phase, 4, 1, 4, str(out), timeout=120):
        for name, value in expected.items():
            assert torch.equal(full[name], value), name


def test_a_split_dim_for_an_unknown_param_is_refused():
    """A misspelled name would leave a split param looking TP-replicated: every TP rank would
    then load TP rank 0's shard."""
    shards = {n: torch.nn.Parameter(initial(n)) for n in SHAPES}
    opt = LayerWiseMuon(shards.items())
    with pytest.raises(muonckpt.StateDictError, match=r"\['attn\.QKV'\]"):
        muonckpt.install_hooks(opt, owner=lambda i, p: 0, tp_split_dims={"attn.QKV": 0})
