"""Pure layout math: which rank owns which elements of which parameter's state.

Ints and shapes only: no torch.distributed, no tensors, no I/O.

Every parameter has a full (logical) shape. Tensor parallelism (TP) splits it evenly along
``tp_split_dim``; ZeRO-1 data parallelism (DP) then packs the TP-local shards of all parameters
into flat buffers, cuts each buffer into buckets and gives every DP rank one contiguous slice of
every bucket. A rank's share of a parameter is therefore "TP block ``tp_rank``, flat elements
``[start, stop)`` of that block", which :class:`Region` expresses in full-tensor coordinates.

To make every split dimension look alike, a full tensor of shape ``S`` split along ``d`` is
viewed as a matrix of ``prod(S[:d])`` rows and ``prod(S[d:])`` columns (row-major, no copy):
TP block ``t`` is then the column range ``[t*C/T, (t+1)*C/T)``. An unsplit tensor is one row.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from ..errors import LayoutError

Range = tuple[int, int]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the layout sees it."""

    name: str
    """Fully qualified parameter name; checkpoints are keyed by it."""
    shape: tuple[int, ...]
    """Full, unsharded shape."""
    tp_split_dim: int = -1
    """Dimension split across TP ranks, or -1 when every TP rank holds the whole tensor."""
    group: int = 0
    """Index of the optimizer param group the parameter belongs to."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s < 0 for s in self.shape):
            raise LayoutError(f"param {self.name!r}: negative size in shape {self.shape}")
        if not -1 <= self.tp_split_dim < max(len(self.shape), 1) or (
            self.tp_split_dim >= 0 and not self.shape
        ):
            raise LayoutError(
                f"param {self.name!r}: tp_split_dim {self.tp_split_dim} is not -1 or a dimension "
                f"of shape {self.shape}"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Topology:
    """A dp x tp grid of ranks, Megatron order: the TP rank varies fastest."""

    dp: int
    tp: int

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise LayoutError(f"topology needs dp >= 1 and tp >= 1, got dp={self.dp} tp={self.tp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of a rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside a {self.dp} x {self.tp} topology")
        return divmod(rank, self.tp)

    def rank(self, dp_rank: int, tp_rank: int) -> int:
        return dp_rank * self.tp + tp_rank

    def __str__(self) -> str:
        return f"dp={self.dp} x tp={self.tp}"


def matrix_view(shape: Sequence[int], tp_split_dim: int) -> tuple[int, int]:
    """(rows, cols) of the row-major matrix view in which TP blocks are column ranges."""
    if tp_split_dim < 0:
        return 1, math.prod(shape)
    return math.prod(shape[:tp_split_dim]), math.prod(shape[tp_split_dim:])


def tp_local_shape(name: str, shape: Sequence[int], tp_split_dim: int, tp: int) -> tuple[int, ...]:
    """Shape of one TP shard; raises :class:`LayoutError` when ``tp`` does not divide the dim."""
    shape = tuple(shape)
    if tp_split_dim < 0 or tp == 1:
        return shape
    if shape[tp_split_dim] % tp:
        raise LayoutError(
            f"param {name!r}: dimension {tp_split_dim} of shape {shape} (size "
            f"{shape[tp_split_dim]}) is not divisible by tp={tp}"
        )
    return (*shape[:tp_split_dim], shape[tp_split_dim] // tp, *shape[tp_split_dim + 1 :])


def tp_full_shape(local_shape: Sequence[int], tp_split_dim: int, tp: int) -> tuple[int, ...]:
    """Inverse of :func:`tp_local_shape`."""
    shape = tuple(local_shape)
    if tp_split_dim < 0:
        return shape
    return (*shape[:tp_split_dim], shape[tp_split_dim] * tp, *shape[tp_split_dim + 1 :])


@dataclass(frozen=True, slots=True)
class Region:
    """Flat elements ``[start, stop)`` of one column block of a full tensor's matrix view.

    The elements of a region, in the order a rank stores them, are the block's elements in
    row-major order; this is also increasing full-tensor flat order, so a region is an ordered
    union of full-tensor flat intervals (:meth:`intervals`).
    """

    cols: int
    """Columns of the full tensor's matrix view."""
    block_start: int
    """First column of the block."""
    block_width: int
    """Columns in the block."""
    start: int
    """First element, counted row-major inside the block."""
    stop: int
    """One past the last element, counted row-major inside the block."""

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def intervals(self) -> Iterator[Range]:
        """Full-tensor flat ``[start, stop)`` intervals of this region, increasing, merged."""
        if self.numel <= 0:
            return
        if self.block_width == self.cols:
            yield self.start, self.stop
            return
        width = self.block_width
        first_row, last_row = self.start // width, (self.stop - 1) // width
        for row in range(first_row, last_row + 1):
            lo = max(self.start - row * width, 0)
            hi = min(self.stop - row * width, width)
            base = row * self.cols + self.block_start
            yield base + lo, base + hi


@functools.lru_cache(maxsize=4096)
def whole_region(numel: int) -> Region:
    """The region of an entire tensor (one object per size: a description of 100k params of
    a few shapes holds a few regions, not 100k)."""
    return Region(cols=numel, block_start=0, block_width=numel, start=0, stop=numel)


def tp_region(
    shape: Sequence[int], tp_split_dim: int, tp: int, tp_rank: int, flat: Range
) -> Region:
    """Region of flat range ``flat`` of TP block ``tp_rank``, in full-tensor coordinates."""
    rows, cols = matrix_view(shape, tp_split_dim)
    if tp_split_dim < 0 or tp == 1:
        return Region(
            cols=rows * cols, block_start=0, block_width=rows * cols, start=flat[0], stop=flat[1]
        )
    width = cols // tp
    return Region(
        cols=cols, block_start=tp_rank * width, block_width=width, start=flat[0], stop=flat[1]
    )


@dataclass(frozen=True)
class Run:
    """``length`` elements copied from flat offset ``src`` of one holder to ``dst`` of another."""

    src: int
    dst: int
    length: int


def copy_runs(source: Region, target: Region) -> list[Run]:
    """Runs that copy every element shared by two regions of one tensor.

    Offsets are positions inside each holder's own storage order (see :class:`Region`).
    Adjacent runs are merged, so regions of the same block give at most one run.
    """
    if source.numel <= 0 or target.numel <= 0 or not _spans_overlap(source, target):
        return []
    if (source.cols, source.block_start, source.block_width) == (
        target.cols,
        target.block_start,
        target.block_width,
    ):
        lo, hi = max(source.start, target.start), min(source.stop, target.stop)
        return [Run(lo - source.start, lo - target.start, hi - lo)] if lo < hi else []
    if source.cols == target.cols and (
        source.block_start + source.block_width <= target.block_start
        or target.block_start + target.block_width <= source.block_start
    ):
        return []
    runs: list[Run] = []
    src_iter, dst_iter = _offset_intervals(source), _offset_intervals(target)
    src, dst = next(src_iter, None), next(dst_iter, None)
    while src is not None and dst is not None:
        (s_lo, s_hi, s_off), (d_lo, d_hi, d_off) = src, dst
        lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
        if lo < hi:
            run = Run(src=s_off + lo - s_lo, dst=d_off + lo - d_lo, length=hi - lo)
            last = runs[-1] if runs else None
            if last and last.src + last.length == run.src and last.dst + last.length == run.dst:
                runs[-1] = Run(last.src, last.dst, last.length + run.length)
            else:
                runs.append(run)
        if s_hi <= d_hi:
            src = next(src_iter, None)
        if d_hi <= s_hi:
            dst = next(dst_iter, None)
    return runs


@dataclass(frozen=True)
class Strided:
    """``count`` runs of ``length`` elements, run ``i`` from ``src + i * src_step`` to
    ``dst + i * dst_step``: the rows of a column block, copied as one 2-D strided copy."""

    src: int
    dst: int
    length: int
    count: int
    src_step: int
    dst_step: int

    def runs(self) -> list[Run]:
        return [
            Run(self.src + i * self.src_step, self.dst + i * self.dst_step, self.length)
            for i in range(self.count)
        ]


def strided_runs(source: Region, target: Region) -> list[Strided]:
    """What :func:`copy_runs` copies, in O(1) groups instead of one run per matrix row.

    Both regions must describe blocks of the same matrix view (equal ``cols``), or one of them
    must span whole rows (as :func:`whole_region` does), which fits any view whose ``cols``
    divides its range. Otherwise (a TP split dimension changed) this falls back to one
    group per run of :func:`copy_runs`.
    """
    if source.numel <= 0 or target.numel <= 0:
        return []
    target = _common_view(target, like=source)
    source = _common_view(source, like=target)
    if source.cols != target.cols:
        return [Strided(r.src, r.dst, r.length, 1, 0, 0) for r in copy_runs(source, target)]
    lo = max(source.block_start, target.block_start)
    hi = min(source.block_start + source.block_width, target.block_start + target.block_width)
    if lo >= hi:
        return []
    first = max(source.start // source.block_width, target.start // target.block_width)
    last = min((source.stop - 1) // source.block_width, (target.stop - 1) // target.block_width)
    if first > last:
        return []
    # Rows strictly between the first and the last shared row are whole in both regions: one
    # strided group. The first and last may be partial: each is copied on its own.
    groups = _partial_row(source, target, first, lo, hi)
    if last > first + 1:
        groups.append(_row_group(source, target, first + 1, last - first - 1, lo, hi))
    if last > first:
        groups += _partial_row(source, target, last, lo, hi)
    return groups


def _common_view(region: Region, like: Region) -> Region:
    """``region`` in the matrix view of ``like`` when ``region`` spans whole rows of its own."""
    if region.block_width != region.cols or like.cols == region.cols:
        return region
    if region.cols % like.cols:
        return region
    return Region(like.cols, 0, like.cols, region.start, region.stop)


def _row_group(source: Region, target: Region, row: int, count: int, lo: int, hi: int) -> Strided:
    """Rows ``row .. row + count - 1``, whole in both regions, columns ``[lo, hi)``."""
    return Strided(
        src=row * source.block_width + lo - source.block_start - source.start,
        dst=row * target.block_width + lo - target.block_start - target.start,
        length=hi - lo,
        count=count,
        src_step=source.block_width,
        dst_step=target.block_width,
    )


def _partial_row(source: Region, target: Region, row: int, lo: int, hi: int) -> list[Strided]:
    """Row ``row`` (full-matrix columns ``[lo, hi)`` at most), as far as both regions hold it."""

    def columns(region: Region) -> Range:
        base = row * region.block_width
        a = max(region.start - base, 0) + region.block_start
        b = min(region.stop - base, region.block_width) + region.block_start
        return a, b

    (s_lo, s_hi), (t_lo, t_hi) = columns(source), columns(target)
    a, b = max(lo, s_lo, t_lo), min(hi, s_hi, t_hi)
    if a >= b:
        return []
    src = row * source.block_width + a - source.block_start - source.start
    dst = row * target.block_width + a - target.block_start - target.start
    return [Strided(src, dst, b - a, 1, 0, 0)]


def _span(region: Region) -> Range:
    """Smallest full-flat ``[first, last + 1)`` containing a non-empty region."""
    width = region.block_width

    def flat(index: int) -> int:
        return (index // width) * region.cols + region.block_start + index % width

    return flat(region.start), flat(region.stop - 1) + 1


def _spans_overlap(a: Region, b: Region) -> bool:
    (a_lo, a_hi), (b_lo, b_hi) = _span(a), _span(b)
    return a_lo < b_hi and b_lo < a_hi


def _offset_intervals(region: Region) -> Iterator[tuple[int, int, int]]:
    offset = 0
    for lo, hi in region.intervals():
        yield lo, hi, offset
        offset += hi - lo


def dp_slice(
    global_range: Range, bucket_offset: int, bucket_size: int, dp: int, dp_rank: int
) -> Range:
    """Flat range, relative to the parameter, that DP rank ``dp_rank`` owns of a bucketed param.

    ``global_range`` is the param's place in its buffer, ``bucket_offset`` and ``bucket_size``
    its bucket's; each DP rank owns one contiguous ``bucket_size / dp`` slice of the bucket.
    An empty result is ``(0, 0)``.
    """
    if bucket_size % dp:
        raise LayoutError(f"bucket size {bucket_size} is not divisible by dp={dp}")
    share = bucket_size // dp
    lo = max(global_range[0], bucket_offset + share * dp_rank)
    hi = min(global_range[1], bucket_offset + share * (dp_rank + 1))
    if lo >= hi:
        return 0, 0
    return lo - global_range[0], hi - global_range[0]


def share_region(
    full_shape: Sequence[int],
    tp_split_dim: int,
    topology: Topology,
    dp_rank: int,
    tp_rank: int,
    global_range: Range,
    bucket_offset: int,
    bucket_size: int,
    *,
    owner_only: bool = False,
) -> Region:
    """What rank (``dp_rank``, ``tp_rank``) holds of a bucketed param, in full-tensor
    coordinates: its ZeRO-1 slice (:func:`dp_slice`) of TP block ``tp_rank``. With
    ``owner_only`` a TP-replicated param counts on TP rank 0 only, so that every element of
    every param has exactly one owner."""
    split = tp_split_dim if topology.tp > 1 else -1
    if owner_only and split < 0 and tp_rank:
        return tp_region(full_shape, -1, 1, 0, (0, 0))
    flat = dp_slice(global_range, bucket_offset, bucket_size, topology.dp, dp_rank)
    return tp_region(full_shape, split, topology.tp, tp_rank, flat)


@dataclass(frozen=True)
class Bucket:
    """A bucket of a ZeRO-1 flat buffer: ``size`` elements starting at ``offset``."""

    offset: int
    size: int


@dataclass(frozen=True)
class Placement:
    """Where one parameter's TP shard sits inside the ZeRO-1 buffers."""

    buffer: int
    bucket: int
    global_range: Range
    """Flat ``[start, stop)`` inside the buffer."""


@dataclass(frozen=True)
class BufferLayout:
    """A Megatron-style arrangement of params into ZeRO-1 buffers and buckets, for one topology."""

    specs: tuple[ParamSpec, ...]
    topology: Topology
    buckets: tuple[tuple[Bucket, ...], ...]
    """Per buffer, its buckets in order."""
    placements: tuple[Placement, ...]
    """Per spec, where its TP shard sits."""

    def global_buffer_sizes(self) -> list[list[tuple[int, int]]]:
        """``[[(bucket_size, bucket_offset), ...], ...]`` per buffer: what the optimizer takes."""
        return [[(b.size, b.offset) for b in buffer] for buffer in self.buckets]

    def local_shape(self, index: int) -> tuple[int, ...]:
        spec = self.specs[index]
        return tp_local_shape(spec.name, spec.shape, spec.tp_split_dim, self.topology.tp)

    def dp_range(self, index: int, dp_rank: int) -> Range:
        """Flat range of the param's TP shard owned by ``dp_rank`` (relative to the shard)."""
        place = self.placements[index]
        bucket = self.buckets[place.buffer][place.bucket]
        return dp_slice(place.global_range, bucket.offset, bucket.size, self.topology.dp, dp_rank)

    def region(self, index: int, dp_rank: int, tp_rank: int, *, owner_only: bool = False) -> Region:
        """What (dp_rank, tp_rank) holds of param ``index``, in full-tensor coordinates
        (:func:`share_region`)."""
        spec, place = self.specs[index], self.placements[index]
        bucket = self.buckets[place.buffer][place.bucket]
        return share_region(
            spec.shape,
            spec.tp_split_dim,
            self.topology,
            dp_rank,
            tp_rank,
            place.global_range,
            bucket.offset,
            bucket.size,
            owner_only=owner_only,
        )

    def owner_region(self, index: int, dp_rank: int, tp_rank: int) -> Region:
        """Like :meth:`region`, but TP-replicated params count only on TP rank 0.

        Every element of every param has exactly one owner in this sense.
        """
        return self.region(index, dp_rank, tp_rank, owner_only=True)

    def owner_ranks(self, index: int) -> list[int]:
        """The ranks whose :meth:`owner_region` of param ``index`` is not empty
        (:func:`owner_ranks`)."""
        spec, place = self.specs[index], self.placements[index]
        bucket = self.buckets[place.buffer][place.bucket]
        return owner_ranks(
            place.global_range, bucket.offset, bucket.size, spec.tp_split_dim, self.topology
        )


def owner_ranks(
    global_range: Range, bucket_offset: int, bucket_size: int, tp_split_dim: int, topology: Topology
) -> list[int]:
    """The ranks whose owner region (:func:`share_region` with ``owner_only``) of a bucketed
    param is not empty, in increasing order: computed from its place in its bucket, so that
    finding what every rank owns is linear in params plus pieces, not params x ranks."""
    lo, hi = global_range
    share = bucket_size // topology.dp
    if hi <= lo or not share:
        return []
    first = (lo - bucket_offset) // share
    last = (hi - 1 - bucket_offset) // share
    split = topology.tp > 1 and tp_split_dim >= 0
    tp_ranks = range(topology.tp if split else 1)
    return [topology.rank(d, t) for d in range(first, last + 1) for t in tp_ranks]


BuffersBy = Literal["none", "group"]
"""How :func:`arrange` splits params into ZeRO-1 buffers (see :attr:`LayoutOptions.buffers_by`)."""


@dataclass(frozen=True, kw_only=True)
class LayoutOptions:
    """How :func:`arrange` packs params into ZeRO-1 buffers and buckets, beyond the topology.

    Passed whole wherever a layout is built (:func:`arrange`,
    :func:`~muonckpt.optim.sharding.shard_param_groups`, :func:`~muonckpt.offline.tools.reshard`,
    the ``muonckpt reshard`` options). Checked when made: a bad value raises :class:`LayoutError`
    naming the field. The defaults are one buffer, one bucket, no alignment.
    """

    bucket_numel: int | None = None
    """Close a bucket once it holds at least this many elements (None: one bucket per buffer).
    A param never straddles two buckets."""
    param_alignment: int = 1
    """Each param starts at a multiple of this many elements, counted from its bucket's start."""
    bucket_alignment: int = 1
    """Each bucket is padded to a multiple of ``lcm(dp, bucket_alignment)`` elements."""
    buffers_by: BuffersBy = "none"
    """``"none"``: every param in buffer 0. ``"group"``: buffer ``i`` holds the params of
    optimizer param group ``i`` (:attr:`ParamSpec.group`), as Megatron keeps separate buffers
    for params that are updated differently (Muon and AdamW params, say); a group without params
    gives a buffer without buckets."""

    def __post_init__(self) -> None:
        if self.bucket_numel is not None:
            _check_positive("bucket_numel", self.bucket_numel)
        _check_positive("param_alignment", self.param_alignment)
        _check_positive("bucket_alignment", self.bucket_alignment)
        if self.buffers_by not in get_args(BuffersBy):
            choices = ", ".join(repr(c) for c in get_args(BuffersBy))
            raise LayoutError(f"buffers_by must be one of {choices}, got {self.buffers_by!r}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise LayoutError(f"{name} must be positive, got {value}")


def arrange(
    specs: Sequence[ParamSpec],
    topology: Topology,
    *,
    options: LayoutOptions = LayoutOptions(),
) -> BufferLayout:
    """Pack params into ZeRO-1 buffers and buckets, Megatron style.

    Args:
        specs: params in packing order.
        topology: the dp x tp grid; TP shapes use ``topology.tp``.
        options: bucketing, alignment and buffers (:class:`LayoutOptions`; default: one buffer
            of one bucket).
    """
    if not isinstance(options, LayoutOptions):
        raise LayoutError(f"options must be a LayoutOptions, got {type(options).__name__}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise LayoutError(f"duplicate param names: {dupes}")
    if options.buffers_by == "group":
        for spec in specs:
            if spec.group < 0:
                raise LayoutError(
                    f"param {spec.name!r}: group {spec.group} is no buffer index "
                    "(buffers_by='group' numbers buffers from 0)"
                )
    pad_to = math.lcm(topology.dp, options.bucket_alignment)
    buffer_ids = [s.group if options.buffers_by == "group" else 0 for s in specs]
    n_buffers = max(buffer_ids, default=-1) + 1
    buckets: list[list[Bucket]] = [[] for _ in range(n_buffers)]
    placements: list[Placement | None] = [None] * len(specs)
    for buffer in range(n_buffers):
        members = [i for i, b in enumerate(buffer_ids) if b == buffer]
        cursor = bucket_start = 0
        for position, index in enumerate(members):
            spec = specs[index]
            numel = math.prod(tp_local_shape(spec.name, spec.shape, spec.tp_split_dim, topology.tp))
            cursor = bucket_start + _round_up(cursor - bucket_start, options.param_alignment)
            placements[index] = Placement(buffer, len(buckets[buffer]), (cursor, cursor + numel))
            cursor += numel
            limit = options.bucket_numel
            full = limit is not None and cursor - bucket_start >= limit
            if full or position == len(members) - 1:
                size = _round_up(cursor - bucket_start, pad_to)
                buckets[buffer].append(Bucket(offset=bucket_start, size=size))
                cursor = bucket_start = bucket_start + size
    return BufferLayout(
        specs=tuple(specs),
        topology=topology,
        buckets=tuple(tuple(b) for b in buckets),
        placements=tuple(p for p in placements if p is not None),
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
