"""Benchmark ``muonckpt.async_save``: how long training stalls, and how long until the commit.

The synthetic state (``synthetic.py``) is sharded at dp x tp (default 2 x 2) in gloo
processes, optionally moved to CUDA (``--device cuda``). Every round, interleaved after one
warm-up round, each rank runs:

``copy into preallocated host buffers`` (the floor)
    ``copy_`` of every tensor the rank writes into host buffers allocated (and touched, pinned
    for CUDA state) before the rounds: the least any snapshot can cost.
``async_save: the call (stall)``
    ``muonckpt.async_save(opt, new_dir, params=False)`` until it returns: what training waits.
``async_save: until committed``
    the same save from the call until ``future.result()`` returns (the commit).
``async_save: the background write``
    the part of that after the call returned: what the write, fsync and commit take while
    training goes on (a job's round: its slowest rank's).
``muonckpt.save``
    the synchronous save into a new directory, for comparison.

Before each timed run the ranks ``os.sync()`` (untimed) and the previous round's outputs are
deleted, as in ``bench_checkpoint.py``; with ``--drop-caches`` (root) the page cache is dropped
too. A job's time is its slowest rank's. The floor and the call are also timed as a job
waits for them (``... : the job's``): from the last rank's start to the last rank's end
(the ranks of one machine share ``time.perf_counter``'s clock), which leaves out how far
apart the ranks leave the barrier before it (a rank that starts first waits in the call's
rendezvous for the others, as a job's ranks wait for the slowest at its next collective
anyway). Every save is of the
optimizer state only (``params=False``), the same tensors the floor copies. The extra host
memory of ``async_save`` is the host buffers it keeps per optimizer (reported per rank), and
the growth of the rank's peak RSS over the call and the background write.

    python benchmarks/bench_async.py --size 1GB --dp 2 --tp 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import (
    MiB,
    make_workdir,
    parse_size,
    print_table,
    reset_peak_rss,
    status_bytes,
    summary_row,
)
from synthetic import build_optimizer, fill_state, model_shapes, state_bytes

import muonckpt
from muonckpt.checkpoint import api as checkpoint
from muonckpt.distributed import run_distributed

ROWS = {
    "floor": "copy into preallocated host buffers (floor)",
    "stall": "async_save: the call (stall)",
    "job_floor": "the floor: the job's (last rank's start to last rank's end)",
    "job_stall": "the call: the job's (last rank's call to last rank's return)",
    "commit": "async_save: until committed",
    "background": "async_save: the background write (the call's return to the commit)",
    "sync": "muonckpt.save",
}


def worker(
    shapes, dp: int, tp: int, device: str, workdir: str, repeats: int, drop_caches: bool
) -> dict:
    """One rank: warm-up plus ``repeats`` rounds of the floor, async_save and save."""
    opt = build_optimizer(shapes, dp, tp)
    local = fill_state(opt)
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        for state in opt.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim():
                    state[key] = value.cuda()
        local = {k: v for state in opt.state.values() for k, v in state.items() if v.dim()}
    pinned = device == "cuda"
    floor = {k: torch.zeros(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in local.items()}
    root, rank = Path(workdir), dist.get_rank()
    seconds: dict[str, list[float]] = {key: [] for key in ROWS if not key.startswith("job_")}
    spans: dict[str, list[tuple[float, float]]] = {"job_floor": [], "job_stall": []}
    growth = 0

    def settle(previous: Path | None) -> None:
        dist.barrier()
        if previous is not None and rank == 0:
            shutil.rmtree(previous, ignore_errors=True)
        dist.barrier()
        os.sync()
        if drop_caches and rank == 0:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")  # the outputs' pages: no run pays for reclaiming another's
        dist.barrier()

    for round_ in range(repeats + 1):
        settle(root / f"async-{round_ - 1}")
        start = time.perf_counter()
        for key, value in local.items():
            floor[key].copy_(value, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()
        floor_span = (start, time.perf_counter())
        floor_s = floor_span[1] - start

        settle(None)
        before = reset_peak_rss()
        start = time.perf_counter()
        future = muonckpt.async_save(opt, root / f"async-{round_}", params=False)
        stall_span = (start, time.perf_counter())
        stall_s = stall_span[1] - start
        future.result()
        commit_s = time.perf_counter() - start
        growth = max(growth, status_bytes("VmHWM") - before)

        settle(root / f"sync-{round_ - 1}")
        start = time.perf_counter()
        muonckpt.save(opt, root / f"sync-{round_}", params=False)
        sync_s = time.perf_counter() - start
        if round_:
            times = (floor_s, stall_s, commit_s, commit_s - stall_s, sync_s)
            for key, value in zip(seconds, times, strict=True):
                seconds[key].append(value)
            spans["job_floor"].append(floor_span)
            spans["job_stall"].append(stall_span)
    settle(None)
    return {
        "seconds": seconds,
        "spans": spans,
        "bytes": sum(v.numel() * v.element_size() for v in local.values()),
        "host_buffers": checkpoint._HOST_BUFFERS[opt].nbytes,
        "rss_growth": growth,
    }


def run(
    size: str, dp: int, tp: int, device: str, repeats: int, where: Path, drop_caches: bool
) -> dict:
    shapes = model_shapes(parse_size(size))
    total = state_bytes(shapes)
    workdir = Path(tempfile.mkdtemp(prefix=f"muonckpt-bench-async-{size}-", dir=where))
    try:
        ranks = run_distributed(
            worker,
            dp * tp,
            *(shapes, dp, tp, device, str(workdir), repeats, drop_caches),
            timeout=7200,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    jobs = {
        k: [max(t) for t in zip(*(r["seconds"][k] for r in ranks), strict=True)]
        for k in ROWS
        if not k.startswith("job_")
    }
    for key in ("job_floor", "job_stall"):  # last end minus last start, each round
        rounds = zip(*(r["spans"][key] for r in ranks), strict=True)
        jobs[key] = [max(e for _, e in spans) - max(s for s, _ in spans) for spans in rounds]
    base = {"stall": "floor", "job_stall": "job_floor", "commit": "sync", "background": "sync"}
    rows = [
        summary_row(
            "snapshot floor" if key.endswith("floor") else "async save",
            label,
            jobs[key],
            total,
            baseline_s=statistics.median(jobs[base[key]]) if key in base else None,
        )
        for key, label in ROWS.items()
    ]
    return {
        "size": size,
        "state_bytes": total,
        "grid": f"{dp}x{tp}",
        "device": device,
        "rows": rows,
        "stall_over_floor": statistics.median(jobs["stall"]) / statistics.median(jobs["floor"]),
        "job_stall_over_floor": statistics.median(jobs["job_stall"])
        / statistics.median(jobs["job_floor"]),
        "commit_over_sync": statistics.median(jobs["commit"]) / statistics.median(jobs["sync"]),
        "background_over_sync": statistics.median(jobs["background"])
        / statistics.median(jobs["sync"]),
        "host_buffers_per_rank": [r["host_buffers"] for r in ranks],
        "share_bytes_per_rank": [r["bytes"] for r in ranks],
        "rss_growth_per_rank": [r["rss_growth"] for r in ranks],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GB", help="total optimizer state, e.g. 1GB, 4GB")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds after warm-up")
    parser.add_argument(
        "--workdir", type=make_workdir, default=None, help="where to write (default: system temp)"
    )
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the page cache before each run (root): at 4 GB the outputs' cached pages "
        "otherwise crowd the state, its snapshot and the floor's buffers in memory",
    )
    args = parser.parse_args()
    where = Path(args.workdir or tempfile.gettempdir())
    res = run(args.size, args.dp, args.tp, args.device, args.repeats, where, args.drop_caches)
    print(
        f"\n### {res['size']}: {res['state_bytes'] / MiB:.0f} MiB fp32 state at {res['grid']}, "
        f"state on {res['device']}\n"
    )
    print_table(res["rows"])
    print(
        f"\nstall / floor {res['stall_over_floor']:.2f}x (the job's: "
        f"{res['job_stall_over_floor']:.2f}x); until committed / save "
        f"{res['commit_over_sync']:.2f}x; background write / save "
        f"{res['background_over_sync']:.2f}x; host buffers kept per rank "
        f"{[round(b / MiB) for b in res['host_buffers_per_rank']]} MiB for shares of "
        f"{[round(b / MiB) for b in res['share_bytes_per_rank']]} MiB; peak RSS growth per rank "
        f"{[round(b / MiB) for b in res['rss_growth_per_rank']]} MiB"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
