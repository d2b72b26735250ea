"""Tensor side of the layout: cut a region out of a full tensor and put one back.

Plain tensor indexing driven by :mod:`muonckpt.layout.topology`; no collectives and no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..layout.topology import Region, Strided, strided_runs, whole_region


def copy_groups_(
    dst: torch.Tensor, src: torch.Tensor, groups: Iterable[Strided], src_offset: int = 0
) -> None:
    """Copy each group's runs from flat ``src`` (shifted by ``src_offset``) into flat ``dst``.

    One 2-D strided copy per group (the rows of a TP column block), so the per-row work stays
    in C whatever the number of rows.
    """
    if dst.dim() != 1 or src.dim() != 1 or dst.stride(0) != 1 or src.stride(0) != 1:
        raise ValueError("copy_groups_ needs contiguous 1-D tensors")
    for g in groups:
        shape = (g.count, g.length)
        dst.as_strided(shape, (g.dst_step, 1), dst.storage_offset() + g.dst).copy_(
            src.as_strided(shape, (g.src_step, 1), src.storage_offset() + g.src - src_offset)
        )


def extract(full: torch.Tensor, region: Region) -> torch.Tensor:
    """A new contiguous 1-D tensor holding ``region`` of ``full``, in the holder's order."""
    flat = full.reshape(-1)
    piece = torch.empty(region.numel, dtype=full.dtype, device=full.device)
    copy_groups_(piece, flat, strided_runs(whole_region(flat.numel()), region))
    return piece


def insert_(full: torch.Tensor, region: Region, piece: torch.Tensor) -> None:
    """Write a holder's 1-D ``piece`` of ``region`` into contiguous ``full`` in place."""
    flat = full.view(-1)
    copy_groups_(flat, piece.reshape(-1), strided_runs(region, whole_region(flat.numel())))
