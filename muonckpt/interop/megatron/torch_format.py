"""Megatron-Core's ``--ckpt-format torch`` checkpoints of its layer-wise Muon in.

``iter_N/mp_rank_XX/model_optim_rng.pt`` holds TP rank ``XX``'s model (bf16 weights, by
module name) and ``layer_wise_optimizer_{d}.pt`` beside it DP rank ``d``'s optimizer: a
``ChainedOptimizer.state_dict()``, per chained optimizer ``optimizer`` (torch's
``state_dict()``: ``state`` and ``param_groups`` keyed by integer ids) and
``fp32_from_fp16_params`` (the fp32 masters, per group, in the ids' order). The ids name no
param. Each DP rank holds only its own params, assigned by a rule of the optimizer's build
that the checkpoint does not record; what it does record beside each master is the model's
own weight: Megatron copies every master into its model param after each step, so the weight
is the master rounded to the model's dtype. An id is mapped to the one param of the model, in
the model's own order, of the master's shape whose weight is the master so rounded; where no
param or more than one is (params of equal values: a checkpoint saved before any step, say),
the mapping cannot be known and the checkpoint is refused, naming the file and the item. At DP
1 the ids also run in the model's order, and that is checked. TP shards are joined along
Megatron's partition dims
(:func:`~muonckpt.interop.megatron.tp_chunks.partition_dim`); names are the torch_dist
checkpoint's (the local spec's ``input_layernorm.`` as ``self_attention.linear_qkv.layer_norm_``),
so both formats convert to the same checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, LayoutError
from ...files.progress import Progress
from ...format.conversion import converted_manifest
from ...format.manifest import Manifest, ParamEntry, Scalar
from ...format.names import PARAM_KEY
from ...storage.dtypes import dtype_name
from .._consolidated import consolidated, conversion_notes, summarized, write_consolidated
from .._fields import count, listed_state, tensor
from ..foreign import Conversion
from . import files as megatron_files
from .files import Namespace
from .groups import Group, assumed, group_of, kind, manifest_of, role_of
from .job_state import iteration_of, job_state
from .tp_chunks import partition_dim

__all__ = ["LOCAL_NAMES", "from_torch_format"]

LOCAL_NAMES = (
    (".input_layernorm.", ".self_attention.linear_qkv.layer_norm_"),
    (".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_"),
)
"""The local layer spec's module names -> the names its checkpoints use (the spec's
``sharded_state_dict_keys_map``, ``gpt_layer_specs.py``), as the torch_dist format has them."""
KEYS = {"momentum_buffer": "muon", "exp_avg": "adamw", "exp_avg_sq": "adamw"}
"""The state tensors of each role (AdamW's ``step`` is read as a scalar)."""


def checkpoint_name(name: str) -> str:
    """A model param's name in Megatron's checkpoints (:data:`LOCAL_NAMES`)."""
    for local, shared in LOCAL_NAMES:
        name = name.replace(local, shared, 1) if name.startswith("decoder.layers.") else name
    return name


@dataclass
class _Param:
    """One param of one TP rank: its group (flat index over the chained optimizers) and its
    tensors by muonckpt's keys."""

    group: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    step: int | None = None


def from_torch_format(
    directory: Path,
    dst: str | os.PathLike[str],
    *,
    to: str | None,
    overwrite: bool,
    progress: Progress | None,
    root: Path,
) -> Conversion:
    """Convert the torch-format iteration ``directory`` (see the module's text) as
    :func:`~.megatron.from_megatron` does a torch_dist one; ``root``: the checkpoint as given
    (no output inside it). Memory: the whole checkpoint."""
    files = megatron_files.torch_files(directory)
    tops = [_top(path) for path in files.model]
    _check_sizes(tops, files)
    groups = _groups(files.optimizer[0][0])
    ranks = [
        _params(top, paths, groups, dp=len(paths))
        for top, paths in zip(tops, files.optimizer, strict=True)
    ]
    tensors, steps = _joined(ranks, files.model)
    args = tops[0].get("args")
    manifest = _manifest(tensors, steps, groups, ranks[0], args)
    target, scales = converted_manifest(manifest, to, path=files.model[0])
    planned = consolidated(target)
    pulled = (tensors[name][key].clone() for name, key in planned.reads)
    rng = {(0, t): top["rng_state"] for t, top in enumerate(tops) if "rng_state" in top}
    trainer, trainer_left = job_state(tops[0], rng, (1, len(tops)))
    path = write_consolidated(
        planned, scales, pulled, dst, overwrite=overwrite, progress=progress, source=root,
        trainer=trainer, step=iteration_of(tops[0]),
    )  # fmt: skip
    carried = {"model", "optimizer", "rng_state", *trainer.shared}
    left = list(tops[0]["model"])  # the bf16 weights: the fp32 masters are carried
    left += [k for k in tops[0] if k not in carried]
    notes = conversion_notes(manifest, target) + assumed(args)
    return Conversion(path, "torch", (*summarized(left), *trainer_left), notes)


SIZES = (
    ("tensor_model_parallel_size", "mp_rank_XX directories (one per TP rank)"),
    ("data_parallel_size", "layer_wise_optimizer files per mp_rank_XX (one per DP rank)"),
    ("pipeline_model_parallel_size", "pipeline stage(s) (mp_rank_XX names hold none)"),
)
"""The parallel sizes of the training ``args`` that the files must match, and what counts."""


def _check_sizes(tops: list[dict[str, Any]], files: megatron_files.TorchFiles) -> None:
    """Refuse an iteration whose files are not those of the parallel sizes that each TP
    rank's training args record (a stale ``mp_rank_XX`` left by an earlier save of the
    iteration at another TP size would be read as a TP rank, every TP-split param joined at a
    wrong shape), or, where ``mp_rank_00``'s args record no TP size, more than one TP rank's
    directory (which of them this save wrote cannot be known)."""
    directory = files.model[0].parent.parent
    found = (len(files.model), len(files.optimizer[0]), 1)
    if found[0] > 1 and type(_recorded(tops[0]).get(SIZES[0][0])) is not int:
        raise CheckpointError(
            f"holds {found[0]} mp_rank_XX directories, but no training args of "
            f"{files.model[0].parent.name} record its {SIZES[0][0]}: which of them are this "
            "save's TP ranks cannot be known",
            path=directory,
        )
    for path, top in zip(files.model, tops, strict=True):
        for (key, what), count_ in zip(SIZES, found, strict=True):
            size = _recorded(top).get(key)
            if type(size) is int and size != count_:
                why = "one left by another save?" if count_ > size else "one missing?"
                raise CheckpointError(
                    f"the training args of {path.parent.name} say {key} {size}, but {count_} "
                    f"{what} are here ({why})",
                    path=directory,
                )


def _recorded(top: Mapping[str, Any]) -> dict[str, Any]:
    """A ``model_optim_rng.pt``'s training args by name (none where it holds no args)."""
    args = top.get("args")
    return vars(args) if isinstance(args, Namespace) else {}


def _top(path: Path) -> dict[str, Any]:
    """A ``model_optim_rng.pt``, checked to be a mapping with a ``model`` mapping."""
    top = megatron_files.load(path)
    if not isinstance(top, dict) or not isinstance(top.get("model"), Mapping):
        raise CheckpointError("holds no 'model' state dict: not Megatron's", path=path)
    return top


def _chained(path: Path) -> list[dict[str, Any]]:
    """A ``layer_wise_optimizer_{d}.pt``'s chained optimizers' state dicts, each checked to
    hold ``optimizer`` (``state``, ``param_groups``) and ``fp32_from_fp16_params`` that agree."""
    value = megatron_files.load(path)
    chained = [value] if isinstance(value, dict) else value
    if not isinstance(chained, list) or not chained:
        raise CheckpointError("holds no optimizer state dict", path=path)
    for c, sd in enumerate(chained):
        if not _well_formed(sd):
            raise CheckpointError(
                f"chained optimizer {c}: not optimizer.state / param_groups with one "
                "fp32_from_fp16_params master per param id",
                path=path,
            )
        ids = [i for group in sd["optimizer"]["param_groups"] for i in group["params"]]
        listed_state(sd["optimizer"]["state"], ids, path, f"chained optimizer {c}")
    return chained


def _well_formed(sd: Any) -> bool:
    """Whether one chained optimizer's state dict is as Megatron writes it."""
    if not isinstance(sd, dict) or not isinstance(sd.get("optimizer"), dict):
        return False
    groups, masters = sd["optimizer"].get("param_groups"), sd.get("fp32_from_fp16_params")
    if not isinstance(sd["optimizer"].get("state"), dict):
        return False
    if not isinstance(groups, list) or not isinstance(masters, list):
        return False
    return len(groups) == len(masters) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list) and isinstance(m, list)
        and len(g["params"]) == len(m) and all(torch.is_tensor(t) for t in m)
        and all(type(i) is int for i in g["params"])
        for g, m in zip(groups, masters, strict=True)
    )  # fmt: skip


def _groups(path: Path) -> list[Group]:
    """Every param group of the chained optimizers, in order (their settings are the same on
    every rank)."""
    out = []
    for c, sd in enumerate(_chained(path)):
        for g, group in enumerate(sd["optimizer"]["param_groups"]):
            role = role_of(group)
            if role is None:
                raise CheckpointError(
                    f"group {g} of chained optimizer {c} is neither Muon's (momentum) nor "
                    "AdamW's (betas)",
                    path=path,
                )
            settings = {k: v for k, v in group.items() if k != "params"}
            out.append(group_of(role, settings, path))
    return out


def _params(
    top: Mapping[str, Any], paths: tuple[Path, ...], groups: list[Group], dp: int
) -> dict[str, _Param]:
    """One TP rank's params by checkpoint name, from its DP ranks' files, each id mapped to
    its model param (see the module's text)."""
    model = {
        checkpoint_name(n): t
        for n, t in top["model"].items()
        if torch.is_tensor(t) and t.is_floating_point()
    }
    order = list(model)
    out: dict[str, _Param] = {}
    for path in paths:
        flat = 0
        for c, sd in enumerate(_chained(path)):
            pairs = zip(sd["optimizer"]["param_groups"], sd["fp32_from_fp16_params"], strict=True)
            for g, (group, masters) in enumerate(pairs):
                if flat >= len(groups):
                    raise CheckpointError("holds more param groups than DP rank 0", path=path)
                last = -1
                for pid, master in zip(group["params"], masters, strict=True):
                    item = f"chained optimizer {c}, group {g}, param id {pid}"
                    name = _match(model, tensor(master, path, f"{item}: its master"), path, item)
                    if name in out:
                        raise CheckpointError(f"{item}: {name} has a master already", path=path)
                    if dp == 1 and order.index(name) < last:
                        raise CheckpointError(
                            f"{item}: {name} is not in the model's order, as the ids of a "
                            "DP-1 optimizer are (a DP rank's file missing?)",
                            path=path,
                        )
                    last = order.index(name)
                    out[name] = _state(
                        sd["optimizer"]["state"].get(pid, {}), master, flat, groups, path, item
                    )
                flat += 1
    missing = [name for name in order if name not in out]
    if missing:
        raise CheckpointError(
            f"model param {missing[0]} ({len(missing)} in all) has no master in the "
            f"{len(paths)} layer_wise_optimizer files beside it (one per DP rank): a DP rank's "
            "file missing, or the optimizer's files not of this model's save",
            path=paths[0].parent,
        )
    return out


def _match(model: Mapping[str, torch.Tensor], master: torch.Tensor, path: Path, item: str) -> str:
    """The one model param whose weight is ``master`` rounded to its dtype; refused where
    none or several are."""
    found = [
        n for n, w in model.items()
        if w.shape == master.shape and torch.equal(w, master.to(w.dtype))
    ]  # fmt: skip
    if len(found) != 1:
        what = "no model param" if not found else f"{len(found)} model params ({found[0]}, ...)"
        raise CheckpointError(
            f"{item}: {what} of shape {list(master.shape)} hold its master's values, so which "
            "param it is cannot be known",
            path=path,
        )
    return found[0]


def _state(
    state: Any, master: torch.Tensor, g: int, groups: list[Group], path: Path, item: str
) -> _Param:
    """A param's master and state, checked to be its group's role's keys and shapes."""
    role = groups[g].role
    if not isinstance(state, dict):
        raise CheckpointError(f"{item}: its state is not a mapping", path=path)
    param = _Param(g, {PARAM_KEY: master})
    for key, value in state.items():
        if key == "step" and role == "adamw":
            param.step = count(value, path, f"{item}: step")
        elif KEYS.get(key) == role and torch.is_tensor(value) and value.shape == master.shape:
            param.tensors[key] = tensor(value, path, f"{item}: state {key!r}")
        else:
            raise CheckpointError(
                f"{item}: state {key!r} is not one of {role}'s tensors of shape "
                f"{list(master.shape)}",
                path=path,
            )
    return param


def _joined(
    ranks: list[dict[str, _Param]], where: tuple[Path, ...]
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int | None]]:
    """Each param's tensors with the TP ranks' shards joined along its partition dim (a
    replicated param checked to be the same on every rank), and its AdamW step."""
    if any(set(r) != set(ranks[0]) for r in ranks):
        raise CheckpointError("its TP ranks hold different params", path=where[0].parent.parent)
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    steps: dict[str, int | None] = {}
    for name, first in ranks[0].items():
        try:
            dim = partition_dim(name) if len(ranks) > 1 else None
        except LayoutError as exc:
            raise CheckpointError(str(exc), path=where[0]) from None
        tensors[name] = {}
        for key, value in first.tensors.items():
            parts = [r[name].tensors.get(key) for r in ranks]
            if dim is not None and all(p is not None for p in parts):
                tensors[name][key] = torch.cat(parts, dim=dim).contiguous()  # type: ignore[arg-type]
            elif all(p is not None and torch.equal(p, value) for p in parts):
                tensors[name][key] = value.contiguous()
            else:
                raise CheckpointError(
                    f"param {name}: {key} differs between TP ranks, yet TP does not split it",
                    path=where[0].parent.parent,
                )
        steps[name] = first.step
    return tensors, steps


def _manifest(
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    steps: Mapping[str, int | None],
    groups: list[Group],
    params: Mapping[str, _Param],
    args: Any,
) -> Manifest:
    """The checkpoint as a consolidated manifest in Megatron's own form, as the torch_dist
    reader makes it."""
    entries = []
    for name in sorted(tensors):
        g = params[name].group
        shape = tuple(tensors[name][PARAM_KEY].shape)
        dtypes = {k: dtype_name(t.dtype) for k, t in tensors[name].items()}
        step = steps[name]
        scalars = {"step": Scalar(float(step), "F32")} if step else {}
        entries.append(ParamEntry(name, shape, -1, g, dtypes, scalars))
    return manifest_of(groups, [kind(g, args) for g in groups], entries)
