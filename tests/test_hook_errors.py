"""Every way a state dict can fail to fit raises StateDictError naming what is wrong, never a hang.

Single-process cases use the packaged Muon with named params; only what needs ranks is distributed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from muonckpt import StateDictError
from muonckpt.distributed.launch import DistributedRunError, run_distributed
from muonckpt.optim.muon import Muon
from muonckpt.state.hooks import install_hooks

from .kj_muon import KJMuon, build, initial_params, owner, train

SHAPES = {"w1": (4, 6), "w2": (6, 4), "b": (5,)}


def make_muon(order: tuple[str, ...] = ("w1", "w2")) -> Muon:
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}
    return Muon(
        [
            {"params": [(n, full[n].clone()) for n in order], "use_muon": True, "lr": 0.05},
            {"params": [("b", full["b"].clone())], "lr": 0.01},
        ]
    )


def named_state(opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {
        n: dict(opt.state[p])
        for g in opt.param_groups
        for n, p in zip(g["param_names"], g["params"], strict=True)
        if p in opt.state
    }


@pytest.fixture
def trained_sd():
    """A complete state dict of make_muon() after one step: state 0 w1, 1 w2, 2 b."""
    opt = make_muon()
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    assert sd["muonckpt"]["complete"] is True
    return copy.deepcopy(sd)


def _load_error(sd, opt=None) -> str:
    with pytest.raises(StateDictError) as info:
        (opt or make_muon()).load_state_dict(sd)
    return str(info.value)


def test_round_trip_loads(trained_sd):
    opt = make_muon()
    opt.load_state_dict(trained_sd)
    assert torch.equal(
        named_state(opt)["w2"]["momentum_buffer"], trained_sd["state"][1]["momentum_buffer"]
    )


def test_missing_param_state_names_the_param(trained_sd):
    del trained_sd["state"][1]
    message = _load_error(trained_sd)
    assert "'w2'" in message
    assert "'w1'" not in message


def test_missing_state_key_names_param_and_key(trained_sd):
    del trained_sd["state"][2]["exp_avg_sq"]
    message = _load_error(trained_sd)
    assert "'b'" in message
    assert "exp_avg_sq" in message


def test_wrong_shape_names_param_and_both_shapes(trained_sd):
    trained_sd["state"][0]["momentum_buffer"] = torch.zeros(3, 3)
    message = _load_error(trained_sd)
    assert "'w1'" in message
    assert "momentum_buffer" in message
    assert "(3, 3)" in message
    assert "(4, 6)" in message


def test_different_param_names_lists_the_difference(trained_sd):
    trained_sd["param_groups"][0]["param_names"] = ["w1", "renamed"]
    message = _load_error(trained_sd)
    assert "['renamed']" in message
    assert "['w2']" in message


def test_stub_marker_is_refused(trained_sd):
    trained_sd["muonckpt"]["complete"] = False
    trained_sd["muonckpt"]["source_rank"] = 3
    message = _load_error(trained_sd)
    assert "rank 3" in message
    assert "complete" in message


def test_params_in_another_order_within_groups_match_by_name(trained_sd):
    opt = make_muon(order=("w2", "w1"))
    opt.load_state_dict(trained_sd)
    state = named_state(opt)
    assert torch.equal(state["w1"]["momentum_buffer"], trained_sd["state"][0]["momentum_buffer"])
    assert torch.equal(state["w2"]["momentum_buffer"], trained_sd["state"][1]["momentum_buffer"])
    assert torch.equal(state["b"]["exp_avg"], trained_sd["state"][2]["exp_avg"])
    assert opt.param_groups[0]["param_names"] == ["w2", "w1"]
    assert opt.param_groups[0]["step"] == 1


def test_swapped_param_groups_are_refused_by_name(trained_sd):
    """Group settings travel by position, so a group holding other params is an error."""
    opt = Muon(
        [
            {"params": [("b", torch.zeros(5))], "lr": 0.01},
            {"params": [("w1", torch.zeros(4, 6)), ("w2", torch.zeros(6, 4))], "use_muon": True},
        ]
    )
    message = _load_error(trained_sd, opt)
    assert "'b'" in message
    assert "'w1'" in message


def test_install_hooks_round_trip_with_stateless_param():
    a, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([("a", a), ("b", b)], lr=0.1, momentum=0.9)
    install_hooks(opt, owner=lambda i, p: 0)
    a.grad = torch.ones_like(a)
    opt.step()
    momentum = opt.state[a]["momentum_buffer"].clone()
    sd = copy.deepcopy(opt.state_dict())
    assert sorted(sd["state"]) == [0]  # b never had a grad: no state, and no entry for it
    opt.state[a]["momentum_buffer"].zero_()
    opt.load_state_dict(sd)  # plain torch accepts this
    assert torch.equal(opt.state[a]["momentum_buffer"], momentum)
    assert b not in opt.state or not opt.state[b]


# --- distributed ------------------------------------------------------------------------------


def stub_and_disagreement() -> dict:
    """Rank 1 loads its own stub; then ranks disagree about a name; then all is well again."""
    rank = dist.get_rank()
    opt = build(initial_params())
    train(opt, 0, 1)
    out = {}
    stub = opt.state_dict()
    out["complete"] = stub["muonckpt"]["complete"]
    try:
        opt.load_state_dict(stub)
        out["stub_load"] = None
    except StateDictError as error:
        out["stub_load"] = str(error)
    renamed = {("z" if rank == 1 and n == "a" else n): t for n, t in initial_params().items()}
    other = KJMuon(list(renamed.items()))
    install_hooks(other, owner=owner)
    try:
        other.state_dict()
        out["disagree"] = None
    except StateDictError as error:
        out["disagree"] = str(error)
    out["after"] = sorted(opt.state_dict()["state"])  # the channel is clean afterwards
    return out


@pytest.mark.dist
def test_stub_is_refused_and_disagreeing_ranks_raise():
    rank0, rank1 = run_distributed(stub_and_disagreement, 2, timeout=25)
    assert rank0["complete"] is True and rank0["stub_load"] is None
    assert rank1["complete"] is False
    assert "rank 1" in rank1["stub_load"]
    for result in (rank0, rank1):
        assert result["disagree"] is not None
        assert "disagree" in result["disagree"]
    assert rank0["after"] == list(range(8))
    assert rank1["after"] == []


def raise_before_state_dict() -> None:
    opt = build(initial_params())
    train(opt, 0, 1)
    if dist.get_rank() == 1:
        raise RuntimeError("rank one gave up before state_dict")
    opt.state_dict()  # rank 0 waits here for rank 1


@pytest.mark.dist
def test_rank_raising_while_others_wait_is_surfaced():
    with pytest.raises(DistributedRunError) as info:
        run_distributed(raise_before_state_dict, 2, timeout=25)
    message = str(info.value)
    assert "rank 1" in message
    assert "rank one gave up before state_dict" in message
    assert "raise_before_state_dict" in message  # the traceback, not just the text
    assert "timed out" not in message  # the failure itself ended the run, not the timeout


def _failing_second_call(original):
    """``original``, except that its second call raises (as an allocation out of memory)."""
    calls = []

    def patched(*args):
        calls.append(None)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return original(*args)

    return patched


def failing_mid_gather(root: str) -> dict[str, str]:
    """(in 2 gloo ranks) The destination fails while assembling a tensor it receives, in
    ``state_dict()`` and in a consolidated save; then a gather runs normally."""
    import muonckpt
    from muonckpt.state import gather

    from . import fixture_model

    opt, sharded, d, t = fixture_model.build(2, 1, fixture_model.initial_params())
    fixture_model.train(opt, sharded, d, t, 0, 1)
    original, seen = gather.insert_, {}
    for case, call in (
        ("state_dict", opt.state_dict),
        ("save", lambda: muonckpt.save(opt, f"{root}/ckpt", consolidated=True)),
    ):
        if dist.get_rank() == 0:
            gather.insert_ = _failing_second_call(original)
        try:
            call()
            seen[case] = "no error"
        except StateDictError as exc:
            seen[case] = str(exc)
        finally:
            gather.insert_ = original
    marker = opt.state_dict()["muonckpt"]  # the ranks are still in step
    seen["after"] = "in step" if marker["complete"] == (dist.get_rank() == 0) else "?"
    return seen


@pytest.mark.dist
def test_a_rank_failing_in_the_middle_of_the_transfer_fails_every_rank(tmp_path):
    ranks = run_distributed(failing_mid_gather, 2, str(tmp_path), timeout=40)
    for seen in ranks:
        for case in ("state_dict", "save"):
            assert "state values" in seen[case] and "RuntimeError: out of memory" in seen[case]
        assert seen["after"] == "in step"
    assert list(tmp_path.iterdir()) == []


def test_ranks_disagreeing_on_a_state_dtype_are_told_what_differs():
    """(issue 20, cosmetic) The error named both ranks' identical key sets, not the dtype."""
    from muonckpt.layout.topology import whole_region
    from muonckpt.state.gather import merge_entry_reports
    from muonckpt.state.sharding_model import Holding, ParamSharding, Sharding

    half = whole_region(4)
    param = ParamSharding("w", (2, 4), (Holding(0, half), Holding(1, half)), None, None, 0)
    tensor = {"kind": "tensor", "shape": [4], "numel": 4}
    reports = [
        {"0": {"exp_avg": {**tensor, "dtype": "float32"}, "step": {"kind": "value", "value": 1}}},
        {"0": {"exp_avg": {**tensor, "dtype": "bfloat16"}, "step": {"kind": "value", "value": 1}}},
    ]
    with pytest.raises(StateDictError) as caught:
        merge_entry_reports(Sharding([param], [0, 1], 0), reports)
    message = str(caught.value)
    assert "'exp_avg' dtype 'float32' on rank 0, 'bfloat16' on rank 1" in message, message
    assert "step" not in message, message


def test_ranks_disagreeing_on_the_state_keys_are_told_which_key_is_where():
    """Two holders of one param's shards, one holding a state key the other has not: named
    with its rank, whatever rank is compared first."""
    from muonckpt.layout.topology import whole_region
    from muonckpt.state.gather import merge_entry_reports
    from muonckpt.state.sharding_model import Holding, ParamSharding, Sharding

    half = whole_region(4)
    param = ParamSharding("w", (2, 4), (Holding(0, half), Holding(1, half)), None, None, 0)
    tensor = {"kind": "tensor", "dtype": "float32", "shape": [4], "numel": 4}
    alike = {"0": {"exp_avg": tensor}}
    more = {"0": {"exp_avg": tensor, "exp_avg_sq": tensor}}
    for reports, where in (([alike, more], 1), ([more, alike], 0)):
        with pytest.raises(StateDictError, match=f"'exp_avg_sq' only on rank {where}"):
            merge_entry_reports(Sharding([param], [0, 1], 0), reports)
    merge_entry_reports(Sharding([param], [0, 1], 0), [more, more])  # alike: no error
