"""Linux /proc memory readings for the benchmarks (no torch import, so children stay light)."""

from __future__ import annotations


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
