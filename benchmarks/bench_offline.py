"""Benchmark the offline tools (consolidate, reshard) against cp -r, PyTorch DCP and a naive script.

For each ``--size`` the synthetic Muon state of ``synthetic.py`` is built at dp x tp (default
2 x 2) in gloo processes and written, untimed (``bench_checkpoint.py`` times saving), three
ways: a per-rank muonckpt checkpoint (``muonckpt.save``), per-rank ``torch.save`` files of the
same local tensors (the naive way), and a PyTorch DCP checkpoint in Hugging Face safetensors
format. Then every row below runs in a fresh subprocess, so its peak RSS is its own
(``os.wait4`` rusage of that child: the whole process, interpreter and imports included;
spawned from a small launcher process, since Linux carries the spawning process's peak RSS
into a child's). "RSS growth" is the child's VmHWM after the
operation minus its RSS just before it (``clear_refs`` resets VmHWM there). Rows run
interleaved, round by round, so that the machine's drift weighs on all alike. "op" wall time is
measured inside the child around the operation alone (interpreter start and imports excluded);
"whole" is the wall time of the whole command, measured by the launcher. Rows:

``cp -r + fsync``
    ``cp -r`` of the muonckpt checkpoint directory, then ``fsync`` of every copied file and the
    directory (muonckpt fsyncs what it writes, so this is the disk's own limit, same durability).
``muonckpt.offline.consolidate`` / ``muonckpt consolidate (CLI)``
    library call (op time) and ``muonckpt --quiet consolidate SRC -o DST`` (whole-command time:
    interpreter, imports and all). ``--quiet`` is a global option, so it goes before the command.
``DCP consolidate_safetensors_files``
    ``torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files``
    (torch 2.13: ``(input_dir, output_dir, fqn_to_index_mapping, num_threads=1)``, all tensors
    mapped to output file 1, i.e. one ``model-00001-of-00001.safetensors``) followed by an
    ``fsync`` of its outputs, which DCP does not do itself (the JSON also has the time without
    it). Its input is written by ``dcp.save(state_dict, storage_writer=
    HuggingFaceStorageWriter(path, save_distributed=True))`` from the same dp x tp gloo ranks,
    each holding ``synthetic.dtensor_state``'s DTensors: one ``shard-0000r-...safetensors`` per
    rank with DCP's saved-offsets metadata. Caveat: DCP cannot express ZeRO-1's flat bucket
    slices, so its input is FSDP-style row/column blocks of the same tensors (same keys,
    shapes, dtype and total bytes; random values, not the muonckpt state's).
    ``_consolidate_hf_safetensors`` is a private module: its API may change between versions.
``naive torch.load + insert_ + save_file``
    one process ``torch.load(weights_only=True)``s every rank's ``torch.save`` file (the rank's
    local flat tensors plus their ``muonckpt.layout.topology.Region``s), reassembles full tensors
    with ``muonckpt.state.regions.insert_``, ``safetensors.torch.save_file``s them and fsyncs the
    file. As muonckpt does, TP-replicated params (the norms) are saved by TP rank 0 only.
``muonckpt.offline.reshard`` / ``muonckpt reshard (CLI)``
    as for consolidate, with ``reshard(src, dst, dp=--to-dp, tp=--to-tp)`` (default 4 x 2).

Caveats: by default every input was just written, so reads are served from the page cache for
every row alike; ``--drop-caches`` (root only) drops it before each row. ``--verify`` checks the
outputs (muonckpt's and the naive consolidation bitwise equal, the reshard equal to its source,
DCP's keys and shapes) outside the timings.

Bounds printed per size, PASS/FAIL from the measurements (each row's fastest run; the JSON
has every run): consolidate and reshard op time <= 1.2x cp -r op time (issue 36); whole
command <= 2x cp -r's (the target is stated at 4 GB: at small sizes interpreter start and
imports dominate); muonckpt consolidate >= 2.5x faster than DCP
consolidation; peak RSS < 2x the largest state tensor + 200 MiB, both as growth during the
operation and as the whole process (interpreter and imports included; the muonckpt rows do not
import torch, DCP's and the naive one do, ~220 MiB).

    python benchmarks/bench_offline.py --size 1GB --size 4GB --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    MiB,
    fsync_path,
    fsync_tree,
    make_workdir,
    parse_size,
    reset_peak_rss,
    status_bytes,
    summary_row,
)

# Heavy imports (torch, muonckpt, synthetic) are made inside functions: the measured
# children import only what their operation needs, e.g. nothing of torch for cp -r.
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS = (
    ("cp", "cp -r + fsync"),
    ("consolidate", "muonckpt.offline.consolidate"),
    ("cli-consolidate", "muonckpt consolidate (CLI)"),
    ("dcp", "DCP consolidate_safetensors_files"),
    ("naive", "naive torch.load + insert_ + save_file"),
    ("reshard", "muonckpt.offline.reshard"),
    ("cli-reshard", "muonckpt reshard (CLI)"),
)


# ---------------------------------------------------------------- building the inputs (gloo)


def build_worker(shapes, dp: int, tp: int, root: str) -> None:
    """One rank: a muonckpt per-rank checkpoint and a naive torch.save file of the same state."""
    import torch
    import torch.distributed as dist
    from synthetic import build_optimizer, fill_state, naive_payload

    import muonckpt

    opt = build_optimizer(shapes, dp, tp)
    local = fill_state(opt)
    muonckpt.save(opt, Path(root) / "muonckpt", params=False)
    path = Path(root) / "naive" / f"rank-{dist.get_rank():05d}.pt"
    path.parent.mkdir(exist_ok=True)
    torch.save(naive_payload(opt, local, shapes, tp), path)
    fsync_path(path)


def dcp_worker(shapes, dp: int, tp: int, root: str) -> None:
    """One rank: its DTensor blocks of every state tensor, saved by DCP as HF safetensors."""
    import torch.distributed.checkpoint as dcp
    from synthetic import dtensor_state
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dcp.save(
        dtensor_state(shapes, dp, tp),
        storage_writer=HuggingFaceStorageWriter(str(Path(root) / "dcp"), save_distributed=True),
    )


# ---------------------------------------------------------------- the measured children


def child(op: str, src: str, dst: str, extra: list[str]) -> None:
    """Run one operation in this (fresh) process; print its timings as one JSON line."""
    src_p, dst_p = Path(src), Path(dst)
    result: dict[str, float] = {}
    if op == "cp":
        before = reset_peak_rss()
        start = time.perf_counter()
        subprocess.run(["cp", "-r", src, dst], check=True)
        fsync_tree(dst_p)
    elif op == "consolidate":
        from muonckpt import offline

        before = reset_peak_rss()
        start = time.perf_counter()
        offline.consolidate(src_p, dst_p)
    elif op == "reshard":
        from muonckpt import offline

        before = reset_peak_rss()
        start = time.perf_counter()
        offline.reshard(src_p, dst_p, dp=int(extra[0]), tp=int(extra[1]))
    elif op == "dcp":
        from safetensors import safe_open
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files,
        )

        keys: set[str] = set()
        for file in src_p.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                keys.update(f.keys())
        dst_p.mkdir(parents=True)
        before = reset_peak_rss()
        start = time.perf_counter()
        consolidate_safetensors_files(
            input_dir=str(src_p),
            output_dir=str(dst_p),
            fqn_to_index_mapping=dict.fromkeys(sorted(keys), 1),
        )
        result["op_s_without_fsync"] = time.perf_counter() - start
        fsync_tree(dst_p)
    elif op == "naive":
        import safetensors.torch
        import torch

        from muonckpt.layout.topology import Region
        from muonckpt.state.regions import insert_

        before = reset_peak_rss()
        start = time.perf_counter()
        parts = [torch.load(f, weights_only=True) for f in sorted(src_p.glob("rank-*.pt"))]
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            for tkey, piece in part["state"].items():
                if tkey not in full:
                    full[tkey] = torch.empty(part["shapes"][tkey], dtype=piece.dtype)
                insert_(full[tkey], Region(*part["regions"][tkey]), piece)
        del parts
        dst_p.mkdir(parents=True)
        safetensors.torch.save_file(full, str(dst_p / "optimizer.safetensors"))
        fsync_tree(dst_p)
    else:
        raise SystemExit(f"unknown child op {op!r}")
    result["op_s"] = time.perf_counter() - start
    peak = status_bytes("VmHWM")
    result.update(rss_before=before, op_peak_rss=peak, op_rss_growth=peak - before)
    print(json.dumps(result))


# ---------------------------------------------------------------- the parent


# Linux carries a process's peak RSS across fork and exec into its child's rusage, so a command
# spawned by this (torch-importing) parent would report at least the parent's RSS. Commands are
# therefore spawned by a small launcher started before anything heavy is imported.
_LAUNCHER = """
import json, os, subprocess, sys, tempfile, time
for line in sys.stdin:
    cmd = json.loads(line)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        reply = dict(wall=wall, maxrss_kib=usage.ru_maxrss, rc=proc.returncode,
                     stdout=out.read(), stderr=err.read()[-4000:])
    sys.stdout.write(json.dumps(reply) + "\\n")
    sys.stdout.flush()
"""


class _Launcher:
    """Runs commands from a ~15 MiB process: their wall time and their own peak RSS (wait4)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, cmd: list[str]) -> dict:
        """Run ``cmd``; whole-command wall time, peak RSS and its stdout's last JSON line."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if reply["rc"]:
            raise RuntimeError(f"{cmd} failed ({reply['rc']}):\n{reply['stderr']}")
        lines = [line for line in reply["stdout"].splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {}
        result.update(whole_s=reply["wall"], peak_rss=reply["maxrss_kib"] * 1024)  # Linux: KiB
        return result

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _cli() -> list[str]:
    exe = shutil.which("muonckpt")
    return [exe] if exe else [sys.executable, "-m", "muonckpt.cli"]


def _drop_caches() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError as exc:
        raise SystemExit(f"--drop-caches needs root: {exc}") from exc


def _verify(op: str, src: Path, dst: Path, size_dir: Path, shapes, launcher) -> None:
    """Correctness of an output, outside every timing; raises on a mismatch."""
    import torch
    from safetensors import safe_open

    from muonckpt import offline

    if op in ("consolidate", "cli-consolidate"):
        naive = size_dir / "naive-reference"
        if not naive.exists():
            launcher.run(
                [sys.executable, __file__, "_child", "naive", str(size_dir / "naive"), str(naive)]
            )
        with (
            safe_open(str(dst / "optimizer.safetensors"), "pt") as a,
            safe_open(str(naive / "optimizer.safetensors"), "pt") as b,
        ):
            assert set(a.keys()) == set(b.keys()), "consolidate and naive keys differ"
            for key in a.keys():  # noqa: SIM118 (safe_open is no mapping)
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    elif op in ("reshard", "cli-reshard"):
        bad = [r for r in offline.diff(src, dst) if not r.bitwise]
        assert not bad, f"reshard differs from its source: {bad[:3]}"
    elif op == "dcp":
        from synthetic import state_keys

        want = {
            f"state.{name}.{key}": list(shape)
            for name, (shape, _) in shapes.items()
            for key in state_keys(name, shape)
        }
        got = {}
        for file in dst.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                got.update({k: list(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118
        assert got == want, "DCP consolidated keys or shapes differ"


def bench_size(size_arg: str, args, root: Path, launcher: _Launcher) -> dict:
    from synthetic import largest_tensor_bytes, model_shapes, state_bytes

    from muonckpt.distributed import run_distributed

    shapes = model_shapes(parse_size(size_arg))
    total, largest = state_bytes(shapes), largest_tensor_bytes(shapes)
    size_dir = root / size_arg
    shutil.rmtree(size_dir, ignore_errors=True)
    size_dir.mkdir(parents=True)
    world = args.dp * args.tp
    print(f"[{size_arg}] building {total / MiB:.0f} MiB at {args.dp}x{args.tp} ...")
    run_distributed(build_worker, world, shapes, args.dp, args.tp, str(size_dir), timeout=7200)
    run_distributed(dcp_worker, world, shapes, args.dp, args.tp, str(size_dir), timeout=7200)
    ckpt = str(size_dir / "muonckpt")
    to = [str(args.to_dp), str(args.to_tp)]
    me = [sys.executable, str(Path(__file__).resolve()), "_child"]
    commands = {
        "cp": lambda d: [*me, "cp", ckpt, d],
        "consolidate": lambda d: [*me, "consolidate", ckpt, d],
        "cli-consolidate": lambda d: [*_cli(), "--quiet", "consolidate", ckpt, "-o", d],
        "reshard": lambda d: [*me, "reshard", ckpt, d, *to],
        "cli-reshard": lambda d: [
            *_cli(),
            "--quiet",
            "reshard",
            ckpt,
            "--dp",
            to[0],
            "--tp",
            to[1],
            "-o",
            d,
        ],
        "dcp": lambda d: [*me, "dcp", str(size_dir / "dcp"), d],
        "naive": lambda d: [*me, "naive", str(size_dir / "naive"), d],
    }
    # Rounds interleave the rows (cp, consolidate, ..., then again), so that a drift of the
    # machine's speed over minutes (large on the benchmark VM) weighs on every row alike.
    runs: dict[str, list[dict]] = {op: [] for op, _ in ROWS}
    for _ in range(args.repeats):
        for op, _label in ROWS:
            dst = size_dir / f"out-{op}"
            shutil.rmtree(dst, ignore_errors=True)
            # Deleting GBs on a filesystem mounted with `discard` queues work that the next
            # fsync waits for: settle it here, untimed, so no row pays for another's output.
            os.sync()
            if args.drop_caches:
                _drop_caches()
            run = launcher.run(commands[op](str(dst)))
            if args.verify:
                _verify(op, Path(ckpt), dst, size_dir, shapes, launcher)
            shutil.rmtree(dst, ignore_errors=True)
            runs[op].append(run)
    rows = {}
    for op, label in ROWS:
        best = min(runs[op], key=lambda r: r.get("op_s", r["whole_s"]))
        best = {
            **best,
            "peak_rss": max(r["peak_rss"] for r in runs[op]),
            "runs": runs[op],
            "label": label,
        }
        rows[op] = best
        shown = f"op {best['op_s']:.2f} s, " if "op_s" in best else ""
        print(f"[{size_arg}] {label}: {shown}whole {best['whole_s']:.2f} s")
    shutil.rmtree(size_dir, ignore_errors=True)
    reshard = f"reshard {args.dp}x{args.tp} -> {args.to_dp}x{args.to_tp}"
    return {
        "size": size_arg,
        "state_bytes": total,
        "largest_tensor_bytes": largest,
        "from": f"{args.dp}x{args.tp}",
        "reshard_to": f"{args.to_dp}x{args.to_tp}",
        "rows": rows,
        "summary": summary_rows(rows, total, reshard),
        "bounds": _bounds(rows, total, largest),
    }


def summary_rows(rows: dict, total: int, reshard: str) -> list[dict]:
    """The rows for ``run.py``'s table: op time (CLI: whole command), ratio to cp -r's."""
    groups = {
        "cp": "copy",
        **dict.fromkeys(("consolidate", "cli-consolidate", "dcp", "naive"), "consolidate"),
        **dict.fromkeys(("reshard", "cli-reshard"), reshard),
    }
    out = []
    for op, label in ROWS:
        r = rows[op]
        basis = "op_s" if "op_s" in r else "whole_s"
        cp = statistics.median(run[basis] for run in rows["cp"]["runs"])
        out.append(
            summary_row(
                groups[op],
                label if basis == "op_s" else f"{label}, whole command",
                [run[basis] for run in r["runs"]],
                total,
                baseline_s=cp,
                peak_rss=r["peak_rss"],
                rss_growth=r.get("op_rss_growth"),
            )
        )
    return out


def _bounds(rows: dict, state_bytes: int, largest: int) -> list[dict]:
    cp_op, cp_whole = rows["cp"]["op_s"], rows["cp"]["whole_s"]
    rss_limit = 2 * largest + 200 * MiB
    at_4gb = "" if state_bytes >= 4 * 10**9 * 0.99 else " (target stated at 4 GB)"
    out = []

    def bound(text: str, value: float, limit: float, unit: str, ok: bool) -> None:
        out.append({"bound": text, "value": value, "limit": limit, "unit": unit, "pass": ok})

    for op in ("consolidate", "reshard"):
        op_s = rows[op]["op_s"]
        bound(f"{op} op time <= 1.2x cp -r op time", op_s, 1.2 * cp_op, "s", op_s <= 1.2 * cp_op)
    for op in ("cli-consolidate", "cli-reshard"):
        whole = rows[op]["whole_s"]
        ok = whole <= 2 * cp_whole
        bound(f"{op} whole command <= 2x cp -r whole{at_4gb}", whole, 2 * cp_whole, "s", ok)
    dcp, ours = rows["dcp"]["op_s"], rows["consolidate"]["op_s"]
    bound(
        "consolidate >= 2.5x faster than DCP consolidation (+fsync)",
        dcp / ours,
        2.5,
        "x",
        dcp >= 2.5 * ours,
    )
    dcp_raw = rows["dcp"]["op_s_without_fsync"]
    bound(
        "consolidate >= 2.5x faster than DCP consolidation (DCP without fsync)",
        dcp_raw / ours,
        2.5,
        "x",
        dcp_raw >= 2.5 * ours,
    )
    for op in ("consolidate", "reshard"):
        growth = rows[op]["op_rss_growth"]
        ok = growth < rss_limit
        bound(f"{op} RSS growth during op < 2x largest + 200 MiB", growth, rss_limit, "B", ok)
    for op in ("consolidate", "cli-consolidate", "reshard", "cli-reshard"):
        peak = rows[op]["peak_rss"]
        ok = peak < rss_limit
        bound(f"{op} whole-process peak RSS < 2x largest + 200 MiB", peak, rss_limit, "B", ok)
    return out


def _print_size(res: dict) -> None:
    rows = res["rows"]
    cp_op, cp_whole = rows["cp"]["op_s"], rows["cp"]["whole_s"]
    print(
        f"\n### {res['size']}: {res['state_bytes'] / MiB:.0f} MiB fp32 state, per-rank at "
        f"{res['from']}, reshard to {res['reshard_to']}; largest tensor "
        f"{res['largest_tensor_bytes'] / MiB:.1f} MiB\n"
    )
    print(
        "| operation | wall s (op) | wall s (whole command) | GB/s | peak RSS MiB "
        "| RSS growth in op MiB | ratio to cp -r (op / whole) |"
    )
    print("|---|---|---|---|---|---|---|")
    for op, label in ROWS:
        r = rows[op]
        op_s = r.get("op_s")
        rate = res["state_bytes"] / 1e9 / (op_s or r["whole_s"])
        growth = f"{r['op_rss_growth'] / MiB:.0f}" if "op_rss_growth" in r else "-"
        ratio_op = f"{op_s / cp_op:.2f}" if op_s is not None else "-"
        print(
            f"| {label} | {f'{op_s:.2f}' if op_s is not None else '-'} | {r['whole_s']:.2f} "
            f"| {rate:.2f} | {r['peak_rss'] / MiB:.0f} | {growth} "
            f"| {ratio_op} / {r['whole_s'] / cp_whole:.2f} |"
        )
    if "op_s_without_fsync" in rows["dcp"]:
        print(f"\nDCP consolidation without its fsync: {rows['dcp']['op_s_without_fsync']:.2f} s")
    print()
    for b in res["bounds"]:
        if b["unit"] == "B":
            value, limit = f"{b['value'] / MiB:.0f} MiB", f"{b['limit'] / MiB:.0f} MiB"
        elif b["unit"] == "x":
            value, limit = f"{b['value']:.2f}x", f"{b['limit']:.2f}x"
        else:
            value, limit = f"{b['value']:.2f} s", f"{b['limit']:.2f} s"
        print(f"- {b['bound']}: {value} vs {limit} -> {'PASS' if b['pass'] else 'FAIL'}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", action="append", help="total optimizer state (repeatable), e.g. 1GB, 64MB"
    )
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--to-dp", type=int, default=4, help="reshard target dp")
    parser.add_argument("--to-tp", type=int, default=2, help="reshard target tp")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per row (table: fastest; summary: median)"
    )
    parser.add_argument(
        "--workdir", type=make_workdir, default=None, help="default: a temp dir, removed at the end"
    )
    parser.add_argument("--drop-caches", action="store_true", help="drop page cache per row")
    parser.add_argument("--verify", action="store_true", help="check outputs (not timed)")
    parser.add_argument("--json", default=None, help="write all numbers here")
    args = parser.parse_args()
    sizes = args.size or ["1GB"]
    root = Path(args.workdir or tempfile.mkdtemp(prefix="muonckpt-bench-offline-"))
    root.mkdir(parents=True, exist_ok=True)
    results = []
    launcher = _Launcher()
    try:
        for size in sizes:
            results.append(bench_size(size, args, root, launcher))
            _print_size(results[-1])
            if args.json:  # after every size, so a long run keeps what it has measured
                Path(args.json).write_text(json.dumps({"sizes": results}, indent=1))
    finally:
        launcher.close()
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
