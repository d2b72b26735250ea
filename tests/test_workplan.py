"""Property tests of the pure work split (muonckpt.layout.workplan) behind the writing shared
among torchrun's ranks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muonckpt import LayoutError
from muonckpt.layout.workplan import WorkUnit, split_work, spread

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def units(draw, max_size: int = 40) -> list[WorkUnit]:
    """Tensors of up to 3 files, laid end to end per file (0-byte ones included)."""
    out, ends = [], {}
    for i in range(draw(st.integers(0, max_size))):
        file = draw(st.sampled_from(["a.safetensors", "b.safetensors", "c.safetensors"]))
        nbytes = draw(st.one_of(st.just(0), st.integers(1, 10), st.integers(1, 10_000)))
        offset = ends.get(file, 64)
        ends[file] = offset + nbytes
        out.append(WorkUnit(file, f"t{i}", offset, nbytes))
    return draw(st.permutations(out))


def _order(unit: WorkUnit) -> tuple[str, int, str]:
    return unit.file, unit.offset, unit.key


@SETTINGS
@given(units(), st.integers(1, 12))
def test_every_unit_exactly_once_in_contiguous_runs(work, workers):
    shares = split_work(work, workers)
    assert len(shares) == workers
    flat = [u for share in shares for u in share]
    assert flat == sorted(work, key=_order)


@SETTINGS
@given(units(), st.integers(1, 12))
def test_balanced_by_bytes(work, workers):
    total = sum(u.nbytes for u in work)
    largest = max((u.nbytes for u in work), default=0)
    loads = [sum(u.nbytes for u in share) for share in split_work(work, workers)]
    assert max(loads) <= total / workers + largest
    if total == 0 and work:
        counts = [len(share) for share in split_work(work, workers)]
        assert max(counts) - min(counts) <= 1


@SETTINGS
@given(units(), st.integers(1, 12), st.randoms())
def test_deterministic_whatever_the_input_order(work, workers, rng):
    shuffled = list(work)
    rng.shuffle(shuffled)
    assert split_work(shuffled, workers) == split_work(work, workers)


@SETTINGS
@given(units(max_size=5), st.integers(6, 40))
def test_more_workers_than_units(work, workers):
    shares = split_work(work, workers)
    assert len(shares) == workers
    assert sorted((u for s in shares for u in s), key=_order) == sorted(work, key=_order)
    if all(u.nbytes == work[0].nbytes > 0 for u in work):
        assert all(len(s) <= 1 for s in shares)


def test_empty_input_and_bad_worker_count():
    assert split_work([], 3) == [[], [], []]
    two = [WorkUnit("f", "a", 0, 10), WorkUnit("f", "b", 10, 10)]
    assert split_work(two, 1) == [two]
    assert split_work(two, 2) == [[two[0]], [two[1]]]
    with pytest.raises(LayoutError, match="workers must be positive"):
        split_work(two, 0)


@SETTINGS
@given(
    st.lists(st.one_of(st.just(0), st.integers(1, 10), st.integers(1, 10_000)), max_size=40),
    st.integers(1, 12),
)
def test_spread_gives_each_item_one_worker_in_runs_balanced_by_bytes(sizes, workers):
    """Replicated params: each written by one rank, in contiguous runs, balanced by bytes."""
    owners = spread(sizes, workers)
    assert len(owners) == len(sizes) and all(0 <= w < workers for w in owners)
    assert owners == sorted(owners)  # contiguous runs in order
    loads = [sum(s for s, w in zip(sizes, owners, strict=True) if w == k) for k in range(workers)]
    assert max(loads, default=0) <= sum(sizes) / workers + max(sizes, default=0)
    assert spread(sizes, 1) == [0] * len(sizes)
