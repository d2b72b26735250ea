"""What Megatron-Core's layer-wise Muon records of its param groups, read the same way from
either of its checkpoint formats (torch_dist: :mod:`.reader`; torch: :mod:`.torch_format`):
each group's role and settings, the Muon settings its groups do not hold, from the
training ``args`` or Megatron's defaults, and the consolidated manifest of its groups."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...format import kinds
from ...format.manifest import CONSOLIDATED, GroupEntry, Manifest, ParamEntry, json_safe
from .._fields import shown
from .files import Namespace

MUON = kinds.MEGATRON
ADAMW = "torch.optim.AdamW"


@dataclass(frozen=True)
class Group:
    """One param group of the chained optimizers: ``muon`` or ``adamw``, its settings (the
    params left out), and its AdamW's common step where the checkpoint holds one."""

    role: str
    settings: dict[str, Any]
    step: int | None


def group_of(role: str, settings: dict[str, Any], where: Path, step: int | None = None) -> Group:
    """A param group read from the file ``where``: its settings as the manifest holds them
    (:func:`~muonckpt.format.manifest.json_safe`), a Muon group's momentum checked to be a
    number in [0, 1) (never ``'0.9'``, committed for readers to refuse)."""
    mu = settings.get("momentum")
    if role == "muon" and (
        isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0 <= mu < 1
    ):
        raise CheckpointError(
            f"a Muon group's momentum {shown(mu)} is not a number in [0, 1)", path=where
        )
    return Group(role, json_safe(settings, where), step)


def role_of(group: Mapping[str, Any]) -> str | None:
    """A param group's role: Muon's (a ``momentum`` setting) or AdamW's (``betas``)."""
    return "adamw" if "betas" in group else "muon" if "momentum" in group else None


SCALE_RULES = {"spectral": kinds.MOONLIGHT, "shape_scaling": kinds.ASPECT}
"""emerging-optimizers' ``scale_mode`` -> muonckpt's lr rule: ``spectral`` is
``sqrt(max(A, B)) * extra_scale_factor``, ``shape_scaling`` ``sqrt(max(1, A / B))``."""
DEFAULTS = {
    "muon_nesterov": False,
    "muon_scale_mode": "spectral",
    "muon_extra_scale_factor": 1.0,
    "muon_split_qkv": True,
}
"""Megatron-Core 0.19.2's defaults (``optimizer_config.py``) of the Muon settings that its
param groups do not hold, taken where the checkpoint has no ``args`` (``muon_split_qkv``: the
compute view: the fused QKV weights orthogonalized as their Q, K and V blocks apart)."""


def kind(group: Group, args: Any) -> kinds.GroupKind:
    """The group's optimizer kind; ``args``: the checkpoint's training args (a
    :class:`~muonckpt.interop.megatron.files.Namespace`) or None."""
    if group.role == "adamw":
        return kinds.GroupKind(ADAMW, "adamw", step_in="tensor")
    given = vars(args) if isinstance(args, Namespace) else {}
    setting = {k: given.get(k, d) for k, d in DEFAULTS.items()}
    rule = SCALE_RULES.get(str(setting["muon_scale_mode"]))
    rms = float(setting["muon_extra_scale_factor"]) if rule == kinds.MOONLIGHT else None
    mu = group.settings["momentum"]
    nesterov = bool(setting["muon_nesterov"])
    view = kinds.SPLIT_QKV if setting["muon_split_qkv"] else kinds.WHOLE
    return kinds.GroupKind(MUON, "muon", kinds.EMA, mu, nesterov, rule, rms, compute_view=view)


def assumed(args: Any) -> tuple[str, ...]:
    """The note for a checkpoint without ``args``: which of Megatron's defaults were taken."""
    if isinstance(args, Namespace):
        return ()
    taken = ", ".join(f"{k}={v}" for k, v in DEFAULTS.items())
    return (f"the checkpoint holds no training args: Megatron's defaults {taken} assumed",)


def manifest_of(
    groups: list[Group], group_kinds: list[kinds.GroupKind], entries: list[ParamEntry]
) -> Manifest:
    """A consolidated manifest in Megatron's own form of ``entries``, each in its group of
    ``groups`` (of ``group_kinds``): the params group by group, by name within each."""
    entries = sorted(entries, key=lambda e: (e.group, e.name))
    group_entries = tuple(
        GroupEntry(group.settings, tuple(e.name for e in entries if e.group == g), kind.to_json())
        for g, (group, kind) in enumerate(zip(groups, group_kinds, strict=True))
    )
    return Manifest(CONSOLIDATED, {"dp": 1, "tp": 1}, group_entries, tuple(entries), (), ())
