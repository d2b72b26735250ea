"""Host memory that optimizer state passes through on its way to a file.

State and params may live in CUDA memory; the file writer takes host tensors. A synchronous
save copies each CUDA tensor to the host just before writing it (:meth:`HostBuffers.to_host`,
one reused buffer); a background save snapshots every tensor it will write into one host
arena first (:meth:`HostBuffers.snapshot`), so that training may change them right after.
Buffers are pinned (page-locked) where a CUDA device is present, which makes device-to-host
copies run at full bus speed and asynchronously, and are kept from one save to the next: a
pinned allocation costs far more than the copy.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Hashable, Mapping
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

import torch

K = TypeVar("K", bound=Hashable)

_ALIGNMENT = 64
"""Byte alignment of each tensor in an arena (every dtype's element size divides it)."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


class HostBuffers:
    """Reusable host buffers of one optimizer's saves (one save at a time uses them)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Host memory held between saves."""
        return sum(b.numel() for b in self._buffers.values())

    def _buffer(self, purpose: str, nbytes: int, pinned: bool) -> torch.Tensor:
        """A uint8 host buffer of at least ``nbytes``, reused while it is large enough."""
        buffer = self._buffers.get(purpose)
        if buffer is None or buffer.numel() < nbytes or buffer.is_pinned() != pinned:
            self._buffers.pop(purpose, None)  # free the old one before allocating
            buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
            self._buffers[purpose] = buffer
        return buffer

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself when it is in host memory; otherwise a copy in a reused buffer,
        valid until the next call."""
        if tensor.device.type == "cpu":
            return tensor
        buffer = self._buffer("stream", tensor.numel() * tensor.element_size(), _pinnable())
        host = _view(buffer, 0, tensor)
        host.copy_(tensor)
        return host

    def snapshot(self, tensors: Mapping[K, torch.Tensor]) -> dict[K, torch.Tensor]:
        """Flat (1-D) copies of ``tensors`` in one arena, complete when this returns; valid
        until the next snapshot (:meth:`start_snapshot`, waited for)."""
        pending = self.start_snapshot(tensors)
        pending.wait()
        return pending.copies

    def start_snapshot(self, tensors: Mapping[K, torch.Tensor]) -> PendingSnapshot[K]:
        """Flat (1-D) copies of ``tensors`` in one arena, being made: complete once
        :meth:`PendingSnapshot.wait` returns, which the caller must call before the sources
        may change (and before the next snapshot). CUDA tensors' copies are issued here, on
        each device's current stream, and waited for then; host tensors are copied on a
        worker thread meanwhile (past :data:`_COPIED_HERE_BYTES`), so that a caller's other
        work (a save's exchanges with the other ranks) overlaps the copy.

        The arena holds the tensors of each dtype in one run, cut by one ``split``: a few
        operations per tensor, which is what a state of many small tensors costs."""
        by_dtype: dict[torch.dtype, list[K]] = {}
        for key, tensor in tensors.items():
            by_dtype.setdefault(tensor.dtype, []).append(key)
        starts, total = {}, 0
        for dtype, keys in by_dtype.items():
            starts[dtype] = total
            total += _aligned(sum(tensors[k].numel() for k in keys) * dtype.itemsize)
        on_cuda = {t.device for t in tensors.values() if t.device.type == "cuda"}
        arena = self._buffer("snapshot", total, bool(on_cuda) and _pinnable())
        copies, on_host = {}, []
        for dtype, keys in by_dtype.items():
            numels = [tensors[k].numel() for k in keys]
            run = arena[starts[dtype] : starts[dtype] + sum(numels) * dtype.itemsize]
            for key, copy in zip(keys, torch.split(run.view(dtype), numels), strict=True):
                source = tensors[key]
                if source.device.type == "cuda":
                    copy.copy_(source.reshape(-1), non_blocking=True)
                else:
                    on_host.append((copy, source))
                copies[key] = copy
        streams = [torch.cuda.current_stream(device) for device in on_cuda]
        host_bytes = sum(copy.numel() * copy.element_size() for copy, _ in on_host)
        copier = _Copier.of_this_process() if host_bytes >= _COPIED_HERE_BYTES else None
        if copier is None:
            _copy_all(on_host)
            return PendingSnapshot(copies, streams, None)
        return PendingSnapshot(copies, streams, copier.submit(on_host))


_COPIED_HERE_BYTES = 1 << 20
"""Host tensors of fewer bytes in all are copied in the caller's thread (a handoff costs more)."""


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each ``(copy, source)``: the source's elements into the copy (torch releases the GIL)."""
    for copy, source in pairs:
        copy.copy_(source.reshape(-1))


class _Copier:
    """The daemon thread that host snapshots are copied on, one per process, made at the
    first: idle between saves, it keeps no interpreter or launcher from ending (a thread pool's
    worker is no daemon), and a snapshot is waited for before the call that started it
    returns, so none is cut short at exit."""

    _here: _Copier | None = None

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[list[Any], Future[None]]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="muonckpt-copy", daemon=True).start()

    @classmethod
    def of_this_process(cls) -> _Copier | None:
        """This process's copier; None when no thread can be started (at interpreter exit,
        a save from an atexit handler: then the caller copies)."""
        if cls._here is None:
            try:
                cls._here = cls()
            except RuntimeError:
                return None
        return cls._here

    def submit(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Future[None]:
        """:func:`_copy_all` of ``pairs`` on the thread; its outcome."""
        done: Future[None] = Future()
        self._jobs.put((pairs, done))
        return done

    def _serve(self) -> None:
        while True:
            pairs, done = self._jobs.get()
            try:
                _copy_all(pairs)
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)
            del pairs, done


os.register_at_fork(after_in_child=lambda: setattr(_Copier, "_here", None))  # its thread is gone


class PendingSnapshot(Generic[K]):
    """A snapshot being made (:meth:`HostBuffers.start_snapshot`): :attr:`copies`, complete
    once :meth:`wait` returns."""

    def __init__(
        self,
        copies: dict[K, torch.Tensor],
        streams: list[torch.cuda.Stream],
        copying: Future[None] | None,
    ) -> None:
        self.copies = copies
        self._streams, self._copying = streams, copying

    def wait(self) -> None:
        """Until every copy is made (idempotent); a copy's failure raises here."""
        copying, self._copying = self._copying, None
        if copying is not None:
            copying.result()
        streams, self._streams = self._streams, []
        for stream in streams:
            stream.synchronize()


def _pinnable() -> bool:
    """Whether pinned host memory can be had (it needs a CUDA driver)."""
    return torch.cuda.is_available()


def _view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``buffer`` from ``offset`` as a tensor of ``like``'s dtype and shape."""
    nbytes = like.numel() * like.element_size()
    return buffer[offset : offset + nbytes].view(like.dtype).view(like.shape)
