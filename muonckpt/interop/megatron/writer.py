"""Megatron-Core out: a muonckpt checkpoint read from Megatron (:func:`.megatron.from_megatron`,
at any topology since) as the torch_dist checkpoint Megatron-Core's layer-wise Muon loads at
another TP and DP (:func:`to_megatron`).

Written as Megatron's ``dist_checkpointing.save`` writes for ``--ckpt-format torch_dist``
(the ``dp_reshardable`` format: ``chained_0.`` the Muon optimizer, ``chained_1.`` AdamW):
``ROOT/latest_checkpointed_iteration.txt``, ``ROOT/iter_NNNNNNN`` with DCP's ``.metadata``
and ``.distcp`` files and ``metadata.json``. Each key is one global tensor in the chunks
Megatron's ranks write at TP ``tp`` (:mod:`muonckpt.interop.megatron.tp_chunks`), the decoder's
layers stacked again: the bf16 model weights (the fp32 masters rounded, as Megatron's
mixed-precision optimizer makes them), ``chained_N.optimizer.state.{fp32_param,
momentum_buffer, exp_avg, exp_avg_sq}.KEY``, the linear modules' empty ``_extra_state``, and
``common_state``: the param groups, AdamW's ``common_step``, ``iteration``,
``checkpoint_version`` and the ``content_metadata`` that ``megatron.training`` saves, and the job's
own state a conversion from Megatron carried (:mod:`.job_state`: ``opt_param_scheduler``,
``num_floating_point_operations_so_far``, the training ``args`` at the output's sizes, and each
TP rank's ``rng_state`` item at the TP size it was saved at).
torch_dist's tensors are global, so the files are the same for any DP size.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import settings, storage
from ...errors import ArgumentError, CheckpointError, LayoutError, OptionError
from ...files.progress import Progress
from ...format import kinds
from ...format.conversion import group_kind
from ...format.manifest import Manifest
from ...format.names import MANIFEST_NAME, PARAM_KEY
from .._foreign_out import not_carried, open_local, read_whole, staged_output
from .._trainer_state import carried, recorded
from ..dcp import files as dcp_files
from ..foreign import Conversion
from . import tp_chunks as megatron_tp
from .files import LATEST
from .job_state import target_layout, written

if TYPE_CHECKING:
    from ...files.pieces import PieceReader

SOURCE = "megatron"
MUON = kinds.MEGATRON
DIST_METADATA = "metadata.json"
STACKED = ("decoder.layers.", "encoder.layers.")
"""Prefixes of the keys whose leading axis is the layer (TransformerBlock's sharded offsets)."""
STATE_KEYS = {"fp32_param": PARAM_KEY, "momentum_buffer": "momentum_buffer"}
STATE_KEYS.update({"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"})
"""Megatron's optimizer state key -> muonckpt's."""
THEIR_KEY = {ours: theirs for theirs, ours in STATE_KEYS.items()}
"""muonckpt's state key -> Megatron's."""
CHAINED = {"muon": 0, "adamw": 1}
"""The index of each role's optimizer in Megatron's ``ChainedOptimizer`` (Muon's first)."""
MODEL_DTYPE, STATE_DTYPE = "BF16", "F32"
"""The layer-wise Muon's model weights (it needs ``bf16=True``) and optimizer state."""
CONTENT_METADATA = {
    "distrib_optim_sharding_type": "dp_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}
"""What ``megatron.training``'s ``_build_sharded_state_dict_metadata`` saves for this format."""
BACKEND = '{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
COMMON_ITEM = "common_state/shard_0_1"
NO_ARGS = "none were carried: Megatron's loader does without, at TP 1 and PP 1"
CHECKPOINT_VERSION = 3.0


_LAYER_NAME = re.compile("(" + "|".join(map(re.escape, STACKED)) + r")(\d+)\.(.+)")


def stacked_key(name: str) -> tuple[str, int | None]:
    """The checkpoint key of a per-layer param and its layer: ``decoder.layers.{i}.X`` ->
    (``decoder.layers.X``, ``i``); other names as they are (the inverse of
    :func:`.megatron._layers`)."""
    match = _LAYER_NAME.fullmatch(name)
    return (match[1] + match[3], int(match[2])) if match else (name, None)


@dataclass(frozen=True)
class _Source:
    """Where one layer's tensor of a key comes from: the param, its state key, and the factor
    its values are multiplied by (a momentum's form to EMA)."""

    name: str
    key: str
    factor: float = 1.0


@dataclass
class _Key:
    """One checkpoint key: its per-layer shape, the partition dim of one layer's tensor,
    whether its layers are stacked, and each layer's source (one, at 0, where not stacked)."""

    shape: tuple[int, ...]
    dim: int | None
    stacked: bool
    layers: dict[int, _Source]


SIZES = "the {}-parallel size Megatron loads the output at"
"""What :func:`to_megatron`'s ``tp`` and ``dp`` (``convert --tp``, ``--dp``) are."""


def _check_sizes(tp: Any, dp: Any) -> None:
    for value, name, kind in ((tp, "tp", "tensor"), (dp, "dp", "data")):
        if type(value) is not int or value < 1:
            raise ArgumentError(
                f"{name} must be {SIZES.format(kind)}, a positive int, not {value!r}",
                argument=name,
            )


def _plain(value: Any) -> Any:
    """A setting as torch's optimizers keep it: the manifest's JSON lists back to tuples."""
    return tuple(value) if isinstance(value, list) else value


def _groups(
    manifest: Manifest, directory: Path
) -> tuple[dict[str, float], dict[int, Any], int | None, list[str]]:
    """Each Muon param's momentum factor (its form to EMA), the common state's ``optimizer``
    (each role's param groups, AdamW's step), that step and the conversion notes. Only groups
    with Megatron's settings are written (``wd_mult``: what :func:`.megatron.from_megatron`
    keeps)."""
    import torch

    factors: dict[str, float] = {}
    param_groups: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    notes: list[str] = []
    for g, group in enumerate(manifest.groups):
        kind = group_kind(group, g, directory)
        if kind.role not in CHAINED or "wd_mult" not in group.hyperparams:
            raise CheckpointError(
                f"group {g} ({kind.optimizer}) holds no Megatron param group (wd_mult, lr_mult): "
                "muonckpt writes Megatron checkpoints of what it read from Megatron",
                path=directory,
            )
        if kind.role == "muon":
            target = kinds.GroupKind(
                MUON, "muon", kinds.EMA, kind.momentum, kind.nesterov, kind.lr_rule
            )
            mapping = kinds.state_mapping(kind, target, f"group {g}", None)
            if mapping.note:
                notes.append(f"{len(group.params)} Muon params: {mapping.note}")
            factors.update(dict.fromkeys(group.params, mapping.keys["momentum_buffer"][1]))
        settings = {k: _plain(v) for k, v in group.hyperparams.items() if k != "step"}
        param_groups[CHAINED[kind.role]].append(settings)
    if not param_groups[0] or not param_groups[1]:
        raise CheckpointError(
            "Megatron's layer-wise Muon chains a Muon and an AdamW optimizer: the checkpoint "
            "has groups of one role only",
            path=directory,
        )
    adamw = [n for g in manifest.groups if "betas" in g.hyperparams for n in g.params]
    step = manifest.latest_step(adamw)
    adam_state = {"state": {"common_step": torch.tensor(float(step))}} if step else {}
    optimizer = {
        0: {"optimizer": {"param_groups": param_groups[0]}},
        1: {"optimizer": {**adam_state, "param_groups": param_groups[1]}},
    }
    return factors, optimizer, step, notes


def _keys(
    manifest: Manifest, factors: Mapping[str, float], tp: int, directory: Path
) -> dict[str, _Key]:
    """Every checkpoint key (model and optimizer) -> its :class:`_Key`, the layers stacked
    again; refused where a stacked key's layers differ or skip one."""
    keys: dict[str, _Key] = {}
    for entry in manifest.params:
        if entry.value_dtype is None:
            raise CheckpointError(
                "has no saved values: Megatron's checkpoint needs every param's master weights",
                path=directory,
                param=entry.name,
            )
        fqn, layer = stacked_key(entry.name)
        try:
            dim = megatron_tp.partition_dim(entry.name) if tp > 1 else None
        except LayoutError as exc:
            raise OptionError(f"--tp {tp}: {exc}", "--tp") from None
        chain = 0 if entry.name in factors else 1
        items = {fqn: _Source(entry.name, PARAM_KEY)}
        for key in entry.state_keys:
            if key not in THEIR_KEY:
                raise CheckpointError(
                    f"holds {key!r}, which Megatron's Muon and AdamW do not keep",
                    path=directory,
                    param=entry.name,
                )
            their = f"chained_{chain}.optimizer.state.{THEIR_KEY[key]}.{fqn}"
            items[their] = _Source(entry.name, key, factors.get(entry.name, 1.0))
        items[f"chained_{chain}.optimizer.state.fp32_param.{fqn}"] = _Source(entry.name, PARAM_KEY)
        for item, source in items.items():
            held = keys.setdefault(item, _Key(entry.shape, dim, layer is not None, {}))
            if held.shape != entry.shape or (layer or 0) in held.layers:
                raise CheckpointError(
                    f"stacks into {item!r} with layers of other shapes or twice",
                    path=directory,
                    param=entry.name,
                )
            held.layers[layer or 0] = source
    for item, held in keys.items():
        if sorted(held.layers) != list(range(len(held.layers))):
            raise CheckpointError(
                f"the layers of {item!r} are {sorted(held.layers)}, not 0 to "
                f"{len(held.layers) - 1}: Megatron stacks every layer",
                path=directory,
            )
    return keys


def to_megatron(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str = SOURCE,
    tp: int | None = None,
    dp: int | None = None,
    allow_large_world: bool = False,
    progress: Progress | None = None,
) -> Conversion:
    """Write the muonckpt checkpoint ``src`` (read from a Megatron-Core torch_dist checkpoint,
    at any topology since) as a new Megatron-Core torch_dist checkpoint root ``dst`` that
    Megatron's layer-wise Muon loads at TP ``tp`` and DP ``dp``: the fp32 masters, the Muon
    momentum in EMA form (sum-form momentum converted by ``1 - mu``), AdamW's moments and
    step, the param groups' settings, and the bf16 model weights rounded from the masters.
    The files do not depend on ``dp`` (torch_dist's tensors are global), only the chunks on
    ``tp``: a ``tp`` past :data:`muonckpt.settings.MAX_WORLD` needs ``allow_large_world``,
    and any ``dp`` is taken. ``progress``: told the bytes and chunks written.

    Memory: one param's tensor at a time (each chunk of it read on its own).
    """
    from ...files.pieces import PieceReader

    if to != SOURCE:
        raise OptionError(f"Megatron output is for {SOURCE!r}, not {to!r}", "--to")
    _check_sizes(tp, dp)
    assert tp is not None and dp is not None
    settings.world_size(tp, "--tp", "one chunk of each tensor", allow_large=allow_large_world)
    directory, files, manifest = open_local(src)
    factors, optimizer, step, notes = _groups(manifest, directory)
    keys = _keys(manifest, factors, tp, directory)
    tensors, chunks = _tensors_and_chunks(keys, tp)
    iteration = manifest.recorded_step or step or 0
    values = _values(keys, optimizer, iteration)
    saved = recorded(manifest)
    trainer = carried(
        files, manifest, SOURCE, target_layout(saved["layout"] if saved else {}, tp, dp)
    )
    written(trainer, tp, dp, values, values[COMMON_ITEM][0], directory / MANIFEST_NAME)
    with staged_output(dst, directory, SOURCE) as (store, staging):
        iteration_dir = storage.make_directory(staging / f"iter_{iteration:07d}")
        with PieceReader(files, manifest) as reader:
            fetch = _LayerBlocks(keys, tensors, manifest, reader)
            dcp_files.write_dcp(iteration_dir, tensors, values, fetch, chunks, progress)
        store.put_text(iteration_dir / DIST_METADATA, BACKEND)
        storage.fsync_dir(iteration_dir)
        store.put_text(staging / LATEST, str(iteration))
    left = [] if "args" in trainer.shared else [f"the training args ({NO_ARGS})"]
    left += not_carried(manifest, trainer)
    layout = f"dp_reshardable, TP {tp} DP {dp}"
    return Conversion(Path(dst), layout, tuple(left), tuple(notes))


def _tensors_and_chunks(
    keys: Mapping[str, _Key], tp: int
) -> tuple[dict[str, tuple[tuple[int, ...], str]], dict[str, list[dcp_files.Region]]]:
    """Each key's global tensor (fqn -> (shape, safetensors dtype): the layers stacked, the
    optimizer's in fp32, the model's in bf16) and the blocks Megatron's ranks write of it at
    TP ``tp``."""
    tensors, chunks = {}, {}
    for item, held in keys.items():
        shape = (len(held.layers), *held.shape) if held.stacked else held.shape
        optimizer_item = ".optimizer.state." in item
        tensors[item] = (shape, STATE_DTYPE if optimizer_item else MODEL_DTYPE)
        try:
            chunks[item] = megatron_tp.chunks(
                held.shape, len(held.layers) if held.stacked else None, held.dim, tp
            )
        except LayoutError as exc:
            raise OptionError(f"--tp {tp}: {item!r}: {exc}", "--tp") from None
    return tensors, chunks


def _values(keys: Mapping[str, _Key], optimizer: dict[int, Any], iteration: int) -> dict[str, Any]:
    """The checkpoint's plain values: ``common_state`` (the optimizer's param groups and step,
    the iteration, the checkpoint version, ``content_metadata``) and an empty
    ``_extra_state`` per layer of each stacked linear module, as Megatron saves them."""
    common = {
        "optimizer": optimizer,
        "iteration": iteration,
        "checkpoint_version": CHECKPOINT_VERSION,
        "content_metadata": dict(CONTENT_METADATA),
    }
    values: dict[str, Any] = {COMMON_ITEM: [common]}
    for item, held in keys.items():
        module, _, last = item.rpartition(".")
        if (
            held.stacked
            and last == "weight"
            and module.endswith(megatron_tp.EXTRA_STATE_MODULES)
            and ".optimizer." not in item
        ):
            count = len(held.layers)
            values.update(
                {f"{module}._extra_state/shard_{i}_{count}": [None] for i in range(count)}
            )
    return values


class _LayerBlocks:
    """The data of each block torch's writer asks for: the layer's tensor of its source (the
    leading offset of a stacked key picks the layer), read whole from the muonckpt checkpoint,
    cut to the block, cast to the key's dtype and multiplied by the source's factor."""

    def __init__(
        self,
        keys: Mapping[str, _Key],
        tensors: Mapping[str, tuple[tuple[int, ...], str]],
        manifest: Manifest,
        reader: PieceReader,
    ) -> None:
        self.keys = keys
        self.tensors = tensors
        self.manifest = manifest
        self.reader = reader
        self.pieces = manifest.pieces_of()

    def __call__(self, item: str, region: dcp_files.Region) -> Any:
        held = self.keys[item]
        offsets, sizes = region
        source = held.layers[offsets[0] if held.stacked else 0]
        if held.stacked:
            offsets, sizes = offsets[1:], sizes[1:]
        entry = self.manifest.param(source.name)
        full = read_whole(self.reader, self.pieces, entry, source.key)
        block = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        block = block.to(storage.torch_dtype(self.tensors[item][1]))
        if source.factor != 1.0:
            block = block.mul(source.factor)
        return block.reshape(region[1])
