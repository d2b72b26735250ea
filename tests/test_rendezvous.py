"""Collectives that cannot hang on a missing rank (issue 21, item 2): every muonckpt
collective begins with a bounded rendezvous, so ``if rank == 0: save(...)`` fails on the rank
that called it within the rendezvous timeout, saying that the call is a collective, which
ranks did not come and what to do; the ranks that did not call it go on. (The hang guard is
the run's timeout: the process group's own timeout is longer, so a hang fails the test.)"""

from __future__ import annotations

import pytest

from muonckpt.launch import run_distributed

from .ddp_cases import lone_call_phase

RENDEZVOUS_S = 2.0
RUN_S = 150.0


@pytest.mark.parametrize(
    ("kind", "operation", "caller", "warm"),
    [
        ("ddp", "save", 0, False),
        ("ddp", "load", 1, False),
        ("muon", "save", 0, False),
        ("muon", "save", 1, True),
        ("muon", "async_save", 0, True),
        ("muon", "load", 0, True),
        ("muon", "state_dict()", 0, False),
        ("muon", "state_dict()", 1, True),
    ],
)
def test_a_collective_called_on_one_rank_fails_there_in_bounded_time(
    tmp_path, kind, operation, caller, warm
):
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
    assert errors[other] is None
    error = errors[caller]
    assert error is not None and error.startswith(f"{operation} ("), error
    assert f"rank(s) [{other}] did not arrive within {RENDEZVOUS_S:g} s" in error, error
    assert f"{operation} is a collective over ranks [0, 1]" in error, error
    assert "call it on every one of them (not under `if rank == 0:`)" in error, error
