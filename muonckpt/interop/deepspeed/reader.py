"""DeepSpeed ZeRO-1/2/3 with its Muon (``"optimizer": {"type": "Muon"}``: ``MuonWithAuxAdam``
inside ``DeepSpeedZeroOptimizer``, or ``DeepSpeedZeroOptimizer_Stage3``) in and out, at any
world size.

:func:`from_deepspeed` reads what ``engine.save_checkpoint`` wrote (the directory with
``latest``, or one tag directory) into a consolidated muonckpt checkpoint keyed by
DeepSpeed's param names: each param's fp32 master value (the ranks' slices joined), each Muon
matrix's momentum (every rank whose slice overlaps a matrix holds all of it: the copies must
agree), the aux Adam's moments and step as it keeps them, the group settings, and the
momentum form (KellerJordan's update, EMA form) recorded as ``deepspeed.MuonWithAuxAdam``, so
that ``load`` into torch.optim.Muon is exact and into the packaged Muon converts it as for
every other family. :func:`to_deepspeed` writes any muonckpt checkpoint as DeepSpeed's own
files for ``world`` ranks, which DeepSpeed loads at that world size as if it had saved them.
The stage is what rank 0's optimizer file records; at ZeRO-3 each rank holds its partition of
every param (the Muon momentum too) in a flat state per sub-group, and the model states are per
rank. The layout math is :mod:`muonckpt.interop.deepspeed.partitions`'s, the file access
:mod:`muonckpt.interop.deepspeed.files`'s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ...errors import CheckpointError, LayoutError
from ...files.progress import Progress
from ...format import kinds
from ...format.conversion import converted_manifest
from ...format.manifest import (
    CONSOLIDATED,
    GroupEntry,
    Manifest,
    ModelFile,
    ParamEntry,
    Scalar,
    json_safe,
)
from ...format.names import PARAM_KEY
from ...storage.dtypes import dtype_name
from .._consolidated import consolidated, conversion_notes, write_consolidated
from .._fields import shown, step_count, tensor
from ..foreign import Conversion
from . import files as deepspeed_files
from . import job_state
from .files import FragmentAddress, ZeroStage
from .partitions import GroupLayout, Zero3Layout, group_layout, zero3_layout
from .writer import ADAM_KEYS, MUON_KEY, OPTIMIZER, SOURCE, to_deepspeed

__all__ = ["from_deepspeed", "is_deepspeed", "to_deepspeed"]

is_deepspeed = deepspeed_files.is_deepspeed


@dataclass
class _Group:
    """One DeepSpeed param group as the rank files are read into it, joined."""

    index: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    layout: GroupLayout
    settings: dict[str, Any]
    master: Any
    """The fp32 master values, flat, the whole group (padding included)."""
    moments: dict[str, Any] = field(default_factory=dict)
    """Adam's ``exp_avg`` / ``exp_avg_sq``, flat like :attr:`master`."""
    momentum: dict[str, tuple[Any, int]] = field(default_factory=dict)
    """Muon: each param's whole momentum, and the first rank that held it."""
    step: Any = None
    keys: list[str] = field(default_factory=list)
    """Rank 0's state keys of the group: every rank's Adam state holds the same."""

    @property
    def muon(self) -> bool:
        return self.settings.get("use_muon") is True


def _fail(message: str, path: Path) -> CheckpointError:
    return CheckpointError(message, path=path)


def _get(mapping: Any, key: str, kind: type | tuple[type, ...], path: Path, where: str) -> Any:
    """``mapping[key]``, of type ``kind``; refused naming the file and the field."""
    if not isinstance(mapping, dict) or key not in mapping:
        raise _fail(f"{where} has no {key!r}: not a DeepSpeed ZeRO file", path)
    value = mapping[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise _fail(
            f"{where}[{key!r}] is a {type(value).__name__}, not what DeepSpeed writes", path
        )
    return value


def _param_shapes(model: Any, path: Path) -> list[dict[str, tuple[int, ...]]]:
    """``param_shapes``: per group, each param's name and shape, in the group's order."""
    import torch

    groups = _get(model, "param_shapes", list, path, "the model states")
    if not groups:
        raise _fail("param_shapes holds no param group: an optimizer of no params", path)
    out = []
    for g, shapes in enumerate(groups):
        if not isinstance(shapes, dict) or not shapes:
            wrong = "names no param" if isinstance(shapes, dict) else "is not a name's shapes"
            raise _fail(f"param_shapes[{g}] {wrong}", path)
        group = {}
        for name, shape in shapes.items():
            if not isinstance(name, str) or not isinstance(shape, (torch.Size, tuple, list)):
                raise _fail(
                    f"param_shapes[{g}] holds {name!r}: {shape!r}, not a name's shape", path
                )
            if not all(type(n) is int and n >= 0 for n in shape):
                raise _fail(f"param_shapes[{g}][{name!r}] is {list(shape)}, not a shape", path)
            group[name] = tuple(shape)
        out.append(group)
    names = [n for group in out for n in group]
    if len(set(names)) != len(names):
        raise _fail("param_shapes names a param in two groups", path)
    return out


_DEGREES = ("tp_degree", "pp_degree")
"""The degrees of ``checkpoint_parallel_dimensions`` that split a param across files."""


def _check_unparallel(model: dict[str, Any], path: Path) -> None:
    """The model states record no model parallelism: ``mp_world_size`` and the
    ``tp_degree`` / ``pp_degree`` of ``checkpoint_parallel_dimensions`` are 1 where saved. A
    save with it holds each rank's shard under the full param's name: read from
    ``mp_rank_00`` alone it would be a wrong checkpoint, not a partial one."""
    dims = model.get("checkpoint_parallel_dimensions")
    found = {"mp_world_size": model.get("mp_world_size", 1)}
    if dims is not None:
        if not isinstance(dims, dict):
            raise _fail(f"checkpoint_parallel_dimensions is {shown(dims)}, not a mapping", path)
        found.update({f"checkpoint_parallel_dimensions[{k!r}]": dims.get(k, 1) for k in _DEGREES})
    for what, degree in found.items():
        if type(degree) is not int or degree != 1:
            raise _fail(
                f"{what} is {shown(degree)}: a save with tensor or pipeline parallelism, which "
                "muonckpt does not read (DeepSpeed ZeRO-1/2/3 without it only)",
                path,
            )


def _check_declared(
    shapes: list[dict[str, tuple[int, ...]]], files: list[Path], path: Path
) -> None:
    """The elements ``param_shapes`` declares must fit the rank files: their fp32 masters
    alone take 4 bytes each. Checked on the files' sizes, before any of them is read, so a
    few-KB file claiming 16384 x 16384 is refused without allocating its 1 GiB."""
    declared = sum(math.prod(shape) for group in shapes for shape in group.values())
    present = deepspeed_files.total_size(files)
    if 4 * declared > present:
        raise _fail(
            f"param_shapes declares {declared} elements ({4 * declared} bytes of fp32 masters), "
            f"but the {len(files)} rank files hold {present} bytes in all",
            path,
        )


def _stage(optim: Any, path: Path) -> int:
    """The ZeRO stage a rank file records (1, 2 or 3)."""
    stage = optim.get("zero_stage") if isinstance(optim, dict) else None
    if not isinstance(stage, int) or stage not in tuple(ZeroStage)[1:]:
        raise _fail(f"zero_stage is {stage!r}: only ZeRO stages 1, 2 and 3 are read", path)
    return int(stage)


def _rank_partitions(optim: Any, world: int, groups: int, stage: int, path: Path) -> None:
    """Check that a rank file written by ``world`` ranks over ``groups`` groups records rank
    0's ZeRO ``stage`` and ``world`` partitions of each group."""
    if _stage(optim, path) != stage:
        raise _fail(f"zero_stage is {optim['zero_stage']!r}, rank 0's {stage}", path)
    counts = optim.get("partition_count")
    counts = [counts] * groups if isinstance(counts, int) else counts
    if not isinstance(counts, list) or len(counts) != groups:
        raise _fail(
            f"partition_count is {counts!r}, not one count per each of {groups} groups", path
        )
    for count in counts:
        if isinstance(count, int) and count > world:  # name the first missing, not this one
            missing = path.parent / deepspeed_files.rank_file(world, path.name.startswith("bf16_"))
            raise _fail(
                f"rank {world}'s optimizer file is missing: partition_count is {count} in "
                f"{path.name}, and {world} rank file{'s are' if world != 1 else ' is'} there",
                missing,
            )
        if count != world:
            raise _fail(
                f"partition_count is {count}, but {world} rank file{'s' * (world != 1)} "
                "are beside it: a rank file is missing or left from another save",
                path,
            )


def _read_rank(
    rank: int,
    world: int,
    path: Path,
    top: Any,
    shapes: list[dict[str, tuple[int, ...]]],
    out: list[_Group],
    stage: int,
) -> None:
    """Check rank ``rank``'s file ``top`` (ZeRO-1/2) against the layout ``shapes`` make for
    ``world`` ranks and join its slices into ``out`` (made here from rank 0's)."""
    import torch

    optim = _get(top, "optimizer_state_dict", dict, path, "the file")
    _rank_partitions(optim, world, len(shapes), stage, path)
    masters, paddings, param_groups, states, align = _rank_groups(optim, len(shapes), path)
    mappings = optim.get("param_slice_mappings")
    for g, group_shapes in enumerate(shapes):
        numels = [math.prod(s) for s in group_shapes.values()]
        layout = _group_layout(numels, world, align[g], g, path)
        settings = param_groups[g]
        if not isinstance(settings, dict):
            raise _fail(f"param_groups[{g}] is not a group's settings", path)
        where = f"group {g}"
        master = _master(masters[g], paddings[g], layout, rank, where, path)
        if rank == 0:  # (the partition checked first: param_shapes' claim is not allocated)
            flat = torch.zeros(layout.world * layout.partition, dtype=torch.float32)
            hyper = {k: v for k, v in settings.items() if k != "params"}
            out.append(
                _Group(g, list(group_shapes), list(group_shapes.values()), layout, hyper, flat)
            )
        group = out[g]
        _check_mappings(mappings, g, group, rank, path)
        at = rank * layout.partition
        group.master[at : at + master.numel()] = master
        _take_state(_state_of(settings.get("params"), states, where, path), group, rank, path)


def _read_rank_z3(
    rank: int,
    world: int,
    path: Path,
    top: Any,
    shapes: list[dict[str, tuple[int, ...]]],
    out: list[_Group],
) -> None:
    """Check rank ``rank``'s ZeRO-3 file ``top`` against the layout ``shapes`` (one entry a
    sub-group) make for ``world`` ranks and join its partitions into ``out``: one
    :class:`_Group` per optimizer group, its sub-groups' params one after the other, held
    whole (a world-1 layout), made here from rank 0's file."""
    import torch

    optim = _get(top, "optimizer_state_dict", dict, path, "the file")
    _rank_partitions(optim, world, 1, ZeroStage.weights, path)
    flats = _get(optim, "fp32_flat_groups", list, path, "optimizer_state_dict")
    inner = _get(optim, "optimizer_state_dict", dict, path, "optimizer_state_dict")
    param_groups = _get(inner, "param_groups", list, path, "the optimizer state")
    states = _get(inner, "state", dict, path, "the optimizer state")
    members = [g.get("params") if isinstance(g, dict) else None for g in param_groups]
    listed = [k for ids in members if isinstance(ids, list) for k in ids]
    if listed != list(range(len(shapes))) or len(flats) != len(shapes):
        raise _fail(
            f"its optimizer groups list sub-groups {listed} and it holds {len(flats)} fp32 "
            f"partitions, not the {len(shapes)} sub-groups of param_shapes in order",
            path,
        )
    for g, (settings, ids) in enumerate(
        zip(param_groups, cast(list[list[int]], members), strict=True)
    ):
        names = [n for k in ids for n in shapes[k]]
        if rank == 0:
            group_shapes = [shapes[k][n] for k in ids for n in shapes[k]]
            layout = group_layout([math.prod(s) for s in group_shapes], 1)
            flat = torch.zeros(layout.partition, dtype=torch.float32)
            hyper = {k: v for k, v in settings.items() if k != "params"}
            out.append(_Group(g, names, group_shapes, layout, hyper, flat))
        group, first = out[g], 0
        if group.names != names:
            raise _fail(f"group {g} holds params {names[:4]}..., rank 0's {group.names[:4]}", path)
        for k in ids:
            sub = zero3_layout([math.prod(s) for s in shapes[k].values()], world)
            state = _state_of([k], states, f"sub-group {k}", path)
            _take_sub_group(flats[k], state, sub, k, group, first, rank, path)
            first += len(sub.numels)


def _take_sub_group(
    master: Any,
    state: dict[Any, Any],
    sub: Zero3Layout,
    k: int,
    group: _Group,
    first: int,
    rank: int,
    path: Path,
) -> None:
    """Join rank ``rank``'s ZeRO-3 partitions of sub-group ``k`` (layout ``sub``; its params
    are ``group``'s from index ``first`` on): the fp32 master ``master`` and each flat state
    tensor of ``state``, each param's piece to where it is in the param."""
    import torch

    where = f"sub-group {k}"
    master = tensor(master, path, f"{where}: its fp32 partition")
    if master.dim() != 1 or master.numel() != sub.flat_numel:
        raise _fail(
            f"{where}: its fp32 partition holds {master.numel()} elements; the "
            f"{sum(sub.numels)} elements of param_shapes over {sub.world} ranks give each "
            f"rank {sub.flat_numel}",
            path,
        )
    _check_keys(state, group, rank, path)
    flats = [(master, group.master)]
    for key in (*ADAM_KEYS, MUON_KEY):
        if key in state:
            value = tensor(state[key], path, f"{where}: {key}")
            if value.dim() != 1 or value.numel() != sub.flat_numel:
                raise _fail(f"{where}: {key} is not this rank's {sub.flat_numel}", path)
            whole = group.moments.get(key)
            if whole is None:
                whole = torch.zeros_like(group.master, dtype=value.dtype)
                group.moments[key] = whole
            flats.append((value, whole))
    for i, at in enumerate(sub.offsets):
        held = sub.held(i, rank)
        to = group.layout.offsets[first + i] + rank * sub.partition(i)
        for piece, whole in flats:
            whole[to : to + held] = piece[at : at + held]
    _take_step(state, group, rank, path)


def _momentum_of_flat(group: _Group) -> None:
    """A ZeRO-3 group's Muon momentum, joined flat like its masters, as each matrix's own."""
    flat = group.moments.pop(MUON_KEY, None)
    if flat is None:
        return
    for index, name in enumerate(group.names):
        at, numel = group.layout.offsets[index], group.layout.numels[index]
        group.momentum[name] = (flat[at : at + numel].reshape(group.shapes[index]), 0)


def _rank_groups(
    optim: dict[Any, Any], groups: int, path: Path
) -> tuple[list[Any], list[Any], list[Any], dict[Any, Any], list[Any]]:
    """A rank file's fp32 partitions, their paddings, its optimizer's groups and state, and
    its params' alignment paddings: one of each per each of the ``groups`` groups of
    ``param_shapes`` (the state by param id)."""
    base = optim.get("base_optimizer_state")
    if not isinstance(base, dict):
        raise _fail(
            "base_optimizer_state is not one optimizer state dict: an elastic checkpoint "
            "(zero_optimization.elastic_checkpoint), which muonckpt does not read",
            path,
        )
    masters = _get(optim, "single_partition_of_fp32_groups", list, path, "optimizer_state_dict")
    paddings = _get(optim, "group_paddings", list, path, "optimizer_state_dict")
    param_groups = _get(base, "param_groups", list, path, "base_optimizer_state")
    states = _get(base, "state", dict, path, "base_optimizer_state")
    if not len(masters) == len(paddings) == len(param_groups) == groups:
        raise _fail(
            f"{len(masters)} fp32 partitions, {len(paddings)} paddings and {len(param_groups)} "
            f"optimizer groups for the {groups} groups of param_shapes",
            path,
        )
    align = optim.get("param_alignment_paddings") or [None] * groups
    if not isinstance(align, list) or len(align) != groups:
        raise _fail(f"param_alignment_paddings is not one list per each of {groups} groups", path)
    return masters, paddings, param_groups, states, align


def _group_layout(numels: list[int], world: int, align: Any, g: int, path: Path) -> GroupLayout:
    """The ZeRO layout of group ``g``'s params (``numels`` elements each) over ``world``
    ranks, with the alignment paddings ``align`` its rank file saved."""
    try:
        return group_layout(numels, world, align)
    except (LayoutError, TypeError):
        raise _fail(
            f"param_alignment_paddings[{g}] is {shown(align)}, not one padding of at least "
            f"0 after each of its {len(numels)} params but the last",
            path,
        ) from None


def _master(
    saved: Any, padding: Any, layout: GroupLayout, rank: int, where: str, path: Path
) -> Any:
    """Rank ``rank``'s fp32 partition of a group, checked to be the flat tensor, at the
    padding, that ``layout`` gives it."""
    master = tensor(saved, path, f"{where}: its fp32 partition")
    if master.dim() != 1:
        raise _fail(f"{where}: its fp32 partition is not a flat tensor", path)
    if master.numel() != layout.kept(rank) or padding != layout.group_padding(rank):
        raise _fail(
            f"{where}: its fp32 partition holds {master.numel()} elements with padding "
            f"{padding!r}; the {sum(layout.numels)} elements of param_shapes over "
            f"{layout.world} ranks give rank {rank} {layout.kept(rank)} with padding "
            f"{layout.group_padding(rank)}",
            path,
        )
    return master


def _check_mappings(mappings: Any, g: int, group: _Group, rank: int, path: Path) -> None:
    """``param_slice_mappings`` (when saved) name exactly the fragments the layout gives."""
    if mappings is None:
        return
    if not isinstance(mappings, list) or len(mappings) <= g or not isinstance(mappings[g], dict):
        raise _fail("param_slice_mappings is not one mapping per group", path)
    expected = {}
    for index, name in enumerate(group.names):
        for fragment in group.layout.fragments(index):
            if fragment.rank == rank:
                expected[name] = (fragment.start, fragment.numel)
    saved = {}
    for name, address in mappings[g].items():
        if not isinstance(address, FragmentAddress):
            raise _fail(f"param_slice_mappings[{g}][{name!r}] is not a fragment_address", path)
        saved[name] = (address.start, address.numel)
    if saved != expected:
        wrong = sorted(set(saved.items()) ^ set(expected.items()))[0][0]
        raise _fail(
            f"param_slice_mappings[{g}] places {wrong!r} at (start, numel) "
            f"{saved.get(wrong)}, the layout of param_shapes at {expected.get(wrong)}",
            path,
        )


def _state_of(ids: Any, states: dict[Any, Any], where: str, path: Path) -> dict[Any, Any]:
    """The state of a group's one flat param (id ``ids[0]``): none before the first step (an
    empty ``state``), else it must be there, never read as none."""
    if not isinstance(ids, list) or len(ids) != 1:
        raise _fail(f"{where}: its optimizer group holds not one flat param", path)
    if ids[0] not in states and states:
        held = sorted(map(repr, states))[:8]
        raise _fail(f"{where}: param id {ids[0]!r} has no state (the file holds ids {held})", path)
    state = states.get(ids[0], {})
    if not isinstance(state, dict):
        raise _fail(f"{where}: the state of param id {ids[0]!r} is not a mapping", path)
    return state


def _check_keys(state: dict[Any, Any], group: _Group, rank: int, path: Path) -> None:
    """A rank's state keys of a group: DeepSpeed Muon's or its Adam's, and (Adam) rank 0's."""
    where = f"group {group.index}"
    allowed = {MUON_KEY} if group.muon else {*ADAM_KEYS, "step"}
    unknown = sorted(str(k) for k in set(state) - allowed)
    if unknown:
        raise _fail(f"{where}: state {unknown} is not DeepSpeed Muon's nor its Adam's", path)
    keys = sorted(map(str, state))
    if rank == 0:
        group.keys = keys
    elif keys != group.keys and not group.muon:  # (a Muon rank may overlap no matrix)
        raise _fail(
            f"{where}: state {keys}, rank 0's {group.keys}: the ranks did not all step", path
        )


def _take_step(state: dict[Any, Any], group: _Group, rank: int, path: Path) -> None:
    """The Adam step of a rank's state of a group: the same on every rank."""
    if "step" in state:
        where = f"group {group.index}"
        step = state["step"]
        step_count(step, path, f"{where}: step")
        if rank > 0 and not _same(step, group.step):
            raise _fail(f"{where}: step {step!r}, rank 0's {group.step!r}", path)
        group.step = step


def _take_state(state: dict[Any, Any], group: _Group, rank: int, path: Path) -> None:
    """Join one rank's optimizer state of a group: Adam's moment slices and step, or the
    whole momentum of each Muon matrix the rank's slice overlaps (equal on every rank)."""
    import torch

    layout, where = group.layout, f"group {group.index}"
    _check_keys(state, group, rank, path)
    for key in ADAM_KEYS:
        if key in state:
            value = tensor(state[key], path, f"{where}: {key}")
            if value.numel() not in (
                layout.partition,
                layout.kept(rank),
            ):
                raise _fail(f"{where}: {key} is not this rank's slice of {layout.partition}", path)
            flat = group.moments.setdefault(key, torch.zeros_like(group.master))
            at = rank * layout.partition
            flat[at : at + layout.kept(rank)] = value.reshape(-1)[: layout.kept(rank)]
    _take_step(state, group, rank, path)
    if MUON_KEY in state:
        _take_momentum(state[MUON_KEY], group, rank, path)


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are copies of one value: tensors bit for bit (two NaN copies
    are the same, as ``torch.equal`` would not say), else of one type and equal."""
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return type(a) is type(b) and a == b


def _take_momentum(buffer: Any, group: _Group, rank: int, path: Path) -> None:
    import torch

    layout = group.layout
    if isinstance(buffer, torch.Tensor):
        tensor(buffer, path, f"group {group.index}: {MUON_KEY}")
    if not isinstance(buffer, torch.Tensor) or buffer.numel() != layout.momentum_numel(rank):
        shown = buffer.numel() if isinstance(buffer, torch.Tensor) else type(buffer).__name__
        raise _fail(
            f"group {group.index}: momentum_buffer holds {shown} elements; the "
            f"Muon matrices rank {rank}'s slice overlaps hold {layout.momentum_numel(rank)}",
            path,
        )
    flat = buffer.reshape(-1)
    for index, at in layout.momentum_offsets(rank):
        name, numel = group.names[index], layout.numels[index]
        piece = flat[at : at + numel].reshape(group.shapes[index])
        held = group.momentum.get(name)
        if held is None:
            group.momentum[name] = (piece.clone(), rank)
        elif not _same(held[0], piece):
            raise _fail(
                f"the momentum of {name!r} differs between rank {held[1]} and rank {rank}, "
                "which both hold all of it",
                path,
            )


def _kind(group: _Group, path: Path) -> kinds.GroupKind:
    """What a DeepSpeed group computes: KellerJordan's Muon update (EMA momentum, Nesterov,
    ``sqrt(max(1, A / B))``), or its aux Adam (step a tensor with torch's AdamW, an int with
    FusedAdam and the inline Adam)."""
    import torch

    if not group.muon:
        step_in = "tensor" if isinstance(group.step, torch.Tensor) else "int"
        return kinds.GroupKind(OPTIMIZER, "adamw", step_in=step_in)
    mu = group.settings.get("momentum")
    if not isinstance(mu, (int, float)) or isinstance(mu, bool) or not 0 <= mu < 1:
        raise _fail(f"group {group.index}: momentum {mu!r} is not a number in [0, 1)", path)
    return kinds.GroupKind(OPTIMIZER, "muon", kinds.EMA, float(mu), True, kinds.ASPECT)


def _step(group: _Group) -> Scalar | None:
    import torch

    if group.step is None:
        return None
    if isinstance(group.step, torch.Tensor):  # (an int64 step stays an int)
        return Scalar(group.step.item(), dtype_name(group.step.dtype))
    return Scalar(int(group.step), None)


def _manifest(groups: Sequence[_Group], recorded: int | None, path: Path, stage: int) -> Manifest:
    """The joined groups as a consolidated manifest in DeepSpeed's own form (files, pieces
    still empty), groups and params in DeepSpeed's order, the ZeRO ``stage`` recorded."""
    entries, entries_of = [], []
    for group in groups:
        kind = _kind(group, path)
        hyper = json_safe({k: v for k, v in group.settings.items() if k != "step"}, path)
        entries_of.append(GroupEntry(hyper, tuple(group.names), kind.to_json()))
        step = _step(group)
        for name, shape in zip(group.names, group.shapes, strict=True):
            dtypes = {PARAM_KEY: "F32"}
            if name in group.momentum:
                dtypes[MUON_KEY] = dtype_name(group.momentum[name][0].dtype)
            dtypes.update({key: "F32" for key in group.moments})
            scalars = {"step": step} if step is not None and group.moments else {}
            entries.append(ParamEntry(name, shape, -1, group.index, dtypes, scalars))
    return Manifest(
        CONSOLIDATED, {"dp": 1, "tp": 1}, tuple(entries_of), tuple(entries), (), (),
        recorded_step=recorded, zero_stage=stage,
    )  # fmt: skip


def _tensors(groups: Sequence[_Group], reads: Iterable[tuple[str, str]]) -> Iterator[Any]:
    """Each tensor of ``reads``, a tensor of its own, cut from the joined groups when the
    writer pulls it (a momentum handed over, not copied)."""
    where = {name: (group, i) for group in groups for i, name in enumerate(group.names)}
    for name, key in reads:
        group, index = where[name]
        if key == MUON_KEY:
            yield group.momentum.pop(name)[0]
            continue
        flat = group.master if key == PARAM_KEY else group.moments[key]
        at, numel = group.layout.offsets[index], group.layout.numels[index]
        yield flat[at : at + numel].clone().reshape(group.shapes[index])


_MODEL_KEYS_USED = {
    "module", "param_shapes", "shared_params", "global_steps", "dp_world_size",
    "mp_world_size", "ds_version", "ds_config", "buffer_names", "optimizer",
    "frozen_param_shapes", "frozen_param_fragments", "skipped_steps", "global_samples",
    "parallel_dims", "checkpoint_parallel_dimensions",
}  # fmt: skip


def _left_out(
    model: dict[str, Any], params: set[str], aliases: Mapping[str, str], carried: frozenset[str]
) -> list[str]:
    """What of the model states the output does not hold: buffers and frozen params, client
    state, and of the job's own state what is not ``carried``."""
    module = model.get("module")
    names = list(module) if isinstance(module, dict) else []
    left = [
        f"{n} (a model tensor no optimizer holds)" for n in names if n not in params | set(aliases)
    ]
    left += [
        f"{key} (client or engine state)"
        for key in model
        if key not in _MODEL_KEYS_USED | carried and model[key] is not None
    ]
    return left


def from_deepspeed(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    source: str = SOURCE,
    to: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Conversion:
    """Convert the DeepSpeed ZeRO-1/2/3 checkpoint ``src`` (the directory holding ``latest``,
    or one tag directory such as ``global_step300``) into a consolidated muonckpt checkpoint
    at ``dst`` for the muonckpt family ``to`` (None: DeepSpeed's own form, recorded as
    ``deepspeed.MuonWithAuxAdam``).

    The ZeRO stage is what rank 0's optimizer file records; it is kept in the manifest
    (``zero_stage``), which :func:`to_deepspeed` writes back. Every rank file is checked
    against the layout ``param_shapes`` gives at the number of rank files: its stage,
    ``partition_count``, each fp32 slice's length and padding, ``param_slice_mappings``, each
    Muon momentum buffer's length, and the copies of each matrix's momentum must agree (at
    ZeRO-3: each sub-group's flat partitions and states against its params' own partitions);
    a refusal is one line naming the file. Tied names (``shared_params``) are kept as the
    model's aliases; the LR scheduler's state and the engine's counters go into the output's
    ``extra`` (:mod:`.job_state`).

    Memory: the whole optimizer state once, plus one rank file and one tensor.
    """
    if source != SOURCE:
        raise CheckpointError(f"a DeepSpeed checkpoint is read as {SOURCE!r}, not {source!r}")
    if to is not None and to not in kinds.FAMILIES:
        raise CheckpointError(f"cannot convert to {to!r}: choose one of {sorted(kinds.FAMILIES)}")
    directory = deepspeed_files.tag_directory(src)
    files = deepspeed_files.rank_files(directory)
    first = deepspeed_files.load(files[0])
    optim = _get(first, "optimizer_state_dict", dict, files[0], "the file")
    stage = _stage(optim, files[0])
    model_path = deepspeed_files.model_states(directory, stage)
    model = deepspeed_files.load(model_path)
    shapes = _param_shapes(model, model_path)  # (a mapping, or refused)
    _check_unparallel(model, model_path)
    params = {n for group in shapes for n in group}
    aliases = _aliases(model.get("shared_params"), params, model_path)
    recorded = model.get("global_steps")
    recorded = recorded if type(recorded) is int else None  # (a negative one refused below)
    step = recorded if recorded is not None and recorded >= 0 else None
    found = job_state.read(model, step)
    left = [*_left_out(model, params, aliases, found.items), *found.left]
    del model  # the module's weights: the masters are the values
    _check_declared(shapes, files, model_path)
    groups: list[_Group] = []
    for rank, path in enumerate(files):
        top = first if rank == 0 else deepspeed_files.load(path)
        if stage == ZeroStage.weights:
            _read_rank_z3(rank, len(files), path, top, shapes, groups)
        else:
            _read_rank(rank, len(files), path, top, shapes, groups, stage)
        del top
    first = None
    for group in groups:
        _momentum_of_flat(group)
    manifest = _manifest(groups, recorded, files[0], stage)
    if aliases:
        manifest = _with_aliases(manifest, aliases)
    target, scales = converted_manifest(manifest, to, path=directory)
    planned = consolidated(target, aliases=aliases)
    path = write_consolidated(
        planned,
        scales,
        _tensors(groups, planned.reads),
        dst,
        overwrite=overwrite,
        progress=progress,
        source=Path(src),  # the root a latest names the tag of: no output inside it either
        trainer=found.state,
        step=step,
    )
    layout = f"ZeRO-{stage}, world {len(files)}"
    return Conversion(path, layout, tuple(left), conversion_notes(manifest, target))


def _aliases(shared: Any, params: set[str], path: Path) -> dict[str, str]:
    """``shared_params`` (alias -> the param holding the data) as the model's aliases."""
    if shared is None:
        return {}
    if not isinstance(shared, dict) or not all(
        isinstance(k, str) and v in params and k not in params for k, v in shared.items()
    ):
        raise _fail("shared_params does not map other names to the optimizer's params", path)
    return dict(shared)


def _with_aliases(manifest: Manifest, aliases: Mapping[str, str]) -> Manifest:
    from dataclasses import replace

    return replace(manifest, model=ModelFile((), (), dict(aliases)))
