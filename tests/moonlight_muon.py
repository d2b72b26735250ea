"""A port of Moonlight's Muon, the optimizer of MoonshotAI/Moonlight's ``examples/toy_train.py``
(https://github.com/MoonshotAI/Moonlight/blob/master/examples/toy_train.py, the seed's lineage),
kept as written there but for two changes that let it take 3-D params: the constructor's
``assert p.ndim == 2`` is left out (its ``step`` already views a gradient of more dims as
``(size(0), -1)``), and the update is viewed back to the param's shape before it is applied.

Its state is what muonckpt must carry as it is: sum-form momentum (``buf.mul_(mu).add_(g)``),
2-D for a 3-D param; a ``use_muon`` flag in every param's state; ``step``, ``moment1`` and
``moment2`` (not ``exp_avg``/``exp_avg_sq``) for its AdamW half; ``adamw_betas`` a tuple.
"""

from __future__ import annotations

import math

import torch


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    assert len(G.shape) == 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


class MoonlightMuon(torch.optim.Optimizer):
    def __init__(
        self,
        lr=1e-3,
        wd=0.1,
        muon_params=None,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        adamw_params=None,
        adamw_betas=(0.9, 0.95),
        adamw_eps=1e-8,
    ):
        defaults = dict(
            lr=lr,
            wd=wd,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
        )
        muon_params = list(muon_params)
        adamw_params = list(adamw_params) if adamw_params is not None else []
        super().__init__(muon_params + adamw_params, defaults)
        for p in muon_params:
            self.state[p]["use_muon"] = True
        for p in adamw_params:
            self.state[p]["use_muon"] = False

    def adjust_lr_for_muon(self, lr, param_shape):
        A, B = param_shape[:2]
        return lr * 0.2 * math.sqrt(max(A, B))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, momentum = group["lr"], group["wd"], group["momentum"]
            for p in [p for p in group["params"] if self.state[p]["use_muon"]]:
                g = p.grad
                if g is None:
                    continue
                if g.ndim > 2:
                    g = g.view(g.size(0), -1)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.mul_(momentum).add_(g)
                g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
                u = zeropower_via_newtonschulz5(g, steps=group["ns_steps"])
                adjusted_lr = self.adjust_lr_for_muon(lr, p.shape)
                p.data.mul_(1 - lr * wd)
                p.data.add_(u.view_as(p), alpha=-adjusted_lr)
            beta1, beta2 = group["adamw_betas"]
            eps = group["adamw_eps"]
            for p in [p for p in group["params"] if not self.state[p]["use_muon"]]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = 0
                    state["moment1"] = torch.zeros_like(g)
                    state["moment2"] = torch.zeros_like(g)
                state["step"] += 1
                step = state["step"]
                buf1, buf2 = state["moment1"], state["moment2"]
                buf1.lerp_(g, 1 - beta1)
                buf2.lerp_(g.square(), 1 - beta2)
                g = buf1 / (eps + buf2.sqrt())
                scale = (1 - beta1**step) / (1 - beta2**step) ** 0.5
                p.data.mul_(1 - lr * wd)
                p.data.add_(g, alpha=-lr / scale)
