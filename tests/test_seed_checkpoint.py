"""Checkpoints of optimizers sharded the seed's way: its ``distribute_params`` as written.

The seed (and Megatron's distributed optimizer) leaves a param out of a rank's optimizer when
the rank holds no element of it, and passes plain tensors (no names). Each case trains K steps
at one dp x tp, saves (per-rank and consolidated, unnamed and named), then resumes at another
dp x tp into an optimizer built from **zeros**, so only the checkpoint can make its params
right, and trains M more: every param must equal an uninterrupted run of K + M steps bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

import muonckpt
from muonckpt import StateDictError
from muonckpt.distributed.launch import run_distributed
from muonckpt.optim.muon import Muon

from .seed_port import SEED_TP_DIMS, distribute_params, gen_param_and_grads, make_groups

pytestmark = pytest.mark.dist

SHAPES = [(20, 20), (24, 36), (52, 28), (44, 52), (32, 32)]
MUON_ARGS = {"use_muon": True, "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}
K, M = 3, 2
SAVED_AT = [(2, 2), (4, 2), (2, 4)]
VARIANTS = [
    (named, kind) for named in (False, True) for kind in ("per-rank", "consolidated", "background")
]
"""Each checkpoint: named params or not; ``save`` per rank or consolidated, or ``async_save``."""


def build(dp, tp, groups, full, named):
    """distribute_params as the seed calls it, then Muon as the seed builds it; named params
    are called ``layers.<index>.weight`` after their index in the seed's list."""
    dp_group, tp_group = groups
    _, grads = gen_param_and_grads(SHAPES, K + M)
    params, grads, size, metas = distribute_params(full, grads, SEED_TP_DIMS, dp_group, tp_group)
    given = params
    if named:
        index_of = {start: i for i, start in enumerate(_shard_starts(tp))}
        given = [(f"layers.{index_of[metas[p].global_range[0]]}.weight", p) for p in params]
    opt = Muon([{"params": given, **MUON_ARGS}])
    opt.enable_distributed_mode([[(size, 0)]], dp_group, tp_group, metas)
    return opt, params, grads


def _shard_starts(tp):
    """Where each param's TP shard starts in the seed's buffer (they are packed in order)."""
    starts, start = [], 0
    for shape, dim in zip(SHAPES, SEED_TP_DIMS):
        starts.append(start)
        start += shape[0] * shape[1] // (tp if dim != -1 else 1)
    return starts


def train(opt, params, grads, first, steps):
    for step in range(first, first + steps):
        for p, grad in zip(params, grads[step]):
            p.grad = grad.clone()
        opt.step()


def reference(steps):
    """The seed's own reference: one plain Muon over the full params."""
    full, grads = gen_param_and_grads(SHAPES, K + M)
    opt = Muon([{"params": full, **MUON_ARGS}])
    train(opt, full, grads, 0, steps)
    return full


def ckpt_name(root, topo, named, kind):
    return str(Path(root) / f"{topo[0]}x{topo[1]}-{'named' if named else 'plain'}-{kind}")


def save_phase(dp, tp, root):
    groups = make_groups(dp, tp)
    sizes = []
    for named, kind in VARIANTS:
        full, _ = gen_param_and_grads(SHAPES, K + M)
        opt, params, grads = build(dp, tp, groups, full, named)
        train(opt, params, grads, 0, K)
        path = ckpt_name(root, (dp, tp), named, kind)
        if kind == "background":
            saving = muonckpt.async_save(opt, path)
            train(opt, params, grads, K, 1)  # training goes on: the checkpoint keeps step K
            saving.result(timeout=120)
        else:
            muonckpt.save(opt, path, consolidated=kind == "consolidated")
        sizes.append(len(params))
    return sizes


def load_phase(dp, tp, ckpts):
    """Resume each checkpoint from zeros; the params that differ from the reference."""
    groups = make_groups(dp, tp)
    expected, _, _, _ = distribute_params(reference(K + M), [], SEED_TP_DIMS, *groups)
    wrong = []
    for ckpt in ckpts:
        zeros = [torch.zeros(shape) for shape in SHAPES]
        opt, params, grads = build(dp, tp, groups, zeros, "-named-" in ckpt)
        muonckpt.load(opt, ckpt)
        train(opt, params, grads, K, M)
        assert len(expected) == len(params)
        wrong += [
            f"{ckpt}: param {i}"
            for i, (a, b) in enumerate(zip(expected, params))
            if not torch.equal(a, b)
        ]
    return wrong


def rollback_phase(dp, tp, ckpt):
    """Train past the checkpoint, load it back into the same optimizer (a rollback), train on:
    how many state tensors this rank had, whether each kept its identity, and the params that
    differ from the reference."""
    groups = make_groups(dp, tp)
    expected, _, _, _ = distribute_params(reference(K + M), [], SEED_TP_DIMS, *groups)
    full, _ = gen_param_and_grads(SHAPES, K + M)
    opt, params, grads = build(dp, tp, groups, full, "-named-" in ckpt)
    train(opt, params, grads, 0, K + 1)
    own = [(p, k, v) for p, s in opt.state.items() for k, v in s.items() if torch.is_tensor(v)]
    muonckpt.load(opt, ckpt)
    kept = all(opt.state[p][k] is v for p, k, v in own)
    train(opt, params, grads, K, M)
    wrong = [i for i, (a, b) in enumerate(zip(expected, params)) if not torch.equal(a, b)]
    return {"tensors": len(own), "kept": kept, "wrong": wrong}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed-ckpts")
    held = {}
    for dp, tp in SAVED_AT:
        held[dp, tp] = run_distributed(save_phase, dp * tp, dp, tp, str(root), timeout=180)
    every = [ckpt_name(root, topo, named, kind) for topo in SAVED_AT for named, kind in VARIANTS]
    return {"root": root, "held": held, "ckpts": every}


def test_seed_sharding_leaves_params_out(saved):
    """The case this file is about: some ranks' optimizers lack some params."""
    for (dp, tp), sizes in saved["held"].items():
        assert min(min(s) for s in sizes) < len(SHAPES), (dp, tp, sizes)


@pytest.mark.parametrize("dp,tp", [(4, 2), (2, 4), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_resume_at_another_topology_from_zeros_is_bitwise(saved, dp, tp):
    """Every checkpoint saved at 2x2, 4x2 and 2x4, resumed at dp x tp: 4x2 and 2x4 take DP and
    TP each up and down, and each topology's own; 2x2 (the same directions, fewer ranks) is in
    the slow tier."""
    for ckpt in saved["ckpts"]:
        assert muonckpt.verify(ckpt) == []
    wrong = run_distributed(load_phase, dp * tp, dp, tp, saved["ckpts"], timeout=300)
    assert wrong == [[]] * (dp * tp)


@pytest.mark.parametrize("named", [False, True])
def test_resume_single_process_from_zeros_is_bitwise(saved, named):
    expected = reference(K + M)
    for ckpt in saved["ckpts"]:
        if ("-named-" in ckpt) != named:
            continue
        zeros = [torch.zeros(shape) for shape in SHAPES]
        given = [(f"layers.{i}.weight", p) for i, p in enumerate(zeros)] if named else zeros
        opt = Muon([{"params": given, **MUON_ARGS}])
        muonckpt.load(opt, ckpt)
        _, grads = gen_param_and_grads(SHAPES, K + M)
        train(opt, zeros, grads, K, M)
        for i, (a, b) in enumerate(zip(expected, zeros)):
            assert torch.equal(a, b), f"{ckpt}: param {i}"


def test_consolidated_model_file_loads_into_a_module(saved):
    after_k = reference(K)
    for topo in SAVED_AT:
        for named in (False, True):
            ckpt = Path(ckpt_name(saved["root"], topo, named, "consolidated"))
            tensors = safetensors.torch.load_file(ckpt / "model.safetensors")
            module = torch.nn.Module()
            for i, shape in enumerate(SHAPES):
                name = f"layers.{i}.weight" if named else str(i)
                assert name in tensors
                module.register_parameter(
                    name.replace(".", "_"), torch.nn.Parameter(torch.zeros(shape))
                )
            module.load_state_dict({k.replace(".", "_"): v for k, v in tensors.items()})
            for i, p in enumerate(module.parameters()):
                assert torch.equal(p.detach(), after_k[i]), (ckpt, i)


def test_unnamed_identity_is_the_packing_order(saved):
    """Unnamed params are numbered over the whole grid, whichever rank holds them."""
    for topo in SAVED_AT:
        manifest = muonckpt.read_manifest(ckpt_name(saved["root"], topo, False, "per-rank"))
        assert [p.name for p in manifest.params] == [str(i) for i in range(len(SHAPES))]
        assert [p.shape for p in manifest.params] == SHAPES


def test_cli_on_a_seed_checkpoint(saved, tmp_path):
    from typer.testing import CliRunner

    from muonckpt.cli import app

    runner = CliRunner()
    src = ckpt_name(saved["root"], (4, 2), False, "per-rank")
    out = tmp_path / "r"
    for args in (
        ["inspect", src],
        ["verify", src],
        ["reshard", src, "--dp", "2", "--tp", "4", "-o", str(out)],
        ["consolidate", str(out), "-o", str(tmp_path / "c")],
        ["diff", src, str(tmp_path / "c")],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
    wrong = run_distributed(load_phase, 8, 2, 4, [str(out)], timeout=180)
    assert wrong == [[]] * 8


# --- errors name the param and the ranks --------------------------------------------------


def drop_a_param(kind):
    """Rank 1 leaves out a param it owns elements of, or lies about a param's shape."""
    groups = make_groups(2, 1)
    full, _ = gen_param_and_grads(SHAPES, K + M)
    opt, params, grads = build(2, 1, groups, full, True)
    train(opt, params, grads, 0, 1)
    if dist.get_rank() == 1:
        group = opt.param_groups[0]
        if kind == "missing":
            del group["params"][0], group["param_names"][0]
        else:
            opt.dist_metas[group["params"][0]].shape = torch.Size((1, 1))
    try:
        muonckpt.save(opt, "/nonexistent-dir-never-written/x")
    except StateDictError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind", ["missing", "disagree"])
def test_inconsistent_ranks_are_named(kind):
    messages = run_distributed(drop_a_param, 2, kind, timeout=60)
    assert messages[0] == messages[1] and messages[0] is not None
    assert "param 'layers." in messages[0]
    assert "grid rank 1 (dp 1, tp 0)" in messages[0]
    if kind == "disagree":
        assert "grid rank 0" in messages[0] and "disagree" in messages[0]


# --- the in-memory path: state_dict / gather_state_dict / load_state_dict --------------------


def state_dict_phase(dp, tp, path):
    """Seed sharding at dp x tp: state_dict on rank 0, and gathered on every rank."""
    groups = make_groups(dp, tp)
    full, _ = gen_param_and_grads(SHAPES, K + M)
    opt, params, grads = build(dp, tp, groups, full, False)
    train(opt, params, grads, 0, K)
    sd = opt.state_dict()
    everywhere = muonckpt.gather_state_dict(opt, all_ranks=True)
    if dist.get_rank() == 0:
        torch.save(sd, path)
    return {"complete": sd["muonckpt"]["complete"], "everywhere": everywhere}


def load_state_dict_phase(dp, tp, path):
    """Resume from the state dict, with the params distributed from the reference at step K."""
    groups = make_groups(dp, tp)
    opt, params, grads = build(dp, tp, groups, reference(K), False)
    opt.load_state_dict(torch.load(path, weights_only=True))
    train(opt, params, grads, K, M)
    expected, _, _, _ = distribute_params(reference(K + M), [], SEED_TP_DIMS, *groups)
    return [i for i, (a, b) in enumerate(zip(expected, params)) if not torch.equal(a, b)]


def test_state_dict_of_seed_sharding_is_complete_everywhere_and_reshards(tmp_path):
    path = str(tmp_path / "optim.pt")
    out = run_distributed(state_dict_phase, 8, 4, 2, path, timeout=120)
    assert [o["complete"] for o in out] == [True] + [False] * 7
    sd = torch.load(path, weights_only=True)
    assert sorted(sd["state"]) == list(range(len(SHAPES)))
    for index, shape in enumerate(SHAPES):
        assert tuple(sd["state"][index]["momentum_buffer"].shape) == shape
    for o in out:
        assert sorted(o["everywhere"]["state"]) == sorted(sd["state"])
        for index, entry in sd["state"].items():
            assert torch.equal(
                o["everywhere"]["state"][index]["momentum_buffer"], entry["momentum_buffer"]
            )
    assert run_distributed(load_state_dict_phase, 8, 2, 4, path, timeout=120) == [[]] * 8


def test_a_rollback_into_the_seeds_optimizer_copies_into_its_momentum(saved):
    """A load into the seed-built optimizer that trained past the checkpoint keeps each rank's
    momentum tensors and continues bitwise as the uninterrupted run."""
    ckpt = ckpt_name(saved["root"], (2, 2), False, "per-rank")
    ranks = run_distributed(rollback_phase, 4, 2, 2, ckpt, timeout=180)
    assert sum(r["tensors"] for r in ranks) > 0
    assert all(r["kept"] for r in ranks), ranks
    assert [r["wrong"] for r in ranks] == [[]] * 4
