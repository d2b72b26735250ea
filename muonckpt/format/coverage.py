"""Coverage: the pieces of one stored tensor hold each of its elements exactly once.

The one check of a tensor's pieces that both ``verify`` (every param) and a load (the params
of its share, before any byte is applied) make, through
:meth:`muonckpt.format.manifest.Manifest.coverage_problems`. Pure.

Each piece is a stored tensor of its own (:func:`shared_tensors`): two naming one ``(file,
tensor)`` would read one tensor's bytes as both, whatever the checksums say.

Pieces that are column blocks of the tensor's matrix view, side by side (every TP layout a
save or a rewrite writes), are checked block by block, one run per piece: a block of a large
matrix is not walked row by row. Any other pieces are checked by their full-tensor flat runs
(:meth:`~muonckpt.layout.topology.Region.intervals`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

from ..layout.topology import Range, matrix_view
from .records import ParamEntry, Piece, placed


def tensor_coverage(entry: ParamEntry, key: str, pieces: Sequence[Piece]) -> list[str]:
    """The first gap or overlap of ``entry``'s stored tensor ``key`` among ``pieces`` (every
    piece of it), in full-tensor flat elements; none where each element is stored once."""
    shape, split = entry.view_of(key)
    numel, cols = math.prod(shape), matrix_view(shape, split)[1]
    blocks = _column_blocks(pieces, cols) if numel else None
    if blocks is None:
        runs = sorted(run for piece in pieces for run in piece.region.intervals())
        fault = _first_fault(runs, numel)
    else:
        fault = _first_fault(sorted((start, start + width) for start, width in blocks), cols)
        rows = numel // cols
        for (start, width), runs in sorted(blocks.items()):
            if fault is not None:
                break
            fault = _first_fault(sorted(runs), rows * width)
            if fault is not None:  # block-local elements as full-tensor ones, in one row
                lo, hi, what = fault
                row, column = divmod(lo, width)
                flat = row * cols + start + column
                fault = flat, flat + min(hi - lo, width - column), what
    if fault is None:
        return []
    lo, hi, what = fault
    return [f"param {entry.name!r} state {key!r}: elements [{lo}, {hi}) {what}"]


def _column_blocks(pieces: Iterable[Piece], cols: int) -> dict[tuple[int, int], list[Range]] | None:
    """The pieces' runs of block-local elements by column block (first column, width), where
    every piece holding elements is a block of the ``cols`` columns (a whole-width piece: of
    the block of them all) and distinct blocks share no column; else None."""
    blocks: dict[tuple[int, int], list[Range]] = {}
    for piece in pieces:
        region = piece.region
        if region.numel <= 0:
            continue
        if region.block_width == region.cols:  # flat elements: those of the whole-width block
            block = (0, cols)
        elif region.cols == cols:
            block = (region.block_start, region.block_width)
        else:
            return None
        blocks.setdefault(block, []).append((region.start, region.stop))
    edges = sorted(blocks)
    for (start, width), (after, _) in itertools.pairwise(edges):
        if start + width > after:
            return None
    return blocks


def _first_fault(runs: Iterable[Range], end: int) -> tuple[int, int, str] | None:
    """The first elements of ``[0, end)`` that sorted ``runs`` hold twice or not at all."""
    cursor = 0
    for lo, hi in runs:
        if lo < cursor:
            return lo, min(hi, cursor), "stored twice (overlap)"
        if lo > cursor:
            return cursor, lo, "stored nowhere (gap)"
        cursor = hi
    if cursor != end:
        return cursor, end, "stored nowhere (gap)"
    return None


def shared_tensors(*groups: Sequence[Piece]) -> list[str]:
    """The first stored tensor (data file, tensor key) that two pieces of ``groups`` name;
    none where each names its own. A row pointed at another stored tensor of its shape and
    dtype, its checksums copied, passes every other check and reads that tensor's values.
    Hashes first (a set of ints, not of a million names), then the names of hashes seen
    twice."""
    seen: set[int] = set()
    twice: set[int] = set()
    for at in map(hash, itertools.chain.from_iterable(map(placed, groups))):
        (twice if at in seen else seen).add(at)
    named: dict[tuple[str, str], Piece] = {}
    for piece in itertools.chain(*groups) if twice else ():
        at2 = (piece.file, piece.tensor)
        if hash(at2) not in twice:
            continue
        other = named.setdefault(at2, piece)
        if other is not piece:
            return [
                f"file {piece.file!r} tensor {piece.tensor!r} is read by two pieces, of param "
                f"{other.param!r} state {other.key!r} and of param {piece.param!r} state "
                f"{piece.key!r} (each piece is a tensor of its own)"
            ]
    return []
