"""Phases run inside gloo children: a DDP job whose torch.optim optimizers (torch.optim.Muon
for the matrices, AdamW for the rest) are replicas on every rank, saved and loaded with no
hooks; and collectives that some ranks never call."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import muonckpt
from muonckpt import offline
from muonckpt.distributed import group_steps

from .fixture_model import build, initial_params, train


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(torch.relu(self.embed(x)))))


def ddp_job(seed: int) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """The model (initialised from ``seed``) wrapped in DDP, and its two optimizers."""
    torch.manual_seed(seed)
    model = DistributedDataParallel(Net())
    return model, optimizers_of(model.module)


def optimizers_of(net: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon for the hidden matrices, AdamW for the rest, over named params."""
    named = list(net.named_parameters())
    hidden = [(n, p) for n, p in named if p.ndim == 2 and n != "embed.weight"]
    rest = [(n, p) for n, p in named if p.ndim != 2 or n == "embed.weight"]
    muon = torch.optim.Muon(hidden, lr=0.02, adjust_lr_fn="match_rms_adamw")
    return [muon, torch.optim.AdamW(rest, lr=0.01)]


def ddp_train(model: torch.nn.Module, optimizers: list, first: int, steps: int) -> list[float]:
    """``steps`` DDP steps from step ``first``: each rank its own batch of the step."""
    losses = []
    for step in range(first, first + steps):
        gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x, y = torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def state_of(model: torch.nn.Module, optimizers: list) -> dict[str, torch.Tensor]:
    """Every param and optimizer state value, by name, as CPU tensors."""
    out = {f"param.{n}": p.detach().clone() for n, p in model.module.named_parameters()}
    names = {p: n for n, p in model.module.named_parameters()}
    for k, optimizer in enumerate(optimizers):
        for p, entry in optimizer.state.items():
            for key, value in entry.items():
                out[f"opt{k}.{names[p]}.{key}"] = torch.as_tensor(value).detach().clone()
    return out


def ddp_save_phase(path: str, steps: int) -> dict[str, torch.Tensor]:
    """Train ``steps`` steps, save both optimizers into one checkpoint; this rank's state."""
    model, optimizers = ddp_job(seed=0)
    ddp_train(model, optimizers, 0, steps)
    muonckpt.save(optimizers, path)
    return state_of(model, optimizers)


def ddp_resume_phase(path: str, first: int, steps: int) -> dict[str, object]:
    """A fresh job (other initial weights), loaded from ``path``: its state right after the
    load, and after ``steps`` more steps."""
    model, optimizers = ddp_job(seed=1)
    muonckpt.load(optimizers, path)
    loaded = state_of(model, optimizers)
    losses = ddp_train(model, optimizers, first, steps)
    return {"loaded": loaded, "trained": state_of(model, optimizers), "losses": losses}


def diverged_save_phase(path: str) -> str:
    """Rank 1's AdamW state drifts from rank 0's; the save must refuse, naming it."""
    model, optimizers = ddp_job(seed=0)
    ddp_train(model, optimizers, 0, 1)
    if dist.get_rank() == 1:
        next(iter(optimizers[1].state.values()))["exp_avg"].add_(1e-3)
    try:
        muonckpt.save(optimizers, path)
    except muonckpt.MuonCkptError as exc:
        return str(exc)
    return "saved"


def lone_call_phase(
    path: str, kind: str, operation: str, caller: int, warm: bool, timeout: float
) -> dict[str, object]:
    """Only rank ``caller`` calls ``operation`` (``if rank == caller: save(...)``) on a ``kind``
    job (``ddp``: the replicated torch optimizers; ``muon``: the packaged Muon at 2x1, whose
    grid is already learned when ``warm``); the others go on to a barrier. Then every rank
    calls it. This rank's error, and whether the call of every rank then worked."""
    muonckpt.distributed.set_rendezvous_timeout(timeout)
    if kind == "ddp":
        model, optimizer = ddp_job(seed=0)
        ddp_train(model, optimizer, 0, 1)
    else:
        optimizer, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
        train(optimizer, sharded, dp_rank, tp_rank, 0, 1)
    if operation == "load" or warm:
        muonckpt.save(optimizer, path)

    def call() -> None:
        if operation == "save":
            muonckpt.save(optimizer, path, overwrite=True)
        elif operation == "async_save":
            muonckpt.async_save(optimizer, path, overwrite=True).result()
        elif operation == "load":
            muonckpt.load(optimizer, path)
        elif operation == "state_dict()":
            optimizer.state_dict()

    error = None
    if dist.get_rank() == caller:
        try:
            call()
        except muonckpt.MuonCkptError as exc:
            error = str(exc)
    dist.barrier()
    call()  # the ranks meet again: the abandoned call is nobody's
    return {"error": error, "again": True}


def offline_phase(src: str, dst: str, how: str, timeout: float) -> str | None:
    """``consolidate`` over the default group (as under torchrun), rank 1 called with another
    output (``output``) or not at all (``lone``). This rank's error."""
    muonckpt.distributed.set_rendezvous_timeout(timeout)
    error = None
    if dist.get_rank() == 0 or how == "output":
        out = f"{dst}-rank1" if dist.get_rank() == 1 else dst
        try:
            offline.consolidate(src, out, collective=True)
        except muonckpt.MuonCkptError as exc:
            error = str(exc)
    dist.barrier()
    return error


def gather_disagreeing_phase() -> str | None:
    """``gather_state_dict`` with ``all_ranks`` True on rank 0 only. This rank's error."""
    optimizer, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
    train(optimizer, sharded, dp_rank, tp_rank, 0, 1)
    try:
        muonckpt.gather_state_dict(optimizer, all_ranks=dist.get_rank() == 0)
    except muonckpt.MuonCkptError as exc:
        return str(exc)
    return None


def subgroup_phase(root: str, timeout: float) -> dict[str, object]:
    """Two pairs of ranks ({0, 1} and {2, 3}), each with its own replicated optimizer over its
    pair (``install_hooks(..., owner=REPLICATED, group=pair)``), save and load at the same time,
    three times, each pair to its own path; then rank 2 saves alone. This rank's error and the
    keys of the agreed operations' rendezvous left in the store, but the last one's (the
    next one over the same ranks deletes them)."""
    muonckpt.distributed.set_rendezvous_timeout(timeout)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = dist.get_rank() // 2
    torch.manual_seed(pair)
    net = Net()
    optimizers = optimizers_of(net)
    for optimizer in optimizers:
        muonckpt.install_hooks(optimizer, owner=lambda i, p: muonckpt.REPLICATED, group=pairs[pair])
    for step in range(3):
        for optimizer in optimizers:
            for p in optimizer.param_groups[0]["params"]:
                p.grad = torch.full_like(p, 0.1 * (step + 1))
            optimizer.step()
        for k, optimizer in enumerate(optimizers):
            path = f"{root}/pair-{pair}-opt-{k}-step-{step}"
            muonckpt.save(optimizer, path)
            muonckpt.load(optimizer, path)
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    members = [2 * pair, 2 * pair + 1]
    operations = group_steps._SEQUENCE[tuple(members)]
    left = [  # every key of every rendezvous so far but the last (the next one deletes it)
        key
        for sequence in range(operations - 1)
        for ranks in ([0, 1], [2, 3])
        for arrivals, verdict in [group_steps.store_keys(ranks, sequence, "rendezvous")]
        for key in [*arrivals, verdict]
        if store.check([key])
    ]
    error = None
    if dist.get_rank() == 2:
        try:
            muonckpt.save(optimizers[0], f"{root}/lone")
        except muonckpt.MuonCkptError as exc:
            error = str(exc)
    dist.barrier()
    return {"error": error, "left": left, "operations": operations}
