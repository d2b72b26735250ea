"""Property tests of the shape rules (muonckpt.layout.state_shapes): which elements of a state
tensor not shaped like its param each holder of a region of the param keeps, under every
layout :func:`~muonckpt.layout.topology.arrange` makes; refused exactly where the layout would
cut a row or column statistic. No processes. The reference is an index tensor of the param:
a holder may keep a row statistic iff its elements are whole rows, a column statistic iff
they are whole columns, any other non-element-wise state iff it holds the whole param.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muonckpt.layout.state_shapes import (
    COLUMN,
    OWN,
    ROW,
    SAME,
    SCALAR,
    StateShape,
    local_shape,
    shape_rule,
    state_region,
)
from muonckpt.layout.topology import LayoutOptions, ParamSpec, Topology, arrange

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_each_rule_from_the_shapes():
    assert shape_rule((32, 48), (32, 48)) == SAME
    assert shape_rule((32, 48), (1536,)) == SAME  # AdaMuon's flat v
    assert shape_rule((4, 8, 6), (4, 48)) == SAME  # Moonlight's 2-D momentum of a 3-D param
    assert shape_rule((32, 48), (32, 1)) == ROW  # NorMuon's second moment
    assert shape_rule((32, 48), (1, 48)) == COLUMN
    assert shape_rule((32, 48), (1,)) == SCALAR
    assert shape_rule((32, 48), (7, 3)) == OWN


def _elements(region) -> list[int]:
    return [i for lo, hi in region.intervals() for i in range(lo, hi)]


@st.composite
def layouts(draw):
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    tp = draw(st.sampled_from([t for t in (1, 2, 3) if rows % t == 0 or cols % t == 0]))
    splits = [-1] + [d for d, n in enumerate((rows, cols)) if tp > 1 and n % tp == 0]
    split = draw(st.sampled_from(splits)) if tp > 1 else -1
    dp = draw(st.integers(1, 4))
    bucket = draw(st.sampled_from([None, 1, 5, 64]))
    other = ParamSpec("other", (draw(st.integers(1, 9)),), group=0)
    spec = ParamSpec("w", (rows, cols), tp_split_dim=split, group=0)
    order = [other, spec] if draw(st.booleans()) else [spec, other]
    options = LayoutOptions(bucket_numel=bucket) if bucket else LayoutOptions()
    layout = arrange(order, Topology(dp, tp), options=options)
    return (rows, cols), layout, order.index(spec)


@SETTINGS
@given(layouts(), st.sampled_from([SAME, ROW, COLUMN, SCALAR, OWN]))
def test_state_regions_follow_the_param_or_refuse_exactly_where_a_statistic_is_cut(case, rule):
    (rows, cols), layout, index = case
    shape = {SAME: (rows * cols,), ROW: (rows, 1), COLUMN: (1, cols), SCALAR: (1,)}.get(rule, (7,))
    stored = StateShape(rule, shape)
    grid = torch.arange(rows * cols).view(rows, cols)
    topology = layout.topology
    covered: list[int] = []
    for rank in layout.owner_ranks(index):
        region = layout.owner_region(index, *topology.coords(rank))
        held = set(_elements(region))
        got = state_region(stored, (rows, cols), region)
        whole = len(held) == rows * cols
        if rule == SAME:
            expected = sorted(held)
        elif rule == ROW:
            touched = {i for i in range(rows) if held & set(grid[i].tolist())}
            ok = held == {e for i in touched for e in grid[i].tolist()}
            expected = sorted(touched) if ok else None
        elif rule == COLUMN:
            touched = {j for j in range(cols) if held & set(grid[:, j].tolist())}
            ok = held == {e for j in touched for e in grid[:, j].tolist()}
            expected = sorted(touched) if ok else None
        else:
            expected = list(range(math.prod(shape))) if whole else None
        assert (None if got is None else _elements(got)) == expected, (rank, region)
        if got is not None:
            covered += _elements(got)
            assert got.numel == math.prod(local_shape(stored, (rows, cols), region, (0,)))
    if all(
        state_region(stored, (rows, cols), layout.owner_region(index, *topology.coords(r)))
        for r in layout.owner_ranks(index)
    ):
        assert sorted(covered) == list(range(math.prod(shape)))  # each element once


def test_a_holder_of_nothing_keeps_nothing_and_the_whole_param_keeps_the_whole_state():
    from muonckpt.layout.topology import Region, whole_region

    stored = StateShape(OWN, (3, 5))
    assert state_region(stored, (4, 4), whole_region(16)) == whole_region(15)
    assert state_region(stored, (4, 4), Region(16, 0, 16, 4, 4)).numel == 0
    assert state_region(None, (4, 4), Region(16, 0, 16, 0, 8)) == Region(16, 0, 16, 0, 8)
    assert local_shape(stored, (4, 4), whole_region(16), (4, 4)) == (3, 5)
    assert local_shape(StateShape(ROW, (4, 1)), (4, 4), Region(16, 0, 16, 8, 16), (8,)) == (2, 1)
