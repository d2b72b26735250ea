"""PyTorch Distributed Checkpoint (DCP) directories: read safely, write through torch's writer.

DCP pickles its ``.metadata``. It is read here only through :class:`_MetadataUnpickler`,
which admits the classes DCP's metadata is made of (:data:`ADMITTED`) and refuses any other
before anything of it runs. Tensor data is read by the byte ranges the metadata gives, each
range through ``torch.load(weights_only=True)`` as torch's own reader does; other values
(param-group settings) likewise. DCP is written only by ``torch.distributed.checkpoint.save``
with a ``FileSystemWriter``, in this process, without a process group, each tensor fetched
when the writer reaches it.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from . import lease
from .dtypes import dtype_name, itemsize, torch_dtype

if TYPE_CHECKING:
    import torch

METADATA_NAME = ".metadata"
"""The pickled metadata file that makes a directory a DCP checkpoint."""
DATA_SUFFIX = ".distcp"
MAX_METADATA_BYTES = 1 << 30

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

    @property
    def nbytes(self) -> int:
        import math

        from .dtypes import itemsize

        return math.prod(self.shape) * itemsize(self.dtype)


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
    """Read a DCP checkpoint's ``.metadata`` safely into a :class:`DcpIndex`.

    Raises:
        CheckpointError: naming the file, for a missing or foreign-class metadata, one that is
            not DCP metadata, or a tensor item without storage.
    """
    directory = Path(directory)
    path = directory / METADATA_NAME
    try:
        size = path.stat().st_size
        if size > MAX_METADATA_BYTES:
            raise CheckpointError(f"is {size} bytes, over {MAX_METADATA_BYTES}", path=path)
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot read the DCP metadata: {exc.strerror}", path=path) from None
    except Exception as exc:
        raise CheckpointError(
            f"is not DCP metadata: {type(exc).__name__}: {exc}", path=path
        ) from None
    from torch.distributed.checkpoint import metadata as dcp_metadata

    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"holds a {type(metadata).__name__}, not DCP Metadata", path=path)
    storage: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for index, info in (metadata.storage_data or {}).items():
        offset = None if index.offset is None else tuple(int(o) for o in index.offset)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"item {index.fqn!r} is stored transformed ({info.transform_descriptors}); "
                "muonckpt reads plain DCP only",
                path=path,
            )
        storage[index.fqn, offset] = info
    tensors, values = {}, {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, dcp_metadata.BytesStorageMetadata):
            info = _stored(storage, fqn, None, path)
            values[fqn] = DcpValue(fqn, info.relative_path, int(info.offset), int(info.length))
            continue
        chunks = []
        for chunk in item.chunks:
            offsets = tuple(int(o) for o in chunk.offsets)
            info = _stored(storage, fqn, offsets, path)
            chunks.append(
                Chunk(
                    offsets,
                    tuple(int(s) for s in chunk.sizes),
                    info.relative_path,
                    int(info.offset),
                    int(info.length),
                )
            )
        tensors[fqn] = DcpTensor(
            fqn, tuple(int(s) for s in item.size), dtype_name(item.properties.dtype), tuple(chunks)
        )
    return DcpIndex(directory, tensors, values)


def _stored(storage: Mapping[Any, Any], fqn: str, offsets: Any, path: Path) -> Any:
    info = storage.get((fqn, offsets))
    if info is None:
        raise CheckpointError(f"item {fqn!r} has no storage entry", path=path)
    name = str(info.relative_path)
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        raise CheckpointError(
            f"item {fqn!r} is stored in {name!r}, not a plain file name", path=path
        )
    return info


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


def _load_range(directory: Path, file: str, offset: int, length: int, what: str) -> Any:
    """``torch.load(weights_only=True)`` of one stored item's byte range."""
    import torch

    path = directory / file
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if offset < 0 or length < 0 or offset + length > size:
                raise CheckpointError(
                    f"{what} is stored at bytes [{offset}, {offset + length}), past the end of "
                    f"the file ({size} bytes): truncated",
                    path=path,
                )
            return torch.load(
                io.BufferedReader(_Slice(f, offset, length)), map_location="cpu", weights_only=True
            )
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot read {what}: {exc.strerror}", path=path) from None
    except Exception as exc:
        raise CheckpointError(
            f"{what} cannot be read: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}",
            path=path,
        ) from None


def read_tensor(index: DcpIndex, item: DcpTensor) -> torch.Tensor:
    """The full tensor ``item``, assembled from its chunks (each checked: in bounds, of the
    shape and dtype the metadata gives, together covering every element once).

    Memory: the full tensor plus one chunk."""
    import math

    import torch

    what = f"DCP item {item.fqn!r}"
    total = 0
    for a, chunk in enumerate(item.chunks):
        if (
            len(chunk.offsets) != len(item.shape)
            or len(chunk.sizes) != len(item.shape)
            or any(
                o < 0 or s < 0 or o + s > n
                for o, s, n in zip(chunk.offsets, chunk.sizes, item.shape, strict=True)
            )
        ):
            raise CheckpointError(f"{what}: a chunk lies outside its shape {list(item.shape)}")
        total += math.prod(chunk.sizes)
        for other in item.chunks[:a]:
            if (
                all(
                    max(o1, o2) < min(o1 + s1, o2 + s2)
                    for o1, s1, o2, s2 in zip(
                        chunk.offsets, chunk.sizes, other.offsets, other.sizes, strict=True
                    )
                )
                and math.prod(chunk.sizes) > 0
            ):
                raise CheckpointError(f"{what}: two of its chunks overlap")
    if total != math.prod(item.shape):
        raise CheckpointError(
            f"{what}: its chunks hold {total} of its {math.prod(item.shape)} elements"
        )
    dtype = torch_dtype(item.dtype)
    full = None
    for chunk in item.chunks:
        value = _load_range(index.directory, chunk.file, chunk.offset, chunk.length, what)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != chunk.sizes:
            raise CheckpointError(f"{what}: a chunk does not hold a tensor of {list(chunk.sizes)}")
        if value.dtype != dtype:
            raise CheckpointError(f"{what}: a chunk is {value.dtype}, the metadata says {dtype}")
        if len(item.chunks) == 1:
            return value.contiguous()
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
