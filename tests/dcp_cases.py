"""An FSDP2 job with a DTensor Muon, as torchtitan / dion / muon-fsdp2 users run one: the test
suite's model under ``fully_shard`` (CPU, gloo), torch.optim.Muon's math and param groups on
the full matrix, the update sharded back; AdamW on the other params. It writes and reads DCP
as those trainers do. The functions here run in gloo children (``run_distributed``), but for
:func:`single_process_dcp`, a small DCP checkpoint one process saves.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from .fixture_model import ADAMW_HPARAMS, ADAMW_PARAMS, MUON_HPARAMS, MUON_PARAMS, full_grad

BETAS, EPS = (0.95, 0.95), 1e-8
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class DTensorMuon(torch.optim.Optimizer):
    """torch.optim.Muon for DTensor params: EMA momentum on the shard, Newton-Schulz on the full
    matrix (``full_tensor``), each rank keeping its shard of the update."""

    def __init__(
        self,
        params,
        lr=1e-3,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        ns_coefficients=(3.4445, -4.775, 2.0315),
        eps=1e-7,
        ns_steps=5,
        adjust_lr_fn=None,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                full = update.full_tensor()
                ortho = _zeropower_via_newtonschulz(
                    full, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                lr = group["lr"]
                adjusted = _adjust_lr(lr, group["adjust_lr_fn"], full.shape)
                shard = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(shard, alpha=-adjusted)


class Model(torch.nn.Module):
    """The fixture's params by name; the loss is sum(p * G) so each grad is exactly G."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, value in params.items():
            self.register_parameter(name, torch.nn.Parameter(value.clone()))
        self.step_index = 0

    def forward(self) -> torch.Tensor:
        return sum(
            (p * full_grad(name, self.step_index)).sum() for name, p in self.named_parameters()
        )


def build(params: dict[str, torch.Tensor]):
    """The model, fully sharded over the world, and its two optimizers."""
    world = torch.distributed.get_world_size()
    model = Model(params)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    named = dict(model.named_parameters())
    muon = DTensorMuon(
        [named[n] for n in MUON_PARAMS],
        lr=MUON_HPARAMS["lr"],
        weight_decay=MUON_HPARAMS["weight_decay"],
        momentum=MUON_HPARAMS["momentum"],
        adjust_lr_fn="match_rms_adamw",
    )
    adamw = torch.optim.AdamW(
        [named[n] for n in ADAMW_PARAMS],
        lr=ADAMW_HPARAMS["lr"],
        weight_decay=ADAMW_HPARAMS["weight_decay"],
        betas=BETAS,
        eps=EPS,
        foreach=False,
    )
    return model, [muon, adamw]


def train(model, opts, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        model.step_index = step
        model().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


def full_state(model, opts) -> dict[str, torch.Tensor]:
    """Every param and state tensor in full, by ``name`` / ``name.key``."""
    out = {}
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                name = next(n for n, q in model.named_parameters() if q is p)
                out[name] = p.full_tensor().clone()
                for key, value in opt.state[p].items():
                    full = value.full_tensor() if isinstance(value, DTensor) else value
                    out[f"{name}.{key}"] = full.clone()
    return out


def state_dicts(model, opts, layout: str) -> dict:
    """What the job hands to DCP, in DCP's recipe or torchtitan's layout."""
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, opts, options=FLAT)
    if layout == "recipe":
        return {"model": msd, "optimizer": osd}
    extras = {
        "lr_scheduler": {"last_epoch": 3, "base_lrs": [0.05, 0.01]},
        "dataloader": {"world_size": 2, "position": torch.tensor(17)},
        "train_state": {"step": 3},
    }
    return {**msd, "optimizer": osd, **extras}


def train_and_save(initial: dict[str, torch.Tensor], steps: int, paths: dict[str, str]):
    """(each rank of a world) Train ``steps`` and save DCP in each layout of ``paths``."""
    model, opts = build(initial)
    train(model, opts, 0, steps)
    for layout, path in paths.items():
        dcp.save(state_dicts(model, opts, layout), checkpoint_id=path)
    return full_state(model, opts)


def load_and_continue(initial: dict[str, torch.Tensor], path: str, first: int, steps: int):
    """(each rank of a world) Build from ``initial``, load torchtitan-layout DCP, train on; the
    full state after the load and after training."""
    model, opts = build(initial)
    state = state_dicts(model, opts, "torchtitan")
    state = {
        k: v for k, v in state.items() if k not in ("lr_scheduler", "dataloader", "train_state")
    }
    dcp.load(state, checkpoint_id=path)
    osd = state.pop("optimizer")
    set_model_state_dict(model, state)
    set_optimizer_state_dict(model, opts, osd, options=FLAT)
    loaded = full_state(model, opts)
    settings = {k: v for k, v in opts[0].param_groups[0].items() if k != "params"}
    train(model, opts, first, steps)
    return {"loaded": loaded, "trained": full_state(model, opts), "settings": settings}


def single_process_dcp(path, momentum_key: str, mu_setting: str, extra: dict, adam: dict):
    """A DCP checkpoint of one Muon matrix and one AdamW vector, saved by one process."""
    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(6, 4, generator=gen), torch.randn(5, generator=gen)
    m = torch.randn(6, 4, generator=gen)
    a, v = torch.randn(5, generator=gen), torch.rand(5, generator=gen)
    muon_settings = {"lr": 0.02, "weight_decay": 0.0, mu_setting: 0.9, "nesterov": True, **extra}
    optimizer = {f"state.w.{momentum_key}": m, f"state.b.{adam['exp_avg']}": a}
    optimizer[f"state.b.{adam['exp_avg_sq']}"] = v
    optimizer["state.b.step"] = adam.get("step", torch.tensor(4.0))
    optimizer.update({f"param_groups.w.{k}": x for k, x in muon_settings.items()})
    adam_settings = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    adam_settings.update(adam.get("settings", {}))
    optimizer.update({f"param_groups.b.{k}": x for k, x in adam_settings.items()})
    dcp.save({"model": {"w": w, "b": b}, "optimizer": optimizer}, checkpoint_id=str(path))
    return w, b, m, a, v
