"""``muonckpt doctor`` (issue 54): momentum in another form than its records say, params that
differ from a model file, and values in state not shaped like its param."""

from __future__ import annotations

import json

import muon
import pytest
import torch
from typer.testing import CliRunner

import muonckpt
from muonckpt.cli import app
from muonckpt.errors import RestoreError

MU = 0.95


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _optimizers(family: str, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """``family``'s Muon on the model's matrices and its AdamW on the rest, each as users
    build it."""
    named = list(model.named_parameters())
    matrices = [(n, p) for n, p in named if p.ndim == 2]
    rest = [(n, p) for n, p in named if p.ndim != 2]
    if family == "packaged":
        groups = [
            {"params": matrices, "use_muon": True, "lr": 0.02, "momentum": MU},
            {"params": rest, "use_muon": False, "lr": 3e-3},
        ]
        return [muonckpt.optim.muon.Muon(groups)]
    if family == "torch":
        return [torch.optim.Muon(matrices, lr=0.02, momentum=MU), torch.optim.AdamW(rest, lr=3e-3)]
    opt = muon.SingleDeviceMuonWithAuxAdam(
        [
            dict(params=[p for _, p in matrices], use_muon=True, lr=0.02, momentum=MU),
            dict(params=[p for _, p in rest], use_muon=False, lr=3e-3),
        ]
    )
    muonckpt.install_hooks(opt, names=dict(named))
    return [opt]


def _train(family: str, saves: list[int], root) -> tuple[dict[int, object], list, torch.nn.Module]:
    """A real run: the MLP fit to a fixed teacher by ``family``'s optimizers, saved (with its
    step) at each of ``saves``."""
    torch.manual_seed(0)
    model, teacher = _mlp(), torch.nn.Linear(16, 4)
    opts = _optimizers(family, model)
    x = torch.randn(256, 16)
    y = torch.sin(teacher(x)).detach()
    saved = {}
    for step in range(1, max(saves) + 1):
        batch = torch.randint(0, 256, (32,))
        loss = ((model(x[batch]) - y[batch]) ** 2).mean()
        for opt in opts:
            opt.zero_grad()
        loss.backward()
        for opt in opts:
            opt.step()
        if step in saves:
            target = opts if len(opts) > 1 else opts[0]
            saved[step] = muonckpt.save(target, root / f"{family}-{step}", extra={"step": step})
    return saved, opts, model


def _copied_into_torch(packaged: muonckpt.optim.muon.Muon, model) -> list[torch.optim.Optimizer]:
    """The packaged Muon's state copied into torch.optim.Muon + AdamW as it is, without
    converting its sum-form momentum: a hand-made port between implementations."""
    opts = _optimizers("torch", model)
    step = packaged.param_groups[1]["step"]
    for p, state in packaged.state.items():
        for opt in opts:
            if any(p is q for group in opt.param_groups for q in group["params"]):
                opt.state[p] = {key: value.clone() for key, value in state.items()}
                if isinstance(opt, torch.optim.AdamW):
                    opt.state[p]["step"] = torch.tensor(float(step))
    return opts


def test_doctor_finds_momentum_copied_between_implementations_without_conversion(tmp_path):
    """The values decide it against the checkpoint the copy came from: the copy's norms are
    those of the packaged Muon's sum form while its records say torch's EMA form (x20 at
    mu 0.95). muonckpt's own conversion of the same checkpoint is healthy."""
    saved, (packaged,), model = _train("packaged", [8], tmp_path)
    source = saved[8]
    copied = _copied_into_torch(packaged, model)
    copy = muonckpt.save(copied, tmp_path / "copied", extra={"step": 8})
    found = muonckpt.doctor(copy, against=source)
    assert [f.check for f in found.findings] == ["momentum-form"]
    message = found.findings[0].message
    assert "group 0 (torch.optim.Muon, recorded ema-form)" in message and "x20" in message
    assert "A heuristic" in message
    shown = CliRunner().invoke(app, ["doctor", str(copy), "--against", str(source)])
    assert shown.exit_code == 1 and "problem: momentum-form:" in shown.output
    converted = muonckpt.offline.convert(source, tmp_path / "converted", to="torch")
    assert muonckpt.doctor(converted, against=source).healthy


@pytest.mark.slow
def test_doctor_against_an_earlier_checkpoint_is_healthy_on_real_runs(tmp_path):
    """Real runs of each implementation, checkpoint against checkpoint, the gradients (and the
    momentum with them) shrinking up to tenfold between them: no finding (the momentum-jump
    and momentum-form heuristics allow for the drift the AdamW moments show)."""
    for family in ("packaged", "torch", "keller-jordan"):
        run, _, _ = _train(family, [60, 100, 400], tmp_path)
        for earlier, later in ((60, 100), (60, 400), (100, 400)):
            checked = muonckpt.doctor(run[later], against=run[earlier])
            assert checked.healthy, (family, earlier, later, checked.findings)


def test_doctor_finds_a_recorded_form_its_optimizer_does_not_keep(tmp_path):
    """The records disagree: a group recorded as torch.optim.Muon (EMA form) whose momentum
    form says sum, as a converter that labels its output wrongly writes it."""
    saved, _, _ = _train("torch", [3], tmp_path)
    manifest = saved[3] / "manifest.json"
    raw = json.loads(manifest.read_text())
    raw["groups"][0]["optimizer"]["momentum_form"] = "sum"
    manifest.write_text(json.dumps(raw))
    found = muonckpt.doctor(saved[3])
    assert [f.check for f in found.findings] == ["momentum-form"]
    assert (
        "group 0 is recorded as torch.optim.Muon, which keeps ema-form momentum, yet records "
        "its momentum as sum-form" in found.findings[0].message
    )


class _GainedSGD(torch.optim.SGD):
    """SGD keeping a one-element state tensor per param beside its momentum (a scalar
    state, as optimizers with a per-tensor gain keep)."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("gain", torch.ones(1)).mul_(0.5)
        return super().step(closure)


NOT_PARAM_SHAPED = ("second_momentum_buffer", "v", "gain")
"""State keys not shaped like their param: NorMuon's (rows, 1) second moment, AdaMuon's flat v,
a (1,) gain."""


def _not_param_shaped(key: str, steps: int) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    """The optimizer keeping state ``key`` (:data:`NOT_PARAM_SHAPED`) after ``steps`` steps,
    and its matrix param."""
    import pytorch_optimizer as po

    gen = torch.Generator().manual_seed(5)
    w = torch.nn.Parameter(torch.randn(6, 4, generator=gen))
    b = torch.nn.Parameter(torch.randn(4, generator=gen))
    if key == "gain":
        opt: torch.optim.Optimizer = _GainedSGD([("w", w), ("b", b)], lr=0.02, momentum=0.9)
    else:
        groups = [
            {"params": [("w", w)], "use_muon": True},
            {"params": [("b", b)], "use_muon": False},
        ]
        opt = (po.NorMuon if key == "second_momentum_buffer" else po.AdaMuon)(groups, lr=0.02)
    for _ in range(steps):
        w.grad, b.grad = torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen)
        opt.step()
    return opt, w


def test_state_not_shaped_like_its_param_is_read_by_doctor_and_proved_by_the_load(tmp_path):
    """NorMuon's (rows, 1) second moment, AdaMuon's flat v and a (1,) scalar: a NaN in one is
    found by doctor naming param and key; a value changed in one by the optimizer's
    load_state_dict fails the load's check naming param and key."""
    for key in NOT_PARAM_SHAPED:
        opt, w = _not_param_shaped(key, steps=2)
        held = opt.state[w][key]
        assert tuple(held.shape) != tuple(w.shape)
        clean = muonckpt.save(opt, tmp_path / f"{key}-clean")
        assert muonckpt.doctor(clean).healthy
        held.view(-1)[0] = float("nan")
        found = muonckpt.doctor(muonckpt.save(opt, tmp_path / f"{key}-nan"))
        assert [(f.check, f.param, f.key) for f in found.findings] == [("nan-inf", "w", key)]
        assert f"1 NaN and 0 Inf of {held.numel()} elements" in found.findings[0].message

        fresh, w = _not_param_shaped(key, steps=0)
        load = fresh.load_state_dict

        def rewriting(state_dict, load=load, key=key, w=w, opt=fresh):
            load(state_dict)
            opt.state[w][key].view(-1)[-1] += 1.0

        fresh.load_state_dict = rewriting
        with pytest.raises(RestoreError, match=f"'w' '{key}': holds other") as raised:
            muonckpt.load(fresh, clean)
        assert (raised.value.param, raised.value.key) == ("w", key)
        fresh, _ = _not_param_shaped(key, steps=0)
        muonckpt.load(fresh, clean)  # the same load without the rewrite: proved, fine


def _adamw_run(tmp_path) -> tuple[object, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint of an MLP trained by AdamW two steps; its weights at that step and at the
    next one (a model file saved one step off), each as a bf16 model keeps them."""
    torch.manual_seed(4)
    model = _mlp()
    opt = torch.optim.AdamW(list(model.named_parameters()), lr=0.01)
    weights = []
    for _ in range(3):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        weights.append({n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()})
        if len(weights) == 2:
            ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    return ckpt, weights[1], weights[2]


def _hf_sharded(weights: dict[str, torch.Tensor], directory) -> None:
    """``weights`` as a Hugging Face sharded checkpoint, each name under ``model.``."""
    from safetensors.torch import save_file

    directory.mkdir()
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    for file, part in shards.items():
        save_file({f"model.{n}": weights[n].contiguous() for n in part}, directory / file)
    weight_map = {f"model.{n}": file for file, part in shards.items() for n in part}
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_doctor_compares_the_params_with_a_model_file_or_sharded_checkpoint(tmp_path):
    """The fp32 params the checkpoint holds against a bf16 model file (compared as cast):
    equal at the same step, in one file and in a Hugging Face sharded checkpoint whose names
    carry a ``model.`` prefix; the model file of the next step differs in every param (how
    many elements, by how much); a tensor of another shape, and names missing on either side,
    are named too. Exit 1 and JSON."""
    from safetensors.torch import save_file

    ckpt, same_step, next_step = _adamw_run(tmp_path)
    single = tmp_path / "model.safetensors"
    save_file(same_step, single)
    found = muonckpt.doctor(ckpt, model=single)
    assert found.healthy, found.findings
    assert [c.equal for c in found.model_compared] == [True] * 4
    assert {(c.dtype, c.model_dtype) for c in found.model_compared} == {("F32", "BF16")}
    _hf_sharded(same_step, tmp_path / "hf")
    assert muonckpt.doctor(ckpt, model=tmp_path / "hf").healthy
    split = muonckpt.offline.reshard(ckpt, tmp_path / "three", dp=3, tp=1)  # pieces of params
    assert muonckpt.doctor(split, model=tmp_path / "hf").healthy

    _hf_sharded(next_step, tmp_path / "hf-next")
    off = muonckpt.doctor(ckpt, model=tmp_path / "hf-next" / "model.safetensors.index.json")
    assert sorted(f.param for f in off.findings) == sorted(same_step)
    first = next(f for f in off.findings if f.param == "0.weight")
    assert first.check == "model" and first.key == "param"
    assert "elements differ from the model file's 'model.0.weight' (as BF16, held as F32)" in (
        first.message
    )

    odd = dict(same_step)
    odd["0.weight"] = odd["0.weight"].t().contiguous()
    del odd["2.bias"]
    odd["lm_head.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    save_file(odd, tmp_path / "odd.safetensors")
    shown = CliRunner().invoke(
        app, ["doctor", str(ckpt), "--model", str(tmp_path / "odd.safetensors")]
    )
    assert shown.exit_code == 1
    text = " ".join(shown.output.split())
    assert "problem: model: param '0.weight' key 'param': shape (32, 16)" in text
    assert "the model file lacks 1 params: '2.bias'" in text
    assert "the checkpoint lacks 1 params: 'lm_head.weight'" in text
    assert "2 of 3 params equal" in text
    as_json = CliRunner().invoke(
        app, ["doctor", str(ckpt), "--model", str(tmp_path / "odd.safetensors"), "--json"]
    )
    shown_json = json.loads(as_json.output)
    assert shown_json["healthy"] is False and len(shown_json["model_compared"]) == 3
