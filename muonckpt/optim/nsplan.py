"""Where each Muon matrix's Newton-Schulz runs in the dp x tp grid, and the messages that carry
its input there and its result back. Pure: ints and regions, no torch, no collectives, no I/O.

The packaged Muon holds every matrix in pieces spread over the grid (ZeRO-1 slices of TP
shards). Newton-Schulz needs the whole matrix, so exactly one rank, its *worker*, runs it:
:func:`plan_newton_schulz` picks the workers by longest-processing-time bin packing of each
matrix's Newton-Schulz FLOPs (:func:`muonckpt.layout.workplan.balance_lpt`; among equally loaded
ranks, the one holding most of the matrix, so that fewer elements travel), as Megatron-Core's
layer-wise optimizer does. Each step the holders send the worker their pieces of the input
(:attr:`NsPlan.inputs`) and the worker sends every other holder its piece of the result
(:attr:`NsPlan.outputs`), at most one message per ordered pair of ranks per direction.

A TP-replicated matrix is held identically by every TP rank of a DP row: its input comes from
one of them (the worker where it is in that row, else TP rank 0), and every one of them gets
the result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import LayoutError
from ..layout.grid import GridParam, GridParams
from ..layout.topology import Region, Topology
from ..layout.workplan import balance_lpt


def ns_flops(shape: Sequence[int], steps: int) -> int:
    """FLOPs (two per multiply-add) of the matrix products of ``steps`` Newton-Schulz iterations
    on a matrix of ``shape``: on its ``m x n`` view with ``m <= n``, ``X X^T`` (``2 m^2 n``),
    ``G G`` (``2 m^3``) and ``P X`` (``2 m^2 n``) per iteration."""
    m, n = sorted(shape[:2])
    return steps * (4 * m * m * n + 2 * m**3)


@dataclass(frozen=True)
class NsMatrix:
    """One Muon matrix of the grid and where its Newton-Schulz runs."""

    param: int
    """Its index in :attr:`GridParams.params`."""
    name: str
    full_shape: tuple[int, ...]
    group: int
    """Index of its param group."""
    flops: int
    """:func:`ns_flops` of its full shape."""
    worker: int
    """Grid index (``dp_rank * tp + tp_rank``) of the rank that runs its Newton-Schulz."""


@dataclass(frozen=True)
class Piece:
    """A region of one matrix inside a message."""

    matrix: int
    """Index in :attr:`NsPlan.matrices`."""
    region: Region
    """What of the full matrix it carries, in the holder's element order."""
    offset: int
    """Its first element in the message."""


@dataclass(frozen=True)
class Message:
    """The pieces one rank sends another in one direction of a step, end to end."""

    src: int
    """Grid index of the sender."""
    dst: int
    """Grid index of the receiver."""
    pieces: tuple[Piece, ...]
    """In matrix order; each starts where the previous one ends."""

    @property
    def numel(self) -> int:
        return sum(piece.region.numel for piece in self.pieces)


@dataclass(frozen=True)
class NsPlan:
    """Every Muon matrix's worker and the step's messages, the same on every rank."""

    topology: Topology
    matrices: tuple[NsMatrix, ...]
    """The grid's Muon matrices, in canonical param order."""
    inputs: tuple[Message, ...]
    """Holders to workers: the pieces of the Newton-Schulz input a worker lacks."""
    outputs: tuple[Message, ...]
    """Workers to holders: each holder's piece of the result, for every holder but the worker."""
    held: tuple[tuple[Region | None, ...], ...]
    """Per matrix, per grid index, the region that rank holds (None: nothing)."""

    def loads(self) -> list[int]:
        """Newton-Schulz FLOPs per grid index."""
        loads = [0] * self.topology.world_size
        for matrix in self.matrices:
            loads[matrix.worker] += matrix.flops
        return loads


def plan_newton_schulz(grid: GridParams, ns_steps: Mapping[int, int]) -> NsPlan:
    """The Newton-Schulz plan of the grid's Muon matrices: the params of the groups in
    ``ns_steps`` (group index -> Newton-Schulz iterations).

    Raises:
        LayoutError: naming the param, for a Muon matrix that is not 2-D.
    """
    topology = grid.topology
    world = topology.world_size
    muon = [(i, p) for i, p in enumerate(grid.params) if p.spec.group in ns_steps]
    held: list[tuple[Region | None, ...]] = []
    for _, param in muon:
        if len(param.full_shape) != 2:
            raise LayoutError(
                f"param {param.name!r} in a Muon group must be 2-D, got shape {param.full_shape}"
            )
        held.append(tuple(_held(param, topology, rank) for rank in range(world)))
    flops = [ns_flops(p.full_shape, ns_steps[p.spec.group]) for _, p in muon]
    affinity = [[r.numel if r is not None else 0 for r in regions] for regions in held]
    workers = balance_lpt(flops, world, affinity)
    matrices = tuple(
        NsMatrix(i, p.name, p.full_shape, p.spec.group, cost, worker)
        for (i, p), cost, worker in zip(muon, flops, workers, strict=True)
    )
    inputs: dict[tuple[int, int], list[tuple[int, Region]]] = {}
    outputs: dict[tuple[int, int], list[tuple[int, Region]]] = {}
    for k, (matrix, regions) in enumerate(zip(matrices, held, strict=True)):
        worker = matrix.worker
        for rank, region in enumerate(regions):
            if region is None or rank == worker:
                continue
            outputs.setdefault((worker, rank), []).append((k, region))
            if _is_source(muon[k][1], topology, rank, worker):
                inputs.setdefault((rank, worker), []).append((k, region))
    return NsPlan(topology, matrices, _messages(inputs), _messages(outputs), tuple(held))


def _held(param: GridParam, topology: Topology, rank: int) -> Region | None:
    region = param.region(topology, *topology.coords(rank))
    return region if region.numel else None


def _is_source(param: GridParam, topology: Topology, rank: int, worker: int) -> bool:
    """Whether ``rank`` sends the worker its piece (the worker's own piece is never sent)."""
    if param.spec.tp_split_dim >= 0 and topology.tp > 1:
        return True
    dp_rank, tp_rank = topology.coords(rank)
    if topology.coords(worker)[0] == dp_rank:
        return False  # the worker holds this DP row's piece itself
    return tp_rank == 0


def _messages(pieces: dict[tuple[int, int], list[tuple[int, Region]]]) -> tuple[Message, ...]:
    out = []
    for (src, dst), items in sorted(pieces.items()):
        placed, offset = [], 0
        for matrix, region in items:
            placed.append(Piece(matrix, region, offset))
            offset += region.numel
        out.append(Message(src, dst, tuple(placed)))
    return tuple(out)
