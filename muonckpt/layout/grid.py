"""What a whole dp x tp grid of packaged-Muon ranks holds: one canonical list of its params.

Pure: JSON-able reports in, dataclasses out; no torch, no collectives, no I/O.

A rank's optimizer may hold an empty shard of a param it owns no element of (what
:func:`muonckpt.optim.sharding.shard_for_groups` builds) or leave that param out altogether (the
seed's ``distribute_params`` and Megatron's distributed optimizer). Either way no single rank knows
every param, so each rank reports the params it holds (:class:`LocalParam`) and
:func:`merge_reports` builds the grid's list, checking that the ranks agree and that every
element the buffer layout assigns to a rank is held by that rank.

Identity: a param is its name where the optimizer's groups carry names. An unnamed param is
identified by its position in the packing order: params sorted by (group, buffer, bucket,
place in the buffer), numbered from 0 over the whole grid. A single-process optimizer numbers
its params in group order, which agrees whenever each group's params are packed in the order
they are listed (as the seed and :func:`muonckpt.optim.sharding.shard_for_groups` do).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import StateDictError
from .topology import Range, Region, Topology, owner_ranks, share_region, tp_full_shape


@dataclass(frozen=True, slots=True)
class LocalParam:
    """One param as the rank holding it describes it (the fields every holder must agree on)."""

    name: str | None
    """Its name, or None for an unnamed param (see the module docstring)."""
    group: int
    """Index of its param group."""
    local_shape: tuple[int, ...]
    """Shape of its TP shard (``MuonDistMeta.shape``)."""
    tp_split_dim: int
    """Dimension split across TP ranks, or -1."""
    buffer: int
    bucket: int
    global_range: Range
    """Flat ``[start, stop)`` of the TP shard in its buffer."""
    bucket_span: Range
    """``(bucket_size, bucket_offset)`` of its bucket, as ``global_buffer_sizes`` has it."""
    dtype: str
    """dtype of the param tensor, by torch's name (``float32``)."""

    def identity(self) -> tuple[int, int, int, int, int]:
        """The packing-order key of an unnamed param."""
        return (self.group, self.buffer, self.bucket, *self.global_range)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LocalParam:
        return cls(
            name=raw["name"],
            group=raw["group"],
            local_shape=tuple(raw["local_shape"]),
            tp_split_dim=raw["tp_split_dim"],
            buffer=raw["buffer"],
            bucket=raw["bucket"],
            global_range=tuple(raw["global_range"]),
            bucket_span=tuple(raw["bucket_span"]),
            dtype=raw["dtype"],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "group": self.group,
            "local_shape": list(self.local_shape),
            "tp_split_dim": self.tp_split_dim,
            "buffer": self.buffer,
            "bucket": self.bucket,
            "global_range": list(self.global_range),
            "bucket_span": list(self.bucket_span),
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class RankReport:
    """What one rank of the grid holds: its params in its own flat order, and its group count."""

    groups: int
    params: tuple[LocalParam, ...]

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RankReport:
        return cls(raw["groups"], tuple(LocalParam.from_json(p) for p in raw["params"]))

    def to_json(self) -> dict[str, Any]:
        return {"groups": self.groups, "params": [p.to_json() for p in self.params]}


@dataclass(frozen=True, slots=True)
class GridParam:
    """One param of the whole grid, with where its state lives."""

    name: str
    """Its name, or for an unnamed param its packing-order position as a string."""
    spec: LocalParam
    """Its description, as every holder gave it."""
    full_shape: tuple[int, ...]
    positions: tuple[int | None, ...] | int
    """Per grid index (``dp_rank * tp + tp_rank``), the param's position in that rank's flat
    param order (None: that rank's optimizer lacks it); one int where every rank holds it at
    that position (:func:`grid_of_alike`)."""

    def position_on(self, rank: int) -> int | None:
        """The param's position in grid rank ``rank``'s flat param order (None: absent)."""
        positions = self.positions
        return positions if isinstance(positions, int) else positions[rank]

    def owner_ranks(self, topology: Topology) -> list[int]:
        """The grid ranks whose :meth:`owner_region` is not empty, from the param's place in its
        bucket (:func:`muonckpt.layout.topology.owner_ranks`): no pass over every rank."""
        size, offset = self.spec.bucket_span
        return owner_ranks(self.spec.global_range, offset, size, self.spec.tp_split_dim, topology)

    def region(
        self, topology: Topology, dp_rank: int, tp_rank: int, *, owner_only: bool = False
    ) -> Region:
        """What (dp_rank, tp_rank) holds of the param, in full-tensor coordinates
        (:func:`muonckpt.layout.topology.share_region`)."""
        spec = self.spec
        size, offset = spec.bucket_span
        return share_region(
            self.full_shape,
            spec.tp_split_dim,
            topology,
            dp_rank,
            tp_rank,
            spec.global_range,
            offset,
            size,
            owner_only=owner_only,
        )

    def owner_region(self, topology: Topology, dp_rank: int, tp_rank: int) -> Region:
        """Like :meth:`region`, with a TP-replicated param counted on TP rank 0 only."""
        return self.region(topology, dp_rank, tp_rank, owner_only=True)


@dataclass(frozen=True, slots=True)
class GridParams:
    """The grid's params in canonical order (group by group, packing order within a group)."""

    topology: Topology
    groups: int
    params: tuple[GridParam, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "topology": [self.topology.dp, self.topology.tp],
            "groups": self.groups,
            "params": [
                [
                    p.name,
                    p.spec.to_json(),
                    p.positions if isinstance(p.positions, int) else list(p.positions),
                ]
                for p in self.params
            ],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> GridParams:
        topology = Topology(*raw["topology"])
        params = []
        for name, spec, positions in raw["params"]:
            local = LocalParam.from_json(spec)
            params.append(
                GridParam(
                    name=name,
                    spec=local,
                    full_shape=_full_shape(local, topology),
                    positions=positions if isinstance(positions, int) else tuple(positions),
                )
            )
        return cls(topology, raw["groups"], tuple(params))


def merge_reports(reports: Sequence[RankReport], topology: Topology) -> GridParams:
    """The grid's canonical param list from every rank's report (grid order).

    Raises :class:`StateDictError` naming the param and the ranks when ranks disagree about a
    param, when names are given on some ranks only or repeat, when unnamed params cannot be
    told apart, or when a rank the buffer layout gives elements of a param does not hold it.
    """
    if len(reports) != topology.world_size:
        raise StateDictError(
            f"{len(reports)} rank reports for a {topology} grid of {topology.world_size}"
        )
    return _merged(reports, topology, alike=False)


def grid_of_alike(report: RankReport, topology: Topology) -> GridParams:
    """The grid's canonical param list when every rank reported ``report`` (found alike by
    comparing digests): what :func:`merge_reports` of ``world_size`` copies of it returns, each
    param's position one int, in time and memory that do not grow with the world size.

    Raises :class:`StateDictError` as :func:`merge_reports` does for the one report.
    """
    return _merged([report], topology, alike=True)


def _merged(reports: Sequence[RankReport], topology: Topology, *, alike: bool) -> GridParams:
    _check_group_counts(reports, topology)
    named = _naming(reports, topology)
    first: dict[object, tuple[int, LocalParam]] = {}
    positions: dict[object, dict[int, int]] = {}
    for rank, report in enumerate(reports):
        for position, param in enumerate(report.params):
            key = param.name if named else param.identity()
            seen = positions.setdefault(key, {})
            if rank in seen:
                what = f"param {param.name!r}" if named else f"two unnamed params at {key}"
                raise StateDictError(
                    f"{what} appears twice on {_where(rank, topology)}: "
                    + ("names must be unique" if named else "give the params names")
                )
            seen[rank] = position
            if key not in first:
                first[key] = (rank, param)
                continue
            _check_same(first[key], (rank, param), topology, named)
    ordered = sorted(first, key=lambda k: (first[k][1].identity(), str(k)))
    params = []
    for number, identity in enumerate(ordered):
        spec = first[identity][1]
        held = positions[identity]
        merged = GridParam(
            name=spec.name if named and spec.name is not None else str(number),
            spec=spec,
            full_shape=_full_shape(spec, topology),
            positions=held[0] if alike else tuple(map(held.get, range(topology.world_size))),
        )
        _check_held(merged, topology)
        params.append(merged)
    return GridParams(topology, reports[0].groups, tuple(params))


def _full_shape(spec: LocalParam, topology: Topology) -> tuple[int, ...]:
    return tp_full_shape(spec.local_shape, spec.tp_split_dim, topology.tp)


def _where(rank: int, topology: Topology) -> str:
    dp_rank, tp_rank = topology.coords(rank)
    return f"grid rank {rank} (dp {dp_rank}, tp {tp_rank})"


def _check_group_counts(reports: Sequence[RankReport], topology: Topology) -> None:
    for rank, report in enumerate(reports):
        if report.groups != reports[0].groups:
            raise StateDictError(
                f"{_where(rank, topology)} has {report.groups} param groups, "
                f"{_where(0, topology)} {reports[0].groups}: every rank needs every group"
            )


def _naming(reports: Sequence[RankReport], topology: Topology) -> bool:
    """True when every param on every rank has a name, False when none has."""
    kinds: dict[bool, int] = {}
    for rank, report in enumerate(reports):
        for param in report.params:
            kinds.setdefault(param.name is not None, rank)
    if len(kinds) == 2:
        raise StateDictError(
            f"{_where(kinds[True], topology)} names its params, {_where(kinds[False], topology)} "
            "does not: give every rank's params names, or none"
        )
    return True in kinds


def _check_same(
    a: tuple[int, LocalParam], b: tuple[int, LocalParam], topology: Topology, named: bool
) -> None:
    (rank_a, pa), (rank_b, pb) = a, b
    fields = ["group", "local_shape", "tp_split_dim", "buffer", "bucket", "dtype"]
    fields += ["global_range", "bucket_span"]
    for field in fields:
        va, vb = getattr(pa, field), getattr(pb, field)
        if va != vb:
            label = pa.name if named else f"#{pa.identity()}"
            raise StateDictError(
                f"param {label!r}: {_where(rank_a, topology)} and {_where(rank_b, topology)} "
                f"disagree about its {field.replace('_', ' ')}: {va} vs {vb}"
            )


def _check_held(param: GridParam, topology: Topology) -> None:
    """Every rank the layout gives elements of the param must hold it (coverage)."""
    size, _ = param.spec.bucket_span
    if size % topology.dp:
        raise StateDictError(
            f"param {param.name!r}: bucket size {size} is not divisible by dp={topology.dp}"
        )
    if isinstance(param.positions, int):
        return  # held by every rank
    for rank in range(topology.world_size):
        if param.positions[rank] is not None:
            continue
        region = param.region(topology, *topology.coords(rank))
        if region.numel:
            raise StateDictError(
                f"param {param.name!r}: the buffer layout gives {_where(rank, topology)} "
                f"{region.numel} of its {math.prod(param.full_shape)} elements, but that "
                "rank's optimizer does not hold the param"
            )
