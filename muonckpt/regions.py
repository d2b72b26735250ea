"""Tensor side of the layout: cut a region out of a full tensor and put one back.

Plain tensor indexing driven by :mod:`muonckpt.layout`; no collectives and no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from .layout import Region, Run


def copy_runs_(dst: torch.Tensor, src: torch.Tensor, runs: Iterable[Run]) -> None:
    """``dst[run.dst : run.dst+len] = src[run.src : run.src+len]`` for flat 1-D tensors.

    Runs of one length at constant source and destination strides (the rows of a TP column
    block) are copied as one strided 2-D copy instead of one copy per row.
    """
    if dst.dim() != 1 or src.dim() != 1 or dst.stride(0) != 1 or src.stride(0) != 1:
        raise ValueError("copy_runs_ needs contiguous 1-D tensors")
    for first, count, src_step, dst_step in _strided_groups(list(runs)):
        shape = (count, first.length)
        dst.as_strided(shape, (dst_step, 1), dst.storage_offset() + first.dst).copy_(
            src.as_strided(shape, (src_step, 1), src.storage_offset() + first.src)
        )


def _strided_groups(runs: list[Run]) -> Iterator[tuple[Run, int, int, int]]:
    """Maximal stretches of runs with equal length and constant src/dst steps."""
    start = 0
    while start < len(runs):
        first, end = runs[start], start + 1
        src_step = dst_step = 0
        if end < len(runs) and runs[end].length == first.length:
            src_step, dst_step = runs[end].src - first.src, runs[end].dst - first.dst
            while (
                end < len(runs)
                and runs[end].length == first.length
                and runs[end].src - runs[end - 1].src == src_step
                and runs[end].dst - runs[end - 1].dst == dst_step
            ):
                end += 1
        yield first, end - start, src_step, dst_step
        start = end


def extract(full: torch.Tensor, region: Region) -> torch.Tensor:
    """A new contiguous 1-D tensor holding ``region`` of ``full``, in the holder's order."""
    flat = full.reshape(-1)
    piece = torch.empty(region.numel, dtype=full.dtype, device=full.device)
    copy_runs_(piece, flat, _identity_runs(region, piece=True))
    return piece


def insert_(full: torch.Tensor, region: Region, piece: torch.Tensor) -> None:
    """Write a holder's 1-D ``piece`` of ``region`` into contiguous ``full`` in place."""
    copy_runs_(full.view(-1), piece.reshape(-1), _identity_runs(region, piece=False))


def _identity_runs(region: Region, *, piece: bool) -> list[Run]:
    """Runs between full-flat coordinates and the holder's order (``piece``: full -> holder)."""
    runs, offset = [], 0
    for lo, hi in region.intervals():
        src, dst = (lo, offset) if piece else (offset, lo)
        runs.append(Run(src=src, dst=dst, length=hi - lo))
        offset += hi - lo
    return runs
