"""Trust at resume (issue 54): the field failures where a resume silently restored the wrong
state, each reproduced and shown caught by muonckpt (a load's check, its environment warning)
or flagged by ``muonckpt doctor``."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from typer.testing import CliRunner

import muonckpt
from muonckpt.cli import app
from muonckpt.distributed.launch import run_distributed
from muonckpt.errors import CheckpointError, EnvironmentWarning, RestoreError, RestoreWarning
from muonckpt.format.manifest import ENVIRONMENT_KEYS


def _adamw(steps: int = 1) -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.arange(12.0).reshape(4, 3))
    opt = torch.optim.AdamW([p], lr=0.1)
    for _ in range(steps):
        p.grad = torch.full_like(p, 0.5)
        opt.step()
    return opt


def test_the_manifest_records_the_environment_and_a_load_under_another_warns_once(
    tmp_path, monkeypatch
):
    """The thread-count trap: a resume is bitwise only under the save's intra-op thread count
    (a one-process torchrun leaves OMP_NUM_THREADS unset); the load says what differs."""
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        path = muonckpt.save(_adamw(), tmp_path / "ckpt")
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((path / "manifest.json").read_text())
    assert saved["format_version"] == 5
    assert list(saved["environment"]) == list(ENVIRONMENT_KEYS)
    assert saved["environment"]["intra_op_threads"] == 1
    assert saved["environment"]["torch"] == torch.__version__
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(2)
    try:
        with pytest.warns(EnvironmentWarning) as said:
            report = muonckpt.load(_adamw(), path)
    finally:
        torch.set_num_threads(threads)
    assert len(said) == 1
    message = str(said[0].message)
    assert "intra_op_threads 1 -> 2" in message and "OMP_NUM_THREADS '1' -> None" in message
    assert report.environment == ["intra_op_threads 1 -> 2", "OMP_NUM_THREADS '1' -> None"]
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", EnvironmentWarning)
            assert muonckpt.load(_adamw(), path).environment == []
    finally:
        torch.set_num_threads(threads)


def _dropping(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt``, whose load_state_dict forgets the momentum of its second param."""
    load = opt.load_state_dict

    def load_state_dict(state_dict):
        load(state_dict)
        opt.state[opt.param_groups[0]["params"][1]].pop("momentum_buffer", None)

    opt.load_state_dict = load_state_dict
    return opt


def _normalizing(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt``, whose load_state_dict normalizes each momentum in place (as torch.optim.Muon
    with bf16 params and nesterov=False does every step)."""
    load = opt.load_state_dict

    def load_state_dict(state_dict):
        load(state_dict)
        for state in opt.state.values():
            state["momentum_buffer"].div_(state["momentum_buffer"].norm())

    opt.load_state_dict = load_state_dict
    return opt


def _sgd(dtype=torch.float32, steps=1):
    named = [(n, torch.nn.Parameter(torch.randn(4, 3).to(dtype))) for n in ("w1", "w2")]
    group = {"params": [p for _, p in named], "param_names": [n for n, _ in named]}
    opt = torch.optim.SGD([group], lr=0.1, momentum=0.9)
    for _ in range(steps):
        for _, p in named:
            p.grad = torch.ones_like(p)
        opt.step()
    return opt


@pytest.fixture
def sgd_ckpt(tmp_path):
    return muonckpt.save(_sgd(), tmp_path / "ckpt")


def test_state_the_optimizer_dropped_fails_the_load_and_changes_nothing(sgd_ckpt):
    opt = _dropping(_sgd(steps=0))
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    with pytest.raises(RestoreError, match=r"dropped state.*'w2' 'momentum_buffer'") as raised:
        muonckpt.load(opt, sgd_ckpt)
    assert (raised.value.param, raised.value.key) == ("w2", "momentum_buffer")
    assert not opt.state  # put back: as it was
    assert all(torch.equal(a, p) for a, p in zip(before, opt.param_groups[0]["params"]))
    muonckpt.load(opt, sgd_ckpt, check=False)  # the documented way out
    assert set(map(len, opt.state.values())) == {0, 1}


def test_a_value_that_differs_after_load_state_dict_fails_naming_param_and_key(sgd_ckpt, tmp_path):
    """At the saving layout (the read's checksums stand for the digest) and resharded (each
    param split over three ranks' files: digested as read)."""
    split = muonckpt.offline.reshard(sgd_ckpt, tmp_path / "three", dp=3, tp=1)
    pieces = muonckpt.read_manifest(split).pieces_of()
    assert len(pieces["w1", "momentum_buffer"]) > 1
    for path in (sgd_ckpt, split):
        with pytest.raises(RestoreError, match="'w1' 'momentum_buffer': holds other") as raised:
            muonckpt.load(_normalizing(_sgd(steps=0)), path)
        assert (raised.value.param, raised.value.key) == ("w1", "momentum_buffer")
        muonckpt.load(_sgd(steps=0), path)  # the same load, without the rewrite: checked, fine


def test_a_cast_by_torchs_rule_warns_once_naming_both_dtypes(sgd_ckpt):
    opt = _sgd(dtype=torch.bfloat16, steps=0)
    with pytest.warns(RestoreWarning) as said:
        muonckpt.load(opt, sgd_ckpt, params=False)
    assert len([w for w in said if w.category is RestoreWarning]) == 1
    message = str(said[0].message)
    assert "'w1' 'momentum_buffer' torch.float32 -> torch.bfloat16" in message and "'w2'" in message


def _torch_muon(dtype: torch.dtype) -> torch.optim.Optimizer:
    """torch.optim.Muon with nesterov=False over three matrices of ``dtype``, four steps."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(16, 12, generator=gen).to(dtype)) for _ in "abc"]
    group = {"params": params, "param_names": list("abc")}
    opt = torch.optim.Muon([group], lr=0.02, nesterov=False)
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return opt


def test_doctor_flags_torch_muons_bf16_momentum_normalized_in_place(tmp_path):
    """torch.optim.Muon with bf16 params and nesterov=False normalizes its momentum buffer in
    place every step: its checkpoints faithfully hold the wrong momentum. Only the values show
    it; fp32 params accumulate as they should."""
    healthy = muonckpt.doctor(muonckpt.save(_torch_muon(torch.float32), tmp_path / "fp32"))
    assert healthy.healthy, healthy.findings
    found = muonckpt.doctor(muonckpt.save(_torch_muon(torch.bfloat16), tmp_path / "bf16"))
    assert [f.check for f in found.findings] == ["normalized-momentum"]
    assert "torch.optim.Muon" in found.findings[0].message
    norms = [t.norm for t in found.tensors if t.key == "momentum_buffer"]
    assert len(norms) == 3 and all(abs(n - 1) < 0.01 for n in norms)


def test_doctor_finds_nans_in_one_ranks_state_and_names_the_rank(tmp_path, single_ckpt):
    """A checkpoint rebuilt from a bad replica (Megatron-LM #5281): checksums of NaNs verify,
    and the load restores them faithfully; doctor names the tensor and the rank, and exits 1."""
    opt = _adamw(steps=2)
    (p,) = opt.param_groups[0]["params"]
    opt.state[p]["exp_avg"].view(-1)[-3:] = torch.tensor([float("nan"), float("inf"), 1.0])
    source = muonckpt.save(opt, tmp_path / "one")
    ranks = muonckpt.offline.reshard(source, tmp_path / "two", dp=2, tp=1)
    assert muonckpt.verify(ranks) == []
    found = muonckpt.doctor(ranks)
    (nan,) = found.findings
    assert (nan.check, nan.param, nan.key) == ("nan-inf", "0", "exp_avg")
    assert "1 NaN and 1 Inf of 12 elements (rank 1)" in nan.message
    assert muonckpt.doctor(single_ckpt(1)).healthy
    result = CliRunner().invoke(app, ["doctor", str(ranks)])
    assert result.exit_code == 1 and "problem: nan-inf: param '0' key 'exp_avg'" in result.output
    shown = json.loads(CliRunner().invoke(app, ["doctor", str(ranks), "--json"]).output)
    assert shown["healthy"] is False and shown["findings"][0]["check"] == "nan-inf"
    assert CliRunner().invoke(app, ["doctor", str(single_ckpt(1))]).exit_code == 0


def test_doctor_against_an_earlier_checkpoint_shows_momentum_that_was_lost(tmp_path):
    """KellerJordan/Muon #46's aftermath: a resume whose state_dict() lacked most momentum
    restarts it at zero; the next checkpoint shows it, and against the one before, the jump."""
    opt = _sgd(steps=2)
    before = muonckpt.save(opt, tmp_path / "before")
    for state in opt.state.values():
        state["momentum_buffer"].zero_()
    after = muonckpt.save(opt, tmp_path / "after")
    found = muonckpt.doctor(after, against=before)
    checks = sorted({(f.check, f.param) for f in found.findings})
    assert ("momentum-jump", "w1") in checks and ("zero-momentum", "w2") in checks
    assert {(c.param, c.key, c.ratio) for c in found.compared if c.key == "momentum_buffer"} == {
        ("w1", "momentum_buffer", 0.0),
        ("w2", "momentum_buffer", 0.0),
    }
    shown = CliRunner().invoke(app, ["doctor", str(after), "--against", str(before)])
    assert shown.exit_code == 1
    text = " ".join(shown.output.split())  # (wrapped at the terminal's width)
    assert f"against {before}: momentum norm ratios x0 to x0; 0 of 2 params moved" in text


def _field_failures_at_two_ranks(root: str) -> dict[str, object]:
    """(In each of two gloo ranks.) KellerJordan/Muon #46 with the upstream package, and a
    model left unsynced after a load (Megatron-LM #6920); what muonckpt said of each."""
    import muon
    import torch.distributed as dist

    from muonckpt.optim.sharding import ShardedParams, shard_for_groups

    said: dict[str, object] = {}
    gen = torch.Generator().manual_seed(7)
    matrices = [torch.nn.Parameter(torch.randn(8, 6, generator=gen)) for _ in range(4)]
    upstream = muon.Muon(matrices, lr=0.05, momentum=0.9)
    for p in matrices:
        p.grad = torch.ones_like(p)
    upstream.step()
    said["momentum in state_dict()"] = sum(
        "momentum_buffer" in s for s in upstream.state_dict()["state"].values()
    )
    try:
        muonckpt.save(upstream, f"{root}/kj")
    except muonckpt.StateDictError as exc:
        said["save"] = str(exc)
    dp_group, tp_group = muonckpt.distributed.grid_groups(2, 1)
    model = {n: torch.nn.Parameter(torch.randn(6, 4, generator=gen)) for n in ("a", "b")}
    sharded = shard_for_groups([{"params": list(model.items())}], dp_group, tp_group)
    opt = muonckpt.optim.muon.Muon(sharded.param_groups, lr=0.05)
    opt.enable_distributed_mode(sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas)
    path = muonckpt.save(opt, f"{root}/packaged")
    with torch.no_grad():
        for p in model.values():
            p.zero_()
    sync, ShardedParams.params_to_model = ShardedParams.params_to_model, lambda self: None
    try:
        muonckpt.load(opt, path)
    except RestoreError as exc:
        said["unsynced"] = (str(exc), exc.param, exc.key)
    finally:
        ShardedParams.params_to_model = sync
    muonckpt.load(opt, path)
    said["synced"] = all(bool(p.abs().sum() > 0) for p in model.values())
    _, masters = _bf16_model_and_masters(seed=11)  # a DDP replica on each rank
    saved = muonckpt.save(masters, f"{root}/masters")
    said["masters unsynced"] = _load_unsynced(_bf16_model_and_masters(seed=12), saved)
    dist.barrier()
    return said


def _bf16_model_and_masters(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A bf16 model and the fp32 master copies of its weights that its optimizer (AdamW, one
    step taken) steps, as Megatron-LM keeps them."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2)).to(torch.bfloat16)
    masters = [(n, torch.nn.Parameter(w.detach().float())) for n, w in model.named_parameters()]
    opt = torch.optim.AdamW(masters, lr=0.01)
    for _, master in masters:
        master.grad = torch.randn_like(master)
    opt.step()
    return model, opt


def _load_unsynced(resumed: tuple[torch.nn.Module, torch.optim.Optimizer], path) -> tuple:
    """``load(model=)`` with the model's sync skipped (Megatron-LM #6920: it never ran): what
    the load said (message, param, key), whether the model was left as it was; then the load
    that syncs, and whether the model holds the masters cast."""
    from muonckpt.checkpoint._model_copies import ModelCopies

    model, opt = resumed
    before = [w.detach().clone() for w in model.parameters()]
    sync, ModelCopies.params_to_model = ModelCopies.params_to_model, lambda self: None
    try:
        muonckpt.load(opt, path, model=model)
        said: tuple = ("no error",)
    except RestoreError as exc:
        said = (str(exc), exc.param, exc.key)
    finally:
        ModelCopies.params_to_model = sync
    unchanged = all(torch.equal(a, w) for a, w in zip(before, model.parameters(), strict=True))
    muonckpt.load(opt, path, model=model)
    masters = [p for g in opt.param_groups for p in g["params"]]
    synced = all(
        w.dtype == torch.bfloat16 and torch.equal(w, m.to(torch.bfloat16))
        for w, m in zip(model.parameters(), masters, strict=True)
    )
    return (*said, unchanged, synced)


def test_a_model_of_bf16_copies_of_fp32_masters_left_unsynced_fails_the_load(tmp_path):
    """Megatron-LM #6920 the way it happens: a bf16 model whose fp32 master params the
    optimizer steps; a resume into another model whose sync never ran fails naming the param;
    with the sync (load(model=) does it) the model holds the loaded masters, cast."""
    _, masters = _bf16_model_and_masters(seed=1)
    path = muonckpt.save(masters, tmp_path / "ckpt")
    message, param, key, unchanged, synced = _load_unsynced(_bf16_model_and_masters(seed=2), path)
    assert "'0.weight' 'model': the model's weight is not the loaded param (as torch.bfloat16)" in (
        message
    )
    assert (param, key, unchanged, synced) == ("0.weight", "model", True, True)
    model, opt = _bf16_model_and_masters(seed=3)
    held = [s["exp_avg"].clone() for s in opt.state.values()]
    renamed = {f"module.{n}": w for n, w in model.named_parameters()}  # not the params' names
    with pytest.raises(CheckpointError, match=r"no weight named \['0.weight'") as refused:
        muonckpt.load(opt, path, model=renamed)
    assert refused.value.param == "0.weight"
    with pytest.raises(CheckpointError, match="needs params=True"):
        muonckpt.load(opt, path, model=model, params=False)
    transposed = {n: w.detach().t().contiguous() for n, w in model.named_parameters()}
    with pytest.raises(CheckpointError, match=r"shapes differ: '0.weight' \(\d+, \d+\) vs") as t:
        muonckpt.load(opt, path, model=transposed)  # as many elements: still not a copy
    assert t.value.param == "0.weight"
    kept = [s["exp_avg"] for s in opt.state.values()]  # refused before anything changed
    assert all(torch.equal(a, b) for a, b in zip(held, kept, strict=True))


@pytest.mark.dist
def test_two_ranks_kj46_is_refused_and_an_unsynced_model_fails_the_load(tmp_path):
    ranks = run_distributed(_field_failures_at_two_ranks, 2, str(tmp_path), timeout=120)
    for said in ranks:
        assert said["momentum in state_dict()"] == 2  # of 4: the other rank's are missing
        assert "call muonckpt.install_hooks(optimizer) first" in said["save"]
        message, param, key = said["unsynced"]
        assert "rank " in message and "the model's weight is not the loaded param" in message
        assert key == "model"
        assert param in ("a", "b") and said["synced"]
        message, param, key, unchanged, synced = said["masters unsynced"]
        assert "rank 0: '0.weight' 'model'" in message and "rank 1: '0.weight'" in message
        assert (param, key, unchanged, synced) == ("0.weight", "model", True, True)
    assert not (tmp_path / "kj").exists()


def test_doctor_tells_step_counts_that_disagree_from_params_that_missed_steps(tmp_path):
    """torch's AdamW counts a param's steps only when it had a gradient, so a count below the
    job's step is sound; a count above the step the job recorded is flagged."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([("a", a), ("b", b)], lr=0.1)
    for step in range(3):
        a.grad = torch.ones(3)
        b.grad = torch.ones(3) if step else None  # b had no gradient at the first step
        opt.step()
    assert muonckpt.doctor(muonckpt.save(opt, tmp_path / "ok", extra={"step": 3})).healthy
    found = muonckpt.doctor(muonckpt.save(opt, tmp_path / "behind", extra={"step": 1}))
    assert [f.check for f in found.findings] == ["steps"]
    assert "param 'a' 3" in found.findings[0].message and "'b'" in found.findings[0].message
