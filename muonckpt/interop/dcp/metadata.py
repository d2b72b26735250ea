"""PyTorch Distributed Checkpoint (DCP) metadata, read safely: what a DCP directory holds.

DCP pickles its ``.metadata``. It is read here only through :class:`_MetadataUnpickler`,
which admits the classes DCP's metadata is made of (:data:`ADMITTED`) and refuses any other
before anything of it runs; then every field muonckpt uses is type- and range-checked
(:func:`read_index`) before any of it is used: the chunks' geometry, and their byte ranges
within the data files (which may not overlap, each at least the bytes its chunk's shape
needs). This is muonckpt's one use of pickle. Every file is opened as muonckpt opens its own
(:func:`~muonckpt.storage.durable.open_regular`: no FIFO, device or symlink). The data itself
is read and written by :mod:`.files`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import pickle
import reprlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...format.names import MANIFEST_NAME
from ...storage import access
from ...storage.dtypes import dtype_name, itemsize, torch_dtype_names
from ...storage.durable import open_failure, open_regular
from ...storage.torch_pickles import one_line

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
    # Megatron-Core's torch_dist adds its save plans (``all_local_plans``): plain records
    "torch.distributed.checkpoint.planner": (
        "SavePlan",
        "TensorWriteData",
        "WriteItem",
        "WriteItemType",
    ),
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
    return access.is_file(Path(path, METADATA_NAME))


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
                f"is not DCP metadata: {type(exc).__name__}: {one_line(exc)}", path=path
            ) from None


def _no_metadata(directory: Path) -> CheckpointError:
    """The refusal of a directory without ``.metadata``: a muonckpt checkpoint, what DCP
    leaves of a save that did not finish (its ``.distcp`` files), or not DCP at all."""
    try:
        names = access.list_names(directory)
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
        with open_data_file(directory, name, f"the data of {ranges[0][2]!r}") as (_, size):
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


@contextlib.contextmanager
def open_data_file(directory: Path, name: str, what: str) -> Iterator[tuple[Any, int]]:
    """The data file ``name`` open, with its size: a regular file of the directory's own,
    opened as muonckpt opens its own (never a FIFO, device or symlink)."""
    path = directory / name
    try:
        fd = open_regular(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {what}: {open_failure(exc)}", path=path) from None
    with os.fdopen(fd, "rb") as f:
        yield f, os.fstat(fd).st_size
