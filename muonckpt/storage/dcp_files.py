"""PyTorch Distributed Checkpoint (DCP) directories: read safely, write through torch's writer.

DCP pickles its ``.metadata``. It is read here only through :class:`_MetadataUnpickler`,
which admits the classes DCP's metadata is made of (:data:`ADMITTED`) and refuses any other
before anything of it runs; then every field muonckpt uses is type- and range-checked
(:func:`read_index`) before any of it is used. Every file is opened as muonckpt opens its
own (:func:`~muonckpt.storage.durable.open_regular`: no FIFO, device or symlink). Tensor data
is read by the byte ranges the metadata gives, each range through
``torch.load(weights_only=True)`` as torch's own reader does; other values (param-group
settings) likewise. The ranges may not overlap and each chunk's must hold at least the bytes
its declared shape needs, and a chunk read is a dense tensor whose storage is exactly those
bytes (never a stride-0 expansion or a view into more): what is read never exceeds what the
directory holds. DCP is written only by ``torch.distributed.checkpoint.save``
with a ``FileSystemWriter``, in this process, without a process group, each tensor fetched
when the writer reaches it.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
import pickle
import reprlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..format.names import MANIFEST_NAME
from . import lease
from .dtypes import dtype_name, itemsize, torch_dtype, torch_dtype_names
from .durable import open_failure, open_regular

if TYPE_CHECKING:
    import torch

METADATA_NAME = ".metadata"
"""The pickled metadata file that makes a directory a DCP checkpoint."""
DATA_SUFFIX = ".distcp"
MAX_METADATA_BYTES = 1 << 30
MAX_COUNT = (1 << 63) - 1
"""The largest size, offset or length a metadata field may give (torch's int64)."""

_METADATA_CLASSES = (
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)
ADMITTED: dict[str, tuple[str, ...]] = {
    "torch.distributed.checkpoint.metadata": _METADATA_CLASSES,
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),
    "pathlib": ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"),
    "collections": ("OrderedDict",),
}
"""module -> the names a DCP ``.metadata`` may use; besides these, torch's dtypes."""


@dataclass(frozen=True)
class Chunk:
    """One stored block of a tensor: where it sits in the full tensor, and its bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    """safetensors dtype name."""
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class DcpValue:
    """A non-tensor item (a setting, a scheduler's state): ``torch.save``d bytes."""

    fqn: str
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpIndex:
    """What a DCP checkpoint holds, from its metadata: tensors and other values by fqn."""

    directory: Path
    tensors: dict[str, DcpTensor]
    values: dict[str, DcpValue]


def is_dcp(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DCP checkpoint directory (it has a ``.metadata``)."""
    return Path(path, METADATA_NAME).is_file()


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any global outside :data:`ADMITTED` is refused unresolved."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        import importlib

        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name not in ADMITTED.get(module, ()):
            raise CheckpointError(
                f"DCP metadata names {module}.{name}, which is not a class DCP metadata is "
                "made of; refusing to unpickle it (nothing of it was run)",
                path=self.path,
            )
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError("DCP metadata holds a persistent id; refused", path=self.path)


def read_index(directory: str | os.PathLike[str]) -> DcpIndex:
    """Read a DCP checkpoint's ``.metadata`` safely into a :class:`DcpIndex`, every field
    muonckpt uses checked before any is used: its type and range, the chunks' geometry (in
    bounds, together covering their tensor once), and their byte ranges (within their files,
    apart from each other, each at least the bytes its chunk's shape needs).

    Raises:
        CheckpointError: one line naming the file and the field, for a missing metadata (an
            incomplete DCP checkpoint when ``.distcp`` files are there), a foreign class, a
            field of a wrong type or out of range, a data file that is not a regular file of
            the directory's own, or one too short for what it is said to hold.
    """
    directory = Path(directory)
    path = directory / METADATA_NAME
    metadata = _unpickled(directory, path)
    from torch.distributed.checkpoint import metadata as dcp_metadata

    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"holds a {type(metadata).__name__}, not DCP Metadata", path=path)
    fields = _Fields(path)
    storage = _storage_entries(fields, directory, metadata)
    tensors, values = {}, {}
    items = fields.mapping(fields.get(metadata, "state_dict_metadata"), "state_dict_metadata")
    for fqn, item in items.items():
        at = f"state_dict_metadata[{_shown(fqn)}]"
        fqn = fields.text(fqn, f"a key of state_dict_metadata ({at})")
        if isinstance(item, dcp_metadata.BytesStorageMetadata):
            file, offset, length = _stored(fields, storage, fqn, None)
            values[fqn] = DcpValue(fqn, file, offset, length)
        elif isinstance(item, dcp_metadata.TensorStorageMetadata):
            tensors[fqn] = _tensor(fields, storage, fqn, item, at)
        else:
            raise fields.wrong(at, item, "TensorStorageMetadata or BytesStorageMetadata")
    return DcpIndex(directory, tensors, values)


def _unpickled(directory: Path, path: Path) -> Any:
    """The unpickled ``.metadata`` (only :data:`ADMITTED` classes), opened as muonckpt opens
    its own files."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise _no_metadata(directory) from None
    except OSError as exc:
        why = open_failure(exc)
        raise CheckpointError(f"cannot read the DCP metadata: {why}", path=path) from None
    with os.fdopen(fd, "rb") as f:
        try:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_METADATA_BYTES:
                raise CheckpointError(f"is {size} bytes, over {MAX_METADATA_BYTES}", path=path)
            return _MetadataUnpickler(f, path).load()
        except CheckpointError:
            raise
        except OSError as exc:
            raise CheckpointError(
                f"cannot read the DCP metadata: {exc.strerror}", path=path
            ) from None
        except Exception as exc:
            raise CheckpointError(
                f"is not DCP metadata: {type(exc).__name__}: {_one_line(exc)}", path=path
            ) from None


def _no_metadata(directory: Path) -> CheckpointError:
    """The refusal of a directory without ``.metadata``: a muonckpt checkpoint, what DCP
    leaves of a save that did not finish (its ``.distcp`` files), or not DCP at all."""
    try:
        with os.scandir(directory) as entries:
            names = [entry.name for entry in entries]
    except OSError as exc:
        return CheckpointError(f"cannot read the directory: {exc.strerror}", path=directory)
    if MANIFEST_NAME in names:
        return CheckpointError(
            f"a muonckpt checkpoint, not DCP (no {METADATA_NAME}): it records what saved it, "
            "convert it without --from (source)",
            path=directory,
        )
    if any(name.endswith(DATA_SUFFIX) for name in names):
        return CheckpointError(
            f"an incomplete DCP checkpoint: no {METADATA_NAME} beside its {DATA_SUFFIX} files "
            "(DCP writes it last: the save did not finish)",
            path=directory,
        )
    return CheckpointError(f"not a DCP checkpoint: no {METADATA_NAME}", path=directory)


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80


def _shown(value: Any) -> str:
    """A metadata value in a message: short, one line, a foreign object by its type only."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return _SHOWN.repr(value)
    return f"a {type(value).__name__}"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


class _Fields:
    """Type and range checks of the unpickled metadata's fields; a refusal names the field."""

    _ABSENT = object()

    def __init__(self, path: Path) -> None:
        self.path = path

    def wrong(self, field: str, value: Any, wanted: str) -> CheckpointError:
        return CheckpointError(
            f"DCP metadata field {field} is {_shown(value)}, not {wanted}", path=self.path
        )

    def get(self, obj: Any, name: str, field: str = "") -> Any:
        """The field ``name`` of the metadata object ``obj`` (at ``field``)."""
        value = getattr(obj, name, self._ABSENT)
        if value is self._ABSENT:
            where = f"{field}.{name}" if field else name
            raise CheckpointError(f"DCP metadata field {where} is missing", path=self.path)
        return value

    def of(self, value: Any, cls: type, field: str) -> Any:
        if not isinstance(value, cls):
            raise self.wrong(field, value, cls.__name__)
        return value

    def mapping(self, value: Any, field: str) -> dict[Any, Any]:
        return self.of(value, dict, field)  # type: ignore[no-any-return]

    def text(self, value: Any, field: str) -> str:
        return self.of(value, str, field)  # type: ignore[no-any-return]

    def count(self, value: Any, field: str) -> int:
        if type(value) is not int or not 0 <= value <= MAX_COUNT:
            raise self.wrong(field, value, f"a count (an int from 0 to {MAX_COUNT})")
        return value

    def counts(self, value: Any, field: str) -> tuple[int, ...]:
        if not isinstance(value, (tuple, list)):
            raise self.wrong(field, value, "a tuple of counts")
        return tuple(self.count(v, f"{field}[{i}]") for i, v in enumerate(value))


Stored = tuple[str, int, int]
"""Where an item's bytes are: (file name, offset, length)."""


def _storage_entries(
    fields: _Fields, directory: Path, metadata: Any
) -> dict[tuple[str, tuple[int, ...] | None], Stored]:
    """``storage_data`` checked: (fqn, chunk offsets or None) -> where its bytes are, each range
    within its file (a regular file of the directory's own) and apart from every other."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    entries = fields.mapping(fields.get(metadata, "storage_data"), "storage_data")
    storage: dict[tuple[str, tuple[int, ...] | None], Stored] = {}
    for i, (key, info) in enumerate(entries.items()):
        at = f"storage_data key {i}"
        fields.of(key, MetadataIndex, at)
        fqn = fields.text(fields.get(key, "fqn", at), f"{at}.fqn")
        offset = fields.get(key, "offset", at)
        offsets = None if offset is None else fields.counts(offset, f"{at}.offset")
        at = f"storage_data[{_shown(fqn)}{'' if offsets is None else f' at {list(offsets)}'}]"
        fields.of(info, _StorageInfo, at)
        name = fields.text(fields.get(info, "relative_path", at), f"{at}.relative_path")
        if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise fields.wrong(f"{at}.relative_path", name, "a plain file name")
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and (not isinstance(transforms, (list, tuple)) or transforms):
            raise CheckpointError(
                f"item {fqn!r} is stored transformed ({_shown(transforms)}); muonckpt reads "
                "plain DCP only",
                path=fields.path,
            )
        start = fields.count(fields.get(info, "offset", at), f"{at}.offset")
        length = fields.count(fields.get(info, "length", at), f"{at}.length")
        storage[fqn, offsets] = (name, start, length)
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for (fqn, _), (name, start, length) in storage.items():
        by_file.setdefault(name, []).append((start, start + length, fqn))
    for name, ranges in by_file.items():
        path = directory / name
        with _data_file(directory, name, f"the data of {ranges[0][2]!r}") as (_, size):
            pass
        ranges.sort()
        for start, end, fqn in ranges:
            if end > size:
                raise CheckpointError(
                    f"DCP item {fqn!r} is stored at bytes [{start}, {end}), past the end of "
                    f"the file ({size} bytes): truncated",
                    path=path,
                )
        held = [r for r in ranges if r[1] > r[0]]
        for (start, end, fqn), (later, _, other) in itertools.pairwise(held):
            if later < end:
                raise CheckpointError(
                    f"DCP items {fqn!r} and {other!r} are stored in overlapping bytes "
                    f"([{start}, {end}) and from {later}): each item's bytes are its own",
                    path=path,
                )
    return storage


def _stored(
    fields: _Fields, storage: Mapping[Any, Stored], fqn: str, offsets: tuple[int, ...] | None
) -> Stored:
    stored = storage.get((fqn, offsets))
    if stored is None:
        at = "" if offsets is None else f" at {list(offsets)}"
        raise CheckpointError(f"item {fqn!r}{at} has no storage entry", path=fields.path)
    return stored


def _tensor(
    fields: _Fields, storage: Mapping[Any, Stored], fqn: str, item: Any, at: str
) -> DcpTensor:
    """A tensor item checked: a strided tensor of a dtype muonckpt stores, its chunks in
    bounds, covering it once, each stored in at least the bytes its shape needs."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    properties = fields.of(fields.get(item, "properties", at), TensorProperties, f"{at}.properties")
    dtype = fields.get(properties, "dtype", f"{at}.properties")
    if not isinstance(dtype, torch.dtype) or dtype not in torch_dtype_names():
        raise fields.wrong(f"{at}.properties.dtype", dtype, "a dtype safetensors stores")
    layout = fields.get(properties, "layout", f"{at}.properties")
    if layout is not torch.strided:
        raise fields.wrong(f"{at}.properties.layout", layout, "torch.strided (a dense tensor)")
    shape = fields.counts(fields.get(item, "size", at), f"{at}.size")
    listed = fields.get(item, "chunks", at)
    if not isinstance(listed, (list, tuple)):
        raise fields.wrong(f"{at}.chunks", listed, "a list of ChunkStorageMetadata")
    element = itemsize(dtype_name(dtype))
    chunks = []
    for i, chunk in enumerate(listed):
        where = f"{at}.chunks[{i}]"
        fields.of(chunk, ChunkStorageMetadata, where)
        offsets = fields.counts(fields.get(chunk, "offsets", where), f"{where}.offsets")
        sizes = fields.counts(fields.get(chunk, "sizes", where), f"{where}.sizes")
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or any(o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True))
        ):
            raise CheckpointError(
                f"DCP metadata field {where} (offsets {list(offsets)}, sizes {list(sizes)}) "
                f"lies outside its tensor's size {list(shape)}",
                path=fields.path,
            )
        file, offset, length = _stored(fields, storage, fqn, offsets)
        if length < math.prod(sizes) * element:
            raise CheckpointError(
                f"DCP metadata field {where}: sizes {list(sizes)} need "
                f"{math.prod(sizes) * element} bytes, its storage entry holds {length}",
                path=fields.path,
            )
        chunks.append(Chunk(offsets, sizes, file, offset, length))
    _check_cover(fields, fqn, shape, chunks)
    return DcpTensor(fqn, shape, dtype_name(dtype), tuple(chunks))


MAX_CHUNK_CELLS = 1 << 24
"""The most blocks a tensor's chunk boundaries may cut it into (the cover check's grid)."""


def _check_cover(fields: _Fields, fqn: str, shape: tuple[int, ...], chunks: list[Chunk]) -> None:
    """The chunks cover the tensor's every element once: they hold its element count, and no
    two overlap (each marks the blocks between all chunks' boundaries it covers, once)."""
    import numpy as np

    total = sum(math.prod(c.sizes) for c in chunks)
    if total != math.prod(shape):
        raise CheckpointError(
            f"DCP item {fqn!r}: its chunks hold {total} of its {math.prod(shape)} elements",
            path=fields.path,
        )
    boxes = [c for c in chunks if math.prod(c.sizes)]
    cuts = [
        sorted({0, n, *(c.offsets[d] for c in boxes), *(c.offsets[d] + c.sizes[d] for c in boxes)})
        for d, n in enumerate(shape)
    ]
    if math.prod(len(cut) - 1 for cut in cuts) > MAX_CHUNK_CELLS:
        raise CheckpointError(
            f"DCP item {fqn!r}: its {len(chunks)} chunks cut it into more than "
            f"{MAX_CHUNK_CELLS} blocks (a DCP save's chunks form a grid)",
            path=fields.path,
        )
    position = [{cut: i for i, cut in enumerate(dim)} for dim in cuts]
    covered = np.zeros([len(cut) - 1 for cut in cuts], dtype=bool)
    for chunk in boxes:
        spans = zip(position, chunk.offsets, chunk.sizes, strict=True)
        box = tuple(slice(at[o], at[o + s]) for at, o, s in spans)
        if covered[box].any():
            raise CheckpointError(f"DCP item {fqn!r}: two of its chunks overlap", path=fields.path)
        covered[box] = True


class _Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a file of their own."""

    def __init__(self, file: Any, offset: int, length: int) -> None:
        self.file, self.start, self.length, self.pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        count = min(len(view), self.length - self.pos)
        if count <= 0:
            return 0
        self.file.seek(self.start + self.pos)
        got = self.file.readinto(view[:count])
        self.pos += got
        return got


@contextlib.contextmanager
def _data_file(directory: Path, name: str, what: str) -> Iterator[tuple[Any, int]]:
    """The data file ``name`` open, with its size: a regular file of the directory's own,
    opened as muonckpt opens its own (never a FIFO, device or symlink)."""
    path = directory / name
    try:
        fd = open_regular(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {what}: {open_failure(exc)}", path=path) from None
    with os.fdopen(fd, "rb") as f:
        yield f, os.fstat(fd).st_size


def _load_range(directory: Path, file: str, offset: int, length: int, what: str) -> Any:
    """``torch.load(weights_only=True)`` of one stored item's byte range."""
    import torch

    with _data_file(directory, file, what) as (f, size):
        path = directory / file
        if offset + length > size:
            raise CheckpointError(
                f"{what} is stored at bytes [{offset}, {offset + length}), past the end of "
                f"the file ({size} bytes): truncated",
                path=path,
            )
        try:
            return torch.load(
                io.BufferedReader(_Slice(f, offset, length)), map_location="cpu", weights_only=True
            )
        except OSError as exc:
            raise CheckpointError(f"cannot read {what}: {exc.strerror}", path=path) from None
        except Exception as exc:
            raise CheckpointError(
                f"{what} cannot be read: {type(exc).__name__}: {_one_line(exc)}", path=path
            ) from None


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` and ``strides`` covers each element of its span exactly
    once, in any order of its dimensions (row-major, column-major, any permutation: what
    ``torch.save`` keeps of a tensor whose storage is exactly its own); never a stride-0
    expansion or an overlapping view."""
    if 0 in shape:
        return True  # no element: nothing stored
    expected = 1
    spans = sorted((p for p in zip(shape, strides, strict=True) if p[0] != 1), key=lambda p: p[1])
    for size, stride in spans:
        if stride != expected:
            return False
        expected *= size
    return True


def read_tensor(index: DcpIndex, item: DcpTensor) -> torch.Tensor:
    """The full tensor ``item``, assembled from its chunks (their geometry was checked by
    :func:`read_index`; each read must be a dense tensor of its chunk's shape and dtype whose
    storage is exactly its bytes: never a stride-0 expansion of fewer bytes, nor a view into
    more).

    Memory: the full tensor plus one chunk, the tensor never more than its stored bytes."""
    import torch

    what = f"DCP item {item.fqn!r}"
    dtype = torch_dtype(item.dtype)
    full = None
    for chunk in item.chunks:
        value = _load_range(index.directory, chunk.file, chunk.offset, chunk.length, what)
        path = index.directory / chunk.file
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != chunk.sizes:
            raise CheckpointError(
                f"{what}: a chunk does not hold a tensor of {list(chunk.sizes)}", path=path
            )
        if value.dtype != dtype:
            raise CheckpointError(
                f"{what}: a chunk is {value.dtype}, the metadata says {dtype}", path=path
            )
        if value.layout != torch.strided:
            raise CheckpointError(f"{what}: a chunk is a {value.layout} tensor", path=path)
        if (
            not _dense(value.shape, value.stride())
            or value.storage_offset() != 0
            or value.untyped_storage().nbytes() != value.numel() * value.element_size()
        ):
            raise CheckpointError(
                f"{what}: a chunk of {list(chunk.sizes)} is stored with strides "
                f"{list(value.stride())} from element {value.storage_offset()} of "
                f"{value.untyped_storage().nbytes()} bytes: not a dense tensor of exactly its "
                f"{value.numel() * value.element_size()} bytes (an expanded, overlapping or "
                "partial view is refused)",
                path=path,
            )
        if len(item.chunks) == 1:
            return value.contiguous()  # a dense chunk in another order (column-major) too
        if full is None:
            full = torch.empty(item.shape, dtype=dtype)
        full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))] = (
            value
        )
        del value
    return full if full is not None else torch.empty(item.shape, dtype=dtype)


def read_value(index: DcpIndex, item: DcpValue) -> Any:
    """A non-tensor item's value (``torch.load(weights_only=True)``: numbers, strings, tuples
    and the like only)."""
    return _load_range(
        index.directory, item.file, item.offset, item.length, f"DCP item {item.fqn!r}"
    )


def write_dcp(
    directory: str | os.PathLike[str],
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    values: Mapping[str, Any],
    fetch: Callable[[str], torch.Tensor],
) -> None:
    """Write a DCP checkpoint of one process into the existing empty ``directory``:
    ``tensors`` (fqn -> (shape, safetensors dtype)), each fetched by ``fetch(fqn)`` when torch's
    writer reaches it, and ``values`` (fqn -> a plain value). Only torch's own writer
    (``torch.distributed.checkpoint.save``, ``FileSystemWriter``) writes, its tensors over files
    of at most the largest tensor's bytes each (torch's writer holds a file's tensors until the
    file is done), settings in one file of their own.

    Memory: about the largest tensor, twice."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _Fetching(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            fqn = write_item.index.fqn
            if fqn not in tensors:
                return super().resolve_data(write_item)
            tensor = fetch(fqn)
            shape, dtype = tensors[fqn]
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != torch_dtype(dtype):
                raise CheckpointError(f"DCP item {fqn!r}: fetched a tensor unlike its plan")
            return tensor.contiguous()

    class _Bounded(dcp.FileSystemWriter):
        """torch's writer, its tensors split over files of at most ``budget`` bytes (a larger
        tensor gets a file of its own): it keeps every tensor of a file until the file ends."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            import queue

            from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
            from torch.distributed.checkpoint.planner import WriteItemType

            buckets: list[list[Any]] = [[]]
            tensor_buckets: list[list[Any]] = []
            used = budget
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    buckets[0].append(item)
                    continue
                size = (
                    math.prod(item.tensor_data.size)
                    * torch.empty(0, dtype=item.tensor_data.properties.dtype).element_size()
                )
                if used + size > budget:
                    tensor_buckets.append([])
                    used = 0
                tensor_buckets[-1].append(item)
                used += size
            files: queue.Queue = queue.Queue()
            for n, bucket in enumerate(b for b in [*buckets, *tensor_buckets] if b):
                name = f"{plan.storage_data.prefix}{n}{DEFAULT_SUFFIX}"
                files.put((self.fs.concat_path(self.path, name), name, bucket))
            return self._write_data(planner, files)

    budget = max(
        [math.prod(shape) * itemsize(dtype) for shape, dtype in tensors.values()], default=0
    )
    state: dict[str, Any] = {
        fqn: torch.empty(shape, dtype=torch_dtype(dtype), device="meta")
        for fqn, (shape, dtype) in tensors.items()
    }
    state.update(values)
    writer = _Bounded(os.fspath(directory), thread_count=1, per_thread_copy_ahead=0)
    with warnings.catch_warnings():  # one process, no process group: as intended
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single")
        dcp.save(state, storage_writer=writer, planner=_Fetching())


def discard_dcp(directory: str | os.PathLike[str]) -> None:
    """Remove a DCP staging directory this process wrote (only DCP's files and, last, the
    lease, then the directory if that emptied it) and stop holding its lease."""
    directory = Path(directory)
    if not directory.is_dir() or directory.is_symlink():
        lease.release(directory)
        return
    names = sorted(os.listdir(directory), key=lease.deletion_order)
    for entry in names:
        ours = entry.startswith(METADATA_NAME) or entry.endswith(DATA_SUFFIX)
        if ours or lease.LEASE_FILE.match(entry):
            with contextlib.suppress(OSError):
                (directory / entry).unlink()
    lease.release(directory)
    with contextlib.suppress(OSError):
        directory.rmdir()
