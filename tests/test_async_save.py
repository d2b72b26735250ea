"""``muonckpt.async_save``: a snapshot at the call, the write and commit in the background,
errors on every rank, bounded waits, one save in flight, and nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import muonckpt
from muonckpt import storage
from muonckpt.distributed.launch import run_distributed
from muonckpt.offline import diff

from . import exit_script
from .async_cases import (
    disagreeing_phase,
    failing_rank_phase,
    keep_last_phase,
    snapshot_phase,
    store_keys_phase,
    unwaited_phase,
)
from .ckpt_cases import load_phase
from .dispositions import default_stop_signals
from .fixture_model import assemble, single_process_optimizer

REPO = Path(__file__).resolve().parents[1]
K, M = 3, 2


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.dist
@pytest.mark.parametrize("consolidated", [False, True])
def test_values_changed_after_the_call_do_not_reach_the_checkpoint(
    tmp_path, reference_params, consolidated
):
    ref, ckpt = tmp_path / "ref", tmp_path / "ckpt"
    paths = run_distributed(
        snapshot_phase, 4, 2, 2, K, M, str(ref), str(ckpt), consolidated, timeout=120
    )
    assert paths == [str(ckpt)] * 4
    assert _entries(tmp_path) == ["ckpt", "ref"]  # no staging, no mailbox left
    assert muonckpt.verify(ckpt) == []
    rows = diff(ref, ckpt)
    assert rows and all(r.bitwise for r in rows), [r for r in rows if not r.bitwise]
    # and a run resumed from it at another topology goes on bit for bit
    shards = run_distributed(load_phase, 4, 4, 1, str(ckpt), K, M, timeout=120)
    full = assemble(4, 1, shards)
    for name, value in reference_params(K + M).items():
        assert torch.equal(full[name], value), name


@pytest.mark.dist
def test_an_error_in_one_ranks_background_write_surfaces_on_every_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    messages = run_distributed(failing_rank_phase, 2, str(ckpt), 1, "raise", 30.0, timeout=120)
    assert messages[0] == messages[1], messages
    assert "async_save (write): rank 1: OSError" in messages[0]
    assert "No space left on device" in messages[0]
    # the checkpoint the failed save would have replaced is whole, and nothing else is left
    assert _entries(tmp_path) == ["ckpt"]
    assert muonckpt.verify(ckpt) == [] and muonckpt.read_manifest(ckpt).step == 1


@pytest.mark.dist
def test_a_rank_whose_write_never_finishes_is_an_error_after_the_timeout(tmp_path):
    ckpt = tmp_path / "ckpt"
    messages = run_distributed(failing_rank_phase, 2, str(ckpt), 1, "stall", 1.0, timeout=120)
    assert "async_save (write): rank(s) [1] did not finish within 1 s" in messages[0]
    assert messages[1].startswith("async_save (write): ")  # the late rank learns it failed
    assert "rank 0 gave up waiting for this rank" in messages[1] or messages[1] == messages[0]
    assert muonckpt.verify(ckpt) == [] and muonckpt.read_manifest(ckpt).step == 1
    leftover = [n for n in _entries(tmp_path) if n != "ckpt"]
    assert all(storage.is_ours(n) for n in leftover), leftover


@pytest.mark.dist
@pytest.mark.parametrize("overwrite", [False, True])
def test_ranks_agree_when_the_root_is_the_late_one(tmp_path, overwrite):
    """Rank 0 writes for longer than rank 1 waits for it: rank 1 gives up first, and rank 0
    then must not commit what rank 1 has already reported as failed."""
    ckpt = tmp_path / "ckpt"
    messages = run_distributed(
        failing_rank_phase, 2, str(ckpt), 0, "stall", 1.0, overwrite, timeout=120
    )
    assert messages[0] == messages[1], messages
    assert "async_save (write): rank 1: rank 0 gave no outcome within 2 s" in messages[0]
    assert _entries(tmp_path) == ["ckpt"]  # nothing committed, nothing left beside it
    assert muonckpt.verify(ckpt) == [] and muonckpt.read_manifest(ckpt).step == 1


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), None, True])
def test_a_bad_timeout_is_refused_by_the_call(tmp_path, timeout):
    with pytest.raises(muonckpt.CheckpointError, match="timeout must be"):
        muonckpt.async_save(single_process_optimizer(1), tmp_path / "a", timeout=timeout)
    assert _entries(tmp_path) == []


@pytest.mark.dist
def test_keep_last_with_background_saves(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "notes").mkdir()  # the user's own directory beside the checkpoints
    (root / "notes" / "a.txt").write_text("mine")
    results = run_distributed(keep_last_phase, 2, str(root), 5, 2, timeout=120)
    assert results == [[5, 1]] * 2
    assert _entries(root) == ["notes", "step-4", "step-5"]
    assert (root / "notes" / "a.txt").read_text() == "mine"


@pytest.mark.dist
def test_the_ranks_agree_through_the_store_and_leave_no_key_there(tmp_path):
    """(issue 52) No directory beside the target: the messages are keys of the process
    group's store, a prefix of their own per save (two in flight together never meet),
    deleted at the end of each."""
    results = run_distributed(store_keys_phase, 2, str(tmp_path), timeout=120)
    assert results == [[[1, 0, 2], []]] * 2
    assert _entries(tmp_path) == ["a", "b", "c"]


def test_one_save_in_flight_per_optimizer(tmp_path):
    opt = single_process_optimizer(2)
    first = muonckpt.async_save(opt, tmp_path / "a")
    second = muonckpt.async_save(opt, tmp_path / "b")
    assert first.done()  # the second call waited for the first commit
    assert second.result(timeout=30) == tmp_path / "b"
    muonckpt.save(opt, tmp_path / "c")
    assert all(muonckpt.verify(tmp_path / n) == [] for n in "abc")


def test_an_error_before_the_snapshot_is_raised_by_the_call(tmp_path):
    opt = single_process_optimizer(1)
    muonckpt.save(opt, tmp_path / "a")
    with pytest.raises(muonckpt.CheckpointError, match="already exists"):
        muonckpt.async_save(opt, tmp_path / "a")
    with pytest.raises(muonckpt.CheckpointError, match="keep_last"):
        muonckpt.async_save(opt, tmp_path / "b", keep_last=0)
    assert _entries(tmp_path) == ["a"]


EXITS = {  # how the script ends: its exit code, something its stderr must say
    "end": (0, None),
    "sys.exit": (3, None),
    "exception": (1, "RuntimeError: the training loop failed"),
    "KeyboardInterrupt": (-signal.SIGINT, "KeyboardInterrupt"),
    "refused": (
        1,
        "muonckpt: a background save failed and its error was never read: async_save (write)",
    ),
    "Ctrl-C twice": (
        1,
        "muonckpt: interrupted at exit while a background save was being written",
    ),
}


def _run_exit_script(ckpt: Path, kind: str, world: int) -> subprocess.CompletedProcess:
    """``tests/exit_script.py`` ending as ``kind`` says, in one process or under torchrun."""
    script = ["-m", "tests.exit_script", str(ckpt), kind]
    if world > 1:
        script = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        script += ["-m", "tests.exit_script", str(ckpt), kind]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(  # the timeout is the hang guard
        [sys.executable, *script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        preexec_fn=default_stop_signals,  # its Ctrl-C ends as on a terminal, however run
    )


def _run_script(source: str, *args: object) -> subprocess.CompletedProcess:
    """``python -c source args...`` from the repository, its output captured; the timeout is
    the hang guard."""
    command = [sys.executable, "-c", source, *map(str, args)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("kind", "world"), [*((kind, 1) for kind in EXITS), ("exception", 2), ("refused", 2)]
)
def test_a_save_in_flight_when_the_script_ends_is_finished_or_the_exit_says_so(
    tmp_path, kind, world
):
    """(issue 30) A script ending with 128 MB of state per rank still being written, by
    running off its end, sys.exit, an exception or Ctrl-C: the checkpoint is committed whole
    before the process ends (at 75 MB it used to be thrown away, exit code 0: the writer's
    thread pool refused work once the interpreter began its shutdown). A save that cannot be
    finished (the files may not grow) is one line on stderr and a non-zero exit, and leaves
    nothing that looks like a checkpoint."""
    done = _run_exit_script(tmp_path / "ckpt", kind, world)
    code, said = EXITS[kind]
    if world > 1 and code:
        code = 1  # torchrun's own, for a failed worker
    assert done.returncode == code, done.stderr[-3000:]
    assert said is None or said in done.stderr, done.stderr[-3000:]
    if kind == "refused":
        assert _entries(tmp_path) == []  # the staging and the mailbox removed
        assert "File too large" in done.stderr, done.stderr[-3000:]
        return
    if kind == "Ctrl-C twice":  # ended in the write: its staging is left, for clean
        assert [e.startswith(".ckpt.staging-") for e in _entries(tmp_path)] == [True]
        return
    assert "never read" not in done.stderr, done.stderr[-3000:]
    assert _entries(tmp_path) == ["ckpt"]
    assert muonckpt.verify(tmp_path / "ckpt") == []
    manifest = muonckpt.read_manifest(tmp_path / "ckpt")
    assert sum(f.bytes for f in manifest.files) >= 3 * exit_script.MB * 2**20 // 2


FORKING_SCRIPT = """
import os, sys, threading
import muonckpt
from muonckpt.files import writing
from tests.fixture_model import single_process_optimizer
forked, write_files = threading.Event(), writing.write_files
writing.write_files = lambda *args, **kwargs: forked.wait() and write_files(*args, **kwargs)
future = muonckpt.async_save(single_process_optimizer(2), sys.argv[1])
child = os.fork()  # the save is in flight: it writes once forked is set
if child == 0:
    sys.exit(0)  # the parent's save is not the child's to wait for or report
forked.set()
print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), future.result(), flush=True)
"""


@pytest.mark.dist
def test_a_forked_child_leaves_its_parents_save_to_the_parent(tmp_path):
    """The exit hook of a child forked while a save was in flight (a data loader's worker)
    used to report the parent's save as its own ('interrupted at exit'), exit code 1."""
    done = _run_script(FORKING_SCRIPT, str(tmp_path / "ckpt"))
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-3000:]
    assert done.stdout.split() == ["0", str(tmp_path / "ckpt")]
    assert muonckpt.verify(tmp_path / "ckpt") == []


CHILD_SAVING_SCRIPT = """
import os, sys, threading
import muonckpt
from muonckpt.files import writing
from tests.fixture_model import single_process_optimizer
forked, write_files = threading.Event(), writing.write_files
writing.write_files = lambda *args, **kwargs: forked.wait() and write_files(*args, **kwargs)
opt = single_process_optimizer(2)
future = muonckpt.async_save(opt, sys.argv[1] + "/parent")
child = os.fork()  # the save is in flight: it writes once forked is set
if child == 0:
    forked.set()  # the child's own save must not wait for the parent's, which it cannot see
    muonckpt.save(opt, sys.argv[1] + "/child")
    os._exit(0)
forked.set()
print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), future.result(), flush=True)
"""


@pytest.mark.dist
def test_a_forked_childs_own_save_does_not_wait_for_its_parents(tmp_path):
    """A child forked while a save of the same optimizer was in flight waited forever in its
    own save (or async_save) for the parent's, whose thread it does not have."""
    done = _run_script(CHILD_SAVING_SCRIPT, str(tmp_path))
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-3000:]
    assert done.stdout.split() == ["0", str(tmp_path / "parent")]
    assert muonckpt.verify(tmp_path / "parent") == []
    assert muonckpt.verify(tmp_path / "child") == []


AT_EXIT_SCRIPT = """
import atexit, sys
import torch
import muonckpt
if sys.argv[2] == "imported":
    import muonckpt.checkpoint.api  # the exit hook registered at import, as a script that saved
param = torch.nn.Parameter(torch.randn(3_000_000))  # 24 MB of moments: the writer's pools
opt = torch.optim.AdamW([param])
param.grad = torch.ones_like(param)
opt.step()
save = muonckpt.async_save if sys.argv[3] == "async_save" else muonckpt.save
atexit.register(lambda: print(type(save(opt, sys.argv[1])).__name__, flush=True))
"""


@pytest.mark.dist
@pytest.mark.parametrize(
    ("imported", "how"),
    [
        ("imported", "async_save"),
        ("first used at exit", "async_save"),
        ("first used at exit", "save"),
        pytest.param("imported", "save", marks=pytest.mark.slow),
    ],
)
def test_a_save_from_an_atexit_handler_is_committed(tmp_path, imported, how):
    """A 'save on exit' handler: muonckpt's first use there raised a raw RuntimeError (its exit
    hook registered at import, after threading's shutdown); an async_save there returned a
    running future nobody waited for (exit code 0, nothing committed, the staging left), and
    the writer's pools refused work ('cannot schedule new futures after interpreter
    shutdown'). The default tier has each fault alone and both together; a save by a script
    that imported muonckpt first is in the slow tier."""
    done = _run_script(AT_EXIT_SCRIPT, str(tmp_path / "ckpt"), imported, how)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "muonckpt:" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert muonckpt.verify(tmp_path / "ckpt") == []


FAILING_AT_EXIT_SCRIPT = """
import atexit, sys
import muonckpt
from muonckpt.files import writing
from tests.fixture_model import single_process_optimizer
def no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")
writing.write_files = no_space
atexit.register(lambda: print("the job's own exit handler ran", flush=True))
muonckpt.async_save(single_process_optimizer(2), sys.argv[1])  # its failure never read
"""


@pytest.mark.dist
def test_the_jobs_exit_handlers_still_run_when_a_failed_save_sets_exit_code_1(tmp_path):
    """The exit hook ended the process with os._exit(1) when a background save failed unread,
    which skipped the job's own atexit handlers (a tracker's finish, logging's shutdown)."""
    done = _run_script(FAILING_AT_EXIT_SCRIPT, tmp_path / "ckpt", tmp_path / "log")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.startswith("muonckpt: a background save failed"), done.stderr
    assert done.stdout == "the job's own exit handler ran\n"


def test_host_buffers_are_reused_between_saves(tmp_path):
    from muonckpt.checkpoint.api import _HOST_BUFFERS

    opt = single_process_optimizer(2)
    muonckpt.async_save(opt, tmp_path / "a").result(timeout=30)
    buffers = _HOST_BUFFERS[opt]
    held = buffers.nbytes
    share = sum(
        v.numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.dim()
    )
    assert held >= share  # the snapshot of the state (and params) is in them
    address = buffers._buffers["snapshot"].data_ptr()
    muonckpt.async_save(opt, tmp_path / "b").result(timeout=30)
    assert buffers._buffers["snapshot"].data_ptr() == address and buffers.nbytes == held


@pytest.mark.dist
def test_a_launched_rank_finishes_its_background_save_before_it_ends(tmp_path):
    """run_distributed (the demo's launcher) lets a child's save in flight
    finish before it ends the child, as the interpreter does at exit."""
    assert run_distributed(unwaited_phase, 2, str(tmp_path / "ckpt"), timeout=120) == [0, 1]
    assert _entries(tmp_path) == ["ckpt"]
    assert muonckpt.verify(tmp_path / "ckpt") == []
    assert muonckpt.read_manifest(tmp_path / "ckpt").step == 2


@pytest.mark.dist
@pytest.mark.parametrize(
    "argument", ["params", "path", "consolidated", "call", "overwrite", "model given", "load"]
)
def test_ranks_that_disagree_on_the_call_write_nothing(tmp_path, argument):
    """(issue 20) One rank saving without its params used to commit a checkpoint no tool could
    read, over the good one; any argument the ranks disagree on now fails every rank first."""
    ckpt = tmp_path / "ckpt"
    messages = run_distributed(disagreeing_phase, 2, str(ckpt), argument, timeout=120)
    said = [m.partition(" (rendezvous): ")[2] for m in messages]  # each names its own call first
    differs = "call" if argument == "load" else argument
    assert said[0] == said[1] and said[0].startswith(f"the ranks disagree on {differs}: "), said
    assert _entries(tmp_path) == ["ckpt"]  # nothing staged, nothing retired
    assert muonckpt.verify(ckpt) == [] and muonckpt.read_manifest(ckpt).step == 1


CTRL_C_IN_START_SCRIPT = """
import sys, threading
import muonckpt
from tests.fixture_model import single_process_optimizer
start = threading.Thread.start
def interrupted(thread):  # a Ctrl-C landing in Thread.start, once the thread runs
    start(thread)
    if thread.name.startswith("muonckpt async_save"):
        raise KeyboardInterrupt
threading.Thread.start = interrupted
try:
    muonckpt.async_save(single_process_optimizer(1), sys.argv[1])
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.mark.dist
def test_a_ctrl_c_in_the_threads_start_neither_hangs_the_exit_nor_loses_the_save(tmp_path):
    """The background thread waits for the call before it writes; a Ctrl-C in
    ``Thread.start`` (found by review) left it waiting for ever, and the exit waiting for it."""
    done = _run_script(CTRL_C_IN_START_SCRIPT, tmp_path / "ckpt")
    assert (done.returncode, done.stdout.split()) == (0, ["interrupted"]), done.stderr[-3000:]
    assert muonckpt.verify(tmp_path / "ckpt") == []
