"""Newton-Schulz work per rank, bytes moved and step time of the packaged Muon's distributed step:
each matrix orthogonalized on one rank (``orthogonalize="one_rank"``, the default) against on
every rank holding a piece of it (``"every_holder"``, the seed's way).

    python benchmarks/bench_ns.py                                  # 2x2, 4x1, 4x2
    python benchmarks/bench_ns.py --grid 4x2 --hidden 256 --layers 2 --json out.json

Model: ``synthetic.model_shapes`` at ``--hidden`` (default 128) with ``--layers`` layers (default
4): per layer qkv (3h x h, TP dim 0), proj (h x h, TP dim 1), up (4h x h, TP dim 0), down
(h x 4h, TP dim 1) in the Muon group, two norms and an 8h x h embedding in the AdamW group;
sharded by ``synthetic.build_optimizer`` (ZeRO-1 + TP, one bucket). Params and grads are random.

Per grid and mode, in dp x tp gloo processes of one thread each: one warm-up step (the default's
first step also learns the grid's params, a collective), one step under ``torch.profiler``
(``with_flops``, CPU), whose ``aten::mm`` FLOPs are the rank's Newton-Schulz FLOPs (the step has
no other matrix product), then ``--steps`` timed steps, each started after a barrier: a step's
time is its slowest rank's, the table shows the median. Bytes: what each rank receives from the
step's collectives (all-gathers, point-to-point messages), counted by wrapping the functions of
``muonckpt.distributed.collectives`` in the rank's process; the table shows the grid's total and
the busiest rank's. The modes' params are compared bitwise after the last step. The single-process
row is the same model's step in this process (one thread), profiled the same way.

Ratios are to the single-process step's FLOPs. The issue's target at 4x2: the grid's total
within 1.25x, the busiest rank within ``max(2 / (dp * tp), largest matrix + 1 / (dp * tp))``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist
from synthetic import build_optimizer, model_shapes, state_keys
from torch.profiler import ProfilerActivity, profile

import muonckpt
from muonckpt.distributed import collectives, run_distributed
from muonckpt.format.kinds import MUON_STATE_KEYS
from muonckpt.optim.nsplan import ns_flops

MODES = ("one_rank", "every_holder")
NS_STEPS = 5


def shapes_for(hidden: int, layers: int) -> dict:
    """``layers`` layers of synthetic.model_shapes at ``hidden``."""
    one = model_shapes(1, hidden)
    per_layer = sum(
        math.prod(s) * 4 * len(state_keys(n, s)) for n, (s, _) in one.items() if "layers." in n
    )
    return model_shapes(per_layer * layers, hidden)


def muon_matrices(shapes: dict) -> list[tuple[int, ...]]:
    return [s for n, (s, _) in shapes.items() if state_keys(n, s) == MUON_STATE_KEYS]


def mm_flops(work) -> int:
    """``aten::mm`` FLOPs the profiler counts while ``work()`` runs in this process."""
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        work()
    return sum(e.flops for e in prof.key_averages() if e.key == "aten::mm")


class ReceivedBytes:
    """Bytes this rank receives from muonckpt's collectives while installed (a benchmark probe:
    wraps the module's functions, which the optimizer calls through the module)."""

    def __init__(self) -> None:
        self.count = 0
        self._saved = {}

    def __enter__(self) -> ReceivedBytes:
        def wrap(name, received):
            inner = getattr(collectives, name)
            self._saved[name] = inner

            def counted(*args, **kwargs):
                out = inner(*args, **kwargs)
                self.count += received(args, out)
                return out

            setattr(collectives, name, counted)

        def gathered(args, out):  # all but this rank's own part
            local = args[0]
            return (out.numel() - local.numel()) * local.element_size()

        wrap("all_gather_flat", gathered)
        wrap(
            "all_gather_list",
            lambda args, out: sum(t.numel() * t.element_size() for t in out[1:]),
        )
        wrap("exchange", lambda args, out: sum(t.numel() * t.element_size() for t in out))
        return self

    def __exit__(self, *exc) -> None:
        for name, inner in self._saved.items():
            setattr(collectives, name, inner)


def _fill(opt: muonckpt.optim.Muon, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for group in opt.param_groups:
        for p in group["params"]:
            p.copy_(torch.randn(p.shape, generator=gen))


def _grads(opt: muonckpt.optim.Muon, gen: torch.Generator) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=gen)


def _rank(shapes: dict, dp: int, tp: int, steps: int) -> dict:
    """One rank: both modes, same params and grads; FLOPs, bytes, step times, final params."""
    out, finals = {}, {}
    for mode in MODES:
        opt = build_optimizer(shapes, dp, tp, orthogonalize=mode)
        with torch.no_grad():
            _fill(opt, dist.get_rank())
        gen = torch.Generator().manual_seed(1000 + dist.get_rank())
        _grads(opt, gen)
        opt.step()  # warm-up (and the grid's description)
        _grads(opt, gen)
        with ReceivedBytes() as received:
            flops = mm_flops(opt.step)
        times = []
        for _ in range(steps):
            _grads(opt, gen)
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        finals[mode] = [p.clone() for g in opt.param_groups for p in g["params"]]
        out[mode] = {"flops": flops, "bytes": received.count, "times": times}
    same = all(torch.equal(a, b) for a, b in zip(*finals.values(), strict=True))
    return {**out, "same_bits": same}


def single_process(shapes: dict, steps: int) -> dict:
    """The same model's step in this process: FLOPs and median step time."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    muon, adamw = [], []
    for name, (shape, _) in shapes.items():
        target = muon if state_keys(name, shape) == MUON_STATE_KEYS else adamw
        target.append((name, torch.randn(shape, generator=gen)))
    opt = muonckpt.optim.Muon([{"params": muon, "use_muon": True}, {"params": adamw}])
    _grads(opt, gen)
    opt.step()
    _grads(opt, gen)
    flops = mm_flops(opt.step)
    times = []
    for _ in range(steps):
        _grads(opt, gen)
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return {"flops": flops, "seconds": statistics.median(times)}


def run_grid(shapes: dict, dp: int, tp: int, steps: int, single: dict) -> list[dict]:
    ranks = run_distributed(_rank, dp * tp, shapes, dp, tp, steps, timeout=1800)
    world = dp * tp
    largest = max(ns_flops(s, NS_STEPS) for s in muon_matrices(shapes)) / single["flops"]
    bound = max(2 / world, largest + 1 / world)
    rows = []
    for mode in MODES:
        flops = [r[mode]["flops"] for r in ranks]
        received = [r[mode]["bytes"] for r in ranks]
        per_step = [max(ts) for ts in zip(*(r[mode]["times"] for r in ranks), strict=True)]
        rows.append(
            {
                "grid": f"{dp}x{tp}",
                "mode": mode,
                "total_flops": sum(flops),
                "total_ratio": sum(flops) / single["flops"],
                "busiest_ratio": max(flops) / single["flops"],
                "busiest_bound": bound,
                "per_rank_flops": flops,
                "bytes_total": sum(received),
                "bytes_busiest": max(received),
                "step_seconds": statistics.median(per_step),
                "same_bits": all(r["same_bits"] for r in ranks),
            }
        )
    return rows


def print_rows(rows: list[dict], single: dict) -> None:
    print(
        f"single process: {single['flops'] / 1e9:.3f} GFLOP Newton-Schulz, "
        f"step {single['seconds']:.3f} s"
    )
    head = (
        f"{'grid':5} {'mode':13} {'grid FLOPs':>10} {'busiest':>8} {'bound':>6} "
        f"{'MiB moved':>9} {'busiest':>8} {'step s':>7} bits"
    )
    print(head)
    for r in rows:
        print(
            f"{r['grid']:5} {r['mode']:13} {r['total_ratio']:9.3f}x {r['busiest_ratio']:7.3f}x "
            f"{r['busiest_bound']:6.3f} {r['bytes_total'] / 2**20:9.2f} "
            f"{r['bytes_busiest'] / 2**20:8.2f} {r['step_seconds']:7.3f} "
            f"{'same' if r['same_bits'] else 'DIFFER'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", action="append", help="DPxTP, repeatable (default 2x2 4x1 4x2)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per grid and mode")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    shapes = shapes_for(args.hidden, args.layers)
    single = single_process(shapes, args.steps)
    rows = []
    for grid in args.grid or ["2x2", "4x1", "4x2"]:
        dp, tp = (int(x) for x in grid.split("x"))
        rows += run_grid(shapes, dp, tp, args.steps, single)
        print(f"done {grid}", file=sys.stderr)
    print_rows(rows, single)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"single": single, "rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
