"""Run every muonckpt benchmark at the given sizes and print one summary.

    python benchmarks/run.py --size 256MB --size 1GB --size 4GB --json results.json

Runs ``bench_checkpoint.py`` (per-rank save vs ``safetensors.torch.save_file``; load with
reshard and its peak RSS) and ``bench_offline.py`` (consolidate, reshard, PyTorch DCP's
``consolidate_safetensors_files``, the naive torch.save/torch.load way, and ``cp -r``) as
separate processes, so each keeps its own memory figures, then merges their JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(script: str, args: list[str], out: Path) -> dict:
    subprocess.run([sys.executable, str(HERE / script), *args, "--json", str(out)], check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", action="append", help="state size, repeatable (default 1GB)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the merged results here")
    args = parser.parse_args()
    sizes = args.size or ["1GB"]
    results: dict = {"checkpoint": {}, "offline": None}
    with tempfile.TemporaryDirectory(prefix="muonckpt-bench-") as tmp:
        for size in sizes:
            results["checkpoint"][size] = _run(
                "bench_checkpoint.py",
                ["--size", size, "--repeats", str(args.repeats)],
                Path(tmp) / f"checkpoint-{size}.json",
            )
        offline_args = [a for size in sizes for a in ("--size", size)]
        results["offline"] = _run(
            "bench_offline.py",
            [*offline_args, "--repeats", str(args.repeats)],
            Path(tmp) / "offline.json",
        )
    print("\n## Per-rank save and load with reshard")
    print("| size | save ratio (job) | worst rank ratio | load RSS growth within bound |")
    print("|---|---|---|---|")
    for size, r in results["checkpoint"].items():
        print(
            f"| {size} | {r['save_ratio_job']:.2f} | {r['save_ratio_worst_rank']:.2f} | "
            f"{'yes' if r['load_bound_ok'] else 'NO'} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
