"""Single-process torch optimizers through muonckpt's files and CLI: no hooks needed.

Each optimizer is trained a few steps, saved, loaded into a fresh optimizer over params that
are zeros, trained on; it must match an uninterrupted run bit for bit. Its whole state round
trips exactly: tensors of every dtype, torch's 0-d ``step`` tensors, plain numbers and None.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import muonckpt
from muonckpt.cli import app

K, M = 3, 2
SHAPES = {"w1": (6, 4), "w2": (4, 6), "b": (6,)}


def make_params(dtype=torch.float32, zeros=False) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(5)
    return {
        n: torch.nn.Parameter(
            torch.zeros(s, dtype=dtype) if zeros else torch.randn(s, generator=gen).to(dtype)
        )
        for n, s in SHAPES.items()
    }


OPTIMIZERS = {
    "Muon": lambda ps: torch.optim.Muon(
        [(n, ps[n]) for n in ("w1", "w2")], lr=0.05, adjust_lr_fn="match_rms_adamw"
    ),
    "AdamW": lambda ps: torch.optim.AdamW(list(ps.items()), lr=0.01),
    "SGD": lambda ps: torch.optim.SGD(list(ps.items()), lr=0.1, momentum=0.9),
    "SGD-no-momentum": lambda ps: torch.optim.SGD(list(ps.items()), lr=0.1),
    "Adagrad": lambda ps: torch.optim.Adagrad(list(ps.items()), lr=0.1),
}


def train(opt, params, first, steps):
    for step in range(first, first + steps):
        for name, p in params.items():
            gen = torch.Generator().manual_seed(step * 10 + len(name))
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index, entry in sa["state"].items():
        assert entry.keys() == sb["state"][index].keys()
        for key, value in entry.items():
            other = sb["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype and value.shape == other.shape, (index, key)
                assert torch.equal(value, other), (index, key)
            else:
                assert value == other and type(value) is type(other), (index, key)


@pytest.mark.parametrize("consolidated", [False, True])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_round_trip_and_resume_are_bitwise(tmp_path, kind, consolidated):
    params = make_params()
    opt = OPTIMIZERS[kind](params)
    train(opt, params, 0, K)
    ckpt = muonckpt.save(opt, tmp_path / "ckpt", consolidated=consolidated)
    assert muonckpt.verify(ckpt) == []
    fresh_params = make_params(zeros=True)
    fresh = OPTIMIZERS[kind](fresh_params)
    muonckpt.load(fresh, ckpt)
    _same_state(opt, fresh)
    held = [
        n for n, p in params.items() if any(p is q for g in opt.param_groups for q in g["params"])
    ]
    for name in held:
        assert torch.equal(fresh_params[name], params[name]), name
    train(opt, params, K, M)
    train(fresh, fresh_params, K, M)
    _same_state(opt, fresh)
    for name in held:
        assert torch.equal(fresh_params[name].detach(), params[name].detach()), name


def test_state_of_every_kind_round_trips(tmp_path):
    """bf16 params and state, torch's 0-d float32 ``step``, ints, floats, bools and None."""
    params = make_params(dtype=torch.bfloat16)
    opt = torch.optim.AdamW(list(params.items()), lr=0.01)
    train(opt, params, 0, 2)
    extra = opt.state[params["b"]]
    extra.update(count=7, scale=0.25, flag=True, nothing=None)
    ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    manifest = muonckpt.read_manifest(ckpt)
    entry = manifest.param("b")
    assert entry.dtypes == {"exp_avg": "BF16", "exp_avg_sq": "BF16", "param": "BF16"}
    assert entry.scalars["step"].dtype == "F32" and entry.scalars["step"].value == 2.0
    assert entry.scalars["count"].dtype is None and entry.scalars["count"].value == 7
    fresh = torch.optim.AdamW(list(make_params(torch.bfloat16, zeros=True).items()), lr=0.01)
    muonckpt.load(fresh, ckpt)
    _same_state(opt, fresh)
    step = next(iter(fresh.state.values()))["step"]
    assert step.dim() == 0 and step.dtype == torch.float32


def test_inspect_and_verify_on_a_torch_muon_checkpoint(tmp_path):
    params = make_params()
    opt = OPTIMIZERS["Muon"](params)
    train(opt, params, 0, K)
    ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    runner = CliRunner()
    result = runner.invoke(app, ["inspect", str(ckpt)])
    assert result.exit_code == 0, result.output
    for text in ("w1", "6x4", "momentum_buffer", "F32"):
        assert text in result.stdout
    result = runner.invoke(app, ["verify", str(ckpt)])
    assert result.exit_code == 0 and "is sound" in result.stdout
    result = runner.invoke(app, ["consolidate", str(ckpt), "-o", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["diff", str(ckpt), str(tmp_path / "c")])
    assert result.exit_code == 0, result.output


def test_a_directory_that_is_no_checkpoint_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    result = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 2
    assert "not a muonckpt checkpoint" in result.stderr and "interrupted" not in result.stderr
