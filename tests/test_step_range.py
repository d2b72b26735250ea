"""A scalar's value must fit its dtype (issue 50, finding 9): a per-param ``step`` of 1e308
recorded as F16 was loaded as inf; it is refused by ``verify`` and ``load``, naming it, and
an F16 step at the dtype's largest value, 65504, still loads exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import muonckpt
from muonckpt import CheckpointError
from muonckpt.format.conversion import step_scalar

SHAPES = {"w": (4, 3), "b": (3,)}


def _adamw() -> torch.optim.AdamW:
    params = {n: torch.nn.Parameter(torch.ones(s)) for n, s in SHAPES.items()}
    return torch.optim.AdamW(list(params.items()), lr=0.01)


def _saved_with_step(tmp_path: Path, step: object, dtype: str) -> Path:
    """A torch AdamW's checkpoint (per-param ``step`` tensors), every param's step recorded
    as ``step`` of ``dtype`` in the manifest's kinds."""
    opt = _adamw()
    for p in (p for g in opt.param_groups for p in g["params"]):
        p.grad = torch.ones_like(p)
    opt.step()
    path = muonckpt.save(opt, tmp_path / "ckpt")
    manifest = json.loads((path / "manifest.json").read_text())
    for kind in manifest["param_kinds"]:
        assert kind["scalars"]["step"]["dtype"] == "F32"
        kind["scalars"]["step"] = {"value": step, "dtype": dtype}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize(("step", "dtype"), [(1e308, "F16"), (65505, "F16"), (1e39, "F32")])
def test_a_step_past_its_dtype_is_refused_by_verify_and_load(tmp_path, step, dtype):
    path = _saved_with_step(tmp_path, step, dtype)
    problems = muonckpt.verify(path)
    said = f"scalar 'step': {step!r} is not a {dtype} value"
    assert len(problems) == 1 and said in str(problems[0]), problems
    opt = _adamw()
    with pytest.raises(CheckpointError, match=re.escape(said)):
        muonckpt.load(opt, path)
    assert not opt.state  # nothing taken


def test_a_step_at_its_dtype_s_largest_value_loads_exactly(tmp_path):
    path = _saved_with_step(tmp_path, 65504, "F16")
    assert muonckpt.verify(path) == []
    opt = _adamw()
    muonckpt.load(opt, path)
    steps = [s["step"] for s in opt.state.values()]
    assert steps and all(s.dtype == torch.float16 and s.item() == 65504 for s in steps)


def test_a_step_past_float32_is_refused_where_a_load_makes_it_a_float32_tensor():
    with pytest.raises(CheckpointError, match=r"step 1e\+300 does not fit a float32 tensor"):
        step_scalar("tensor", 1e300, "w")
    assert step_scalar("tensor", 3.0, "w") == muonckpt.format.manifest.Scalar(3.0, "F32")
