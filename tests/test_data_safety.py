"""Data safety under hostile and unlucky use (issue 12), on real files and real processes.

Only muonckpt's own files are ever deleted (``--force`` / ``overwrite=True`` replace only a
muonckpt checkpoint, a symlinked output is replaced as a link); two writers of one path race
safely; output names that cannot work are refused before anything is written; a reader never
dies of a file shrinking under it and names a checkpoint that changed while it read; and every
rank learns every rank's failure, whatever its exception type.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import muonckpt
from muonckpt import CheckpointError, storage
from muonckpt.cli import app
from muonckpt.distributed.launch import run_distributed
from muonckpt.errors import CheckpointWarning
from muonckpt.offline import tools as offline
from muonckpt.storage import transaction

from .commit_race import DATA, race, racer
from .fixture_model import build, initial_params, train

REPO = Path(__file__).resolve().parents[1]
"""Where a ``python -c`` helper finds ``tests.fixture_model``."""


def _opt(steps: int):
    opt, sharded, dp_rank, tp_rank = build(1, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, steps)
    return opt


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    """A small single-process checkpoint of the package's example model."""
    return muonckpt.save(_opt(2), tmp_path_factory.mktemp("safety") / "ck")


@pytest.fixture(autouse=True)
def _bounded(monkeypatch):
    monkeypatch.setattr(offline, "WORKER_TIMEOUT", 60.0)


def _tree(root: Path) -> dict[str, object]:
    """Every entry under ``root`` (symlinks not followed): file bytes, link target or a dir."""
    found: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            found[name] = ("link", os.readlink(path))
        elif path.is_dir():
            found[name] = "dir"
        else:
            found[name] = path.read_bytes()
    return found


def _cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# ---------------------------------------------------------------- only our own files


def _user_data(root: Path, kind: str, ck: Path) -> tuple[Path, str]:
    """A directory (or file) that is not a muonckpt checkpoint, and what the refusal says."""
    target = root / "userdata"
    if kind == "regular file":
        target.write_text("precious")
        return target, "exists and is not a checkpoint directory"
    target.mkdir()
    if kind == "user file":
        (target / "README.md").write_text("precious")
        (target / "manifest.json").write_text('{"format": "muonckpt"}')
        return target, "holds user file README.md"
    if kind == "checkpoint inside":  # the consolidate t/userdata/ck -o t/userdata
        shutil.copytree(ck, target / "ck")
        (target / "notes.txt").write_text("precious")
        return target, "holds directory ck, user file notes.txt"
    if kind == "hf model":
        (target / "model.safetensors").write_bytes(b"weights")
        (target / "config.json").write_text("{}")
        return target, "holds user file config.json"
    if kind == "bare safetensors":
        (target / "model.safetensors").write_bytes(b"weights")
        return target, "it has no manifest.json"
    if kind == "foreign manifest":
        (target / "model.safetensors").write_bytes(b"weights")
        (target / "manifest.json").write_text('{"format": "other"}')
        return target, 'no "format": "muonckpt"'
    if kind == "broken manifest":
        (target / "manifest.json").write_text("{")
        return target, "not valid JSON"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "regular file",
        "user file",
        "checkpoint inside",
        "hf model",
        "bare safetensors",
        "foreign manifest",
        "broken manifest",
    ],
)
def test_force_never_replaces_what_is_not_a_checkpoint(ck, tmp_path, kind):
    target, says = _user_data(tmp_path, kind, ck)
    source = target / "ck" if kind == "checkpoint inside" else ck
    before = _tree(tmp_path)
    writers = {
        "consolidate": lambda: offline.consolidate(source, target, overwrite=True),
        "reshard": lambda: offline.reshard(source, target, dp=2, tp=1, overwrite=True),
        "save": lambda: muonckpt.save(_opt(1), target, overwrite=True),
    }
    # A rewrite into a directory that holds its own source is refused for that first.
    inside = "contains the source checkpoint" if kind == "checkpoint inside" else says
    for name, write in writers.items():
        with pytest.raises(CheckpointError, match="userdata") as caught:
            write()
        assert (says if name == "save" else inside) in str(caught.value), (name, caught.value)
        assert _tree(tmp_path) == before, name
    line = _one_error_line(_cli("consolidate", source, "-o", target, "--force"))
    assert inside in line and str(target) in line
    assert _tree(tmp_path) == before


def test_force_replaces_a_checkpoint_and_an_empty_directory(ck, tmp_path):
    out = offline.consolidate(ck, tmp_path / "out")
    assert muonckpt.read_manifest(out).kind == "consolidated"
    offline.reshard(ck, out, dp=2, tp=1, overwrite=True)
    assert muonckpt.read_manifest(out).topology == {"dp": 2, "tp": 1}
    (tmp_path / "empty").mkdir()
    offline.consolidate(ck, tmp_path / "empty", overwrite=True)
    assert muonckpt.verify(tmp_path / "empty") == []
    in_place = shutil.copytree(ck, tmp_path / "in-place")
    offline.consolidate(in_place, in_place, overwrite=True)  # rewritten where it is
    assert muonckpt.read_manifest(in_place).kind == "consolidated"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "in-place", "out"]


def test_output_overlapping_its_source_is_refused(ck, tmp_path):
    outer = tmp_path / "outer"
    source = shutil.copytree(ck, outer / "ck")
    with pytest.raises(CheckpointError, match="contains the source checkpoint"):
        storage.check_target(outer, True, source=source)
    with pytest.raises(CheckpointError, match="is inside the source checkpoint"):
        storage.check_target(source / "out", False, source=source)
    link = tmp_path / "link"
    link.symlink_to(outer)
    with pytest.raises(CheckpointError, match="is inside the source checkpoint"):
        storage.check_target(link / "ck" / "out", False, source=source)
    storage.check_target(source, True, source=source)  # the same directory: in place
    assert sorted(p.name for p in source.iterdir()) == sorted(p.name for p in ck.iterdir())


def test_single_process_output_inside_its_source_is_refused(ck, tmp_path):
    source = shutil.copytree(ck, tmp_path / "ck")
    for rewrite in (
        lambda: offline.consolidate(source, source / "out"),
        lambda: offline.reshard(source, source / "out", dp=2, tp=1),
        lambda: offline.convert(source, source / "out", to="torch"),
    ):
        with pytest.raises(CheckpointError, match="inside the source checkpoint"):
            rewrite()
        assert sorted(p.name for p in source.iterdir()) == sorted(p.name for p in ck.iterdir())


def test_symlinked_output_replaces_the_link_never_its_target(ck, tmp_path):
    step_a = offline.consolidate(ck, tmp_path / "step-A")
    kept = _tree(step_a)
    latest = tmp_path / "latest"
    latest.symlink_to("step-A")
    with pytest.raises(CheckpointError, match="already exists"):
        offline.consolidate(ck, latest)
    writers = [
        lambda: offline.reshard(ck, latest, dp=2, tp=1, overwrite=True),
        lambda: muonckpt.save(_opt(3), latest, overwrite=True),
        lambda: _cli("consolidate", ck, "-o", latest, "--force"),
    ]
    for write in writers:
        latest.unlink(missing_ok=True) if latest.is_symlink() else shutil.rmtree(latest)
        latest.symlink_to("step-A")
        write()
        assert latest.is_dir() and not latest.is_symlink()
        assert muonckpt.verify(latest) == []
        assert _tree(step_a) == kept  # the old target: untouched, manifest and all
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-A"]
    # a dangling link, or one to something else, is refused and left as it is
    user = tmp_path / "user"
    user.mkdir()
    (user / "README.md").write_text("precious")
    for target, says in [("nowhere", "dangling symlink"), ("user", "holds user file README.md")]:
        link = tmp_path / f"to-{target}"
        link.symlink_to(target)
        with pytest.raises(CheckpointError, match=says):
            offline.consolidate(ck, link, overwrite=True)
        assert link.is_symlink() and os.readlink(link) == target
    assert (user / "README.md").read_text() == "precious"


def test_discard_and_retire_delete_only_checkpoint_files(tmp_path):
    for remove in (transaction.discard, transaction.retire):
        staging = tmp_path / f".ck.staging-{remove.__name__[:2]}345678"
        (staging / "sub").mkdir(parents=True)
        names = [
            "manifest.json",
            "rank-00000-of-00002.safetensors",
            ".rank-00001-of-00002.safetensors.part",
            ".manifest.json.tmp-123",
            "optimizer.safetensors.index.json",
            "rank-00000-of-00002.pieces.json",
            ".rank-00000-of-00002.pieces.json.tmp-123",
        ]
        for name in [*names, "README.md", "sub/inner.safetensors"]:
            (staging / name).write_text(name)
        outside = tmp_path / "outside.safetensors"
        outside.write_text("precious")
        (staging / "link.safetensors").symlink_to(outside)
        with pytest.warns(CheckpointWarning, match="README.md") as caught:
            remove(staging)
        assert "sub" in str(caught[0].message)
        assert sorted(p.name for p in staging.iterdir()) == ["README.md", "link.safetensors", "sub"]
        assert (staging / "sub" / "inner.safetensors").exists()
        assert outside.read_text() == "precious"


# ---------------------------------------------------------------- racing writers


def _race(tmp_path: Path, overwrite: bool, trials: int = 40) -> dict[int, dict[str, str]]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2, timeout=30), ctx.Queue()
    args = [(who, str(tmp_path), trials, overwrite, barrier, results) for who in ("A", "B")]
    outcomes = race(ctx, racer, args, results, trials)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"t{t:03d}" for t in range(trials)]
    return outcomes


def _writer_of(final: Path) -> str:
    writer = json.loads((final / "manifest.json").read_text())["writer"]
    assert (final / DATA).read_text() == writer  # whole: manifest and data from one writer
    assert sorted(p.name for p in final.iterdir()) == sorted([DATA, "manifest.json"])
    return writer


@pytest.mark.dist
def test_racing_writers_without_overwrite_exactly_one_wins(tmp_path):
    outcomes = _race(tmp_path, overwrite=False)
    winners = []
    for trial, by in sorted(outcomes.items()):
        ok = [who for who, outcome in by.items() if outcome == "ok"]
        assert len(ok) == 1, (trial, by)
        (loser,) = set(by) - set(ok)
        assert "was created by another writer while this save ran" in by[loser], by
        assert _writer_of(tmp_path / f"t{trial:03d}") == ok[0]
        winners.append(ok[0])
    print(f"winners {''.join(winners)}")


@pytest.mark.dist
def test_racing_writers_with_overwrite_both_commit_and_the_last_wins_whole(tmp_path):
    outcomes = _race(tmp_path, overwrite=True)
    for trial, by in sorted(outcomes.items()):
        assert by == {"A": "ok", "B": "ok"}, (trial, by)
        assert _writer_of(tmp_path / f"t{trial:03d}") in ("A", "B")


def _refuse_deletes_under(monkeypatch, prefix: str, names: tuple[str, ...]) -> None:
    """Deleting ``names`` in directories called ``prefix...`` fails with EACCES (these tests
    may run as root, which chmod would not stop)."""
    unlink = Path.unlink

    def refusing(self: Path, missing_ok: bool = False) -> None:
        if self.parent.name.startswith(prefix) and self.name in names:
            raise PermissionError(13, "Permission denied", str(self))
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refusing)


def test_a_commit_is_reported_as_it_happened_when_the_old_cannot_be_deleted(
    ck, tmp_path, monkeypatch
):
    target = muonckpt.save(_opt(1), tmp_path / "ckpt")
    _refuse_deletes_under(monkeypatch, ".ckpt.staging-", ("manifest.json",))
    with pytest.warns(CheckpointWarning, match="but the replaced one .* cannot be deleted"):
        muonckpt.save(_opt(2), target, overwrite=True)
    assert muonckpt.verify(target) == [] and muonckpt.read_manifest(target).step == 2
    (left,) = [p for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert (left / "manifest.json").exists()  # the old one, whole, named as never a checkpoint
    with pytest.raises(CheckpointError, match="staging directory"):
        muonckpt.read_manifest(left)
    shutil.rmtree(left)

    monkeypatch.undo()
    _refuse_deletes_under(monkeypatch, ".ckpt.staging-", ("rank-00000-of-00001.safetensors",))
    with pytest.warns(CheckpointWarning, match="could not be deleted entirely") as caught:
        muonckpt.save(_opt(3), target, overwrite=True)
    assert "rank-00000-of-00001.safetensors (Permission denied)" in str(caught[0].message)
    assert muonckpt.read_manifest(target).step == 3
    result = _cli("consolidate", ck, "-o", target, "--force")
    assert result.exit_code == 0, result.output
    done, warning, *wrote = result.stderr.strip().splitlines()  # progress (no terminal) first
    assert done.startswith("consolidate: done, ") and warning.startswith(
        "warning: the new checkpoint is in place"
    ), result.stderr
    assert wrote[0].startswith("wrote "), result.stderr
    assert muonckpt.read_manifest(target).kind == "consolidated"


# ---------------------------------------------------------------- names that cannot work


@pytest.mark.parametrize(
    ("name", "says"),
    [
        (".ck.staging-0123abcd", "named like a muonckpt staging directory"),
        (".ck.old-4242", "named like a muonckpt staging directory"),
        ("x" * 238, "at most 237 fit"),
        ("..", "not a name"),
    ],
)
def test_unusable_output_names_are_refused_before_anything_is_written(ck, tmp_path, name, says):
    target = tmp_path / "new" / "parents" / name
    writers = [
        lambda: offline.consolidate(ck, target),
        lambda: offline.reshard(ck, target, dp=2, tp=1, overwrite=True),
        lambda: muonckpt.save(_opt(1), target),
    ]
    for write in writers:
        with pytest.raises(CheckpointError, match=says):
            write()
        assert list(tmp_path.iterdir()) == []  # not even the parents
    assert says in _one_error_line(_cli("consolidate", ck, "-o", target))
    assert list(tmp_path.iterdir()) == []


def test_longest_usable_name_works(ck, tmp_path):
    out = offline.consolidate(ck, tmp_path / "new" / ("x" * 237))
    assert muonckpt.verify(out) == []


# ---------------------------------------------------------------- readers


TRUNCATE_UNDER_VERIFY = r"""
import os, random, shutil, sys, threading, time
import numpy as np
from muonckpt import storage
from muonckpt.errors import CheckpointError
from muonckpt.layout.topology import Strided

root = sys.argv[1]
data = np.random.default_rng(0).integers(0, 256, 48 << 20, dtype=np.uint8)
template = os.path.join(root, "template.safetensors")
with storage.SafetensorsWriter(template, {"t": ("U8", (data.size,))}) as out:
    out.write("t", data)
    record = out.commit()["t"]
rng = random.Random(12)
outcomes = []
target = bytearray(data.size)
for trial in range(int(sys.argv[2])):
    path = os.path.join(root, "t.safetensors")
    shutil.copyfile(template, path)
    with storage.SafetensorsReader(path) as reader:
        delay = rng.uniform(0, 0.012)
        size = rng.randrange(8, record.offset + data.size)
        cut = threading.Timer(delay, os.truncate, (path, size))
        cut.start()
        try:
            if sys.argv[3] == "verify":
                reader.verify("t", record.checksums)
            else:  # what load, consolidate and reshard call
                whole = [Strided(0, 0, data.size, 1, 0, 0)]
                reader.read_groups("t", memoryview(target), whole, checksums=record.checksums)
            outcomes.append("ok")
        except CheckpointError as exc:
            outcomes.append(str(exc))
        cut.join()
print("\n".join(outcomes))
"""


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["verify", "read_groups"])
def test_readers_survive_a_file_truncated_under_them(tmp_path, mode):
    done = subprocess.run(
        [sys.executable, "-c", TRUNCATE_UNDER_VERIFY, str(tmp_path), "30", mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)  # -7 would be SIGBUS
    outcomes = done.stdout.splitlines()
    assert len(outcomes) == 30
    errors = [o for o in outcomes if o != "ok"]
    assert errors, "no truncation landed during a verify: the test proves nothing"
    for error in errors:
        assert "file truncated" in error and "changed while reading" in error, error
    print(f"{len(errors)} of {len(outcomes)} reads raced a truncation")


WRITER_LOOP = r"""
import sys
import torch
torch.set_num_threads(1)
import muonckpt
from tests.fixture_model import build, initial_params, train

opt, sharded, dp_rank, tp_rank = build(1, 1, initial_params())
train(opt, sharded, dp_rank, tp_rank, 0, 1)
tensors = [v for state in opt.state.values() for v in state.values()]
save = 0
for t in tensors:
    t.fill_(save)  # every save's tensors all hold its number, the first's too
muonckpt.save(opt, sys.argv[1], overwrite=True)
print("ready", flush=True)
while True:
    save += 1
    for t in tensors:
        t.fill_(save)
    muonckpt.save(opt, sys.argv[1], overwrite=True)
"""


MIN_READS_RACING_A_WRITER = 30
"""Reads (verify, load, consolidate in turn) against the writer at least, ..."""
READS_RACING_A_WRITER = 3000
"""... and at most, if both outcomes have not been seen by then (the hang guard)."""
OUTCOMES = ("whole", "changed while reading")
"""What a read racing the writer may find."""


@pytest.mark.dist
def test_a_reader_racing_a_writer_gets_a_whole_checkpoint_or_changed_while_reading(tmp_path):
    path = tmp_path / "ckpt"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER_LOOP, str(path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    counts: dict[str, int] = {}
    try:
        assert writer.stdout.readline().strip() == "ready"
        opt = _opt(1)
        for turn in range(READS_RACING_A_WRITER):
            if turn >= MIN_READS_RACING_A_WRITER and _seen_both(counts):
                break
            operation = ("verify", "load", "consolidate")[turn % 3]
            try:
                if operation == "verify":
                    problems = muonckpt.verify(path)
                    if problems:
                        raise problems[0]
                elif operation == "load":
                    muonckpt.load(opt, path)
                    state = [v for s in opt.state.values() for v in s.values()]
                    values = {x for v in state for x in v.unique().tolist()}
                    assert len(values) == 1, f"a mixed load: {sorted(values)}"
                    assert int(next(iter(values))) == next(iter(values)) >= 0
                else:
                    shutil.rmtree(tmp_path / "out", ignore_errors=True)
                    offline.consolidate(path, tmp_path / "out")
                outcome = OUTCOMES[0]
            except CheckpointError as exc:
                assert "changed while reading" in str(exc), str(exc)
                assert "checksum mismatch" not in str(exc)
                outcome = OUTCOMES[1]
            counts[f"{operation}: {outcome}"] = counts.get(f"{operation}: {outcome}", 0) + 1
    finally:
        writer.kill()
        writer.wait()
    print(counts)
    assert _seen_both(counts), f"{READS_RACING_A_WRITER} reads never saw both outcomes: {counts}"


def _seen_both(counts: dict[str, int]) -> bool:
    """Whether some reads found the checkpoint whole and some found it changed under them."""
    return {key.split(": ", 1)[1] for key in counts} == set(OUTCOMES)


# ---------------------------------------------------------------- every rank learns


def _fail_on(rank: int, owner: object, name: str, error: Exception) -> None:
    """On ``rank`` only, make ``owner.name`` raise ``error`` (a non-library exception)."""
    import torch.distributed as dist

    if dist.get_rank() == rank:
        setattr(owner, name, lambda *a, **k: (_ for _ in ()).throw(error))


def failing_ranks(root: str, src: str) -> dict[str, str]:
    """(in 2 gloo ranks) Three collective writes, each with one rank raising a non-library
    error; returns what every rank raised."""
    from muonckpt import storage
    from muonckpt.files import writing
    from muonckpt.offline import tools as offline

    seen = {}
    original = (storage.SafetensorsWriter.write, writing.write_files)
    original_write = storage.SharedSafetensorsFile.write
    cases = {
        "per-rank": (1, storage.SafetensorsWriter, "write", OSError(28, "No space left on device")),
        "consolidated": (0, writing, "write_files", RuntimeError("disk on fire")),
        "reshard": (1, storage.SharedSafetensorsFile, "write", ValueError("bad bytes")),
    }
    for case, (rank, owner, name, error) in cases.items():
        _fail_on(rank, owner, name, error)
        try:
            if case == "reshard":
                offline.reshard(src, f"{root}/{case}", dp=2, tp=1, collective=True)
            else:
                opt, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
                train(opt, sharded, dp_rank, tp_rank, 0, 1)
                muonckpt.save(opt, f"{root}/{case}", consolidated=case == "consolidated")
            seen[case] = "no error"
        except CheckpointError as exc:
            seen[case] = str(exc)
        storage.SafetensorsWriter.write, writing.write_files = original
        storage.SharedSafetensorsFile.write = original_write
    return seen


@pytest.mark.dist
def test_every_rank_learns_a_non_library_failure(ck, tmp_path):
    ranks = run_distributed(failing_ranks, 2, str(tmp_path), str(ck), timeout=60)
    expected = {
        "per-rank": "rank 1: OSError: [Errno 28] No space left on device",
        "consolidated": "rank 0: RuntimeError: disk on fire",
        "reshard": "rank 1: ValueError: bad bytes",
    }
    for seen in ranks:
        for case, message in expected.items():
            assert message in seen[case], (case, seen[case])
    assert list(tmp_path.iterdir()) == []  # nothing committed, no staging left


def test_a_step_turns_any_exception_into_the_protocol_error_naming_rank_type_and_place():
    from muonckpt.distributed import group_steps

    steps = group_steps.CollectiveSteps("save", [0], 0, CheckpointError)

    def boom() -> None:
        raise KeyError("missing")

    with pytest.raises(CheckpointError) as info:
        steps.each_then_root("write", boom, lambda values: values)
    assert str(info.value).startswith(
        "save (write): rank 0: KeyError: 'missing' (at test_data_safety.py:"
    )
    assert isinstance(info.value.__cause__, KeyError)
    late = lambda values: (_ for _ in ()).throw(ValueError("late"))  # noqa: E731
    with pytest.raises(CheckpointError, match=r"^save \(commit\): rank 0: ValueError: late"):
        steps.each_then_root("commit", lambda: None, late)
    assert steps.each_then_root("stage", lambda: 7, lambda values: values) == [7]
    with pytest.raises(KeyboardInterrupt):
        steps.each_then_root("stage", lambda: (_ for _ in ()).throw(KeyboardInterrupt()), list)


def test_a_data_file_truncated_before_the_commit_is_not_published(tmp_path, monkeypatch):
    from muonckpt.files import writing

    from .fixture_model import single_process_optimizer

    write_files = writing.write_files

    def then_truncated(*args, **kwargs):
        written = write_files(*args, **kwargs)
        (staging,) = [p for p in tmp_path.iterdir() if ".staging-" in p.name]
        data = sorted(staging.glob("*.safetensors"))[0]
        os.truncate(data, data.stat().st_size - 1)
        return written

    monkeypatch.setattr(writing, "write_files", then_truncated)
    with contextlib.suppress(CheckpointError):  # refused: what should happen
        muonckpt.save(single_process_optimizer(2), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() or muonckpt.verify(tmp_path / "ckpt") == []
