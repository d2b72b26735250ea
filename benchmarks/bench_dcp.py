"""Benchmark DCP conversion (issue 23) against DCP's own load-then-save of the same state.

For each ``--size`` the synthetic model of ``synthetic.py`` (params plus their fp32 Muon /
AdamW state: Muon momentum for the matrices, two AdamW moments for the embedding and norms) is
written, untimed, as a torchtitan-layout DCP checkpoint by one process (model fqns at the top
level, ``optimizer.state.<fqn>.<key>``, ``optimizer.param_groups.<fqn>.<setting>`` of
torch.optim.Muon / AdamW). Then every row runs in a fresh subprocess, so its peak RSS is its
own; rows run interleaved, round by round, ``--repeats`` times. Rows:

``DCP load + save``
    what DCP itself offers for a rewrite in one process: allocate the state dict, ``dcp.load``
    it, ``dcp.save`` it to a new directory (``FileSystemWriter``, one thread), fsync the output.
``muonckpt from_dcp``
    ``muonckpt.interop.from_dcp(src, dst, source="torchtitan", to="packaged")``: the same
    checkpoint into a consolidated muonckpt checkpoint, momentum converted, checksummed, fsynced.
``muonckpt to_dcp``
    ``muonckpt.interop.to_dcp(that, dst, to="torchtitan")``: back to DCP through torch's
    writer.

"op" is the wall time of the operation alone, measured in the child; "growth" its peak RSS
(VmHWM after, reset just before) minus its RSS before, i.e. what the operation held at most.

    python benchmarks/bench_dcp.py --size 256MB --size 1GB --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MiB, fsync_tree, parse_size, reset_peak_rss, status_bytes

ROWS = ("DCP load + save", "muonckpt from_dcp", "muonckpt to_dcp")


def _state(shapes: dict, empty: bool = False) -> dict:
    """The torchtitan-layout state dict of the synthetic model (random values, or empty)."""
    import synthetic
    import torch

    gen = torch.Generator().manual_seed(0)

    def tensor(shape):
        return torch.empty(shape) if empty else torch.randn(shape, generator=gen)

    muon = {k: v for k, v in torch.optim.Muon([torch.zeros(2, 2)]).param_groups[0].items()}
    adamw = {k: v for k, v in torch.optim.AdamW([torch.zeros(2)]).param_groups[0].items()}
    model, optimizer = {}, {}
    for name, (shape, _) in shapes.items():
        model[name] = tensor(shape)
        keys = synthetic.state_keys(name, shape)
        for key in keys:
            optimizer[f"state.{name}.{key}"] = tensor(shape)
        settings = muon if keys == ("momentum_buffer",) else adamw
        if keys != ("momentum_buffer",):
            optimizer[f"state.{name}.step"] = torch.tensor(10.0)
        for k, v in settings.items():
            if k != "params":
                optimizer[f"param_groups.{name}.{k}"] = v
    return {**model, "optimizer": optimizer}


def _row(name: str, src: str, mid: str, dst: str, size: int) -> dict:
    """(child) One row: its op time and RSS growth."""
    import warnings

    warnings.simplefilter("ignore")
    import synthetic
    import torch  # noqa: F401  (imports outside the measured region)
    import torch.distributed.checkpoint as dcp

    from muonckpt import interop

    shapes = synthetic.model_shapes(size)
    before = reset_peak_rss()
    start = time.perf_counter()
    if name == "DCP load + save":
        state = _state(shapes, empty=True)
        dcp.load(state, checkpoint_id=src)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dst, thread_count=1))
        fsync_tree(dst)
    elif name == "muonckpt from_dcp":
        interop.from_dcp(src, dst, source="torchtitan", to="packaged")
    else:
        interop.to_dcp(mid, dst, to="torchtitan")
    seconds = time.perf_counter() - start
    return {"op_s": seconds, "growth_mib": (status_bytes("VmHWM") - before) / MiB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", action="append", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, src, mid, dst, size = args.child
        print(json.dumps(_row(name, src, mid, dst, int(size))))
        return
    import warnings

    warnings.simplefilter("ignore")
    import synthetic
    import torch.distributed.checkpoint as dcp

    from muonckpt import interop

    results = {}
    for text in args.size or ["256MB"]:
        size = parse_size(text)
        shapes = synthetic.model_shapes(size)
        largest = synthetic.largest_tensor_bytes(shapes)
        total = sum(
            math.prod(s) * 4 * (1 + len(synthetic.state_keys(n, s))) for n, (s, _) in shapes.items()
        )
        root = Path(tempfile.mkdtemp(prefix="bench-dcp-", dir=os.environ.get("BENCH_DIR")))
        src, mid = root / "src", root / "mid"
        dcp.save(_state(shapes), checkpoint_id=str(src))
        interop.from_dcp(src, mid, source="torchtitan", to="packaged")
        rows: dict[str, list[dict]] = {name: [] for name in ROWS}
        for _ in range(args.repeats):
            for name in ROWS:
                dst = root / "dst"
                shutil.rmtree(dst, ignore_errors=True)
                child = [sys.executable, __file__, "--child", name, str(src), str(mid), str(dst)]
                done = subprocess.run([*child, str(size)], capture_output=True, text=True)
                assert done.returncode == 0, done.stderr[-3000:]
                rows[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
        shutil.rmtree(root, ignore_errors=True)
        summary = {
            name: {
                "op_s_median": statistics.median(r["op_s"] for r in runs),
                "op_s_all": [round(r["op_s"], 3) for r in runs],
                "growth_mib_max": max(r["growth_mib"] for r in runs),
            }
            for name, runs in rows.items()
        }
        results[text] = {
            "bytes": total,
            "largest_tensor_mib": largest / MiB,
            "rows": summary,
        }
        base = summary["DCP load + save"]["op_s_median"]
        print(
            f"## {text}: {total / MiB:.0f} MiB of params + state, largest tensor "
            f"{largest / MiB:.0f} MiB"
        )
        print("| row | op s (median) | runs | x DCP load+save | peak RSS growth MiB |")
        print("|---|---|---|---|---|")
        for name, row in summary.items():
            print(
                f"| {name} | {row['op_s_median']:.2f} | {row['op_s_all']} | "
                f"{row['op_s_median'] / base:.2f} | {row['growth_mib_max']:.0f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
