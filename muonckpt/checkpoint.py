"""Save and load an optimizer's whole training state as safetensors checkpoints.

Any optimizer muonckpt understands: the packaged Muon (single-process or ZeRO-1 + TP), one with
:func:`muonckpt.install_hooks` (KellerJordan's Muon, layer-wise layouts), or any single-process
torch optimizer. A checkpoint holds every param's optimizer state and, by default, the param's
own values (the optimizer's params: in distributed mode each rank's ZeRO-1 slice of its TP
shard, Megatron's "main params"), so a run resumes from the checkpoint alone at any dp x tp.
It is a directory: safetensors data files plus ``manifest.json``, written last as the commit
marker (docs/format.md). ``save`` writes into a staging directory beside the target and swaps it in
atomically; ``load`` asks which elements this rank owns under its own topology and reads just
those from whichever pieces hold them. Collectives come from :mod:`muonckpt.collectives`, file
I/O from :mod:`muonckpt.storage`.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import collectives, kinds, storage, writing
from .errors import CheckpointError, ConversionWarning, StateDictError
from .hooks import (
    _HOOKS,
    ParamSharding,
    Sharding,
    check_state_holders,
    describe,
    describe_value,
    flat_params,
    gather_full_state,
    remap_groups,
    value_of,
)
from .layout import Region, whole_region
from .manifest import (
    CONSOLIDATED,
    MANIFEST_NAME,
    PARAM_KEY,
    PER_RANK,
    GroupEntry,
    Manifest,
    ParamEntry,
    Scalar,
    json_safe,
)
from .pieces import PieceReader, open_checkpoint
from .writeplan import consolidated_plan, rank_plan, unique_tensor_keys


def save(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    consolidated: bool = False,
    max_shard_size: int | None = None,
    params: bool = True,
    overwrite: bool = False,
) -> Path:
    """Save ``optimizer``'s state (and its params) to directory ``path``; a collective over its
    dp x tp grid.

    Args:
        optimizer: a packaged :class:`~muonckpt.Muon`, single-process or distributed (every
            rank holding every param, or only those it owns elements of); an optimizer with
            :func:`muonckpt.install_hooks`; or any single-process torch optimizer. In a single
            process also a list of optimizers that together train a model (torch.optim.Muon
            for the matrices and AdamW for the rest): their groups are saved in order, as one.
        path: target directory. The save is staged beside it and swapped in atomically.
        consolidated: gather full-shape tensors on rank 0 and write the state as
            ``state.<param>.<key>`` in ``optimizer.safetensors`` and the params by name in
            ``model.safetensors`` (:func:`muonckpt.writeplan.consolidated_plan`), instead of
            one file per rank (no gathering; only metadata crosses ranks).
        max_shard_size: with ``consolidated``, split each family of files past this many bytes,
            HF style.
        params: also save the optimizer's params (the default), so that :func:`load` restores
            them; False saves the optimizer state only, for weights kept elsewhere.
        overwrite: replace an existing checkpoint at ``path`` (otherwise an error).

    Returns:
        The checkpoint directory.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = _Joined(list(optimizer))
    sharding = describe(optimizer)
    steps = collectives.CollectiveSteps(
        "save", sharding.participants, sharding.destination, CheckpointError
    )
    if consolidated:
        write = lambda staging: _write_consolidated(  # noqa: E731
            optimizer, sharding, staging, max_shard_size, params
        )
    else:
        write = lambda staging: _write_rank_file(optimizer, sharding, staging, params)  # noqa: E731
    kind = CONSOLIDATED if consolidated else PER_RANK
    check = lambda: _check_storable(sharding, optimizer, params, Path(path))  # noqa: E731
    steps.each_then_root("check", check, lambda _: None)
    if not consolidated and len(sharding.participants) > 1:
        # Each rank writes only the state it owns: a wrong owner rule would drop the rest
        # unnoticed (the consolidated gather checks this itself).
        check_state_holders(sharding, _local_state(optimizer, sharding, params=False))
    return writing.write_checkpoint(
        steps,
        path,
        overwrite=overwrite,
        write=write,
        manifest=lambda reports: build_manifest(optimizer, sharding, reports, kind),
    )


class _Joined:
    """Several single-process optimizers seen as one by :func:`save`: their groups in order."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if collectives.is_distributed() and collectives.group_size(None) > 1:
            raise CheckpointError("several optimizers go into one checkpoint in one process only")
        if not optimizers:
            raise CheckpointError("no optimizer to save")
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.state = {p: s for o in optimizers for p, s in o.state.items()}


def _group_kinds(optimizer: Any) -> list[kinds.GroupKind]:
    """What each group computes, by the optimizer that owns the group."""
    owners = optimizer.optimizers if isinstance(optimizer, _Joined) else [optimizer]
    return [kinds.group_kind(o, g) for o in owners for g in o.param_groups]


def _check_storable(
    sharding: Sharding, optimizer: torch.optim.Optimizer, params: bool, where: Path
) -> None:
    """Refuse, before writing anything, what a checkpoint could not hold or load back."""
    flat = flat_params(optimizer)
    keys = [(p.name, k) for p in sharding.params for k in p.expected_keys]
    for param in sharding.local():
        p = flat[param.local_index]
        state = optimizer.state.get(p, {})
        if PARAM_KEY in state:
            raise CheckpointError(
                f"state key {PARAM_KEY!r} is reserved for the param's values", param=param.name
            )
        for key, value in state.items():
            if not isinstance(key, str):
                raise CheckpointError(f"state key {key!r} is not a string", param=param.name)
            info = describe_value(param, key, value, p.numel())
            if info["kind"] == "tensor":
                keys.append((param.name, key))
            elif isinstance(info["value"], float) and not math.isfinite(info["value"]):
                raise CheckpointError(
                    f"state {key!r} is {info['value']}, which a JSON manifest cannot hold",
                    param=param.name,
                )
    keys += [(p.name, PARAM_KEY) for p in sharding.params] if params else []
    unique_tensor_keys(iter(keys), where)


def _local_state(
    optimizer: torch.optim.Optimizer, sharding: Sharding, params: bool
) -> dict[int, dict[str, Any]]:
    """This rank's state by its own flat param index, with each param's values under
    :data:`PARAM_KEY` when ``params``."""
    flat = flat_params(optimizer)
    local: dict[int, dict[str, Any]] = {}
    for param in sharding.local():
        p = flat[param.local_index]
        entry = dict(optimizer.state.get(p, {}))
        if params:
            entry[PARAM_KEY] = p.detach()
        local[param.local_index] = entry
    return local


def _owned(
    optimizer: torch.optim.Optimizer, sharding: Sharding, params: bool
) -> Iterator[tuple[ParamSharding, dict[str, Any]]]:
    """(param sharding, local state and values) of each param this rank must write."""
    me = collectives.global_rank()
    local = _local_state(optimizer, sharding, params)
    for param in sharding.params:
        if any(h.rank == me for h in param.sources):
            yield param, local[param.local_index]


def _write_rank_file(
    optimizer: torch.optim.Optimizer, sharding: Sharding, staging: Path, params: bool
) -> writing.Written:
    """Write this rank's own pieces (its file of :func:`rank_plan`); scalars are reported."""
    me = collectives.global_rank()
    owned, tensors, scalars = [], {}, {}
    for param, state in _owned(optimizer, sharding, params):
        holding = next(h for h in param.sources if h.rank == me)
        for key, value in sorted(state.items()):
            info = describe_value(param, key, value)
            if info["kind"] != "tensor":
                scalars.setdefault(param.name, {})[key] = _scalar_json(info)
                continue
            owned.append(((param.name, key, storage.dtype_name(value.dtype)), holding.region))
            tensors[param.name, key] = value
    rank = sharding.participants.index(me)
    plan = rank_plan(rank, len(sharding.participants), owned)
    fetch = lambda w: tensors[w.param, w.key].reshape(-1)  # noqa: E731
    written = writing.write_files(plan, staging, fetch, prefetch=False)
    written.extra = scalars
    return written


def _scalar_json(info: Mapping[str, Any]) -> dict[str, Any]:
    """A scalar's manifest form: its value, and its safetensors dtype if it is a 0-d tensor."""
    dtype = info.get("dtype")
    value = json_safe(info["value"])
    return {"value": value, "dtype": storage.dtype_name(getattr(torch, dtype)) if dtype else None}


def _write_consolidated(
    optimizer: torch.optim.Optimizer,
    sharding: Sharding,
    staging: Path,
    max_shard_size: int | None,
    params: bool,
) -> writing.Written:
    """Gather every param's full state on the destination, which writes the files of
    :func:`consolidated_plan`; the other ranks write nothing."""
    full = gather_full_state(sharding, _local_state(optimizer, sharding, params))
    if full is None:
        return writing.Written([], [], {})
    by_name, items, scalars = {}, [], {}
    for index, param in enumerate(sharding.params):
        by_name[param.name] = state = full.get(index, {})
        for key, value in sorted(state.items()):
            info = describe_value(param, key, value)
            if info["kind"] == "tensor":
                items.append(((param.name, key, storage.dtype_name(value.dtype)), param.full_shape))
            else:
                scalars.setdefault(param.name, {})[key] = _scalar_json(info)
    plan = consolidated_plan(items, max_shard_size)
    written = writing.write_files(plan, staging, lambda w: by_name[w.param][w.key], prefetch=False)
    written.extra = scalars
    return written


def build_manifest(
    optimizer: torch.optim.Optimizer, sharding: Sharding, reports: writing.Reports, kind: str
) -> Manifest:
    """The manifest of a save: params and groups from the grid, files, pieces, dtypes and
    scalars from the ranks' reports."""
    scalars: dict[str, dict[str, Scalar]] = {}
    for extra in reports.extras:
        for name, values in (extra or {}).items():
            for key, item in values.items():
                scalars.setdefault(name, {}).setdefault(key, Scalar(item["value"], item["dtype"]))
    pieces, dtypes = reports.pieces, reports.dtypes
    keys: dict[str, set[str]] = {}
    for piece in pieces:
        keys.setdefault(piece.param, set()).add(piece.key)
    entries = []
    for param in sharding.params:
        entries.append(
            ParamEntry(
                name=param.name,
                shape=tuple(param.full_shape),
                group=param.group,
                tp_split_dim=param.tp_split_dim,
                dtypes={k: dtypes[param.name, k] for k in sorted(keys.get(param.name, ()))},
                scalars=dict(scalars.get(param.name, {})),
            )
        )
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: json_safe(v) for k, v in group.items() if k not in ("params", "param_names")}
        names = tuple(sharding.params[i].name for i in sharding.members(g))
        computes = _group_kinds(optimizer)[g].to_json()
        groups.append(GroupEntry(hyperparams=hyper, params=names, optimizer=computes))
    return Manifest(
        kind=kind,
        topology=dict(sharding.topology),
        groups=tuple(groups),
        params=tuple(entries),
        files=tuple(reports.files),
        pieces=tuple(pieces),
    )


@dataclass
class LoadReport:
    """What :func:`load` did beyond copying bytes (also logged, and warned for settings)."""

    converted: list[str] = field(default_factory=list)
    """Momentum converted between forms, per group: which params, from which form, by what."""
    warnings: list[str] = field(default_factory=list)
    """Target settings that cannot continue the saved trajectory, and what would."""


@dataclass
class _Target:
    """The optimizer(s) to load into, and how the checkpoint's state maps onto them."""

    optimizer: Any
    """One optimizer, or a :class:`_Joined` list of them."""
    sharding: Sharding
    groups: list[dict[str, Any]]
    maps: dict[str, kinds.KeyMap] | None
    """Per param name, the key map of a load across implementations; None: same optimizer."""
    steps_in: list[str | None]
    """Per target group, where an AdamW step count goes."""


def load(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    params: bool = True,
    momentum_form: str | None = None,
) -> LoadReport:
    """Load a checkpoint of any kind and source topology into ``optimizer`` at its topology.

    Restores the optimizer state and, by default, the optimizer's params (each rank its own
    share, bitwise): a resumed run needs nothing but the checkpoint. A model whose weights are
    not the optimizer's params gets them back from those params (see
    :meth:`muonckpt.ShardedParams.params_to_model`).

    The target may be another Muon implementation than the one that saved, or several
    optimizers that together hold every param (``[torch.optim.Muon(...),
    torch.optim.AdamW(...)]`` for a packaged Muon + AdamW checkpoint). Momentum is then
    converted between sum and EMA form by ``1 - mu`` (:mod:`muonckpt.kinds`), AdamW state and
    step counts are mapped as each optimizer keeps them, the target keeps its own settings,
    and settings that cannot continue the saved trajectory are warned about.

    Every rank reads the manifest and then only the bytes of the pieces overlapping its own
    share, verifying their checksums; memory is its share plus one piece span in flight.
    In distributed mode a collective over the grid the first time the optimizer is described.

    Args:
        optimizer: an optimizer :func:`save` takes, at any topology, or a list of them.
        path: a checkpoint directory.
        params: restore the params too (the default; the checkpoint must hold them). False
            restores the optimizer state only, for weights loaded elsewhere.
        momentum_form: ``"sum"`` or ``"ema"``: the momentum form of a target whose form
            muonckpt does not know (required then), or an override for one it knows.

    Returns:
        A :class:`LoadReport` of the conversions made and the settings warned about.

    Raises:
        CheckpointError: naming the file and param on any damage or mismatch, before anything
            in the optimizer changes. StateDictError: for a target that cannot take the state.
    """
    targets = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    directory, manifest = open_checkpoint(path)
    if params and not manifest.has_values:
        raise CheckpointError(
            "the checkpoint holds no param values (saved with params=False, or by format "
            f"version {manifest.format_version}); load it with params=False to restore the "
            "optimizer state only",
            path=directory / MANIFEST_NAME,
        )
    joined = targets[0] if len(targets) == 1 else _Joined(targets)
    report = LoadReport()
    plan = _plan(joined, manifest, momentum_form, report)
    _check_covered(manifest, plan, directory)
    with PieceReader(directory, manifest) as reader:
        state, values = _read(plan, manifest, reader, params, directory)
    _apply(plan, state, values)
    for message in report.converted:
        _LOG.info("muonckpt.load: converted %s", message)
    for message in report.warnings:
        warnings.warn(message, ConversionWarning, stacklevel=2)
    return report


_LOG = logging.getLogger("muonckpt")


def _plan(
    optimizer: Any, manifest: Manifest, momentum_form: str | None, report: LoadReport
) -> _Target:
    sharding = describe(optimizer)
    source = [
        kinds.GroupKind.from_json(g.optimizer) if g.optimizer else None for g in manifest.groups
    ]
    target = _group_kinds(optimizer)
    steps_in = [k.step_in for k in target]
    same = {k.optimizer for k in target} == {k.optimizer for k in source if k is not None}
    same = same and not any(k and k.converted_from for k in source)
    if momentum_form is None and (same or None in source):
        groups = remap_groups(optimizer, _torch_groups(manifest), sharding)
        return _Target(optimizer, sharding, groups, None, steps_in)
    maps: dict[str, kinds.KeyMap] = {}
    converted: dict[tuple[int, str], list[str]] = {}
    pairs = set()
    for param in sharding.params:
        entry = manifest.param(param.name)
        origin = source[entry.group]
        if origin is None:
            raise StateDictError(
                f"param {param.name!r}: the checkpoint does not say which optimizer saved it "
                "(format 1), so it loads only into the same optimizer"
            )
        maps[param.name] = key_map = kinds.state_mapping(
            origin, target[param.group], param.name, momentum_form
        )
        if key_map.note is not None:
            converted.setdefault((param.group, key_map.note), []).append(param.name)
        pairs.add((entry.group, param.group))
    for (group, note), names in converted.items():
        where = f"{target[group].optimizer} (group {group})"
        report.converted.append(f"{where}: momentum of {len(names)} params, {note}")
    for source_group, target_group in sorted(pairs):
        where = f"{target[target_group].optimizer} (group {target_group})"
        for note in kinds.trajectory_notes(source[source_group], target[target_group]):
            report.warnings.append(f"{where}: {note}")
    return _Target(optimizer, sharding, _own_groups(optimizer, sharding, manifest), maps, steps_in)


def _own_groups(optimizer: Any, sharding: Sharding, manifest: Manifest) -> list[dict[str, Any]]:
    """The target's own group settings in local indices; a group that counts steps itself (the
    packaged AdamW) takes the checkpoint's count."""
    groups, start = [], 0
    computed = _group_kinds(optimizer)
    for g, (group, computes) in enumerate(zip(optimizer.param_groups, computed, strict=True)):
        settings = {k: v for k, v in group.items() if k != "params"}
        settings["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        if "step" in group or computes.step_in == "group":
            step = manifest.latest_step(p.name for p in sharding.params if p.group == g)
            if step is not None:
                settings["step"] = step
        groups.append(settings)
    return groups


def _check_covered(manifest: Manifest, plan: _Target, directory: Path) -> None:
    """Loading across optimizers, every checkpoint param must land in exactly one of them."""
    if plan.maps is None:
        return  # the same optimizer: remap_groups has matched every name
    names = [p.name for p in plan.sharding.params]
    missing = sorted({e.name for e in manifest.params} - set(names))
    if missing:
        raise CheckpointError(
            f"the optimizers must together hold every param of the checkpoint: held by none "
            f"{missing[:8]}",
            path=directory / MANIFEST_NAME,
        )


def _read(
    plan: _Target, manifest: Manifest, reader: PieceReader, params: bool, directory: Path
) -> tuple[dict[int, dict[str, Any]], dict[int, torch.Tensor]]:
    """This rank's share of the state (in the target's keys) and of its params' values."""
    grouped = manifest.pieces_of()

    def read(entry: ParamEntry, key: str, region: Region) -> torch.Tensor:
        data = reader.gather(grouped[entry.name, key], entry, key, region)
        return storage.tensor_of_bytes(data, entry.dtype_of(key))

    flat = flat_params(plan.optimizer)
    state: dict[int, dict[str, Any]] = {}
    values: dict[int, torch.Tensor] = {}
    for param in plan.sharding.params:
        entry = manifest.param(param.name)
        _check_param(entry, param, directory)
        if param.local_index is None:
            continue
        p = flat[param.local_index]
        if param.local is not None and (entry.state_keys or entry.scalars):
            if plan.maps is None:
                kept = {k: read(entry, k, param.local).reshape(p.shape) for k in entry.state_keys}
                kept.update({k: _scalar_value(v) for k, v in entry.scalars.items()})
            else:
                kept = _mapped(plan, param, entry, manifest, read)
                kept = {k: v.reshape(p.shape) if k != "step" else v for k, v in kept.items()}
            state[param.local_index] = kept
        if params:
            held = param.held or whole_region(entry.numel)
            values[param.local_index] = _checked_value(
                read(entry, PARAM_KEY, held), p, entry, directory
            )
    return state, values


def _mapped(
    plan: _Target,
    param: ParamSharding,
    entry: ParamEntry,
    manifest: Manifest,
    read: Callable[[ParamEntry, str, Region], torch.Tensor],
) -> dict[str, Any]:
    """A param's state in the target's keys and forms."""
    key_map = plan.maps[param.name]
    out: dict[str, Any] = {}
    for key, (source_key, factor) in key_map.keys.items():
        if source_key in entry.state_keys:
            value = read(entry, source_key, param.local)
            out[key] = value.mul_(factor) if factor != 1.0 else value
    step = manifest.step_of(entry)
    where = plan.steps_in[param.group]
    if key_map.step and out and step is not None and where in ("tensor", "int"):
        out["step"] = torch.tensor(float(step)) if where == "tensor" else int(step)
    return out


class _Indices(list):
    """A group's param indices for ``load_state_dict``: torch asks ``index in group["params"]``
    once per state value, which on a plain list makes a load quadratic in the params."""

    def __init__(self, indices: Iterable[int]) -> None:
        super().__init__(indices)
        self._members = frozenset(self)

    def __contains__(self, index: object) -> bool:
        return index in self._members


def _apply(
    plan: _Target, state: dict[int, dict[str, Any]], values: dict[int, torch.Tensor]
) -> None:
    """Hand each optimizer its share (in its own indices), then copy the params' values."""
    owners = plan.optimizer.optimizers if isinstance(plan.optimizer, _Joined) else [plan.optimizer]
    first_group = first_param = 0
    for optimizer in owners:
        groups = plan.groups[first_group : first_group + len(optimizer.param_groups)]
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        share = {
            "state": {
                i - first_param: v
                for i, v in state.items()
                if first_param <= i < first_param + count
            },
            "param_groups": [
                {**g, "params": _Indices(i - first_param for i in g["params"])} for g in groups
            ],
        }
        hooks = _HOOKS.get(optimizer)
        if hooks is None:
            optimizer.load_state_dict(share)
        else:
            hooks.load_local_share(optimizer, share)
        flat = flat_params(optimizer)
        with torch.no_grad():
            for index, value in values.items():
                if first_param <= index < first_param + count:
                    p = flat[index - first_param]
                    p.copy_(value.reshape(p.shape))
        first_group += len(optimizer.param_groups)
        first_param += count


def _scalar_value(scalar: Scalar) -> Any:
    """A stored scalar as the optimizer had it: a 0-d tensor of its dtype, or the number."""
    if scalar.dtype is None:
        return scalar.value
    name = str(storage.torch_dtype(scalar.dtype)).removeprefix("torch.")
    return value_of({"kind": "scalar", "value": scalar.value, "dtype": name})


def _checked_value(
    value: torch.Tensor, p: torch.Tensor, entry: ParamEntry, directory: Path
) -> torch.Tensor:
    if value.dtype != p.dtype or value.numel() != p.numel():
        raise CheckpointError(
            f"saved values are {value.dtype} x {value.numel()} elements here, the optimizer's "
            f"param {p.dtype} x {p.numel()}",
            path=directory / MANIFEST_NAME,
            param=entry.name,
        )
    return value


def _torch_groups(manifest: Manifest) -> list[dict[str, Any]]:
    return [
        {**g.hyperparams, "param_names": list(g.params), "params": list(g.params)}
        for g in manifest.groups
    ]


def _check_param(entry: ParamEntry, param: ParamSharding, directory: Path) -> None:
    if param.full_shape is not None and tuple(entry.shape) != tuple(param.full_shape):
        raise CheckpointError(
            f"checkpoint shape {entry.shape} differs from the optimizer's full shape "
            f"{tuple(param.full_shape)}",
            path=directory / MANIFEST_NAME,
            param=param.name,
        )
    missing = [k for k in param.expected_keys if entry.state_keys and k not in entry.state_keys]
    if missing:
        raise CheckpointError(
            f"checkpoint lacks state key(s) {missing}",
            path=directory / MANIFEST_NAME,
            param=param.name,
        )
