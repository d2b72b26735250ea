"""What a checkpoint write puts where, decided before any tensor is written: pure, no torch,
no files.

Every way of producing a checkpoint (``save`` per rank or consolidated, ``consolidate``,
``reshard``, ``convert``) first builds a :class:`WritePlan`, the counterpart of DCP's
``SavePlan``: the output files, and for every output tensor which elements (a
:class:`~muonckpt.layout.topology.Region` of the full tensor) of which param's state it holds, with
its dtype and stored shape. The plan is checked when it is made; :mod:`muonckpt.files.writing`
then writes it and commits the directory, the same way for every source of bytes. Between two
layouts a plan is the design's one idea: a copy plan from the pieces that hold the elements
to the pieces that will.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import pairwise

from ..errors import CheckpointError
from ..layout.topology import Region, whole_region
from ..settings import shard_size
from .manifest import DTYPE_BYTES, FORMAT_NAME, Piece
from .names import PARAM_KEY, STATE_STEM, VALUE_STEM, index_file, rank_file, stem_of, tensor_key

Item = tuple[str, str, str]
"""``(param, key, safetensors dtype)`` of one stored tensor."""


@dataclass(frozen=True, slots=True)
class TensorWrite:
    """One output tensor: which elements of which param state go to which file.

    Slotted, its key made once and interned (a plan of 100k params holds 300k of them, and
    the key is also the source file's key and the output piece's)."""

    file: str
    param: str
    key: str
    """A state key, or :data:`~muonckpt.format.names.PARAM_KEY` for the param's own values."""
    dtype: str
    """safetensors dtype."""
    region: Region
    """The elements of the full tensor it holds, in stored order."""
    shape: tuple[int, ...]
    """Its shape in the file: the full shape (consolidated) or ``(region.numel,)``."""
    scale: float = 1.0
    """Factor applied to the values on their way (``convert``: momentum between forms)."""
    tensor: str = field(init=False)
    """Its key in the file."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensor", _file_key(self.param, self.key))

    @property
    def nbytes(self) -> int:
        return self.region.numel * DTYPE_BYTES[self.dtype]

    def piece(self, digests: bytes, chunk_bytes: int) -> Piece:
        """Its manifest entry once written, with the (packed) checksums of its data."""
        return Piece(
            param=self.param,
            key=self.key,
            file=self.file,
            tensor=self.tensor,
            region=self.region,
            digests=digests,
            chunk_bytes=chunk_bytes,
        )


@dataclass(frozen=True)
class WritePlan:
    """Every file and tensor one write produces, checked on construction.

    ``writes`` come file by file in the order of ``files``, tensor keys sorted within a file
    (the order a safetensors header has them, so each file is written front to back).
    """

    files: dict[str, dict[str, str]]
    """Output file -> its safetensors metadata, in manifest order."""
    writes: tuple[TensorWrite, ...]
    texts: dict[str, str] = field(default_factory=dict)
    """Small extra files (the Hugging Face index of sharded files)."""

    def __post_init__(self) -> None:
        _unique_keys(((w.param, w.key, w.tensor) for w in self.writes), None)
        in_file: dict[str, list[TensorWrite]] = {file: [] for file in self.files}
        for w in self.writes:
            if (
                w.file not in in_file
                or w.dtype not in DTYPE_BYTES
                or math.prod(w.shape) != w.region.numel
            ):
                self._refuse()
            in_file[w.file].append(w)
        ordered = [w for writes in in_file.values() for w in sorted(writes, key=_tensor)]
        if any(a.tensor == b.tensor and a.file == b.file for a, b in pairwise(ordered)):
            self._refuse()
        object.__setattr__(self, "writes", tuple(ordered))

    def _refuse(self) -> None:
        """Raise the first problem of the writes, in their order (there is one)."""
        order = {file: i for i, file in enumerate(self.files)}
        placed: set[tuple[str, str]] = set()
        for w in self.writes:
            if w.file not in order:
                raise CheckpointError(f"planned a tensor into an unplanned file {w.file!r}")
            if w.dtype not in DTYPE_BYTES:
                raise CheckpointError(f"unknown safetensors dtype {w.dtype!r}", param=w.param)
            if math.prod(w.shape) != w.region.numel:
                raise CheckpointError(
                    f"{w.key!r}: stored shape {w.shape} does not hold {w.region.numel} elements",
                    param=w.param,
                )
            if (w.file, w.tensor) in placed:
                raise CheckpointError(f"{w.tensor!r} planned twice in {w.file!r}", param=w.param)
            placed.add((w.file, w.tensor))

    @property
    def total_bytes(self) -> int:
        return sum(w.nbytes for w in self.writes)

    @property
    def count(self) -> int:
        return len(self.writes)

    def iter_writes(self) -> Iterator[TensorWrite]:
        return iter(self.writes)

    def specs(self, file: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The safetensors header of ``file``: tensor key -> (dtype, shape)."""
        return specs_of(self.by_file()[file])

    def by_file(self) -> dict[str, list[TensorWrite]]:
        """Each file's writes in order, files in order (a file may have none)."""
        return self._by_file

    @cached_property
    def _by_file(self) -> dict[str, list[TensorWrite]]:
        out: dict[str, list[TensorWrite]] = {file: [] for file in self.files}
        for w in self.writes:
            out[w.file].append(w)
        return out


def specs_of(writes: Iterable[TensorWrite]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The safetensors header of a file of these writes: tensor key -> (dtype, shape)."""
    return {w.tensor: (w.dtype, w.shape) for w in writes}


def _file_key(param: str, key: str) -> str:
    """:func:`~muonckpt.format.names.tensor_key`, interned: a rewrite's source pieces, its plan
    and its output name each tensor alike, one string for all (300k of them at 100k params)."""
    return sys.intern(tensor_key(param, key))


def unique_tensor_keys(items: Iterable[tuple[str, str]], where: object) -> None:
    """Refuse (param, key) pairs whose file keys collide (a param named like another's state)."""
    _unique_keys(((param, key, _file_key(param, key)) for param, key in items), where)


def _unique_keys(items: Iterable[tuple[str, str, str]], where: object) -> None:
    """:func:`unique_tensor_keys` of (param, key, its file key) triples. A file key and its
    param determine the key, so only the param is kept per file key (300k tuples less)."""
    seen: dict[str, str] = {}
    for param, key, tkey in items:
        first = seen.setdefault(tkey, param)
        if first != param:
            first_key = PARAM_KEY if tkey == first else tkey[len(tensor_key(first, "")) :]
            raise CheckpointError(
                f"param {param!r} {key!r} and param {first!r} {first_key!r} would "
                f"both be stored as {tkey!r}: rename one",
                path=where,
            )


def _tensor(write: TensorWrite) -> str:
    return write.tensor


def rank_plan(rank: int, world_size: int, owned: Iterable[tuple[Item, Region]]) -> WritePlan:
    """One rank's file of a per-rank checkpoint: each (param, key, dtype) with the region of
    the full tensor the rank holds, stored flat."""
    file = rank_file(rank, world_size)
    shapes: dict[int, tuple[int]] = {}  # equal shapes one tuple
    regions: dict[Region, Region] = {}  # and equal regions one region (many params alike)
    writes = tuple(
        TensorWrite(
            file,
            param,
            key,
            dtype,
            regions.setdefault(region, region),
            shapes.setdefault(region.numel, (region.numel,)),
        )
        for (param, key, dtype), region in owned
    )
    return WritePlan({file: {"format": FORMAT_NAME, "rank": str(rank)}}, writes)


class PerRankPlan:
    """Every rank's file of a per-rank checkpoint, each file's writes made (:func:`rank_plan`,
    checked as a :class:`WritePlan` is) when that file is written and let go after: a reshard to
    thousands of ranks of a model of 70k params plans a million tensors, which as objects held
    at once took about 100 MB. ``owned(r)`` is what rank ``r`` holds, each call anew.

    What a :class:`WritePlan` offers, but :attr:`writes` (every file's writes in a tuple, for
    the paths that split the writes among processes) is made when asked for."""

    def __init__(self, world_size: int, owned: Callable[[int], Iterable[tuple[Item, Region]]]):
        self.world_size, self._owned = world_size, owned
        self.files = {
            rank_file(r, world_size): {"format": FORMAT_NAME, "rank": str(r)}
            for r in range(world_size)
        }
        self.texts: dict[str, str] = {}
        self._rank = {file: r for r, file in enumerate(self.files)}
        self._recent: dict[str, WritePlan] = {}

    def plan_of(self, file: str) -> WritePlan:
        """``file``'s plan; the last two made are kept, so that the writer and the producer
        of the tensors it pulls (one file ahead, at most) each walking the plan make it once."""
        made = self._recent.get(file)
        if made is None:
            made = rank_plan(self._rank[file], self.world_size, self._owned(self._rank[file]))
            self._recent = {**dict(list(self._recent.items())[-1:]), file: made}
        return made

    def by_file(self) -> Mapping[str, Sequence[TensorWrite]]:
        """Each file's writes, made as each file is looked up."""
        return _FilesOf(self)

    def specs(self, file: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        return self.plan_of(file).specs(file)

    def iter_writes(self) -> Iterator[TensorWrite]:
        for file in self.files:
            yield from self.plan_of(file).writes

    @property
    def writes(self) -> tuple[TensorWrite, ...]:
        return tuple(self.iter_writes())

    @property
    def total_bytes(self) -> int:
        return sum(w.nbytes for w in self.iter_writes())

    @property
    def count(self) -> int:
        return sum(1 for _ in self.iter_writes())


class _FilesOf(Mapping[str, Sequence[TensorWrite]]):
    def __init__(self, plan: PerRankPlan) -> None:
        self._plan = plan

    def __getitem__(self, file: str) -> Sequence[TensorWrite]:
        return self._plan.plan_of(file).writes

    def __iter__(self) -> Iterator[str]:
        return iter(self._plan.files)

    def __len__(self) -> int:
        return len(self._plan.files)


Plan = WritePlan | PerRankPlan
"""What :mod:`muonckpt.files.writing` writes: a plan made whole, or one per-rank file at a
time."""


def consolidated_plan(
    items: Iterable[tuple[Item, tuple[int, ...]]],
    max_shard_size: int | None,
    model_metadata: Mapping[str, str] | None = None,
) -> WritePlan:
    """The files of a consolidated checkpoint: each (param, key, dtype) whole, in its full
    shape.

    State goes to ``optimizer.safetensors`` as ``state.<param>.<key>``, values to
    ``model.safetensors`` under the param's name; past ``max_shard_size`` bytes a family is
    split HF style (:func:`shard_files`) with its index among the plan's texts.
    ``model_metadata`` (tied names: alias -> stored name) goes into every ``model`` file's
    header beside ``format``.
    """
    if model_metadata and "format" in model_metadata:
        raise CheckpointError("a tied name 'format' would overwrite the file's format metadata")
    shapes = {item: tuple(shape) for item, shape in items}
    unique_tensor_keys(((param, key) for param, key, _ in shapes), None)
    files: dict[str, dict[str, str]] = {}
    writes: list[TensorWrite] = []
    texts: dict[str, str] = {}
    wholes: dict[int, Region] = {}
    for stem in (STATE_STEM, VALUE_STEM):
        family = {_file_key(p, k): (p, k, d) for p, k, d in shapes if stem_of(k) == stem}
        if not family:
            continue
        sizes = {
            tkey: math.prod(shapes[item]) * DTYPE_BYTES[item[2]] for tkey, item in family.items()
        }
        shards = shard_files(sizes, max_shard_size, stem)
        for file, keys in shards:
            extra = dict(model_metadata or {}) if stem == VALUE_STEM else {}
            files[file] = {**extra, "format": FORMAT_NAME}
            for tkey in keys:
                param, key, dtype = family[tkey]
                shape = shapes[param, key, dtype]
                numel = math.prod(shape)
                region = wholes.setdefault(numel, whole_region(numel))  # one per size, shared
                writes.append(TensorWrite(file, param, key, dtype, region, shape))
        if len(shards) > 1:
            texts[index_file(stem)] = shard_index(shards, sizes)
    return WritePlan(files, tuple(writes), texts)


def shard_files(
    sizes: Mapping[str, int], max_shard_size: int | None, stem: str = STATE_STEM
) -> list[tuple[str, list[str]]]:
    """(file name, sorted tensor keys) of each file of one family, given each key's bytes.

    Keys in sorted order fill a file up to ``max_shard_size`` bytes (a larger tensor gets a
    file of its own); one file, ``<stem>.safetensors``, without a limit or below it, else
    ``<stem>-0000i-of-0000N.safetensors``.
    """
    max_shard_size = shard_size(max_shard_size)
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
