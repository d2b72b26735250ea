"""A port of NorMuon as its authors define it: microsoft/dion's ``NorMuon``, single process.

The dion package is not on PyPI (``pip download dion`` / ``microsoft-dion`` find nothing), so
this ports microsoft/dion@0a059a4542e5aa74b40dcd1dce363836c7afcd48 (MIT): ``dion/normuon.py``
(``NorMuon``, ``normuon_update_megabatch_async``, ``_normuon_normalization_core``),
``dion/megabatch_base.py`` (``step``, ``_get_or_initialize_state``, ``adjust_lr_spectral_norm``),
``dion/muon.py`` (``muon_update_pre_orthogonalize``, ``muon_update_post_orthogonalize``,
``zeropower_via_newtonschulz5``) and ``dion/scalar_opts.py`` (the AdamW half). Kept as upstream:
the group settings (``mu``, ``muon_beta2``, ``beta1``, ``beta2``, ``algorithm``, a ``step`` counted
in the group, ...), the state, made for every param at construction: ``momentum`` (the
param's shape and dtype, **sum form**: ``M = mu * M + G``) and ``variance_neuron``
(``param[..., 0:1]``: ``(rows, 1)``, ``(E, rows, 1)`` for a batch of matrices, the param's
dtype) for NorMuon params, ``momentum``, ``variance`` and a 0-d fp32 ``step_dev`` for AdamW
params. Left out: the process group / device mesh (a single process is dion's path for
replicated DDP params), CUDA graphs, torch.compile, the per-head and split-QKV views, cautious
weight decay, Lion; the orthogonalization is dion's ``zeropower_via_newtonschulz5`` (its
``use_polar_express=False`` path) and the AdamW half the plain formula of its fused kernel.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NS_CONSTS = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


def zeropower_via_newtonschulz5(G: Tensor, epsilon: float = 1e-7) -> Tensor:
    X = G.to(dtype=torch.bfloat16)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + epsilon)
    for a, b, c in NS_CONSTS:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def _normuon_normalization_core(U: Tensor, V: Tensor, muon_beta2: Tensor) -> tuple[Tensor, Tensor]:
    U = U.to(dtype=V.dtype)
    norm_U = U.norm(p=2, dim=(-2, -1), keepdim=True)
    neuron_norms = (U * U).mean(dim=-1, keepdim=True)
    V = torch.lerp(V, neuron_norms, 1 - muon_beta2)
    normalized_U = U / (V.sqrt() + 1e-8)
    norm_U_new = normalized_U.norm(p=2, dim=(-2, -1), keepdim=True).clamp(min=1e-8)
    return normalized_U * (norm_U / norm_U_new), V


class NorMuon(torch.optim.Optimizer):
    """dion's NorMuon (groups with ``algorithm="adamw"`` run its AdamW)."""

    def __init__(
        self,
        params,
        lr: float = 0.01,
        mu: float = 0.95,
        muon_beta2: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        epsilon: float = 1e-8,
        nesterov: bool = False,
        adjust_lr: str | None = "spectral_norm",
    ) -> None:
        defaults = dict(
            lr=lr,
            mu=mu,
            muon_beta2=muon_beta2,
            beta1=betas[0],
            beta2=betas[1],
            weight_decay=weight_decay,
            cautious_wd=False,
            algorithm="normuon",
            step=0,
            epsilon=epsilon,
            nesterov=nesterov,
            flatten=False,
            adjust_lr=adjust_lr,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:  # megabatch_base: state complete from construction
            for p in group["params"]:
                self._get_or_initialize_state(p, group["algorithm"])

    def _get_or_initialize_state(self, param: Tensor, algo: str) -> dict:
        state = self.state[param]
        if not state:
            state["momentum"] = torch.zeros_like(param)
            if algo == "adamw":
                state["variance"] = torch.zeros_like(param)
        if algo == "adamw" and "step_dev" not in state:
            state["step_dev"] = torch.zeros((), dtype=torch.float32)
        if algo == "normuon" and "variance_neuron" not in state:
            state["variance_neuron"] = torch.zeros_like(param[..., 0:1])
        return state

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] += 1
            params = [p for p in group["params"] if p.grad is not None]
            if group["algorithm"] == "normuon":
                for p in params:  # one shape group at a time upstream; the math is per param
                    self._normuon(p, group)
            else:
                for p in params:
                    self._adamw(p, group)

    def _normuon(self, p: Tensor, group: dict) -> None:
        state = self._get_or_initialize_state(p, "normuon")
        M, V = state["momentum"], state["variance_neuron"]
        G = p.grad.to(dtype=M.dtype)
        momentum = torch.tensor(group["mu"])
        M.mul_(momentum).add_(G)
        U = M * momentum + G if group["nesterov"] else M
        U = zeropower_via_newtonschulz5(U.to(dtype=torch.bfloat16), group["epsilon"])
        U, V_new = _normuon_normalization_core(U, V, torch.tensor(group["muon_beta2"]))
        V.copy_(V_new)
        lr = group["lr"]
        fan_out, fan_in = p.shape[-2:]
        adjusted = lr * math.sqrt(fan_out / fan_in) if group["adjust_lr"] else lr
        p.mul_(1 - lr * group["weight_decay"])
        p.sub_(U.to(p.dtype) * adjusted)

    def _adamw(self, p: Tensor, group: dict) -> None:
        state = self._get_or_initialize_state(p, "adamw")
        state["step_dev"] += 1
        step = state["step_dev"].item()
        beta1, beta2, lr = group["beta1"], group["beta2"], group["lr"]
        state["momentum"].lerp_(p.grad, 1 - beta1)
        state["variance"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (state["variance"].sqrt() / math.sqrt(1 - beta2**step)).add_(group["epsilon"])
        p.mul_(1 - lr * group["weight_decay"])
        p.addcdiv_(state["momentum"], denom, value=-lr / (1 - beta1**step))
