"""The layout model every path reads: for one optimizer over the ranks it spans, each param's
full shape, the regions its sources hold and the region this rank keeps.

Save, load, the gather and the trim read only a :class:`Sharding`; the describers
(:mod:`.describers`, :mod:`.owners`, chosen by :func:`muonckpt.state.placement.describe`) make
one. Plain data: a change to what a layout says goes here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..errors import StateDictError
from ..layout.topology import Region


class _Replicated:
    """The type of :data:`REPLICATED`."""

    def __repr__(self) -> str:
        return "muonckpt.REPLICATED"


REPLICATED = _Replicated()
"""What an ``owner`` rule returns for a param whose state every rank keeps identically (the
AdamW state of KellerJordan's ``MuonWithAuxAdam``): gathered from one rank, restored on all."""


@dataclass(frozen=True, slots=True)
class Holding:
    """A global rank's share of a param's state: ``region`` of the full tensor."""

    rank: int
    region: Region


@dataclass(frozen=True, slots=True)
class ParamSharding:
    """How one param of the whole grid is spread over ranks, seen from this rank."""

    name: str
    full_shape: tuple[int, ...]
    """Full shape of the param and of each state tensor shaped like it."""
    sources: tuple[Holding, ...]
    """Owners that together hold every element exactly once (what the gather reads)."""
    local: Region | None
    """This rank's share of the state when loading (None: it keeps no state of the param)."""
    local_index: int | None
    """The param's position in this rank's flat param order; None where this rank lacks it."""
    group: int
    """Index of its param group."""
    expected_keys: tuple[str, ...] = ()
    """State keys a complete entry must have (empty: whatever the source had)."""
    tp_split_dim: int = -1
    """TP split dimension in this run (recorded in checkpoints)."""
    dtype: str | None = None
    """torch dtype name of the param itself (``float32``), where known."""
    held: Region | None = None
    """What this rank's param tensor holds of the full param (None: all of it)."""
    replicated: bool = False
    """Every rank keeps the same state of this param (:data:`REPLICATED`)."""

    @property
    def index_here(self) -> int:
        """:attr:`local_index`, for a param this rank holds (:meth:`Sharding.local`)."""
        if self.local_index is None:
            raise StateDictError(f"param {self.name!r} is not held on this rank")
        return self.local_index

    @property
    def region_here(self) -> Region:
        """:attr:`local`, for a param this rank holds (:meth:`Sharding.local`)."""
        if self.local is None:
            raise StateDictError(f"param {self.name!r} is not held on this rank")
        return self.local


@dataclass
class Sharding:
    """Everything the hooks need to know about one optimizer's sharding, for one call."""

    params: list[ParamSharding]
    """Every param of the grid, in canonical order (group by group)."""
    participants: list[int]
    """Global ranks taking part in the gather."""
    destination: int
    """Global rank that receives the complete state dict."""
    topology: dict[str, int] = field(default_factory=dict)
    named: bool = True
    """Whether the params carry names (else their names are canonical positions)."""

    def local(self) -> Iterator[ParamSharding]:
        """The params this rank's optimizer holds, in its own flat order."""
        return iter(sorted((p for p in self.params if p.local_index is not None), key=_position))

    def members(self, group: int) -> list[int]:
        """Canonical indices of the params of one group."""
        return [i for i, p in enumerate(self.params) if p.group == group]


def _position(param: ParamSharding) -> int:
    return param.local_index if param.local_index is not None else -1


def check_unique_names(names: Sequence[str]) -> None:
    """Refuse a layout in which two params share a name."""
    counts = Counter(names)
    dupes = sorted(n for n, count in counts.items() if count > 1)
    if dupes:
        raise StateDictError(f"duplicate param names {dupes}: names must be unique")
