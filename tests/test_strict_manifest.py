"""Manifests are strict JSON (docs/format.md): a non-finite number, a key twice in one object
or nesting past the limit is refused by ``verify`` and by every tool that reads the manifest,
as a CheckpointError naming the file, never a silently wrong resume (issue 20: ``NaN`` in a
hyperparameter used to load, and the next step made every param NaN)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

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


def _adamw_ckpt(path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return muonckpt.save(opt, path), opt


FIELD_EDITS = {
    # (which checkpoint, old text, new text, what the refusal says)
    "a param's group out of range": ("muon", '"group":0', '"group":7', "says group 7"),
    "momentum 1": (
        "muon",
        '"momentum_form":"sum","momentum":0.9',
        '"momentum_form":"sum","momentum":1.0',
        "[0, 1)",
    ),
    "momentum null": (
        "muon",
        '"momentum_form":"sum","momentum":0.9',
        '"momentum_form":"sum","momentum":null',
        "[0, 1)",
    ),
    "a step that is a string": (
        "adamw",
        '"value":1.0,"dtype":"F32"',
        '"value":"1","dtype":null',
        "non-negative number",
    ),
    "a scalar its dtype cannot hold": (
        "adamw",
        '"value":1.0,"dtype":"F32"',
        '"value":1e30,"dtype":"I32"',
        "not a I32 value",
    ),
}


@pytest.mark.parametrize("edit", list(FIELD_EDITS))
def test_a_field_out_of_range_is_refused_by_verify_and_every_tool(single_ckpt, tmp_path, edit):
    """(issue 20) Manifests that verify called sound made convert, load and consolidate raise
    IndexError, ZeroDivisionError, TypeError or ValueError."""
    which, old, new, says = FIELD_EDITS[edit]
    if which == "muon":
        ckpt = shutil.copytree(single_ckpt(1), tmp_path / "ckpt")
        opt = build(1, 1, initial_params())[0]
    else:
        ckpt, opt = _adamw_ckpt(tmp_path / "ckpt")
    text = (ckpt / "manifest.json").read_text()
    assert old in text
    (ckpt / "manifest.json").write_text(text.replace(old, new, 1))
    (problem,) = muonckpt.verify(ckpt)
    assert says in str(problem), problem
    for read in (
        lambda: muonckpt.load(opt, ckpt),
        lambda: offline.consolidate(ckpt, tmp_path / "full"),
        lambda: offline.convert(ckpt, tmp_path / "torch", to="torch"),
    ):
        with pytest.raises(CheckpointError, match=re.escape(says)):
            read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_pieces_parsed_as_they_come_leave_piece_shaped_settings_as_they_are(single_ckpt):
    """The parser makes each piece as soon as its object is parsed (memory at 100k params); an
    object of the same shape where no piece belongs (a hyperparameter, an optimizer field)
    stays the JSON it was."""
    import json

    from muonckpt.format.manifest import Piece, piece_to_json
    from muonckpt.format.manifest_json import parse_manifest

    ckpt = single_ckpt(1)
    text = (ckpt / "manifest.json").read_text()
    body = json.loads(text)
    shaped = piece_to_json(muonckpt.read_manifest(ckpt).pieces[0])  # (version 3: in an index)
    body["groups"][0]["hyperparams"]["odd"] = [shaped, {"inner": shaped}]
    body["groups"][0]["optimizer"]["extra"] = shaped
    manifest = parse_manifest(json.dumps(body), "x")
    assert manifest.groups[0].hyperparams["odd"] == [shaped, {"inner": shaped}]
    assert manifest.groups[0].optimizer["extra"] == shaped
    assert all(isinstance(p, Piece) for p in manifest.pieces)
    assert parse_manifest(manifest.to_json(), "x") == manifest
