"""Save and load a packaged Muon's state as safetensors checkpoints, resharding on load.

A checkpoint is a directory: safetensors data files plus ``manifest.json``, written last as the
commit marker (docs/format.md). ``save`` writes into a staging directory beside the target and
swaps it in atomically; ``load`` asks which elements this rank owns under its own topology and
reads just those from whichever pieces hold them. Collectives come from
:mod:`muonckpt.collectives`, file I/O from :mod:`muonckpt.storage`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from . import collectives, storage
from .errors import CheckpointError
from .hooks import (
    MARKER,
    ParamSharding,
    Sharding,
    check_agreement,
    describe_muon,
    gather_state_dict,
    remap_groups,
)
from .layout import whole_region
from .manifest import (
    CONSOLIDATED,
    MANIFEST_NAME,
    PER_RANK,
    FileEntry,
    GroupEntry,
    Manifest,
    ParamEntry,
    Piece,
    json_safe,
    piece_from_json,
)
from .optim import Muon
from .pieces import (
    INDEX_FILE,
    PieceReader,
    open_checkpoint,
    piece_for,
    prefetched,
    rank_file,
    shard_files,
    shard_index,
    tensor_key,
)


def save(
    optimizer: Muon,
    path: str | os.PathLike[str],
    *,
    consolidated: bool = False,
    max_shard_size: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Save ``optimizer``'s state to directory ``path``; a collective over its dp x tp grid.

    Args:
        optimizer: a packaged :class:`~muonckpt.Muon`, single-process or distributed.
        path: target directory. The save is staged beside it and swapped in atomically.
        consolidated: gather full-shape tensors on rank 0 and write them as
            ``state.<param>.<key>`` (see :func:`write_full_tensors`) instead of one file per
            rank (no gathering; only metadata crosses ranks).
        max_shard_size: with ``consolidated``, split files past this many bytes, HF style.
        overwrite: replace an existing checkpoint at ``path`` (otherwise an error).

    Returns:
        The checkpoint directory.
    """
    sharding = describe_muon(optimizer, collective=True)
    check_agreement(sharding)
    final = Path(path)
    me, dst = collectives.global_rank(), sharding.destination
    staging: Any = None
    if me == dst:
        staging = collectives.as_outcome(lambda: str(storage.make_staging(final, overwrite)))
    staging = Path(_agree_or_raise(sharding, staging))
    try:
        if consolidated:
            report = _write_consolidated(optimizer, sharding, staging, max_shard_size)
        else:
            report = collectives.as_outcome(lambda: _write_rank_file(optimizer, sharding, staging))
        reports = collectives.gather_json(report, sharding.participants, dst)
        outcome = None
        if me == dst:
            outcome = collectives.as_outcome(
                lambda: _commit(optimizer, sharding, staging, final, reports, consolidated)
            )
        replaced = _agree_or_raise(sharding, outcome)
    except BaseException:
        if me == dst:
            storage.discard(staging)
        raise
    if replaced is not None:
        _retire_together(sharding, replaced)
    return final


def _agree_or_raise(sharding: Sharding, value: Any) -> Any:
    """Broadcast the destination's value; an ``{"error": ...}`` value raises on every rank."""
    return collectives.agree_or_raise(value, sharding.participants, sharding.destination)


def _owned(optimizer: Muon, sharding: Sharding) -> Iterator[tuple[ParamSharding, dict[str, Any]]]:
    """(param sharding, local state) for each param whose state this rank must write."""
    me = collectives.global_rank()
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    for p, param in zip(flat, sharding.params, strict=True):
        if any(h.rank == me for h in param.sources):
            yield param, optimizer.state.get(p, {})


def _write_rank_file(optimizer: Muon, sharding: Sharding, staging: Path) -> dict[str, Any]:
    """Write this rank's own pieces; return the report (files, pieces) for the manifest."""
    me = collectives.global_rank()
    rank = sharding.participants.index(me)
    name = rank_file(rank, len(sharding.participants))
    tensors, regions = {}, {}
    for param, state in _owned(optimizer, sharding):
        holding = next(h for h in param.sources if h.rank == me)
        for key, value in sorted(state.items()):
            tkey = tensor_key(param.name, key)
            tensors[tkey] = value.reshape(-1)
            regions[tkey] = (param.name, key, holding.region)
    records = storage.write_safetensors(
        staging / name, tensors, {"format": "muonckpt", "rank": str(rank)}
    )
    pieces = [
        piece_for(name, records[tkey], param, key, region)
        for tkey, (param, key, region) in regions.items()
    ]
    return _report([FileEntry(name, storage.file_size(staging / name))], pieces, records)


def _report(
    files: list[FileEntry], pieces: list[Piece], records: Mapping[str, storage.TensorRecord]
) -> dict[str, Any]:
    """JSON form of what a rank wrote; dtypes ride along for the manifest's param entries."""
    return {
        "files": [asdict(f) for f in files],
        "pieces": [{**asdict(p), "dtype": records[p.tensor].dtype} for p in pieces],
    }


def _write_consolidated(
    optimizer: Muon, sharding: Sharding, staging: Path, max_shard_size: int | None
) -> dict[str, Any]:
    full = gather_state_dict(optimizer)
    if collectives.global_rank() != sharding.destination:
        return {"files": [], "pieces": []}
    by_name = {
        param.name: full["state"].get(index, {}) for index, param in enumerate(sharding.params)
    }
    items = [
        (name, key, storage.dtype_name(value.dtype), tuple(value.shape))
        for name, state in by_name.items()
        for key, value in sorted(state.items())
    ]
    return collectives.as_outcome(
        lambda: _report(
            *write_full_tensors(
                staging, items, lambda name, key: by_name[name][key], max_shard_size=max_shard_size
            )
        )
    )


def write_full_tensors(
    staging: Path,
    items: Sequence[tuple[str, str, str, tuple[int, ...]]],
    fetch: Callable[[str, str], torch.Tensor],
    *,
    max_shard_size: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> tuple[list[FileEntry], list[Piece], dict[str, storage.TensorRecord]]:
    """Write full-shape tensors ``state.<param>.<key>``, streaming one at a time.

    ``items`` are (param, state key, safetensors dtype, full shape); ``fetch(param, key)``
    produces each tensor when its turn comes. Up to ``max_shard_size`` bytes of tensor data
    go into ``optimizer.safetensors``; past it into ``optimizer-0000i-of-0000N.safetensors``
    plus a Hugging Face style ``optimizer.safetensors.index.json`` (a tensor larger than the
    limit gets a file of its own).
    """
    by_key = {tensor_key(name, key): (name, key, dtype, shape) for name, key, dtype, shape in items}
    sizes = {
        tkey: math.prod(shape) * storage.itemsize(dtype)
        for tkey, (_, _, dtype, shape) in by_key.items()
    }
    shards = shard_files(sizes, max_shard_size)
    files, pieces, all_records = [], [], {}
    for file, keys in shards:
        specs = {tkey: (by_key[tkey][2], by_key[tkey][3]) for tkey in keys}
        with storage.SafetensorsWriter(staging / file, specs, {"format": "muonckpt"}) as out:
            for tkey, tensor in prefetched(keys, lambda k: fetch(*by_key[k][:2])):
                out.write(tkey, tensor.reshape(by_key[tkey][3]))
                del tensor
                if on_bytes is not None:
                    on_bytes(sizes[tkey])
            records = out.commit()
        all_records.update(records)
        for tkey in keys:
            name, key, _, shape = by_key[tkey]
            pieces.append(piece_for(file, records[tkey], name, key, whole_region(math.prod(shape))))
        files.append(FileEntry(file, storage.file_size(staging / file)))
    if len(shards) > 1:
        storage.write_text_atomic(staging / INDEX_FILE, shard_index(shards, sizes))
    return files, pieces, all_records


def _commit(
    optimizer: Muon,
    sharding: Sharding,
    staging: Path,
    final: Path,
    reports: list[dict[str, Any]],
    consolidated: bool,
) -> dict[str, Any] | None:
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        return {"error": "; ".join(errors)}
    raw = [p for r in reports for p in r["pieces"]]
    manifest = build_manifest(
        optimizer,
        sharding,
        [piece_from_json(p) for p in raw],
        {p["param"]: p["dtype"] for p in raw},
        [FileEntry(f["name"], f["bytes"]) for r in reports for f in r["files"]],
        CONSOLIDATED if consolidated else PER_RANK,
    )
    storage.write_text_atomic(staging / MANIFEST_NAME, manifest.to_json())
    storage.fsync_dir(staging)
    replaced = storage.swap_in(staging, final)
    if replaced is None:
        return None
    return {"directory": str(replaced), "files": storage.entries(replaced)}


def _retire_together(sharding: Sharding, replaced: dict[str, Any]) -> None:
    """Delete the checkpoint a save replaced, each rank a share of its files.

    Freeing a large file's blocks takes time, so the ranks delete in parallel (as each rank's
    ``save_file`` over an old file would truncate its own); the destination removes what is
    left once every rank is done.
    """
    me, ranks = collectives.global_rank(), sharding.participants
    storage.retire(replaced["directory"], replaced["files"][ranks.index(me) :: len(ranks)])
    collectives.gather_json(None, ranks, sharding.destination)
    if me == sharding.destination:
        storage.retire(replaced["directory"])


def build_manifest(
    optimizer: Muon,
    sharding: Sharding,
    pieces: list[Piece],
    dtypes: Mapping[str, str],
    files: list[FileEntry],
    kind: str,
) -> Manifest:
    """The manifest of a save: params and groups from the optimizer, pieces from the ranks."""
    keys: dict[str, set[str]] = {}
    for piece in pieces:
        keys.setdefault(piece.param, set()).add(piece.key)
    params, groups, index = [], [], 0
    for g, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            param = sharding.params[index]
            meta = optimizer.dist_metas.get(p) if optimizer.distributed_mode else None
            params.append(
                ParamEntry(
                    name=param.name,
                    shape=tuple(param.full_shape),
                    group=g,
                    dtype=dtypes.get(param.name, storage.dtype_name(p.dtype)),
                    tp_split_dim=meta.tp_split_dim if meta is not None else -1,
                    state_keys=tuple(sorted(keys.get(param.name, ()))),
                )
            )
            names.append(param.name)
            index += 1
        hyper = {k: json_safe(v) for k, v in group.items() if k not in ("params", "param_names")}
        groups.append(GroupEntry(hyperparams=hyper, params=tuple(names)))
    return Manifest(
        kind=kind,
        topology=dict(sharding.topology),
        groups=tuple(groups),
        params=tuple(params),
        files=tuple(files),
        pieces=tuple(pieces),
    )


def load(optimizer: Muon, path: str | os.PathLike[str]) -> None:
    """Load a checkpoint of any kind and source topology into ``optimizer`` at its topology.

    Every rank reads the manifest and then only the bytes of the pieces overlapping its own
    share, verifying their checksums; memory is its share plus one piece span in flight.
    Raises :class:`CheckpointError` naming the file and param on any damage or mismatch.
    """
    directory, manifest = open_checkpoint(path)
    sharding = describe_muon(optimizer, collective=False)
    groups = remap_groups(optimizer, _torch_groups(manifest), sharding)
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    grouped = manifest.pieces_of()
    state: dict[int, dict[str, torch.Tensor]] = {}
    with PieceReader(directory, manifest) as reader:
        for index, (p, param) in enumerate(zip(flat, sharding.params, strict=True)):
            entry = manifest.param(param.name)
            _check_param(entry, param, directory)
            if not entry.state_keys or param.local is None:
                continue
            state[index] = {
                key: storage.tensor_of_bytes(
                    reader.gather(grouped[entry.name, key], entry, param.local), entry.dtype
                ).reshape(p.shape)
                for key in entry.state_keys
            }
    optimizer.load_state_dict(
        {"state": state, "param_groups": groups, MARKER: {"complete": True, "local_share": True}}
    )


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
