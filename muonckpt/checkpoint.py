"""Save and load a packaged Muon's state as safetensors checkpoints, resharding on load.

A checkpoint is a directory: safetensors data files plus ``manifest.json``, written last as the
commit marker (docs/format.md). ``save`` writes into a staging directory beside the target and
swaps it in atomically; ``load`` asks which elements this rank owns under its own topology and
reads just those from whichever pieces hold them. Collectives come from
:mod:`muonckpt.collectives`, file I/O from :mod:`muonckpt.storage`.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from . import collectives, storage
from .errors import CheckpointError, MuonCkptError
from .hooks import (
    MARKER,
    ParamSharding,
    Sharding,
    check_agreement,
    describe_muon,
    gather_state_dict,
    remap_groups,
)
from .layout import Run, copy_runs, whole_region
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
    parse_manifest,
)
from .optim import Muon
from .regions import copy_runs_

CONSOLIDATED_FILE = "optimizer.safetensors"
_STAGING_NAME = re.compile(r"^\..+\.(staging-[0-9a-f]{8}|old-\d+)$")
INDEX_FILE = "optimizer.safetensors.index.json"


def tensor_key(param: str, key: str) -> str:
    """torch's flattened optimizer-state key: ``state.<param name>.<state key>``."""
    return f"state.{param}.{key}"


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def save(
    optimizer: Muon,
    path: str | os.PathLike[str],
    *,
    consolidated: bool = False,
    overwrite: bool = False,
) -> Path:
    """Save ``optimizer``'s state to directory ``path``; a collective over its dp x tp grid.

    Args:
        optimizer: a packaged :class:`~muonckpt.Muon`, single-process or distributed.
        path: target directory. The save is staged beside it and swapped in atomically.
        consolidated: write full-shape tensors into one ``optimizer.safetensors`` (gathered on
            rank 0) instead of one file per rank (no gathering; only metadata crosses ranks).
        overwrite: replace an existing checkpoint at ``path`` (otherwise an error).

    Returns:
        The checkpoint directory.
    """
    sharding = describe_muon(optimizer, collective=True)
    check_agreement(sharding)
    final = Path(path)
    me, dst = collectives.global_rank(), sharding.destination
    staging = None
    if me == dst:
        staging = _prepare_staging(final, overwrite)
    staging = Path(_agree_or_raise(sharding, str(staging) if staging else None))
    try:
        if consolidated:
            report = _write_consolidated(optimizer, sharding, staging)
        else:
            report = _write_rank_file(optimizer, sharding, staging)
        reports = collectives.gather_json(report, sharding.participants, dst)
        outcome: Any = None
        if me == dst:
            outcome = _commit(optimizer, sharding, staging, final, reports, consolidated)
        _agree_or_raise(sharding, outcome)
    except BaseException:
        if me == dst:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def _prepare_staging(final: Path, overwrite: bool) -> Path | dict[str, str]:
    if final.exists() and not overwrite:
        return {"error": f"{final} already exists; pass overwrite=True to replace it"}
    if final.exists() and not final.is_dir():
        return {"error": f"{final} exists and is not a checkpoint directory"}
    staging = final.parent / f".{final.name}.staging-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir(parents=True)
    except OSError as exc:
        return {"error": f"cannot create {staging}: {exc}"}
    return staging


def _agree_or_raise(sharding: Sharding, value: Any) -> Any:
    """Broadcast the destination's value; an ``{"error": ...}`` value raises on every rank."""
    value = collectives.broadcast_json(
        value if not isinstance(value, Path) else str(value),
        sharding.participants,
        sharding.destination,
    )
    if isinstance(value, dict) and "error" in value:
        raise CheckpointError(value["error"])
    return value


def _owned(optimizer: Muon, sharding: Sharding) -> Iterator[tuple[ParamSharding, dict[str, Any]]]:
    """(param sharding, local state) for each param whose state this rank must write."""
    me = collectives.global_rank()
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    for p, param in zip(flat, sharding.params, strict=True):
        if any(h.rank == me for h in param.sources):
            yield param, optimizer.state.get(p, {})


def _write_rank_file(optimizer: Muon, sharding: Sharding, staging: Path) -> dict[str, Any]:
    me = collectives.global_rank()
    rank = sharding.participants.index(me)
    name = rank_file(rank, len(sharding.participants))
    tensors, pieces = {}, []
    for param, state in _owned(optimizer, sharding):
        holding = next(h for h in param.sources if h.rank == me)
        for key, value in sorted(state.items()):
            tkey = tensor_key(param.name, key)
            tensors[tkey] = value.reshape(-1)
            pieces.append(
                {"param": param.name, "key": key, "tensor": tkey, "region": holding.region.__dict__}
            )
    try:
        records = storage.write_safetensors(
            staging / name, tensors, {"format": "muonckpt", "rank": str(rank)}
        )
    except MuonCkptError as exc:
        return {"error": f"rank {rank}: {exc}"}
    return _file_report(name, staging, pieces, records)


def _file_report(
    name: str, staging: Path, pieces: list[dict[str, Any]], records: dict[str, storage.TensorRecord]
) -> dict[str, Any]:
    for piece in pieces:
        record = records[piece["tensor"]]
        piece.update(
            file=name,
            checksums=list(record.checksums),
            chunk_bytes=record.chunk_bytes,
            dtype=record.dtype,
        )
    return {"files": [{"name": name, "bytes": (staging / name).stat().st_size}], "pieces": pieces}


def _write_consolidated(optimizer: Muon, sharding: Sharding, staging: Path) -> dict[str, Any]:
    full = gather_state_dict(optimizer)
    if collectives.global_rank() != sharding.destination:
        return {"files": [], "pieces": []}
    tensors, pieces = {}, []
    for index, param in enumerate(sharding.params):
        for key, value in sorted(full["state"].get(index, {}).items()):
            tkey = tensor_key(param.name, key)
            tensors[tkey] = value
            pieces.append(
                {
                    "param": param.name,
                    "key": key,
                    "tensor": tkey,
                    "region": whole_region(value.numel()).__dict__,
                }
            )
    records = storage.write_safetensors(
        staging / CONSOLIDATED_FILE, tensors, {"format": "muonckpt"}
    )
    return _file_report(CONSOLIDATED_FILE, staging, pieces, records)


def _commit(
    optimizer: Muon,
    sharding: Sharding,
    staging: Path,
    final: Path,
    reports: list[dict[str, Any]],
    consolidated: bool,
) -> Any:
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        return {"error": "; ".join(errors)}
    pieces = [p for r in reports for p in r["pieces"]]
    manifest = build_manifest(
        optimizer,
        sharding,
        pieces,
        [f for r in reports for f in r["files"]],
        CONSOLIDATED if consolidated else PER_RANK,
    )
    storage.write_text_atomic(staging / MANIFEST_NAME, manifest.to_json())
    storage.fsync_dir(staging)
    storage.swap_in(staging, final)
    return "committed"


def build_manifest(
    optimizer: Muon,
    sharding: Sharding,
    pieces: list[dict[str, Any]],
    files: list[dict[str, Any]],
    kind: str,
) -> Manifest:
    dtypes = {p["param"]: p["dtype"] for p in pieces}
    keys: dict[str, set[str]] = {}
    for p in pieces:
        keys.setdefault(p["param"], set()).add(p["key"])
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
        checksum_algorithm=storage.CHECKSUM_ALGORITHM,
        groups=tuple(groups),
        params=tuple(params),
        files=tuple(FileEntry(f["name"], f["bytes"]) for f in files),
        pieces=tuple(
            Piece(
                param=p["param"],
                key=p["key"],
                file=p["file"],
                tensor=p["tensor"],
                region=_region(p["region"]),
                checksums=tuple(p["checksums"]),
                chunk_bytes=p["chunk_bytes"],
            )
            for p in pieces
        ),
    )


def _region(raw: dict[str, int]) -> Any:
    from .layout import Region

    return Region(**raw)


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The parsed, schema-checked manifest of the checkpoint at ``path``."""
    directory = Path(path)
    manifest_path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise CheckpointError("no checkpoint directory", path=directory)
    if _STAGING_NAME.match(directory.name):
        raise CheckpointError(
            "incomplete: a staging directory left by an interrupted save, not a checkpoint",
            path=directory,
        )
    if not manifest_path.is_file():
        raise CheckpointError(
            "incomplete checkpoint: no manifest.json (the save was interrupted or is not done)",
            path=manifest_path,
        )
    return parse_manifest(storage.read_text(manifest_path), manifest_path)


class PieceReader:
    """Reads pieces of a checkpoint with checksums, keeping each needed file open once."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = directory
        self.manifest = manifest
        self._stack = ExitStack()
        self._readers: dict[str, storage.SafetensorsReader] = {}
        self._sizes = {f.name: f.bytes for f in manifest.files}

    def __enter__(self) -> PieceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def reader(self, file: str) -> storage.SafetensorsReader:
        if file not in self._readers:
            path = self.directory / file
            if not path.is_file():
                raise CheckpointError("missing data file", path=path)
            if path.stat().st_size != self._sizes[file]:
                raise CheckpointError(
                    f"file is {path.stat().st_size} bytes, the manifest says {self._sizes[file]}"
                    " (truncated or replaced)",
                    path=path,
                )
            self._readers[file] = self._stack.enter_context(storage.SafetensorsReader(path))
        return self._readers[file]

    def check_header(self, piece: Piece, entry: ParamEntry) -> storage.TensorRecord:
        reader = self.reader(piece.file)
        if piece.tensor not in reader:
            raise CheckpointError(
                f"tensor {piece.tensor!r} missing from the file",
                path=reader.path,
                param=piece.param,
            )
        record = reader.record(piece.tensor)
        if record.dtype != entry.dtype or record.numel != piece.region.numel:
            raise CheckpointError(
                f"header says {record.dtype} x {record.numel} elements, the manifest "
                f"{entry.dtype} x {piece.region.numel}",
                path=reader.path,
                param=piece.param,
            )
        return record

    def read_into(
        self, local: torch.Tensor, piece: Piece, runs: list[Run], entry: ParamEntry
    ) -> None:
        """Copy ``runs`` of ``piece`` into flat ``local``, reading only the span they touch."""
        self.check_header(piece, entry)
        lo = min(r.src for r in runs)
        hi = max(r.src + r.length for r in runs)
        data = self.reader(piece.file).read(
            piece.tensor, lo, hi, checksums=piece.checksums, chunk_bytes=piece.chunk_bytes
        )
        copy_runs_(local, data, [Run(r.src - lo, r.dst, r.length) for r in runs])


def load(optimizer: Muon, path: str | os.PathLike[str]) -> None:
    """Load a checkpoint of any kind and source topology into ``optimizer`` at its topology.

    Every rank reads the manifest and then only the bytes of the pieces overlapping its own
    share, verifying their checksums; memory is its share plus one piece span in flight.
    Raises :class:`CheckpointError` naming the file and param on any damage or mismatch.
    """
    directory = Path(path)
    manifest = read_manifest(directory)
    problems = manifest.coverage_problems()
    if problems:
        raise CheckpointError(problems[0], path=directory / MANIFEST_NAME)
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
                key: _read_share(reader, grouped[entry.name, key], entry, param).reshape(p.shape)
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


def _read_share(
    reader: PieceReader, pieces: list[Piece], entry: ParamEntry, param: ParamSharding
) -> torch.Tensor:
    local = torch.empty(param.local.numel, dtype=storage.torch_dtype(entry.dtype))
    filled = 0
    for piece in pieces:
        runs = copy_runs(piece.region, param.local)
        if runs:
            reader.read_into(local, piece, runs, entry)
            filled += sum(r.length for r in runs)
    if filled != local.numel():
        raise CheckpointError(
            f"pieces cover {filled} of the {local.numel()} elements this rank needs",
            path=reader.directory / MANIFEST_NAME,
            param=entry.name,
        )
    return local


def verify(path: str | os.PathLike[str]) -> list[CheckpointError]:
    """Every problem found in the checkpoint at ``path`` (empty: sound). Reads all data once."""
    directory = Path(path)
    try:
        manifest = read_manifest(directory)
    except CheckpointError as exc:
        return [exc]
    problems: list[CheckpointError] = [
        CheckpointError(p, path=directory / MANIFEST_NAME) for p in manifest.coverage_problems()
    ]
    problems += _topology_problems(manifest, directory)
    known = {f.name for f in manifest.files} | {MANIFEST_NAME, INDEX_FILE}
    for extra in sorted(p.name for p in directory.iterdir() if p.name not in known):
        problems.append(
            CheckpointError("unknown file in the checkpoint directory", path=directory / extra)
        )
    with PieceReader(directory, manifest) as reader:
        for piece in manifest.pieces:
            try:
                entry = manifest.param(piece.param)
                reader.check_header(piece, entry)
                reader.reader(piece.file).read(
                    piece.tensor, checksums=piece.checksums, chunk_bytes=piece.chunk_bytes
                )
            except CheckpointError as exc:
                problems.append(exc)
    return _unique(problems)


def _topology_problems(manifest: Manifest, directory: Path) -> list[CheckpointError]:
    if manifest.kind != PER_RANK:
        return []
    world = manifest.topology.get("dp", 0) * manifest.topology.get("tp", 0)
    expected = {rank_file(r, world) for r in range(world)}
    listed = {f.name for f in manifest.files}
    if listed != expected:
        return [
            CheckpointError(
                f"the manifest's topology {manifest.topology} implies {world} rank files, "
                f"it lists {len(listed)}: {sorted(listed)[:4]}",
                path=directory / MANIFEST_NAME,
            )
        ]
    return []


def _unique(problems: list[CheckpointError]) -> list[CheckpointError]:
    seen, out = set(), []
    for problem in problems:
        if str(problem) not in seen:
            seen.add(str(problem))
            out.append(problem)
    return out
