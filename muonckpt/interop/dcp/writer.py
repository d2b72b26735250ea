"""PyTorch Distributed Checkpoint (DCP) out: :func:`to_dcp` writes any muonckpt checkpoint as
DCP for a DTensor family, which ``torch.distributed.checkpoint.load`` reads at any world size,
one tensor at a time, through torch's own writer (:func:`.files.write_dcp`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, StateDictError
from ...files.pieces import PieceReader
from ...files.progress import Progress
from ...format import kinds
from ...format.conversion import group_kind, step_scalar
from ...format.manifest import Manifest, ParamEntry, PieceIndex, Scalar
from ...format.names import PARAM_KEY
from ...format.stacked import merged_experts
from .._foreign_out import not_carried, open_local, read_whole, staged_output
from .._trainer_state import Carried, carried
from ..foreign import Conversion
from . import files as dcp_files
from .reader import LAYOUTS, OPTIMIZER_PREFIX, dcp_family

__all__ = ["DEFAULT_LAYOUT", "to_dcp"]

DEFAULT_LAYOUT = "torchtitan"
"""The layout :func:`to_dcp` writes a checkpoint that was not read from DCP in."""


def to_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str,
    layout: str | None = None,
    merge_experts: bool | None = None,
    progress: Progress | None = None,
    job_state: tuple[str, Callable[[Carried], dict[str, Any]]] | None = None,
) -> Conversion:
    """Write the muonckpt checkpoint ``src`` (any kind, any topology) as a DCP checkpoint at
    ``dst`` for the DTensor family ``to``: the params as the model's tensors, each param's
    state under ``optimizer.state.<fqn>.<key>`` in the family's keys and momentum form, AdamW
    step counts where the family keeps them (torch: a float32 0-d tensor per param, as
    :func:`muonckpt.load` restores them), and ``optimizer.param_groups.<fqn>.<setting>`` for
    the settings the family has (torch's optimizers' own defaults where the checkpoint does
    not say). ``layout``: ``torchtitan`` (model fqns at the top level) or ``recipe``
    (``model.<fqn>``); None: the layout ``src`` was read as when it was converted from DCP (its
    manifest's ``dcp_layout``: the round trip keeps it), else ``torchtitan``.
    ``merge_experts``: None: each param the manifest records ``--split-experts`` split
    (``<fqn>.0`` ... ``<fqn>.<E-1>``, :func:`muonckpt.format.stacked.merged_experts`) is
    written as the stacked ``<fqn>`` of shape (E, m, n) again, param and state alike, for a job
    that keeps its experts stacked (torchtitan's DistMuon); True: likewise, and where none is
    recorded, the 2-D Muon params named so are merged by their names (said in ``converted``),
    a checkpoint with none refused; False: nothing is merged.
    Only torch's writer writes; ``dst`` must not exist.
    ``progress``: told the bytes and tensors written.
    ``job_state``: (trainer, its items of a carried state) where the output is that trainer's
    (torchtitan's: its scheduler and data loader back, :mod:`muonckpt.interop._trainer_state`).

    Memory: one full tensor at a time.
    """
    family = dcp_family(to, "target")
    if layout is not None and layout not in LAYOUTS:
        raise StateDictError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}")
    directory, files, manifest = open_local(src)
    if layout is None:
        layout = manifest.dcp_layout if manifest.dcp_layout in LAYOUTS else DEFAULT_LAYOUT
    out = _DcpOut(LAYOUTS[layout])
    if merge_experts is not False:
        _merge_experts(out, manifest, insist=bool(merge_experts), directory=directory)
    _add_optimizer(out, manifest, family, directory)
    _add_model(out, manifest)
    trainer = carried(files, manifest, job_state[0]) if job_state is not None else None
    if job_state is not None and trainer is not None:
        out.values.update(job_state[1](trainer))
    with (
        staged_output(dst, directory, "dcp") as (_, staging),
        PieceReader(files, manifest) as reader,
    ):
        fetch = _WholeTensors(out.sources, manifest, reader)
        dcp_files.write_dcp(staging, out.tensors, out.values, fetch, progress=progress)
    left = tuple(out.left) + not_carried(manifest, trainer)
    return Conversion(Path(dst), layout, left, tuple(out.notes))


def _merge_experts(out: _DcpOut, manifest: Manifest, insist: bool, directory: Path) -> None:
    """The split experts ``out`` stacks again, each told in its notes: those the manifest
    records; ``insist``: else those named so, a checkpoint with none refused."""
    out.merged = merged_experts(manifest)
    how = "recorded as split by --split-experts"
    if insist and not out.merged:
        out.merged = merged_experts(manifest, by_name=True)
        how = "no split recorded: merged by their names, as --merge-experts asked"
    if insist and not out.merged:
        raise CheckpointError(
            "holds no experts split into one param each (NAME.0 ... NAME.<E-1>, 2-D Muon "
            "params of one shape): nothing to merge",
            path=directory,
        )
    for stem, parts in out.merged.items():
        shape = (len(parts), *manifest.param(parts[0]).shape)
        out.notes.append(f"merged {len(parts)} experts into {stem!r} {shape} ({how})")


@dataclass(frozen=True)
class _Source:
    """Where a written tensor's data comes from: stored tensor ``key`` of the param or model
    tensor ``names[0]``, or of each of ``names`` stacked (``stacked``: a merged expert), times
    ``factor``."""

    names: tuple[str, ...]
    key: str
    factor: float = 1.0
    stacked: bool = False


@dataclass
class _DcpOut:
    """What :func:`to_dcp` writes, in the order it writes it: each tensor's fqn -> (shape,
    safetensors dtype) and where its data comes from (the muonckpt names, stacked where
    several, its state key, the factor its values are multiplied by), the plain values (fqn
    -> value), and for the report the momentum conversions and what was left out. ``prefix``:
    the model fqns' prefix; ``merged``: the stacked params to write, each with its matrices."""

    prefix: str
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    sources: dict[str, _Source] = field(default_factory=dict)
    merged: dict[str, tuple[str, ...]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


def _add_optimizer(
    out: _DcpOut, manifest: Manifest, family: kinds.DcpFamily, directory: Path
) -> None:
    """Add each optimizer param to ``out``: its values as the model's tensor, its state in the
    family's keys and momentum form, its AdamW step and its group's settings; the matrices
    of a merged expert as its stack, once, where its first matrix stood."""
    stacked = {parts[0]: (stem, parts) for stem, parts in out.merged.items()}
    merged = {part for parts in out.merged.values() for part in parts}
    for g, group in enumerate(manifest.groups):
        kind = group_kind(group, g, directory)
        target = family.target_kind(kind)
        factor = 1.0  # (a family kept as it is: its state unconverted)
        if not family.as_is:
            mapping = kinds.state_mapping(kind, target, f"group {g}", None)
            factor = mapping.keys.get("momentum_buffer", ("", 1.0))[1]
            if mapping.note:
                out.notes.append(f"{len(group.params)} Muon params: {mapping.note}")
        group_settings = family_settings(family, kind, target, group.hyperparams)
        for member in group.params:
            if member in merged and member not in stacked:
                continue  # (written with its stack's first matrix)
            name, parts = stacked.get(member, (member, (member,)))
            entry = manifest.param(member)
            stack = member in stacked
            lead = (len(parts),) if stack else ()
            if entry.value_dtype is not None:
                out.tensors[out.prefix + name] = ((*lead, *entry.shape), entry.value_dtype)
                out.sources[out.prefix + name] = _Source(parts, PARAM_KEY, stacked=stack)
            else:
                out.left.append(f"{name} (no values saved)")
            for key in entry.state_keys:
                fqn = f"{OPTIMIZER_PREFIX}state.{name}.{family.their_key(kind.role or '', key)}"
                out.tensors[fqn] = ((*lead, *entry.shape_of(key)), entry.dtype_of(key))
                scale = factor if key == "momentum_buffer" else 1.0
                out.sources[fqn] = _Source(parts, key, scale, stack)
            step = step_scalar(family.step_in, manifest.step_of(entry), name)
            if kind.role == "adamw" and step is not None and entry.state_keys:
                out.values[f"{OPTIMIZER_PREFIX}state.{name}.step"] = (
                    step_tensor(step) if step.dtype is not None else step.value
                )
            for key, scalar in entry.scalars.items() if family.as_is else ():
                out.values[f"{OPTIMIZER_PREFIX}state.{name}.{key}"] = (
                    scalar_tensor(scalar) if scalar.dtype is not None else scalar.value
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
        out.sources[out.prefix + entry.name] = _Source((entry.name,), PARAM_KEY)
    for alias, stored in sorted(model_file.aliases.items()):
        if out.prefix + stored not in out.sources:
            out.left.append(f"{alias} (an alias of {stored}, which holds no values)")
            continue
        out.tensors[out.prefix + alias] = out.tensors[out.prefix + stored]
        out.sources[out.prefix + alias] = out.sources[out.prefix + stored]


class _WholeTensors:
    """The data of each tensor torch's writer asks for (one block, the whole tensor): read
    from the muonckpt checkpoint as ``sources`` says (fqn -> the params or model tensor, stacked
    where several, its state key, the factor its values are multiplied by)."""

    def __init__(
        self, sources: Mapping[str, _Source], manifest: Manifest, reader: PieceReader
    ) -> None:
        model = manifest.model
        self.sources = sources
        self.manifest = manifest
        self.reader = reader
        self.model_tensors = {t.name: t for t in model.tensors} if model is not None else {}
        self.pieces = PieceIndex(manifest.pieces, model.pieces if model is not None else ())

    def __call__(self, fqn: str, _whole: dcp_files.Region) -> Any:
        import torch

        source = self.sources[fqn]
        read = [
            read_whole(self.reader, self.pieces, self.entry(name), source.key)
            for name in source.names
        ]
        tensor = torch.stack(read) if source.stacked else read[0]
        return tensor.mul_(source.factor) if source.factor != 1.0 else tensor

    def entry(self, name: str) -> ParamEntry:
        """The model tensor or param ``name``."""
        return self.model_tensors.get(name) or self.manifest.param(name)


def step_tensor(step: Scalar) -> Any:
    """A step as torch's AdamW holds it: a 0-d float32 tensor."""
    return scalar_tensor(replace(step, dtype="F32"))


def scalar_tensor(scalar: Scalar) -> Any:
    """A 0-d tensor of ``scalar``'s value and dtype."""
    import torch

    from ...storage.dtypes import torch_dtype

    return torch.tensor(scalar.value, dtype=torch_dtype(scalar.dtype or "F32"))


def family_settings(
    family: kinds.DcpFamily,
    source: kinds.GroupKind,
    target: kinds.GroupKind,
    hyper: Mapping[str, Any],
) -> dict[str, Any]:
    """The settings a group of ``family`` has, from a group of ``source`` with ``hyper``:
    torch's optimizers' own defaults (torch, torchtitan), overridden by what the checkpoint
    says; for other families the settings muonckpt knows they have."""
    own = family.name == source.family or source.optimizer in (family.muon, family.adamw)
    own = own or family.as_is  # (its settings kept as they are)
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
