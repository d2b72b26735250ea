"""The committed DeepSpeed fixtures (tests/fixtures/deepspeed, written by DeepSpeed 0.19.8 itself
through make_fixtures.py) are whole and small, and their recorded facts agree with each other.
No DeepSpeed needed, no process started: the ``trainers`` tier reruns DeepSpeed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
FIXTURES = sorted(p.name for p in HERE.iterdir() if (p / "meta.json").is_file())


def meta(name: str) -> dict:
    return json.loads((HERE / name / "meta.json").read_text())


def test_the_fixtures_cover_the_matrix_and_stay_small() -> None:
    specs = {
        (meta(n)["world"], meta(n)["stage"], meta(n)["aux"], meta(n)["dtype"]) for n in FIXTURES
    }
    assert {s[0] for s in specs} == {2, 3}
    assert {s[1] for s in specs} == {1, 2, 3}
    assert {s[2] for s in specs} == {"torch_adam", "fused_adam"}
    assert {s[3] for s in specs} == {"fp32", "bf16"}
    total = sum(p.stat().st_size for p in HERE.rglob("*") if p.is_file())
    assert total < 2_000_000, total


@pytest.mark.parametrize("name", FIXTURES)
def test_each_fixture_is_whole(name: str) -> None:
    spec = meta(name)
    for rel, size in spec["files"].items():
        assert (HERE / name / rel).stat().st_size == size, rel
    prefix = "bf16_" if spec["dtype"] == "bf16" else ""
    ranks = {
        f"ckpt/{spec['tag']}/{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        for r in range(spec["world"])
    }
    if spec["stage"] == 3:  # a model states file per rank
        models = {
            f"ckpt/{spec['tag']}/zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            for r in range(spec["world"])
        }
    else:
        models = {f"ckpt/{spec['tag']}/mp_rank_00_model_states.pt"}
    assert ranks | models | {"ckpt/latest"} == set(spec["files"])
    assert (HERE / name / "ckpt" / "latest").read_text().strip() == spec["tag"]


@pytest.mark.parametrize("name", FIXTURES)
def test_the_truth_holds_each_params_state(name: str) -> None:
    spec = meta(name)
    truth = load_file(HERE / name / "truth.safetensors")
    expected = set()
    for param in spec["params"]:
        keys = ["param", "module"]
        keys += ["momentum_buffer"] if param["use_muon"] else ["exp_avg", "exp_avg_sq", "step"]
        for key in keys:
            expected.add(f"{param['name']}.{key}")
            if key != "step":
                assert list(truth[f"{param['name']}.{key}"].shape) == param["shape"], key
    assert set(truth) == expected
    if spec["dtype"] == "fp32":
        assert spec["master_equals_module"]


@pytest.mark.parametrize("name", [n for n in FIXTURES if meta(n)["stage"] == 3])
def test_zero3_partitions_each_param_on_its_own(name: str) -> None:
    """ZeRO-3: each rank holds ``ceil(numel / world)`` elements of each param from element
    ``rank * ceil(numel / world)`` on, its partitions one after the other in its sub-group's
    flat state; together they cover each param once; Muon's momentum is partitioned alike."""
    spec = meta(name)
    world = spec["world"]
    shapes = {p["name"]: p["shape"] for p in spec["params"]}
    for group in spec["groups"]:
        size = {n: -(-math.prod(shapes[n]) // world) for n in group["params"]}
        assert group["flat_numel"] == sum(size.values())
        covered = {n: [0] * math.prod(shapes[n]) for n in group["params"]}
        for rank, held in enumerate(group["per_rank"]):
            at = 0
            for part in held["param_partitions"]:
                name = part["name"]
                assert (part["start"], part["param_start"]) == (at, rank * size[name])
                for i in range(part["param_start"], part["param_start"] + part["numel"]):
                    covered[name][i] += 1
                at += size[name]
            if group["use_muon"]:
                assert held["state_keys"] == ["momentum_buffer"]
                assert held["state_forms"]["momentum_buffer"].endswith(f"[{at}]")
        assert all(set(c) == {1} for c in covered.values())


@pytest.mark.parametrize("name", [n for n in FIXTURES if meta(n)["stage"] < 3])
def test_the_partitions_cover_each_param_once(name: str) -> None:
    """Per group: the flat buffer splits into ``world`` equal partitions; DeepSpeed's slice
    mappings place every element of every param in exactly one; a Muon param's momentum is
    on every rank whose partition it overlaps; some Muon matrix straddles a boundary."""
    spec = meta(name)
    shapes = {p["name"]: p["shape"] for p in spec["params"]}
    straddling = []
    for group in spec["groups"]:
        assert group["flat_numel"] == spec["world"] * group["partition_size"]
        assert len(group["per_rank"]) == spec["world"]
        for param in group["params"]:
            covered = [0] * math.prod(shapes[param])
            holders = []
            for rank in group["per_rank"]:
                piece = rank["slice_mappings"].get(param)
                if piece is None:
                    continue
                holders.append(rank["partition_id"])
                assert piece["start"] + piece["numel"] <= group["partition_size"]
                for i in range(piece["param_start"], piece["param_start"] + piece["numel"]):
                    covered[i] += 1
            assert set(covered) == {1}, param
            if group["use_muon"]:
                on = [
                    r["partition_id"]
                    for r in group["per_rank"]
                    if param in [m["name"] for m in r["momentum_layout"]]
                ]
                assert on == holders, param
                if len(holders) > 1:
                    straddling.append(param)
    assert straddling, "no Muon matrix split across partitions"
