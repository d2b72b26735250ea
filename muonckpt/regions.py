"""Tensor side of the layout: cut a region out of a full tensor and put one back.

Plain tensor indexing driven by :mod:`muonckpt.layout`; no collectives and no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .layout import Region, Run


def copy_runs_(dst: torch.Tensor, src: torch.Tensor, runs: Iterable[Run]) -> None:
    """``dst[run.dst : run.dst+len] = src[run.src : run.src+len]`` for flat 1-D tensors."""
    for run in runs:
        dst[run.dst : run.dst + run.length].copy_(src[run.src : run.src + run.length])


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
