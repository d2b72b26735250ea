"""(issue 56) The node-local tier: each rank's share written to its node's own directory and
copied to a rank on another node; a node lost, the job restarted on the survivors at another
world size loads bitwise what was saved.

Nodes are simulated as docs/format.md says a user would: one ``torchrun --nnodes N
--node-rank k`` launcher per node over a 127.0.0.1 rendezvous, each with a directory of its
own (``NODE_ROOT``); a node is killed as a machine dies, its launcher and every worker (each
in a session of its own, as torchrun starts them) SIGKILLed, and its directory deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import muonckpt
from muonckpt.checkpoint.tiers import _candidates, placement
from muonckpt.errors import CheckpointError, OptionError
from muonckpt.format.manifest_json import replica_placement
from muonckpt.format.names import MANIFEST_NAME

from .kill_helpers import REPO

SILENCE_S = 90.0
"""The hang guard: how long the ranks may print nothing before the test fails."""


def test_each_ranks_copies_go_to_its_place_on_the_next_nodes():
    assert placement([0, 0, 1, 1], 1) == [[2], [3], [0], [1]]
    assert placement([5, 5, 7, 7, 9, 9], 2) == [[2, 4], [3, 5], [4, 0], [5, 1], [0, 2], [1, 3]]
    with pytest.raises(OptionError, match="at least 3 nodes"):
        placement([0, 1], 2)
    with pytest.raises(OptionError, match="as many ranks on every node"):
        placement([0, 0, 1], 1)


def test_the_setting_is_checked_when_made_and_named_apart_from_local(tmp_path):
    assert muonckpt.LocalTier(tmp_path, node=3).node_id() == 3
    wrong = ({"replicas": 0}, {"durable_every": -1}, {"keep_last": 0}, {"replicas": True})
    wrong += ({"durable_every": True}, {"keep_last": True}, {"node": "a"}, {"node": -1})
    for bad in wrong:
        with pytest.raises(OptionError, match=next(iter(bad))):
            muonckpt.LocalTier(tmp_path, **bad)
    with pytest.raises(CheckpointError, match="s3://"):
        muonckpt.LocalTier("s3://bucket/local")


def test_the_placement_is_an_optional_version_5_field():
    body = {"replicas": {"nodes": [0, 0, 1, 1], "holders": [[2], [3], [0], [1]]}}
    assert replica_placement(body, 5) == body["replicas"]
    assert replica_placement({}, 5) is None
    for wrong in ({"nodes": [0], "holders": [[0]]}, {"nodes": [0, 1]}, [1]):
        with pytest.raises(CheckpointError, match="replicas"):
            replica_placement({"replicas": wrong}, 5)
    with pytest.raises(CheckpointError, match="version 4"):
        replica_placement(body, 4)


def test_a_tiered_save_without_a_process_group_is_refused_before_anything_is_written(tmp_path):
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(3)
    opt.step()
    tier = muonckpt.LocalTier(tmp_path / "local", node=0)
    with pytest.raises(CheckpointError, match="torchrun"):
        muonckpt.save(opt, tmp_path / "step-1", tier=tier)
    with pytest.raises(CheckpointError, match="torchrun"):
        muonckpt.recover(opt, tier)
    assert not (tmp_path / "local").exists() and not (tmp_path / "step-1").exists()


def _survey(step: int, digest: str, files: list[str], here: list[str]) -> dict[str, Any]:
    return {"digest": digest, "step": step, "files": [[f, 1] for f in files], "here": here}


def test_a_step_counts_when_its_files_survive_across_nodes_under_one_manifest():
    """Which local steps recovery may use: complete across the surveys of the surviving
    nodes, a step name whose manifests differ between nodes (a stale copy) never mixed, none
    older than the durable tier's newest, newest first."""
    files = ["a", "b", MANIFEST_NAME]
    surveys = {
        0: {
            "step-1": _survey(1, "d1", files, ["a", MANIFEST_NAME]),
            "step-2": _survey(2, "d2", files, ["a", MANIFEST_NAME]),
            "step-3": _survey(3, "d3", files, files),
        },
        2: {
            "step-1": _survey(1, "d1", files, ["b", MANIFEST_NAME]),
            "step-2": _survey(2, "other", files, ["b", MANIFEST_NAME]),  # a stale copy
        },
    }
    found = _candidates(surveys, None)
    assert [(c.name, c.digest) for c in found] == [("step-3", "d3"), ("step-1", "d1")]
    assert found[1].holders == {"a": [0], "b": [2], MANIFEST_NAME: [0, 2]}
    assert [c.name for c in _candidates(surveys, 2)] == ["step-3"]
    assert _candidates(surveys, 4) == []


class Node:
    """One simulated node: its torchrun launcher and what its ranks printed."""

    def __init__(
        self, args: list[str], nodes: int, rank: int, port: int, root: Path, env: dict[str, str]
    ) -> None:
        self.root = root
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes)]
        argv += ["--node-rank", str(rank), "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
        argv += ["--master-port", str(port), "-m", "tests.tier_script", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "NODE_ROOT": str(root), **env}
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        self.said: list[dict[str, Any]] = []
        self._pending = b""

    def read(self, lines: int) -> list[dict[str, Any]]:
        """The first ``lines`` JSON lines its ranks printed."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + SILENCE_S
        while len(self.said) < lines:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            assert ready, f"the ranks printed {self.said} in {SILENCE_S:g} s"
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            assert chunk, f"the node's output ended after {self.said}"
            *done, self._pending = (self._pending + chunk).split(b"\n")
            self.said += [json.loads(line) for line in done if line.strip()]
        return self.said

    def kill(self) -> None:
        """SIGKILL the launcher and each worker's process group (torchrun's setsid)."""
        for said in self.said:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(said["pid"], signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@contextlib.contextmanager
def _nodes(
    args: list[str], roots: list[Path], env: dict[str, str] | None = None
) -> Iterator[list[Node]]:
    """One launcher per root, over one rendezvous; every process killed on the way out."""
    port = _free_port()
    nodes = [Node(args, len(roots), k, port, root, env or {}) for k, root in enumerate(roots)]
    try:
        yield nodes
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.kill()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _saved_then_node_1_lost(
    tmp_path: Path, steps: int, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """2 nodes x 2 ranks (dp 2 x tp 2) save ``steps`` steps with one replica each; then the
    job ends, node 1 lost with its directory. What node 0's ranks printed."""
    roots = [tmp_path / "node0", tmp_path / "node1"]
    with _nodes(["save", str(tmp_path), "2", "2", str(steps)], roots, env) as nodes:
        said = nodes[0].read(2)
        if not (env or {}).get("TIER_DIE_AT"):
            nodes[1].read(2)
        for node in reversed(nodes):
            node.kill()
    shutil.rmtree(roots[1])
    return said


def _recovered(tmp_path: Path, nodes: int, dp: int, tp: int, step: int) -> list[dict[str, Any]]:
    """The job restarted at ``nodes`` x 2 ranks (node 0's directory kept, the others empty)
    at ``dp`` x ``tp``: what each rank's recovery printed, in rank order."""
    roots = [tmp_path / f"node{k}" for k in range(nodes)]
    with _nodes(["recover", str(tmp_path), str(dp), str(tp), str(step)], roots) as launched:
        said = [line for node in launched for line in node.read(2)]
        for node in launched:
            assert node.proc.wait(timeout=SILENCE_S) == 0
    return sorted(said, key=lambda line: line["rank"])


@pytest.mark.dist
def test_a_node_lost_is_recovered_from_the_survivors_at_another_world_size(tmp_path):
    """Node 1 dies with its directory after a save; the job restarts on node 0 alone at
    dp 2 x tp 1, and each rank loads the step, bitwise what the save's durable copy loads at
    that layout, from node 0's own files and the replicas it kept of node 1's, fetching
    nothing. (Several steps, keep_last and the choice of the newest: the slow tier.)"""
    said = _saved_then_node_1_lost(tmp_path, 1)
    assert {line["saved"] for line in said} == {str(tmp_path / "durable" / "step-1")}
    for outcome in _recovered(tmp_path, 1, 2, 1, 1):
        assert outcome["equal"], outcome
        assert (outcome["tier"], outcome["step"], outcome["fetched"]) == ("local", 1, [])
        assert outcome["refused"] == outcome["warnings"] == []


@pytest.mark.dist
@pytest.mark.slow
def test_a_background_save_recovered_at_three_nodes_fetches_what_the_new_nodes_lack(tmp_path):
    """async_save with the tier (the copies in the background); node 1 lost; the job restarts
    at 3 nodes x 2 ranks (dp 3 x tp 2): the new nodes fetch the step from node 0."""
    said = _saved_then_node_1_lost(tmp_path, 1, {"TIER_ASYNC": "1"})
    assert {line["saved"] for line in said} == {str(tmp_path / "durable" / "step-1")}
    outcomes = _recovered(tmp_path, 3, 3, 2, 1)
    for outcome in outcomes:
        assert outcome["equal"], outcome
        assert (outcome["tier"], outcome["step"]) == ("local", 1)
    fetched = [outcome["fetched"] for outcome in outcomes]
    assert fetched[:2] == [[], []]  # node 0 holds the step
    for leader, other in ((2, 3), (4, 5)):  # the new nodes' ranks share the copies
        assert fetched[leader][-1] == "manifest.json"  # the manifest last, by the leader
        assert fetched[other] and "manifest.json" not in fetched[other]
        assert not set(fetched[leader]) & set(fetched[other])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # in the last tensor's data, past the header
    path.write_bytes(bytes(data))


@pytest.mark.dist
@pytest.mark.slow
def test_a_corrupt_replica_is_refused_and_the_durable_tier_used(tmp_path):
    """Node 0's replica of rank 2's file of the newest step has a flipped byte: it is never
    applied; no other copy survives, so the durable checkpoint of that step is loaded, and the
    recovery says so."""
    _saved_then_node_1_lost(tmp_path, 2)
    assert sorted(os.listdir(tmp_path / "node0")) == ["step-1", "step-2"]  # keep_last=2
    _flip_a_byte(tmp_path / "node0" / "step-2" / "rank-00002-of-00004.safetensors")
    for outcome in _recovered(tmp_path, 1, 2, 1, 2):
        assert outcome["equal"], outcome
        assert (outcome["tier"], outcome["step"]) == ("durable", 2)
        said = " ".join(outcome["warnings"])
        assert "rank-00002-of-00004.safetensors is refused" in said, said
        assert "no sound copy" in said and "loading" in said


@pytest.mark.dist
@pytest.mark.slow
def test_a_node_lost_in_the_copy_fails_the_save_everywhere_and_the_previous_step_is_used(
    tmp_path,
):
    """Node 1's ranks die while they receive step 2's copies: the save fails on node 0's
    ranks too, a library error, in bounded time (at once where gloo sees the connections
    close, else at the process groups' timeout, 20 s here); the job restarted on node 0
    recovers step 1."""
    started = time.monotonic()
    env = {"TIER_DIE_AT": "2", "MUONCKPT_RENDEZVOUS_TIMEOUT": "20"}
    said = _saved_then_node_1_lost(tmp_path, 2, env)
    assert time.monotonic() - started < SILENCE_S
    for outcome in said:
        assert outcome["library"] and outcome["step"] == 2, outcome
    assert sorted(os.listdir(tmp_path / "node0")) == ["step-1"]  # step 2's staging discarded
    for outcome in _recovered(tmp_path, 1, 2, 1, 1):
        assert outcome["equal"], outcome
        assert (outcome["tier"], outcome["step"], outcome["fetched"]) == ("local", 1, [])


def test_a_commit_prunes_the_later_steps_of_a_run_given_up_even_keeping_all(tmp_path):
    """(issue 56's adversarial pass) A node's directory holds steps 5 and 6 of a run given up
    and steps 1 and 2 of the run that went on from an older state: committing step 2 deletes
    steps 5 and 6 (recovery would take them for the newest), with keep_last=None too."""
    from muonckpt.checkpoint.tiers import _prune

    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(3)
    opt.step()
    for step in (5, 6, 1, 2):
        muonckpt.save(opt, tmp_path / f"step-{step}", extra={"step": step})
    _prune(tmp_path, None, tmp_path / "step-2")
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-2"]
    _prune(tmp_path, 1, tmp_path / "step-2")
    assert os.listdir(tmp_path) == ["step-2"]


def _save_over_an_existing_durable_target(workdir: str) -> list[str]:
    """(gloo child, a node per rank) A tiered save due to write its durable target, which an
    earlier save already holds: its refusal, and what each node's local root then holds."""
    import torch.distributed as dist

    rank = dist.get_rank()
    param = torch.nn.Parameter(torch.full((4, 4), float(rank)))
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(4, 4)
    opt.step()
    root = Path(workdir)
    muonckpt.save(opt, root / "durable" / "step-7")
    tier = muonckpt.LocalTier(root / f"node-{rank}", replicas=1, durable_every=1, node=rank)
    try:
        muonckpt.save(opt, root / "durable" / "step-7", tier=tier)
    except CheckpointError as exc:
        local = root / f"node-{rank}"
        return [str(exc), *(sorted(os.listdir(local)) if local.exists() else [])]
    return ["saved"]


@pytest.mark.dist
def test_a_durable_target_a_tiered_save_may_not_write_is_refused_before_the_local_step(tmp_path):
    """(review) The durable target exists and overwrite is not given: the save is refused on
    every rank before its local step is written; the local step of such a save, published,
    would be recovered as if the save had succeeded."""
    from muonckpt.distributed.launch import run_distributed

    results = run_distributed(_save_over_an_existing_durable_target, 2, str(tmp_path), timeout=120)
    for result in results:
        assert "already exists" in result[0] and "step-7" in result[0], result
        assert [name for name in result[1:] if name.startswith("step-")] == [], result
