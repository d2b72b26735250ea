"""Where the packaged Muon runs Newton-Schulz: ``workplan.balance_lpt`` and ``nsplan`` (pure,
property-tested; no processes, no torch)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muonckpt import LayoutError
from muonckpt.layout.grid import LocalParam, RankReport, merge_reports
from muonckpt.layout.topology import LayoutOptions, ParamSpec, Topology, arrange
from muonckpt.layout.workplan import balance_lpt
from muonckpt.optim.nsplan import ns_flops, plan_newton_schulz

costs_strategy = st.lists(st.integers(0, 1000), min_size=0, max_size=7)


def _optimum(costs: list[int], workers: int) -> int:
    """The smallest possible busiest load, by trying every assignment."""
    best = sum(costs)
    for assignment in itertools.product(range(workers), repeat=len(costs)):
        loads = [0] * workers
        for cost, w in zip(costs, assignment):
            loads[w] += cost
        best = min(best, max(loads))
    return best


@pytest.mark.dist
@given(costs=costs_strategy, workers=st.integers(1, 3))
def test_lpt_gives_every_job_one_worker_within_four_thirds_of_the_optimum(costs, workers):
    assigned = balance_lpt(costs, workers)
    assert len(assigned) == len(costs) and all(0 <= w < workers for w in assigned)
    loads = [sum(c for c, w in zip(costs, assigned) if w == k) for k in range(workers)]
    assert sum(loads) == sum(costs)
    # Graham: LPT <= (4/3 - 1/(3m)) OPT, i.e. 3m * LPT <= (4m - 1) * OPT
    assert 3 * workers * max(loads) <= (4 * workers - 1) * _optimum(costs, workers)


@pytest.mark.dist
@given(
    costs=st.lists(st.integers(0, 10**9), max_size=60),
    workers=st.integers(1, 16),
    data=st.data(),
)
def test_lpt_load_bound_affinity_and_determinism(costs, workers, data):
    affinity = data.draw(
        st.lists(
            st.lists(st.integers(0, 3), min_size=workers, max_size=workers),
            min_size=len(costs),
            max_size=len(costs),
        )
    )
    for aff in (None, affinity):
        assigned = balance_lpt(costs, workers, aff)
        loads = [sum(c for c, w in zip(costs, assigned) if w == k) for k in range(workers)]
        # list scheduling: max <= total/m + max_cost * (1 - 1/m)
        bound = sum(costs) * 1 + max(costs, default=0) * (workers - 1)
        assert max(loads, default=0) * workers <= bound
        assert balance_lpt(costs, workers, aff) == assigned
    # with all loads equal at the start, the largest job goes where its affinity is highest
    if costs:
        first = min(range(len(costs)), key=lambda j: (-costs[j], j))
        chosen = balance_lpt(costs, workers, affinity)[first]
        assert affinity[first][chosen] == max(affinity[first])


def test_lpt_bad_input():
    with pytest.raises(LayoutError, match="workers must be positive"):
        balance_lpt([1], 0)
    with pytest.raises(LayoutError, match="negative"):
        balance_lpt([1, -2], 2)
    with pytest.raises(LayoutError, match="affinity"):
        balance_lpt([1, 2], 2, [[0, 1]])


def test_ns_flops_counts_the_matrix_products():
    # 24 x 36, m = 24, n = 36: per iteration 2 m^2 n twice and 2 m^3
    assert ns_flops((24, 36), 5) == 5 * (4 * 24 * 24 * 36 + 2 * 24**3) == 552960
    assert ns_flops((36, 24), 5) == ns_flops((24, 36), 5)


def grid_of(shapes, topology: Topology, options: LayoutOptions):
    """The grid of a layout of Muon matrices (group 0) and vectors (group 1, AdamW), every rank
    leaving out the params it holds nothing of, as the seed does."""
    specs = []
    for i, (shape, split) in enumerate(shapes):
        split = split if split < 0 or shape[split] % topology.tp == 0 else -1
        specs.append(ParamSpec(f"w{i}", shape, tp_split_dim=split, group=0))
    specs.append(ParamSpec("bias", (6,), tp_split_dim=-1, group=1))
    layout = arrange(specs, topology, options=options)
    reports = []
    for rank in range(topology.world_size):
        d, t = topology.coords(rank)
        held = []
        for i, spec in enumerate(specs):
            if not layout.region(i, d, t).numel:
                continue
            place = layout.placements[i]
            bucket = layout.buckets[place.buffer][place.bucket]
            held.append(
                LocalParam(
                    spec.name,
                    spec.group,
                    layout.local_shape(i),
                    spec.tp_split_dim,
                    place.buffer,
                    place.bucket,
                    place.global_range,
                    (bucket.size, bucket.offset),
                    "float32",
                )
            )
        reports.append(RankReport(2, tuple(held)))
    return layout, merge_reports(reports, topology)


shape_strategy = st.tuples(
    st.tuples(st.sampled_from([2, 4, 6, 8, 12]), st.sampled_from([2, 4, 6, 8, 12])),
    st.sampled_from([-1, 0, 1]),
)


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(shape_strategy, min_size=1, max_size=8),
    dp=st.integers(1, 4),
    tp=st.sampled_from([1, 2]),
    bucket_numel=st.sampled_from([None, 30]),
    steps=st.integers(1, 5),
)
def test_plan_runs_every_matrix_once_and_moves_every_element_where_it_is_needed(
    shapes, dp, tp, bucket_numel, steps
):
    topology = Topology(dp, tp)
    options = LayoutOptions(bucket_numel=bucket_numel, buffers_by="group")
    layout, grid = grid_of(shapes, topology, options)
    plan = plan_newton_schulz(grid, {0: steps})
    # every Muon matrix exactly once, none of the AdamW group
    assert [m.name for m in plan.matrices] == [f"w{i}" for i in range(len(shapes))]
    world = topology.world_size
    assert all(0 <= m.worker < world for m in plan.matrices)
    costs = [ns_flops(s, steps) for s, _ in shapes]
    assert [m.flops for m in plan.matrices] == costs
    loads = plan.loads()
    assert sum(loads) == sum(costs)
    assert max(loads) * world <= sum(costs) + max(costs) * (world - 1)
    for k, matrix in enumerate(plan.matrices):
        held = {r: layout.region(k, *topology.coords(r)) for r in range(world)}
        assert plan.held[k] == tuple(h if h.numel else None for h in held.values())
        # the worker's input: its own piece plus the pieces sent to it, each element once
        sent = [
            (m.src, pc.region)
            for m in plan.inputs
            for pc in m.pieces
            if pc.matrix == k and m.dst == matrix.worker
        ]
        assert all(region == held[src] for src, region in sent)
        own = held[matrix.worker]
        elements = [i for _, r in sent for a, b in r.intervals() for i in range(a, b)]
        elements += [i for a, b in own.intervals() for i in range(a, b)]
        assert sorted(elements) == list(range(math.prod(matrix.full_shape)))
        # every other holder gets back exactly what it holds
        back = {
            m.dst: pc.region
            for m in plan.outputs
            for pc in m.pieces
            if pc.matrix == k and m.src == matrix.worker
        }
        assert back == {r: h for r, h in held.items() if h.numel and r != matrix.worker}
    # messages: one per ordered pair and direction, pieces end to end, nobody sends to itself
    for messages in (plan.inputs, plan.outputs):
        pairs = [(m.src, m.dst) for m in messages]
        assert len(set(pairs)) == len(pairs) and all(s != d for s, d in pairs)
        for m in messages:
            assert m.pieces and m.pieces[0].offset == 0
            for a, b in zip(m.pieces, m.pieces[1:]):
                assert b.offset == a.offset + a.region.numel and b.matrix > a.matrix
    # deterministic: the same grid gives the same plan
    assert plan_newton_schulz(grid, {0: steps}) == plan


def test_plan_at_4x2_balances_equal_matrices_one_per_rank_and_prefers_holders():
    shapes = [((8, 8), 0)] * 8
    topology = Topology(4, 2)
    _, grid = grid_of(shapes, topology, LayoutOptions(buffers_by="group"))
    plan = plan_newton_schulz(grid, {0: 5})
    assert sorted(m.worker for m in plan.matrices) == list(range(8))
    for k, matrix in enumerate(plan.matrices):
        assert plan.held[k][matrix.worker] is not None
    # elements moved: each matrix's input arrives once less the worker's piece, and its result
    # goes back the same way
    total = sum(math.prod(s) for s, _ in shapes)
    kept = sum(plan.held[k][m.worker].numel for k, m in enumerate(plan.matrices))
    moved = sum(m.numel for m in plan.inputs) + sum(m.numel for m in plan.outputs)
    assert moved == 2 * (total - kept)


def test_plan_rejects_a_muon_matrix_that_is_not_2d():
    topology = Topology(2, 1)
    _, grid = grid_of([((4, 4), -1)], topology, LayoutOptions(buffers_by="group"))
    with pytest.raises(LayoutError, match=r"'bias'.*2-D"):
        plan_newton_schulz(grid, {0: 5, 1: 5})
