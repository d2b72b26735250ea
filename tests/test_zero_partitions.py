"""Property tests of DeepSpeed ZeRO-1/2's group layout (muonckpt.interop.deepspeed.partitions),
checked against a direct transcription of DeepSpeed 0.19.8's own arithmetic
(``stage_1_and_2.py``: the aligned flat buffer, ``get_data_parallel_partitions``,
``groups_padding``, ``get_partition_info``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muonckpt import LayoutError
from muonckpt.interop.deepspeed.partitions import group_layout

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
numels = st.lists(st.integers(0, 300), min_size=1, max_size=12)


def _deepspeed(numels: list[int], world: int) -> tuple[int, list[int], list[list[int]]]:
    """DeepSpeed's partition size, groups_padding per rank and params_in_partition per rank."""
    total = sum(numels)
    alignment = 2 * world
    aligned = total + ((alignment - total % alignment) if total % alignment else 0)
    partition = aligned // world  # get_data_parallel_partitions: equal, as aligned % world == 0
    paddings, inside = [], []
    for rank in range(world):
        left = rank * partition
        if total <= left:
            paddings.append(partition)
        elif total < left + partition:
            paddings.append(left + partition - total)
        else:
            paddings.append(0)
        start, end, current, mine = partition * rank, partition * (rank + 1), 0, []
        for i, size in enumerate(numels):
            if start <= current < end or current < start < current + size:
                mine.append(i)
            current += size
        inside.append(mine)
    return partition, paddings, inside


@SETTINGS
@given(numels, st.integers(1, 9))
def test_matches_deepspeeds_arithmetic(sizes, world):
    layout = group_layout(sizes, world)
    partition, paddings, inside = _deepspeed(sizes, world)
    assert layout.partition == partition
    assert [layout.group_padding(r) for r in range(world)] == paddings
    # DeepSpeed's rule also lists a 0-element param at a partition's start; it holds nothing
    assert [layout.overlapping(r) for r in range(world)] == [
        [i for i in mine if sizes[i]] for mine in inside
    ]
    assert sum(layout.kept(r) for r in range(world)) == sum(sizes)


@SETTINGS
@given(numels, st.integers(1, 9))
def test_fragments_cover_each_param_once_in_rank_order(sizes, world):
    layout = group_layout(sizes, world)
    for index, numel in enumerate(sizes):
        fragments = layout.fragments(index)
        assert sum(f.numel for f in fragments) == numel
        assert [f.rank for f in fragments] == sorted({f.rank for f in fragments})
        at = 0
        for f in fragments:
            assert f.offset == at and f.start >= 0 and f.start + f.numel <= layout.kept(f.rank)
            assert f.rank * layout.partition + f.start == layout.offsets[index] + f.offset
            at += f.numel
        for rank in range(world):
            assert (index in layout.overlapping(rank)) == any(f.rank == rank for f in fragments)


@SETTINGS
@given(numels, st.integers(1, 9))
def test_momentum_buffer_holds_whole_overlapping_params_in_order(sizes, world):
    layout = group_layout(sizes, world)
    for rank in range(world):
        offsets = layout.momentum_offsets(rank)
        assert [i for i, _ in offsets] == layout.overlapping(rank)
        at = 0
        for index, offset in offsets:
            assert offset == at
            at += sizes[index]
        assert layout.momentum_numel(rank) == at


def test_a_param_split_across_ranks():
    layout = group_layout([512, 512, 16], 2)  # 1040 elements: 520 a rank
    assert layout.partition == 520
    assert [(f.rank, f.start, f.offset, f.numel) for f in layout.fragments(1)] == [
        (0, 512, 0, 8),
        (1, 0, 8, 504),
    ]
    assert layout.overlapping(0) == [0, 1] and layout.overlapping(1) == [1, 2]
    assert [layout.kept(r) for r in range(2)] == [520, 520]


def test_padding_after_params():
    layout = group_layout([3, 5, 2], 1, [1, 3, 0])
    assert layout.offsets == (0, 4, 12)
    assert layout.padded_numel == 14 and layout.partition == 14


def test_refusals():
    with pytest.raises(LayoutError, match="at least one rank"):
        group_layout([4], 0)
    with pytest.raises(LayoutError, match="paddings"):
        group_layout([4, 4], 2, [0])
    with pytest.raises(LayoutError, match="but the last"):
        group_layout([4, 4], 2, [0, 2])
