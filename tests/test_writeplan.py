"""The pure write plan (muonckpt.format.writeplan): what every checkpoint write puts where, checked
before any I/O. Expectations are computed independently: element coverage by enumerating
full-tensor indices, file sizes by summing bytes."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muonckpt import CheckpointError
from muonckpt.format.manifest import DTYPE_BYTES
from muonckpt.format.names import PARAM_KEY, rank_file
from muonckpt.format.writeplan import (
    PerRankPlan,
    TensorWrite,
    WritePlan,
    consolidated_plan,
    rank_plan,
)
from muonckpt.layout.topology import LayoutOptions, ParamSpec, Topology, arrange, whole_region

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def params_and_topology(draw):
    dp, tp = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2]))
    specs = []
    for i in range(draw(st.integers(1, 5))):
        rows = draw(st.integers(1, 4)) * tp
        cols = draw(st.integers(1, 4)) * tp
        shape = draw(st.sampled_from([(rows, cols), (rows * cols,)]))
        split = draw(st.sampled_from([-1, *range(len(shape))]))
        specs.append(ParamSpec(f"p{i}", shape, tp_split_dim=split, group=draw(st.integers(0, 1))))
    bucket = draw(st.one_of(st.none(), st.integers(1, 40)))
    return specs, Topology(dp, tp), LayoutOptions(bucket_numel=bucket)


def _elements(writes, param, key):
    out = []
    for w in writes:
        if (w.param, w.key) == (param, key):
            out += [i for start, stop in w.region.intervals() for i in range(start, stop)]
    return sorted(out)


@SETTINGS
@given(params_and_topology())
def test_a_reshard_plan_stores_every_element_of_every_tensor_exactly_once(case):
    specs, topology, options = case
    layout = arrange(specs, topology, options=options)
    keys = ("momentum_buffer", PARAM_KEY)
    owned = [
        [
            ((spec.name, key, "F32"), region)
            for index, spec in enumerate(specs)
            if (region := layout.owner_region(index, *topology.coords(rank))).numel
            for key in keys
        ]
        for rank in range(topology.world_size)
    ]
    plan = PerRankPlan(len(owned), owned.__getitem__)
    assert list(plan.files) == [rank_file(r, topology.world_size) for r in range(len(owned))]
    for spec in specs:
        for key in keys:
            assert _elements(plan.writes, spec.name, key) == list(range(spec.numel))
    assert plan.total_bytes == sum(s.numel for s in specs) * len(keys) * 4
    assert plan.count == len(plan.writes) == sum(map(len, owned))
    for rank, file in enumerate(plan.files):  # each file's writes as its rank_plan makes them
        alone = rank_plan(rank, len(owned), owned[rank])
        assert plan.by_file()[file] == alone.writes and plan.specs(file) == alone.specs(file)


@SETTINGS
@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=8),
    st.one_of(st.none(), st.integers(1, 200)),
)
def test_a_consolidated_plan_keeps_files_under_the_limit_and_indexes_them(sizes, limit):
    items = [((f"w{i}", "exp_avg", "F64"), (n,)) for i, n in enumerate(sizes)]
    items += [((f"w{i}", PARAM_KEY, "BF16"), (n,)) for i, n in enumerate(sizes)]
    plan = consolidated_plan(items, limit)
    for file, writes in plan.by_file().items():
        stored = sum(w.nbytes for w in writes)
        assert limit is None or stored <= limit or len(writes) == 1, (file, stored)
        assert all(file.startswith("model" if w.key == PARAM_KEY else "optimizer") for w in writes)
        assert [w.tensor for w in writes] == sorted(w.tensor for w in writes)
    for stem, dtype in (("optimizer", "F64"), ("model", "BF16")):
        files = [f for f in plan.files if f.startswith(stem)]
        index = plan.texts.get(f"{stem}.safetensors.index.json")
        assert (index is None) == (len(files) == 1)
        if index is not None:
            body = json.loads(index)
            assert body["metadata"]["total_size"] == sum(sizes) * DTYPE_BYTES[dtype]
            assert sorted(set(body["weight_map"].values())) == sorted(files)
    assert plan.total_bytes == sum(sizes) * (8 + 2)


def test_writes_come_file_by_file_in_key_order_whatever_order_they_were_given():
    a = TensorWrite("b.safetensors", "x", "k", "F32", whole_region(2), (2,))
    b = TensorWrite("a.safetensors", "y", "k", "F32", whole_region(3), (3,))
    c = TensorWrite("b.safetensors", "a", "k", "F32", whole_region(1), (1,))
    plan = WritePlan({"b.safetensors": {}, "a.safetensors": {}}, (b, a, c))
    assert plan.writes == (c, a, b)
    assert plan.specs("b.safetensors") == {"state.a.k": ("F32", (1,)), "state.x.k": ("F32", (2,))}


@pytest.mark.parametrize(
    ("writes", "message"),
    [
        ([TensorWrite("z.safetensors", "x", "k", "F32", whole_region(2), (2,))], "unplanned"),
        ([TensorWrite("a.safetensors", "x", "k", "Q8", whole_region(2), (2,))], "dtype 'Q8'"),
        ([TensorWrite("a.safetensors", "x", "k", "F32", whole_region(6), (2, 2))], "hold 6"),
        (
            [TensorWrite("a.safetensors", "x", "k", "F32", whole_region(2), (2,))] * 2,
            "planned twice",
        ),
        (
            [
                TensorWrite("a.safetensors", "state.x.k", PARAM_KEY, "F32", whole_region(2), (2,)),
                TensorWrite("a.safetensors", "x", "k", "F32", whole_region(2), (2,)),
            ],
            "would both be stored as 'state.x.k'",
        ),
    ],
)
def test_a_plan_that_could_not_be_written_or_read_back_is_refused(writes, message):
    with pytest.raises(CheckpointError, match=message):
        WritePlan({"a.safetensors": {}}, tuple(writes))


def test_a_rank_plan_names_its_rank_and_stores_regions_flat():
    region = arrange([ParamSpec("w", (4, 6), tp_split_dim=1)], Topology(2, 2)).region(0, 1, 1)
    plan = rank_plan(3, 4, [(("w", "momentum_buffer", "BF16"), region)])
    assert plan.files == {rank_file(3, 4): {"format": "muonckpt", "rank": "3"}}
    (write,) = plan.writes
    assert write.shape == (region.numel,) and write.nbytes == region.numel * 2
    columns = {i % 6 for start, stop in write.region.intervals() for i in range(start, stop)}
    assert columns == {3, 4, 5}  # TP rank 1 of 2 holds the second half of dim 1
