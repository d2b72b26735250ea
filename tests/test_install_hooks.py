"""install_hooks on a KellerJordan-style Muon: complete state dicts, and bitwise resumes anywhere.

Upstream's distributed Muon keeps each param's momentum only on its owner rank, so a
``state_dict()`` saved on rank 0 silently lacks every other rank's momentum (the upstream bug
"Does Muon save the momentum_buffer correctly in a distributed setting?").
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from muonckpt.distributed.launch import run_distributed
from muonckpt.state.hooks import gather_state_dict, install_hooks

from .kj_muon import (
    HPARAMS,
    SHAPES,
    SORTED_NAMES,
    build,
    full_grad,
    initial_params,
    local_momentum,
    named_params,
    owner,
    phase,
    train,
)

pytestmark = pytest.mark.dist

K_STEPS, M_STEPS = 3, 2
WORLD = 4


def probe(steps: int, save_to: str) -> dict:
    """Train without hooks, save; install hooks, save (to a file too); gather everywhere."""
    opt = build(initial_params(), hooks=False)
    train(opt, 0, steps)
    plain = opt.state_dict()
    install_hooks(opt, owner=owner)
    complete = opt.state_dict()
    if dist.get_rank() == 0:
        torch.save(complete, save_to)
        torch.save(named_params(opt), save_to + ".params")
    everywhere = gather_state_dict(opt, all_ranks=True)
    again = opt.state_dict()
    return {
        "plain": sorted(plain["state"]),
        "local": local_momentum(opt),
        "complete": complete,
        "everywhere": everywhere,
        "again_complete": again["muonckpt"]["complete"],
        "again_state": sorted(again["state"]),
        "params": named_params(opt),
        "rank": dist.get_rank(),
    }


@pytest.fixture(scope="module")
def from_4(tmp_path_factory):
    """The state dict saved after K steps at world 4, as (params file, state file)."""
    state = str(tmp_path_factory.mktemp("from_4") / "optim.pt")
    return state + ".params", state


@pytest.fixture(scope="module")
def probed(from_4):
    return run_distributed(probe, WORLD, K_STEPS, from_4[1], timeout=60)


def test_params_are_sorted_by_size_stably(probed):
    names = probed[0]["complete"]["param_groups"][0]["param_names"]
    assert names == SORTED_NAMES


def test_params_stay_replicated(probed):
    for result in probed[1:]:
        for name, value in probed[0]["params"].items():
            assert torch.equal(result["params"][name], value), name


def test_without_hooks_rank0_misses_other_ranks_momentum(probed):
    """The upstream bug: each rank's plain state dict holds only the params it owns."""
    for rank, result in enumerate(probed):
        assert result["plain"] == [i for i in range(len(SORTED_NAMES)) if i % WORLD == rank]
    missing = set(range(len(SORTED_NAMES))) - set(probed[0]["plain"])
    assert missing == {1, 2, 3, 5, 6, 7}


def test_with_hooks_rank0_holds_every_momentum(probed):
    sd = probed[0]["complete"]
    assert sd["muonckpt"]["complete"] is True
    assert sd["muonckpt"]["source_topology"] == {"dp": WORLD, "tp": 1}
    assert sorted(sd["state"]) == list(range(len(SORTED_NAMES)))
    for index, name in enumerate(SORTED_NAMES):
        entry = sd["state"][index]
        assert set(entry) == {"momentum_buffer"}
        held = probed[index % WORLD]["local"][name]
        assert torch.equal(entry["momentum_buffer"], held), name
        assert entry["momentum_buffer"].abs().sum() > 0


def test_each_rank_holds_only_its_own_momentum(probed):
    for rank, result in enumerate(probed):
        owned = {n for i, n in enumerate(SORTED_NAMES) if i % WORLD == rank}
        assert set(result["local"]) == owned


def test_other_ranks_get_an_incomplete_stub(probed):
    for result in probed[1:]:
        stub = result["complete"]
        assert stub["state"] == {}
        assert stub["muonckpt"]["complete"] is False
        assert stub["muonckpt"]["source_rank"] == result["rank"]
        assert stub["param_groups"][0]["param_names"] == SORTED_NAMES


def test_gather_all_ranks_is_complete_everywhere(probed):
    reference = probed[0]["complete"]["state"]
    for result in probed:
        sd = result["everywhere"]
        assert sd["muonckpt"]["complete"] is True
        assert sorted(sd["state"]) == sorted(reference)
        for index, entry in reference.items():
            assert torch.equal(sd["state"][index]["momentum_buffer"], entry["momentum_buffer"])


def test_gather_all_ranks_does_not_stick(probed):
    assert probed[0]["again_complete"] is True
    for result in probed[1:]:
        assert result["again_complete"] is False
        assert result["again_state"] == []


# --- resume on a different world size ---------------------------------------------------------


def _run(world, *args):
    return run_distributed(phase, world, *args, timeout=60)


@pytest.fixture(scope="module")
def reference():
    """Params after K + M steps of a single-process run (in a child, like every run)."""
    return _run(1, None, None, 0, K_STEPS + M_STEPS, None)[0]["params"]


@pytest.fixture(scope="module")
def from_2(tmp_path_factory):
    """(params file, state file) after K steps at world 2."""
    state = str(tmp_path_factory.mktemp("from_2") / "optim.pt")
    _run(2, None, None, 0, K_STEPS, state)
    return state + ".params", state


@pytest.mark.parametrize("source,target", [(4, 2), (4, 3), (4, 1), (2, 4)])
def test_resume_on_another_world_size_is_bitwise(source, target, request, reference):
    if source == 4:
        request.getfixturevalue("probed")  # writes from_4's files
    params, state = request.getfixturevalue(f"from_{source}")
    results = _run(target, params, state, K_STEPS, M_STEPS, None)
    for rank, result in enumerate(results):
        assert result["loaded"] == result["owned"], f"rank {rank} keeps state it does not own"
        assert result["params"].keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(result["params"][name], value), f"rank {rank}: param {name}"


def test_saved_state_dict_is_complete_and_named(probed, from_4):
    sd = torch.load(from_4[1], weights_only=True)
    assert sd["muonckpt"]["complete"] is True
    assert sd["param_groups"][0]["param_names"] == SORTED_NAMES
    for index, name in enumerate(SORTED_NAMES):
        assert tuple(sd["state"][index]["momentum_buffer"].shape) == SHAPES[name]


def kj_beside_upstream(steps: int) -> dict[str, bool]:
    """(in 2 gloo ranks) ``KJMuon`` and the ``muon-optimizer`` package's own ``muon.Muon``, from
    the same params and grads; shapes whose chunks of 2 share a shape, as upstream's gather
    needs."""
    import muon

    names = ["b", "f", "a", "d"]
    start = {n: t for n, t in initial_params().items() if n in names}
    ours = build(start, hooks=False)
    bare = [torch.nn.Parameter(start[n].clone()) for n in names]
    by_name = dict(zip(names, bare, strict=True))
    theirs = muon.Muon(bare, **HPARAMS)
    for step in range(steps):
        train(ours, step, 1)
        for name, p in by_name.items():
            p.grad = full_grad(name, step)
        theirs.step()
    mine = named_params(ours)
    return {n: torch.equal(mine[n], by_name[n].detach()) for n in names}


def test_the_test_optimizer_is_upstreams_step_bit_for_bit():
    for rank in run_distributed(kj_beside_upstream, 2, 3, timeout=60):
        assert rank == {"b": True, "f": True, "a": True, "d": True}
