"""Checkpoints of preempted jobs: ``muonckpt.latest`` finds the newest complete checkpoint
under a root, ``retention.prune`` (a save's ``keep_last``) deletes older ones, on real
checkpoints and real files beside interrupted saves, damaged checkpoints and the user's own
files."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import muonckpt
from muonckpt import CheckpointError
from muonckpt.cli import app
from muonckpt.errors import CheckpointWarning
from muonckpt.files.retention import Cleaned, complete_checkpoints, prune
from muonckpt.format.names import MANIFEST_NAME, rank_file
from muonckpt.storage import backend

from .fixture_model import build, initial_params, train

STORE = backend.PosixStore()

DATA = rank_file(0, 1)
"""The one data file of a single-process checkpoint."""
T0 = 1_700_000_000 * 10**9
"""A commit time, in ns; the tests' commits are seconds after it."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, Path]:
    """Real checkpoints of the fixture model after 1, 2, 3 and 4 steps (copy, never change)."""
    root = tmp_path_factory.mktemp("templates")
    opt, sharded, dp_rank, tp_rank = build(1, 1, initial_params())
    found = {}
    for step in range(1, 5):
        train(opt, sharded, dp_rank, tp_rank, step - 1, 1)
        found[step] = muonckpt.save(opt, root / f"step-{step}")
    return found


def committed_at(path: Path, seconds: float) -> None:
    """Date the checkpoint at ``path``'s commit (its manifest's mtime) ``seconds`` after T0."""
    when = T0 + int(seconds * 10**9)
    os.utime(path / MANIFEST_NAME, ns=(when, when))


def put(
    saved: dict[int, Path], root: Path, step: int, name: str | None = None, at: float = 0
) -> Path:
    """A copy of the checkpoint of ``step`` at ``root / name``, committed ``at`` seconds."""
    path = Path(shutil.copytree(saved[step], root / (name or f"step-{step}")))
    committed_at(path, at)
    return path


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root``: a file's bytes, a symlink's target, a directory."""
    found: dict[str, object] = {}
    for here, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(here) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                found[key] = "directory"
            elif not path.is_file():
                found[key] = "special file"  # a FIFO: never read
            else:
                found[key] = path.read_bytes()
    return found


# ---------------------------------------------------------------- latest


def test_latest_is_the_highest_step_then_the_newest_commit(saved, tmp_path):
    root = tmp_path / "ckpt"
    put(saved, root, 3, "b", at=0)
    put(saved, root, 2, "c", at=20)
    put(saved, root, 1, "d", at=30)  # the newest commit, but the lowest step
    assert muonckpt.latest(root) == root / "b"
    put(saved, root, 3, "a", at=10)  # the same step as b, committed after it
    assert muonckpt.latest(root) == root / "a"
    committed_at(root / "b", 40)
    assert muonckpt.latest(root) == root / "b"


def test_among_equal_steps_the_last_real_save_is_latest(tmp_path):
    opt, sharded, dp_rank, tp_rank = build(1, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 2)
    first = muonckpt.save(opt, tmp_path / "z-first")
    time.sleep(0.05)  # well past the file system's timestamp granularity
    second = muonckpt.save(opt, tmp_path / "a-second")
    assert muonckpt.latest(tmp_path) == second
    os.utime(first / MANIFEST_NAME)  # as if committed now
    assert muonckpt.latest(tmp_path) == first


def test_the_step_is_the_groups_else_the_params_and_none_sorts_first(saved, tmp_path):
    root = tmp_path / "ckpt"
    put(saved, root, 1, "muon-1", at=0)
    param = torch.nn.Parameter(torch.ones(3, 4))
    sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9)  # no step count anywhere
    adamw = torch.optim.AdamW([param])  # a step count per param, none per group
    for opt in (sgd, adamw, adamw):
        param.grad = torch.ones(3, 4)
        opt.step()
    committed_at(muonckpt.save(sgd, root / "sgd"), 20)
    assert muonckpt.latest(root) == root / "muon-1"
    committed_at(muonckpt.save(adamw, root / "adamw-2"), 10)
    assert muonckpt.latest(root) == root / "adamw-2"
    assert [f.step for f in complete_checkpoints(root, STORE)] == [None, 1, 2]


def _rename_to(name: str) -> Callable[[Path], None]:
    return lambda path: path.rename(path.with_name(name.format(path.name)))


def _truncate(path: Path) -> None:
    with open(path / DATA, "r+b") as f:
        f.truncate(os.fstat(f.fileno()).st_size - 1)


def _symlinked_data(path: Path) -> None:
    moved = path.parent.parent / "elsewhere.safetensors"
    (path / DATA).rename(moved)
    (path / DATA).symlink_to(moved)


def _moved_out_and_linked(path: Path) -> None:
    moved = path.parent.parent / "elsewhere" / path.name
    moved.parent.mkdir()
    path.rename(moved)
    path.symlink_to(moved)
    assert muonckpt.latest(moved.parent) == moved  # still sound where it is


DAMAGES = {
    "a staging directory (interrupted after its manifest)": _rename_to(".{}.staging-0123abcd"),
    "a replaced checkpoint not yet deleted": _rename_to(".{}.old-4242"),
    "no manifest (partly written)": lambda path: (path / MANIFEST_NAME).unlink(),
    "a data file truncated": _truncate,
    "a data file missing": lambda path: (path / DATA).unlink(),
    "a data file that is a symlink": _symlinked_data,
    "a manifest that does not parse": lambda path: (path / MANIFEST_NAME).write_text("{"),
    "another format's manifest": lambda path: (path / MANIFEST_NAME).write_text(
        json.dumps({"format": "other", "step": 9})
    ),
    "a symlink (latest -> a checkpoint)": _moved_out_and_linked,
}


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
def test_latest_skips_what_is_not_a_complete_checkpoint(saved, tmp_path, damage):
    root = tmp_path / "ckpt"
    older = put(saved, root, 1, at=0)
    newer = put(saved, root, 3, at=10)
    assert muonckpt.latest(root) == newer  # sound, it is the one
    damage(newer)
    assert muonckpt.latest(root) == older


def test_latest_ignores_the_users_files_and_directories(saved, tmp_path):
    root = tmp_path / "ckpt"
    model = root / "hf-model"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    (model / "config.json").write_text("{}")
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("step 9 was the best")
    (root / "step-9.safetensors").write_bytes(b"\0" * 64)
    assert muonckpt.latest(root) is None
    ckpt = put(saved, root, 1)
    assert muonckpt.latest(root) == ckpt


def test_latest_of_a_missing_or_empty_root_is_none_an_unusable_one_an_error(tmp_path, monkeypatch):
    assert muonckpt.latest(tmp_path) is None
    assert muonckpt.latest(tmp_path / "not-yet") is None  # a job's first start
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(CheckpointError, match="is not a directory") as caught:
        muonckpt.latest(file)
    assert str(file) in str(caught.value)

    def refused(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "scandir", refused)  # the suite may run as root: chmod would not do
    with pytest.raises(CheckpointError, match="cannot be listed: Permission denied") as caught:
        muonckpt.latest(tmp_path)
    assert str(tmp_path) in str(caught.value)


# ---------------------------------------------------------------- prune


def test_prune_keeps_the_newest_and_the_one_just_written(saved, tmp_path):
    root = tmp_path / "ckpt"
    for step in range(1, 5):
        put(saved, root, step, at=step)
    assert prune(root, 5, root / "step-4", STORE) == []
    assert prune(root, 2, root / "step-4", STORE) == [root / "step-1", root / "step-2"]
    assert sorted(os.listdir(root)) == ["step-3", "step-4"]
    assert muonckpt.verify(root / "step-3") == [] and muonckpt.verify(root / "step-4") == []
    # A run restarted at step 1 writes a checkpoint older, by step, than those it finds.
    put(saved, root, 1, "step-1", at=10)
    assert prune(root, 1, root / "step-1", STORE) == [root / "step-3"]
    assert sorted(os.listdir(root)) == ["step-1", "step-4"]
    assert muonckpt.verify(root / "step-1") == []


def test_prune_counts_only_the_series_of_the_one_just_written(saved, tmp_path):
    """Other runs' and models' checkpoints under the same root are never deleted."""
    root = tmp_path / "models"
    for name, step in (("llama-a", 1), ("final", 2), ("run2-step-1", 1), ("step-1", 1)):
        put(saved, root, step, name, at=step)
    put(saved, root, 3, "step-3", at=3)
    put(saved, root, 4, "step-4", at=4)
    assert prune(root, 1, root / "step-4", STORE) == [root / "step-1", root / "step-3"]
    assert sorted(os.listdir(root)) == ["final", "llama-a", "run2-step-1", "step-4"]
    with pytest.warns(CheckpointWarning, match="does not hold its step 2"):
        assert prune(root, 1, root / "final", STORE) == []  # no step in its name: nothing deleted
    assert prune(root, 1, root / "run2-step-1", STORE) == []  # its series: run<N>-step-<M>


def test_keep_last_in_a_sweep_deletes_only_its_own_run(tmp_path):
    """(issue 30) Seed and learning-rate sweeps under one parent: ``seed1-step-400`` with
    ``keep_last=1`` deleted ``seed2-step-100/200/300`` too, as names differing only in digits.
    Now a save prunes only the names that differ from its own in its step alone."""
    root = tmp_path / "sweep"
    opt, sharded, dp_rank, tp_rank = build(1, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 1)
    others = ["seed2-step-{}", "lr1e-3-step{}", "lr3e-4-step{}", "run-8-step-{}", "step-{:06d}"]
    for pattern in others:
        for step in (100, 200, 300):
            muonckpt.save(opt, root / pattern.format(step), extra={"step": step}, keep_last=3)
    # a name holding the step, but recording another: not of the series
    muonckpt.save(opt, root / "seed1-step-250", extra={"step": 7})
    before = snapshot(root)
    for step in (100, 200, 300, 400):
        muonckpt.save(opt, root / f"seed1-step-{step}", extra={"step": step}, keep_last=1)
    assert snapshot(root) == {**before, **snapshot_of(root, "seed1-step-400")}
    for step in (100, 200, 300):  # and the other runs prune only themselves
        muonckpt.save(opt, root / f"run-7-step-{step}", extra={"step": step}, keep_last=2)
    muonckpt.save(opt, root / "step-000400", extra={"step": 400}, keep_last=2)
    muonckpt.save(opt, root / "lr3e-4-step1000", extra={"step": 1000}, keep_last=1)
    left = sorted(os.listdir(root))
    assert left == sorted(
        [f"{run}-step-{step}" for run in ("seed2", "run-8") for step in (100, 200, 300)]
        + ["lr1e-3-step100", "lr1e-3-step200", "lr1e-3-step300", "lr3e-4-step1000"]
        + ["run-7-step-200", "run-7-step-300", "seed1-step-250", "seed1-step-400"]
        + ["step-000300", "step-000400"]
    )
    assert all(muonckpt.verify(root / name) == [] for name in left)


def snapshot_of(root: Path, name: str) -> dict[str, object]:
    """:func:`snapshot` of ``root / name``, keyed as :func:`snapshot` of ``root`` keys it."""
    return {str(Path(name) / k): v for k, v in snapshot(root / name).items()} | {name: "directory"}


@pytest.mark.parametrize(
    ("name", "step", "why"),
    [
        ("final", 3, "its name does not hold its step 3"),
        ("run-3-step-3", 3, "its name holds its step 3 2 times"),
        ("step-30", 3, "its name does not hold its step 3"),  # 3 is part of 30
        ("step-3", None, "its manifest records no step"),
    ],
)
def test_keep_last_without_a_step_in_the_name_deletes_nothing_and_says_why(
    tmp_path, name, step, why
):
    """A checkpoint whose series cannot be told prunes nothing, and the warning says why."""
    root = tmp_path / "ckpt"
    param = torch.nn.Parameter(torch.ones(3, 4))
    sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9)  # no step count anywhere
    param.grad = torch.ones(3, 4)
    sgd.step()
    extra = None if step is None else {"step": step}
    for old in ("step-1", "step-2", "run-3-step-1", "final-old"):
        muonckpt.save(sgd, root / old, extra={"step": int(old[-1]) if old[-1].isdigit() else 1})
    before = snapshot(root)
    with pytest.warns(CheckpointWarning, match=f"no old checkpoint deleted.*{why}"):
        muonckpt.save(sgd, root / name, extra=extra, keep_last=1)
    assert snapshot(root) == {**before, **snapshot_of(root, name)}


def test_latest_of_a_checkpoint_itself_is_an_error(saved, tmp_path):
    ckpt = put(saved, tmp_path / "ckpt", 1)
    with pytest.raises(CheckpointError, match="is a checkpoint itself"):
        muonckpt.latest(ckpt)
    assert muonckpt.latest(tmp_path / "ckpt") == ckpt


def test_prune_deletes_only_complete_checkpoints_of_ours(saved, tmp_path):
    root = tmp_path / "ckpt"
    noted = put(saved, root, 1, "noted", at=1)
    (noted / "notes.txt").write_text("the user's")  # a checkpoint holding a file of the user's
    put(saved, root, 1, at=2)
    put(saved, root, 2, ".step-5.staging-0123abcd", at=3)  # a save committing right now
    (put(saved, root, 2, "partial", at=3) / MANIFEST_NAME).unlink()
    model = root / "hf-model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    (root / "notes.txt").write_text("mine")
    outside = put(saved, tmp_path / "elsewhere", 1, at=0)
    (root / "linked").symlink_to(outside)  # a complete, old checkpoint, but through a link
    put(saved, root, 3, at=4)
    put(saved, root, 4, at=5)
    (root / "latest").symlink_to("step-4")
    before, outside_before = snapshot(root), snapshot(outside)

    assert prune(root, 1, root / "step-4", STORE) == [root / "step-1", root / "step-3"]
    deleted = ("step-1", "step-3")
    kept = {k: v for k, v in before.items() if k.split(os.sep)[0] not in deleted}
    assert snapshot(root) == kept
    assert snapshot(outside) == outside_before
    assert muonckpt.latest(root) == root / "step-4"


def test_prune_removes_the_manifest_first(saved, tmp_path, monkeypatch):
    class Killed(BaseException):
        """The process dying in the middle of a prune."""

    root = tmp_path / "ckpt"
    old = put(saved, root, 1, at=1)
    put(saved, root, 2, at=2)
    unlink, deleted = Path.unlink, []

    def dying(self: Path, missing_ok: bool = False) -> None:
        if self.parent == old:
            deleted.append(self.name)
            if self.name != MANIFEST_NAME:
                raise Killed
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", dying)
    with pytest.raises(Killed):
        prune(root, 1, root / "step-2", STORE)
    monkeypatch.undo()
    assert deleted == [MANIFEST_NAME, DATA.replace(".safetensors", ".pieces.json")]  # its index
    assert (old / DATA).exists()  # cut short with its data still there
    assert [f.path for f in complete_checkpoints(root, STORE)] == [root / "step-2"]
    alone = tmp_path / "alone"
    alone.mkdir()
    old.rename(alone / old.name)
    assert muonckpt.latest(alone) is None
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        muonckpt.load(build(1, 1, initial_params())[0], alone / old.name)


def _refuse_deletes_in(monkeypatch, directory: Path, names: tuple[str, ...]) -> None:
    """Deleting ``names`` in ``directory`` fails with EACCES (the suite may run as root)."""
    unlink = Path.unlink

    def refusing(self: Path, missing_ok: bool = False) -> None:
        if self.parent == directory and self.name in names:
            raise PermissionError(13, "Permission denied", str(self))
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refusing)


def test_a_failed_delete_is_a_warning_never_an_error(saved, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        put(saved, root, step, at=step)
    _refuse_deletes_in(monkeypatch, root / "step-1", (DATA,))
    with pytest.warns(CheckpointWarning, match="deleted only in part") as caught:
        assert prune(root, 1, root / "step-3", STORE) == [root / "step-2"]
    assert f"{DATA} (Permission denied)" in str(caught[0].message)
    assert os.listdir(root / "step-1") == [DATA]
    monkeypatch.undo()

    put(saved, root, 2, at=2)
    _refuse_deletes_in(monkeypatch, root / "step-2", (MANIFEST_NAME,))
    with pytest.warns(CheckpointWarning, match="cannot be deleted .Permission denied.; it is left"):
        assert prune(root, 1, root / "step-3", STORE) == []
    assert muonckpt.verify(root / "step-2") == []
    monkeypatch.undo()

    def refused(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "scandir", refused)
    with pytest.warns(CheckpointWarning, match="not deleted: cannot be listed"):
        assert prune(root, 1, root / "step-3", STORE) == []
    monkeypatch.undo()
    assert [f.path.name for f in complete_checkpoints(root, STORE)] == ["step-2", "step-3"]


@pytest.mark.parametrize("keep_last", [0, -1, True, 1.5, "2", None])
def test_keep_last_below_one_is_an_error_before_anything_is_deleted(saved, tmp_path, keep_last):
    root = tmp_path / "ckpt"
    put(saved, root, 1, at=1)
    put(saved, root, 2, at=2)
    with pytest.raises(CheckpointError, match="keep_last must be an int of at least 1"):
        prune(root, keep_last, root / "step-2", STORE)
    assert sorted(os.listdir(root)) == ["step-1", "step-2"]


# ---------------------------------------------------------------- the command line


def test_cli_latest_prints_the_path_or_exits_1(saved, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    run = CliRunner().invoke
    for where in (root, tmp_path / "not-yet"):
        result = run(app, ["latest", str(where)])
        assert result.exit_code == 1, result.output
        assert result.stdout == "" and result.stderr == f"no complete checkpoint in {where}\n"
    put(saved, root, 2, at=0)
    put(saved, root, 1, at=5)
    put(saved, root, 3, ".step-3.staging-0123abcd", at=10)
    result = run(app, ["latest", str(root)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{root / 'step-2'}\n"
    result = run(app, ["latest", str(root / "step-2" / DATA)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: is not a directory of checkpoints (file ")
    assert "Traceback" not in result.output


# ---------------------------------------------------------------- clean


MAKER = """
import sys
from muonckpt.storage import lease, transaction
staging = transaction.make_staging(sys.argv[1], False)
mailbox = staging.with_name(staging.name.replace(".staging-", ".steps-"))
mailbox.mkdir()
lease.take(mailbox, "mailbox")
print(staging, flush=True)
if sys.argv[2] == "hold":
    sys.stdin.readline()  # a save in progress, until the test says
"""
"""A process that stages a save of ``argv[1]`` as a background save of an earlier version did
(staging directory and mailbox directory ``.NAME.steps-X``, each with its lease) and then
dies, or holds them (``hold``) until told."""


def interrupted_save(saved: dict[int, Path], final: Path, *, hold: bool = False):
    """What a save of ``final`` leaves when its process dies (or, ``hold``, while it runs):
    the staging directory with its data files written, the mailbox with a message. Returns
    the two paths and, with ``hold``, the running process (close its stdin to end it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", MAKER, str(final), "hold" if hold else "exit"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    staging = Path(proc.stdout.readline().strip())
    if not hold:
        assert proc.wait(timeout=60) == 0
    shutil.copy(saved[2] / DATA, staging / DATA)
    mailbox = staging.with_name(staging.name.replace(".staging-", ".steps-"))
    (mailbox / "write-1.json").write_text('{"value": null}')
    return staging, mailbox, proc if hold else None


def unchanged_for_decades(*directories: Path) -> None:
    for directory in directories:
        for path in [*directory.iterdir(), directory]:
            os.utime(path, (1, 1), follow_symlinks=False)


def lookalikes(root: Path) -> list[Path]:
    """Directories of a user's, named like muonckpt's own, holding what a checkpoint holds."""
    made = []
    for name in (".llama.old-2023", ".mine.staging-00000000", ".runs.steps-0123abcd"):
        directory = root / name
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"\0" * 64)
        (directory / "model.safetensors.index.json").write_text("{}")
        (directory / "write-1.json").write_text("{}")
        made.append(directory)
    (root / ".empty.staging-89abcdef").mkdir()
    return [*made, root / ".empty.staging-89abcdef"]


@pytest.mark.dist
def test_clean_removes_only_old_leftovers_of_interrupted_saves(saved, tmp_path):
    """(issue 30) Only directories holding muonckpt's lease, no save uses, unchanged for
    ``older_than``; a user's directory named like ours is left whole, and each kept one is
    named with why."""
    root = tmp_path / "ckpt"
    put(saved, root, 1, at=1)
    old_staging, old_mailbox, _ = interrupted_save(saved, root / "step-2")
    fresh_staging, fresh_mailbox, _ = interrupted_save(saved, root / "step-3")
    shared, shared_mailbox, _ = interrupted_save(saved, root / "step-4")
    (shared / "notes.txt").write_text("mine")  # a user's file in a leftover of ours
    users = lookalikes(root)
    unchanged_for_decades(old_staging, old_mailbox, shared, shared_mailbox, *users)
    before = snapshot(root)

    cleaned = muonckpt.clean(root, older_than=3600)
    assert cleaned.removed == [old_staging, old_mailbox, shared_mailbox]  # by name
    gone = {p.name for p in cleaned.removed} | {str(shared.relative_to(root) / DATA)}
    gone.add(str(shared.relative_to(root) / ".muonckpt-lease"))
    assert snapshot(root) == {k: v for k, v in before.items() if not _under(k, gone)}
    why = dict(cleaned.skipped)
    for user in users:
        assert why.pop(user) == "holds no .muonckpt-lease, so muonckpt did not make it"
    assert why.pop(shared) == "kept in part: it holds notes.txt (not a checkpoint file: kept)"
    for fresh in (fresh_staging, fresh_mailbox):
        assert re.fullmatch(r"changed \d+ s ago, not older than 3600 s", why.pop(fresh))
    assert why == {}
    assert muonckpt.latest(root) == root / "step-1"
    assert muonckpt.clean(tmp_path / "nothing-here", older_than=0) == Cleaned([], [])
    with pytest.raises(CheckpointError, match="older_than"):
        muonckpt.clean(root, older_than=-1)


def _under(key: str, names: set[str]) -> bool:
    return any(key == name or key.startswith(name + os.sep) for name in names)


@pytest.mark.dist
def test_clean_never_removes_a_save_in_progress(saved, tmp_path):
    """(issue 30) A save in progress holds its lease: ``older_than=0`` leaves it, and once its
    process is gone its leftovers go."""
    root = tmp_path / "ckpt"
    staging, mailbox, proc = interrupted_save(saved, root / "step-2", hold=True)
    try:
        unchanged_for_decades(staging, mailbox)
        before = snapshot(root)
        cleaned = muonckpt.clean(root, older_than=0)
        assert cleaned.removed == []
        assert snapshot(root) == before
        for _, why in cleaned.skipped:
            assert why.startswith(f"in use: a running save holds its lease (pid {proc.pid} on ")
        assert [path for path, _ in cleaned.skipped] == [staging, mailbox]
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert muonckpt.clean(root, older_than=0).removed == [staging, mailbox]
    assert os.listdir(root) == []


@pytest.mark.dist
def test_clean_on_the_command_line_says_what_it_skipped_and_why(saved, tmp_path):
    """(issue 30) The real CLI: a user's directory named like ours (``.llama.old-2023``) is
    left whole; fresh leftovers under the default ``--older-than 3600`` are named, with why;
    old ones removed."""
    root = tmp_path / "ckpt"
    users = lookalikes(root)
    staging, mailbox, _ = interrupted_save(saved, root / "step-2")
    unchanged_for_decades(*users)
    before = snapshot(root)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "muonckpt.cli", "clean", str(root), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    done = cli()
    assert (done.returncode, done.stderr) == (0, "")
    lines = done.stdout.splitlines()
    assert snapshot(root) == before
    no_lease = "holds no .muonckpt-lease, so muonckpt did not make it"
    assert lines[:4] == [f"skipped {user}: {no_lease}" for user in sorted(users)]
    assert len(lines) == 6, lines
    fresh = r"changed \d+ s ago, not older than 3600 s"
    for path, line in zip((staging, mailbox), lines[4:]):
        assert re.fullmatch(rf"skipped {re.escape(str(path))}: {fresh}", line), line

    unchanged_for_decades(staging, mailbox)
    done = cli("--older-than", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == [f"removed {staging}", f"removed {mailbox}"]
    assert not staging.exists() and not mailbox.exists()
    assert snapshot(root) == {
        k: v for k, v in before.items() if not _under(k, {staging.name, mailbox.name})
    }


@pytest.mark.dist
@pytest.mark.parametrize(
    ("lease", "why"),
    [
        ("symlink", "holds no .muonckpt-lease, so muonckpt did not make it"),
        ("fifo", "its .muonckpt-lease is not one muonckpt wrote"),
        ("garbage", "its .muonckpt-lease is not one muonckpt wrote"),
        ("huge", "its .muonckpt-lease is not one muonckpt wrote"),
        ("directory", "its .muonckpt-lease is not one muonckpt wrote"),
    ],
)
def test_clean_is_not_fooled_by_a_lease_file_it_did_not_write(saved, tmp_path, lease, why):
    """A look-alike directory whose ``.muonckpt-lease`` is a symlink to a real lease, a FIFO
    (never opened blocking), not muonckpt's JSON, huge or a directory: left whole, said why."""
    root = tmp_path / "ckpt"
    real, _, _ = interrupted_save(saved, tmp_path / "elsewhere" / "step-1")
    fake = root / ".step-1.staging-0123abcd"
    fake.mkdir(parents=True)
    shutil.copy(saved[1] / DATA, fake / DATA)
    target = fake / ".muonckpt-lease"
    if lease == "symlink":
        target.symlink_to(real / ".muonckpt-lease")
    elif lease == "fifo":
        os.mkfifo(target)
    elif lease == "directory":
        target.mkdir()
    else:
        target.write_text("{}" if lease == "garbage" else json.dumps({"muonckpt": "x" * 10**4}))
    unchanged_for_decades(fake)
    before = snapshot(root)
    assert muonckpt.clean(root, older_than=0) == Cleaned([], [(fake, why)])
    assert snapshot(root) == before


def test_a_forged_lease_cannot_write_lines_of_its_own_through_clean(tmp_path):
    """What ``clean`` says of a lease comes from the lease's own text: a forged host with a
    newline or a terminal escape is shown escaped, on the one line of its directory."""
    root = tmp_path / "ckpt"
    fake = root / ".step-1.staging-0123abcd"
    fake.mkdir(parents=True)
    forged = {"muonckpt": "staging", "host": "elsewhere\nremoved /data\x1b[2J", "pid": 7}
    (fake / ".muonckpt-lease").write_text(json.dumps(forged))  # fresh: in use, said why
    cleaned = muonckpt.clean(root, older_than=0)
    assert cleaned.removed == [] and [path for path, _ in cleaned.skipped] == [fake]
    ((_, why),) = cleaned.skipped
    assert why.startswith("in use: its lease was renewed") and "pid 7 on 'elsewhere" in why
    assert "\n" not in why and "\x1b" not in why


def test_latest_for_every_rank_needs_a_process_group(saved, tmp_path):
    """``latest(root, collective=True)`` (rank 0 looks for every rank: one listing of the root,
    tests/test_s3_load.py) outside a process group is refused in one line, not answered as
    if one process were the job."""
    put(saved, tmp_path, 1, "step-1", at=0)
    assert muonckpt.latest(tmp_path) == tmp_path / "step-1"
    with pytest.raises(CheckpointError, match="collective=True needs an initialized"):
        muonckpt.latest(tmp_path, collective=True)
