"""The conversion rules between optimizer implementations, for ``load`` and ``convert`` alike.

A checkpoint records what each group computed (:class:`muonckpt.format.kinds.GroupKind`). Loading
into another implementation (:func:`load_mapping`) or rewriting a checkpoint for one
(:func:`converted_manifest`, the offline ``convert``, ``from_dcp``) applies the same rules:
state keys and momentum form by :func:`muonckpt.format.kinds.state_mapping` (sum and EMA form differ
by ``1 - mu``), and an AdamW step count where the target keeps it (:func:`step_scalar`,
:func:`group_step`). Pure: names, kinds and manifests only, no tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import CheckpointError, StateDictError
from . import kinds
from .manifest import GroupEntry, Manifest, ParamEntry, Scalar
from .records import fits


def group_kinds(optimizers: Iterable[Any]) -> list[kinds.GroupKind]:
    """What each group of ``optimizers`` (in order) computes, by the optimizer that owns it."""
    return [kinds.group_kind(o, g) for o in optimizers for g in o.param_groups]


def group_kind(group: GroupEntry, index: int, path: object = None) -> kinds.GroupKind:
    """The optimizer kind group ``index`` records, for a conversion; refused (naming ``path``)
    for a group that records none (format 1)."""
    if not group.optimizer:
        raise CheckpointError(
            f"group {index} does not say which optimizer saved it (format 1): cannot convert",
            path=path,
        )
    return kinds.GroupKind.from_json(group.optimizer)


def step_scalar(step_in: str | None, step: int | float | None, param: str) -> Scalar | None:
    """A param's AdamW step count as a target that counts per param keeps it: a float32
    tensor (torch, ``"tensor"``; a count past float32's range refused, not made inf) or an
    int (KellerJordan, ``"int"``); None where the target keeps no per-param count (or there
    is none)."""
    if step is None:
        return None
    if step_in == "tensor":
        if not fits(step, "F32"):
            raise CheckpointError(f"step {step!r} does not fit a float32 tensor", param=param)
        return Scalar(float(step), "F32")
    if step_in == "int":
        return Scalar(int(step), None)
    return None


def group_step(
    manifest: Manifest, names: Iterable[str], step_in: str | None, counts: bool = False
) -> int | None:
    """The step count a group of the target takes, for one that counts per group (the
    packaged AdamW, or ``counts``: a group that already keeps ``step``): the largest its
    params saved; None otherwise or when none saved one."""
    if step_in != "group" and not counts:
        return None
    return manifest.latest_step(names)


def converted_manifest(
    manifest: Manifest, to: str | None, *, path: object = None
) -> tuple[Manifest, list[float]]:
    """``manifest`` with its state rewritten for the family ``to`` (``packaged``, ``torch``,
    ``keller-jordan``): each group records what it now holds
    (:func:`muonckpt.format.kinds.converted`) and where its AdamW counts steps; with the factor
    each group's ``momentum_buffer`` is multiplied by (sum and EMA form differ by ``1 - mu``).
    Files and pieces are kept. ``to=None`` keeps every group as it is.

    Raises:
        CheckpointError: (naming ``path``) for a group that does not say which optimizer saved
            it (format 1).
    """
    if to is None:
        return manifest, [1.0] * len(manifest.groups)
    groups, scales = [], []
    for g, group in enumerate(manifest.groups):
        source = group_kind(group, g, path)
        target = kinds.converted(source, to)
        factor = kinds.state_mapping(source, target, f"group {g}", None).keys
        scales.append(factor.get("momentum_buffer", ("", 1.0))[1])
        hyper = dict(group.hyperparams)
        step = group_step(manifest, group.params, target.step_in)
        if step is not None:
            hyper["step"] = step
        groups.append(replace(group, hyperparams=hyper, optimizer=target.to_json()))
    params = tuple(_converted_steps(manifest, e, groups[e.group]) for e in manifest.params)
    return replace(manifest, groups=tuple(groups), params=params), scales


def _converted_steps(manifest: Manifest, entry: ParamEntry, group: GroupEntry) -> ParamEntry:
    """The param with its AdamW step count where the target keeps it."""
    scalars = {k: v for k, v in entry.scalars.items() if k != "step"}
    step = step_scalar(group.optimizer.get("step_in"), manifest.step_of(entry), entry.name)
    if step is not None and entry.state_keys:
        scalars["step"] = step
    return replace(entry, scalars=scalars)


@dataclass
class LoadMapping:
    """How a checkpoint's state maps onto a target of other implementations."""

    maps: dict[str, kinds.KeyMap]
    """Per param name, its key map (keys, momentum factor, whether the step count moves)."""
    converted: list[str] = field(default_factory=list)
    """Momentum converted between forms, per group: which params, from which form, by what."""
    warnings: list[str] = field(default_factory=list)
    """Target settings that cannot continue the saved trajectory, and what would."""


def needs_mapping(
    source: Sequence[kinds.GroupKind | None],
    target: Sequence[kinds.GroupKind],
    momentum_form: str | None,
) -> bool:
    """Whether a load must map state across implementations (else the same optimizer's
    state loads as it is): another optimizer, a converted checkpoint, or a form asked for."""
    same = {k.optimizer for k in target} == {k.optimizer for k in source if k is not None}
    same = same and not any(k and k.converted_from for k in source)
    return not (momentum_form is None and (same or None in source))


def load_mapping(
    manifest: Manifest,
    source: Sequence[kinds.GroupKind | None],
    target: Sequence[kinds.GroupKind],
    params: Iterable[tuple[str, int]],
    momentum_form: str | None,
) -> LoadMapping:
    """The key map of each target param (``(name, target group)``), with the conversions made
    and the settings warned about, per group."""
    out = LoadMapping({})
    converted: dict[tuple[int, str], list[str]] = {}
    pairs = set()
    for name, group in params:
        entry = manifest.param(name)
        origin = source[entry.group]
        if origin is None:
            raise StateDictError(
                f"param {name!r}: the checkpoint does not say which optimizer saved it "
                "(format 1), so it loads only into the same optimizer"
            )
        out.maps[name] = key_map = kinds.state_mapping(origin, target[group], name, momentum_form)
        if key_map.note is not None:
            converted.setdefault((group, key_map.note), []).append(name)
        pairs.add((entry.group, group))
    for (group, note), names in converted.items():
        where = f"{target[group].optimizer} (group {group})"
        out.converted.append(f"{where}: momentum of {len(names)} params, {note}")
    for source_group, target_group in sorted(pairs):
        where = f"{target[target_group].optimizer} (group {target_group})"
        origin = source[source_group]
        for note in kinds.trajectory_notes(origin, target[target_group]) if origin else ():
            out.warnings.append(f"{where}: {note}")
    return out


UPDATE_SETTINGS = (
    "nesterov",
    "momentum",
    "ns_steps",
    "ns_coeffs",
    "beta2",
    "betas",
    "update_scale",
    "adjust_lr_fn",
    "use_muon",
    "qk_clip_threshold",
    "qk_clip_alpha",
    "second_moment",
    "mu",
    "muon_beta2",
    "num_heads",
    "split_sizes",
)
"""Group settings that pick a Muon variant's update (Nesterov, momentum, the Newton-Schulz
steps and coefficients, NorMuon's ``beta2`` and ``update_scale``, AdaMuon's ``betas``, the lr
rule, MuonClip's ``qk_clip_*``, the packaged Muon's ``second_moment``; dion's ``mu``,
``muon_beta2`` and its compute view: ``num_heads`` per-head blocks, ``split_sizes`` row blocks
of a fused QKV weight), beside the learning rate and its schedule."""


def replaced_settings(
    saved: Sequence[GroupEntry], own: Sequence[Any], names: Sequence[str]
) -> list[str]:
    """For a load into the same optimizer, whose groups take the checkpoint's settings (as
    torch's ``load_state_dict`` does): each group whose :data:`UPDATE_SETTINGS` the optimizer
    was built with otherwise, naming the difference (``own``: its groups' settings as JSON,
    ``names``: its optimizer's, by group)."""
    notes: list[str] = []
    if len(saved) != len(own):  # another group structure, which the load refuses itself
        return notes
    for index, (group, settings) in enumerate(zip(saved, own, strict=True)):
        differ = [
            f"{key} {settings.get(key, '(none)')!r} -> {group.hyperparams.get(key, '(none)')!r}"
            for key in UPDATE_SETTINGS
            if (key in group.hyperparams or key in settings)
            and settings.get(key) != group.hyperparams.get(key)
        ]
        if differ:
            notes.append(
                f"group {index} ({names[index]}): the checkpoint's settings replace those the "
                f"optimizer was built with, so its update is the saved variant's: "
                f"{', '.join(differ)}"
            )
    return notes
