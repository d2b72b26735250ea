"""Manifests are strict JSON (docs/format.md): a non-finite number, a key twice in one object
or nesting past the limit is refused by ``verify`` and by every tool that reads the manifest,
as a CheckpointError naming the file, never a silently wrong resume (issue 20: ``NaN`` in a
hyperparameter used to load, and the next step made every param NaN)."""

from __future__ import annotations

import shutil

import pytest

import muonckpt
from muonckpt import CheckpointError, offline

from .fixture_model import build, initial_params

EDITS = {
    "NaN": ('"lr":0.05', '"lr":NaN'),
    "Infinity": ('"lr":0.05', '"lr":-Infinity'),
    "a float that overflows": ('"lr":0.05', '"lr":1e400'),
    "a key twice": ('"lr":0.05', '"lr":0.05,"lr":0.5'),
    "deep nesting": ('"lr":0.05', '"lr":' + "[" * 40 + "0.05" + "]" * 40),
}


@pytest.fixture
def damaged(single_ckpt, tmp_path):
    def make(edit: str):
        path = shutil.copytree(single_ckpt(1), tmp_path / "ckpt")
        manifest = path / "manifest.json"
        old, new = EDITS[edit]
        text = manifest.read_text()
        assert text.count(old) == 1  # the edit lands where it means to
        manifest.write_text(text.replace(old, new))
        return path

    return make


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_manifest_that_is_not_strict_json_is_refused_by_every_reader(damaged, tmp_path, edit):
    ckpt = damaged(edit)
    (problem,) = muonckpt.verify(ckpt)
    assert "manifest is not valid JSON" in str(problem) and str(ckpt) in str(problem)
    opt, *_ = build(1, 1, initial_params())
    readers = {
        "load": lambda: muonckpt.load(opt, ckpt),
        "read_manifest": lambda: muonckpt.read_manifest(ckpt),
        "consolidate": lambda: offline.consolidate(ckpt, tmp_path / "full"),
        "reshard": lambda: offline.reshard(ckpt, tmp_path / "2x1", dp=2, tp=1),
        "convert": lambda: offline.convert(ckpt, tmp_path / "torch", to="torch"),
        "summarize": lambda: offline.summarize(ckpt),
    }
    for name, read in readers.items():
        with pytest.raises(CheckpointError, match="manifest is not valid JSON"):
            read()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], name  # nothing written
    assert muonckpt.latest(tmp_path) is None  # and never picked to resume from
