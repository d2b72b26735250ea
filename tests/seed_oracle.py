"""An independent oracle of the seed's math: one process, full tensors, written from the seed
(shared/reference/seed_muon_readable.py, its ``zeropower_via_newtonschulz5``, ``step`` and
``adjust_lr_wd_for_muon``) without importing muonckpt.

``OracleMuon`` keeps, per full param, what the seed's single-process step keeps (sum-form
momentum, AdamW moments) and updates the params in place exactly as the seed does.
"""

from __future__ import annotations

import math

import torch


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    assert len(G.shape) == 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G
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


def adjust_lr_wd_for_muon(lr: float, matched_adamw_rms: float, param_shape) -> float:
    A, B = param_shape[:2]
    return lr * (math.sqrt(max(A, B)) * matched_adamw_rms)


SEED_DEFAULTS = dict(
    lr=2e-2,
    weight_decay=0.1,
    matched_adamw_rms=0.2,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    adamw_betas=(0.95, 0.95),
    adamw_eps=1e-8,
)
"""The seed's constructor defaults."""


class OracleMuon:
    """The seed's step over groups of full tensors: ``[{"params": [t, ...], **settings}]``."""

    def __init__(self, groups: list[dict]) -> None:
        self.groups = [{**SEED_DEFAULTS, **g} for g in groups]
        self.state: dict[int, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, grads: dict[int, torch.Tensor]) -> None:
        """``grads``: id(param) -> its full grad."""
        ns_inputs = {}
        for group in self.groups:
            if not group.get("use_muon", False):
                continue
            for p in group["params"]:
                g = grads[id(p)]
                state = self.state.setdefault(id(p), {})
                if "muon_buffer" not in state:
                    state["muon_buffer"] = torch.zeros_like(g)
                buf = state["muon_buffer"]
                buf.mul_(group["momentum"]).add_(g)
                g = g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                ns_inputs[id(p)] = g.bfloat16()
        for group in self.groups:
            if not group.get("use_muon", False):
                continue
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                ns_input = ns_inputs[id(p)]
                update = zeropower_via_newtonschulz5(ns_input, steps=group["ns_steps"])
                p.mul_(1 - lr * wd)
                scaled = adjust_lr_wd_for_muon(lr, group["matched_adamw_rms"], ns_input.shape)
                p.add_(update, alpha=-scaled)
        for group in self.groups:
            if group.get("use_muon", False):
                continue
            group["step"] = group.get("step", 0) + 1
            step, lr, wd = group["step"], group["lr"], group["weight_decay"]
            beta1, beta2 = group["adamw_betas"]
            for p in group["params"]:
                g = grads[id(p)]
                state = self.state.setdefault(id(p), {})
                if len(state) == 0:
                    state["adamw_exp_avg"] = torch.zeros_like(g)
                    state["adamw_exp_avg_sq"] = torch.zeros_like(g)
                buf1, buf2 = state["adamw_exp_avg"], state["adamw_exp_avg_sq"]
                buf1.lerp_(g, 1 - beta1)
                buf2.lerp_(g.square(), 1 - beta2)
                g = buf1 / (group["adamw_eps"] + buf2.sqrt())
                scale = (1 - beta1**step) / (1 - beta2**step) ** 0.5
                p.mul_(1 - lr * wd)
                p.add_(g, alpha=-lr / scale)
