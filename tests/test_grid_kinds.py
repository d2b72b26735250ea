"""The pure cores added for the seed's sharding and for moving between implementations:
``muonckpt.layout.grid`` (merging each rank's report of its params) and ``muonckpt.format.kinds``
(momentum forms and lr rules). No processes, no torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from muonckpt import StateDictError
from muonckpt.format import kinds
from muonckpt.format.kinds import EMA, SUM, GroupKind, state_mapping, trajectory_notes
from muonckpt.layout.grid import LocalParam, RankReport, grid_of_alike, merge_reports
from muonckpt.layout.topology import ParamSpec, Topology, arrange


def reports(shapes, topology: Topology, named: bool, drop_empty: bool):
    """What each rank of a seed-style layout reports: params it owns no element of are left
    out when ``drop_empty`` (the seed), else held as empty shards."""
    specs = [
        ParamSpec(f"p{i}", s, tp_split_dim=0 if s[0] % topology.tp == 0 else -1)
        for i, s in enumerate(shapes)
    ]
    layout = arrange(specs, topology)
    out = []
    for rank in range(topology.world_size):
        d, t = topology.coords(rank)
        params = []
        for i, spec in enumerate(specs):
            if drop_empty and not layout.region(i, d, t).numel:
                continue
            place = layout.placements[i]
            bucket = layout.buckets[place.buffer][place.bucket]
            params.append(
                LocalParam(
                    name=spec.name if named else None,
                    group=0,
                    local_shape=layout.local_shape(i),
                    tp_split_dim=spec.tp_split_dim,
                    buffer=place.buffer,
                    bucket=place.bucket,
                    global_range=place.global_range,
                    bucket_span=(bucket.size, bucket.offset),
                    dtype="float32",
                )
            )
        out.append(RankReport(1, tuple(params)))
    return specs, out


shapes_strategy = st.lists(
    st.tuples(st.sampled_from([2, 4, 6, 8]), st.integers(1, 5)), min_size=1, max_size=6
)


@given(
    shapes=shapes_strategy,
    dp=st.integers(1, 4),
    tp=st.sampled_from([1, 2]),
    named=st.booleans(),
    drop_empty=st.booleans(),
)
def test_merge_recovers_every_param_whatever_the_ranks_leave_out(shapes, dp, tp, named, drop_empty):
    topology = Topology(dp, tp)
    specs, rank_reports = reports(shapes, topology, named, drop_empty)
    grid = merge_reports(rank_reports, topology)
    assert [p.full_shape for p in grid.params] == [s.shape for s in specs]
    assert [p.name for p in grid.params] == [
        s.name if named else str(i) for i, s in enumerate(specs)
    ]
    for param in grid.params:
        covered = sum(
            param.owner_region(topology, *topology.coords(r)).numel
            for r in range(topology.world_size)
        )
        assert covered == param.spec.local_shape[0] * param.spec.local_shape[1] * (
            tp if param.spec.tp_split_dim >= 0 else 1
        )


@given(
    shapes=shapes_strategy,
    dp=st.integers(1, 4),
    tp=st.sampled_from([1, 2]),
    named=st.booleans(),
)
def test_a_grid_of_alike_reports_is_their_merge_and_owners_come_from_the_bucket(
    shapes, dp, tp, named
):
    """Every rank holding every param (empty shards included): one report gives what merging
    all of them gives, each param at one position on every rank; and each param's owners found
    from its place in its bucket are the ranks whose owner region is not empty."""
    topology = Topology(dp, tp)
    _, rank_reports = reports(shapes, topology, named, drop_empty=False)
    merged = merge_reports(rank_reports, topology)
    alike = grid_of_alike(rank_reports[0], topology)
    assert [(p.name, p.spec, p.full_shape) for p in alike.params] == [
        (p.name, p.spec, p.full_shape) for p in merged.params
    ]
    for a, m in zip(alike.params, merged.params, strict=True):
        assert [a.position_on(r) for r in range(topology.world_size)] == list(m.positions)
        owners = [
            r
            for r in range(topology.world_size)
            if m.owner_region(topology, *topology.coords(r)).numel
        ]
        assert a.owner_ranks(topology) == owners


def test_a_name_twice_in_alike_reports_is_refused():
    topology = Topology(2, 1)
    _, rank_reports = reports([(4, 4), (4, 4)], topology, named=True, drop_empty=False)
    first = rank_reports[0].params[0]
    with pytest.raises(StateDictError, match="'p0' appears twice"):
        grid_of_alike(RankReport(1, (first, *rank_reports[0].params)), topology)


def test_a_rank_lacking_a_param_it_owns_elements_of_is_named():
    topology = Topology(2, 1)
    # 36 elements, 18 a rank: p1 = [12, 24) straddles both; rank 1 leaves it out.
    _, rank_reports = reports([(4, 3)] * 3, topology, named=True, drop_empty=True)
    held = rank_reports[1].params
    rank_reports[1] = RankReport(1, tuple(p for p in held if p.name != "p1"))
    with pytest.raises(StateDictError, match=r"grid rank 1 \(dp 1, tp 0\).*does not hold"):
        merge_reports(rank_reports, topology)


def test_ranks_that_disagree_are_named():
    topology = Topology(2, 1)
    _, rank_reports = reports([(4, 4), (4, 4)], topology, named=True, drop_empty=False)
    first = rank_reports[1].params[0]
    changed = dataclasses.replace(first, dtype="bfloat16")
    rank_reports[1] = RankReport(1, (changed, *rank_reports[1].params[1:]))
    with pytest.raises(StateDictError, match=r"param 'p0': grid rank 0 .* and grid rank 1 .*dtype"):
        merge_reports(rank_reports, topology)


def test_names_on_some_ranks_only_are_refused():
    topology = Topology(2, 1)
    _, named = reports([(4, 4)], topology, named=True, drop_empty=False)
    _, unnamed = reports([(4, 4)], topology, named=False, drop_empty=False)
    with pytest.raises(StateDictError, match="names its params"):
        merge_reports([named[0], unnamed[1]], topology)


PACKAGED = GroupKind("muonckpt.Muon", "muon", SUM, 0.9, True, "moonlight", 0.2)
TORCH = GroupKind("torch.optim.Muon", "muon", EMA, 0.9, True, "aspect")


def test_momentum_factor_between_forms():
    assert state_mapping(PACKAGED, TORCH, "w", None).keys["momentum_buffer"][1] == pytest.approx(
        0.1
    )
    assert state_mapping(TORCH, PACKAGED, "w", None).keys["momentum_buffer"][1] == pytest.approx(
        10.0
    )
    assert state_mapping(PACKAGED, PACKAGED, "w", None).note is None


@pytest.mark.parametrize("form", [kinds.UNKNOWN, None])
def test_a_muon_momentum_of_no_known_form_is_not_converted(form):
    """A known Muon recording ``unknown`` (or no) form is not taken for sum form."""
    source = dataclasses.replace(TORCH, momentum_form=form)
    with pytest.raises(StateDictError, match=r"param 'w':.*neither 'sum' nor 'ema'"):
        state_mapping(source, PACKAGED, "w", None)
    with pytest.raises(StateDictError, match="not 'sum' or 'ema'"):
        kinds.form_factor(form, SUM, 0.9)


def test_settings_that_cannot_continue_the_trajectory_name_the_fix():
    (note,) = trajectory_notes(PACKAGED, TORCH)
    assert 'adjust_lr_fn="match_rms_adamw"' in note
    assert (
        trajectory_notes(
            PACKAGED,
            GroupKind(**{**TORCH.to_json(), "lr_rule": "moonlight", "matched_adamw_rms": 0.2}),
        )
        == []
    )


@pytest.mark.dist
def test_grid_and_kinds_do_not_import_torch():
    probe = "import sys, muonckpt.layout.grid, muonckpt.format.kinds, muonckpt.format.manifest\n"
    probe += "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


@given(
    family=st.sampled_from(sorted(n for n, f in kinds.DCP_FAMILIES.items() if not f.as_is)),
    role=st.sampled_from(["muon", "adamw"]),
    mu=st.floats(0.0, 0.999),
)
def test_dcp_families_name_every_key_both_ways_and_tell_roles(family, role, mu):
    f = kinds.DCP_FAMILIES[family]
    ours = kinds.MUON_STATE_KEYS if role == "muon" else kinds.ADAMW_STATE_KEYS
    theirs = [f.their_key(role, k) for k in ours]
    assert [f.our_key(role, k) for k in theirs] == list(ours)
    settings = {f.mu_setting: mu} if role == "muon" else {"betas": (0.9, 0.95)}
    assert f.role(settings, theirs) == role
    assert f.role(settings, []) == role  # no state yet: the settings tell
    source = f.group_kind(role, settings)
    assert source.role == role and f.target_kind(source) == source
    if role == "muon":
        assert source.momentum == mu and source.momentum_form == f.momentum_form
        with pytest.raises(StateDictError, match=f.mu_setting):
            f.group_kind(role, {f.mu_setting: 1.0})


def test_a_use_muon_of_0_or_1_is_a_bool_and_no_other_int_is():
    families = [f for f in kinds.DCP_FAMILIES.values() if f.role_setting == "use_muon"]
    assert families
    for f in families:
        assert [f.role({"use_muon": v}, []) for v in (1, 0, True, False)] == [
            "muon",
            "adamw",
            "muon",
            "adamw",
        ]
        assert f.role({"use_muon": 2}, []) is None and f.role({"use_muon": 1.0}, []) is None


def test_a_dcp_family_kept_as_it_is_converts_nothing():
    """dion's NorMuon: its keys kept, every group of an optimizer muonckpt does not know (as a
    native save records it); written only from a NorMuon's groups, unconverted."""
    f = kinds.DCP_FAMILIES["dion-normuon"]
    assert f.as_is and f.their_key("", "variance_neuron") == f.our_key("", "variance_neuron")
    assert f.role({"algorithm": "adamw"}, ["momentum"]) == kinds.UNKNOWN
    kept = f.group_kind(kinds.UNKNOWN, {"algorithm": "normuon", "mu": 0.95})
    assert kept == kinds.GroupKind("dion.NorMuon", None, kinds.UNKNOWN)
    port = kinds.GroupKind("tests.dion_normuon.NorMuon", None, kinds.UNKNOWN)
    assert f.target_kind(port) == kept
    with pytest.raises(StateDictError, match=r"torch\.optim\.Muon is not dion\.NorMuon"):
        f.target_kind(kinds.GroupKind("torch.optim.Muon", "muon", kinds.EMA, 0.95, True))
