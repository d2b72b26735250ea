"""DeepSpeed ZeRO's layout of one param group over its ranks, pure (ints only): ZeRO-1/2's
(:func:`group_layout`) and ZeRO-3's (:func:`zero3_layout`).

DeepSpeed flattens a group's params, in the group's order, into one buffer (each param
followed by its alignment padding, none after the last; zero without
``zero_optimization.parameter_alignment``), pads the buffer to a multiple of ``2 * world``
elements (``nccl_start_alignment_factor``) and gives rank ``r`` the equal slice
``[r * P, (r + 1) * P)``. A rank keeps its fp32 master slice without the padding at the
buffer's end (``groups_padding``), its Adam moments at the full ``P`` elements, and, for a
Muon group, the *whole* momentum of every param its slice overlaps, one after the other
(``stage_1_and_2.py``: ``get_partition_info``, ``_muon_momentum_buffer``). The one function
:func:`group_layout` gives all of it, for the reader (checking what the files say) and the
writer (the files for another world size) alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import LayoutError

START_ALIGNMENT = 2
"""DeepSpeed's ``nccl_start_alignment_factor``: the buffer is a multiple of it per rank."""


@dataclass(frozen=True)
class Fragment:
    """The elements of one param that one rank holds: ``numel`` of them from ``offset`` in
    the param (flat), at ``start`` in the rank's slice (DeepSpeed's ``fragment_address``)."""

    rank: int
    start: int
    offset: int
    numel: int


@dataclass(frozen=True)
class GroupLayout:
    """One group's flat buffer over ``world`` ranks of ``partition`` elements each."""

    world: int
    numels: tuple[int, ...]
    """Each param's element count, in the group's order."""
    offsets: tuple[int, ...]
    """Where each param begins in the buffer."""
    partition: int

    @property
    def padded_numel(self) -> int:
        """The buffer's elements before the end padding (DeepSpeed's ``padded_group_numel``)."""
        return self.offsets[-1] + self.numels[-1] if self.numels else 0

    def group_padding(self, rank: int) -> int:
        """The padding at the end of ``rank``'s slice (DeepSpeed's ``groups_padding``)."""
        left = rank * self.partition
        return min(self.partition, max(0, left + self.partition - self.padded_numel))

    def kept(self, rank: int) -> int:
        """The elements of ``rank``'s fp32 master slice a checkpoint keeps."""
        return self.partition - self.group_padding(rank)

    def fragments(self, index: int) -> list[Fragment]:
        """Param ``index``'s pieces on the ranks, in rank order; they cover it once."""
        begin, numel = self.offsets[index], self.numels[index]
        out = []
        for rank in range(begin // self.partition if self.partition else 0, self.world):
            lo, hi = rank * self.partition, (rank + 1) * self.partition
            start, stop = max(begin, lo), min(begin + numel, hi)
            if start >= stop:
                break
            out.append(Fragment(rank, start - lo, start - begin, stop - start))
        return out

    def overlapping(self, rank: int) -> list[int]:
        """The params whose elements ``rank``'s slice holds, in order (DeepSpeed's
        ``params_in_partition``): the params of its Muon momentum buffer."""
        lo, hi = rank * self.partition, (rank + 1) * self.partition
        return [
            i
            for i, (begin, numel) in enumerate(zip(self.offsets, self.numels, strict=True))
            if numel and begin < hi and begin + numel > lo
        ]

    def momentum_offsets(self, rank: int) -> list[tuple[int, int]]:
        """``(param index, offset)`` of each whole param in ``rank``'s flat Muon momentum."""
        out, at = [], 0
        for index in self.overlapping(rank):
            out.append((index, at))
            at += self.numels[index]
        return out

    def momentum_numel(self, rank: int) -> int:
        return sum(self.numels[i] for i in self.overlapping(rank))


def group_layout(
    numels: Sequence[int], world: int, paddings: Sequence[int] | None = None
) -> GroupLayout:
    """The layout DeepSpeed gives a group of params of ``numels`` elements (in its order) over
    ``world`` ranks, each param followed by ``paddings`` (DeepSpeed's
    ``param_alignment_paddings``; None: none)."""
    if world < 1:
        raise LayoutError(f"a DeepSpeed group needs at least one rank, got {world}")
    paddings = [0] * len(numels) if paddings is None else list(paddings)
    if len(paddings) != len(numels) or any(n < 0 for n in [*numels, *paddings]):
        raise LayoutError(
            f"{len(numels)} params with {len(paddings)} paddings: one count each, none negative"
        )
    offsets, at = [], 0
    for numel, padding in zip(numels, paddings, strict=True):
        offsets.append(at)
        at += numel + padding
    if paddings and paddings[-1]:
        raise LayoutError("DeepSpeed pads after every param but the last")
    alignment = START_ALIGNMENT * world
    aligned = -(-at // alignment) * alignment
    return GroupLayout(world, tuple(numels), tuple(offsets), aligned // world)


@dataclass(frozen=True)
class Zero3Layout:
    """ZeRO-3's layout of one sub-group over ``world`` ranks, pure (ints only).

    ZeRO-3 partitions each param on its own: ``P = ceil(numel / world)`` elements a rank,
    rank ``r`` holding elements ``[r * P, (r + 1) * P)`` of it, zero-padded past its end
    (``partition_parameters.py``: ``partition_numel``). A rank's fp32 master of the sub-group,
    its Adam moments and its Muon momentum are its params' partitions one after the other, in
    the sub-group's order (``stage3.py``: ``fp32_partitioned_groups_flat``,
    ``_muon_update_sub_group``; ``zero_to_fp32.py``: ``zero3_partitioned_param_info``)."""

    world: int
    numels: tuple[int, ...]
    """Each param's element count, in the sub-group's order."""

    def partition(self, index: int) -> int:
        """Param ``index``'s elements on each rank, padding included."""
        return -(-self.numels[index] // self.world)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each param's partition begins in a rank's flat partition."""
        out, at = [], 0
        for index in range(len(self.numels)):
            out.append(at)
            at += self.partition(index)
        return tuple(out)

    @property
    def flat_numel(self) -> int:
        """The elements of a rank's flat partition of the sub-group."""
        return sum(self.partition(i) for i in range(len(self.numels)))

    def held(self, index: int, rank: int) -> int:
        """The elements of param ``index`` (not padding) that ``rank``'s partition holds, from
        element ``rank * partition(index)`` of the param on."""
        size = self.partition(index)
        return max(0, min(size, self.numels[index] - rank * size))


def zero3_layout(numels: Sequence[int], world: int) -> Zero3Layout:
    """The ZeRO-3 layout of a sub-group of params of ``numels`` elements over ``world`` ranks."""
    if world < 1:
        raise LayoutError(f"a DeepSpeed group needs at least one rank, got {world}")
    if any(n < 0 for n in numels):
        raise LayoutError(f"params of {list(numels)} elements: none may be negative")
    return Zero3Layout(world, tuple(numels))
