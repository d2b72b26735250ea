"""KellerJordan's distributed Muon (upstream ``muon.Muon.step``) over named params, and runs of it.

Each param's momentum lives only on its owner rank, ``index % world_size`` over the params sorted
by shape, and the updated params are shared with ``dist.all_gather`` over chunks of ``world_size``
params, exactly as upstream. The update is upstream's own ``muon.muon_update`` from the
``muon-optimizer`` package; only the constructor differs, because upstream's sorts bare tensors
and so cannot take the ``(name, tensor)`` pairs that give state dicts names.

That is the layout whose ``state_dict()`` upstream loses: without
hooks, rank 0 saves only the momentum of the params it owns.

Full params and grads are generated identically on every rank, so runs at any world size are
comparable, bit for bit, with a single-process run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from muon import muon_update

from muonckpt.state.hooks import install_hooks

# Eight 2-D params of several shapes, with ties (b/f, a/d, c/g) to pin the stable sort, and a
# tall one (h) for the rows/cols scale.
SHAPES = {
    "a": (8, 8),
    "b": (12, 16),
    "c": (4, 6),
    "d": (8, 8),
    "e": (6, 10),
    "f": (12, 16),
    "g": (4, 6),
    "h": (10, 6),
}
SORTED_NAMES = ["b", "f", "h", "a", "d", "e", "c", "g"]
"""Upstream's construction order: ``sorted(params, key=lambda x: x.size(), reverse=True)``, shapes
compared as tuples, ties kept in the given order."""
HPARAMS = {"lr": 0.05, "weight_decay": 0.1, "momentum": 0.9}


class KJMuon(torch.optim.Optimizer):
    """Upstream's distributed ``Muon``, taking ``(name, tensor)`` pairs so state dicts have names.

    One param group. Every rank holds every param; rank ``r`` updates params ``base + r`` of
    each chunk of ``world_size`` and keeps their ``momentum_buffer``; the chunk is then
    all-gathered into every rank's params in place.
    """

    def __init__(
        self,
        named_params,
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        ns_steps: int = 5,
    ) -> None:
        named = sorted(named_params, key=lambda pair: pair[1].size(), reverse=True)  # stable
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps)
        super().__init__([{"params": named}], defaults)

    @torch.no_grad()
    def step(self, closure=None):
        world, rank = dist.get_world_size(), dist.get_rank()
        for group in self.param_groups:
            params = group["params"]
            params_pad = params + [torch.empty_like(params[-1])] * (world - len(params) % world)
            for base_i in range(0, len(params), world):
                if base_i + rank < len(params):
                    p = params[base_i + rank]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)  # force synchronization
                    state = self.state[p]
                    if len(state) == 0:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    update = muon_update(
                        p.grad,
                        state["momentum_buffer"],
                        beta=group["momentum"],
                        ns_steps=group["ns_steps"],
                    )
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(update.reshape(p.shape), alpha=-group["lr"])
                _all_gather(params_pad[base_i : base_i + world], params_pad[base_i + rank])
        return None


def _all_gather(chunk: list[torch.Tensor], mine: torch.Tensor) -> None:
    """Upstream's ``dist.all_gather(chunk, mine)``; chunks mixing shapes travel padded and flat.

    Upstream relies on its size sort giving every chunk one shape (true for a transformer's
    blocks); gloo rejects mixed shapes, so those chunks go through equal-sized flat buffers.
    """
    if all(t.shape == mine.shape for t in chunk):
        dist.all_gather(chunk, mine)
        return
    width = max(t.numel() for t in chunk)
    padded = torch.zeros(width, dtype=mine.dtype)
    padded[: mine.numel()].copy_(mine.reshape(-1))
    parts = [torch.empty(width, dtype=mine.dtype) for _ in chunk]
    dist.all_gather(parts, padded)
    for t, part in zip(chunk, parts, strict=True):
        t.copy_(part[: t.numel()].view(t.shape))


def owner(index: int, p: torch.Tensor) -> int:
    """The rank holding param ``index``'s state (for :func:`install_hooks`)."""
    return index % dist.get_world_size()


def initial_params() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4321)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def full_grad(name: str, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step * 1000 + sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=gen)


def build(params: dict[str, torch.Tensor], hooks: bool = True, **install) -> KJMuon:
    opt = KJMuon([(name, t.clone()) for name, t in params.items()], **HPARAMS)
    if hooks:
        install_hooks(opt, owner=owner, **install)
    return opt


def train(opt: KJMuon, first_step: int, steps: int) -> None:
    for step in range(first_step, first_step + steps):
        for group in opt.param_groups:
            for name, p in zip(group["param_names"], group["params"], strict=True):
                p.grad = full_grad(name, step)
        opt.step()


def named_params(opt: KJMuon) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone()
        for g in opt.param_groups
        for n, p in zip(g["param_names"], g["params"], strict=True)
    }


def local_momentum(opt: KJMuon) -> dict[str, torch.Tensor]:
    """The momentum this rank holds, by param name."""
    return {
        n: opt.state[p]["momentum_buffer"].clone()
        for g in opt.param_groups
        for n, p in zip(g["param_names"], g["params"], strict=True)
        if "momentum_buffer" in opt.state.get(p, {})
    }


def owned_names(opt: KJMuon) -> list[str]:
    world, rank = dist.get_world_size(), dist.get_rank()
    names = [n for g in opt.param_groups for n in g["param_names"]]
    return [n for i, n in enumerate(names) if i % world == rank]


def phase(
    params_path: str | None,
    state_path: str | None,
    first_step: int,
    steps: int,
    save_to: str | None,
) -> dict:
    """Build with hooks, optionally resume from files, train, optionally save on rank 0.

    Returns this rank's params, the names it owns, and the names it held state for right
    after loading.
    """
    params = initial_params()
    if params_path is not None:
        params = torch.load(params_path, weights_only=True)
    opt = build(params)
    loaded: list[str] = []
    if state_path is not None:
        opt.load_state_dict(torch.load(state_path, weights_only=True))
        loaded = sorted(local_momentum(opt))
    train(opt, first_step, steps)
    if save_to is not None:
        sd = opt.state_dict()
        if dist.get_rank() == 0:
            torch.save(sd, save_to)
            torch.save(named_params(opt), save_to + ".params")
    return {"params": named_params(opt), "owned": sorted(owned_names(opt)), "loaded": loaded}
