"""Benchmark the cost of ``muonckpt.load``'s post-load check (issue 54), on CPU or CUDA.

One process, no process group: an AdamW over one fp32 param of half of ``--size`` (its state,
``exp_avg`` and ``exp_avg_sq``, the whole ``--size``), on ``--device`` (``cuda``: the param and the
state in CUDA memory, as a GPU job holds them). Two checkpoints of it: one at the saving layout
(a load takes the checksums its read verified for the digests) and one resharded to two ranks'
files, the param split (a load digests the share as it reads it). Each is loaded with and
without the check (``check=False``), each with the optimizer state only and with the params
too, alternating round by round after one warm-up round; a round's wall time (after
``torch.cuda.synchronize()`` on CUDA) and its CPU seconds (``time.process_time``: every thread
of the process) are reported, with the check's cost as the median of the rounds' ratios.

    python benchmarks/bench_check.py --size 1GB --repeats 7
    python benchmarks/bench_check.py --size 1GB --repeats 7 --device cuda
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from common import make_workdir, parse_size

import muonckpt


def _optimizer(numel: int, device: str) -> torch.optim.Optimizer:
    """AdamW over one param of ``numel`` fp32 elements on ``device``, one step taken."""
    param = torch.nn.Parameter(torch.empty(numel, device=device).uniform_(-1, 1))
    opt = torch.optim.AdamW([("w", param)], lr=1e-3)
    param.grad = torch.empty_like(param).uniform_(-1, 1)
    opt.step()
    param.grad = None
    return opt


def _timed(run, device: str) -> tuple[float, float]:
    """Wall and CPU seconds of ``run()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu


def run(size: str, device: str, repeats: int, workdir: Path) -> dict:
    numel = parse_size(size) // 2 // 4
    opt = _optimizer(numel, device)
    root = Path(tempfile.mkdtemp(prefix="bench_check-", dir=workdir))
    try:
        saved = muonckpt.save(opt, root / "saved")
        layouts = {
            "saving layout": saved,
            "resharded (2 ranks' files)": muonckpt.offline.reshard(saved, root / "two", dp=2, tp=1),
        }
        rows, costs = [], {}
        for layout, ckpt in layouts.items():
            for params in (False, True):
                seconds: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
                for round_ in range(repeats + 1):
                    for check in (True, False) if round_ % 2 else (False, True):
                        opt.state.clear()
                        load = partial(muonckpt.load, opt, ckpt, params=params, check=check)
                        took = _timed(load, device)
                        if round_:
                            seconds[check].append(took)
                what = f"{layout}, {'params too' if params else 'state only'}"
                for part, index in (("wall", 0), ("cpu", 1)):
                    ratios = [
                        a[index] / b[index] - 1
                        for a, b in zip(seconds[True], seconds[False], strict=True)
                    ]
                    costs[f"{what}, {part}"] = statistics.median(ratios)
                for check in (True, False):
                    walls = [w for w, _ in seconds[check]]
                    cpus = [c for _, c in seconds[check]]
                    rows.append(
                        {
                            "load": f"{what}, check={check}",
                            "wall median s": round(statistics.median(walls), 3),
                            "wall min s": round(min(walls), 3),
                            "cpu median s": round(statistics.median(cpus), 3),
                        }
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"size": size, "device": device, "repeats": repeats, "rows": rows, "costs": costs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GB", help="the optimizer state, e.g. 1GB")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds after warm-up")
    parser.add_argument(
        "--workdir", type=make_workdir, default=None, help="where to write (default: system temp)"
    )
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.gettempdir())
    res = run(args.size, args.device, args.repeats, workdir)
    print(f"muonckpt.load's check, {res['size']} of AdamW state on {res['device']}\n")
    print("| load | wall median s | wall min s | CPU median s |\n|---|---|---|---|")
    for row in res["rows"]:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")
    print("\nthe check's cost (median of the rounds' ratios):")
    for what, cost in res["costs"].items():
        print(f"  {what}: {cost:+.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
