"""An oracle of the seed's optimizer math, written from the seed document and independent of
``muonckpt``: it imports nothing from the package, so a change there cannot move it.

It works on whole tensors in one process, the way the seed's math reads before any sharding:

* Muon groups (``use_muon``): sum-form momentum ``buf = mu * buf + g``; a Nesterov look-ahead
  ``g + mu * buf``; a bf16 copy orthogonalized by the quintic Newton-Schulz iteration (the tall
  case transposed); decoupled weight decay; then the update scaled by
  ``lr * sqrt(max(rows, cols)) * matched_adamw_rms`` (Moonlight's LR matching).
* Other groups: AdamW with a per-group step count, both moments by ``lerp`` and bias correction
  folded into the step size.

The operations run in the seed's order, so that results can be compared bit for bit: floating
point addition does not commute with reordering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

QUINTIC = (3.4445, -4.7750, 2.0315)
"""Newton-Schulz coefficients (a, b, c) of ``X <- a X + (b A + c A^2) X``, ``A = X X^T``."""


def orthogonalize(matrix: torch.Tensor, steps: int) -> torch.Tensor:
    """Approximate ``U V^T`` of ``matrix`` by ``steps`` quintic Newton-Schulz iterations."""
    a, b, c = QUINTIC
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.T if tall else matrix
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        poly = b * gram + (c * gram) @ gram
        x = a * x + poly @ x
    return x.T if tall else x


@dataclass
class OracleGroup:
    """One param group: full tensors and the seed's hyperparameters."""

    params: list[torch.Tensor]
    use_muon: bool
    lr: float = 2e-2
    weight_decay: float = 0.1
    matched_adamw_rms: float = 0.2
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adamw_betas: tuple[float, float] = (0.95, 0.95)
    adamw_eps: float = 1e-8
    step: int = 0
    state: list[dict[str, torch.Tensor]] = field(default_factory=list)


def oracle_step(groups: list[OracleGroup], grads: list[list[torch.Tensor]]) -> None:
    """One step of every group in place; ``grads[i][j]`` is the grad of group i's param j."""
    for group, group_grads in zip(groups, grads, strict=True):
        if not group.state:
            group.state = [{} for _ in group.params]
        if group.use_muon:
            _muon(group, group_grads)
        else:
            _adamw(group, group_grads)


def _muon(group: OracleGroup, grads: list[torch.Tensor]) -> None:
    mu = group.momentum
    for param, grad, state in zip(group.params, grads, group.state, strict=True):
        buf = state.setdefault("buf", torch.zeros_like(grad))
        buf.mul_(mu).add_(grad)
        look_ahead = grad.add(buf, alpha=mu) if group.nesterov else buf
        update = orthogonalize(look_ahead.bfloat16(), group.ns_steps)
        rows, cols = param.shape
        scaled_lr = group.lr * (math.sqrt(max(rows, cols)) * group.matched_adamw_rms)
        param.mul_(1 - group.lr * group.weight_decay)
        param.add_(update, alpha=-scaled_lr)


def _adamw(group: OracleGroup, grads: list[torch.Tensor]) -> None:
    group.step += 1
    beta1, beta2 = group.adamw_betas
    for param, grad, state in zip(group.params, grads, group.state, strict=True):
        first = state.setdefault("m", torch.zeros_like(grad))
        second = state.setdefault("v", torch.zeros_like(grad))
        first.lerp_(grad, 1 - beta1)
        second.lerp_(grad.square(), 1 - beta2)
        direction = first / (group.adamw_eps + second.sqrt())
        step_size = (1 - beta1**group.step) / (1 - beta2**group.step) ** 0.5
        param.mul_(1 - group.lr * group.weight_decay)
        param.add_(direction, alpha=-group.lr / step_size)
