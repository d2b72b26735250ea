"""Splitting the tensors of output files among workers, balanced by bytes: pure ints, no I/O.

Used by ``consolidate`` and ``reshard`` when several processes share the writing
(:func:`muonckpt.offline.consolidate` with ``workers`` or ``collective``), and by ``save`` of a
replicated optimizer, whose ranks share the writing of its state (:func:`spread`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import LayoutError


@dataclass(frozen=True)
class WorkUnit:
    """One output tensor: its file, its key in the file, where its data lies and how large."""

    file: str
    key: str
    offset: int
    """Absolute byte offset of the tensor's data in ``file``."""
    nbytes: int


def split_work(units: Sequence[WorkUnit], workers: int) -> list[list[WorkUnit]]:
    """Each worker's units, in (file, offset) order; contiguous runs of the output, by bytes.

    The units, laid end to end in (file, offset, key) order, span ``total`` bytes; worker ``w``
    takes those whose midpoint falls in ``[w, w + 1) * total / workers``, so it writes one
    contiguous stretch of the output and at most ``total / workers + max(nbytes)`` bytes.
    With no bytes at all the units are spread by count. Deterministic: the same units in any
    order give the same split.

    Raises:
        LayoutError: when ``workers`` is not positive.
    """
    if workers < 1:
        raise LayoutError(f"workers must be positive, got {workers}")
    ordered = sorted(units, key=lambda u: (u.file, u.offset, u.key))
    total = sum(u.nbytes for u in ordered)
    shares: list[list[WorkUnit]] = [[] for _ in range(workers)]
    start = 0
    for index, unit in enumerate(ordered):
        if total:
            owner = (2 * start + unit.nbytes) * workers // (2 * total)
        else:
            owner = index * workers // len(ordered)
        shares[min(owner, workers - 1)].append(unit)
        start += unit.nbytes
    return shares


def spread(sizes: Sequence[int], workers: int) -> list[int]:
    """The worker of each item of ``sizes`` (bytes), by :func:`split_work`'s rule: contiguous
    runs of the items in order, each worker at most ``total / workers + max(sizes)`` bytes. For
    items every worker holds alike (replicated optimizer state), so that each is written once
    and the writing is shared.

    Raises:
        LayoutError: when ``workers`` is not positive.
    """
    units, start = [], 0
    for index, size in enumerate(sizes):
        units.append(WorkUnit("", f"{index:012d}", start, size))
        start += size
    owners = [0] * len(units)
    for worker, share in enumerate(split_work(units, workers)):
        for unit in share:
            owners[int(unit.key)] = worker
    return owners
