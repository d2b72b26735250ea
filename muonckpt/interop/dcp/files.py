"""PyTorch Distributed Checkpoint (DCP) data: tensors and values read by the byte ranges
:func:`.metadata.read_index` checked, written only through torch's writer.

Each range is read through ``torch.load(weights_only=True)`` as torch's own reader does, and
a chunk read is a dense tensor whose storage is exactly those bytes (never a stride-0
expansion or a view into more): what is read never exceeds what the directory holds; a value
is read within :mod:`muonckpt.storage.foreign_limits`. DCP is
written only by ``torch.distributed.checkpoint.save`` with a ``FileSystemWriter``, in this
process, without a process group, each tensor fetched when the writer reaches it.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError
from ...files.progress import Counted, Meter, Progress
from ...storage.dtypes import itemsize, torch_dtype
from ...storage.durable import failing_as, failure, system_error
from ...storage.foreign_limits import check_archive, check_value, non_overlapping
from ...storage.torch_pickles import refusal
from .metadata import DcpIndex, DcpTensor, DcpValue, open_data_file

if TYPE_CHECKING:
    import torch


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
        got: int = self.file.readinto(view[:count])
        self.pos += got
        return got


def _load_range(
    directory: Path,
    file: str,
    offset: int,
    length: int,
    what: str,
    admitted: Sequence[tuple[type, str]] = (),
) -> tuple[Any, int]:
    """``torch.load(weights_only=True)`` of one stored item's byte range, its archive checked
    first (:func:`~.foreign_limits.check_archive`); ``admitted``: the stand-ins,
    ``(class, "module.qualname")``, for foreign classes it may name (their attributes only:
    nothing of the foreign class runs). Returns the value and the bytes its archive holds."""
    import torch

    with open_data_file(directory, file, what) as (f, size):
        path = directory / file
        if offset + length > size:
            raise CheckpointError(
                f"{what} is stored at bytes [{offset}, {offset + length}), past the end of "
                f"the file ({size} bytes): truncated",
                path=path,
            )
        stream = io.BufferedReader(_Slice(f, offset, length))
        try:
            held = check_archive(stream, path, what)
            with torch.serialization.safe_globals(list(admitted)):
                return torch.load(stream, map_location="cpu", weights_only=True), held
        except CheckpointError:
            raise
        except OSError as exc:
            raise CheckpointError(f"cannot read {what}: {exc.strerror}", path=path) from None
        except Exception as exc:
            raise CheckpointError(
                f"{what} cannot be read: {type(exc).__name__}: {refusal(exc)}", path=path
            ) from None


def read_tensor(index: DcpIndex, item: DcpTensor, at: int | None = None) -> torch.Tensor:
    """The full tensor ``item``, assembled from its chunks (their geometry was checked by
    :func:`~muonckpt.interop.dcp.metadata.read_index`; each read must be a dense tensor of its
    chunk's shape and dtype whose storage is exactly its bytes: never a stride-0 expansion of fewer
    bytes, nor a view into more); ``at``: only ``item[at]`` (one of stacked layers), from the
    chunks that hold it.

    Memory: the full tensor (or ``item[at]``) plus one chunk, the tensor never more than its
    stored bytes."""
    import torch

    what = f"DCP item {item.fqn!r}"
    dtype = torch_dtype(item.dtype)
    shape, chunks = item.shape, item.chunks
    if at is not None:
        shape = item.shape[1:]
        chunks = tuple(c for c in item.chunks if c.offsets[0] <= at < c.offsets[0] + c.sizes[0])
    full = None
    for chunk in chunks:
        value, _ = _load_range(index.directory, chunk.file, chunk.offset, chunk.length, what)
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
        if (  # no element twice, from element 0, as many as its storage holds: dense
            not non_overlapping(value.shape, value.stride())
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
        offsets, sizes = chunk.offsets, chunk.sizes
        if at is not None:
            value, offsets, sizes = value[at - offsets[0]], offsets[1:], sizes[1:]
        if len(chunks) == 1:
            return value.contiguous()  # a dense chunk in another order (column-major) too
        if full is None:
            full = torch.empty(shape, dtype=dtype)
        full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] = value
        del value
    return full if full is not None else torch.empty(shape, dtype=dtype)


def read_value(index: DcpIndex, item: DcpValue, admitted: Sequence[tuple[type, str]] = ()) -> Any:
    """A non-tensor item's value (``torch.load(weights_only=True)``: numbers, strings, tuples
    and the like only, and the stand-ins ``admitted`` for foreign classes, as
    :func:`_load_range` takes them), within the limits of
    :func:`~.foreign_limits.check_value`."""
    what = f"DCP item {item.fqn!r}"
    value, held = _load_range(index.directory, item.file, item.offset, item.length, what, admitted)
    check_value(value, index.directory / item.file, what, held)
    return value


Region = tuple[tuple[int, ...], tuple[int, ...]]
"""A block of a tensor: its offsets in the full tensor and its sizes."""


def write_dcp(
    directory: str | os.PathLike[str],
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    values: Mapping[str, Any],
    fetch: Callable[[str, Region], torch.Tensor],
    chunks: Mapping[str, Sequence[Region]] | None = None,
    progress: Progress | None = None,
) -> None:
    """Write a DCP checkpoint of one process into the existing empty ``directory``:
    ``tensors`` (fqn -> (shape, safetensors dtype)), each stored as the blocks ``chunks`` gives
    it (one block, the whole tensor, where it gives none), each block fetched by
    ``fetch(fqn, (offsets, sizes))`` when torch's writer reaches it, and ``values`` (fqn -> a
    plain value). Only torch's own writer (``torch.distributed.checkpoint.save``,
    ``FileSystemWriter``) writes, its tensors over files of at most the largest tensor's bytes
    each (torch's writer holds a file's tensors until the file is done), settings in one file
    of their own, each value one item (as ``torch.save`` of it: a value holding tensors too).

    ``progress`` is told the bytes and blocks fetched (:class:`~muonckpt.files.progress.Meter`).

    Memory: about the largest tensor, twice."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ._torch_writer import BoundedWriter, FetchingPlanner

    nbytes = [math.prod(shape) * itemsize(dtype) for shape, dtype in tensors.values()]
    budget = max(nbytes, default=0)
    state: dict[str, Any] = {
        fqn: torch.empty(shape, dtype=torch_dtype(dtype), device="meta")
        for fqn, (shape, dtype) in tensors.items()
    }
    state.update(values)
    writer = BoundedWriter(os.fspath(directory), budget)
    blocks = {fqn: len((chunks or {}).get(fqn) or [None]) for fqn in tensors}
    meter = Meter(Counted(sum(nbytes), sum(blocks.values())), progress)

    def fetched(fqn: str, region: Region) -> torch.Tensor:
        block = fetch(fqn, region)
        meter.tick(block.numel() * block.element_size())
        return block

    planner = FetchingPlanner(tensors, dict(chunks or {}), fetched)
    with warnings.catch_warnings(), failing_as("write", directory):
        # one process, no process group (none used where a job has one: this one writes)
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single")
        try:
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)  # type: ignore[attr-defined]
        except CheckpointException as exc:
            # torch's wrapper of what failed in a step (a full disk, a source refused, Ctrl-C):
            # mapped here, as re-raising it would hide the OSError under a zip writer's
            # RuntimeError behind the wrapper (its context becomes the CheckpointException)
            first = next(iter(exc.failures.values()))[0]
            cause = system_error(first)
            raise (first if cause is None else failure("write", cause, directory)) from None
