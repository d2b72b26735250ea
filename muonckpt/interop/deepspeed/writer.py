"""DeepSpeed ZeRO-1/2/3 output: any muonckpt checkpoint as DeepSpeed's own files for
``world`` ranks (:func:`to_deepspeed`, the writer of :mod:`muonckpt.interop.deepspeed.reader`'s
format).

DeepSpeed loads them at that world size as if it had saved them there
(``engine.load_checkpoint`` takes rank ``r``'s own file): ``latest``; at ZeRO-1/2
``<tag>/mp_rank_00_model_states.pt``, the module's weights by name (tied names included),
``param_shapes`` and ``dp_world_size``, and per rank
``<tag>/zero_pp_rank_{r}_mp_rank_00_optim_states.pt``, its fp32 master slice of each group,
the aux Adam's moment slices and step, and for a Muon group the whole EMA momentum of each
matrix the slice overlaps, laid out by :func:`muonckpt.interop.deepspeed.partitions.group_layout`.
At ZeRO-3 each rank has a model states file of its own (the module's tensors empty, as
DeepSpeed saves them) and its optimizer file holds each param's own partition of the masters,
the Adam moments and the Muon momentum alike (:func:`~.partitions.zero3_layout`), one
sub-group per group, and the loss scaler DeepSpeed's ZeRO-3 load assigns. Written: plain
tensors, dicts, lists, numbers and strings (``torch.save``) and that one stand-in; never
``param_slice_mappings`` (DeepSpeed's load does not read them).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import settings, storage
from ...errors import ArgumentError, CheckpointError, OptionError
from ...files.progress import Counted, Meter, Progress
from ...format import kinds
from ...format.manifest import Manifest
from ...format.names import PARAM_KEY
from ...storage import make_directory
from .._foreign_out import check_split, not_carried, open_local, read_whole, staged_output
from .._trainer_state import carried
from ..foreign import Conversion
from . import files as deepspeed_files
from . import job_state
from .files import ZeroStage
from .partitions import GroupLayout, Zero3Layout, group_layout, zero3_layout

OPTIMIZER = kinds.DEEPSPEED
"""How a checkpoint names the optimizer of DeepSpeed's groups."""
SOURCE = "deepspeed"
"""The implementation's name (``convert --from`` / ``--to``)."""
MUON_KEY = kinds.MUON_STATE_KEYS[0]
ADAM_KEYS = kinds.ADAMW_STATE_KEYS
DS_VERSION = "0.19.8"
"""The DeepSpeed version the written files say wrote them (its loader asserts one is there)."""


@dataclass
class _OutGroup:
    """One DeepSpeed group to write: its params in DeepSpeed's order, its settings, and how
    the source's state becomes DeepSpeed's."""

    names: list[str]
    settings: dict[str, Any]
    muon: bool
    factor: float
    """What the source's momentum is multiplied by (its form to EMA)."""
    step_in: str


def _out_settings(kind: kinds.GroupKind, hyper: Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed group's settings from another optimizer's: the ones DeepSpeed's Muon and
    Adam halves take (``_muon_param_groups``), by their names there."""
    out: dict[str, Any] = {"lr": hyper.get("lr"), "weight_decay": hyper.get("weight_decay", 0.0)}
    if kind.role == "muon":
        out.update(momentum=kind.momentum, ns_method="gram", use_muon=True, name="muon-params")
    else:
        betas = hyper.get("betas", hyper.get("adamw_betas", (0.9, 0.95)))
        eps = hyper.get("eps", hyper.get("adamw_eps", 1e-10))
        out.update(betas=list(betas), eps=eps, use_muon=False, name="adam-params")
    return {k: v for k, v in out.items() if v is not None}


def _out_groups(manifest: Manifest, directory: Path) -> tuple[list[_OutGroup], list[str]]:
    """DeepSpeed's groups for ``manifest``'s, with the momentum conversions made. A checkpoint
    DeepSpeed wrote keeps its groups, order and settings; any other becomes DeepSpeed's own
    grouping of one incoming group: the Muon groups first, their params largest shape first
    (``MuonWithAuxAdam`` sorts them so), then the Adam groups, in the checkpoint's order."""
    from ...format.conversion import group_kind

    out, notes = [], []
    own = all(
        kinds.GroupKind.from_json(g.optimizer).optimizer == OPTIMIZER
        and not g.optimizer.get("converted_from")
        for g in manifest.groups
    )
    for g, group in enumerate(manifest.groups):
        kind = group_kind(group, g, directory)
        if kind.role is None:
            raise CheckpointError(
                f"group {g}: {kind.optimizer} is not an optimizer muonckpt converts", path=directory
            )
        if kind.role == "muon":
            ds_kind = kinds.GroupKind(
                OPTIMIZER, "muon", kinds.EMA, kind.momentum, True, kinds.ASPECT
            )
        else:
            ds_kind = kinds.GroupKind(
                OPTIMIZER, "adamw", step_in="int" if kind.step_in == "int" else "tensor"
            )
        mapping = kinds.state_mapping(kind, ds_kind, f"group {g}", None)
        if mapping.note:
            notes.append(f"{len(group.params)} Muon params: {mapping.note}")
        notes += [f"group {g}: {note}" for note in kinds.trajectory_notes(kind, ds_kind)]
        unsaved = [n for n in group.params if manifest.param(n).value_dtype is None]
        if unsaved:
            raise CheckpointError(
                f"param {unsaved[0]!r} has no saved values: DeepSpeed's files need every "
                "param's master weights",
                path=directory,
            )
        factor = mapping.keys.get(MUON_KEY, ("", 1.0))[1]
        names = list(group.params)
        settings = dict(group.hyperparams) if own else _out_settings(kind, group.hyperparams)
        settings.pop("step", None)
        if kind.role == "muon" and not own:
            names.sort(key=lambda n: manifest.param(n).shape, reverse=True)
        out.append(_OutGroup(names, settings, kind.role == "muon", factor, ds_kind.step_in or ""))
    if not own:
        placed = [(name, group.muon) for group in out for name in group.names]
        check_split(manifest, placed, uses_muon, SPLIT_RULE, directory)
        out.sort(key=lambda group: not group.muon)
    return out, notes


SPLIT_RULE = (
    "DeepSpeed's Muon job puts every 2-D param whose name holds neither 'embed' nor 'lm_head' "
    "in Muon and every other in its Adam"
)


def uses_muon(name: str, shape: tuple[int, ...]) -> bool:
    """Whether DeepSpeed's Muon job puts param ``name`` of ``shape`` in Muon: DeepSpeed
    0.19.8 tags a param ``use_muon`` when it is 2-D and its name holds neither ``embed`` nor
    ``lm_head`` (``deepspeed/__init__.py`` ``set_optimizer_flags``); every other goes to its
    Adam."""
    return len(shape) == 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def _tensor_bytes(manifest: Manifest, group: _OutGroup) -> list[int]:
    """The bytes of each tensor of ``group`` a write reads: each param's values and state."""
    out = []
    for name in group.names:
        entry = manifest.param(name)
        for key in entry.tensor_keys:
            out.append(math.prod(entry.shape_of(key)) * storage.itemsize(entry.dtype_of(key)))
    return out


@dataclass
class _OutValues:
    """A group's state, whole and flat, padded to ``world`` slices."""

    layout: GroupLayout
    master: Any
    moments: dict[str, Any]
    momentum: dict[str, Any]
    step: int | None


def _out_values(reader: Any, manifest: Manifest, group: _OutGroup, world: int) -> _OutValues:
    """Read a group's params and state from the muonckpt checkpoint, as DeepSpeed lays them."""
    import torch

    from ... import storage

    entries = [manifest.param(n) for n in group.names]
    layout = group_layout([e.numel for e in entries], world)
    pieces = manifest.pieces_of()
    flat_numel = layout.world * layout.partition

    def read(name: str, key: str) -> Any:
        return read_whole(reader, pieces, manifest.param(name), key).reshape(-1)

    master = torch.zeros(flat_numel, dtype=torch.float32)
    keys = {k for e in entries for k in e.state_keys}
    moments = {k: torch.zeros(flat_numel, dtype=torch.float32) for k in ADAM_KEYS if k in keys}
    momentum: dict[str, Any] = {}
    held = [e.dtype_of(MUON_KEY) for e in entries if MUON_KEY in e.state_keys]
    for index, entry in enumerate(entries):
        at = slice(layout.offsets[index], layout.offsets[index] + entry.numel)
        master[at] = read(entry.name, PARAM_KEY)
        for key, flat in moments.items():
            if key in entry.state_keys:
                flat[at] = read(entry.name, key)
        if group.muon and held:  # a matrix without momentum (no grad yet) gets zeros
            value = (
                read(entry.name, MUON_KEY)
                if MUON_KEY in entry.state_keys
                else torch.zeros(entry.numel, dtype=storage.torch_dtype(held[0]))
            )
            momentum[entry.name] = value.mul_(group.factor) if group.factor != 1.0 else value
    return _OutValues(layout, master, moments, momentum, manifest.latest_step(group.names))


def _step_value(step: int | None, step_in: str) -> Any:
    """An Adam step count as DeepSpeed's aux Adam keeps it: a float32 0-d tensor (torch's
    AdamW) or an int (FusedAdam, the inline Adam)."""
    import torch

    if step is None:
        return None
    return torch.tensor(float(step), dtype=torch.float32) if step_in == "tensor" else int(step)


def _rank_file(
    rank: int, groups: list[_OutGroup], values: list[_OutValues], stage: int, world: int
) -> dict[str, Any]:
    """Rank ``rank``'s optimizer file, as ``DeepSpeedZeroOptimizer.state_dict`` makes it
    (rigid, not elastic), from plain values only."""
    import torch

    masters, paddings, states, param_groups = [], [], {}, []
    for g, (group, value) in enumerate(zip(groups, values, strict=True)):
        layout, at = value.layout, rank * value.layout.partition
        masters.append(value.master[at : at + layout.kept(rank)].clone())
        paddings.append(layout.group_padding(rank))
        state: dict[str, Any] = {}
        if value.momentum:
            parts = [value.momentum[group.names[i]] for i in layout.overlapping(rank)]
            state[MUON_KEY] = torch.cat(parts) if parts else torch.zeros(0)
        for key, flat in value.moments.items():
            state[key] = flat[at : at + layout.partition].clone()
        step = _step_value(value.step, group.step_in)
        if value.moments and step is not None:
            state["step"] = step
        states[g] = state
        param_groups.append({**group.settings, "params": [g]})
    if not any(states.values()):  # before the first step: no state at all, as DeepSpeed saves
        states = {}
    optimizer = {
        "dynamic_loss_scale": False,
        "overflow": False,
        "base_optimizer_state": {"state": states, "param_groups": param_groups},
        "single_partition_of_fp32_groups": masters,
        "zero_stage": stage,
        "group_paddings": paddings,
        "param_alignment_paddings": [[0] * len(group.names) for group in groups],
        "partition_count": [world] * len(groups),
        "ds_version": DS_VERSION,
    }
    return {"optimizer_state_dict": optimizer, "ds_version": DS_VERSION}


def _z3_flat(whole: Any, offsets: Sequence[int], layout: Zero3Layout, rank: int) -> Any:
    """Rank ``rank``'s ZeRO-3 flat partition of a group's state ``whole`` (its params one
    after the other from ``offsets``): each param's partition, zero-padded."""
    import torch

    parts = []
    for index, at in enumerate(offsets):
        begin, held = at + rank * layout.partition(index), layout.held(index, rank)
        part = torch.zeros(layout.partition(index), dtype=whole.dtype)
        part[:held] = whole[begin : begin + held]
        parts.append(part)
    return torch.cat(parts)


def _rank_file_z3(
    rank: int, groups: list[_OutGroup], values: list[_OutValues], world: int
) -> dict[str, Any]:
    """Rank ``rank``'s ZeRO-3 optimizer file, as ``DeepSpeedZeroOptimizer_Stage3.state_dict``
    makes it: one sub-group per group, each param's partition of every flat state (the
    values whole in ``values``: a world-1 layout)."""
    import torch

    masters, states, param_groups = [], {}, []
    for g, (group, value) in enumerate(zip(groups, values, strict=True)):
        layout = zero3_layout(value.layout.numels, world)
        offsets = value.layout.offsets
        masters.append(_z3_flat(value.master, offsets, layout, rank))
        state = {
            key: _z3_flat(whole, offsets, layout, rank) for key, whole in value.moments.items()
        }
        if value.momentum:
            whole = torch.cat([value.momentum[name].reshape(-1) for name in group.names])
            state[MUON_KEY] = _z3_flat(whole, offsets, layout, rank)
        step = _step_value(value.step, group.step_in)
        if value.moments and step is not None:
            state["step"] = step
        states[g] = state
        param_groups.append({**group.settings, "params": [g]})
    if not any(states.values()):
        states = {}
    optimizer = {
        "zero_stage": int(ZeroStage.weights),
        "loss_scaler": deepspeed_files.loss_scaler(),
        "dynamic_loss_scale": False,
        "overflow": False,
        "partition_count": world,
        "optimizer_state_dict": {"state": states, "param_groups": param_groups},
        "fp32_flat_groups": masters,
    }
    return {"optimizer_state_dict": optimizer, "ds_version": DS_VERSION}


def _model_file(
    groups: list[_OutGroup],
    values: list[_OutValues],
    manifest: Manifest,
    step: int,
    world: int,
    stage: int,
    job: Mapping[str, Any],
) -> dict[str, Any]:
    """The model states file: the module's weights by name (the fp32 masters; tied names
    beside the stored one; at ZeRO-3 every one empty, as DeepSpeed saves its partitioned
    params), ``param_shapes`` in DeepSpeed's order, the counters, and ``job``, the job's own
    state a conversion from DeepSpeed carried (its LR scheduler and counters, over these)."""
    import collections

    import torch

    module: dict[str, Any] = collections.OrderedDict()
    shapes: list[dict[str, Any]] = []
    for group, value in zip(groups, values, strict=True):
        shapes.append(collections.OrderedDict())
        for index, name in enumerate(group.names):
            entry = manifest.param(name)
            at = value.layout.offsets[index]
            module[name] = value.master[at : at + entry.numel].clone().reshape(entry.shape)
            if stage == ZeroStage.weights:
                module[name] = torch.empty(0, dtype=torch.float32)
            shapes[-1][name] = torch.Size(entry.shape)
    aliases = dict(manifest.model.aliases) if manifest.model is not None else {}
    for alias, stored in aliases.items():
        module[alias] = module[stored]
    return {
        "module": module,
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": shapes,
        "frozen_param_shapes": None,
        "shared_params": aliases,
        "frozen_param_fragments": None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": step,
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_version": DS_VERSION,
        **job,
    }


WORLD = "the number of ranks DeepSpeed loads the output at"
"""What :func:`to_deepspeed`'s ``world`` (``convert --world``) is."""


def to_deepspeed(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str = SOURCE,
    world: int | None = None,
    zero_stage: int | None = None,
    allow_large_world: bool = False,
    progress: Progress | None = None,
) -> Conversion:
    """Write the muonckpt checkpoint ``src`` (any kind, any topology) as DeepSpeed ZeRO files
    for ``world`` ranks at the new directory ``dst`` (``latest`` and ``global_step<N>``, N the
    checkpoint's step), which ``engine.load_checkpoint(dst)`` of a Muon job at ``world`` ranks
    loads: the fp32 masters, the aux Adam's moments and step, and the Muon momentum in EMA
    form (sum-form momentum converted by ``1 - mu``).

    A checkpoint read from DeepSpeed keeps its groups, their order and settings; any other is
    grouped as DeepSpeed groups one incoming param group (Muon params largest first, then the
    Adam params), so the job must build its optimizer from one group, and must split its
    params between Muon and Adam as DeepSpeed does (:func:`uses_muon`): one that does not is
    refused before anything is written, naming the params that would change optimizer.
    ``zero_stage``: the ZeRO stage (1, 2 or 3) the job runs at; None: the one the checkpoint
    recorded when it was read from DeepSpeed (its manifest's ``zero_stage``), else 2. Stages
    1 and 2 share one layout (the files say which); ZeRO-3's is its own, one sub-group per
    group (DeepSpeed's default ``sub_group_size``). The model's other tensors (buffers) are
    not in a muonckpt checkpoint's optimizer state and are not written. More than
    :data:`muonckpt.settings.MAX_WORLD` ranks need ``allow_large_world``.

    ``progress`` is told the bytes and tensors read, a group at a time (the last once the
    files are written).

    Memory: the whole optimizer state once, plus one rank's file.
    """
    from ...files.pieces import PieceReader

    if to != SOURCE:
        raise OptionError(f"DeepSpeed output is for {SOURCE!r}, not {to!r}", "--to")
    if type(world) is not int or world < 1:
        raise ArgumentError(
            f"world must be {WORLD}, a positive int, not {world!r}", argument="world"
        )
    settings.world_size(world, "--world", "one rank file", allow_large=allow_large_world)
    if zero_stage is not None and zero_stage not in STAGES:
        raise OptionError(
            f"ZeRO stage {zero_stage!r}: DeepSpeed's Muon runs at stages 1, 2 and 3",
            "--zero-stage",
        )
    directory, files, manifest = open_local(src)
    stage = zero_stage or manifest.zero_stage or DEFAULT_STAGE
    zero3 = stage == ZeroStage.weights
    groups, notes = _out_groups(manifest, directory)
    sizes = [_tensor_bytes(manifest, group) for group in groups]
    with staged_output(dst, directory, SOURCE) as (_, staging):  # refused before any read
        meter = Meter(Counted(sum(map(sum, sizes)), sum(map(len, sizes))), progress)
        values: list[_OutValues] = []
        last: list[int] = []  # the last tensor counted once the files are written
        with PieceReader(files, manifest) as reader:
            for group, read in zip(groups, sizes, strict=True):
                values.append(_out_values(reader, manifest, group, 1 if zero3 else world))
                for nbytes in [*last, *read][:-1]:
                    meter.tick(nbytes)
                last = [*last, *read][-1:]
        step = manifest.recorded_step or max((v.step or 0 for v in values), default=0)
        tag = f"global_step{step}"
        tag_dir = make_directory(staging / tag)
        for rank in range(world):
            deepspeed_files.save(
                tag_dir / deepspeed_files.rank_file(rank),
                _rank_file_z3(rank, groups, values, world)
                if zero3
                else _rank_file(rank, groups, values, stage, world),
            )
        trainer = carried(files, manifest, job_state.NAME)
        model = _model_file(groups, values, manifest, step, world, stage, job_state.values(trainer))
        for rank, name in enumerate(_model_file_names(world, zero3)):
            # (ZeRO-3 records the tied names in rank 0's file alone, as DeepSpeed does)
            deepspeed_files.save(tag_dir / name, {**model, "shared_params": {}} if rank else model)
        for nbytes in last:
            meter.tick(nbytes)
        deepspeed_files.finish(staging, tag)
    left = [
        "param_slice_mappings (DeepSpeed's load does not read them)"
        if zero3
        else "param_slice_mappings and the loss scaler (DeepSpeed's load reads neither)"
    ]
    left += not_carried(manifest, trainer)
    layout = f"ZeRO-{stage}, world {world}"
    return Conversion(Path(dst), layout, tuple(left), tuple(notes))


STAGES = (1, 2, 3)
"""The ZeRO stages :func:`to_deepspeed` writes."""
DEFAULT_STAGE = 2
"""The stage written for a checkpoint that records none (not read from DeepSpeed)."""


def _model_file_names(world: int, zero3: bool) -> list[str]:
    """The model states files of a save: one per rank at ZeRO-3, else the one."""
    if zero3:
        return [deepspeed_files.rank_model_file(rank) for rank in range(world)]
    return [deepspeed_files.MODEL_STATES]
