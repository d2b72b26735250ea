"""The packaged Muon: distributed (ZeRO-1 + TP, via muonckpt.optim.sharding) vs single-process,
bitwise,
plus its hazards and its errors on bad input.

Distributed workers are module-level functions run by ``run_distributed`` in 8 gloo processes;
they assert on every rank and return how many comparisons they made.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from muonckpt import LayoutError
from muonckpt.distributed.launch import run_distributed
from muonckpt.layout.topology import LayoutOptions, Topology
from muonckpt.optim.muon import Muon, MuonDistMeta
from muonckpt.optim.nsplan import ns_flops
from muonckpt.optim.sharding import (
    ShardedParams,
    shard_for_groups,
    shard_param_groups,
    shard_tensor,
)

from .seed_oracle import OracleGroup, oracle_step
from .seed_port import make_groups

TIMEOUT = 120

MUON_SHAPES = {"w_a": (12, 20), "w_b": (28, 12), "w_c": (20, 12), "w_d": (12, 12)}
ADAMW_SHAPES = {"b_a": (7,), "b_b": (13,), "n_a": (12,), "b_c": (33,), "n_b": (8,)}
TP_SPLIT_DIMS = {"w_a": 0, "w_b": 1, "w_d": 1, "n_a": 0, "n_b": 0}  # w_c, b_*: replicated
MUON_ARGS = {
    "use_muon": True,
    "lr": 0.1,
    "momentum": 0.9,
    "nesterov": True,
    "ns_steps": 5,
    "weight_decay": 0.1,
}
ADAMW_ARGS = {"lr": 0.01, "weight_decay": 0.05, "adamw_betas": (0.9, 0.95)}

# One buffer and bucket, or two buffers (Muon and AdamW params) cut into small buckets with
# aligned params, so buckets start at offsets > 0.
PLAIN = LayoutOptions()
BUCKETED = LayoutOptions(bucket_numel=40, param_alignment=4, buffers_by="group")


def full_groups(seed: int = 0, empty_first: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    groups = [
        {
            "params": [(n, torch.randn(s, generator=gen)) for n, s in MUON_SHAPES.items()],
            **MUON_ARGS,
        },
        {
            "params": [(n, torch.randn(s, generator=gen)) for n, s in ADAMW_SHAPES.items()],
            **ADAMW_ARGS,
        },
    ]
    if empty_first:
        groups.insert(0, {"params": [], **MUON_ARGS})
    return groups


def clone_groups(groups: list[dict]) -> list[dict]:
    return [{**g, "params": [(n, t.clone()) for n, t in g["params"]]} for g in groups]


def layout_kwargs(variant: LayoutOptions) -> dict:
    return dict(tp_split_dims=TP_SPLIT_DIMS, options=variant)


def step_grads(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One step's full grads, in param order (Muon rewrites the group dicts it is given)."""
    return {n: torch.randn(s, generator=gen) for n, s in {**MUON_SHAPES, **ADAMW_SHAPES}.items()}


def named_params(optimizer: Muon) -> dict[str, torch.Tensor]:
    return {
        n: p for g in optimizer.param_groups for n, p in zip(g.get("param_names", []), g["params"])
    }


# --- sharding helper, single process -------------------------------------------------------------


@pytest.mark.parametrize("dp,tp", [(4, 2), (2, 4)])
@pytest.mark.parametrize("variant", [PLAIN, BUCKETED])
def test_layouts_used_below_cut_params_mid_way(dp, tp, variant):
    """The distributed cases are only meaningful if shard edges fall inside params."""
    sharded = shard_param_groups(full_groups(), Topology(dp, tp), 0, 0, **layout_kwargs(variant))
    layout = sharded.layout
    partial = [
        s.name
        for i, s in enumerate(sharded.specs)
        for r in range(dp)
        if 0
        < layout.dp_range(i, r)[1] - layout.dp_range(i, r)[0]
        < math.prod(layout.local_shape(i))
    ]
    assert len(partial) >= 2
    empty = [
        (s.name, r)
        for i, s in enumerate(sharded.specs)
        for r in range(dp)
        if layout.dp_range(i, r) == (0, 0)
    ]
    assert empty  # some rank holds a 0-numel piece of some param
    if variant is BUCKETED:
        assert len(sharded.global_buffer_sizes) == 2
        assert all(len(buffer) >= 2 for buffer in sharded.global_buffer_sizes)
        assert any(offset > 0 for buffer in sharded.global_buffer_sizes for _, offset in buffer)


@pytest.mark.parametrize("variant", [PLAIN, BUCKETED])
def test_shard_param_groups_pieces_cover_every_param(variant):
    groups = full_groups()
    topo = Topology(3, 2)
    shards = [
        [shard_param_groups(groups, topo, d, t, **layout_kwargs(variant)) for t in range(topo.tp)]
        for d in range(topo.dp)
    ]
    first = shards[0][0]
    assert isinstance(first, ShardedParams)
    for g_in, g_out in zip(groups, first.param_groups):
        assert {k: v for k, v in g_in.items() if k != "params"} == {
            k: v for k, v in g_out.items() if k != "params"
        }
        assert [n for n, _ in g_in["params"]] == [n for n, _ in g_out["params"]]
    for g, group in enumerate(groups):
        for k, (name, full) in enumerate(group["params"]):
            split = TP_SPLIT_DIMS.get(name, -1)
            blocks = full.chunk(topo.tp, dim=split) if split >= 0 else [full] * topo.tp
            for t in range(topo.tp):
                pieces = []
                for d in range(topo.dp):
                    sp = shards[d][t]
                    local_name, local = sp.param_groups[g]["params"][k]
                    assert local_name == name
                    assert local.dim() == 1 and local.is_contiguous() and local.is_leaf
                    assert not local.requires_grad and local.dtype == full.dtype
                    assert local.data_ptr() != full.data_ptr() or local.numel() == 0
                    meta = sp.dist_metas[local]
                    assert tuple(meta.shape) == tuple(blocks[t].shape)
                    assert meta.tp_split_dim == split
                    assert torch.equal(local, shard_tensor(full, sp, name, d, t))
                    pieces.append(local)
                assert torch.equal(torch.cat(pieces), blocks[t].reshape(-1))
    # the pieces are independent copies
    name, local = first.param_groups[0]["params"][0]
    before = groups[0]["params"][0][1].clone()
    local.add_(1.0)
    assert torch.equal(groups[0]["params"][0][1], before)


def test_shard_param_groups_bad_input():
    topo = Topology(2, 2)
    with pytest.raises(LayoutError, match=r"'w'.*not divisible by tp=2"):
        shard_param_groups(
            [{"params": [("w", torch.zeros(3, 4))]}], topo, 0, 0, tp_split_dims={"w": 0}
        )
    with pytest.raises(LayoutError, match="#1 of group 0 is not a \\(name, tensor\\) pair"):
        shard_param_groups([{"params": [("w", torch.zeros(2, 4)), torch.zeros(3)]}], topo, 0, 0)
    with pytest.raises(LayoutError, match="'v'"):
        shard_param_groups([{"params": [("v", [1, 2])]}], topo, 0, 0)
    with pytest.raises(LayoutError, match="'typo'"):
        shard_param_groups(
            [{"params": [("w", torch.zeros(2, 4))]}], topo, 0, 0, tp_split_dims={"typo": 0}
        )
    with pytest.raises(LayoutError, match=r"'w'.*tp_split_dim 2"):
        shard_param_groups(
            [{"params": [("w", torch.zeros(2, 4))]}], topo, 0, 0, tp_split_dims={"w": 2}
        )
    with pytest.raises(LayoutError, match="duplicate"):
        shard_param_groups(
            [{"params": [("w", torch.zeros(2))]}, {"params": [("w", torch.zeros(2))]}], topo, 0, 0
        )
    with pytest.raises(LayoutError, match="outside"):
        shard_param_groups([{"params": [("w", torch.zeros(2))]}], topo, 2, 0)
    sharded = shard_param_groups([{"params": [("w", torch.zeros(2, 4))]}], topo, 0, 0)
    with pytest.raises(LayoutError, match=r"'w'.*shape"):
        shard_tensor(torch.zeros(4, 2), sharded, "w", 0, 0)
    with pytest.raises(LayoutError, match="'nope'"):
        shard_tensor(torch.zeros(2, 4), sharded, "nope", 0, 0)


# --- distributed vs single process, bitwise ------------------------------------------------------


def _bitwise_worker(configs, steps):
    rank, checked = dist.get_rank(), 0
    for dp, tp, variant, noncontig_grads in configs:
        dp_group, tp_group = make_groups(dp, tp)
        dp_rank, tp_rank = dist.get_rank(dp_group), dist.get_rank(tp_group)
        ref_groups = full_groups()
        sharded = shard_for_groups(
            clone_groups(ref_groups), dp_group, tp_group, **layout_kwargs(variant)
        )
        assert sharded.layout.topology == Topology(dp, tp)
        ref = Muon(ref_groups)
        test = Muon(sharded.param_groups)
        test.enable_distributed_mode(
            sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas
        )
        ref_params, test_params = named_params(ref), named_params(test)
        assert list(ref_params) == list(test_params) == [s.name for s in sharded.specs]
        gen = torch.Generator().manual_seed(1234)  # same stream on every rank
        for step in range(steps):
            grads = step_grads(gen)
            for name, grad in grads.items():
                ref_params[name].grad = grad.clone()
                local = shard_tensor(grad, sharded, name, dp_rank, tp_rank)
                if noncontig_grads:
                    local = torch.stack([local, torch.full_like(local, 7.0)], dim=1)[:, 0]
                    assert not local.is_contiguous() or local.numel() <= 1
                test_params[name].grad = local
            ref.step()
            test.step()
            for name, p in test_params.items():
                expected = shard_tensor(ref_params[name], sharded, name, dp_rank, tp_rank)
                assert torch.equal(p, expected), (
                    f"rank {rank} dp={dp} tp={tp} {variant} noncontig={noncontig_grads} "
                    f"step {step} param {name}: max diff "
                    f"{(p - expected).abs().max() if p.numel() else 0}"
                )
                checked += 1
        # sanity: the params did move
        assert not torch.equal(ref_params["w_a"], full_groups()[0]["params"][0][1])
    return checked


@pytest.mark.dist
def test_distributed_matches_single_process_bitwise():
    """dp=4 x tp=2 and dp=2 x tp=4; one buffer and bucket with contiguous grads, then two
    buffers of several buckets (non-zero offsets, param_alignment 4) with strided grads.
    One launch for all four cases: starting 8 processes dominates the cost here."""
    configs = [
        (dp, tp, variant, variant is BUCKETED)
        for variant in (PLAIN, BUCKETED)
        for dp, tp in [(4, 2), (2, 4)]
    ]
    checked = run_distributed(_bitwise_worker, 8, configs, 4, timeout=TIMEOUT)
    n_params = len(MUON_SHAPES) + len(ADAMW_SHAPES)
    assert checked == [len(configs) * 4 * n_params] * 8


def _mm_flops(work) -> int:
    """Matrix-multiply FLOPs the profiler counts while ``work()`` runs in this process."""
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        work()
    return sum(e.flops for e in prof.key_averages() if e.key == "aten::mm")


def _one_rank_worker(configs, steps):
    """Per config: the default Muon, the seed's every-holder way and one process, stepped
    together; params compared bitwise after every step; the last step's matrix-multiply FLOPs
    of each, profiled, with the plan's load of this rank."""
    out = []
    for dp, tp in configs:
        dp_group, tp_group = make_groups(dp, tp)
        dp_rank, tp_rank = dist.get_rank(dp_group), dist.get_rank(tp_group)
        ref_groups = full_groups()
        ref = Muon(ref_groups)
        tests = {}
        for mode in ("one_rank", "every_holder"):
            sharded = shard_for_groups(
                clone_groups(ref_groups), dp_group, tp_group, **layout_kwargs(BUCKETED)
            )
            tests[mode] = Muon(sharded.param_groups, orthogonalize=mode)
            tests[mode].enable_distributed_mode(
                sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas
            )
        ref_params = named_params(ref)
        gen = torch.Generator().manual_seed(77)
        flops = {}
        for step in range(steps):
            grads = step_grads(gen)
            for name, grad in grads.items():
                ref_params[name].grad = grad.clone()
                for opt in tests.values():
                    local = shard_tensor(grad, sharded, name, dp_rank, tp_rank)
                    named_params(opt)[name].grad = local
            last = step == steps - 1
            for mode, opt in [("ref", ref), *tests.items()]:
                flops[mode] = _mm_flops(opt.step) if last else opt.step()
            for mode, opt in tests.items():
                for name, p in named_params(opt).items():
                    expected = shard_tensor(ref_params[name], sharded, name, dp_rank, tp_rank)
                    assert torch.equal(p, expected), f"{mode} dp={dp} tp={tp} step {step} {name}"
        _, me, plan, _ = tests["one_rank"]._newton_schulz_plan()
        out.append({**flops, "planned": plan.loads()[me], "largest": max(plan.loads())})
    return out


@pytest.mark.dist
def test_newton_schulz_runs_once_per_matrix_in_the_grid_with_the_same_bits():
    """At 4x2 and 2x4 (two buffers of several buckets): the default runs each matrix's
    Newton-Schulz on exactly one rank, so the grid's matrix-multiply FLOPs are one process's
    and each rank's are what the plan gives it; the seed's every-holder way does more; the
    params of both are bitwise those of one process."""
    configs = [(4, 2), (2, 4)]
    results = run_distributed(_one_rank_worker, 8, configs, 3, timeout=TIMEOUT)
    for c, (dp, tp) in enumerate(configs):
        ranks = [r[c] for r in results]
        single = ranks[0]["ref"]
        assert single > 0 and all(r["ref"] == single for r in ranks)
        assert sum(r["one_rank"] for r in ranks) == single, (dp, tp)
        assert all(r["one_rank"] == r["planned"] for r in ranks)
        assert sum(r["every_holder"] for r in ranks) > single
        # the busiest rank: within the list-scheduling bound of an even split
        largest_matrix = max(ns_flops(s, MUON_ARGS["ns_steps"]) for s in MUON_SHAPES.values())
        assert max(r["one_rank"] for r in ranks) <= single / 8 + largest_matrix


def _oracle_worker(configs, steps):
    """The default Muon at each grid against the seed's math written independently
    (``seed_oracle``), on full tensors in every rank: each rank's shards, bitwise."""
    checked = 0
    for dp, tp in configs:
        dp_group, tp_group = make_groups(dp, tp)
        dp_rank, tp_rank = dist.get_rank(dp_group), dist.get_rank(tp_group)
        groups = full_groups(seed=3)
        oracle = [
            OracleGroup(
                [t.clone() for _, t in g["params"]],
                use_muon=g.get("use_muon", False),
                **{k: v for k, v in g.items() if k not in ("params", "use_muon")},
            )
            for g in groups
        ]
        names = [[n for n, _ in g["params"]] for g in groups]
        full = {n: p for group, o in zip(names, oracle) for n, p in zip(group, o.params)}
        sharded = shard_for_groups(groups, dp_group, tp_group, **layout_kwargs(BUCKETED))
        opt = Muon(sharded.param_groups)
        opt.enable_distributed_mode(
            sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas
        )
        params = named_params(opt)
        gen = torch.Generator().manual_seed(4321)
        for step in range(steps):
            grads = step_grads(gen)
            for name, grad in grads.items():
                params[name].grad = shard_tensor(grad, sharded, name, dp_rank, tp_rank)
            oracle_step(oracle, [[grads[n] for n in group] for group in names])
            opt.step()
            for name, p in params.items():
                expected = shard_tensor(full[name], sharded, name, dp_rank, tp_rank)
                assert torch.equal(p, expected), f"dp={dp} tp={tp} step {step} param {name}"
                checked += 1
    return checked


@pytest.mark.dist
def test_default_muon_matches_an_independent_oracle_of_the_seed_bitwise():
    configs = [(4, 2), (2, 4), (8, 1)]
    checked = run_distributed(_oracle_worker, 8, configs, 3, timeout=TIMEOUT)
    assert checked == [len(configs) * 3 * (len(MUON_SHAPES) + len(ADAMW_SHAPES))] * 8


def test_orthogonalize_must_be_one_of_two():
    with pytest.raises(LayoutError, match="orthogonalize must be 'one_rank' or 'every_holder'"):
        Muon([{"params": [torch.zeros(2, 2)], **MUON_ARGS}], orthogonalize="owner")


# --- hazards -------------------------------------------------------------------------------------


def _none_grad_and_empty_group_worker(dp, tp, steps):
    """Rank 1 leaves some grads None while every other rank passes zeros; an empty first group."""
    dp_group, tp_group = make_groups(dp, tp)
    dp_rank, tp_rank = dist.get_rank(dp_group), dist.get_rank(tp_group)
    optimizers, params = [], []
    for _ in range(2):
        sharded = shard_for_groups(
            full_groups(empty_first=True), dp_group, tp_group, **layout_kwargs(BUCKETED)
        )
        assert sharded.param_groups[0]["params"] == []
        opt = Muon(sharded.param_groups)
        opt.enable_distributed_mode(
            sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas
        )
        optimizers.append(opt)
        params.append(named_params(opt))
    none_names = {"w_a", "w_c", "b_b", "n_a"}
    gen = torch.Generator().manual_seed(99)
    for _ in range(steps):
        grads = step_grads(gen)
        for name, grad in grads.items():
            local = shard_tensor(grad, sharded, name, dp_rank, tp_rank)
            if name in none_names:
                local = torch.zeros_like(local)
            params[0][name].grad = local.clone()
            none_here = name in none_names and dist.get_rank() == 1
            params[1][name].grad = None if none_here else local.clone()
        for opt in optimizers:
            opt.step()
        for name in params[0]:
            assert torch.equal(params[0][name], params[1][name]), name
    return sum(p.numel() for p in params[1].values() if p.numel())


def test_step_closure_returns_loss_and_updates_under_no_grad():
    w = torch.nn.Parameter(torch.randn(12, 20))
    b = torch.nn.Parameter(torch.randn(7))
    opt = Muon([{"params": [("w", w)], **MUON_ARGS}, {"params": [("b", b)], **ADAMW_ARGS}])
    seen = {}

    def closure():
        seen["grad_enabled"] = torch.is_grad_enabled()
        opt.zero_grad()
        loss = (w.sum() * b.sum()) ** 2
        loss.backward()
        return loss

    before = w.detach().clone()
    with torch.enable_grad():
        loss = opt.step(closure)
    assert seen["grad_enabled"] is True
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert w.grad_fn is None and w.is_leaf and w.requires_grad
    assert not torch.equal(w.detach(), before)
    assert opt.step() is None


def test_empty_first_group_single_process_unnamed():
    ref_groups = full_groups()
    groups = [{"params": [], **MUON_ARGS}] + [
        {**g, "params": [t.clone() for _, t in g["params"]]} for g in full_groups()
    ]
    opt, ref = Muon(groups), Muon(ref_groups)
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    opt_params = [p for g in opt.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        grads = list(step_grads(gen).values())
        for params in (ref_params, opt_params):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
        ref.step()
        opt.step()
    for a, b in zip(ref_params, opt_params):
        assert torch.equal(a, b)


def test_empty_first_group_single_process_named():
    groups = full_groups(empty_first=True)
    ref_groups = clone_groups(full_groups())
    opt, ref = Muon(groups), Muon(ref_groups)
    assert opt.param_groups[0]["params"] == []
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        grads = step_grads(gen)
        for optimizer in (opt, ref):
            for name, p in named_params(optimizer).items():
                p.grad = grads[name].clone()
            optimizer.step()
    for name, p in named_params(ref).items():
        assert torch.equal(named_params(opt)[name], p)


def test_none_grad_is_zero_grad_single_process():
    a, b = Muon(clone_groups(full_groups())), Muon(clone_groups(full_groups()))
    pa, pb = named_params(a), named_params(b)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        grads = step_grads(gen)
        for name, grad in grads.items():
            zero = name in ("w_b", "b_a") or step == 1
            pa[name].grad = torch.zeros_like(grad) if zero else grad.clone()
            pb[name].grad = None if zero else grad.clone()
        a.step()
        b.step()
        for name in pa:
            assert torch.equal(pa[name], pb[name]), (step, name)
    # and the zero-grad params did move (weight decay / momentum), so the comparison is not idle
    assert not torch.equal(pa["w_b"], full_groups()[0]["params"][1][1])


def test_noncontiguous_grads_match_contiguous_single_process():
    a, b = Muon(clone_groups(full_groups())), Muon(clone_groups(full_groups()))
    pa, pb = named_params(a), named_params(b)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        grads = step_grads(gen)
        for name, grad in grads.items():
            pa[name].grad = grad.clone()
            if grad.dim() == 2:
                strided = grad.T.contiguous().T
            else:
                strided = torch.stack([grad, torch.zeros_like(grad)], dim=1)[:, 0]
            assert not strided.is_contiguous() and torch.equal(strided, grad)
            pb[name].grad = strided
        a.step()
        b.step()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


# --- clear errors --------------------------------------------------------------------------------


def test_non_2d_param_in_muon_group_single_process():
    opt = Muon(
        [{"params": [("layer.w", torch.randn(4, 4)), ("layer.bias", torch.randn(5))], **MUON_ARGS}]
    )
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    with pytest.raises(LayoutError, match=r"'layer\.bias'.*2-D"):
        opt.step()
    with pytest.raises(ValueError, match="'conv'"):
        Muon([{"params": [("conv", torch.randn(2, 3, 4))], **MUON_ARGS}]).step()


def _errors_worker(dp, tp):
    dp_group, tp_group = make_groups(dp, tp)
    groups = [
        {"params": [("w", torch.randn(4, 6)), ("v", torch.randn(6, 4))], **MUON_ARGS},
        {"params": [("b", torch.randn(5))], **ADAMW_ARGS},
    ]

    def fresh():
        sharded = shard_for_groups(clone_groups(groups), dp_group, tp_group)
        return Muon(sharded.param_groups), sharded

    # a 1-D TP shard shape in a Muon group
    opt, sharded = fresh()
    v = named_params(opt)["v"]
    old = sharded.dist_metas[v]
    sharded.dist_metas[v] = MuonDistMeta(
        old.buffer_idx, old.bucket_idx, (24,), old.global_range, -1
    )
    with pytest.raises(LayoutError, match="'v' in a Muon group must be 2-D"):
        opt.enable_distributed_mode(
            sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas
        )
    # a bucket size not divisible by dp=2
    opt, sharded = fresh()
    ((size, offset),) = sharded.global_buffer_sizes[0]
    with pytest.raises(LayoutError, match=f"size {size + 1} is not divisible by dp={dp}"):
        opt.enable_distributed_mode([[(size + 1, offset)]], dp_group, tp_group, sharded.dist_metas)
    # a param without a MuonDistMeta
    opt, sharded = fresh()
    del sharded.dist_metas[named_params(opt)["b"]]
    with pytest.raises(LayoutError, match="'b' has no MuonDistMeta"):
        opt.enable_distributed_mode(
            sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas
        )
    # the same setup, unmodified, is accepted and steps
    opt, sharded = fresh()
    opt.enable_distributed_mode(sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas)
    for p in named_params(opt).values():
        p.grad = torch.ones_like(p)
    opt.step()
    return True


def _hazards_worker():
    owned = _none_grad_and_empty_group_worker(4, 2, 3)
    return owned, _errors_worker(2, 4)


@pytest.mark.dist
def test_distributed_none_grad_on_one_rank_empty_first_group_and_errors():
    """One rank's grad None vs zeros elsewhere: same result, no hang; an empty first group;
    then enable_distributed_mode's errors (1-D Muon meta, bucket size, missing meta)."""
    results = run_distributed(_hazards_worker, 8, timeout=TIMEOUT)
    assert all(owned > 0 and ok is True for owned, ok in results)
