"""(issue 22) The save path of the packaged Muon runs one way through the package's modules.

Before the redesign a per-rank save went checkpoint -> hooks -> optim -> hooks -> optim -> grid
-> hooks -> checkpoint. Here every call from one package module into another during a real
save is recorded (``sys.setprofile``), leaving out the closures a caller hands down for the
step protocol to call back (``check``, ``write``, the commit watcher: functions defined inside
another function, arguments travelling down) and an object's calls on itself (a base class in
one module calling the method its subclass in another overrides), and no two modules may call
each other.
"""

from __future__ import annotations

import inspect
import sys
from types import FrameType
from typing import Any

import pytest

import muonckpt
from muonckpt.distributed.launch import run_distributed

from .fixture_model import build, initial_params, single_process_optimizer, train


def _module_calls(work: Any) -> dict[tuple[str, str], str]:
    """(caller module, callee module) -> the first callee function, for every call between two
    modules of the package while ``work()`` runs; closures and an object's calls on itself left
    out."""
    calls: dict[tuple[str, str], str] = {}

    def module(frame: FrameType | None) -> str | None:
        name = frame.f_globals.get("__name__", "") if frame is not None else ""
        return name if name.startswith("muonckpt.") else None

    def record(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_flags & inspect.CO_NESTED:
            return
        this = frame.f_locals.get("self")
        if (
            this is not None
            and frame.f_back is not None
            and frame.f_back.f_locals.get("self") is this
        ):
            return
        caller, callee = module(frame.f_back), module(frame)
        if caller and callee and caller != callee:
            calls.setdefault(
                (caller, callee), getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            )

    sys.setprofile(record)
    try:
        work()
    finally:
        sys.setprofile(None)
    return calls


def _both_ways(calls: dict[tuple[str, str], str]) -> list[str]:
    return sorted(
        f"{a} -> {b} ({calls[a, b]}) and back ({calls[b, a]})"
        for a, b in calls
        if (b, a) in calls and a < b
    )


def _save_across_ranks(path: str, dp: int, tp: int) -> list[str]:
    """(each rank) The packaged Muon at dp x tp after a step, saved per rank: this rank's
    module calls that run both ways, and the modules the save passed through."""
    optimizer, sharded, dp_rank, tp_rank = build(dp, tp, initial_params())
    train(optimizer, sharded, dp_rank, tp_rank, 0, 1)
    calls = _module_calls(lambda: muonckpt.save(optimizer, path))
    return [*_both_ways(calls), "modules: " + " ".join(sorted({m for c in calls for m in c}))]


def test_a_single_process_save_runs_one_way_through_the_modules(tmp_path):
    optimizer = single_process_optimizer(1)
    calls = _module_calls(lambda: muonckpt.save(optimizer, tmp_path / "ckpt"))
    assert muonckpt.verify(tmp_path / "ckpt") == []
    modules = {m for pair in calls for m in pair}
    assert {
        "muonckpt.checkpoint.api",
        "muonckpt.checkpoint.saving",
        "muonckpt.state.placement",
    } <= modules
    assert _both_ways(calls) == []


@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (1, 2)])
def test_a_per_rank_save_of_the_distributed_muon_runs_one_way(tmp_path, dp, tp):
    """The path the issue traced (a per-rank save of the distributed packaged Muon, whose
    grid is described on the first save): each rank's calls run one way."""
    for rank, found in enumerate(
        run_distributed(_save_across_ranks, dp * tp, str(tmp_path / "ckpt"), dp, tp)
    ):
        *both_ways, modules = found
        assert both_ways == [], (rank, both_ways)
        for module in ("checkpoint", "saving", "placement", "gather", "grid", "writing"):
            assert f"muonckpt.{module}" in modules.split(), (rank, modules)
    assert muonckpt.verify(tmp_path / "ckpt") == []
