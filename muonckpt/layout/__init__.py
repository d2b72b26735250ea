"""The layout math, pure (ints only: no torch, no files, no process groups).

How params are arranged on a dp x tp grid and cut into regions, how two regions' elements
map onto each other (copy runs), the grid's canonical param list merged from each rank's
report, and work split among processes. Modules: :mod:`.topology` (ParamSpec, Topology,
``arrange``, regions, copy runs), :mod:`.grid` (each rank's report merged), :mod:`.workplan`
(work balanced among processes).

Public here is what a user passes or reads back: the params and the grid (:class:`ParamSpec`,
:class:`Topology`), how they are packed (:class:`LayoutOptions`, :func:`arrange`) and the
packing (:class:`BufferLayout`). The regions and copy runs are the package's own, in
:mod:`.topology`.
"""

from __future__ import annotations

from .topology import BufferLayout, LayoutOptions, ParamSpec, Topology, arrange

__all__ = ["BufferLayout", "LayoutOptions", "ParamSpec", "Topology", "arrange"]
