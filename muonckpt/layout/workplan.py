"""Splitting work among workers: pure ints, no I/O.

:func:`split_work` cuts the tensors of output files into contiguous runs balanced by bytes, for
``consolidate`` and ``reshard`` when several processes share the writing
(:func:`muonckpt.offline.tools.consolidate` with ``collective``). :func:`balance_lpt`
spreads independent jobs by cost (longest processing time first), for the packaged Muon's
Newton-Schulz work (:mod:`muonckpt.optim.nsplan`). :func:`spread` shares the writing of a
replicated optimizer's state among its ranks, for ``save``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import LayoutError


@dataclass(frozen=True)
class WorkUnit:
    """One output tensor: its file, its key in the file, where its data lies and how large."""

    file: str
    key: str
    offset: int
    """Absolute byte offset of the tensor's data in ``file``."""
    nbytes: int


def check_workers(workers: int) -> None:
    """Refuse a number of workers that is not positive (:class:`LayoutError`): the one rule for
    every split of work among processes."""
    if workers < 1:
        raise LayoutError(f"workers must be positive, got {workers}")


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
    check_workers(workers)
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


def balance_lpt(
    costs: Sequence[int], workers: int, affinity: Sequence[Sequence[int]] | None = None
) -> list[int]:
    """The worker of each job: longest processing time first (Graham's LPT).

    Jobs go, largest cost first (ties: lower index first), each to a least loaded worker; among
    equally loaded workers to the one with the highest ``affinity[job][worker]`` (the elements
    of the job it already holds, say), then the lowest index. Deterministic. The busiest
    worker's load is at most ``(4/3 - 1/(3 * workers))`` times the optimum and at most
    ``sum(costs) / workers + max(costs) * (1 - 1 / workers)``.

    Raises:
        LayoutError: when ``workers`` is not positive, a cost is negative, or ``affinity`` does
            not give one row of ``workers`` scores per job.
    """
    check_workers(workers)
    if any(c < 0 for c in costs):
        raise LayoutError(f"job costs must not be negative, got {list(costs)}")
    if affinity is not None and (
        len(affinity) != len(costs) or any(len(row) != workers for row in affinity)
    ):
        raise LayoutError(f"affinity needs {len(costs)} rows of {workers} scores each")
    loads = [0] * workers
    assigned = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        least = min(loads)
        candidates = [w for w in range(workers) if loads[w] == least]
        if affinity is not None:
            best = max(affinity[job][w] for w in candidates)
            candidates = [w for w in candidates if affinity[job][w] == best]
        assigned[job] = candidates[0]
        loads[candidates[0]] += costs[job]
    return assigned


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
