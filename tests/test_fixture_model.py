"""The suite's fixture model is what its tables say, so the counts derived from them hold."""

from __future__ import annotations

import muonckpt
from muonckpt.layout.topology import Topology

from .fixture_model import (
    ADAMW_PARAMS,
    BUCKET_NUMEL,
    MUON_PARAMS,
    N_STATE_TENSORS,
    PARAM_NAMES,
    SHAPES,
    STATE_KEYS,
    TP_SPLIT_DIMS,
    initial_params,
    shard,
    single_process_optimizer,
)

TOPOLOGIES = [(1, 2), (2, 1), (2, 2), (4, 2), (2, 4), (8, 1), (4, 1)]
"""Every grid the tests shard the fixture model at."""


def test_the_optimizer_keeps_the_state_the_tables_list():
    opt = single_process_optimizer(1)
    state = {
        name: sorted(opt.state[p])
        for g in opt.param_groups
        for name, p in zip(g["param_names"], g["params"], strict=True)
    }
    assert list(state) == PARAM_NAMES
    assert state == {name: sorted(keys) for name, keys in STATE_KEYS.items()}
    assert sum(len(keys) for keys in state.values()) == N_STATE_TENSORS


def test_a_checkpoint_lists_the_tables_params(tmp_path):
    manifest = muonckpt.read_manifest(muonckpt.save(single_process_optimizer(1), tmp_path / "c"))
    assert [p.name for p in manifest.params] == PARAM_NAMES
    assert {p.name: tuple(p.shape) for p in manifest.params} == SHAPES


def _kind(name: str) -> tuple[int, int]:
    """(ndim, TP split dim or -1)."""
    return len(SHAPES[name]), TP_SPLIT_DIMS.get(name, -1)


def test_every_kind_of_param_is_there():
    assert {_kind(n) for n in MUON_PARAMS} == {(2, 0), (2, 1), (2, -1)}
    assert {_kind(n) for n in ADAMW_PARAMS} == {(1, -1), (1, 0), (2, 1)}
    assert all(len(set(SHAPES[n])) == 2 for n in SHAPES if len(SHAPES[n]) == 2)  # not square
    for name, dim in TP_SPLIT_DIMS.items():  # every tp the tests run divides the split dims
        assert all(SHAPES[name][dim] % tp == 0 for tp in {tp for _, tp in TOPOLOGIES}), name


def test_sharding_at_every_test_grid_makes_several_buckets_and_empty_ranges():
    params = initial_params()
    for dp, tp in TOPOLOGIES:
        layout = shard(params, dp, tp, 0, 0).layout
        assert layout.topology == Topology(dp, tp)
        assert len(layout.buckets[0]) > 1, (dp, tp, BUCKET_NUMEL)
        if dp > 1:  # some DP rank holds nothing of some param
            empty = [
                (i, r)
                for i in range(len(PARAM_NAMES))
                for r in range(dp)
                if layout.dp_range(i, r) == (0, 0)
            ]
            assert empty, (dp, tp)
