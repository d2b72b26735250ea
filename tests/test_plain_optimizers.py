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
    # factored state: row_var (rows, 1) and col_var (1, cols), by their shape rules
    "Adafactor": lambda ps: torch.optim.Adafactor(list(ps.items()), lr=0.01),
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


@pytest.mark.parametrize("how", ["per-rank", "consolidated", "background"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_round_trip_and_resume_are_bitwise(tmp_path, kind, how):
    params = make_params()
    opt = OPTIMIZERS[kind](params)
    train(opt, params, 0, K)
    if how == "background":
        ckpt = muonckpt.async_save(opt, tmp_path / "ckpt").result(timeout=60)
    else:
        ckpt = muonckpt.save(opt, tmp_path / "ckpt", consolidated=how == "consolidated")
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


# --- what the review found (each refused or fixed, with the param named) -------------------


def test_non_finite_state_value_is_refused_naming_param_and_key(tmp_path):
    params = make_params()
    opt = torch.optim.AdamW(list(params.items()), lr=0.01)
    train(opt, params, 0, 1)
    opt.state[params["b"]]["scale"] = float("inf")
    for consolidated in (False, True):
        with pytest.raises(muonckpt.CheckpointError, match=r"state 'scale' is inf.*param 'b'"):
            muonckpt.save(opt, tmp_path / "ckpt", consolidated=consolidated)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("named", [False, True])
def test_a_list_of_optimizers_round_trips_into_the_same_list(tmp_path, named):
    def build(ps):
        matrices = [ps[n] for n in ("w1", "w2")]
        if named:
            return [
                torch.optim.Muon([(n, ps[n]) for n in ("w1", "w2")], lr=0.05),
                torch.optim.AdamW([("b", ps["b"])], lr=0.01, amsgrad=True),
            ]
        return [torch.optim.Muon(matrices, lr=0.05), torch.optim.AdamW([ps["b"]], amsgrad=True)]

    params = make_params()
    opts = build(params)
    for step in range(K):
        for name, p in params.items():
            p.grad = torch.full_like(p, 0.1 * (step + 1 + len(name)))
        for opt in opts:
            opt.step()
    ckpt = muonckpt.save(opts, tmp_path / "ckpt")
    background = muonckpt.async_save(opts, tmp_path / "background").result(timeout=60)
    for saved in (ckpt, background):
        fresh_params = make_params(zeros=True)
        fresh = build(fresh_params)
        report = muonckpt.load(fresh, saved)
        assert report.converted == [] and report.warnings == []
        for old, new in zip(opts, fresh):
            _same_state(old, new)  # max_exp_avg_sq and the saved hyperparams included
        for name in params:
            assert torch.equal(fresh_params[name], params[name]), name


def test_adamw_state_into_an_unknown_optimizer_is_refused(tmp_path):
    params = make_params()
    opt = torch.optim.Adam(list(params.items()), lr=0.01)
    train(opt, params, 0, 1)
    ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    sgd = torch.optim.SGD(list(make_params(zeros=True).items()), lr=0.1, momentum=0.9)
    with pytest.raises(muonckpt.StateDictError, match=r"does not know how torch\.optim\.SGD"):
        muonckpt.load(sgd, ckpt)
    assert not sgd.state


def test_a_different_group_structure_is_refused(tmp_path):
    params = make_params()
    opt = torch.optim.Adam(list(params.items()), lr=0.01)
    train(opt, params, 0, 1)
    ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    ps = make_params(zeros=True)
    two = torch.optim.Adam(
        [{"params": [("w1", ps["w1"])]}, {"params": [("w2", ps["w2"]), ("b", ps["b"])]}]
    )
    with pytest.raises(muonckpt.StateDictError, match="param groups"):
        muonckpt.load(two, ckpt)
