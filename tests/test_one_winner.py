"""(issue 50, finding 2) One winner per path: of two saves to one new path without overwrite,
sync or async, in one process or in two, exactly one succeeds; the other fails with a
CheckpointError naming the path, and nothing of it is left beside the path."""

from __future__ import annotations

import multiprocessing as mp
import os
import warnings
from pathlib import Path

import pytest

import muonckpt
from muonckpt import CheckpointError

from .commit_race import race, saving_racer
from .fixture_model import single_process_optimizer

TRIALS = 10


@pytest.fixture(scope="module")
def optimizers():
    """Two optimizers of one process, with different states."""
    return single_process_optimizer(1), single_process_optimizer(2)


def _outcome(run) -> tuple[str, object]:
    try:
        return "ok", run()
    except CheckpointError as exc:
        return "error", exc


def _one_winner(root: Path, outcomes: list[tuple[str, object]]) -> None:
    """Exactly one "ok" at ``root/ck``; the other an error naming it; ``root`` holds only it,
    whole."""
    final = root / "ck"
    assert sorted(kind for kind, _ in outcomes) == ["error", "ok"], outcomes
    (won,) = [value for kind, value in outcomes if kind == "ok"]
    (lost,) = [value for kind, value in outcomes if kind == "error"]
    assert won == final
    assert isinstance(lost, CheckpointError) and str(lost).endswith(f"(file {final})"), lost
    assert "created by another writer" in str(lost)
    assert sorted(os.listdir(root)) == ["ck"]  # no staging, no mailbox of the loser
    assert muonckpt.verify(final) == []


def _no_commit_claimed(caught: list[warnings.WarningMessage]) -> None:
    """The loser must not report the winner's commit as its own (a 'committed' warning)."""
    assert not [w for w in caught if "committed" in str(w.message)], [
        str(w.message) for w in caught
    ]


@pytest.mark.parametrize("trial", range(TRIALS))
def test_two_async_saves_of_one_process_one_wins(tmp_path, optimizers, trial):
    a, b = optimizers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        futures = [muonckpt.async_save(a, tmp_path / "ck"), muonckpt.async_save(b, tmp_path / "ck")]
        outcomes = [_outcome(f.result) for f in futures]
    _no_commit_claimed(caught)
    _one_winner(tmp_path, outcomes)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_save_racing_an_async_save_of_one_process_one_wins(tmp_path, optimizers, trial):
    a, b = optimizers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        future = muonckpt.async_save(a, tmp_path / "ck")
        outcomes = [_outcome(lambda: muonckpt.save(b, tmp_path / "ck"))]
        outcomes.append(_outcome(future.result))
    _no_commit_claimed(caught)
    _one_winner(tmp_path, outcomes)


@pytest.mark.dist
def test_two_processes_saving_one_path_one_wins(tmp_path, optimizers):
    """Two processes ``muonckpt.save`` to each new path, meeting right before the commit:
    with renameat2, then with the rename fallback of a kernel without it."""
    trials = 40
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(2, timeout=60), ctx.Queue()
    args = [
        (who, optimizers[who], str(tmp_path), trials, trials // 2, barrier, results)
        for who in (0, 1)
    ]
    outcomes = race(ctx, saving_racer, args, results, trials)
    assert sorted(os.listdir(tmp_path)) == [f"t{t:03d}" for t in range(trials)]
    for trial, by in sorted(outcomes.items()):
        final = tmp_path / f"t{trial:03d}"
        ok = [who for who, outcome in by.items() if outcome == "ok"]
        assert len(ok) == 1, (trial, by)
        outcome = by[1 - ok[0]]
        assert outcome.startswith("CheckpointError: ") and outcome.endswith(f"(file {final})"), by
        assert "created by another writer" in outcome
        assert muonckpt.verify(final) == []
