"""How a state tensor follows its param: the shape rule of each state key, and which
elements of the state a holder of some elements of the param keeps. Pure.

A state tensor shaped like its param (momentum, AdamW's moments) needs no rule: it is split
with the param. Other state follows the param by one of :data:`RULES`, recorded per key in the
manifest (version 5; absent: shaped like the param):

- ``same``: element for element with the param in another shape (AdaMuon's flat ``v``,
  Moonlight's 2-D momentum of a 3-D param): split with the param's flat elements;
- ``row``: one value per row of a 2-D param, shape ``(rows, 1)`` (NorMuon's second moment):
  split with the param's rows, never across a cut of its columns;
- ``column``: one value per column, shape ``(1, cols)``: split with whole columns;
- ``scalar``: one element, shape ``(1,)`` or ``(1, 1)``: kept whole with the param's one holder;
- ``own``: any other shape: kept whole with the param's one holder.

Where a layout cuts the param so that a statistic would have to be cut or recombined (a row
statistic of a param whose columns are split, a scalar of a param split over ranks),
:func:`state_region` says so (None), and the caller refuses, naming param, key and layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .topology import Region, whole_region

SAME, ROW, COLUMN, SCALAR, OWN = "same", "row", "column", "scalar", "own"
RULES = (SAME, ROW, COLUMN, SCALAR, OWN)


@dataclass(frozen=True, slots=True)
class StateShape:
    """A state tensor's full shape, where it is not its param's, and how it follows it."""

    rule: str
    """One of :data:`RULES`."""
    shape: tuple[int, ...]
    """The state tensor's full (unsharded) shape."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def shape_rule(param_shape: Sequence[int], state_shape: Sequence[int]) -> str:
    """The rule by which a whole state tensor of ``state_shape`` follows its param."""
    param, state = tuple(param_shape), tuple(state_shape)
    if math.prod(state) == math.prod(param):
        return SAME
    if len(param) == 2 and state == (param[0], 1):
        return ROW
    if len(param) == 2 and state == (1, param[1]):
        return COLUMN
    if math.prod(state) == 1:
        return SCALAR
    return OWN


def state_region(
    stored: StateShape | None, param_shape: Sequence[int], region: Region
) -> Region | None:
    """The elements of a state tensor (``stored``; None: shaped like the param) that the
    holder of ``region`` of the param keeps, as a region of the state tensor; None where the
    region cuts what the rule keeps whole (a row statistic of a column-split param, a scalar
    of a param split over ranks): such a layout cannot hold the state."""
    if stored is None or stored.rule == SAME:
        return region
    if region.numel <= 0:
        return Region(stored.numel, 0, stored.numel, 0, 0)
    if region.numel == math.prod(param_shape):
        return whole_region(stored.numel)
    rows, cols = (param_shape[0], param_shape[1]) if len(param_shape) == 2 else (0, 0)
    run = _contiguous(region, math.prod(param_shape))
    if stored.rule == ROW and run is not None and run[0] % cols == 0 and run[1] % cols == 0:
        return Region(stored.numel, 0, stored.numel, run[0] // cols, run[1] // cols)
    if stored.rule == COLUMN:
        whole_columns = region.cols == cols and region.numel == rows * region.block_width
        first, width = region.block_start, region.block_width
        if run is not None and rows == 1:
            first, width, whole_columns = run[0], run[1] - run[0], True
        if whole_columns:
            return Region(stored.numel, 0, stored.numel, first, first + width)
    return None


def _contiguous(region: Region, numel: int) -> tuple[int, int] | None:
    """The full-tensor flat range ``region`` holds, where it is one (a flat range, or any
    range of a one-row matrix view); None where it may be several."""
    if region.block_width == region.cols or region.cols == numel:
        return region.block_start + region.start, region.block_start + region.stop
    return None


def local_shape(
    stored: StateShape | None, param_shape: Sequence[int], region: Region, held: Sequence[int]
) -> tuple[int, ...]:
    """The shape of the state tensor that the holder of ``region`` of the param keeps, its
    param tensor there of shape ``held``: the param's there (shaped like it), the state's own
    (the whole param held), else its share flat (``same``), as a column (``row``) or as a row
    (``column``) of the elements :func:`state_region` gives."""
    if stored is None:
        return tuple(held)
    if region.numel == math.prod(param_shape):
        return stored.shape
    share = state_region(stored, param_shape, region)
    count = share.numel if share is not None else 0
    return {ROW: (count, 1), COLUMN: (1, count)}.get(stored.rule, (count,))
