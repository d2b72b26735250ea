"""Helpers shared by the benchmark scripts; torch-free, so measured children stay light.

Sizes, /proc memory readings, fsync, and the summary rows and tables every script prints.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

MiB = 2**20


def make_workdir(text: str) -> str:
    """``--workdir DIR`` of every script: DIR made (with its parents) when missing, else a
    one-line refusal (exit 1) naming DIR and why, never a traceback."""
    try:
        Path(text).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"--workdir {text}: {exc.strerror or exc}") from None
    return text


def parse_size(text: str) -> int:
    """``"256MB"``, ``"1GB"``, ``"64KB"`` (binary units) or plain bytes."""
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    for suffix, scale in units.items():
        if text.upper().endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


def status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset this process's peak RSS (VmHWM, via clear_refs) and return the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file and directory under ``root``."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(dirpath)


def summary_row(
    operation: str,
    tool: str,
    seconds: list[float],
    state_bytes: int,
    *,
    baseline_s: float | None = None,
    peak_rss: int | None = None,
    rss_growth: int | None = None,
) -> dict:
    """One row of the summary table: median and min of ``seconds``, GB/s of the median.

    ``baseline_s`` is the baseline's median; the row shows its own median divided by it.
    """
    median = statistics.median(seconds)
    return {
        "operation": operation,
        "tool": tool,
        "runs_s": seconds,
        "median_s": median,
        "min_s": min(seconds),
        "gb_per_s": state_bytes / 1e9 / median,
        "x_baseline": None if baseline_s is None else median / baseline_s,
        "peak_rss": peak_rss,
        "rss_growth": rss_growth,
    }


def print_table(rows: list[dict]) -> None:
    """Markdown table of summary rows, in their order."""

    def mib(value: int | None) -> str:
        return "-" if value is None else f"{value / MiB:.0f}"

    print(
        "| operation | tool | median s | min s | GB/s | peak RSS MiB | RSS growth MiB "
        "| x baseline |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = "-" if r["x_baseline"] is None else f"{r['x_baseline']:.2f}"
        print(
            f"| {r['operation']} | {r['tool']} | {r['median_s']:.2f} | {r['min_s']:.2f} "
            f"| {r['gb_per_s']:.2f} | {mib(r['peak_rss'])} | {mib(r['rss_growth'])} | {ratio} |"
        )


def print_growth(rows_by_size: dict[str, list[dict]]) -> None:
    """Median seconds of every row at every size, one column per size."""
    sizes = list(rows_by_size)
    tools: dict[tuple[str, str], dict[str, float]] = {}
    for size, rows in rows_by_size.items():
        for r in rows:
            tools.setdefault((r["operation"], r["tool"]), {})[size] = r["median_s"]
    print("| operation | tool | " + " | ".join(f"{s} s" for s in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for (operation, tool), by_size in tools.items():
        cells = " | ".join(f"{by_size[s]:.2f}" if s in by_size else "-" for s in sizes)
        print(f"| {operation} | {tool} | {cells} |")


def checkpoint_notes(res: dict) -> str:
    """What ``bench_checkpoint.py``'s table leaves implicit: checksum cost, load memory bound."""
    alone = max(s["checksum_alone_s"] for s in res["saves"])
    return (
        f"Checksums add {res['checksums_add']:.0%} to muonckpt.save (new directory); "
        f"checksumming a rank's state alone takes up to {alone:.2f} s. Overwriting, muonckpt.save "
        f"takes {res['overwrite_ratio']:.2f}x save_file over its previous file. muonckpt.load "
        f"RSS growth within share + largest tensor + 200 MiB on every rank: "
        f"{'yes' if res['load_bound_ok'] else 'NO'}."
    )
