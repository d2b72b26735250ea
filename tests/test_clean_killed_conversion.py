"""(issue 50, finding 7) A conversion to a foreign format killed mid-write (``convert --to
deepspeed``, ``--to megatron``, ``--format dcp``, run by the CLI in a process SIGKILLed right
after its first files are written, forked from one helper that imports torch once) leaves a
staging directory that ``clean`` removes whole: its lease records the format, whose files
alone are deleted; a user's file placed inside is kept."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import muonckpt
from muonckpt import storage
from muonckpt.interop.megatron import reader as megatron
from muonckpt.storage import lease

from .fixture_model import single_process_optimizer
from .kill_helpers import REPO

pytestmark = pytest.mark.dist

KILLED = r"""
import json, os, signal, sys
import torch
import torch.distributed.checkpoint  # once, not in each child
torch.set_num_threads(1)  # no OpenMP pool to inherit across fork
import muonckpt.interop
from muonckpt.cli import main
from muonckpt.interop.dcp import files as dcp_files
from muonckpt.interop.deepspeed import files as deepspeed_files

def killed_after(original):
    def call(*args, **kwargs):
        original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)  # mid-write: files written, nothing published
    return call

deepspeed_files.save = killed_after(deepspeed_files.save)
dcp_files.write_dcp = killed_after(dcp_files.write_dcp)
for args in json.loads(sys.argv[1]):
    child = os.fork()
    if child == 0:
        sys.argv = ["muonckpt", *args]
        main()
        os._exit(0)
    print(-os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), flush=True)
"""
"""Each command of argv[1] (JSON) run by the CLI in a forked child, SIGKILLed right after its
first DeepSpeed rank file, or its DCP files, are written; prints each child's signal."""

CASES = {
    "deepspeed": ("packaged", ["--to", "deepspeed", "--world", "2"]),
    "megatron": ("megatron", ["--to", "megatron", "--tp", "2", "--dp", "1"]),
    "dcp": ("packaged", ["--format", "dcp", "--to", "torch"]),
}
VARIANTS = ("alone", "with-a-user-file")


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """Each case's conversion, twice, killed mid-write at ``ROOT/CASE-VARIANT/out``; ROOT."""
    root = tmp_path_factory.mktemp("killed")
    packaged = muonckpt.save(single_process_optimizer(3), root / "packaged", consolidated=True)
    fixture = Path(__file__).parent / "fixtures" / "megatron" / "tp2_dp1" / "checkpoint"
    sources = {"packaged": packaged, "megatron": megatron.from_megatron(fixture, root / "mc").path}
    commands = []
    for case, (source, options) in CASES.items():
        for variant in VARIANTS:
            out = root / f"{case}-{variant}" / "out"
            commands.append(["convert", str(sources[source]), "-o", str(out), *options])
    proc = subprocess.run(
        [sys.executable, "-c", KILLED, json.dumps(commands)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.stdout.split() == [str(signal.SIGKILL)] * len(commands), proc.stderr
    return root


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_clean_removes_a_killed_conversions_staging(killed, case, variant):
    where = killed / f"{case}-{variant}"
    (staging,) = where.glob(".out.staging-*")
    written = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*"))
    assert ".muonckpt-lease" in written and len(written) > 1, written  # files of the format
    if variant == "with-a-user-file":
        (staging / "notes.txt").write_text("mine")
    cleaned = muonckpt.clean(where, 0)
    assert not (where / "out").exists()
    if variant == "with-a-user-file":
        assert sorted(p.name for p in staging.iterdir()) == ["notes.txt"]
        assert (staging / "notes.txt").read_text() == "mine"
        assert [path for path, _ in cleaned.skipped] == [staging], cleaned
        assert "notes.txt (not written by the conversion: kept)" in cleaned.skipped[0][1]
    else:
        assert cleaned.removed == [staging] and not staging.exists(), (cleaned, written)
        assert list(where.iterdir()) == []


@pytest.mark.parametrize(
    "recorded",
    [{"name": "deepspeed", "writes": [".*"]}, "evil", ["deepspeed"], None],
    ids=["patterns-in-the-lease", "unknown-name", "not-a-name", "no-output"],
)
def test_what_clean_deletes_never_comes_from_the_lease(tmp_path, recorded):
    """(issue 51 review) A lease names its foreign format; the files that format's writer may
    leave are the package's own table (``storage.outputs.OUTPUTS``), never read from the file:
    a lease that records patterns, an unknown name or no format leaves a foreign file and a
    user's file in place, and a lease of this version's own kind removes only the format's."""
    staging = tmp_path / ".out.staging-0123abcd"
    storage.make_directory(staging)
    lease.take(staging, "staging", "deepspeed")
    lease.release(staging)
    record = json.loads((staging / lease.LEASE_NAME).read_text())
    record["output"] = recorded
    (staging / lease.LEASE_NAME).write_text(json.dumps(record))
    (staging / "latest").write_text("global_step3")
    (staging / "notes.txt").write_text("mine")
    muonckpt.clean(tmp_path, 0)
    assert (staging / "notes.txt").read_text() == "mine"
    assert (staging / "latest").exists()


def test_a_killed_conversions_own_lease_removes_only_its_format_files(tmp_path):
    staging = tmp_path / ".out.staging-0123abcd"
    storage.make_directory(staging)
    lease.take(staging, "staging", "deepspeed")
    lease.release(staging)
    (staging / "latest").write_text("global_step3")
    (staging / "notes.txt").write_text("mine")
    muonckpt.clean(tmp_path, 0)
    assert sorted(p.name for p in staging.iterdir()) == ["notes.txt"]
