"""Run every benchmark script once at a tiny size, so that none can break unnoticed (issue 36).

    python benchmarks/smoke.py                    # every script but the trainers' ones
    python benchmarks/smoke.py bench_deepspeed.py # named ones only

A smoke run checks that a script completes and prints its table; it measures nothing and
asserts no time. ``.ci/run`` runs the default set after the test suite; the trainers tier
(``python -m pytest -m trainers``) runs the scripts that need a trainer's own venv.
``tests/test_benchmarks.py`` checks that every script in ``benchmarks/`` is listed here.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

SMOKE: dict[str, list[str]] = {
    "run.py": ["--size", "2MB", "--repeats", "1"],  # bench_checkpoint.py and bench_offline.py
    "bench_async.py": ["--size", "2MB", "--repeats", "1"],
    "bench_check.py": ["--size", "2MB", "--repeats", "1"],
    "bench_dcp.py": ["--size", "2MB", "--repeats", "1"],
    "bench_ns.py": ["--grid", "2x1", "--hidden", "16", "--layers", "1", "--steps", "1"],
    "bench_scale.py": ["--params", "20", "--moe", "moonlight", "--moe-layers", "2"],
    "profile_io.py": ["offline", "async", "--size", "2MB", "--rounds", "1"],
    "bench_s3.py": ["--size", "2MB", "--repeats", "1"],  # boto3 and moto: the test extra
    "bench_tiers.py": ["--size", "2MB", "--nodes", "2", "--rounds", "1"],
}
"""Script -> the arguments of its smoke run."""
NEEDS_A_TRAINER: dict[str, list[str]] = {
    "bench_deepspeed.py": ["--size", "16MB", "--repeats", "1"],  # DeepSpeed's venv
    "bench_megatron.py": ["--size", "16MB", "--repeats", "1"],  # Megatron-Core's venv
}
"""Scripts that need a trainer installed apart (``$MUONCKPT_DS_VENV``,
``$MUONCKPT_MEGATRON_VENV``): run by name only."""
RUN_BY_OTHERS = {"bench_checkpoint.py", "bench_offline.py"}
"""Scripts a smoke run above runs (``run.py`` runs both)."""
HELPERS = {"common.py", "synthetic.py", "smoke.py", "moe_shapes.py"}
"""Modules that are no benchmark of their own."""
TIMEOUT_S = 600


def smoke(name: str, args: list[str]) -> float:
    """Run ``name`` with ``args``, its output passed through; its wall time. Exits on failure."""
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, str(HERE / name), *args], timeout=TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        sys.exit(f"smoke: {name} {' '.join(args)} did not finish within {TIMEOUT_S} s")
    if done.returncode != 0:
        sys.exit(f"smoke: {name} {' '.join(args)} exited with {done.returncode}")
    return time.perf_counter() - start


def main() -> None:
    every = {**SMOKE, **NEEDS_A_TRAINER}
    names = sys.argv[1:] or list(SMOKE)
    unknown = [n for n in names if n not in every]
    if unknown:
        sys.exit(f"smoke: no smoke run for {unknown}; known: {sorted(every)}")
    times = {name: smoke(name, every[name]) for name in names}
    for name, seconds in times.items():
        print(f"smoke: {name} {' '.join(every[name])}: ok in {seconds:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
