"""Checkpoints with more files than the open-file limit (issue 20: ``verify`` of 1,500 rank files
under ``ulimit -n 1024`` reported 357 "Too many open files" problems; consolidate and load
failed). Every tool reads through a bounded cache of descriptors
(:class:`muonckpt.storage.ReaderCache`), so 10,000 rank files work under ``ulimit -n 256``.

The 10,000 files are made by ``reshard`` itself (to dp=10000), under the same limit, on a tmpfs
where there is one (10,000 fsyncs on a disk take minutes, in memory seconds). The default tier
makes and reads 1,500 (issue 20's count, past the limit as far), the ``slow`` tier 10,000."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

import muonckpt
from muonckpt import CheckpointError, storage
from muonckpt.files.pieces import PieceReader, open_checkpoint

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import torch
    import muonckpt
    from muonckpt import offline

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    src, root, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3])
    big = offline.reshard(src, root + "/big", dp=ranks, tp=1, allow_large_world=True)
    assert len(list(big.glob("rank-*.safetensors"))) == ranks
    assert muonckpt.verify(big) == [], muonckpt.verify(big)[:3]
    assert offline.summarize(big).totals.files == ranks
    full = offline.consolidate(big, root + "/full")
    assert all(r.equal for r in offline.diff(big, src))
    assert all(r.equal for r in offline.diff(full, big))
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 100)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 100)).sum().backward()
    opt.step()
    muonckpt.load(opt, big)
    steps = [s["step"].item() for s in opt.state_dict()["state"].values()]
    print("ok", steps)
    """
)


def _adamw_ckpt(path: Path) -> Path:
    torch.manual_seed(1)
    model = torch.nn.Linear(100, 100)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 100)).sum().backward()
    opt.step()
    return muonckpt.save(opt, path)


@pytest.mark.dist
@pytest.mark.parametrize(
    "ranks",
    [
        1_500,  # issue 20's count: six times the limit, 23 times the readers' cache of 64
        pytest.param(10_000, marks=pytest.mark.slow),  # past MAX_WORLD (allow_large_world)
    ],
)
def test_rank_files_past_an_open_file_limit_of_256(tmp_path, ranks):
    """``reshard`` to ``ranks`` rank files, then ``verify``, ``summarize``, ``consolidate``,
    ``diff`` and ``load`` of them, all under ``ulimit -n 256``."""
    src = _adamw_ckpt(tmp_path / "src")
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    root = tempfile.mkdtemp(prefix="muonckpt-10k-", dir=base)
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(src), root, str(ranks)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=840,
            check=False,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok [1.0, 1.0]"), done.stdout


def test_an_evicted_file_reopened_must_be_the_same_file(tmp_path, single_ckpt):
    """A reader past its cache's limit closes and reopens files; one replaced meanwhile is the
    checkpoint changing under the reader, never read as if it were the file first opened."""
    ckpt = muonckpt.offline.reshard(single_ckpt(1), tmp_path / "ckpt", dp=2, tp=1)
    checkpoint, manifest = open_checkpoint(ckpt)
    directory = ckpt
    with PieceReader(checkpoint, manifest, open_files=1) as reader:
        files = [f.name for f in manifest.files]
        reader.reader(files[0])
        reader.reader(files[1])  # evicts files[0]
        assert reader.opens == 2
        copy = tmp_path / "copy"
        shutil.copy2(directory / files[0], copy)
        os.replace(copy, directory / files[0])  # same bytes, another file
        with pytest.raises(CheckpointError, match="changed while reading"):
            reader.reader(files[0])
    assert storage.ReaderCache(3).limit == 3
