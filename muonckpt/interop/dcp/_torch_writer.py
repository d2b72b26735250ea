"""torch's DCP writer, taught to fetch each tensor when it reaches it, to bound its files and
to write them through the storage seam: the planner and storage writer that
:func:`.files.write_dcp` hands to ``torch.distributed.checkpoint.save``.

This module imports ``torch.distributed.checkpoint`` at its top, since its classes derive from
torch's; :mod:`.files` imports it only inside :func:`~.files.write_dcp`, so that the
offline tools run without torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystemBase
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ...errors import CheckpointError
from ...storage import access
from ...storage.dtypes import torch_dtype

if TYPE_CHECKING:
    from .files import Region

TensorPlan = Mapping[str, tuple[tuple[int, ...], str]]
"""fqn -> (shape, safetensors dtype) of each tensor written."""


def block_items(
    fqn: str, shape: tuple[int, ...], dtype: str, blocks: Sequence[Region]
) -> list[Any]:
    """The ``WriteItem`` of each block of tensor ``fqn`` (of ``shape`` and ``dtype``)."""
    properties = TensorProperties(dtype=torch_dtype(dtype))
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                properties=properties,
                size=torch.Size(shape),
            ),
        )
        for offsets, sizes in blocks
    ]


class FetchingPlanner(DefaultSavePlanner):
    """torch's planner over a state dict of meta tensors: each tensor of ``tensors`` is planned
    as the blocks ``blocks`` gives it (the whole tensor, as torch plans it, where it gives
    none), and each block's data is ``fetch(fqn, (offsets, sizes))``, checked against the
    plan, when the writer asks for it."""

    def __init__(
        self,
        tensors: TensorPlan,
        blocks: Mapping[str, Sequence[Region]],
        fetch: Callable[[str, Region], torch.Tensor],
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors = tensors
        self.blocks = blocks
        self.fetch = fetch

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        items = [i for i in plan.items if i.index.fqn not in self.blocks]
        items += [
            item
            for fqn, blocks in self.blocks.items()
            for item in block_items(fqn, *self.tensors[fqn], blocks)
        ]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: Any) -> Any:
        fqn = write_item.index.fqn
        if fqn not in self.tensors:
            return super().resolve_data(write_item)
        dtype = self.tensors[fqn][1]
        chunk = write_item.tensor_data.chunk
        region = (tuple(chunk.offsets), tuple(chunk.sizes))
        tensor = self.fetch(fqn, region)
        if tuple(tensor.shape) != region[1] or tensor.dtype != torch_dtype(dtype):
            raise CheckpointError(f"DCP item {fqn!r}: fetched a tensor unlike its plan")
        return tensor.contiguous()


class StorageFileSystem(FileSystemBase):
    """torch's file system interface over muonckpt's storage seam (:mod:`muonckpt.storage.access`):
    DCP's files are created new, renamed and removed as every other file muonckpt writes, so
    that a store behind the seam is DCP's too. A failure of the system is
    the storage's :class:`~muonckpt.errors.CheckpointError`, naming the file written."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if mode != "wb":
            raise ValueError(f"muonckpt's DCP writer only writes new files, not mode {mode!r}")
        with access.new_file(path, sync=False) as stream:  # torch fsyncs each file it writes
            yield stream

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> Path:
        return Path(path, suffix)

    def init_path(self, path: str | os.PathLike[str]) -> Path:
        return Path(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        access.rename(path, new_path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        access.make_directories(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in str(checkpoint_id)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return access.exists(path)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        access.remove(path)


class BoundedWriter(dcp.FileSystemWriter):  # type: ignore[name-defined,misc]  # not in the stubs
    """torch's writer, its tensors split over files of at most ``budget`` bytes (a larger
    tensor gets a file of its own): it keeps every tensor of a file until the file ends. The
    plain values go into a file of their own, the first."""

    def __init__(self, path: str, budget: int) -> None:
        super().__init__(path, thread_count=1, per_thread_copy_ahead=0)
        self.fs = StorageFileSystem()
        self.budget = budget

    def write_data(self, plan: Any, planner: Any) -> Any:
        files: queue.Queue[tuple[str | os.PathLike[str], str, list[Any]]] = queue.Queue()
        for n, bucket in enumerate(b for b in self.buckets(plan.items) if b):
            name = f"{plan.storage_data.prefix}{n}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, files)

    def buckets(self, items: Sequence[Any]) -> list[list[Any]]:
        """The plan's items, one list per file: the plain values, then the tensors in order,
        a new file wherever the next tensor would take the current one past the budget."""
        values: list[Any] = []
        tensor_buckets: list[list[Any]] = []
        used = self.budget
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                values.append(item)
                continue
            size = (
                math.prod(item.tensor_data.chunk.sizes)
                * torch.empty(0, dtype=item.tensor_data.properties.dtype).element_size()
            )
            if not tensor_buckets or used + size > self.budget:  # (a first tensor of 0 bytes)
                tensor_buckets.append([])
                used = 0
            tensor_buckets[-1].append(item)
            used += size
        return [values, *tensor_buckets]
