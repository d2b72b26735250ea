"""Cost against the number of params: save, inspect, verify, load, consolidate, reshard and diff
at 1k to 100k params, in time and peak memory.

    python benchmarks/bench_scale.py                       # 1k and 10k params
    python benchmarks/bench_scale.py --params 1000 --params 10000 --params 100000 --json out.json
    python benchmarks/bench_scale.py --params 10000 --profile prof/   # cProfile of every op

For each ``--params N``, one process builds the packaged :class:`muonckpt.optim.Muon` over N
tiny (2, 2) fp32 params in one AdamW group (two state tensors each, ``exp_avg`` and ``exp_avg_sq``),
takes one step and saves a single-process checkpoint with :func:`muonckpt.save` (timed: the
``save`` row). Then each operation runs in a fresh subprocess, which reports the time of the
operation alone (interpreter start, imports and, for load, building the optimizer excluded):

``inspect``      :func:`muonckpt.offline.summarize` (what ``muonckpt inspect`` shows)
``verify``       :func:`muonckpt.verify` (every checksum)
``load``         :func:`muonckpt.load` into an optimizer over the same params that took one
                 step (a rollback: the load copies into the state it has)
``load-fresh``   :func:`muonckpt.load` into one that took none (a resume: the load makes the
                 state, whose own cost is the ``state (MB)`` row, the RSS the saving child's
                 step added)
``consolidate``  :func:`muonckpt.offline.consolidate` into a new directory
``reshard``      :func:`muonckpt.offline.reshard` to dp=4 x tp=1 into a new directory
``diff``         :func:`muonckpt.offline.iter_diff` of the checkpoint with itself, rows
counted
                 as they stream (every tensor read twice; what ``muonckpt diff`` does)

Each child also reports its peak resident memory (``getrusage(RUSAGE_SELF).ru_maxrss``:
interpreter, imports and, for load, the optimizer included; ``*-rss`` rows, MB) and its
resident memory just before the operation (``OP base (MB)`` rows); the operation's own share
is the difference (``OP growth (MB)`` rows), which issue 20 bounds by 2x the largest tensor +
300 MB (the largest tensor here is 16 bytes).

and the CLI commands ``muonckpt inspect``, ``muonckpt verify`` and ``muonckpt --quiet
consolidate`` run once more as a user runs them, timed as whole commands (``*-cli`` rows:
interpreter, imports and the table printed to /dev/null included). The table gives seconds per
size and, between consecutive sizes, the growth factor divided by the growth in params: 1.0 is
linear, 10 at a 10x step is quadratic. An operation that exceeds ``--timeout`` seconds is
recorded as such and not run at larger sizes. ``--profile DIR`` writes each operation's
cProfile statistics to ``DIR/OP-N.pstats`` and prints its top functions by own time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import make_workdir

OPS = ("inspect", "verify", "load", "load-fresh", "consolidate", "reshard", "diff")
CLI = {
    "inspect-cli": ["inspect", "{ck}"],
    "verify-cli": ["verify", "{ck}"],
    "consolidate-cli": ["--quiet", "consolidate", "{ck}", "-o", "{out}"],
}


def _optimizer(n: int, *, step: bool = True, stepped: dict[str, float] | None = None):
    """The packaged Muon over ``n`` (2, 2) params in one AdamW group, one step taken (none
    with ``step=False``). ``stepped`` gets the RSS the step added (``state_mb``): what its
    state costs when the optimizer makes it."""
    import torch

    import muonckpt

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(n)
    params = [(f"layer{i:06d}.w", torch.randn(2, 2, generator=generator)) for i in range(n)]
    opt = muonckpt.optim.Muon([{"params": params}], lr=0.01)
    if step:
        for _, p in params:
            p.grad = torch.randn(2, 2, generator=generator)
        before = _rss_mb()
        opt.step()
        if stepped is not None:
            stepped["state_mb"] = _rss_mb() - before
    return opt


def build(n: int, path: Path) -> dict[str, float]:
    """(in a child) The checkpoint of ``n`` params at ``path``; the step and save times."""
    import muonckpt

    stepped: dict[str, float] = {}
    start = time.perf_counter()
    opt = _optimizer(n, stepped=stepped)
    built = time.perf_counter() - start
    start = time.perf_counter()
    muonckpt.save(opt, path)
    return {"build_s": built, "save_s": time.perf_counter() - start, **stepped}


def run_op(op: str, ck: Path, out: Path, n: int, profile: Path | None) -> dict[str, float]:
    """(in a child) One operation on the checkpoint, timed alone (optionally profiled)."""
    import cProfile
    import io
    import pstats

    import muonckpt
    from muonckpt import offline

    opt = _optimizer(n, step=op == "load") if op.startswith("load") else None
    calls = {
        "inspect": lambda: offline.summarize(ck),
        "verify": lambda: muonckpt.verify(ck),
        "load": lambda: muonckpt.load(opt, ck),
        "load-fresh": lambda: muonckpt.load(opt, ck),
        "consolidate": lambda: offline.consolidate(ck, out),
        "reshard": lambda: offline.reshard(ck, out, dp=4, tp=1),
        "diff": lambda: sum(not r.equal for r in offline.iter_diff(ck, ck)),
    }
    base = _rss_mb()
    profiler = cProfile.Profile() if profile is not None else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    result = calls[op]()
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - start
    if op == "verify" and result:
        raise SystemExit(f"verify found problems: {result[:3]}")
    if profiler is not None:
        profiler.dump_stats(profile)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
        print(text.getvalue(), file=sys.stderr)
    if op == "diff" and result:
        raise SystemExit("diff of a checkpoint with itself found differences")
    return {"op_s": elapsed, "base_mb": base, "peak_mb": _peak_rss_mb()}


def _rss_mb() -> float:
    """This process's resident memory now, in MB (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError):
        return 0.0


def _peak_rss_mb() -> float:
    """This process's peak resident memory, in MB (``ru_maxrss``: KiB on Linux)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e6 if sys.platform == "darwin" else peak * 1024 / 1e6


def _child(args: list[str], timeout: float) -> dict | None:
    """Run this script as a child with ``args``; its JSON result, or None past ``timeout``."""
    cmd = [sys.executable, __file__, *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cli(argv: list[str], timeout: float) -> float | None:
    """Wall seconds of ``muonckpt ARGV`` (stdout to /dev/null), or None past ``timeout``."""
    cmd = [sys.executable, "-m", "muonckpt.cli", *argv]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        raise SystemExit(f"muonckpt {' '.join(argv)} failed:\n{done.stderr.decode()}")
    return time.perf_counter() - start


def bench(sizes: list[int], root: Path, timeout: float, profile: Path | None) -> dict:
    results: dict[str, dict[int, float | None]] = {"save": {}, "state (MB)": {}}
    for op in (*OPS, *CLI):
        results[op] = {}
    for op in OPS:
        results[f"{op} base (MB)"], results[f"{op} peak (MB)"] = {}, {}
        results[f"{op} growth (MB)"] = {}
    given_up: set[str] = set()
    for n in sizes:
        ck, out = root / f"ck-{n}", root / f"out-{n}"
        print(f"[{n} params] building and saving ...", file=sys.stderr, flush=True)
        built = _child(["_build", str(n), str(ck)], timeout)
        if built is None:
            print(f"[{n} params] save exceeded {timeout:.0f} s: stopping", file=sys.stderr)
            results["save"][n] = None
            break
        results["save"][n] = built["save_s"]
        results["state (MB)"][n] = built["state_mb"]
        for op in OPS:
            if op in given_up:
                for row in (op, f"{op} base (MB)", f"{op} peak (MB)", f"{op} growth (MB)"):
                    results[row][n] = None
                continue
            shutil.rmtree(out, ignore_errors=True)
            args = ["_op", op, str(ck), str(out), str(n)]
            if profile is not None:
                profile.mkdir(parents=True, exist_ok=True)
                args.append(str(profile / f"{op}-{n}.pstats"))
            print(f"[{n} params] {op} ...", file=sys.stderr, flush=True)
            got = _child(args, timeout)
            results[op][n] = None if got is None else got["op_s"]
            results[f"{op} base (MB)"][n] = None if got is None else got["base_mb"]
            results[f"{op} peak (MB)"][n] = None if got is None else got["peak_mb"]
            results[f"{op} growth (MB)"][n] = (
                None if got is None else got["peak_mb"] - got["base_mb"]
            )
            if got is None:
                given_up.add(op)
        for name, argv in CLI.items():
            if name in given_up or name.removesuffix("-cli") in given_up:
                results[name][n] = None
                continue
            shutil.rmtree(out, ignore_errors=True)
            argv = [a.format(ck=ck, out=out) for a in argv]
            results[name][n] = took = _cli(argv, timeout)
            if took is None:
                given_up.add(name)
        shutil.rmtree(ck, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    return results


def _table(results: dict, sizes: list[int]) -> str:
    head = ["operation (s, or MB)", *(f"{n:,} params" for n in sizes)]
    head += [f"growth / params {a:,}->{b:,}" for a, b in itertools.pairwise(sizes)]
    rows = [head, ["---"] * len(head)]
    for op, by_size in results.items():
        row = [op]
        for n in sizes:
            value = by_size.get(n)
            row.append("-" if n not in by_size else "timeout" if value is None else f"{value:.3f}")
        for a, b in itertools.pairwise(sizes):
            x, y = by_size.get(a), by_size.get(b)
            row.append(f"{(y / x) / (b / a):.2f}" if x and y else "-")
        rows.append(row)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


MOE_LAYOUTS = ((8, 8), (128, 8), (512, 8))
RESUME_FROM, RESUME_AT = (128, 8), (2, 2)
"""A real job at ``RESUME_AT`` resumes from the reshard to ``RESUME_FROM``, bitwise."""
"""dp x tp of each reshard of the MoE models (issue 35)."""


def moe_op(op: str, arg: dict) -> dict[str, float]:
    """(in a child) One operation of the MoE benchmark, timed alone, with its RSS."""
    import moe_shapes

    import muonckpt
    from muonckpt import offline

    src, out = Path(arg["src"]), Path(arg.get("out", ""))
    if op == "build":
        return {**moe_shapes.build_checkpoint(arg["model"], arg["layers"], src), **_rss()}
    dims = moe_shapes.split_dims(arg["model"], arg["layers"])
    base = _rss_mb()
    start = time.perf_counter()
    if op == "reshard":
        offline.reshard(src, out, dp=arg["dp"], tp=arg["tp"], tp_split_dims=dims)
        extra: dict[str, float] = {}
    elif op == "verify":
        problems = muonckpt.verify(src)
        if problems:
            raise SystemExit(f"verify found problems: {problems[:3]}")
        extra = {}
    elif op == "consolidate":
        offline.consolidate(src, out)
        extra = {}
    elif op == "diff":
        extra = {"unequal": sum(not r.equal for r in offline.iter_diff(src, out))}
    elif op == "resume":
        dp, tp = RESUME_AT
        extra = moe_shapes.resumed_bitwise(dp, tp, src, arg["model"], arg["layers"])
    else:  # plan: sampled ranks of a load at dp x tp
        planned = [moe_shapes.plan_rank(src, arg["dp"], arg["tp"], r) for r in arg["ranks"]]
        elapsed = (time.perf_counter() - start) / len(arg["ranks"])
        most = max(planned, key=lambda p: p["bytes"])
        return {
            "op_s": elapsed,
            "read_mb": most["bytes"] / 1e6,
            "indexes": most["indexes"],
            "base_mb": base,
            "peak_mb": _peak_rss_mb(),
        }
    return {
        "op_s": time.perf_counter() - start,
        "base_mb": base,
        "peak_mb": _peak_rss_mb(),
        **extra,
    }


def _rss() -> dict[str, float]:
    return {"base_mb": 0.0, "peak_mb": _peak_rss_mb()}


def bench_moe(model: str, layers: int | None, root: Path, timeout: float) -> list[dict]:
    """The MoE benchmark of one model: build and save, then per layout reshard, verify,
    consolidate back, diff against the source, and plan sampled ranks' loads; rows of
    (what, layout, seconds, peak RSS growth MB, metadata MB, ...)."""
    import moe_shapes

    src = root / f"{model}-src"
    base = {"model": model, "layers": layers, "src": str(src)}

    def run(op: str, **more: object) -> dict:
        result = _child(["_moe", op, json.dumps({**base, **more})], timeout)
        if result is None:
            raise SystemExit(f"{model} {op} {more}: past {timeout} s")
        print(f"{model} {op} {more.get('dp', '')}x{more.get('tp', '')}: {result}", file=sys.stderr)
        return result

    built = run("build")
    rows = [
        {
            "what": "save",
            "layout": "1x1",
            "s": built["save_s"],
            "rss_mb": built["save_growth_mb"],
            **moe_shapes.metadata_bytes(src),
            "params": built["params"],
        }
    ]
    for dp, tp in MOE_LAYOUTS:
        out, back = root / f"{model}-{dp}x{tp}", root / f"{model}-{dp}x{tp}-back"
        layout = f"{dp}x{tp}"
        done = run("reshard", dp=dp, tp=tp, out=str(out))
        rows.append(
            {
                "what": "reshard",
                "layout": layout,
                "s": done["op_s"],
                "rss_mb": done["peak_mb"] - done["base_mb"],
                **moe_shapes.metadata_bytes(out),
            }
        )
        for op, more in (("verify", {}), ("consolidate", {"out": str(back)})):
            done = run(op, **{**more, "src": str(out)})
            rows.append(
                {
                    "what": op,
                    "layout": layout,
                    "s": done["op_s"],
                    "rss_mb": done["peak_mb"] - done["base_mb"],
                }
            )
        done = run("diff", out=str(back))
        if done["unequal"]:
            raise SystemExit(f"{model} {layout}: consolidated back, {done['unequal']} differ")
        rows.append(
            {
                "what": "diff",
                "layout": layout,
                "s": done["op_s"],
                "rss_mb": done["peak_mb"] - done["base_mb"],
            }
        )
        if (dp, tp) == RESUME_FROM:
            done = run("resume", src=str(out))
            if done["differ"]:
                raise SystemExit(
                    f"{model}: resumed at {RESUME_AT} from {layout}, {done['differ']} differ"
                )
            rows.append(
                {
                    "what": f"resume at {RESUME_AT[0]}x{RESUME_AT[1]}, bitwise",
                    "layout": layout,
                    "s": done["load_s"],
                    "rss_mb": done["load_growth_mb"],
                }
            )
        world = dp * tp
        done = run("plan", src=str(out), dp=dp, tp=tp, ranks=[0, world // 2, world - 1])
        rows.append(
            {
                "what": "plan a rank's load",
                "layout": layout,
                "s": done["op_s"],
                "rss_mb": done["peak_mb"] - done["base_mb"],
                "read_mb": done["read_mb"],
                "indexes": done["indexes"],
            }
        )
        shutil.rmtree(back)
        if (dp, tp) != MOE_LAYOUTS[-1]:
            shutil.rmtree(out)
    return rows


def _moe_table(rows: list[dict]) -> str:
    lines = [
        f"{'model':10} {'op':20} {'layout':8} {'s':>8} {'RSS+ MB':>8} {'top MB':>7} "
        f"{'index MB':>9} {'indexes':>7} {'read MB':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['model']:10} {r['what']:20} {r['layout']:8} {r['s']:8.2f} {r['rss_mb']:8.0f} "
            f"{r.get('top_mb', float('nan')):7.2f} {r.get('index_mb', float('nan')):9.2f} "
            f"{r.get('indexes', ''):>7} {r.get('read_mb', float('nan')):8.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_moe":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        print(json.dumps(moe_op(sys.argv[2], json.loads(sys.argv[3]))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_build":
        print(json.dumps(build(int(sys.argv[2]), Path(sys.argv[3]))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_op":
        op, ck, out, n = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])
        profile = Path(sys.argv[6]) if len(sys.argv) > 6 else None
        print(json.dumps(run_op(op, ck, out, n, profile)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, action="append", help="params (repeatable)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per operation")
    parser.add_argument(
        "--workdir", type=make_workdir, default=None, help="where to write (default: system temp)"
    )
    parser.add_argument("--profile", default=None, help="write cProfile stats to this directory")
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument(
        "--moe",
        action="append",
        choices=["k2", "moonlight"],
        help="the MoE benchmark of issue 35 for this model (repeatable)",
    )
    parser.add_argument(
        "--moe-layers", type=int, default=None, help="fewer layers than the model has (a smoke run)"
    )
    args = parser.parse_args()
    if args.moe:
        with tempfile.TemporaryDirectory(prefix="muonckpt-moe-", dir=args.workdir) as tmp:
            rows = []
            for model in args.moe:
                rows += [
                    {"model": model, **r}
                    for r in bench_moe(model, args.moe_layers, Path(tmp), args.timeout)
                ]
        print(_moe_table(rows))
        if args.json:
            Path(args.json).with_suffix(".moe.json").write_text(json.dumps(rows, indent=2) + "\n")
        if not args.params:
            return
    sizes = sorted(args.params or [1000, 10000])
    with tempfile.TemporaryDirectory(prefix="muonckpt-scale-", dir=args.workdir) as tmp:
        profile = Path(args.profile).resolve() if args.profile else None
        results = bench(sizes, Path(tmp), args.timeout, profile)
    print(_table(results, sizes))
    if args.json:
        body = {
            "sizes": sizes,
            "seconds": {op: {str(n): v for n, v in r.items()} for op, r in results.items()},
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
        }
        Path(args.json).write_text(json.dumps(body, indent=2) + "\n")


if __name__ == "__main__":
    main()
