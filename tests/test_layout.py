"""Property tests of the pure layout math (muonckpt.layout.topology) and its tensor side (regions).

No processes: every (dp, tp) position is evaluated in this one process. The reference for
"what TP block t is" is torch.chunk on an index tensor, independent of layout's matrix view.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from muonckpt import LayoutError
from muonckpt.layout.topology import (
    Bucket,
    LayoutOptions,
    ParamSpec,
    Placement,
    Region,
    Topology,
    arrange,
    copy_runs,
    dp_slice,
    strided_runs,
    tp_local_shape,
    whole_region,
)
from muonckpt.state.regions import copy_groups_, extract, insert_

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def specs_for(draw, tps: tuple[int, ...]):
    """1..6 params of 1-, 2- or 3-D shapes (size-1 and size-0 dims included), mixed groups.

    A split dim is only chosen among dims whose size every tp in ``tps`` divides.
    """
    unit = math.lcm(*tps)
    specs = []
    for i in range(draw(st.integers(1, 6))):
        ndim = draw(st.integers(1, 3))
        shape = [draw(st.sampled_from([0, 1, 1, 2, 3, 4, 5, 7])) for _ in range(ndim)]
        if draw(st.booleans()):  # make one dim splittable
            d = draw(st.integers(0, ndim - 1))
            shape[d] = unit * draw(st.integers(1, 2))
        valid = [d for d in range(ndim) if shape[d] % unit == 0]
        split = draw(st.sampled_from([-1, *valid]))
        specs.append(
            ParamSpec(f"p{i}", tuple(shape), tp_split_dim=split, group=draw(st.integers(0, 2)))
        )
    return specs


@st.composite
def layout_cases(draw):
    dp, tp = draw(st.integers(1, 9)), draw(st.integers(1, 4))
    specs = draw(specs_for((tp,)))
    return specs, Topology(dp, tp), draw(layout_options())


def layout_options():
    """Any options; with ``buffers_by="group"`` the specs' random groups (0..2, some possibly
    empty) become buffers."""
    return st.builds(
        LayoutOptions,
        bucket_numel=st.one_of(st.none(), st.integers(1, 40)),
        param_alignment=st.sampled_from([1, 2, 3, 4, 8]),
        bucket_alignment=st.sampled_from([1, 2, 4, 6, 16]),
        buffers_by=st.sampled_from(["none", "group"]),
    )


def tp_block_indices(spec: ParamSpec, tp: int, tp_rank: int) -> torch.Tensor:
    """Full-flat indices of TP block ``tp_rank``, in the block's row-major order."""
    index = torch.arange(spec.numel, dtype=torch.int64).reshape(spec.shape)
    if spec.tp_split_dim < 0 or tp == 1:
        return index.reshape(-1)
    return index.chunk(tp, dim=spec.tp_split_dim)[tp_rank].reshape(-1)


def a_param_some_dp_rank_lacks(layout) -> bool:
    dp = layout.topology.dp
    return any(
        layout.dp_range(i, r) == (0, 0) and math.prod(layout.local_shape(i)) > 0
        for i in range(len(layout.specs))
        for r in range(dp)
    )


# dp=9 over 14 elements: several DP ranks own no element of some param.
RANKS_WITHOUT_ELEMENTS = (
    [ParamSpec("tiny", (2,)), ParamSpec("w", (4, 3), tp_split_dim=0)],
    Topology(9, 2),
    LayoutOptions(),
)


@SETTINGS
@given(layout_cases())
@example(RANKS_WITHOUT_ELEMENTS)
def test_every_element_has_exactly_one_owner(case):
    specs, topo, options = case
    layout = arrange(specs, topo, options=options)
    for i, spec in enumerate(specs):
        counts = torch.zeros(spec.numel, dtype=torch.int64)
        for dp_rank in range(topo.dp):
            for tp_rank in range(topo.tp):
                region = layout.owner_region(i, dp_rank, tp_rank)
                for lo, hi in region.intervals():
                    assert 0 <= lo < hi <= spec.numel
                    counts[lo:hi] += 1
        assert bool((counts == 1).all()), (spec, counts.tolist())


@SETTINGS
@given(layout_cases())
@example(RANKS_WITHOUT_ELEMENTS)
def test_owner_ranks_are_the_ranks_owning_elements(case):
    specs, topo, options = case
    layout = arrange(specs, topo, options=options)
    for i in range(len(specs)):
        owning = [
            r for r in range(topo.world_size) if layout.owner_region(i, *topo.coords(r)).numel
        ]
        assert layout.owner_ranks(i) == owning, (specs[i], topo, options)


@SETTINGS
@given(layout_cases())
@example(RANKS_WITHOUT_ELEMENTS)
def test_dp_regions_partition_each_tp_block_in_order(case):
    specs, topo, options = case
    layout = arrange(specs, topo, options=options)
    for i, spec in enumerate(specs):
        full_index = torch.arange(spec.numel, dtype=torch.int64).reshape(spec.shape)
        local_numel = math.prod(layout.local_shape(i))
        for tp_rank in range(topo.tp):
            block = tp_block_indices(spec, topo.tp, tp_rank)
            assert block.numel() == local_numel
            pieces, covered = [], 0
            for dp_rank in range(topo.dp):
                lo, hi = layout.dp_range(i, dp_rank)
                region = layout.region(i, dp_rank, tp_rank)
                assert region.numel == hi - lo
                if hi > lo:  # ranges are consecutive in dp order
                    assert lo == covered
                    covered = hi
                pieces.append(extract(full_index, region))
            assert covered == local_numel
            assert torch.equal(torch.cat(pieces), block)


@SETTINGS
@given(layout_cases())
def test_buckets_and_placements(case):
    """The buckets as the optimizer takes them (``global_buffer_sizes``), checked against the
    packing rules, and each param's placement and DP ranges against those buckets."""
    specs, topo, options = case
    layout = arrange(specs, topo, options=options)
    pad = math.lcm(topo.dp, options.bucket_alignment)

    def buffer_of(spec: ParamSpec) -> int:
        return spec.group if options.buffers_by == "group" else 0

    sizes = layout.global_buffer_sizes()  # per buffer, [(size, offset), ...]
    assert len(sizes) == max((buffer_of(spec) for spec in specs), default=-1) + 1
    for buffer in sizes:  # laid end to end from 0, each a multiple of lcm(dp, alignment)
        ends = list(itertools.accumulate(size for size, _ in buffer))
        assert [offset for _, offset in buffer] == [0, *ends][:-1]
        assert all(size % topo.dp == 0 and size % pad == 0 for size, _ in buffer)
    members: dict[tuple[int, int], list[int]] = {}
    for i, (spec, place) in enumerate(zip(specs, layout.placements)):
        assert place.buffer == buffer_of(spec)
        size, offset = sizes[place.buffer][place.bucket]
        lo, hi = place.global_range
        assert (
            hi - lo
            == math.prod(layout.local_shape(i))
            == spec.numel // (topo.tp if spec.tp_split_dim >= 0 else 1)
        )
        # never straddles a bucket; aligned relative to the bucket start
        assert offset <= lo <= hi <= offset + size
        assert (lo - offset) % options.param_alignment == 0
        # dp_range is exactly the param's elements that fall in each rank's equal share of the
        # bucket, found element by element
        owners = [(x - offset) * topo.dp // size for x in range(lo, hi)]
        for dp_rank in range(topo.dp):
            mine = [k for k, owner in enumerate(owners) if owner == dp_rank]
            expected = (mine[0], mine[-1] + 1) if mine else (0, 0)
            assert layout.dp_range(i, dp_rank) == expected
        members.setdefault((place.buffer, place.bucket), []).append(i)
    for (buffer, k), idx in members.items():
        # packing order is input order, no overlaps
        ranges = [layout.placements[i].global_range for i in idx]
        assert idx == sorted(idx)
        assert all(r1[1] <= r2[0] for r1, r2 in itertools.pairwise(ranges))
        size, offset = sizes[buffer][k]
        content = ranges[-1][1] - offset
        # padded to the smallest multiple of lcm(dp, bucket_alignment) that holds its content
        assert content <= size < content + pad
        if options.bucket_numel is not None:
            # a bucket closes as soon as it holds bucket_numel elements, not before
            if k < len(sizes[buffer]) - 1:
                assert content >= options.bucket_numel
            if len(idx) > 1:
                assert ranges[-2][1] - offset < options.bucket_numel
    for buffer, bucket_list in enumerate(sizes):  # no bucket without a param
        assert {k for (b, k) in members if b == buffer} == set(range(len(bucket_list)))


def test_some_dp_ranks_own_nothing_of_a_param():
    specs = [ParamSpec("tiny", (2,)), ParamSpec("w", (4, 3), tp_split_dim=0), ParamSpec("v", (5,))]
    layout = arrange(specs, Topology(9, 2), options=LayoutOptions(bucket_numel=2))
    assert a_param_some_dp_rank_lacks(layout)
    # tiny is alone in a bucket of 18: ranks 0 and 1 hold one element each, the rest nothing
    assert [layout.dp_range(0, r) for r in range(9)] == [(0, 1), (1, 2)] + [(0, 0)] * 7
    assert layout.region(0, 5, 0).numel == 0
    assert list(layout.region(0, 5, 0).intervals()) == []


@st.composite
def reshard_cases(draw):
    topo_a = Topology(draw(st.integers(1, 6)), draw(st.integers(1, 4)))
    topo_b = Topology(draw(st.integers(1, 6)), draw(st.integers(1, 4)))
    specs = draw(specs_for((topo_a.tp, topo_b.tp)))
    return specs, topo_a, draw(layout_options()), topo_b, draw(layout_options())


@SETTINGS
@given(reshard_cases())
def test_strided_runs_reshard_reproduces_target_pieces(case):
    specs, topo_a, opt_a, topo_b, opt_b = case
    src_layout = arrange(specs, topo_a, options=opt_a)
    dst_layout = arrange(specs, topo_b, options=opt_b)
    for i, spec in enumerate(specs):
        full = torch.randn(spec.shape, dtype=torch.float64)
        sources = [
            (src_layout.owner_region(i, d, t), extract(full, src_layout.region(i, d, t)))
            for d in range(topo_a.dp)
            for t in range(topo_a.tp)
        ]
        for d in range(topo_b.dp):
            for t in range(topo_b.tp):
                target_region = dst_layout.region(i, d, t)
                target = torch.full((target_region.numel,), float("nan"), dtype=torch.float64)
                written = torch.zeros(target_region.numel, dtype=torch.int64)
                for src_region, piece in sources:
                    # owner_region is region or empty; its groups index the full source piece
                    groups = strided_runs(src_region, target_region)
                    copy_groups_(target, piece, groups)
                    for run in (run for group in groups for run in group.runs()):
                        assert run.length > 0
                        written[run.dst : run.dst + run.length] += 1
                assert bool((written == 1).all())
                assert torch.equal(target, extract(full, target_region))


@SETTINGS
@given(reshard_cases())
def test_copy_runs_same_block_is_one_run(case):
    specs, topo, opt_a, _, opt_b = case
    a, b = arrange(specs, topo, options=opt_a), arrange(specs, topo, options=opt_b)
    for i, spec in enumerate(specs):
        index = torch.arange(spec.numel).reshape(spec.shape)
        for t in range(topo.tp):
            for d1 in range(topo.dp):
                for d2 in range(topo.dp):
                    r1, r2 = a.region(i, d1, t), b.region(i, d2, t)
                    runs = copy_runs(r1, r2)
                    assert len(runs) <= 1
                    # the run copies exactly the elements both hold, found by their indices
                    held_1, held_2 = extract(index, r1).tolist(), extract(index, r2).tolist()
                    copied = {
                        held_2[r.dst + k]: held_1[r.src + k] for r in runs for k in range(r.length)
                    }
                    shared = set(held_1) & set(held_2)
                    assert copied == {e: e for e in shared}


@SETTINGS
@given(layout_cases())
def test_extract_insert_round_trip(case):
    specs, topo, options = case
    layout = arrange(specs, topo, options=options)
    for i, spec in enumerate(specs):
        full = torch.randn(spec.shape)
        rebuilt = torch.full(spec.shape, float("nan"))
        for d in range(topo.dp):
            for t in range(topo.tp):
                region = layout.owner_region(i, d, t)
                insert_(rebuilt, region, extract(full, region))
        assert torch.equal(rebuilt, full)


def test_whole_region_and_matrix_view_examples():
    assert list(whole_region(6).intervals()) == [(0, 6)]
    # (4, 6) split on dim 1 over tp=2: block 1 is columns 3..5 of each row
    layout = arrange([ParamSpec("w", (4, 6), tp_split_dim=1)], Topology(1, 2))
    assert list(layout.region(0, 0, 1).intervals()) == [(3, 6), (9, 12), (15, 18), (21, 24)]
    assert layout.local_shape(0) == (4, 3)


# --- bad input ---------------------------------------------------------------------------------


def test_tp_not_dividing_names_the_param():
    with pytest.raises(LayoutError, match=r"'layer\.w'.*not divisible by tp=2"):
        arrange([ParamSpec("layer.w", (5, 4), tp_split_dim=0)], Topology(1, 2))
    with pytest.raises(LayoutError, match="'b'"):
        tp_local_shape("b", (4, 3), 1, 2)


def test_duplicate_names():
    with pytest.raises(LayoutError, match=r"duplicate param names: \['a'\]"):
        arrange([ParamSpec("a", (2,)), ParamSpec("b", (2,)), ParamSpec("a", (3,))], Topology(1, 1))


@pytest.mark.parametrize("shape,dim", [((3, 4), 2), ((3, 4), -2), ((), 0), ((5,), 1)])
def test_bad_tp_split_dim(shape, dim):
    with pytest.raises(LayoutError, match=r"'w'.*tp_split_dim"):
        ParamSpec("w", shape, tp_split_dim=dim)


def test_negative_size():
    with pytest.raises(LayoutError, match="'w'"):
        ParamSpec("w", (3, -1))


def test_bucket_size_not_divisible_by_dp():
    with pytest.raises(LayoutError, match="bucket size 10 is not divisible by dp=4"):
        dp_slice((0, 3), 0, 10, 4, 1)
    assert dp_slice((0, 3), 0, 12, 4, 0) == (0, 3)
    assert dp_slice((0, 3), 0, 12, 4, 1) == (0, 0)
    assert dp_slice((4, 7), 0, 12, 4, 1) == (0, 2)
    assert dp_slice((4, 7), 0, 12, 4, 2) == (2, 3)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(bucket_numel=0), "bucket_numel must be positive, got 0"),
        (dict(bucket_numel=-3), "bucket_numel must be positive, got -3"),
        (dict(bucket_numel=2.5), "bucket_numel must be an int, got 2.5"),
        (dict(param_alignment=0), "param_alignment must be positive, got 0"),
        (dict(param_alignment=True), "param_alignment must be an int, got True"),
        (dict(param_alignment=None), "param_alignment must be an int, got None"),
        (dict(bucket_alignment=-1), "bucket_alignment must be positive, got -1"),
        (dict(bucket_alignment="4"), "bucket_alignment must be an int, got '4'"),
        (dict(buffers_by="dtype"), "buffers_by must be one of 'none', 'group', got 'dtype'"),
        (dict(buffers_by=None), "buffers_by must be one of 'none', 'group', got None"),
    ],
)
def test_layout_options_refuse_bad_values_naming_the_field(fields, message):
    with pytest.raises(LayoutError) as caught:
        LayoutOptions(**fields)
    assert str(caught.value) == message


def test_layout_options_are_frozen_keyword_only_values():
    options = LayoutOptions(bucket_numel=8, param_alignment=2, bucket_alignment=4)
    assert options == LayoutOptions(bucket_alignment=4, param_alignment=2, bucket_numel=8)
    assert hash(options) == hash(
        LayoutOptions(bucket_numel=8, param_alignment=2, bucket_alignment=4)
    )
    assert LayoutOptions() == LayoutOptions(
        bucket_numel=None, param_alignment=1, bucket_alignment=1, buffers_by="none"
    )
    with pytest.raises(TypeError):
        LayoutOptions(8)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.bucket_numel = 9  # type: ignore[misc]


def test_arrange_takes_options_whole():
    specs = [ParamSpec("a", (2,))]
    with pytest.raises(LayoutError, match="options must be a LayoutOptions, got dict"):
        arrange(specs, Topology(1, 1), options={"bucket_numel": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        arrange(specs, Topology(1, 1), LayoutOptions())  # type: ignore[misc]
    with pytest.raises(TypeError):
        arrange(specs, Topology(1, 1), bucket_numel=1)  # type: ignore[call-arg]


def test_buffers_by_group_refuses_a_negative_group():
    specs = [ParamSpec("a", (2,)), ParamSpec("b", (2,), group=-1)]
    assert len(arrange(specs, Topology(1, 1)).buckets) == 1  # no buffers by group: no problem
    with pytest.raises(LayoutError, match="param 'b': group -1"):
        arrange(specs, Topology(1, 1), options=LayoutOptions(buffers_by="group"))


def test_every_option_at_work_on_a_worked_example():
    """Buckets and places worked out by hand: dp=2, buckets closed at 6 elements, params
    aligned to 2, buckets padded to lcm(2, 4) = 4, one buffer per group."""
    specs = [
        ParamSpec("a", (5,)),
        ParamSpec("b", (3,), group=1),
        ParamSpec("c", (2, 4), tp_split_dim=1),  # 4 elements per TP rank
        ParamSpec("d", (1,)),
    ]
    options = LayoutOptions(
        bucket_numel=6, param_alignment=2, bucket_alignment=4, buffers_by="group"
    )
    layout = arrange(specs, Topology(2, 2), options=options)
    # buffer 0: a at [0, 5); c aligned to 6, [6, 10): 10 >= 6 closes bucket 0, padded to 12;
    # d at [12, 13), bucket 1 padded to 4. Buffer 1: b at [0, 3), one bucket padded to 4.
    assert layout.buckets == ((Bucket(0, 12), Bucket(12, 4)), (Bucket(0, 4),))
    assert layout.placements == (
        Placement(0, 0, (0, 5)),
        Placement(1, 0, (0, 3)),
        Placement(0, 0, (6, 10)),
        Placement(0, 1, (12, 13)),
    )
    assert [layout.dp_range(2, r) for r in range(2)] == [(0, 0), (0, 4)]
    # the same specs without options: one buffer, one bucket, packed tight
    plain = arrange(specs, Topology(2, 2))
    assert plain.buckets == ((Bucket(0, 14),),)
    assert [p.global_range for p in plain.placements] == [(0, 5), (5, 8), (8, 12), (12, 13)]


@pytest.mark.parametrize("dp,tp", [(0, 1), (1, 0)])
def test_bad_topology(dp, tp):
    with pytest.raises(LayoutError):
        Topology(dp, tp)
    with pytest.raises(ValueError):  # what a caller that knows no muonckpt errors catches
        Topology(dp, tp)


@st.composite
def region_pairs(draw):
    """Two regions of one tensor: column blocks of one or two matrix views, or whole rows."""
    numel = draw(st.sampled_from([12, 24, 36]))

    def region() -> Region:
        cols = draw(st.sampled_from([c for c in (1, 2, 3, 4, 6, 12, numel) if numel % c == 0]))
        width = draw(st.integers(1, cols))
        block_start = draw(st.integers(0, cols - width))
        size = numel // cols * width
        start = draw(st.integers(0, size))
        return Region(cols, block_start, width, start, draw(st.integers(start, size)))

    return region(), region()


def _element_map(runs) -> tuple[dict[int, int], int]:
    mapping, total = {}, 0
    for run in runs:
        total += run.length
        mapping.update({run.dst + k: run.src + k for k in range(run.length)})
    return mapping, total


@settings(max_examples=400, deadline=None)
@given(region_pairs())
def test_strided_runs_copy_what_copy_runs_copies(pair):
    source, target = pair
    groups = strided_runs(source, target)
    expanded = [run for group in groups for run in group.runs()]
    assert _element_map(expanded) == _element_map(copy_runs(source, target))
    if source.cols == target.cols:
        assert len(groups) <= 3  # the first and last shared rows, and one group between
