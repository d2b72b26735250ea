"""What Megatron-Core's layer-wise Muon records of its param groups, read the same way from
either of its checkpoint formats (torch_dist: :mod:`.megatron`; torch: :mod:`._megatron_torch`):
each group's role and settings, and the Muon settings its groups do not hold, from the
training ``args`` or Megatron's defaults."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..format import kinds
from ..storage.megatron_files import Namespace

MUON = kinds.MEGATRON
ADAMW = "torch.optim.AdamW"


@dataclass(frozen=True)
class Group:
    """One param group of the chained optimizers: ``muon`` or ``adamw``, its settings (the
    params left out), and its AdamW's common step where the checkpoint holds one."""

    role: str
    settings: dict[str, Any]
    step: int | None


def role_of(group: Mapping[str, Any]) -> str | None:
    """A param group's role: Muon's (a ``momentum`` setting) or AdamW's (``betas``)."""
    return "adamw" if "betas" in group else "muon" if "momentum" in group else None


def count(step: Any, where: Path, what: str) -> int | None:
    """A step count (a number or a one-element tensor), refused naming ``what`` where it is
    not a finite count: a bool, NaN, infinite, negative or not a number."""
    if step is None:
        return None
    value = (
        step.item() if hasattr(step, "item") and getattr(step, "numel", lambda: 1)() == 1 else step
    )
    if (
        isinstance(value, bool)  # (True is no step 1)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise CheckpointError(f"{what} {value!r} is not a count", path=where)
    return int(value)


SCALE_RULES = {"spectral": kinds.MOONLIGHT, "shape_scaling": kinds.ASPECT}
"""emerging-optimizers' ``scale_mode`` -> muonckpt's lr rule: ``spectral`` is
``sqrt(max(A, B)) * extra_scale_factor``, ``shape_scaling`` ``sqrt(max(1, A / B))``."""
DEFAULTS = {"muon_nesterov": False, "muon_scale_mode": "spectral", "muon_extra_scale_factor": 1.0}
"""Megatron-Core 0.19.2's defaults (``optimizer_config.py``) of the Muon settings that its
param groups do not hold, taken where the checkpoint has no ``args``."""


def kind(group: Group, args: Any) -> kinds.GroupKind:
    """The group's optimizer kind; ``args``: the checkpoint's training args (a
    :class:`~muonckpt.storage.megatron_files.Namespace`) or None."""
    if group.role == "adamw":
        return kinds.GroupKind(ADAMW, "adamw", step_in="tensor")
    given = vars(args) if isinstance(args, Namespace) else {}
    setting = {k: given.get(k, d) for k, d in DEFAULTS.items()}
    rule = SCALE_RULES.get(str(setting["muon_scale_mode"]))
    rms = float(setting["muon_extra_scale_factor"]) if rule == kinds.MOONLIGHT else None
    mu = group.settings["momentum"]
    return kinds.GroupKind(MUON, "muon", kinds.EMA, mu, bool(setting["muon_nesterov"]), rule, rms)


def assumed(args: Any) -> tuple[str, ...]:
    """The note for a checkpoint without ``args``: which of Megatron's defaults were taken."""
    if isinstance(args, Namespace):
        return ()
    taken = ", ".join(f"{k}={v}" for k, v in DEFAULTS.items())
    return (f"the checkpoint holds no training args: Megatron's defaults {taken} assumed",)
