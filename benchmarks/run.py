"""Run every muonckpt benchmark at the given sizes and print one table per size.

    python benchmarks/run.py --size 256MB --size 1GB --size 4GB --json results.json

Per size, ``bench_checkpoint.py`` (per-rank save by muonckpt, safetensors, torch.save and
DCP; load with reshard by muonckpt and the naive way) and then ``bench_offline.py``
(consolidate and reshard by muonckpt, DCP's consolidation, the naive script, ``cp -r``) run as
separate processes, so each keeps its own memory figures; their own tables and progress go to
stderr. Their rows go to stdout as one table, grouped by operation, with each row's ratio to
its baseline (save: ``save_file``; consolidate, reshard: ``cp -r``); with several sizes, a
table of median seconds per size follows. The scripts' docstrings say what each row measures.
Default sizes: 256MB and 1GB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import MiB, checkpoint_notes, make_workdir, print_growth, print_table

HERE = Path(__file__).resolve().parent


def _run(script: str, args: list[str], out: Path) -> dict:
    """Run a benchmark script, its own output going to stderr; return its JSON."""
    cmd = [sys.executable, str(HERE / script), *args, "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", action="append", help="state size, repeatable")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--to-dp", type=int, default=4, help="reshard / load target dp")
    parser.add_argument("--to-tp", type=int, default=1, help="reshard / load target tp")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per row")
    parser.add_argument(
        "--workdir", type=make_workdir, default=None, help="where to write (default: system temp)"
    )
    parser.add_argument("--json", default=None, help="write every number here")
    args = parser.parse_args()
    shared = ["--dp", str(args.dp), "--tp", str(args.tp), "--repeats", str(args.repeats)]
    shared += ["--to-dp", str(args.to_dp), "--to-tp", str(args.to_tp)]
    if args.workdir:
        shared += ["--workdir", args.workdir]
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="muonckpt-bench-json-") as tmp:
        for size in args.size or ["256MB", "1GB"]:
            ckpt = _run("bench_checkpoint.py", ["--size", size, *shared], Path(tmp) / "c.json")
            offline = _run("bench_offline.py", ["--size", size, *shared], Path(tmp) / "o.json")
            offline = offline["sizes"][0]
            rows = ckpt["rows"] + offline["summary"]
            results[size] = {"rows": rows, "checkpoint": ckpt, "offline": offline}
            print(
                f"\n## {size}: {ckpt['state_bytes'] / MiB:.0f} MiB fp32 state at "
                f"{ckpt['from']}, resharded and loaded into {ckpt['to']}\n"
            )
            print_table(rows)
            print("\n" + checkpoint_notes(ckpt), flush=True)
            if args.json:  # after every size, so a long run keeps what it has measured
                Path(args.json).write_text(json.dumps(results, indent=1))
    if len(results) > 1:
        print("\n## Median seconds by size\n")
        print_growth({size: r["rows"] for size, r in results.items()})


if __name__ == "__main__":
    main()
