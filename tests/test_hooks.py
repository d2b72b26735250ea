"""Complete state dicts through the hooks, and resumes at any dp x tp, bit for bit."""

from __future__ import annotations

import pytest
import torch

import muonckpt
from muonckpt.distributed.launch import run_distributed

from .fixture_model import N_GROUPS, N_PARAMS, PARAM_NAMES, SHAPES, STATE_KEYS, assemble
from .resume_cases import phase

K_STEPS, M_STEPS = 3, 2


def _run(dp, tp, *args):
    return run_distributed(phase, dp * tp, dp, tp, *args, timeout=120)


@pytest.fixture(scope="module")
def reference(reference_params):
    """Full params after K + M steps of a single-process run (in a child, like every run)."""
    return reference_params(K_STEPS + M_STEPS)


@pytest.fixture(scope="module")
def from_2x2(tmp_path_factory):
    """State dict and full params after K steps at 2 x 2."""
    tmp = tmp_path_factory.mktemp("from_2x2")
    state, params = tmp / "optim.pt", tmp / "params.pt"
    torch.save(assemble(2, 2, _run(2, 2, None, None, 0, K_STEPS, str(state))), params)
    return str(params), str(state)


def _assert_bitwise(full, reference):
    assert full.keys() == reference.keys()
    for name in reference:
        assert torch.equal(full[name], reference[name]), f"param {name} differs"


TOPOLOGIES = [(4, 2), pytest.param(2, 4, marks=pytest.mark.slow), (8, 1), (1, 1)]
"""Where the 2 x 2 state dict is resumed, and where the one resumed into 2 x 2 is made: the
default tier goes to more and fewer DP ranks, TP 2 -> 1 and 1 -> 2, and one process; TP 4
(split as TP 2 is) is in the slow tier."""


@pytest.mark.dist
@pytest.mark.parametrize("dp,tp", TOPOLOGIES)
def test_resume_from_2x2_is_bitwise(dp, tp, from_2x2, reference):
    params, state = from_2x2
    shards = _run(dp, tp, params, state, K_STEPS, M_STEPS, None)
    _assert_bitwise(assemble(dp, tp, shards), reference)


@pytest.mark.dist
@pytest.mark.parametrize("dp,tp", TOPOLOGIES)
def test_resume_into_2x2_is_bitwise(dp, tp, tmp_path, reference):
    state, params = tmp_path / "optim.pt", tmp_path / "params.pt"
    torch.save(assemble(dp, tp, _run(dp, tp, None, None, 0, K_STEPS, str(state))), params)
    shards = _run(2, 2, str(params), str(state), K_STEPS, M_STEPS, None)
    _assert_bitwise(assemble(2, 2, shards), reference)


@pytest.mark.dist
def test_state_dict_is_complete_and_full_shape(from_2x2):
    _, state = from_2x2
    sd = torch.load(state, weights_only=True)
    groups = sd["param_groups"]
    assert sd["muonckpt"]["complete"] is True
    assert sd["muonckpt"]["source_topology"] == {"dp": 2, "tp": 2}
    names = [n for g in groups for n in g["param_names"]]
    assert names == PARAM_NAMES
    assert [g["step"] for g in groups] == [K_STEPS] * N_GROUPS
    assert sorted(sd["state"]) == list(range(N_PARAMS))
    for index, name in enumerate(names):
        entry = sd["state"][index]
        assert set(entry) == set(STATE_KEYS[name]), name
        for key in STATE_KEYS[name]:  # full shape, and filled on every rank's part
            assert tuple(entry[key].shape) == SHAPES[name], (name, key)
            assert entry[key].abs().sum() > 0, (name, key)


@pytest.mark.parametrize("kind", ["packaged", "install_hooks"])
def test_an_optimizer_with_hooks_is_freed_once_dropped(kind):
    """The hooks live in a weak mapping beside the optimizer: they must not keep it (and its
    params and state) alive."""
    import gc
    import weakref

    from muonckpt.state.hooks import _HOOKS

    p = torch.nn.Parameter(torch.ones(4, 4))
    if kind == "packaged":
        opt = muonckpt.optim.muon.Muon([{"params": [p], "use_muon": True}])
    else:
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        muonckpt.install_hooks(opt, owner=lambda index, param: 0)
    p.grad = torch.ones(4, 4)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert opt in _HOOKS
    alive = weakref.ref(opt)
    del opt
    gc.collect()
    assert alive() is None
