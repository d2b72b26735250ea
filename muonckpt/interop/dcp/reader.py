"""PyTorch Distributed Checkpoint (DCP) in and out: the checkpoints of FSDP2 / DTensor Muons
(torchtitan, microsoft/dion, muon-fsdp2, a hand-rolled Muon under ``fully_shard``).

:func:`from_dcp` reads a DCP checkpoint (the layout of DCP's recipe, ``model.<fqn>`` beside
``optimizer.state.<fqn>.<key>`` and ``optimizer.param_groups.<fqn>.<setting>``, or
torchtitan's, the model's fqns at the top level) and writes a consolidated muonckpt
checkpoint for a muonckpt family, params included, momentum converted from the form of the
family that wrote it (``source``: a DCP checkpoint does not record its optimizer).
:func:`to_dcp` writes any muonckpt checkpoint as DCP for a DTensor family, which
``torch.distributed.checkpoint.load`` reads at any world size. Both stream one tensor at a
time; all DCP file access is :mod:`muonckpt.interop.dcp.metadata`'s and
:mod:`muonckpt.interop.dcp.files`'s.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, StateDictError
from ...files.pieces import PieceReader, open_checkpoint
from ...files.writing import Progress
from ...format import kinds
from ...format.conversion import converted_manifest, group_kind, step_scalar
from ...format.manifest import (
    CONSOLIDATED,
    GroupEntry,
    Manifest,
    ParamEntry,
    PieceIndex,
    Scalar,
    json_safe,
)
from ...format.names import PARAM_KEY
from .._consolidated import (
    consolidated,
    conversion_notes,
    split_experts_of,
    summarized,
    write_consolidated,
)
from .._foreign_out import not_carried, read_whole, staged_output
from ..foreign import Conversion
from . import files as dcp_files
from . import metadata as dcp_metadata
from .model_items import ModelItems, model_others_of

__all__ = [
    "LAYOUTS",
    "from_dcp",
    "is_dcp",
    "to_dcp",
]

LAYOUTS = {"torchtitan": "", "recipe": "model."}
"""Layout name -> the prefix of the model's fqns (the optimizer's is ``optimizer.``)."""
OPTIMIZER_PREFIX = "optimizer."
is_dcp = dcp_metadata.is_dcp


def _family(name: str, what: str) -> kinds.DcpFamily:
    family = kinds.DCP_FAMILIES.get(name)
    if family is None:
        raise StateDictError(
            f"{what} {name!r} is not a family muonckpt knows: choose one of "
            f"{', '.join(kinds.DCP_FAMILIES)}"
        )
    return family


MAX_SETTING_CHARS = 1 << 20
"""The most text one DCP setting may become in the manifest."""


def _setting(value: Any, fqn: str, where: Path) -> Any:
    """A DCP value as the manifest holds a setting: a number, bool, string or None, or a flat
    tuple or list of them (betas, param_names), a one-element tensor as its number; at most
    :data:`MAX_SETTING_CHARS` of text. Anything else is refused naming the item: the manifest
    never holds more than the item's own bytes."""
    import torch

    def plain(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.layout == torch.strided and x.numel() == 1:
            return x.item()
        if isinstance(x, float) and not math.isfinite(x):
            raise CheckpointError(f"DCP item {fqn!r} holds {x}, not a finite setting", path=where)
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        shown = f"a tensor of {list(x.shape)}" if isinstance(x, torch.Tensor) else None
        raise CheckpointError(
            f"DCP item {fqn!r} holds {shown or f'a {type(x).__name__}'}, not a setting (a "
            "number, bool, string or None, or a flat tuple of them)",
            path=where,
        )

    flat = isinstance(value, (list, tuple))
    out, chars = [], 0
    for x in value if flat else (value,):
        out.append(plain(x))
        chars += len(out[-1]) if isinstance(out[-1], str) else 24
        if chars > MAX_SETTING_CHARS:
            raise CheckpointError(
                f"DCP item {fqn!r} holds more than {MAX_SETTING_CHARS} characters: not a setting",
                path=where,
            )
    if not flat:
        return out[0]
    return tuple(out) if isinstance(value, tuple) else out


def from_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    source: str,
    to: str | None = "packaged",
    model_prefix: str | None = None,
    optimizer_prefix: str = OPTIMIZER_PREFIX,
    job_states: tuple[str, ...] | None = None,
    model_others: bool = True,
    split_experts: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Conversion:
    """Convert the DCP checkpoint ``src`` into a consolidated muonckpt checkpoint at ``dst``.

    Args:
        source: the family that wrote it (:data:`muonckpt.format.kinds.DCP_FAMILIES`: ``torch``,
            ``torchtitan``, ``dion``, ``muon-fsdp2``, ``keller-jordan``, ``packaged``); its
            momentum form and state keys are read as that family keeps them.
        to: the muonckpt family the output is for (``packaged``, ``torch``, ``keller-jordan``);
            None keeps ``source``'s own groups and form (``torchtitan.DistMuon``, EMA).
        model_prefix: the prefix of the model's fqns; None detects it (``model.`` for DCP's
            recipe, none for torchtitan's layout).
        optimizer_prefix: the prefix of the flattened optimizer state dict.
        job_states: with the model at the top level (torchtitan's layout), the first name
            components of the job's other states (``lr_scheduler``, ``dataloader``): every
            other top-level tensor is the model's, named when left out, carried with
            ``model_others``.
        model_others: whether the model's tensors no optimizer holds (buffers, frozen params)
            are carried where they are told from the job's.
        split_experts: write each Muon param of more than two dims (stacked experts) as one
            2-D param per matrix, ``<fqn>.<i>`` (:mod:`muonckpt.format.stacked`).

    The params are the fqns of ``<optimizer_prefix>param_groups.<fqn>.<setting>``, or of the
    ``params`` of ``<optimizer_prefix>param_groups.<i>.<setting>`` (``get_state_dict``'s
    groups by index); each must have its model tensor (the output resumes from itself
    alone), and its group's settings give mu. Every ``<optimizer_prefix>state.<fqn>.<key>``
    must be a state key of ``source`` for a param; anything else under the optimizer prefix
    is refused naming the key. Under a model prefix of its own, the model's other tensors are
    carried (:func:`.model_items.model_others_of`). Other items (schedulers, dataloaders,
    train state) are left out and reported.

    Memory: one full tensor and one of its chunks, twice (the next is read meanwhile); telling
    a tied name reads it beside each param of its shape and dtype, one at a time.
    """
    family = _family(source, "source")
    if to is not None and to not in kinds.FAMILIES:
        raise StateDictError(f"cannot convert to {to!r}: choose one of {sorted(kinds.FAMILIES)}")
    index = dcp_metadata.read_index(src)
    where = index.directory / dcp_metadata.METADATA_NAME
    settings, settings_items = _group_settings(index, optimizer_prefix, where)
    model_prefix, layout = _model_prefix(index, settings, model_prefix, optimizer_prefix, where)
    state = _state_items(index, settings, settings_items, optimizer_prefix, where)
    manifest = _manifest(index, family, settings, state, model_prefix, where)
    target, scales = converted_manifest(manifest, to, path=where)
    fqn_of = _fqns_of(manifest, family, state, model_prefix)
    model_items = ModelItems(model_prefix, optimizer_prefix, job_states)
    others, aliases = model_others_of(index, settings, model_items) if model_others else ([], {})
    fqn_of.update({(t.name, PARAM_KEY): model_prefix + t.name for t in others})
    target, parts = split_experts_of(target, others, aliases) if split_experts else (target, {})
    planned = consolidated(target, aliases=aliases, model_tensors=others, parts=parts)
    tensors = (dcp_files.read_tensor(index, index.tensors[fqn_of[r]]) for r in planned.reads)
    path = write_consolidated(
        planned,
        scales,
        tensors,
        dst,
        overwrite=overwrite,
        progress=progress,
        source=index.directory,
    )
    used = {model_prefix + name for name in [*settings, *aliases]}
    used |= {model_prefix + t.name for t in others} | settings_items
    used |= {fqn for keys in state.values() for fqn in keys.values()}
    left = sorted((set(index.tensors) | set(index.values)) - used)
    left_out = summarized(left, model_prefix, named=model_items.holds)
    return Conversion(path, layout, left_out, conversion_notes(manifest, target))


def _fqns_of(
    manifest: Manifest,
    family: kinds.DcpFamily,
    state: Mapping[str, Mapping[str, str]],
    model_prefix: str,
) -> dict[tuple[str, str], str]:
    """The DCP item of each (param, key) the output holds: its values and its state tensors
    under muonckpt's keys."""
    fqn_of = {(e.name, PARAM_KEY): model_prefix + e.name for e in manifest.params}
    for name, keys in state.items():
        kind = kinds.GroupKind.from_json(manifest.groups[manifest.param(name).group].optimizer)
        for key, fqn in keys.items():
            if key != "step":
                fqn_of[name, family.our_key(kind.role or "", key) or key] = fqn
    return fqn_of


def _group_settings(
    index: dcp_metadata.DcpIndex, optimizer_prefix: str, where: Path
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Each param's group settings, by param, and the items read for them: the items
    ``<prefix>param_groups.<fqn>.<setting>``, or ``<prefix>param_groups.<i>.<setting>`` of a
    group whose ``params`` setting lists its params' fqns (``get_state_dict``'s groups by
    index). Refused unless there is at least one."""
    groups_at = optimizer_prefix + "param_groups."
    read: dict[str, dict[str, Any]] = {}
    items: set[str] = set()
    for fqn, item in index.values.items():
        if fqn.startswith(groups_at) and "." in fqn[len(groups_at) :]:
            name, setting = fqn[len(groups_at) :].rsplit(".", 1)
            value = dcp_files.read_value(index, item)
            read.setdefault(name, {})[setting] = _setting(value, fqn, where)
            items.add(fqn)
    if not read:
        raise CheckpointError(
            f"holds no {groups_at}<fqn>.<setting> items: not a flattened optimizer state dict "
            "under that prefix (pass optimizer_prefix)",
            path=where,
        )
    settings: dict[str, dict[str, Any]] = {}
    for name, group in read.items():
        members = group.pop("params", None) if name.isdigit() else None
        if members is None:
            settings[name] = group
            continue
        if not isinstance(members, (list, tuple)) or not all(isinstance(m, str) for m in members):
            raise CheckpointError(
                f"DCP item {groups_at}{name}.params holds {members!r}, not the group's fqns",
                path=where,
            )
        for member in members:
            if member in settings:
                raise CheckpointError(
                    f"param {member!r} is in two groups of {groups_at}*", path=where
                )
            settings[member] = dict(group)
    return settings, items


def _state_items(
    index: dcp_metadata.DcpIndex,
    settings: Mapping[str, Mapping[str, Any]],
    settings_items: set[str],
    optimizer_prefix: str,
    where: Path,
) -> dict[str, dict[str, str]]:
    """Each param's state items, param -> key -> fqn: every item under the optimizer prefix but
    the settings, each of them ``<prefix>state.<param>.<key>`` of a param with settings."""
    groups_at, state_at = optimizer_prefix + "param_groups.", optimizer_prefix + "state."
    state: dict[str, dict[str, str]] = {name: {} for name in settings}
    for fqn in [*index.tensors, *index.values]:
        if fqn in settings_items or not fqn.startswith(optimizer_prefix):
            continue
        rest = fqn[len(state_at) :] if fqn.startswith(state_at) else ""
        name, _, key = rest.rpartition(".")
        if name not in state:
            raise CheckpointError(
                f"DCP item {fqn!r} maps to no param: it is not "
                f"{state_at}<param>.<key> of a param in {groups_at}*",
                path=where,
            )
        state[name][key] = fqn
    return state


def _manifest(
    index: dcp_metadata.DcpIndex,
    family: kinds.DcpFamily,
    settings: Mapping[str, Mapping[str, Any]],
    state: Mapping[str, Mapping[str, str]],
    model_prefix: str,
    where: Path,
) -> Manifest:
    """The DCP checkpoint as a consolidated manifest in ``family``'s own form: one group per
    kind and settings, the params group by group, files and pieces still empty."""
    entries: list[ParamEntry] = []
    group_of: dict[str, int] = {}
    kinds_of: list[tuple[kinds.GroupKind, Any, list[str]]] = []
    for name, group_settings in settings.items():
        model = index.tensors[model_prefix + name]
        role = family.role(group_settings, list(state[name]))
        if role is None:
            raise CheckpointError(
                f"param {name!r}: neither its settings nor its state keys "
                f"{sorted(state[name])} say whether {family.name} ran Muon or AdamW on it",
                path=where,
            )
        dtypes, scalars = _param_state(index, family, role, model, state[name], where)
        hyper = json_safe(group_settings, where)
        try:
            kind = family.group_kind(role, group_settings)
        except StateDictError as exc:
            raise CheckpointError(f"param {name!r}: {exc}", path=where) from None
        signature = json.dumps([kind.to_json(), hyper], sort_keys=True)
        if signature not in group_of:
            group_of[signature] = len(kinds_of)
            kinds_of.append((kind, hyper, []))
        kinds_of[group_of[signature]][2].append(name)
        entries.append(ParamEntry(name, model.shape, -1, group_of[signature], dtypes, scalars))
    groups = tuple(
        GroupEntry(hyper, tuple(names), kind.to_json()) for kind, hyper, names in kinds_of
    )
    order = {name: i for i, (_, _, names) in enumerate(kinds_of) for name in names}
    entries.sort(key=lambda e: order[e.name])  # group by group, as the manifest lists them
    return Manifest(CONSOLIDATED, {"dp": 1, "tp": 1}, groups, tuple(entries), (), ())


def _param_state(
    index: dcp_metadata.DcpIndex,
    family: kinds.DcpFamily,
    role: str,
    model: dcp_metadata.DcpTensor,
    state: Mapping[str, str],
    where: Path,
) -> tuple[dict[str, str], dict[str, Scalar]]:
    """A param's dtypes by muonckpt's keys (its value's and each state tensor's, each of the
    param's shape) and its step count."""
    dtypes, scalars = {PARAM_KEY: model.dtype}, {}
    for key, fqn in state.items():
        if key == "step":
            scalars["step"] = _step(index, fqn, where)
            continue
        ours = family.our_key(role, key)
        if ours is None or fqn not in index.tensors:
            raise CheckpointError(
                f"DCP item {fqn!r}: {key!r} is not a tensor state key of a {role} param "
                f"in {family.name}",
                path=where,
            )
        if index.tensors[fqn].shape != model.shape:
            raise CheckpointError(
                f"DCP item {fqn!r} has shape {list(index.tensors[fqn].shape)}, its param "
                f"{list(model.shape)}",
                path=where,
            )
        dtypes[ours] = index.tensors[fqn].dtype
    return dtypes, scalars


def _model_prefix(
    index: dcp_metadata.DcpIndex,
    settings: Mapping[str, Any],
    given: str | None,
    optimizer_prefix: str,
    where: Path,
) -> tuple[str, str]:
    """The model's prefix (given, or the layout whose fqns all exist) and the layout's name."""
    candidates = [given] if given is not None else list(LAYOUTS.values())
    for prefix in candidates:
        if all(prefix + name in index.tensors for name in settings):
            names = {v: k for k, v in LAYOUTS.items()}
            default = prefix in names and optimizer_prefix == OPTIMIZER_PREFIX
            shown = names[prefix] if default else f"prefixes {prefix!r} / {optimizer_prefix!r}"
            return prefix, shown
    missing = next(n for n in settings if candidates[-1] + n not in index.tensors)
    tried = " or ".join(repr(p + missing) for p in candidates)
    raise CheckpointError(
        f"param {missing!r} has no model tensor ({tried}): pass model_prefix", path=where
    )


def _step(index: dcp_metadata.DcpIndex, fqn: str, where: Path) -> Scalar:
    """A param's step count: a one-element tensor or a number, finite, not negative."""
    dtype = None
    if fqn in index.tensors:
        tensor = dcp_files.read_tensor(index, index.tensors[fqn])
        if tensor.numel() != 1:
            raise CheckpointError(
                f"DCP item {fqn!r}: a step count of {tensor.numel()} elements", path=where
            )
        value, dtype = float(tensor.item()), index.tensors[fqn].dtype
    else:
        value = _setting(dcp_files.read_value(index, index.values[fqn]), fqn, where)
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not value >= 0
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise CheckpointError(f"DCP item {fqn!r}: step {value!r} is not a count", path=where)
    return Scalar(value, dtype)


def to_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str,
    layout: str = "torchtitan",
) -> Conversion:
    """Write the muonckpt checkpoint ``src`` (any kind, any topology) as a DCP checkpoint at
    ``dst`` for the DTensor family ``to``: the params as the model's tensors, each param's
    state under ``optimizer.state.<fqn>.<key>`` in the family's keys and momentum form, AdamW
    step counts where the family keeps them (torch: a float32 0-d tensor per param, as
    :func:`muonckpt.load` restores them), and ``optimizer.param_groups.<fqn>.<setting>`` for
    the settings the family has (torch's optimizers' own defaults where the checkpoint does
    not say). ``layout``: ``torchtitan`` (model fqns at the top level) or ``recipe``
    (``model.<fqn>``). Only torch's writer writes; ``dst`` must not exist.

    Memory: one full tensor at a time.
    """
    family = _family(to, "target")
    if layout not in LAYOUTS:
        raise StateDictError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    directory, manifest = open_checkpoint(src)
    out = _DcpOut(LAYOUTS[layout])
    _add_optimizer(out, manifest, family, directory)
    _add_model(out, manifest)
    with (
        staged_output(dst, directory, dcp_metadata.OUTPUT) as staging,
        PieceReader(directory, manifest) as reader,
    ):
        fetch = _WholeTensors(out.sources, manifest, reader)
        dcp_files.write_dcp(staging, out.tensors, out.values, fetch)
    left = tuple(out.left) + not_carried(manifest)
    return Conversion(Path(dst), layout, left, tuple(out.notes))


@dataclass
class _DcpOut:
    """What :func:`to_dcp` writes, in the order it writes it: each tensor's fqn -> (shape,
    safetensors dtype) and where its data comes from (the muonckpt name, its state key, the
    factor its values are multiplied by), the plain values (fqn -> value), and for the report
    the momentum conversions and what was left out. ``prefix``: the model fqns' prefix."""

    prefix: str
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    sources: dict[str, tuple[str, str, float]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


def _add_optimizer(
    out: _DcpOut, manifest: Manifest, family: kinds.DcpFamily, directory: Path
) -> None:
    """Add each optimizer param to ``out``: its values as the model's tensor, its state in the
    family's keys and momentum form, its AdamW step and its group's settings."""
    for g, group in enumerate(manifest.groups):
        kind = group_kind(group, g, directory)
        target = family.target_kind(kind)
        mapping = kinds.state_mapping(kind, target, f"group {g}", None)
        factor = mapping.keys.get("momentum_buffer", ("", 1.0))[1]
        if mapping.note:
            out.notes.append(f"{len(group.params)} Muon params: {mapping.note}")
        group_settings = _settings(family, kind, target, group.hyperparams)
        for name in group.params:
            entry = manifest.param(name)
            if entry.value_dtype is not None:
                out.tensors[out.prefix + name] = (entry.shape, entry.value_dtype)
                out.sources[out.prefix + name] = (name, PARAM_KEY, 1.0)
            else:
                out.left.append(f"{name} (no values saved)")
            for key in entry.state_keys:
                fqn = f"{OPTIMIZER_PREFIX}state.{name}.{family.their_key(kind.role or '', key)}"
                out.tensors[fqn] = (entry.shape, entry.dtype_of(key))
                out.sources[fqn] = (name, key, factor if key == "momentum_buffer" else 1.0)
            step = step_scalar(family.step_in, manifest.step_of(entry), name)
            if kind.role == "adamw" and step is not None and entry.state_keys:
                out.values[f"{OPTIMIZER_PREFIX}state.{name}.step"] = (
                    _step_tensor(step) if step.dtype is not None else step.value
                )
            for setting, value in group_settings.items():
                out.values[f"{OPTIMIZER_PREFIX}param_groups.{name}.{setting}"] = value


def _add_model(out: _DcpOut, manifest: Manifest) -> None:
    """Add the model's other tensors (buffers, params no optimizer holds) to ``out``, then its
    tied names, each as the tensor it aliases (left out where that holds no values)."""
    model_file = manifest.model
    if model_file is None:
        return
    for entry in model_file.tensors:
        out.tensors[out.prefix + entry.name] = (entry.shape, entry.dtype_of(PARAM_KEY))
        out.sources[out.prefix + entry.name] = (entry.name, PARAM_KEY, 1.0)
    for alias, stored in sorted(model_file.aliases.items()):
        if out.prefix + stored not in out.sources:
            out.left.append(f"{alias} (an alias of {stored}, which holds no values)")
            continue
        out.tensors[out.prefix + alias] = out.tensors[out.prefix + stored]
        out.sources[out.prefix + alias] = out.sources[out.prefix + stored]


class _WholeTensors:
    """The data of each tensor torch's writer asks for (one block, the whole tensor): read
    from the muonckpt checkpoint as ``sources`` says (fqn -> the param or model tensor, its
    state key, the factor its values are multiplied by)."""

    def __init__(
        self, sources: Mapping[str, tuple[str, str, float]], manifest: Manifest, reader: PieceReader
    ) -> None:
        model = manifest.model
        self.sources = sources
        self.manifest = manifest
        self.reader = reader
        self.model_tensors = {t.name: t for t in model.tensors} if model is not None else {}
        self.pieces = PieceIndex(manifest.pieces, model.pieces if model is not None else ())

    def __call__(self, fqn: str, _whole: dcp_files.Region) -> Any:
        name, key, scale = self.sources[fqn]
        entry = self.model_tensors.get(name) or self.manifest.param(name)
        tensor = read_whole(self.reader, self.pieces, entry, key)
        return tensor.mul_(scale) if scale != 1.0 else tensor


def _step_tensor(step: Scalar) -> Any:
    import torch

    return torch.tensor(step.value, dtype=torch.float32)


def _settings(
    family: kinds.DcpFamily,
    source: kinds.GroupKind,
    target: kinds.GroupKind,
    hyper: Mapping[str, Any],
) -> dict[str, Any]:
    """The settings a group of ``family`` has, from a group of ``source`` with ``hyper``:
    torch's optimizers' own defaults (torch, torchtitan), overridden by what the checkpoint
    says; for other families the settings muonckpt knows they have."""
    own = family.name == source.family or source.optimizer in (family.muon, family.adamw)
    if own and source.converted_from is None:
        settings = {k: v for k, v in hyper.items() if k != "step" or family.step_in == "group"}
        return _titan_settings(family, settings, hyper)
    betas = hyper.get("betas", hyper.get("adamw_betas"))
    eps = hyper.get("eps", hyper.get("adamw_eps"))
    known: dict[str, Any] = {"lr": hyper.get("lr"), "weight_decay": hyper.get("weight_decay")}
    if target.role == "muon":
        known.update({family.mu_setting: target.momentum, "nesterov": target.nesterov})
        if family.name in ("torch", "torchtitan"):
            known["adjust_lr_fn"] = "match_rms_adamw" if target.lr_rule == kinds.MOONLIGHT else None
        if "ns_steps" in hyper:
            known["ns_steps"] = hyper["ns_steps"]
    else:
        known.update({"betas": tuple(betas) if betas is not None else None, "eps": eps})
    if family.role_setting == "use_muon":
        known["use_muon"] = target.role == "muon"
    elif family.role_setting is not None:
        known[family.role_setting] = "muon" if target.role == "muon" else "adamw"
    if family.step_in == "group" and hyper.get("step") is not None:
        known["step"] = hyper["step"]
    if family.name in ("torch", "torchtitan"):
        known["param_names"] = hyper.get("param_names")  # optimizers built from named params
    settings = _torch_defaults(target.role or "") if family.name in ("torch", "torchtitan") else {}
    settings.update({k: v for k, v in known.items() if v is not None})
    return _titan_settings(family, settings, hyper)


def _titan_settings(
    family: kinds.DcpFamily, settings: dict[str, Any], hyper: Mapping[str, Any]
) -> dict[str, Any]:
    """``settings`` with the settings every torchtitan group has (its load asks for each):
    ``initial_lr`` (its LR schedulers'; the checkpoint's, else ``lr``), ``foreach`` and
    ``fused`` (its optimizer builder's; off where the checkpoint does not say)."""
    if family.name == "torchtitan" and settings.get("lr") is not None:
        settings.setdefault("initial_lr", hyper.get("initial_lr", settings["lr"]))
        settings.setdefault("foreach", False)
        settings.setdefault("fused", False)
    return settings


def _torch_defaults(role: str) -> dict[str, Any]:
    """Every setting of a torch.optim.Muon (or AdamW) group, with torch's defaults."""
    import torch

    if role == "muon":
        group = torch.optim.Muon([torch.zeros(2, 2)]).param_groups[0]
    else:
        group = torch.optim.AdamW([torch.zeros(2)]).param_groups[0]
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}
