"""A failed load is all or nothing (issue 30, item 7): whatever refuses (a stateful value in
``extra`` / ``rank_extra``, once or twice; an optimizer's own ``load_state_dict``; another
rank), the optimizers, the model and every value of ``extra`` / ``rank_extra`` are left as
they were, bitwise, and the error is the library's, naming what refused and anything that
could not be put back. Real objects, real checkpoints, a real gloo world."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist

import muonckpt
from muonckpt.distributed.launch import run_distributed

from .test_trainstate import torch_job, train_steps


class Stubborn:
    """A stateful value that refuses every state it is given, its own previous one too."""

    def __init__(self, value: int = 0) -> None:
        self.value = value
        self.calls = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.calls += 1
        raise RuntimeError("refuses every state")


class OneWay:
    """A stateful value that only moves forward: it takes a later version and refuses an
    earlier one, so that once loaded it refuses to go back to its own previous state."""

    def __init__(self, version: int) -> None:
        self.version = version

    def state_dict(self) -> dict:
        return {"version": self.version}

    def load_state_dict(self, state: dict) -> None:
        if state["version"] < self.version:
            raise ValueError(f"cannot go back from {self.version} to {state['version']}")
        self.version = state["version"]


class Accepting:
    """A stateful value that takes whatever it is given."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def refuse_after_loading(optimizer: torch.optim.Optimizer) -> None:
    """A ``load_state_dict`` post hook that refuses what was loaded (as a check after loading
    does): the optimizer has changed when it raises."""
    raise ValueError("this build refuses checkpoints")


def held(model: torch.nn.Module, opts: list, schedulers: dict) -> dict:
    """What a failed load must leave as it was: the model's params and buffers, each
    optimizer's state (its tensors, by identity and by bytes) and groups, the schedulers'
    state, the CPU generator."""
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "state": [
            [(id(p), k, id(v), _copy(v)) for p, s in o.state.items() for k, v in s.items()]
            for o in opts
        ],
        "groups": [
            [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in opts
        ],
        "params": [[id(p) for g in o.param_groups for p in g["params"]] for o in opts],
        "schedulers": {n: copy.deepcopy(s.state_dict()) for n, s in schedulers.items()},
        "rng": torch.get_rng_state(),
    }


def _copy(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def same(a, b) -> bool:
    """Equal, tensors compared by dtype, shape and bytes."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def saved_job(tmp_path, **objects):
    """A checkpoint of a job trained 2 steps, its extra holding ``objects`` beside a step, a
    scheduler and plain values, its rank_extra the RNG state and ``objects`` too."""
    model, opts, schedulers = torch_job(0)
    train_steps(model, opts, schedulers, 2)
    extra = {"step": 2, **objects, "scheduler": schedulers["muon"], "data": {"batch": 7}}
    rank_extra = {"rng": muonckpt.RNGState(), **objects}
    return muonckpt.save(opts, tmp_path / "ckpt", extra=extra, rank_extra=rank_extra)


def running_job():
    """Another job, one step in (its optimizers hold state: a rollback), schedulers moved on."""
    model, opts, schedulers = torch_job(1)
    train_steps(model, opts, schedulers, 1)
    for _ in range(3):
        schedulers["muon"].step()
    return model, opts, schedulers


def test_an_object_that_refuses_every_state_is_named_and_nothing_changes(tmp_path):
    """It refuses its saved state and would refuse its own previous one too: it is not asked
    again (its state is still its own), the values loaded before it (a scheduler, the RNG
    state) are put back, and the optimizers and the model were never touched."""
    ckpt = saved_job(tmp_path, late=Accepting(5))
    model, opts, schedulers = running_job()
    before = held(model, opts, schedulers)
    stubborn = Stubborn(1)
    trainer = {"step": 0, "scheduler": schedulers["muon"], "data": {"batch": 3}}
    mine = {"rng": muonckpt.RNGState(), "late": stubborn}
    message = r"rank_extra\[0\]\['late'\]: its load_state_dict refused the saved state " + (
        r"\(RuntimeError: refuses every state\)$"
    )
    with pytest.raises(muonckpt.CheckpointError, match=message):
        muonckpt.load(opts, ckpt, extra=trainer, rank_extra=mine)
    assert same(held(model, opts, schedulers), before)
    assert trainer == {"step": 0, "scheduler": schedulers["muon"], "data": {"batch": 3}}
    assert stubborn.calls == 1 and stubborn.value == 1
    # The same checkpoint loads once nothing refuses.
    muonckpt.load(opts, ckpt, extra=trainer, rank_extra={"rng": mine["rng"], "late": Accepting()})
    assert trainer["step"] == 2 and trainer["data"] == {"batch": 7}


def test_an_object_that_cannot_go_back_is_named_and_everything_else_is_put_back(tmp_path):
    """A value loaded before the refusal refuses its own previous state: the error names both,
    one line, and every other value, the optimizers and the model are as they were."""
    ckpt = saved_job(tmp_path, early=OneWay(3), late=Accepting(5))
    model, opts, schedulers = running_job()
    before = held(model, opts, schedulers)
    one_way = OneWay(1)
    trainer = {"early": one_way, "scheduler": schedulers["muon"], "late": Stubborn()}
    with pytest.raises(muonckpt.CheckpointError) as failed:
        muonckpt.load(opts, ckpt, extra=trainer)
    text = str(failed.value)
    assert "\n" not in text
    assert re.search(r"extra\['late'\]: its load_state_dict refused the saved state", text)
    assert re.search(
        r"extra\['early'\] is left changed: its load_state_dict refused its own previous "
        r"state too \(ValueError: cannot go back from 3 to 1\)",
        text,
    )
    assert one_way.version == 3  # as the error says
    assert same(held(model, opts, schedulers), before)


def test_an_optimizer_that_refuses_leaves_every_optimizer_and_value_as_it_was(tmp_path):
    """The second of two optimizers takes its share and then refuses, after the first took
    its own and the job's values were loaded: every one is put back, tensor for tensor."""
    ckpt = saved_job(tmp_path)
    model, opts, schedulers = running_job()
    opts[1].register_load_state_dict_post_hook(refuse_after_loading)
    before = held(model, opts, schedulers)
    trainer = {"scheduler": schedulers["muon"], "data": {"batch": 3}}
    mine = {"rng": muonckpt.RNGState()}
    message = (
        r"^optimizer 1 \(AdamW\): its load_state_dict refused the checkpoint's state "
        r"\(ValueError: this build refuses checkpoints\)$"
    )
    with pytest.raises(muonckpt.StateDictError, match=message):
        muonckpt.load(opts, ckpt, extra=trainer, rank_extra=mine)
    assert same(held(model, opts, schedulers), before)
    assert trainer == {"scheduler": schedulers["muon"], "data": {"batch": 3}}


def refused_on_one_rank(ckpt: str) -> dict:
    """(2 gloo ranks) DDP replicas save, train on, then load with rank 1's rank_extra value
    refusing every state: each rank's error and whether everything it held is as it was."""
    rank = dist.get_rank()
    torch.manual_seed(0)  # replicas: the same model, optimizer and data on every rank
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step() -> None:
        model(torch.ones(2, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()

    step()
    extra = {"step": 1, "scheduler": scheduler}
    muonckpt.save(opt, ckpt, extra=extra, rank_extra={"value": Accepting(rank)})
    step()
    before = held(model, [opt], {"scheduler": scheduler})
    mine = {"value": Stubborn() if rank == 1 else Accepting(7)}
    try:
        muonckpt.load(opt, ckpt, extra={"scheduler": scheduler}, rank_extra=mine)
        error = None
    except muonckpt.MuonCkptError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {
        "error": error,
        "unchanged": same(held(model, [opt], {"scheduler": scheduler}), before),
        "value": mine["value"].value,
    }


@pytest.mark.dist
def test_a_refusal_on_one_rank_leaves_every_rank_as_it_was(tmp_path):
    out = run_distributed(refused_on_one_rank, 2, str(tmp_path / "ckpt"), timeout=120)
    for result in out:
        assert result["error"] is not None, result
        assert result["error"].startswith("CheckpointError: load (read): rank 1: "), result
        assert (
            "rank_extra[1]['value']: its load_state_dict refused the saved state"
            in (result["error"])
        )
        assert result["unchanged"], result
    assert [result["value"] for result in out] == [7, 0]
