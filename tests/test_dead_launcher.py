"""(issue 30) A job whose launcher, or its rank 0, died while the other ranks trained on, or
whose rank 0 died in a save: the save is a muonckpt error on every surviving rank, naming what
went away, never torch's raw ``DistNetworkError: Broken pipe`` or gloo's ``RuntimeError``.

The ranks are launched as a user launches them: ``tests/orphan_script.py`` by a real torchrun
(whose agent hosts the store) and by hand through ``env://`` (rank 0 hosts the store); the
ranks of a save that kills its rank 0 join a store hosted outside them, as torchrun's.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from .kill_helpers import REPO

pytestmark = pytest.mark.dist

SILENCE_S = 120.0
"""The hang guard: how long the ranks may print nothing before the test fails."""


class Ranks:
    """The processes that launch a job's ranks, and what the ranks printed (one JSON line
    each, twice: their pids once they trained, then how their saves ended)."""

    def __init__(self, launch: list[tuple[list[str], dict[str, str]]], directory: Path) -> None:
        self.directory = directory
        self.procs = [
            subprocess.Popen(
                argv,
                cwd=REPO,
                env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            for argv, env in launch
        ]
        self.pids: dict[int, int] = {}
        self.outcomes: dict[int, dict[str, Any]] = {}
        self._pending = {proc.stdout.fileno(): b"" for proc in self.procs if proc.stdout}

    def read(self, pids: int = 0, outcomes: int = 0) -> None:
        """Read the ranks' lines until ``pids`` pids and ``outcomes`` outcomes are in."""
        while len(self.pids) < pids or len(self.outcomes) < outcomes:
            ready, _, _ = select.select(list(self._pending), [], [], SILENCE_S)
            assert ready, f"the ranks printed nothing for {SILENCE_S:g} s"
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    del self._pending[fd]
                    assert self._pending, "every rank's output ended early"
                    continue
                *lines, self._pending[fd] = (self._pending[fd] + chunk).split(b"\n")
                for line in filter(None, map(bytes.strip, lines)):
                    said = json.loads(line)
                    if "pid" in said:
                        self.pids[said["rank"]] = said["pid"]
                    else:
                        self.outcomes[said["rank"]] = said

    def release(self, ranks: list[int]) -> None:
        """Let ``ranks`` go on to their save."""
        for rank in ranks:
            with open(self.directory / f"go-{rank}", "wb"):
                pass

    def kill_all(self) -> None:
        """SIGKILL every rank still there (torchrun's run in sessions of their own) and every
        launching process; a rank whose pid never came, still waiting to be let go, is let
        go (its save then fails and it exits)."""
        for fifo in self.directory.glob("go-*"):
            with contextlib.suppress(OSError):  # ENXIO: nobody waits there
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()


@contextlib.contextmanager
def _launched(
    launch: list[tuple[list[str], dict[str, str]]], directory: Path, world: int
) -> Iterator[Ranks]:
    """The job of ``launch`` (each process's argv and environment) once every rank trained;
    every process it started is killed on the way out."""
    for rank in range(world):
        os.mkfifo(directory / f"go-{rank}")
    ranks = Ranks(launch, directory)
    try:
        ranks.read(pids=world)
        yield ranks
    finally:
        ranks.kill_all()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _assert_one_library_line_naming(outcome: dict[str, Any], *words: str) -> None:
    assert outcome.get("library") is True, outcome
    assert outcome["message"].startswith("save (rendezvous): "), outcome
    assert "\n" not in outcome["message"], outcome
    for word in words:
        assert word in outcome["message"], outcome


def test_a_killed_torchrun_is_a_muonckpt_error_naming_the_launcher_on_every_rank(tmp_path):
    """torchrun SIGKILLed: its workers, in sessions of their own, train on; their next save
    used to die in the rendezvous with ``DistNetworkError: Broken pipe``."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    script = ["--nproc-per-node=2", "-m", "tests.orphan_script", str(tmp_path)]
    with _launched([(torchrun + script, {})], tmp_path, 2) as ranks:
        ranks.procs[0].kill()
        ranks.procs[0].wait()
        ranks.release([0, 1])
        ranks.read(outcomes=2)
    for rank in range(2):
        _assert_one_library_line_naming(
            ranks.outcomes[rank], "store at ", "is gone: the launcher", "torchrun"
        )
    assert not (tmp_path / "ckpt").exists()


def test_a_dead_rank_0_hosting_the_store_is_a_muonckpt_error_on_every_other_rank(tmp_path):
    """Ranks joined by ``env://`` by hand (as a cluster launcher starts them): rank 0 hosts the
    store, and is SIGKILLed."""
    world, port = 3, _free_port()
    place = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    launch = [
        ([sys.executable, "-m", "tests.orphan_script", str(tmp_path)], {**place, "RANK": str(r)})
        for r in range(world)
    ]
    with _launched(launch, tmp_path, world) as ranks:
        ranks.procs[0].kill()
        ranks.procs[0].wait()
        ranks.release([1, 2])
        ranks.read(outcomes=2)
    for rank in (1, 2):
        _assert_one_library_line_naming(
            ranks.outcomes[rank], f"store at 127.0.0.1:{port} is gone", "rank 0"
        )
    assert not (tmp_path / "ckpt").exists()


RANK_DIES_SCRIPT = r"""
import json, os, signal, sys
from datetime import timedelta
import torch
import torch.distributed as dist
torch.set_num_threads(1)
import muonckpt
from muonckpt.checkpoint import saving
from muonckpt.files import writing
from muonckpt.errors import PeerLostError
from tests.fixture_model import build, initial_params, train

rank, port, out, moment = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=timedelta(seconds=60))
opt, sharded, d, t = build(3, 1, initial_params())
train(opt, sharded, d, t, 0, 1)
die = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
if moment == "step":  # the packaged Muon's next step: its all-reduce, its all-gathers
    work = die if rank == 0 else lambda: train(opt, sharded, d, t, 1, 1)
else:
    work = lambda: muonckpt.save(opt, out, consolidated=moment == "gather")
    module, name = (writing, "write_files") if moment == "write" else (saving, "gather_full_state")
    if rank == 0:  # killed there, as the OOM killer would
        setattr(module, name, die)
try:
    outcome = {"done": str(work())}
except Exception as exc:
    outcome = {"type": type(exc).__name__, "message": str(exc)}
    outcome["library"] = isinstance(exc, muonckpt.MuonCkptError)
    lost = exc if isinstance(exc, PeerLostError) else exc.__cause__
    outcome["peers"] = lost.peers if isinstance(lost, PeerLostError) else None
print(json.dumps(outcome), flush=True)
os._exit(0)  # the group lost its root: no orderly teardown
"""


@pytest.mark.parametrize(
    ("moment", "named"),
    [("write", "rank 0 ("), ("gather", "rank 0 ("), ("step", "rank(s) [0, ")],
)
def test_rank_0_dying_is_a_muonckpt_error_naming_it_on_every_other_rank(tmp_path, moment, named):
    """Rank 0 SIGKILLed in a save (its write step; a consolidated save's gather) or before a
    training step of the packaged Muon, the store hosted outside the ranks as torchrun's agent
    hosts it: the others used to raise gloo's raw ``RuntimeError: ... Connection closed by
    peer ... GLHF!``."""
    store = dist.TCPStore(
        "127.0.0.1", 0, 3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    argv = [sys.executable, "-c", RANK_DIES_SCRIPT]
    procs = [
        subprocess.Popen(
            [*argv, str(rank), str(store.port), str(tmp_path / "ckpt"), moment],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(3)
    ]
    try:
        printed = [proc.communicate(timeout=150)[0] for proc in procs]  # the hang guard
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert procs[0].returncode == -signal.SIGKILL
    for rank in (1, 2):
        outcome = json.loads(printed[rank].strip().splitlines()[-1])
        assert outcome.get("library") is True, outcome
        assert f"lost the connection to {named}" in outcome["message"], outcome
        assert "\n" not in outcome["message"], outcome
        assert 0 in outcome["peers"], outcome  # the PeerLostError's field, cause or error
    assert not (tmp_path / "ckpt").exists()
