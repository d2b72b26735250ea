"""(internal) A load's proof of what it restored, for :func:`muonckpt.checkpoint.loading.load`.

As the share is read, :class:`Check` takes a digest (XXH3-64, per 16 MiB chunk, on a thread
pool: it releases the GIL, and the reads go on meanwhile) of every tensor this rank means to
apply, as read, resharded and converted (the manifest's checksums are of the pieces saved, which
a reshard or a conversion does not keep; a slot that is one whole stored piece takes the
checksums its read verified). After their ``load_state_dict`` it finds every state key each
kept (:meth:`Check.taken`: state it dropped refuses the load, which every rank then puts back)
and any it cast by torch's documented rule (floating state to the param's dtype: warned, once).
After the values are applied it digests what the optimizers, the params and the models that
follow them hold and names every difference (:meth:`Check.problems`); a state tensor that is
the very bytes read (torch kept the loaded view) and that no torch op wrote in place since
(the version counter of its block, which every in-place op on a view advances) is equal
without being read again.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from .. import storage
from ..errors import RestoreError, RestoreWarning
from ..format.manifest import Piece
from ..optim.sharding import ShardedParams
from ..state.arena import ReadArena
from ..state.placement import optimizers_of
from ._model_copies import ModelCopies
from ._taking import Taken

DIGEST_CHUNK = 16 << 20
"""Bytes of one digest's chunk: the unit the threads share."""
WORKERS = min(8, os.cpu_count() or 1)
"""Threads that digest at once."""


def digests(tensors: Sequence[torch.Tensor], chunks: Sequence[int] | None = None) -> list[bytes]:
    """Each tensor's digest (the XXH3-64 digests of its ``chunks[i]``-byte chunks, default
    :data:`DIGEST_CHUNK`, packed as the manifest's checksums are), its bytes on the host;
    hashed by :data:`WORKERS` threads, in tasks of about :data:`DIGEST_CHUNK` bytes (many
    small tensors one task: a task each would cost more than their bytes)."""
    views = [_host_bytes(t) for t in tensors]
    sizes = chunks or [DIGEST_CHUNK] * len(views)
    tasks: list[list[tuple[int, int, int]]] = [[]]
    size = 0
    for i, (view, step) in enumerate(zip(views, sizes, strict=True)):
        for at in range(0, len(view), step):
            tasks[-1].append((i, at, at + step))
            size += min(step, len(view) - at)
            if size >= DIGEST_CHUNK:
                tasks.append([])
                size = 0

    def digest(task: list[tuple[int, int, int]]) -> list[bytes]:
        return [xxhash.xxh3_64_digest(views[i][at:end]) for i, at, end in task]

    out = [b""] * len(views)
    with ThreadPoolExecutor(min(WORKERS, len(tasks))) as pool:
        for task, parts in zip(tasks, pool.map(digest, tasks), strict=True):
            for (i, _, _), part in zip(task, parts, strict=True):
                out[i] += part
    return out


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes in row-major order, on the host (copied only where they are not)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy().data)


@dataclass(frozen=True)
class _Applied:
    """One tensor the load applies: which param and key, and where its values are read."""

    param: str
    key: str
    position: int
    """The param's index in the target's flat param order."""
    slot: int
    dtype: torch.dtype
    """As read (the state's as saved, after any conversion)."""


class Check:
    """What one rank's load applies, digested as it is read (overlapping the reads, on a pool
    of :data:`WORKERS` threads: :meth:`read`), and compared after it is applied."""

    taken_share: Taken
    state: list[_Applied]
    """The state tensors it applies (set by :meth:`handing`, as are the next three)."""
    values: list[_Applied]
    """The params' values it applies."""
    before: list[bytes]
    """The digest of each of :attr:`state` and :attr:`values`, in that order, as read."""
    chunks: list[int]
    """The bytes of each digest's chunks (the stored piece's, where its checksums are used)."""
    versions: list[int]
    """The state arena's blocks' version counters when handed over."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="muonckpt-check")
        self._read: dict[tuple[int, int], tuple[list[Future[bytes]] | bytes, int]] = {}
        self.casts: list[str] = []

    def read(self, arena: ReadArena, slot: int, piece: Piece | None) -> None:
        """(as the share is read, and again after a conversion changes it) Slot ``slot`` of
        ``arena`` holds what the load applies: its digest begun, or, for a slot that is one
        whole stored ``piece`` (a load at the saving layout), the checksums the read verified
        taken for it."""
        if piece is not None:
            self._read[id(arena), slot] = (piece.digests, piece.chunk_bytes)
            return
        view = _host_bytes(arena.raw(slot))
        self._read[id(arena), slot] = (
            [
                self._pool.submit(xxhash.xxh3_64_digest, view[at : at + DIGEST_CHUNK])
                for at in range(0, len(view), DIGEST_CHUNK)
            ],
            DIGEST_CHUNK,
        )

    def handing(self, taken: Taken) -> None:
        """(the share read, before any optimizer is handed it) What it applies, and each
        tensor's digest as read."""
        self.taken_share, share = taken, taken.share
        names = {p.local_index: p.name for p in taken.plan.sharding.params}
        self.state = [
            _Applied(names[s.position], key, s.position, slot, storage.torch_dtype(dtype))
            for s in share.state
            for slot, (key, dtype) in enumerate(s.tensors, s.first)
        ]
        params = taken.params
        self.values = [
            _Applied(names[index], "param", index, slot, params[index].dtype)
            for index, slot in zip(share.values[::2], share.values[1::2], strict=True)
        ]
        arenas = [(share.arena, self.state), (share.value_bytes, self.values)]
        taken_as = [self._read[id(arena), a.slot] for arena, applied in arenas for a in applied]
        self.before = [
            known if isinstance(known, bytes) else b"".join(f.result() for f in known)
            for known, _ in taken_as
        ]
        self.chunks = [chunk for _, chunk in taken_as]
        self.versions = share.arena.versions()
        self.close()

    def close(self) -> None:
        """The threads ended (after :meth:`handing`, or when the load failed before it)."""
        self._pool.shutdown(cancel_futures=True)

    def _held(self) -> list[torch.Tensor | None]:
        """The tensor each optimizer now keeps for each state tensor applied (None: none)."""
        params = self.taken_share.params
        states = [o.state for o in optimizers_of(self.taken_share.plan.optimizer)]
        held = []
        for a in self.state:
            p = params[a.position]
            kept = next((s[p].get(a.key) for s in states if p in s), None)
            held.append(kept if isinstance(kept, torch.Tensor) else None)
        return held

    def taken(self) -> None:
        """(after every ``load_state_dict``) State an optimizer dropped refuses the load, naming
        the param and key; one it cast to its param's dtype is noted for :meth:`warn`."""
        held = list(zip(self.state, self._held(), strict=True))
        dropped = [a for a, kept in held if kept is None]
        if dropped:
            raise RestoreError(
                "the optimizer's load_state_dict dropped state the checkpoint gave it: "
                + _named(f"{a.param!r} {a.key!r}" for a in dropped),
                param=dropped[0].param,
                key=dropped[0].key,
            )
        self.casts = [
            f"{a.param!r} {a.key!r} {a.dtype} -> {kept.dtype}"
            for a, kept in held
            if kept is not None and kept.dtype != a.dtype
        ]

    def problems(
        self, models: Iterable[ShardedParams], copies: ModelCopies | None = None
    ) -> list[tuple[str, str, str]]:
        """(after the apply) (param, key, what) of every tensor held that is not what was read:
        the optimizers' state (cast as torch casts, where it did), the params, and the model
        weights that follow them or are copies of them (``load(model=)``; ``key``
        ``"model"``)."""
        share, params = self.taken_share.share, self.taken_share.params
        held = [t for t in self._held() if t is not None]
        first = len(self.state)  # then the params' values: written into the params, compared
        compared: list[tuple[_Applied, bytes, torch.Tensor, int]] = []
        read_as = zip(self.state, self.before[:first], held, self.chunks[:first], strict=True)
        for a, want, kept, chunk in read_as:
            if self._unchanged(a, kept):
                continue
            if kept.dtype != a.dtype:  # cast by the optimizer: compared as cast
                read = share.arena.raw(a.slot).view(a.dtype).to(kept.dtype)
                want, chunk = digests([read])[0], DIGEST_CHUNK
            compared.append((a, want, kept, chunk))
        values = zip(self.values, self.before[first:], self.chunks[first:], strict=True)
        compared += [(a, want, params[a.position], chunk) for a, want, chunk in values]
        now = digests([t for _, _, t, _ in compared], [c for _, _, _, c in compared])
        found = [
            (a.param, a.key, "holds other values than the checkpoint gave it")
            for (a, want, _, _), got in zip(compared, now, strict=True)
            if want != got
        ]
        for sharded in models:
            cut = [
                sharded.cut(model_param, i) for i, model_param in enumerate(sharded.model_params)
            ]
            pairs = zip(sharded.specs, digests(cut), digests(sharded.shards()), strict=True)
            for spec, model, loaded in pairs:
                if model != loaded:
                    found.append((spec.name, "model", "the model's weight is not the loaded param"))
        return found + ([] if copies is None else copies.problems())

    def _unchanged(self, applied: _Applied, kept: torch.Tensor) -> bool:
        """Whether ``kept`` is the very bytes read for ``applied`` (a view of its slot, as
        torch keeps a loaded tensor of the param's dtype and device) and no torch op wrote in
        place into them since they were digested: equal without a second pass."""
        raw = self.taken_share.share.arena.raw(applied.slot)
        return (
            kept.dtype == applied.dtype
            and kept.data_ptr() == raw.data_ptr()
            and kept.is_contiguous()
            and kept.numel() * kept.element_size() == raw.numel()
            and not self.taken_share.share.arena.touched(applied.slot, self.versions)
        )

    def warn(self) -> None:
        """State the optimizer cast, warned once (:class:`RestoreWarning`)."""
        if self.casts:
            warnings.warn(
                "the optimizer cast loaded state to its params' dtype (torch casts floating "
                f"state so): {_named(self.casts)}",
                RestoreWarning,
                stacklevel=4,
            )


def refusal(problems: Sequence[Sequence[Any]]) -> RestoreError:
    """The error of a load whose check found ``problems``, (rank or None, param, key, what)
    each: the first named in its fields."""
    _, param, key, _ = problems[0]
    return RestoreError(
        "the load's check found what the optimizer holds after it differ from the checkpoint: "
        + _named(
            f"{'' if r is None else f'rank {r}: '}{p!r} {k!r}: {what}" for r, p, k, what in problems
        ),
        param=param,
        key=key,
    )


def _named(items: Iterable[str]) -> str:
    """Up to eight of ``items``, and how many more."""
    listed = list(items)
    more = f" and {len(listed) - 8} more" if len(listed) > 8 else ""
    return "; ".join(listed[:8]) + more
