"""(issue 56) The adversarial pass over the node-local tier: nodes killed at every phase of a
save and of a recovery, corrupt, truncated and stale copies, survivors that disagree about the
newest step, a durable step newer than the local ones, a node's root that is a symlink. Each
case asserts no data loss (the newest step that is whole somewhere is loaded, bitwise what its
durable copy loads) and no silent wrong result (a damaged copy is never applied; a fallback is
said). Nodes are simulated as in tests/test_tiers.py. All slow: each case launches nodes.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from .test_tiers import SILENCE_S, _flip_a_byte, _nodes, _recovered, _saved_then_node_1_lost

pytestmark = [pytest.mark.dist, pytest.mark.slow]

FILE_0 = "rank-00000-of-00004.safetensors"
"""Rank 0's data file: node 0's own, node 1 keeps its replica."""


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 nodes x 2 ranks saved steps 1-3 (R=1, every step durable too); both nodes' directories
    kept (steps 2 and 3, keep_last=2). Each case works on a copy."""
    where = tmp_path_factory.mktemp("three_steps")
    roots = [where / "node0", where / "node1"]
    with _nodes(["save", str(where), "2", "2", "3"], roots) as launched:
        for node in launched:
            assert {line.get("saved") for line in node.read(2)} == {
                str(where / "durable" / "step-3")
            }
    return where


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _loaded(outcomes: list[dict[str, Any]], tier: str, step: int) -> None:
    for outcome in outcomes:
        assert (outcome["tier"], outcome["step"], outcome["equal"]) == (tier, step, True), outcome


def test_survivors_that_disagree_take_the_newest_step_whole_on_either(three_steps, tmp_path):
    """Node 0 lost step 3 (it has only step 2), node 1 has step 3 whole; node 1's root is a
    symlink to a directory elsewhere: both ranks of node 0 load step 3, fetched from node 1."""
    run = _copy(three_steps, tmp_path)
    shutil.rmtree(run / "node0" / "step-3")
    elsewhere = tmp_path / "elsewhere"
    (run / "node1").rename(elsewhere)
    (run / "node1").symlink_to(elsewhere)
    outcomes = _recovered(run, 2, 2, 2, 3)
    _loaded(outcomes, "local", 3)
    assert outcomes[0]["fetched"] and outcomes[2]["fetched"] == []


def test_a_stale_copy_under_the_newest_name_is_never_mixed_in(three_steps, tmp_path):
    """Node 1's ``step-3`` holds step 2's files and manifest (a stale copy under the newest
    name): node 0's step 3 is loaded everywhere; node 1 replaces what its ranks read."""
    run = _copy(three_steps, tmp_path)
    shutil.rmtree(run / "node1" / "step-3")
    shutil.copytree(run / "node1" / "step-2", run / "node1" / "step-3")
    outcomes = _recovered(run, 2, 2, 2, 3)
    _loaded(outcomes, "local", 3)
    assert outcomes[2]["fetched"]


def test_a_durable_step_newer_than_every_local_one_is_loaded_and_said(three_steps, tmp_path):
    run = _copy(three_steps, tmp_path)
    for node in ("node0", "node1"):
        shutil.rmtree(run / node / "step-3")
    outcomes = _recovered(run, 2, 2, 2, 3)
    _loaded(outcomes, "durable", 3)
    assert all("loading" in " ".join(o["warnings"]) for o in outcomes)


def test_a_damaged_own_copy_is_refused_and_fetched_again_from_its_replica(three_steps, tmp_path):
    """Node 0's own file of rank 0 has a flipped byte: refused, node 1's replica fetched in
    its place, step 3 loaded bitwise."""
    run = _copy(three_steps, tmp_path)
    _flip_a_byte(run / "node0" / "step-3" / FILE_0)
    outcomes = _recovered(run, 2, 2, 2, 3)
    _loaded(outcomes, "local", 3)
    assert FILE_0 in outcomes[0]["fetched"]
    assert all(f"{FILE_0} is refused" in " ".join(o["warnings"]) for o in outcomes)


def test_no_sound_copy_left_falls_back_and_says_so(three_steps, tmp_path):
    """Rank 0's file of step 3: node 0's copy flipped, node 1's truncated. No sound copy: the
    durable step 3 (newer than local step 2) is loaded, with the refusal said."""
    run = _copy(three_steps, tmp_path)
    _flip_a_byte(run / "node0" / "step-3" / FILE_0)
    replica = run / "node1" / "step-3" / FILE_0
    os.truncate(replica, replica.stat().st_size // 2)
    outcomes = _recovered(run, 2, 2, 2, 3)
    _loaded(outcomes, "durable", 3)
    for outcome in outcomes:
        said = " ".join(outcome["warnings"])
        assert "no sound copy" in said and "loading" in said, said


def test_a_node_lost_during_a_recovery_fails_it_and_the_next_one_succeeds(three_steps, tmp_path):
    """Node 1 lacks step 3 and dies while it fetches it: node 0's ranks fail (not hang); the
    job restarted recovers step 3 (node 1's half-fetched directory does not count)."""
    run = _copy(three_steps, tmp_path)
    shutil.rmtree(run / "node1" / "step-3")
    roots = [run / "node0", run / "node1"]
    started = time.monotonic()
    env = {"TIER_DIE_IN": "fetch", "MUONCKPT_RENDEZVOUS_TIMEOUT": "20"}
    with _nodes(["recover", str(run), "2", "2", "3"], roots, env) as launched:
        assert launched[0].proc.wait(timeout=SILENCE_S) != 0
    assert time.monotonic() - started < SILENCE_S
    _loaded(_recovered(run, 2, 2, 2, 3), "local", 3)


@pytest.mark.parametrize("phase", ["write", "commit", "publish"])
def test_a_node_killed_at_each_phase_of_a_save_loses_nothing_committed(tmp_path, phase):
    """Node 1's ranks die in step 2's save, in its write into staging, between the copies and
    the commit, or at its publish: node 0's ranks' save fails as a library error in bounded
    time; the job restarted on node 0 loads a step whole and sound: step 1 bitwise, or, where
    node 0 published step 2 before the loss was seen, step 2 (its extra says so)."""
    started = time.monotonic()
    env = {"TIER_DIE_AT": "2", "TIER_DIE_IN": phase, "MUONCKPT_RENDEZVOUS_TIMEOUT": "20"}
    said = _saved_then_node_1_lost(tmp_path, 2, env)
    assert time.monotonic() - started < SILENCE_S
    for outcome in said:
        assert outcome["library"] and outcome["step"] == 2, outcome
    outcomes = _recovered(tmp_path, 1, 2, 1, 1)
    for outcome in outcomes:
        assert outcome["tier"] == "local", outcome
        if outcome["step"] == 1:
            assert outcome["equal"], outcome
        else:
            assert outcome["step"] == 2 and outcome["scale"] == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_a_damaged_piece_index_is_fetched_again_from_a_sound_copy(three_steps, tmp_path):
    """Node 0's piece index of rank 0 has a flipped byte, node 1's is sound: the index is
    refused and fetched from node 1, and step 3 is loaded from the local tier."""
    run = _copy(three_steps, tmp_path)
    _flip_a_byte(run / "node0" / "step-3" / "rank-00000-of-00004.pieces.json")
    outcomes = _recovered(run, 2, 2, 2, 3)
    _loaded(outcomes, "local", 3)
    assert "rank-00000-of-00004.pieces.json" in outcomes[0]["fetched"]


def test_a_run_restarted_over_an_older_runs_local_steps_recovers_its_own(three_steps, tmp_path):
    """The nodes' directories still hold steps 2 and 3 of a run given up (a rollback, or an
    earlier job on the same nodes); the new run saves step 1 and is lost: recovery loads
    the new run's step 1, not the older run's step 3, and its step 1 was not pruned."""
    run = _copy(three_steps, tmp_path)
    shutil.rmtree(run / "durable")
    roots = [run / "node0", run / "node1"]
    with _nodes(["save", str(run), "2", "2", "1"], roots) as launched:
        for node in launched:
            assert {line.get("saved") for line in node.read(2)} == {str(run / "durable" / "step-1")}
    _loaded(_recovered(run, 2, 2, 2, 1), "local", 1)


def test_two_nodes_given_one_root_are_refused_before_anything_is_written(tmp_path):
    """Both nodes' NODE_ROOT is one directory: every rank's save fails at once with an
    OptionError naming it (it failed at the publish, saying the staging directory's lease
    was replaced, and a step was left there all the same), and nothing is left in it."""
    shared = tmp_path / "shared"
    env = {"MUONCKPT_RENDEZVOUS_TIMEOUT": "20"}
    with _nodes(["save", str(tmp_path), "2", "2", "1"], [shared, shared], env) as launched:
        said = [line for node in launched for line in node.read(2)]
    for outcome in said:
        assert outcome["library"] and "one directory as their root" in outcome["error"], outcome
    assert os.listdir(shared) == []


def test_a_node_lost_in_a_background_saves_copy_loses_nothing_committed(tmp_path):
    """As above with async_save: node 1 dies in step 2's copies, on the background thread.
    The save fails at async_save's ``timeout`` (10 s here; 1800 s by default: the steps of a
    background save wait that long for a rank's report), not at once as a foreground one."""
    env = {"TIER_DIE_AT": "2", "TIER_ASYNC": "1", "TIER_ASYNC_TIMEOUT": "10"}
    env["MUONCKPT_RENDEZVOUS_TIMEOUT"] = "20"
    for outcome in _saved_then_node_1_lost(tmp_path, 2, env):
        assert outcome["library"] and outcome["step"] == 2, outcome
    _loaded(_recovered(tmp_path, 1, 2, 1, 1), "local", 1)


def test_the_save_roots_node_lost_in_the_copy_fails_the_save_on_the_other(tmp_path):
    """Node 0 (the save's root and the store's host) dies in step 2's copies: node 1's ranks
    fail as a library error in bounded time; restarted on node 1's directory alone, step 1 is
    loaded bitwise."""
    roots = [tmp_path / "node0", tmp_path / "node1"]
    env = {"TIER_DIE_AT": "2", "TIER_DIE_NODE": "0", "MUONCKPT_RENDEZVOUS_TIMEOUT": "20"}
    started = time.monotonic()
    with _nodes(["save", str(tmp_path), "2", "2", "2"], roots, env) as launched:
        said = launched[1].read(2)
    assert time.monotonic() - started < SILENCE_S
    for outcome in said:
        assert outcome["library"] and outcome["step"] == 2, outcome
    shutil.rmtree(roots[0])
    (tmp_path / "node1").rename(tmp_path / "node0")
    _loaded(_recovered(tmp_path, 1, 2, 1, 1), "local", 1)
