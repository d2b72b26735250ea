"""Megatron-Core's torch_dist checkpoints of its layer-wise Muon in:
``LayerWiseDistributedOptimizer`` over emerging-optimizers' Muon (``TensorParallelMuon``) and
AdamW, saved at any TP and DP.

A torch_dist checkpoint is a DCP one (``.metadata``, ``__R_0.distcp``) with a ``metadata.json``
(``sharded_backend: torch_dist``), found as ``ROOT/iter_NNNNNNN`` through
``ROOT/latest_checkpointed_iteration.txt`` or given as that directory. Its tensors are global:
TP chunks are joined by the DCP index, and the decoder layers are stacked on a leading axis
(``decoder.layers.self_attention.linear_qkv.weight`` of shape (L, out, in)); :func:`from_megatron`
splits them into one param per layer under Megatron's own names
(``decoder.layers.0.self_attention.linear_qkv.weight``), each tensor in Megatron's layout (the
interleaved QKV as it is). The optimizer's tensors are ``[chained_N.]optimizer.state.KEY.FQN``
(``fp32_param``, Muon's ``momentum_buffer``, AdamW's ``exp_avg`` / ``exp_avg_sq``; the
``chained_N.`` prefix in the default ``dp_reshardable`` format, none in ``fully_reshardable``);
its param groups and AdamW's step are in the ``common_state`` item with the training ``args``,
read through ``torch.load(weights_only=True)`` with the torch format's stand-ins
(:data:`.files.STAND_INS`: ``argparse.Namespace``, Megatron's enums, ``signal.Signals``, numpy's
arrays); any other global is refused, naming the item, the file and the global.
The fp32 master params become the output's params; the bf16 model weights are left out.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ... import storage
from ...errors import CheckpointError, StateDictError
from ...files.progress import Progress
from ...format import kinds
from ...format.conversion import converted_manifest
from ...format.manifest import Manifest, ParamEntry, Scalar
from ...format.names import PARAM_KEY
from ...format.stacked import matrices
from ...storage import access
from ...storage.foreign_limits import read_json
from .._consolidated import consolidated, conversion_notes, summarized, write_consolidated
from .._fields import count
from .._trainer_state import TrainerState
from ..dcp import files as dcp_files
from ..dcp import metadata as dcp_metadata
from ..foreign import Conversion
from . import files as megatron_files
from .files import LATEST, Namespace
from .groups import MUON, Group, assumed, group_of, kind, manifest_of, role_of
from .job_state import RNG_ITEM, iteration_of, job_state
from .writer import DIST_METADATA, STACKED, STATE_KEYS, to_megatron

__all__ = [
    "MUON",
    "from_megatron",
    "is_megatron",
    "iteration_dir",
    "to_megatron",
]

WANTED = {
    "muon": {"fp32_param", "momentum_buffer"},
    "adamw": {"fp32_param", "exp_avg", "exp_avg_sq"},
}
"""The state keys Megatron saves for a param of each role (only ``fp32_param`` before a step)."""
_OPTIMIZER_ITEM = re.compile(r"(?:chained_(\d+)\.)?optimizer\.state\.([a-z0-9_]+)\.(.+)")
COMMON = "common_state"


ADMITTED = tuple((cls, name) for name, cls in megatron_files.STAND_INS.items())
"""The stand-ins ``common_state`` and ``rng_state`` are read with: those of the torch format's
files (``megatron.training``'s full ``args`` hold its enums and ``signal.Signals``; the RNG
states numpy's arrays)."""


def iteration_dir(path: str | os.PathLike[str]) -> Path:
    """The ``iter_N`` directory ``path`` names: itself, or the one its
    ``latest_checkpointed_iteration.txt`` names (refused naming the file where it is missing,
    not a regular file, or not ASCII digits: ``str.isdigit`` takes '²', which ``int`` refuses)."""
    root = Path(path)
    if not access.exists(root / LATEST):
        return root
    text = storage.read_text(root / LATEST, limit=64).strip()
    if text == "release":
        iteration = root / "release"
    elif text.isascii() and text.isdigit():
        iteration = root / f"iter_{int(text):07d}"
    else:
        raise CheckpointError(f"names iteration {text!r}, not a number", path=root / LATEST)
    if not access.is_dir(iteration):
        raise CheckpointError(
            f"names iteration {text}, but {iteration.name} is not a directory", path=root / LATEST
        )
    return iteration


def is_megatron(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a Megatron checkpoint root (``latest_checkpointed_iteration.txt``), a
    torch_dist ``iter_N`` directory (``metadata.json`` beside DCP's ``.metadata``) or a torch
    one (``mp_rank_XX/model_optim_rng.pt``): files' presence only (a FIFO in a file's place
    too, which the reader then refuses as not a regular file)."""
    root = Path(path)
    if access.exists(root / LATEST):
        return True
    if megatron_files.is_torch_format(root):
        return True
    return access.exists(root / DIST_METADATA) and dcp_metadata.is_dcp(root)


def _check_backend(directory: Path) -> None:
    """Refuse what is not torch_dist (the ``torch`` format's ``mp_rank_XX`` files, say)."""
    where = directory / DIST_METADATA
    if not access.exists(where):
        found = access.list_names(directory)[:4] if access.is_dir(directory) else []
        raise CheckpointError(
            f"no {DIST_METADATA}: not a torch_dist checkpoint (muonckpt reads Megatron's "
            f"torch_dist format; found {found})",
            path=directory,
        )
    body = read_json(where, limit=1 << 16)
    if not isinstance(body, dict):
        raise CheckpointError("not a JSON object", path=where)
    backend = body.get("sharded_backend")
    if backend != "torch_dist":
        raise CheckpointError(
            f"sharded_backend is {backend!r}: muonckpt reads torch_dist only", path=where
        )


def from_megatron(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    source: str = "megatron",
    to: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Conversion:
    """Convert the Megatron-Core torch_dist checkpoint ``src`` (its root or an ``iter_N``) into
    a consolidated muonckpt checkpoint at ``dst``, per layer, with the fp32 master params,
    Muon's momentum (EMA form, recorded so; converted for ``to``, a muonckpt family, or kept
    as Megatron's when None), AdamW's state and step and the groups' settings.

    Memory: one layer's tensor and one chunk of it at a time.
    """
    if source != "megatron":
        raise StateDictError(f"source {source!r}: a Megatron checkpoint is read as 'megatron'")
    if to is not None and to not in kinds.FAMILIES:
        raise StateDictError(f"cannot convert to {to!r}: choose one of {sorted(kinds.FAMILIES)}")
    directory = iteration_dir(src)
    if megatron_files.is_torch_format(directory):
        from .torch_format import from_torch_format

        return from_torch_format(
            directory, dst, to=to, overwrite=overwrite, progress=progress, root=Path(src)
        )
    _check_backend(directory)
    index = dcp_metadata.read_index(directory)
    where = index.directory / dcp_metadata.METADATA_NAME
    common = _common_state(index, where)
    _check_parallelism(common.get("args"), where)
    trainer, trainer_left, rng_fqns = _trainer_state(index, common, where)
    items, layout = _optimizer_items(index, where)
    groups = _groups(common, where)
    manifest, fqn_of = _manifest(index, items, groups, common, where)
    target, scales = converted_manifest(manifest, to, path=where)
    planned = consolidated(target)
    tensors = (
        dcp_files.read_tensor(index, index.tensors[fqn], layer)
        for fqn, layer in (fqn_of[r] for r in planned.reads)
    )
    path = write_consolidated(
        planned, scales, tensors, dst, overwrite=overwrite, progress=progress,
        source=Path(src), trainer=trainer, step=iteration_of(common),
    )  # (the root: an output inside it is refused, as inside the iteration)  # fmt: skip
    used = {fqn for fqn, _ in fqn_of.values()} | {_common_fqn(index, where)} | rng_fqns
    left = sorted((set(index.tensors) | set(index.values)) - used)
    notes = conversion_notes(manifest, target) + assumed(common.get("args"))
    return Conversion(path, layout, (*summarized(left), *trainer_left), notes)


def _trainer_state(
    index: dcp_metadata.DcpIndex, common: Mapping[str, Any], where: Path
) -> tuple[TrainerState, list[str], set[str]]:
    """The job's own state (:func:`.job_state.job_state`): ``common``'s and every
    ``rng_state/shard_{pp}.{tp}_{PP}.{TP}`` item's (read as ``common_state`` is), what of it
    is left out, and the RNG items' fqns."""
    found = {fqn: m for fqn in index.values if (m := RNG_ITEM.fullmatch(fqn))}
    sizes = {(int(m[3]), int(m[4])) for m in found.values()}
    rng = {}
    if len(sizes) == 1:
        for fqn, m in found.items():
            value = dcp_files.read_value(index, index.values[fqn], ADMITTED)
            rng[int(m[1]), int(m[2])] = value[0] if isinstance(value, list) and value else value
    state, left = job_state(common, rng, sizes.pop() if len(sizes) == 1 else (1, 1))
    if len(sizes) > 1:
        left.append(f"rng_state (items of PP, TP sizes {sorted(sizes)}, not one): {where}")
    return state, left, set(found)


UNREAD = {
    "pipeline_model_parallel_size": "pipeline-parallel (PP)",
    "virtual_pipeline_model_parallel_size": "interleaved pipeline (VPP)",
    "expert_model_parallel_size": "expert-parallel (EP)",
}
"""The parallel sizes of the training ``args`` whose layouts of the layer-wise optimizer muonckpt
does not read (no checkpoint of them was run): refused where above 1."""


def _check_parallelism(args: Any, where: Path) -> None:
    """Refuse, in one line naming the size, a checkpoint whose training args record a
    pipeline- or expert-parallel layout (muonckpt reads TP x DP ones)."""
    recorded = vars(args) if isinstance(args, Namespace) else {}
    for key, what in UNREAD.items():
        size = recorded.get(key)
        if type(size) is int and size > 1:
            raise CheckpointError(
                f"{COMMON}: the training args say {key} {size}: the layer-wise optimizer's "
                f"{what} layout, which muonckpt does not read (it reads and writes TP x DP)",
                path=where,
            )


def _common_fqn(index: dcp_metadata.DcpIndex, where: Path) -> str:
    found = [fqn for fqn in index.values if fqn.split("/", 1)[0] == COMMON]
    if len(found) != 1:
        raise CheckpointError(
            f"holds {len(found)} {COMMON} items, not one: not a Megatron torch_dist checkpoint",
            path=where,
        )
    return found[0]


def _common_state(index: dcp_metadata.DcpIndex, where: Path) -> dict[str, Any]:
    """The checkpoint's common state (param groups, AdamW's step, ``args``), checked to be a
    mapping with an ``optimizer``."""
    fqn = _common_fqn(index, where)
    value = dcp_files.read_value(index, index.values[fqn], ADMITTED)
    if isinstance(value, list) and len(value) == 1:
        value = value[0]  # as dist_checkpointing saves it: one object per shard
    if not isinstance(value, dict) or not isinstance(value.get("optimizer"), dict):
        raise CheckpointError(f"DCP item {fqn!r} holds no optimizer state", path=where)
    return value


def _optimizer_items(
    index: dcp_metadata.DcpIndex, where: Path
) -> tuple[dict[str, dict[str, str]], str]:
    """model key -> Megatron's state key -> the item's fqn, and the sharding format."""
    items: dict[str, dict[str, str]] = {}
    prefixed = set()
    for fqn in index.tensors:
        if "optimizer." not in fqn:
            continue
        match = _OPTIMIZER_ITEM.fullmatch(fqn)
        if match is None or match[2] not in STATE_KEYS:
            raise CheckpointError(
                f"DCP item {fqn!r} is not [chained_N.]optimizer.state.KEY.PARAM with KEY one "
                f"of {sorted(STATE_KEYS)}",
                path=where,
            )
        if match[3] not in index.tensors:
            raise CheckpointError(f"DCP item {fqn!r}: no model tensor {match[3]!r}", path=where)
        if index.tensors[fqn].shape != index.tensors[match[3]].shape:
            raise CheckpointError(
                f"DCP item {fqn!r} has shape {list(index.tensors[fqn].shape)}, its model "
                f"tensor {list(index.tensors[match[3]].shape)}",
                path=where,
            )
        prefixed.add(match[1] is not None)
        items.setdefault(match[3], {})[match[2]] = fqn
    if not items or len(prefixed) != 1:
        shown = "no optimizer state" if not items else "chained prefixes on some items only"
        raise CheckpointError(f"holds {shown}: not a Megatron optimizer checkpoint", path=where)
    return items, "dp_reshardable" if prefixed == {True} else "fully_reshardable"


def _groups(common: Mapping[str, Any], where: Path) -> list[Group]:
    """Every param group of the chained optimizers, Muon's (a ``momentum`` setting) or
    AdamW's (``betas``), with its chained optimizer's common step."""
    optimizer = common["optimizer"]
    chained = {0: optimizer} if "optimizer" in optimizer else optimizer
    out = []
    for c in sorted(chained):
        inner = chained[c].get("optimizer") if isinstance(chained[c], dict) else None
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise CheckpointError(
                f"{COMMON}: chained optimizer {c} has no param_groups", path=where
            )
        step = inner.get("state", {}).get("common_step") if isinstance(inner, dict) else None
        for g, group in enumerate(groups):
            role = role_of(group)
            if role is None:
                raise CheckpointError(
                    f"{COMMON}: group {g} of chained optimizer {c} is neither Muon's "
                    "(momentum) nor AdamW's (betas)",
                    path=where,
                )
            settings = {k: v for k, v in group.items() if k != "params"}
            out.append(
                group_of(role, settings, where, count(step, where, f"{COMMON}: common_step"))
            )
    return out


def _group_of(
    groups: list[Group], role: str, name: str, shape: tuple[int, ...], where: Path
) -> int:
    """The group of a param: its role's only group, or, where AdamW's (or Muon's) groups
    differ by ``wd_mult``, Megatron's default rule: no weight decay for 1-D params and biases
    (``megatron/core/optimizer/__init__.py``, ``wd_mult=0.0``)."""
    mine = [i for i, g in enumerate(groups) if g.role == role]
    if len(mine) == 1:
        return mine[0]
    no_decay = len(shape) == 1 or name.endswith(".bias")
    by_wd = {groups[i].settings.get("wd_mult") == 0.0: i for i in mine}
    if len(mine) != 2 or len(by_wd) != 2:
        raise CheckpointError(
            f"{COMMON}: {len(mine)} {role} groups that Megatron's weight-decay rule does not "
            "tell apart (the checkpoint does not say which holds a param)",
            path=where,
            param=name,
        )
    return by_wd[no_decay]


def _layers(fqn: str, shape: tuple[int, ...], where: Path) -> list[tuple[str, int | None]]:
    """The per-layer names of a model key: ``decoder.layers.X`` -> ``decoder.layers.{i}.X``
    for each ``i`` of its leading axis, with ``i``; other keys as they are. A stacked key of
    no elements is refused (:func:`~muonckpt.format.stacked.matrices`)."""
    for prefix in STACKED:
        if fqn.startswith(prefix) and shape:
            rest = fqn[len(prefix) :]
            return [(f"{prefix}{i}.{rest}", i) for i in range(matrices(fqn, shape, 1, where))]
    return [(fqn, None)]


def _manifest(
    index: dcp_metadata.DcpIndex,
    items: Mapping[str, Mapping[str, str]],
    groups: list[Group],
    common: Mapping[str, Any],
    where: Path,
) -> tuple[Manifest, dict[tuple[str, str], tuple[str, int | None]]]:
    """The checkpoint as a consolidated manifest in Megatron's own form, one param per layer,
    and where each (param, key) is: the item's fqn and its layer."""
    kinds_of = [kind(g, common.get("args")) for g in groups]
    entries, fqn_of = [], {}
    for model_fqn in sorted(items):
        keys = items[model_fqn]
        if PARAM_KEY not in {STATE_KEYS[k] for k in keys}:
            raise CheckpointError(f"DCP item {model_fqn!r}: no fp32_param saved", path=where)
        role = "muon" if "momentum_buffer" in keys else "adamw"
        wanted = WANTED[role]
        if set(keys) != wanted and set(keys) != {"fp32_param"}:
            raise CheckpointError(
                f"DCP item {model_fqn!r}: optimizer state {sorted(keys)}, not {role}'s "
                f"{sorted(wanted)}",
                path=where,
            )
        full = index.tensors[keys["fp32_param"]]
        for name, layer in _layers(model_fqn, full.shape, where):
            shape = full.shape[1:] if layer is not None else full.shape
            g = _group_of(groups, role, name, shape, where)
            dtypes = {STATE_KEYS[k]: index.tensors[fqn].dtype for k, fqn in keys.items()}
            step = groups[g].step
            scalars = {"step": Scalar(float(step), "F32")} if role == "adamw" and step else {}
            entries.append(ParamEntry(name, shape, -1, g, dtypes, scalars))
            fqn_of.update({(name, STATE_KEYS[k]): (fqn, layer) for k, fqn in keys.items()})
    return manifest_of(groups, kinds_of, entries), fqn_of
