"""Checkpoint directories without torch: names, manifest, and verified reads of pieces.

What the offline tools need to read any checkpoint, kept free of torch so that ``muonckpt
consolidate`` and ``reshard`` start in a fraction of a second and stay small: the file-name
conventions, :func:`open_checkpoint` (manifest, sizes and coverage checked),
:class:`PieceReader`, which gathers any region of a param's state as raw bytes from whichever
pieces hold it, verifying checksums, and :func:`verify` (file access through
:mod:`muonckpt.storage`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

import numpy as np

from . import storage
from .errors import CheckpointError
from .layout import Region, Strided, strided_runs
from .manifest import (
    CONSOLIDATED,
    MANIFEST_NAME,
    PARAM_KEY,
    PER_RANK,
    Manifest,
    ParamEntry,
    Piece,
    parse_manifest,
)

STATE_STEM = "optimizer"
"""Consolidated state goes to ``optimizer.safetensors`` (or ``optimizer-0000i-of-0000N``)."""
VALUE_STEM = "model"
"""Consolidated param values go to ``model.safetensors``, keyed by param name, as HF has it."""
CONSOLIDATED_FILE = f"{STATE_STEM}.safetensors"
INDEX_FILE = f"{STATE_STEM}.safetensors.index.json"
MODEL_FILE = f"{VALUE_STEM}.safetensors"
MODEL_INDEX_FILE = f"{VALUE_STEM}.safetensors.index.json"
_STAGING_NAME = re.compile(rf"^\..+\.({storage.STAGING_TAG}-[0-9a-f]{{8}}|old-\d+)$")


def tensor_key(param: str, key: str) -> str:
    """The key a stored tensor has in its file: the param's name for its values, else torch's
    flattened optimizer-state key ``state.<param name>.<state key>``."""
    return param if key == PARAM_KEY else f"state.{param}.{key}"


def index_file(stem: str) -> str:
    return f"{stem}.safetensors.index.json"


def stem_of(key: str) -> str:
    """The consolidated file family of a stored tensor: values to ``model``, state to
    ``optimizer``."""
    return VALUE_STEM if key == PARAM_KEY else STATE_STEM


def unique_tensor_keys(items: Iterator[tuple[str, str]], where: object) -> None:
    """Refuse (param, key) pairs whose file keys collide (a param named like another's state)."""
    seen: dict[str, tuple[str, str]] = {}
    for param, key in items:
        tkey = tensor_key(param, key)
        if tkey in seen and seen[tkey] != (param, key):
            raise CheckpointError(
                f"param {param!r} {key!r} and param {seen[tkey][0]!r} {seen[tkey][1]!r} would "
                f"both be stored as {tkey!r}: rename one",
                path=where,
            )
        seen[tkey] = (param, key)


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def piece_for(
    file: str, record: storage.TensorRecord, param: str, key: str, region: Region
) -> Piece:
    return Piece(
        param=param,
        key=key,
        file=file,
        tensor=record.key,
        region=region,
        checksums=record.checksums,
        chunk_bytes=record.chunk_bytes,
    )


T = TypeVar("T")
R = TypeVar("R")


def prefetched(items: Sequence[T], produce: Callable[[T], R]) -> Iterator[tuple[T, R]]:
    """``(item, produce(item))`` in order, producing the next item on a thread meanwhile.

    Reading (page-cache copies, xxhash) and writing (write, xxhash) both release the GIL, so a
    reader one tensor ahead of the writer keeps two cores busy. At most two produced values are
    alive, and ``produce`` for item ``i + 2`` starts only once the consumer is done with item
    ``i``: a :class:`PieceReader` with ``reuse_outputs=2`` can produce them.
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(produce, items[0]) if items else None
        for index, item in enumerate(items):
            value = pending.result()
            if index + 1 < len(items):
                pending = pool.submit(produce, items[index + 1])
            yield item, value
            del value


def consolidated_files(
    sizes: Mapping[tuple[str, str], int], max_shard_size: int | None
) -> tuple[list[tuple[str, list[tuple[str, str]]]], dict[str, str]]:
    """The files of a consolidated checkpoint, given each stored (param, key)'s bytes.

    Returns ``(file, its (param, key) pairs in tensor-key order)`` for every file, state files
    first, and the Hugging Face style index texts of the families that were split
    (see :func:`shard_files`). Values go to ``model*``, state to ``optimizer*``.
    """
    unique_tensor_keys(iter(sizes), None)
    files: list[tuple[str, list[tuple[str, str]]]] = []
    texts: dict[str, str] = {}
    for stem in (STATE_STEM, VALUE_STEM):
        by_tkey = {tensor_key(*item): item for item in sizes if stem_of(item[1]) == stem}
        if not by_tkey:
            continue
        family = {tkey: sizes[item] for tkey, item in by_tkey.items()}
        shards = shard_files(family, max_shard_size, stem)
        files += [(file, [by_tkey[k] for k in keys]) for file, keys in shards]
        if len(shards) > 1:
            texts[index_file(stem)] = shard_index(shards, family)
    return files, texts


def shard_files(
    sizes: Mapping[str, int], max_shard_size: int | None, stem: str = STATE_STEM
) -> list[tuple[str, list[str]]]:
    """(file name, sorted tensor keys) of each file of one family, given each key's bytes.

    Keys in sorted order fill a file up to ``max_shard_size`` bytes (a larger tensor gets a
    file of its own); one file, ``<stem>.safetensors``, without a limit or below it, else
    ``<stem>-0000i-of-0000N.safetensors``.
    """
    if max_shard_size is not None and max_shard_size <= 0:
        raise CheckpointError(f"max_shard_size must be positive, got {max_shard_size}")
    shards: list[list[str]] = [[]]
    used = 0
    for tkey in sorted(sizes):
        if max_shard_size is not None and shards[-1] and used + sizes[tkey] > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(tkey)
        used += sizes[tkey]
    if len(shards) == 1:
        return [(f"{stem}.safetensors", shards[0])]
    return [
        (f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors", keys)
        for i, keys in enumerate(shards)
    ]


def shard_index(shards: Sequence[tuple[str, Sequence[str]]], sizes: Mapping[str, int]) -> str:
    """The Hugging Face style ``<stem>.safetensors.index.json`` of sharded files."""
    index = {
        "metadata": {"total_size": sum(sizes.values())},
        "weight_map": {tkey: file for file, keys in shards for tkey in keys},
    }
    return json.dumps(index, indent=2) + "\n"


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
        if any(name.endswith(".safetensors") for name in storage.entries(directory)):
            raise CheckpointError(
                "incomplete checkpoint: data files but no manifest.json (the save was "
                "interrupted or is not done)",
                path=manifest_path,
            )
        raise CheckpointError(
            "not a muonckpt checkpoint: no manifest.json and no .safetensors files",
            path=directory,
        )
    return parse_manifest(storage.read_text(manifest_path), manifest_path)


def open_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, Manifest]:
    """The directory and manifest of a checkpoint whose pieces cover every state tensor once."""
    directory = Path(path)
    manifest = read_manifest(directory)
    problems = size_problems(manifest, directory)
    if problems:
        raise changed_while_reading(directory, manifest) or problems[0]
    problems = [
        CheckpointError(p, path=directory / MANIFEST_NAME) for p in manifest.coverage_problems()
    ]
    if problems:
        raise problems[0]
    return directory, manifest


def changed_while_reading(directory: Path, manifest: Manifest) -> CheckpointError | None:
    """The error to raise when the checkpoint's manifest is no longer ``manifest`` (a writer
    replaced the checkpoint while it was read), else None: a missing or resized data file is
    then a race, not damage."""
    try:
        now = read_manifest(directory)
    except CheckpointError:
        now = None
    if now is not None and (now.files, now.pieces) == (manifest.files, manifest.pieces):
        return None
    return CheckpointError(
        "the checkpoint changed while reading (another writer replaced it): read it again",
        path=directory / MANIFEST_NAME,
    )


def size_problems(manifest: Manifest, directory: Path) -> list[CheckpointError]:
    """Files that are symlinks, whose size differs from the manifest, or that are smaller than
    the pieces it puts in them (a checkpoint's data files are regular files of its own).

    Checked before coverage, so a manifest cannot make the coverage check walk regions larger
    than the data actually on disk.
    """
    problems = []
    claimed: dict[str, int] = {}
    for piece in manifest.pieces:
        itemsize = storage.itemsize(manifest.param(piece.param).dtype_of(piece.key))
        claimed[piece.file] = claimed.get(piece.file, 0) + piece.region.numel * itemsize
    for entry in manifest.files:
        path = directory / entry.name
        if path.is_symlink():
            problems.append(
                CheckpointError("is a symlink, not a file of this checkpoint", path=path)
            )
            continue
        if not path.is_file():
            problems.append(CheckpointError("missing data file", path=path))
            continue
        size = storage.file_size(path)
        if size != entry.bytes:
            problems.append(
                CheckpointError(
                    f"file is {size} bytes, the manifest says {entry.bytes} "
                    "(truncated or replaced)",
                    path=path,
                )
            )
        elif claimed.get(entry.name, 0) > size:
            problems.append(
                CheckpointError(
                    f"the manifest puts {claimed[entry.name]} bytes of tensors in a "
                    f"{size}-byte file",
                    path=path,
                )
            )
    return problems


class PieceReader:
    """Reads pieces of a checkpoint with checksums, keeping each needed file open once.

    With ``reuse_outputs=n``, :meth:`gather` returns views into a ring of ``n`` buffers that
    are reused, each result valid until ``n`` more gathers: streaming tools (which hold at most
    ``n`` results) then skip the page faults of fresh allocations, which on some machines cost
    several times the read itself.
    """

    def __init__(self, directory: Path, manifest: Manifest, *, reuse_outputs: int = 0) -> None:
        self.directory = directory
        self.manifest = manifest
        self._stack = ExitStack()
        self._readers: dict[str, storage.SafetensorsReader] = {}
        self._sizes = {f.name: f.bytes for f in manifest.files}
        self._ring = [np.empty(0, dtype=np.uint8) for _ in range(reuse_outputs)]
        self._turn = 0

    def __enter__(self) -> PieceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def reader(self, file: str) -> storage.SafetensorsReader:
        if file not in self._readers:
            path = self.directory / file
            if not path.is_file():
                changed = changed_while_reading(self.directory, self.manifest)
                raise changed or CheckpointError("missing data file", path=path)
            if path.stat().st_size != self._sizes[file]:
                changed = changed_while_reading(self.directory, self.manifest)
                raise changed or CheckpointError(
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
        dtype = entry.dtype_of(piece.key)
        if record.dtype != dtype or record.numel != piece.region.numel:
            raise CheckpointError(
                f"header says {record.dtype} x {record.numel} elements, the manifest "
                f"{dtype} x {piece.region.numel}",
                path=reader.path,
                param=piece.param,
            )
        full = self.manifest.kind == CONSOLIDATED  # stored at full shape, as load_file gives it
        if full and tuple(record.shape) != tuple(entry.shape):
            raise CheckpointError(
                f"header says shape {tuple(record.shape)}, the manifest {tuple(entry.shape)}",
                path=reader.path,
                param=piece.param,
            )
        return record

    def gather(
        self, pieces: Sequence[Piece], entry: ParamEntry, key: str, target: Region
    ) -> np.ndarray:
        """The raw bytes of ``target``'s elements of stored tensor ``key`` (in the region's own
        order), as a 1-D uint8 array, read from the pieces overlapping it and verified."""
        size = storage.itemsize(entry.dtype_of(key))
        out = self._output(target.numel * size)
        filled = 0
        for piece in pieces:
            groups = strided_runs(piece.region, target)
            if groups:
                self._read_groups(out, piece, groups, entry)
                filled += sum(g.length * g.count for g in groups)
        if filled != target.numel:
            raise CheckpointError(
                f"pieces cover {filled} of the {target.numel} elements needed",
                path=self.directory / MANIFEST_NAME,
                param=entry.name,
            )
        return out

    def _read_groups(
        self, out: np.ndarray, piece: Piece, groups: list[Strided], entry: ParamEntry
    ) -> None:
        self.check_header(piece, entry)
        self.reader(piece.file).read_groups(
            piece.tensor,
            memoryview(out),
            groups,
            checksums=piece.checksums,
            chunk_bytes=piece.chunk_bytes,
        )

    def _output(self, nbytes: int) -> np.ndarray:
        if not self._ring:
            return np.empty(nbytes, dtype=np.uint8)
        slot = self._turn % len(self._ring)
        self._turn += 1
        if self._ring[slot].nbytes < nbytes:
            self._ring[slot] = np.empty(nbytes, dtype=np.uint8)
        return self._ring[slot][:nbytes]


def verify(path: str | os.PathLike[str]) -> list[CheckpointError]:
    """Every problem found in the checkpoint at ``path`` (empty: sound). Reads all data once."""
    directory = Path(path)
    try:
        manifest = read_manifest(directory)
    except CheckpointError as exc:
        return [exc]
    try:
        problems = size_problems(manifest, directory)
    except CheckpointError as exc:
        return [exc]
    problems = problems or [
        CheckpointError(p, path=directory / MANIFEST_NAME) for p in manifest.coverage_problems()
    ]
    problems += _topology_problems(manifest, directory)
    known = {f.name for f in manifest.files} | {MANIFEST_NAME, INDEX_FILE, MODEL_INDEX_FILE}
    for extra in sorted(p.name for p in directory.iterdir() if p.name not in known):
        problems.append(
            CheckpointError("unknown file in the checkpoint directory", path=directory / extra)
        )
    with PieceReader(directory, manifest) as reader:
        for piece in manifest.pieces:
            try:
                entry = manifest.param(piece.param)
                reader.check_header(piece, entry)
                reader.reader(piece.file).verify(piece.tensor, piece.checksums, piece.chunk_bytes)
            except CheckpointError as exc:
                problems.append(exc)
    return _unique(problems)


def _topology_problems(manifest: Manifest, directory: Path) -> list[CheckpointError]:
    if manifest.kind != PER_RANK:
        return []
    world = manifest.topology.get("dp", 0) * manifest.topology.get("tp", 0)
    listed = {f.name for f in manifest.files}
    if len(listed) != world or listed != {rank_file(r, world) for r in range(world)}:
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
