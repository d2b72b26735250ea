"""A rank's own optimizer, on its own (issue 30, item 10): inside an initialized process group,
``save`` / ``async_save`` / ``load`` with ``local=True`` take an optimizer of this process
alone (not a DDP replica): each rank its own to its own path, or one rank only, with no
rendezvous and no wait. Without it, the ranks out of step are told about ``local=True``.
Real 2-process gloo worlds; the hang guard is each run's timeout (every rank's wait for the
others is longer than the rendezvous timeout a lone call would otherwise sit out)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import muonckpt
from muonckpt.distributed import group_steps
from muonckpt.distributed.launch import run_distributed

from .fixture_model import build, initial_params, train

RUN_S = 150.0
LONG_RENDEZVOUS_S = 100.0
"""Longer than any wait these tests allow: a call that met the other rank would time out."""


def own_job(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its AdamW, stepped twice on data of ``seed``: each rank's differs."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(3, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def fresh_job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def everything(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            out[f"state.{names[p]}.{key}"] = torch.as_tensor(value).detach().clone()
    return out


def identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names, each with the same dtype, shape and values."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def each_rank_its_own(root: str, background: bool) -> dict:
    """(2 gloo ranks) Each rank saves its own optimizer to its own path with local=True, then
    loads it back into a fresh one; the other rank is busy elsewhere (waiting at a barrier)."""
    group_steps.set_rendezvous_timeout(LONG_RENDEZVOUS_S)
    rank = dist.get_rank()
    model, opt = own_job(seed=rank)
    path = f"{root}/rank{rank}"
    extra, rank_extra = {"step": 2, "rank": rank}, {"seed": rank}
    if background:
        done = muonckpt.async_save(
            opt, path, local=True, extra=extra, rank_extra=rank_extra
        ).result(timeout=60)
    else:
        done = muonckpt.save(opt, path, local=True, extra=extra, rank_extra=rank_extra)
    model2, opt2 = fresh_job()
    got, mine = {}, {}
    muonckpt.load(opt2, done, local=True, extra=got, rank_extra=mine)
    dist.barrier()
    same = identical(everything(model, opt), everything(model2, opt2))
    return {"same": same, "extra": got, "rank_extra": mine, "path": str(done)}


@pytest.mark.dist
@pytest.mark.parametrize("background", [False, True])
def test_each_rank_saves_and_loads_its_own_optimizer(tmp_path, background):
    out = run_distributed(
        each_rank_its_own, 2, str(tmp_path), background, timeout=RUN_S, wait_timeout=RUN_S - 30
    )
    for rank, result in enumerate(out):
        assert result["same"], rank
        assert result["extra"] == {"step": 2, "rank": rank}
        assert result["rank_extra"] == {"seed": rank}
        assert result["path"] == str(tmp_path / f"rank{rank}")
        # a checkpoint of one process: it loads as such anywhere
        assert muonckpt.verify(tmp_path / f"rank{rank}") == []
        manifest = muonckpt.read_manifest(tmp_path / f"rank{rank}")
        assert manifest.topology == {"dp": 1, "tp": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    model, opt = fresh_job()
    muonckpt.load(opt, tmp_path / "rank1")
    reference_model, reference_opt = own_job(seed=1)
    for name, value in everything(reference_model, reference_opt).items():
        assert torch.equal(everything(model, opt)[name], value), name


def rank_zero_alone(root: str) -> dict:
    """(2 gloo ranks) Only rank 0 saves its optimizer (local=True) and loads it back, twice
    (save, then async_save over it), while rank 1 waits at a barrier."""
    group_steps.set_rendezvous_timeout(LONG_RENDEZVOUS_S)
    rank = dist.get_rank()
    result: dict = {}
    if rank == 0:
        model, opt = own_job(seed=7)
        muonckpt.save(opt, f"{root}/ckpt", local=True)
        muonckpt.async_save([opt], f"{root}/ckpt", local=True, overwrite=True).result(timeout=60)
        model2, opt2 = fresh_job()
        muonckpt.load([opt2], f"{root}/ckpt", local=True)
        result["same"] = identical(everything(model, opt), everything(model2, opt2))
    dist.barrier()
    return result


@pytest.mark.dist
def test_one_rank_alone_saves_and_loads_its_own_optimizer(tmp_path):
    out = run_distributed(rank_zero_alone, 2, str(tmp_path), timeout=RUN_S, wait_timeout=RUN_S - 30)
    assert out == [{"same": True}, {}]
    assert muonckpt.verify(tmp_path / "ckpt") == []


def without_local(root: str, how: str, rendezvous_s: float) -> str | None:
    """(2 gloo ranks) A process-local optimizer saved without local=True: by rank 0 alone
    (``lone``), by each rank to its own path (``paths``) or to one path (``same``); this
    rank's error."""
    group_steps.set_rendezvous_timeout(rendezvous_s)
    rank = dist.get_rank()
    _, opt = own_job(seed=rank)
    error = None
    if how != "lone" or rank == 0:
        try:
            muonckpt.save(opt, f"{root}/rank{rank}" if how == "paths" else f"{root}/ckpt")
        except muonckpt.MuonCkptError as exc:
            error = str(exc)
    dist.barrier()
    return error


@pytest.mark.dist
def test_replicas_of_each_process_own_say_to_pass_local(tmp_path):
    """Each rank saves its own optimizer to one path: taken for replicas, they differ."""
    out = run_distributed(
        without_local, 2, str(tmp_path), "same", 2.0, timeout=RUN_S, wait_timeout=RUN_S - 30
    )
    for error in out:
        assert error is not None and "differs between ranks 0 and 1" in error, error
        assert "each process's own optimizer is saved with local=True" in error, error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.dist
@pytest.mark.parametrize("how", ["lone", "paths"])
def test_a_local_optimizer_saved_without_local_says_to_pass_it(tmp_path, how):
    out = run_distributed(
        without_local, 2, str(tmp_path), how, 2.0, timeout=RUN_S, wait_timeout=RUN_S - 30
    )
    errors = out if how == "paths" else out[:1]
    for error in errors:
        assert error is not None and "\n" not in error, error
        assert error.endswith(
            "an optimizer without muonckpt hooks in a process group is taken for a DDP replica "
            "on every rank; for an optimizer of this process alone, pass local=True"
        ), error
    if how == "lone":
        assert "rank(s) [1] did not arrive within 2 s" in out[0] and out[1] is None
    else:
        assert "the ranks disagree on path" in errors[0]
    assert list(tmp_path.iterdir()) == []


def sharded_with_local(root: str) -> list[str]:
    """(2 gloo ranks) local=True for a packaged Muon sharded over the 2 ranks: each rank's
    error of save and of load."""
    group_steps.set_rendezvous_timeout(LONG_RENDEZVOUS_S)
    opt, sharded, d, t = build(2, 1, initial_params())
    train(opt, sharded, d, t, 0, 1)
    errors = []
    for call in (muonckpt.save, muonckpt.load):
        try:
            call(opt, f"{root}/ckpt", local=True)
        except muonckpt.CheckpointError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.dist
def test_local_refuses_an_optimizer_sharded_over_ranks(tmp_path):
    out = run_distributed(sharded_with_local, 2, str(tmp_path), timeout=RUN_S)
    for errors in out:
        assert len(errors) == 2, errors
        for call, error in zip(("save", "load"), errors, strict=True):
            assert error.startswith(
                f"{call}(..., local=True) is for an optimizer of this process alone, and "
                f"['Muon'] keep their state across ranks"
            ), error
    assert list(tmp_path.iterdir()) == []


def test_local_in_one_process_is_the_plain_save_and_load(tmp_path):
    """Without a process group there is nobody else: local=True changes nothing, and it must
    be a bool."""
    model, opt = own_job(seed=3)
    muonckpt.save(opt, tmp_path / "ckpt", local=True)
    model2, opt2 = fresh_job()
    muonckpt.load(opt2, tmp_path / "ckpt", local=True)
    assert identical(everything(model, opt), everything(model2, opt2))
    with pytest.raises(muonckpt.CheckpointError, match="load: local must be True or False"):
        muonckpt.load(opt2, tmp_path / "ckpt", local="yes")
