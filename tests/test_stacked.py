"""Splitting stacked Muon params into one 2-D param per matrix (format/stacked.py, pure)."""

from __future__ import annotations

import pytest

from muonckpt import CheckpointError
from muonckpt.format.kinds import GroupKind
from muonckpt.format.manifest import GroupEntry, Manifest, ModelFile, ParamEntry
from muonckpt.format.stacked import Part, split_stacked

MUON = GroupKind("torch.optim.Muon", "muon", "ema", 0.95, True, "original").to_json()
ADAMW = GroupKind("torch.optim.AdamW", "adamw", step_in="tensor").to_json()


def _manifest(model: ModelFile | None = None) -> Manifest:
    dtypes = {"param": "F32", "momentum_buffer": "F32"}
    params = (
        ParamEntry("a", (2, 3, 4, 5), -1, 0, dtypes),
        ParamEntry("b", (4, 5), -1, 0, dtypes),
        ParamEntry("c", (2, 3, 4), -1, 1, {"param": "F32"}),
    )
    groups = (GroupEntry({"lr": 0.1}, ("a", "b"), MUON), GroupEntry({"lr": 0.2}, ("c",), ADAMW))
    return Manifest("consolidated", {"dp": 1, "tp": 1}, groups, params, (), (), model=model)


def test_muon_params_of_more_than_two_dims_split_in_place_others_kept():
    split, parts = split_stacked(_manifest())
    names = [f"a.{i}" for i in range(6)]
    assert [p.name for p in split.params] == [*names, "b", "c"]
    assert split.groups[0].params == (*names, "b") and split.groups[1].params == ("c",)
    assert {split.param(n).shape for n in names} == {(4, 5)}
    assert split.param("c").shape == (2, 3, 4)  # AdamW takes any shape
    assert parts == {n: Part("a", i) for i, n in enumerate(names)}
    assert split.param("a.5").dtypes == split.param("b").dtypes


def test_a_name_taken_or_a_tied_stacked_param_is_refused():
    taken = ModelFile((ParamEntry("a.1", (1,), -1, -1, {"param": "F32"}),), (), {})
    with pytest.raises(CheckpointError, match=r"'a\.1'"):
        split_stacked(_manifest(taken))
    tied = ModelFile((), (), {"head": "a"})
    with pytest.raises(CheckpointError, match="'head'"):
        split_stacked(_manifest(tied))
