"""State and params in CUDA memory: save, load, state dicts, consolidation, an NCCL group.

The distributed runs save both ways, ``save`` and ``async_save``. Marked ``cuda``: collected
everywhere, skipped where ``torch.cuda.is_available()`` is False (tests/conftest.py). One GPU
is enough: the NCCL group has one rank (every collective path still runs, so a CPU tensor
handed to NCCL would fail there), and the two-process run keeps a gloo group (several NCCL
ranks cannot share one GPU) while its params and state live on the GPU.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import muonckpt
import muonckpt.offline
from muonckpt.distributed import collectives
from muonckpt.distributed.launch import run_distributed

from .fixture_model import (
    LAYOUT,
    TP_SPLIT_DIMS,
    build,
    full_grad,
    initial_params,
    param_groups,
)

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda", 0)
K, M = 3, 2


def zeros() -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(value) for name, value in initial_params().items()}


def on_gpu(params: dict[str, torch.Tensor]) -> muonckpt.optim.muon.Muon:
    """The fixture model's plain (single-process) packaged Muon over ``params`` on the GPU."""
    return muonckpt.optim.muon.Muon(param_groups({name: p.to(CUDA) for name, p in params.items()}))


def distributed_on_gpu(
    params: dict[str, torch.Tensor], dp: int, tp: int
) -> tuple[muonckpt.optim.muon.Muon, muonckpt.optim.sharding.ShardedParams]:
    """The fixture model's distributed packaged Muon at dp x tp, its shards on the GPU."""
    dp_group, tp_group = muonckpt.distributed.grid_groups(dp, tp)
    sharded = muonckpt.optim.sharding.shard_for_groups(
        param_groups({name: p.to(CUDA) for name, p in params.items()}),
        dp_group,
        tp_group,
        tp_split_dims=TP_SPLIT_DIMS,
        options=LAYOUT,
    )
    opt = muonckpt.optim.muon.Muon(sharded.param_groups)
    opt.enable_distributed_mode(sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas)
    return opt, sharded


def train(
    opt: muonckpt.optim.muon.Muon,
    sharded: muonckpt.optim.sharding.ShardedParams | None,
    first: int,
    steps: int,
) -> None:
    """Steps ``first .. first+steps-1``, each grad this rank's cut of the fixture's full grad,
    on the device of its param."""
    for step in range(first, first + steps):
        for group in opt.param_groups:
            for name, p in zip(group["param_names"], group["params"]):
                grad = full_grad(name, step).to(p.device)
                if sharded is not None:
                    grad = sharded.cut(grad, sharded.index(name))
                p.grad = grad.reshape(p.shape)
        opt.step()


def move_to_gpu(opt: torch.optim.Optimizer) -> None:
    """Every param and state tensor of ``opt`` moved to the GPU in place (the same objects)."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.data = p.data.to(CUDA)
            state = opt.state.get(p, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(CUDA)


def assert_same(expected: torch.optim.Optimizer, got: torch.optim.Optimizer, params=True) -> None:
    """Steps, state (and params) bitwise equal, each of ``got``'s state tensors on its param's
    device with its dtype (torch's rules for loaded state)."""
    for want, have in zip(expected.param_groups, got.param_groups):
        assert want["step"] == have["step"]
        for name, p, q in zip(want["param_names"], want["params"], have["params"]):
            assert q.device.type == "cuda", name
            if params:
                assert torch.equal(p, q), name
            state, loaded = expected.state[p], got.state[q]
            assert state.keys() == loaded.keys(), name
            for key, value in state.items():
                assert loaded[key].device == q.device, (name, key, loaded[key].device)
                assert loaded[key].dtype == value.dtype, (name, key)
                assert torch.equal(loaded[key], value), (name, key)


def host_tensors(state_dict: dict[str, Any]) -> list[torch.Tensor]:
    return [v for entry in state_dict["state"].values() for v in entry.values()]


@pytest.fixture(scope="module")
def trained() -> muonckpt.optim.muon.Muon:
    opt = on_gpu(initial_params())
    train(opt, None, 0, K)
    return opt


@pytest.mark.parametrize("consolidated", [False, True], ids=["per-rank", "consolidated"])
def test_save_and_load_round_trip_bitwise(trained, tmp_path, consolidated):
    path = muonckpt.save(trained, tmp_path / "ckpt", consolidated=consolidated)
    fresh = on_gpu(zeros())
    muonckpt.load(fresh, path)
    assert_same(trained, fresh)


def test_a_consolidated_save_holds_the_gpu_values(trained, tmp_path):
    path = muonckpt.save(trained, tmp_path / "ckpt", consolidated=True)
    state = load_file(path / "optimizer.safetensors")
    model = load_file(path / "model.safetensors")
    for group in trained.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            assert torch.equal(model[name], p.cpu()), name
            for key, value in trained.state[p].items():
                assert torch.equal(state[f"state.{name}.{key}"], value.cpu()), (name, key)


def test_state_dict_is_on_the_host_and_loads_onto_the_gpu(trained):
    sd = trained.state_dict()
    assert sd["muonckpt"]["complete"] is True
    assert {t.device.type for t in host_tensors(sd)} == {"cpu"}
    fresh = on_gpu(initial_params())
    fresh.load_state_dict(sd)
    assert_same(trained, fresh, params=False)


def test_offline_consolidate_of_a_gpu_checkpoint_loads_back(trained, tmp_path):
    saved = muonckpt.save(trained, tmp_path / "ckpt")
    full = muonckpt.offline.consolidate(saved, tmp_path / "full")
    fresh = on_gpu(zeros())
    muonckpt.load(fresh, full)
    assert_same(trained, fresh)


def saved(opt: Any, path: Path, consolidated: bool, background: bool) -> Path:
    """``save``, or ``async_save`` and its result (each rank's, which all must agree on)."""
    if background:
        return muonckpt.async_save(opt, path, consolidated=consolidated).result(timeout=120)
    return muonckpt.save(opt, path, consolidated=consolidated)


def nccl_world_of_one(root: str) -> dict[str, str]:
    """(In an NCCL child of world 1.) The distributed packaged Muon on the GPU through
    state_dict, per-rank and consolidated save, load and load_state_dict, then more steps."""
    torch.cuda.set_device(0)
    opt, sharded = distributed_on_gpu(initial_params(), 1, 1)
    train(opt, sharded, 0, K)
    sd = opt.state_dict()
    assert {t.device.type for t in host_tensors(sd)} == {"cpu"}
    for consolidated, background in itertools.product((False, True), (False, True)):
        path = saved(
            opt, Path(root) / f"ckpt-{consolidated}-{background}", consolidated, background
        )
        resumed, resumed_sharded = distributed_on_gpu(zeros(), 1, 1)
        muonckpt.load(resumed, path)
        assert_same(opt, resumed)
    other, _ = distributed_on_gpu(initial_params(), 1, 1)
    other.load_state_dict(sd)
    assert_same(opt, other, params=False)
    train(opt, sharded, K, M)  # every collective of a step, on NCCL
    train(resumed, resumed_sharded, K, M)
    assert_same(opt, resumed)
    return {"backend": dist.get_backend_config(), "device": str(collectives.comm_device(None))}


@pytest.mark.dist
def test_an_nccl_group_of_one_rank_runs_every_operation(tmp_path):
    (result,) = run_distributed(nccl_world_of_one, 1, str(tmp_path), backend="nccl", timeout=300)
    assert result == {"backend": "cuda:nccl", "device": "cuda:0"}


def gloo_ranks_with_gpu_state(root: str, step_on_gpu: bool) -> dict[str, Any]:
    """(In a gloo child of world 2, dp=2.) Step on the CPU, move params and state to the GPU,
    then state_dict (to rank 0 and to every rank), save, load and load_state_dict; with
    ``step_on_gpu`` (a ``cpu:gloo`` group) go on stepping on the GPU, the step's collectives
    through the CPU, from the saved and from the loaded state alike. (A ``gloo`` group serves
    CUDA, but moves CUDA tensors only in broadcast and all-reduce, not the step's all-gathers.)"""
    torch.cuda.set_device(0)
    opt, sharded, _, _ = build(2, 1, initial_params())
    train(opt, sharded, 0, K)
    on_cpu = opt.state_dict()
    move_to_gpu(opt)
    sd = opt.state_dict()
    everywhere = muonckpt.gather_state_dict(opt, all_ranks=True)
    assert {t.device.type for t in host_tensors(everywhere)} == {"cpu"}
    for consolidated, background in itertools.product((False, True), (False, True)):
        path = saved(
            opt, Path(root) / f"ckpt-{consolidated}-{background}", consolidated, background
        )
        resumed, resumed_sharded, _, _ = build(2, 1, zeros())
        move_to_gpu(resumed)
        muonckpt.load(resumed, path)
        assert_same(opt, resumed)
    other, _, _, _ = build(2, 1, initial_params())
    move_to_gpu(other)
    other.load_state_dict(everywhere)
    assert_same(opt, other, params=False)
    if step_on_gpu:
        train(opt, sharded, K, M)
        train(resumed, resumed_sharded, K, M)
        assert_same(opt, resumed)
    return {"on_cpu": on_cpu, "on_gpu": sd}


@pytest.mark.dist
@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo"])
def test_gloo_ranks_with_state_on_the_gpu(tmp_path, backend):
    """Rank 0's state dict gathered from GPU state equals the one gathered before the move."""
    ranks = run_distributed(
        gloo_ranks_with_gpu_state,
        2,
        str(tmp_path),
        backend == "cpu:gloo",
        backend=backend,
        timeout=300,
    )
    before, after = ranks[0]["on_cpu"], ranks[0]["on_gpu"]
    assert after["muonckpt"]["complete"] is True
    assert after["state"].keys() == before["state"].keys()
    for index, entry in before["state"].items():
        assert entry.keys() == after["state"][index].keys()
        for key, value in entry.items():
            assert after["state"][index][key].device.type == "cpu"
            assert torch.equal(after["state"][index][key], value), (index, key)
