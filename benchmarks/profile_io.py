"""Where the time of the offline tools and of the ``async_save`` call goes (issue 36's profiles).

``offline``: the synthetic state of ``synthetic.py`` saved per rank at 2 x 2 (untimed), then

* the stages of ``offline.consolidate`` and ``offline.reshard`` (to 4 x 2), each in a fresh
  process: summed wall time inside ``pread`` of the reads, their checksum verification, the
  reads' whole ``read_groups`` (the copies into the output included), ``pwrite``, the output's
  XXH3 and ``sync_file_range``. Reads and writes overlap on two threads, so the sum exceeds
  the total;
* the same consolidate with parts switched off (no input verification, no output hashing, no
  fsync, none of the three), against ``cp -r`` + fsync, fresh processes, interleaved rounds.

``async``: ``cProfile`` of the ``async_save`` call on every rank (2 x 2 gloo processes, after two
warm-up saves): each rank's call times, and the functions of the rank whose call took longest;
then the call's timeline over ``--rounds`` rounds: when the last rank has the rendezvous'
verdict, when the ranks' copies start and end, when the ``stage`` step ends and the ranks
return, against the floor's copy (each round's outputs deleted and ``os.sync()`` run before
it, as in ``bench_async.py``).

    python benchmarks/profile_io.py offline --size 1GB --rounds 5
    python benchmarks/profile_io.py async --size 1GB --rounds 10
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import fsync_tree, parse_size

OFF = {"noverify": "input verification", "nohash": "output hashing", "nosync": "fsync"}
"""The parts a variant may switch off, and what they are."""


def save_worker(shapes, root: str) -> None:
    """One rank of the 2 x 2 job: its share of the synthetic state, saved."""
    from synthetic import build_optimizer, fill_state

    import muonckpt

    opt = build_optimizer(shapes, 2, 2)
    fill_state(opt)
    muonckpt.save(opt, Path(root), params=False)


def stages(op: str, src: str, dst: str) -> dict[str, float]:
    """(in a child) ``op`` run once with its stages timed."""
    import muonckpt.storage.safetensors_reader as reader
    import muonckpt.storage.safetensors_writer as writer
    from muonckpt import offline

    spent: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def timed(name: str, work):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return work(*args, **kwargs)
            finally:
                with lock:
                    spent[name] += time.perf_counter() - start

        return run

    cls = reader.SafetensorsReader
    cls._read_into = timed("read: pread", cls._read_into)
    cls._verify = timed("read: verify (XXH3)", cls._verify)
    cls.read_groups = timed("read: read_groups, all of it", cls.read_groups)
    writer.pwrite_all = timed("write: pwrite", writer.pwrite_all)
    writer.chunk_digests = timed("write: XXH3 of the output", writer.chunk_digests)
    writer.start_writeback = timed("write: sync_file_range", writer.start_writeback)
    start = time.perf_counter()
    _run(offline, op, src, dst)
    return {"total": time.perf_counter() - start, **spent}


def variant(op: str, src: str, dst: str, off: list[str]) -> float:
    """(in a child) ``op`` (or ``cp``) with the parts ``off`` switched off: its seconds."""
    import muonckpt.storage.safetensors_reader as reader
    import muonckpt.storage.safetensors_writer as writer
    from muonckpt import offline

    if "noverify" in off:
        reader.SafetensorsReader._verify = lambda *args, **kwargs: None
    if "nohash" in off:  # digests of the right count, so that the manifest keeps its shape
        writer.chunk_digests = lambda view, chunk: bytes(8 * -(-len(view) // chunk))
    if "nosync" in off:
        os.fsync = lambda fd: None
    start = time.perf_counter()
    if op == "cp":
        subprocess.run(["cp", "-r", src, dst], check=True)
        fsync_tree(Path(dst))
    else:
        _run(offline, op, src, dst)
    return time.perf_counter() - start


def _run(offline, op: str, src: str, dst: str) -> None:
    if op == "consolidate":
        offline.consolidate(src, dst)
    else:
        offline.reshard(src, dst, dp=4, tp=2)


def _child(*args: str) -> Any:
    """Run this script's ``_child`` with ``args`` in a fresh process; its JSON result."""
    done = subprocess.run(
        [sys.executable, __file__, "_child", *args], capture_output=True, text=True, check=False
    )
    if done.returncode:
        sys.exit(f"profile_io: {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def profile_offline(size: str, rounds: int, root: Path) -> None:
    from synthetic import model_shapes

    from muonckpt.distributed import run_distributed

    src, dst = root / "src", root / "out"
    run_distributed(save_worker, 4, model_shapes(parse_size(size)), str(src), timeout=3600)
    print(f"### Stages ({size} at 2x2; seconds summed inside each, threads overlap)\n")
    for op in ("consolidate", "reshard"):
        for _ in range(2):
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()
            spent = _child("stages", op, str(src), str(dst))
            shown = ", ".join(f"{k} {v:.3f}" for k, v in spent.items())
            print(f"- {op}: {shown}")
    cases = [("cp", ""), ("consolidate", "")] + [("consolidate", part) for part in OFF]
    cases.append(("consolidate", ",".join(OFF)))
    seconds: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
    for _ in range(rounds):
        for op, off in cases:
            shutil.rmtree(dst, ignore_errors=True)
            os.sync()
            seconds[op, off].append(float(_child("variant", op, str(src), str(dst), off)))
    print(f"\n### Parts switched off ({rounds} interleaved rounds, fresh processes)\n")
    print("| what | median s | every round |\n| --- | --- | --- |")
    for (op, off), taken in seconds.items():
        parts = " and ".join(OFF[part] for part in off.split(",") if part)
        label = "cp -r + fsync" if op == "cp" else op + (f", without {parts}" if parts else "")
        runs = " / ".join(f"{t:.2f}" for t in taken)
        print(f"| {label} | {statistics.median(taken):.3f} | {runs} |")


TIMED = {
    "agree": "muonckpt.checkpoint.saving",
    "collect": "muonckpt.checkpoint.saving",
    "stage": "muonckpt.checkpoint.saving",
    "_in_background": "muonckpt.checkpoint.api",
}
"""The steps of the ``async_save`` call whose ends the timeline records (function: module),
with the snapshot's copy (``HostBuffers.start_snapshot``)."""

TIMELINE = {
    "floor": "the floor: the slowest rank's copy into preallocated host buffers",
    "call": "the call: the slowest rank's",
    "last call": "the last rank calls",
    "last agreed": "the last rank has the rendezvous' verdict (and the layout)",
    "first copy": "the first rank starts its copy",
    "last copy": "the last rank starts its copy",
    "slowest copy": "the slowest rank's copy (its duration)",
    "copies done": "the last copy ends",
    "first staged": "the first rank has the stage step's outcome",
    "last staged": "the last rank has it",
    "last return": "the last rank returns",
}
"""The rows of the timeline: times from the first rank's call (ms), the floor and the call and
the slowest copy as durations."""


def async_worker(shapes, root: str, rounds: int) -> dict:
    """One rank: two warm-up async saves, the call profiled, then ``rounds`` rounds of the
    floor's copy and the call, each after a barrier, with the times its steps end."""
    import importlib

    import torch
    import torch.distributed as dist
    from synthetic import build_optimizer, fill_state

    import muonckpt
    from muonckpt.state.hostcopy import HostBuffers

    opt = build_optimizer(shapes, 2, 2)
    local = fill_state(opt)
    calls, text = [], ""
    for round_ in range(4):
        dist.barrier()
        profile = cProfile.Profile() if round_ == 3 else None
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        future = muonckpt.async_save(opt, Path(root) / f"r{round_}", params=False)
        if profile is not None:
            profile.disable()
        calls.append(time.perf_counter() - start)
        future.result()
        if profile is not None:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(20)
            text = out.getvalue()

    events: dict[str, float] = {}

    def timed(owner: Any, name: str) -> None:
        work = getattr(owner, name)

        def run(*args, **kwargs):
            events.setdefault(f"{name}<", time.perf_counter())
            try:
                return work(*args, **kwargs)
            finally:
                events[f"{name}>"] = time.perf_counter()

        setattr(owner, name, run)

    for name, module in TIMED.items():
        timed(importlib.import_module(module), name)
    timed(HostBuffers, "start_snapshot")
    floor = {key: torch.zeros_like(value) for key, value in local.items()}
    timeline = []
    for round_ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for key, value in local.items():
            floor[key].copy_(value)
        copied = time.perf_counter() - start
        if dist.get_rank() == 0:
            shutil.rmtree(Path(root) / f"t{round_ - 1}", ignore_errors=True)
        dist.barrier()
        os.sync()
        dist.barrier()
        events.clear()
        events["call"] = time.perf_counter()  # one machine: the ranks share this clock
        future = muonckpt.async_save(opt, Path(root) / f"t{round_}", params=False)
        events["return"] = time.perf_counter()
        future.result()
        timeline.append({"floor": copied, **events})
    return {"calls": calls[2:], "profile": text, "timeline": timeline}


def _timeline_rows(ranks: list[dict]) -> dict[str, list[float]]:
    """Each round's :data:`TIMELINE` rows, in ms, from every rank's events."""
    rows: dict[str, list[float]] = {row: [] for row in TIMELINE}

    def last(each: tuple[dict, ...], key: str) -> float:
        return (max(e[key] for e in each) - min(e["call"] for e in each)) * 1000

    for each in zip(*(r["timeline"] for r in ranks), strict=True):
        first = min(e["call"] for e in each)
        copies = [e["start_snapshot>"] - e["start_snapshot<"] for e in each]
        rows["floor"].append(max(e["floor"] for e in each) * 1000)
        rows["call"].append(max(e["return"] - e["call"] for e in each) * 1000)
        rows["last call"].append(last(each, "call"))
        rows["last agreed"].append(last(each, "agree>"))
        rows["first copy"].append((min(e["start_snapshot<"] for e in each) - first) * 1000)
        rows["last copy"].append(last(each, "start_snapshot<"))
        rows["slowest copy"].append(max(copies) * 1000)
        rows["copies done"].append(last(each, "start_snapshot>"))
        rows["first staged"].append((min(e["stage>"] for e in each) - first) * 1000)
        rows["last staged"].append(last(each, "stage>"))
        rows["last return"].append(last(each, "return"))
    return rows


def profile_async(size: str, rounds: int, root: Path) -> None:
    from synthetic import model_shapes

    from muonckpt.distributed import run_distributed

    ranks = run_distributed(
        async_worker, 4, model_shapes(parse_size(size)), str(root), rounds, timeout=3600
    )
    for rank, result in enumerate(ranks):
        print(f"rank {rank}: the call took {[round(c, 3) for c in result['calls']]} s")
    slowest = max(range(len(ranks)), key=lambda r: ranks[r]["calls"][-1])
    print(f"\n### rank {slowest}, the profiled call\n\n```\n{ranks[slowest]['profile']}```")
    print(f"\n### The call's timeline, {rounds} rounds (ms from the first rank's call)\n")
    print("| event | median | every round |\n| --- | --- | --- |")
    for row, times in _timeline_rows(ranks).items():
        runs = " / ".join(f"{t:.1f}" for t in times)
        print(f"| {TIMELINE[row]} | {statistics.median(times):.1f} | {runs} |")


def main() -> None:
    if sys.argv[1:2] == ["_child"]:
        kind, op, src, dst, *rest = sys.argv[2:]
        if kind == "stages":
            print(json.dumps(stages(op, src, dst)))
        else:
            print(json.dumps(variant(op, src, dst, [p for p in rest[0].split(",") if p])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("offline", "async"), nargs="+")
    parser.add_argument("--size", default="1GB", help="total optimizer state, e.g. 1GB")
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds of the offline variants and of the timeline"
    )
    args = parser.parse_args()
    for what in args.what:
        with tempfile.TemporaryDirectory(prefix="muonckpt-profile-") as tmp:
            if what == "offline":
                profile_offline(args.size, args.rounds, Path(tmp))
            else:
                profile_async(args.size, args.rounds, Path(tmp))


if __name__ == "__main__":
    main()
