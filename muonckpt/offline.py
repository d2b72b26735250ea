"""Offline checkpoint tools: consolidate, reshard, summarize and diff, without an optimizer.

Library functions behind the ``muonckpt`` CLI. No collectives: everything is driven by a
checkpoint's manifest and the pure layout math of :mod:`muonckpt.layout`. All file I/O goes
through :mod:`muonckpt.storage` and :class:`muonckpt.checkpoint.PieceReader` (which verifies
checksums on every read).

Memory is bounded by what one output tensor needs: consolidation holds one full tensor plus the
span of one source piece; resharding one rank's piece of one tensor plus one source span.
Outputs are written into a staging directory beside the target, manifest last, and swapped in
atomically (:func:`muonckpt.storage.swap_in`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from . import storage
from .checkpoint import (
    PieceReader,
    open_checkpoint,
    piece_for,
    prefetched,
    rank_file,
    tensor_key,
    write_full_tensors,
)
from .errors import CheckpointError, LayoutError
from .layout import ParamSpec, Region, Topology, arrange, whole_region
from .manifest import (
    CONSOLIDATED,
    MANIFEST_NAME,
    PER_RANK,
    FileEntry,
    ParamEntry,
    Piece,
)

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called after each tensor is written."""

__all__ = ["consolidate", "diff", "open_checkpoint", "reshard", "summarize"]


def _itemsize(dtype: str) -> int:
    return storage.torch_dtype(dtype).itemsize


class _Meter:
    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.done, self.progress = total, 0, progress
        self.tick(0)

    def tick(self, nbytes: int) -> None:
        self.done += nbytes
        if self.progress is not None:
            self.progress(self.done, self.total)


def consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Rewrite any checkpoint as a consolidated one: full-shape tensors ``state.<param>.<key>``.

    Args:
        src: a checkpoint directory (any kind, any source topology).
        dst: target directory; staged beside it and swapped in atomically.
        max_shard_size: past this many bytes of tensor data, split the tensors over
            ``optimizer-0000i-of-0000N.safetensors`` files plus an HF-style
            ``optimizer.safetensors.index.json``; otherwise one ``optimizer.safetensors``.
            A tensor larger than the limit gets a file of its own.
        overwrite: replace an existing ``dst``.
        progress: called with (bytes written, total bytes) after each tensor.

    Memory: one full tensor plus the span of one source piece.
    """
    directory, manifest = open_checkpoint(src)
    items = [(e.name, key, e.dtype, e.shape) for e in manifest.params for key in e.state_keys]
    total = sum(math.prod(shape) * _itemsize(dtype) for _, _, dtype, shape in items)
    grouped = manifest.pieces_of()
    meter = _Meter(total, progress)

    def fetch(name: str, key: str) -> torch.Tensor:
        entry = manifest.param(name)
        return reader.gather(grouped[name, key], entry, whole_region(entry.numel))

    with storage.staged(dst, overwrite) as staging, PieceReader(directory, manifest) as reader:
        files, pieces, _ = write_full_tensors(
            staging, items, fetch, max_shard_size=max_shard_size, on_bytes=meter.tick
        )
        manifest = replace(
            manifest,
            kind=CONSOLIDATED,
            files=tuple(files),
            pieces=tuple(pieces),
        )
        storage.write_text_atomic(staging / MANIFEST_NAME, manifest.to_json())
    return Path(dst)


def reshard(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    dp: int,
    tp: int,
    bucket_numel: int | None = None,
    param_alignment: int = 1,
    bucket_alignment: int = 1,
    tp_split_dims: Mapping[str, int] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Rewrite any checkpoint as per-rank files for a ``dp`` x ``tp`` job.

    Rank ``r`` (TP rank fastest) gets ``rank-0000r-of-N.safetensors`` holding exactly what it
    owns under :func:`muonckpt.layout.arrange` of the manifest's params (in manifest order,
    TP split dims and groups from the manifest) with the given bucketing; TP-replicated params
    are stored on TP rank 0 only, as :func:`muonckpt.save` does.

    Args:
        tp_split_dims: param name -> split dimension, overriding the manifest's (a checkpoint
            saved by a single process records every param as unsplit, -1).
        bucket_numel, param_alignment, bucket_alignment: as in :func:`muonckpt.layout.arrange`;
            they decide which rank holds what, but any choice loads correctly.

    Raises:
        LayoutError: naming the param, when ``tp`` does not divide a split dimension.
    """
    topology = Topology(dp, tp)
    directory, manifest = open_checkpoint(src)
    overrides = dict(tp_split_dims or {})
    unknown = sorted(set(overrides) - {e.name for e in manifest.params})
    if unknown:
        raise LayoutError(f"tp_split_dims names params that are not in the checkpoint: {unknown}")
    params = tuple(
        replace(e, tp_split_dim=overrides.get(e.name, e.tp_split_dim)) for e in manifest.params
    )
    specs = [ParamSpec(e.name, e.shape, tp_split_dim=e.tp_split_dim, group=e.group) for e in params]
    layout = arrange(
        specs,
        topology,
        bucket_numel=bucket_numel,
        param_alignment=param_alignment,
        bucket_alignment=bucket_alignment,
    )
    world = topology.world_size
    plans: list[dict[str, tuple[ParamEntry, str, Region]]] = []
    for rank in range(world):
        d, t = topology.coords(rank)
        plan = {}
        for index, entry in enumerate(params):
            region = layout.owner_region(index, d, t)
            if region.numel == 0:
                continue
            for key in entry.state_keys:
                plan[tensor_key(entry.name, key)] = (entry, key, region)
        plans.append(plan)
    total = sum(r.numel * _itemsize(e.dtype) for plan in plans for e, _, r in plan.values())
    grouped = manifest.pieces_of()
    meter = _Meter(total, progress)
    pieces: list[Piece] = []
    files: list[FileEntry] = []
    with storage.staged(dst, overwrite) as staging, PieceReader(directory, manifest) as reader:
        for rank, plan in enumerate(plans):
            name = rank_file(rank, world)
            specs_out = {k: (e.dtype, (r.numel,)) for k, (e, _, r) in plan.items()}
            meta = {"format": "muonckpt", "rank": str(rank)}
            with storage.SafetensorsWriter(staging / name, specs_out, meta) as out:

                def produce(tkey: str, plan: dict = plan) -> torch.Tensor:
                    entry, key, region = plan[tkey]
                    return reader.gather(grouped[entry.name, key], entry, region)

                for tkey, piece in prefetched(out.pending, produce):
                    out.write(tkey, piece)
                    entry, _, region = plan[tkey]
                    meter.tick(region.numel * _itemsize(entry.dtype))
                records = out.commit()
            for tkey in sorted(plan):
                entry, key, region = plan[tkey]
                pieces.append(piece_for(name, records[tkey], entry.name, key, region))
            files.append(FileEntry(name, storage.file_size(staging / name)))
        resharded = replace(
            manifest,
            kind=PER_RANK,
            topology={"dp": dp, "tp": tp},
            params=params,
            files=tuple(files),
            pieces=tuple(pieces),
        )
        storage.write_text_atomic(staging / MANIFEST_NAME, resharded.to_json())
    return Path(dst)


def summarize(src: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``muonckpt inspect`` shows: kind, topology, step, groups, params and totals.

    Reads only the manifest (and checks that its pieces cover every state tensor once).
    """
    directory, manifest = open_checkpoint(src)
    params = [
        {
            "name": e.name,
            "shape": list(e.shape),
            "dtype": e.dtype,
            "tp_split_dim": e.tp_split_dim,
            "group": e.group,
            "state_keys": list(e.state_keys),
            "bytes": e.numel * _itemsize(e.dtype) * len(e.state_keys),
        }
        for e in manifest.params
    ]
    return {
        "path": str(directory),
        "kind": manifest.kind,
        "format_version": manifest.format_version,
        "topology": dict(manifest.topology),
        "step": manifest.step,
        "groups": [
            {"hyperparams": dict(g.hyperparams), "params": list(g.params)} for g in manifest.groups
        ],
        "params": params,
        "totals": {
            "params": len(params),
            "tensors": sum(len(e.state_keys) for e in manifest.params),
            "bytes": sum(p["bytes"] for p in params),
            "file_bytes": sum(f.bytes for f in manifest.files),
            "files": len(manifest.files),
            "pieces": len(manifest.pieces),
        },
    }


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> list[dict[str, Any]]:
    """Compare two checkpoints (any kinds, any topologies) as logical tensors.

    One row per (param, state key): ``max_abs`` and ``max_rel`` differences and ``equal``
    (every element within ``atol + rtol * |b|``; NaNs equal NaNs). A param or key on only one
    side, or of different shape or dtype, is a row with ``equal`` False and a ``note``.
    Memory: one full tensor from each side at a time.
    """
    if atol < 0 or rtol < 0:
        raise CheckpointError(f"atol and rtol must be non-negative, got {atol}, {rtol}")
    dir_a, man_a = open_checkpoint(a)
    dir_b, man_b = open_checkpoint(b)
    params_a = {e.name: e for e in man_a.params}
    params_b = {e.name: e for e in man_b.params}
    names = [e.name for e in man_a.params] + [
        e.name for e in man_b.params if e.name not in params_a
    ]
    pieces_a, pieces_b = man_a.pieces_of(), man_b.pieces_of()
    rows: list[dict[str, Any]] = []

    def row(param: str, key: str | None, note: str | None = None, **values: Any) -> None:
        rows.append(
            {
                "param": param,
                "key": key,
                "max_abs": None,
                "max_rel": None,
                "equal": False,
                "bitwise": False,
                "note": note,
                **values,
            }
        )

    with PieceReader(dir_a, man_a) as read_a, PieceReader(dir_b, man_b) as read_b:
        for name in names:
            ea, eb = params_a.get(name), params_b.get(name)
            if ea is None or eb is None:
                row(name, None, f"param only in {'A' if eb is None else 'B'}")
                continue
            if ea.shape != eb.shape or ea.dtype != eb.dtype:
                row(name, None, f"A is {ea.dtype} {list(ea.shape)}, B {eb.dtype} {list(eb.shape)}")
                continue
            keys = list(ea.state_keys) + [k for k in eb.state_keys if k not in ea.state_keys]
            for key in keys:
                if key not in ea.state_keys or key not in eb.state_keys:
                    row(name, key, f"state key only in {'A' if key in ea.state_keys else 'B'}")
                    continue
                whole = whole_region(ea.numel)
                x = read_a.gather(pieces_a[name, key], ea, whole)
                y = read_b.gather(pieces_b[name, key], eb, whole)
                row(name, key, **_compare(x, y, atol, rtol))
                del x, y
    return rows


def _compare(x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> dict[str, Any]:
    if x.numel() == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "equal": True}
    bitwise = torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    x64, y64 = x.to(torch.float64), y.to(torch.float64)
    both_nan = torch.isnan(x64) & torch.isnan(y64)
    delta = (x64 - y64).abs().masked_fill(both_nan, 0.0)
    rel = delta / y64.abs().clamp_min(torch.finfo(torch.float64).tiny)
    max_abs, max_rel = float(delta.max()), float(rel.max())
    if math.isnan(max_abs):
        max_abs = max_rel = math.inf
    close = bitwise or bool(torch.isclose(x64, y64, rtol=rtol, atol=atol, equal_nan=True).all())
    return {"max_abs": max_abs, "max_rel": max_rel, "equal": close, "bitwise": bitwise}
