"""The layout math, pure (ints only: no torch, no files, no process groups).

How params are arranged on a dp x tp grid and cut into regions, how two regions' elements
map onto each other (copy runs), the grid's canonical param list merged from each rank's
report, and work split among processes. Modules: :mod:`.topology` (ParamSpec, Topology,
``arrange``, regions, copy runs), :mod:`.grid` (each rank's report merged), :mod:`.workplan`
(work balanced among processes).
"""

from __future__ import annotations

from .topology import (
    Bucket,
    BufferLayout,
    LayoutOptions,
    ParamSpec,
    Placement,
    Region,
    Run,
    Strided,
    Topology,
    arrange,
    copy_runs,
    dp_slice,
    matrix_view,
    share_region,
    strided_runs,
    tp_full_shape,
    tp_local_shape,
    tp_region,
    whole_region,
)

__all__ = [
    "Bucket",
    "BufferLayout",
    "LayoutOptions",
    "ParamSpec",
    "Placement",
    "Region",
    "Run",
    "Strided",
    "Topology",
    "arrange",
    "copy_runs",
    "dp_slice",
    "matrix_view",
    "share_region",
    "strided_runs",
    "tp_full_shape",
    "tp_local_shape",
    "tp_region",
    "whole_region",
]
