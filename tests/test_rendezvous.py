"""Collectives that cannot hang on a missing rank (issue 21, item 2): every muonckpt
collective begins with a bounded rendezvous, so ``if rank == 0: save(...)`` fails on the rank
that called it within the rendezvous timeout, saying that the call is a collective, which
ranks did not come and what to do; the ranks that did not call it go on, and the next call
of every rank meets. (The hang guard is the run's timeout: the process group's own timeout is
longer, so a hang fails the test.)"""

from __future__ import annotations

import pytest

import muonckpt
from muonckpt.distributed.launch import run_distributed

from .ddp_cases import (
    ddp_save_phase,
    gather_disagreeing_phase,
    lone_call_phase,
    offline_phase,
    subgroup_phase,
)

RENDEZVOUS_S = 2.0
RUN_S = 150.0


@pytest.mark.dist
@pytest.mark.parametrize(
    ("kind", "operation", "caller", "warm"),
    [
        ("ddp", "save", 0, False),
        ("ddp", "load", 1, False),
        ("muon", "save", 0, False),
        pytest.param("muon", "save", 1, True, marks=pytest.mark.slow),
        ("muon", "async_save", 0, True),
        ("muon", "load", 0, True),
        ("muon", "state_dict()", 0, False),
        pytest.param("muon", "state_dict()", 1, True, marks=pytest.mark.slow),
    ],
)
def test_a_collective_called_on_one_rank_fails_there_in_bounded_time(
    tmp_path, kind, operation, caller, warm
):
    """Each case waits out the rendezvous timeout. The default tier calls every operation,
    of both kinds, cold and warm, on rank 0 (and a load on rank 1); the slow tier adds the
    packaged Muon's warm save and state_dict() on rank 1."""
    errors = run_distributed(
        lone_call_phase,
        2,
        str(tmp_path / "ckpt"),
        kind,
        operation,
        caller,
        warm,
        RENDEZVOUS_S,
        timeout=RUN_S,
        wait_timeout=RUN_S - 30,
    )
    other = 1 - caller
    assert all(rank["again"] for rank in errors)  # and then every rank's call meets
    errors = [rank["error"] for rank in errors]
    assert errors[other] is None
    error = errors[caller]
    assert error is not None and error.startswith(f"{operation} ("), error
    assert f"rank(s) [{other}] did not arrive within {RENDEZVOUS_S:g} s" in error, error
    assert f"{operation} is a collective over ranks [0, 1]" in error, error
    assert "call it on every one of them (not under `if rank == 0:`)" in error, error


@pytest.mark.dist
@pytest.mark.parametrize("how", ["output", "lone"])
def test_an_offline_tool_over_a_process_group_meets_first(tmp_path, how):
    """consolidate under torchrun (issue 20): ranks called with different outputs fail
    together before anything is staged; a rank alone fails within the rendezvous timeout."""
    src, dst = tmp_path / "src", tmp_path / "out"
    run_distributed(ddp_save_phase, 2, str(src), 1, timeout=RUN_S)
    errors = run_distributed(
        offline_phase,
        2,
        str(src),
        str(dst),
        how,
        RENDEZVOUS_S,
        timeout=RUN_S,
        wait_timeout=RUN_S - 30,
    )
    if how == "output":
        assert errors[0] == errors[1], errors
        assert errors[0].startswith("consolidate (rendezvous): the ranks disagree on output: ")
    else:
        assert errors[1] is None
        assert "consolidate is a collective over ranks [0, 1]" in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing staged


@pytest.mark.dist
def test_ranks_that_gather_a_state_dict_differently_fail_together():
    """(issue 20) gather_state_dict's all_ranks on one rank only: rank 0 waited for a full
    copy rank 1 never sent, or sent copies nobody received; now both fail, naming it."""
    errors = run_distributed(gather_disagreeing_phase, 2, timeout=RUN_S, wait_timeout=RUN_S - 30)
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("state_dict() (rendezvous): the ranks disagree on all_ranks: ")


@pytest.mark.dist
def test_subgroups_meet_apart_and_leave_no_keys(tmp_path):
    """Each set of ranks numbers its own operations: two pairs saving and loading at once
    never meet each other's rendezvous; each operation's keys are gone from the store once
    the next one over the same ranks has begun; a lone rank of a pair names its pair."""
    ranks = run_distributed(
        subgroup_phase, 4, str(tmp_path), RENDEZVOUS_S, timeout=RUN_S, wait_timeout=RUN_S - 30
    )
    assert [r["operations"] for r in ranks] == [12] * 4  # 3 x (2 saves + 2 loads) per pair
    assert [r["left"] for r in ranks] == [[]] * 4
    assert [r["error"] is None for r in ranks] == [True, True, False, True]
    assert "rank(s) [3] did not arrive" in ranks[2]["error"]
    assert "save is a collective over ranks [2, 3]" in ranks[2]["error"]
    assert muonckpt.verify(tmp_path / "pair-1-opt-0-step-2") == []


def test_the_rendezvous_timeout_is_checked_and_restored(monkeypatch):
    monkeypatch.delenv("MUONCKPT_RENDEZVOUS_TIMEOUT", raising=False)
    assert muonckpt.distributed.rendezvous_timeout() == 60.0
    for bad in (0, -1, float("inf"), float("nan"), "5", True):
        with pytest.raises(muonckpt.CollectiveError, match="rendezvous timeout"):
            muonckpt.distributed.set_rendezvous_timeout(bad)
    monkeypatch.setenv("MUONCKPT_RENDEZVOUS_TIMEOUT", "7.5")
    assert muonckpt.distributed.rendezvous_timeout() == 7.5
    assert muonckpt.distributed.set_rendezvous_timeout(3) == 7.5
    assert muonckpt.distributed.rendezvous_timeout() == 3.0
    assert muonckpt.distributed.set_rendezvous_timeout(None) == 3.0
    assert muonckpt.distributed.rendezvous_timeout() == 7.5
    monkeypatch.setenv("MUONCKPT_RENDEZVOUS_TIMEOUT", "soon")
    with pytest.raises(muonckpt.CollectiveError, match="MUONCKPT_RENDEZVOUS_TIMEOUT='soon'"):
        muonckpt.distributed.rendezvous_timeout()
