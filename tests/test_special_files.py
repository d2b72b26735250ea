"""A checkpoint's files are its own regular files: a FIFO put in place of one never blocks a
reader, and a symlink in place of one is never followed out of the checkpoint (issue 20)."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

import muonckpt
from muonckpt import CheckpointError, offline, storage

from .fixture_model import build, initial_params, single_process_optimizer


def _finishes(work, seconds: float = 30.0):
    """``work()``'s value or exception, failing the test if it blocks for ``seconds``."""
    done: dict[str, object] = {}

    def run() -> None:
        try:
            done["value"] = work()
        except Exception as exc:
            done["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for {seconds} s"
    return done


def test_a_fifo_in_place_of_the_manifest_is_refused_not_waited_on(single_ckpt, tmp_path):
    ckpt = shutil.copytree(single_ckpt(1), tmp_path / "ckpt")
    (ckpt / "manifest.json").unlink()
    os.mkfifo(ckpt / "manifest.json")
    (problem,) = _finishes(lambda: muonckpt.verify(ckpt))["value"]
    assert "manifest.json" in str(problem)
    opt, *_ = build(1, 1, initial_params())
    done = _finishes(lambda: muonckpt.load(opt, ckpt))
    assert isinstance(done.get("error"), CheckpointError), done
    # and swapped in after that check: the read itself refuses it
    done = _finishes(lambda: storage.read_text(ckpt / "manifest.json"))
    assert "not a regular file" in str(done.get("error")), done


def test_a_fifo_swapped_in_for_a_data_file_is_refused_not_waited_on(single_ckpt, tmp_path):
    """The readers check each data file before they open it; one swapped for a FIFO after
    that check is refused by the open itself."""
    data = shutil.copytree(single_ckpt(1), tmp_path / "ckpt") / "rank-00000-of-00001.safetensors"
    data.unlink()
    os.mkfifo(data)
    done = _finishes(lambda: storage.SafetensorsReader(data))
    assert isinstance(done.get("error"), CheckpointError), done
    assert "not a regular file" in str(done["error"]) and str(data) in str(done["error"])


def test_a_symlinked_data_file_is_not_followed_out_of_the_checkpoint(single_ckpt, tmp_path):
    ckpt = shutil.copytree(single_ckpt(1), tmp_path / "ckpt")
    data = ckpt / "rank-00000-of-00001.safetensors"
    outside = tmp_path / "outside.safetensors"
    data.rename(outside)
    data.symlink_to(outside)  # the same bytes, but not the checkpoint's own file
    assert any("symlink" in str(p) for p in muonckpt.verify(ckpt))
    with pytest.raises(CheckpointError, match="symlink"):
        muonckpt.load(build(1, 1, initial_params())[0], ckpt)


def test_a_symlinked_index_file_is_refused_not_copied(tmp_path):
    """(issue 20) convert copied whatever a symlinked index file pointed to into its output,
    and verify called the checkpoint sound."""
    opt = single_process_optimizer(1)
    ckpt = muonckpt.save(opt, tmp_path / "ckpt", consolidated=True, max_shard_size=2000)
    index = ckpt / "optimizer.safetensors.index.json"
    secret = tmp_path / "secret.json"
    index.rename(secret)
    index.symlink_to(secret)
    assert any("symlink" in str(p) and str(index) in str(p) for p in muonckpt.verify(ckpt))
    with pytest.raises(CheckpointError, match="symlink"):
        offline.convert(ckpt, tmp_path / "converted", to="torch")
    assert not (tmp_path / "converted").exists()
