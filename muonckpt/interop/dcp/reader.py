"""PyTorch Distributed Checkpoint (DCP) in: the checkpoints of FSDP2 / DTensor Muons
(torchtitan, microsoft/dion, muon-fsdp2, a hand-rolled Muon under ``fully_shard``).

:func:`from_dcp` reads a DCP checkpoint (the layout of DCP's recipe, ``model.<fqn>`` beside
``optimizer.state.<fqn>.<key>`` and ``optimizer.param_groups.<fqn>.<setting>``, or
torchtitan's, the model's fqns at the top level) and writes a consolidated muonckpt
checkpoint for a muonckpt family, params included, momentum converted from the form of the
family that wrote it (``source``: a DCP checkpoint does not record its optimizer).
It streams one tensor at a time; all DCP file access is
:mod:`muonckpt.interop.dcp.metadata`'s and :mod:`muonckpt.interop.dcp.files`'s (DCP out:
:mod:`.writer`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, StateDictError
from ...files.progress import Progress
from ...format import kinds
from ...format.conversion import converted_manifest
from ...format.manifest import (
    CONSOLIDATED,
    GroupEntry,
    Manifest,
    ParamEntry,
    Scalar,
    json_safe,
)
from ...format.names import PARAM_KEY
from ...layout.state_shapes import StateShape, shape_rule
from .._consolidated import (
    consolidated,
    conversion_notes,
    split_experts_of,
    summarized,
    write_consolidated,
)
from .._trainer_state import Found
from ..foreign import Conversion
from . import files as dcp_files
from . import metadata as dcp_metadata
from .model_items import ModelItems, model_others_of

__all__ = [
    "LAYOUTS",
    "from_dcp",
    "is_dcp",
]

LAYOUTS = {"torchtitan": "", "recipe": "model."}
"""Layout name -> the prefix of the model's fqns (the optimizer's is ``optimizer.``)."""
OPTIMIZER_PREFIX = "optimizer."
is_dcp = dcp_metadata.is_dcp


def dcp_family(name: str, what: str) -> kinds.DcpFamily:
    """The DCP family ``name``, the ``source`` or ``target`` (``what``) of a conversion."""
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
    job_state: Callable[[dcp_metadata.DcpIndex], Found] | None = None,
) -> Conversion:
    """Convert the DCP checkpoint ``src`` into a consolidated muonckpt checkpoint at ``dst``.

    Args:
        source: the family that wrote it (:data:`muonckpt.format.kinds.DCP_FAMILIES`: ``torch``,
            ``torchtitan``, ``dion``, ``muon-fsdp2``, ``keller-jordan``, ``packaged``, and
            ``dion-normuon``, dion's NorMuon kept as it is); its momentum form and state keys
            are read as that family keeps them, state not shaped like its param at its own
            shape with its rule (:func:`_state_shapes`).
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
        job_state: the trainer's reader of its own state in the checkpoint (torchtitan's
            scheduler and data loader: :mod:`muonckpt.interop._trainer_state`), carried in the
            output's ``extra``.

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
    family = dcp_family(source, "source")
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
    if layout in LAYOUTS:  # what a conversion back writes by default (other prefixes: none)
        target = replace(target, dcp_layout=layout)
    planned = consolidated(target, aliases=aliases, model_tensors=others, parts=parts)
    tensors = (dcp_files.read_tensor(index, index.tensors[fqn_of[r]]) for r in planned.reads)
    found = job_state(index) if job_state is not None else None
    path = write_consolidated(
        planned,
        scales,
        tensors,
        dst,
        overwrite=overwrite,
        progress=progress,
        source=index.directory,
        trainer=found.state if found is not None else None,
        step=found.step if found is not None else None,
    )
    used = set(found.items) if found is not None else set()
    used |= {model_prefix + name for name in [*settings, *aliases]}
    used |= {model_prefix + t.name for t in others} | settings_items
    used |= {fqn for keys in state.values() for fqn in keys.values()}
    left = sorted((set(index.tensors) | set(index.values)) - used)
    left_out = summarized(left, model_prefix, named=model_items.holds)
    left_out += found.left if found is not None else ()
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
        shapes = _state_shapes(index, name, model, state[name], where)
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
        ours = {family.our_key(role, key) or key: shape for key, shape in shapes.items()}
        entries.append(
            ParamEntry(name, model.shape, -1, group_of[signature], dtypes, scalars, ours)
        )
    groups = tuple(
        GroupEntry(hyper, tuple(names), kind.to_json()) for kind, hyper, names in kinds_of
    )
    order = {name: i for i, (_, _, names) in enumerate(kinds_of) for name in names}
    entries.sort(key=lambda e: order[e.name])  # group by group, as the manifest lists them
    return Manifest(CONSOLIDATED, {"dp": 1, "tp": 1}, groups, tuple(entries), (), ())


def _state_shapes(
    index: dcp_metadata.DcpIndex,
    name: str,
    model: dcp_metadata.DcpTensor,
    state: Mapping[str, str],
    where: Path,
) -> dict[str, StateShape]:
    """The shape and rule of each state tensor of param ``name`` not shaped like it (dion's
    NorMuon ``variance_neuron`` ``(rows, 1)`` under FSDP2), as a native save records them
    (:func:`muonckpt.layout.state_shapes.shape_rule`). Each is read at its own global shape,
    which DCP keeps whole or in chunks; chunks must be the param's own row shards (FSDP2's
    ``Shard(0)`` of both), else no rule says how it follows its param: refused, naming param,
    key and both shapes."""
    shapes: dict[str, StateShape] = {}
    rows = {(c.offsets[0], c.offsets[0] + c.sizes[0]) for c in model.chunks if c.sizes}
    for key, fqn in state.items():
        found = index.tensors.get(fqn)
        if found is None or found.shape in (model.shape, ()):  # () a scalar (a step count)
            continue
        row_shards = found.shape[:1] == model.shape[:1] and all(
            (c.offsets[0], c.offsets[0] + c.sizes[0]) in rows
            and c.sizes[1:] == found.shape[1:]
            and not any(c.offsets[1:])
            for c in found.chunks
        )
        if len(found.chunks) > 1 and not row_shards:
            raise CheckpointError(
                f"param {name!r}: state {key!r} ({fqn!r}) has shape {list(found.shape)}, not "
                f"its param's {list(model.shape)}, stored in {len(found.chunks)} chunks that "
                "are not its param's row shards: no shape rule says how it follows its param",
                path=where,
            )
        shapes[key] = StateShape(shape_rule(model.shape, found.shape), found.shape)
    return shapes


def _param_state(
    index: dcp_metadata.DcpIndex,
    family: kinds.DcpFamily,
    role: str,
    model: dcp_metadata.DcpTensor,
    state: Mapping[str, str],
    where: Path,
) -> tuple[dict[str, str], dict[str, Scalar]]:
    """A param's dtypes by muonckpt's keys (its value's and each state tensor's) and its
    scalars: its step count, and (a family kept as it is) every 0-d state item."""
    dtypes, scalars = {PARAM_KEY: model.dtype}, {}
    for key, fqn in state.items():
        found = index.tensors.get(fqn)
        if key == "step" or (family.as_is and (found is None or found.shape == ())):
            scalars[key] = _scalar(index, fqn, where, count=key == "step")
            continue
        ours = family.our_key(role, key)
        if ours is None or found is None:
            raise CheckpointError(
                f"DCP item {fqn!r}: {key!r} is not a tensor state key of a {role} param "
                f"in {family.name}",
                path=where,
            )
        dtypes[ours] = found.dtype
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


def _scalar(index: dcp_metadata.DcpIndex, fqn: str, where: Path, *, count: bool) -> Scalar:
    """A param's scalar state: a one-element tensor or a number, finite; a step count
    (``count``) not negative."""
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
        or (count and not value >= 0)
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        what = "a count" if count else "a finite number"
        raise CheckpointError(f"DCP item {fqn!r}: {value!r} is not {what}", path=where)
    return Scalar(value, dtype)
