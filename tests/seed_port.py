"""The seed's own distributed test (shared/reference/seed_test_readable.py), ported.

Only its import is changed, to muonckpt, and its process launch replaced by the test harness;
``gen_param_and_grads`` takes the shapes and step count so the suite can also run it smaller.
"""

import torch
import torch.distributed as dist

from muonckpt.optim.muon import Muon, MuonDistMeta, normalize_range

SEED_SHAPES = [(100, 100), (124, 324), (456, 124), (676, 876), (128, 128)]
SEED_TP_DIMS = [0, 1, -1, 1, 0]


def cdiv(x: int, y: int):
    return (x + y - 1) // y


def gen_param_and_grads(shapes=SEED_SHAPES, steps=10):
    torch.manual_seed(0)
    params = [torch.randn(shape, device="cpu", dtype=torch.float32) for shape in shapes]
    grads = [[torch.randn_like(param) for param in params] for _ in range(steps)]
    return params, grads


def distribute_params(params, grads, tp_dims, dist_group, tp_group):
    """shard params for dist & tp, keep only own part"""
    params = params.copy()
    grads = [step_grads.copy() for step_grads in grads]
    tp_size = dist.get_world_size(tp_group)
    tp_rank = dist.get_rank(tp_group)
    for i, param in enumerate(params):
        tp_dim = tp_dims[i]
        if tp_dim == -1:
            continue
        assert param.shape[tp_dim] % tp_size == 0
        local_range_start = param.shape[tp_dim] // tp_size * tp_rank
        local_range_end = param.shape[tp_dim] // tp_size * (tp_rank + 1)
        params[i] = (
            param[local_range_start:local_range_end, :]
            if tp_dim == 0
            else param[:, local_range_start:local_range_end].contiguous()
        )
        for step_grads in grads:
            step_grads[i] = (
                step_grads[i][local_range_start:local_range_end, :]
                if tp_dim == 0
                else step_grads[i][:, local_range_start:local_range_end].contiguous()
            )
    world_size = dist.get_world_size(dist_group)
    rank = dist.get_rank(dist_group)
    global_buffer_size = sum(param.numel() for param in params)
    local_buffer_size = cdiv(global_buffer_size, world_size)
    local_buffer_range = (local_buffer_size * rank, local_buffer_size * (rank + 1))
    global_buffer_size = local_buffer_size * world_size
    numel_acc = 0
    dist_params = []
    dist_grads = [[] for _ in grads]
    dist_metas = {}
    for i, param in enumerate(params):
        numel = param.numel()
        dist_meta = MuonDistMeta(0, 0, param.shape, (numel_acc, numel_acc + numel), tp_dims[i])
        dist_meta.set_local_buffer_range(local_buffer_range)
        numel_acc += numel
        if dist_meta.local_range[0] == dist_meta.local_range[1]:
            continue
        local_range = normalize_range(dist_meta.local_range, dist_meta.global_range[0])
        dist_param = param.view(-1)[local_range[0] : local_range[1]]
        dist_params.append(dist_param)
        dist_metas[dist_param] = dist_meta
        for step, step_grads in enumerate(grads):
            dist_grad = step_grads[i].view(-1)[local_range[0] : local_range[1]]
            dist_grads[step].append(dist_grad)
    return dist_params, dist_grads, global_buffer_size, dist_metas


def make_groups(dp_size, tp_size):
    """The seed's group construction: DP groups stride tp, TP groups are consecutive ranks."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    assert dp_size * tp_size == world_size
    dist_group = tp_group = None
    for i in range(tp_size):
        ranks = list(range(i, world_size, tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            dist_group = group
    for i in range(dp_size):
        ranks = list(range(i * tp_size, (i + 1) * tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    return dist_group, tp_group


def test_muon_dist(dp_size, tp_size, shapes=SEED_SHAPES, tp_dims=SEED_TP_DIMS, steps=10):
    """Returns the number of (step, param) comparisons that passed on this rank."""
    rank = dist.get_rank()
    dist_group, tp_group = make_groups(dp_size, tp_size)
    params_ref, grads_ref = gen_param_and_grads(shapes, steps)
    params_test, grads_test = gen_param_and_grads(shapes, steps)
    params_test, grads_test, global_buffer_size, dist_metas = distribute_params(
        params_test, grads_test, tp_dims, dist_group, tp_group
    )
    muon_args = {
        "use_muon": True,
        "lr": 0.1,
        "momentum": 0.9,
        "nesterov": True,
        "ns_steps": 5,
        "weight_decay": 0.1,
    }
    ref_muon = Muon([{"params": params_ref, **muon_args}])
    test_muon = Muon([{"params": params_test, **muon_args}])
    test_muon.enable_distributed_mode([[(global_buffer_size, 0)]], dist_group, tp_group, dist_metas)
    checked = 0
    for step in range(steps):
        for i, grad in enumerate(grads_ref[step]):
            params_ref[i].grad = grad.clone()
        for i, grad in enumerate(grads_test[step]):
            params_test[i].grad = grad.clone()
        ref_muon.step()
        test_muon.step()
        dist_ref_params, _, _, _ = distribute_params(params_ref, [], tp_dims, dist_group, tp_group)
        assert len(dist_ref_params) == len(params_test)
        for i, (ref, test) in enumerate(zip(dist_ref_params, params_test)):
            assert (ref == test).all(), f"rank {rank} param {i} step {step} verify failed"
            checked += 1
    return checked


def run_seed_test(topologies, shapes=SEED_SHAPES, steps=10):
    return sum(test_muon_dist(dp, tp, shapes, SEED_TP_DIMS, steps) for dp, tp in topologies)
