"""Shard a model's named parameters for ZeRO-1 + TP: what :class:`~muonckpt.optim.Muon` needs.

:func:`shard_param_groups` turns param groups of full tensors into param groups of this rank's
flat ZeRO-1 shards, plus the ``global_buffer_sizes`` and ``dist_metas`` that
:meth:`Muon.enable_distributed_mode <muonckpt.optim.Muon.enable_distributed_mode>` takes. The
layout math is :func:`muonckpt.layout.arrange`; the cut is :func:`muonckpt.regions.extract`.
Plain tensors only: no collectives (process groups are only asked for sizes and ranks), no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import LayoutError
from .layout import BufferLayout, ParamSpec, Topology, arrange
from .optim import MuonDistMeta
from .regions import extract


@dataclass
class ShardedParams:
    """One rank's share of a model's params: what ``Muon`` and its distributed mode take."""

    param_groups: list[dict]
    """The input groups with ``"params"`` = ``[(name, local_flat_shard), ...]`` in input order.

    Every param is present; a rank that owns no element of a param holds a 0-numel tensor.
    Every other group key is kept.
    """
    global_buffer_sizes: list[list[tuple[int, int]]]
    """Per buffer, ``[(bucket_size, bucket_offset), ...]``."""
    dist_metas: dict[torch.Tensor, MuonDistMeta]
    """A :class:`MuonDistMeta` per local shard, keyed by the shard tensor."""
    layout: BufferLayout
    specs: list[ParamSpec]
    """Params in packing order (group by group, in input order)."""

    def index(self, name: str) -> int:
        """Position of param ``name`` in :attr:`specs`; :class:`LayoutError` if unknown."""
        for i, spec in enumerate(self.specs):
            if spec.name == name:
                return i
        raise LayoutError(f"unknown param {name!r}")


def shard_param_groups(
    groups: Sequence[Mapping[str, Any]],
    topology: Topology,
    dp_rank: int,
    tp_rank: int,
    *,
    tp_split_dims: Mapping[str, int] | None = None,
    bucket_numel: int | None = None,
    param_alignment: int = 1,
    bucket_alignment: int = 1,
    buffer_of: Callable[[ParamSpec], int] | None = None,
) -> ShardedParams:
    """Cut (``dp_rank``, ``tp_rank``)'s ZeRO-1 + TP shard of every param of ``groups``.

    Args:
        groups: ``[{"params": [(name, full_tensor), ...], "use_muon": True, ...}, ...]``.
        topology: the dp x tp grid.
        dp_rank: this rank's position in the DP group.
        tp_rank: this rank's position in the TP group.
        tp_split_dims: param name -> dimension split across TP ranks (missing: -1, replicated).
        bucket_numel, param_alignment, bucket_alignment, buffer_of: see
            :func:`muonckpt.layout.arrange`.

    Raises:
        LayoutError: naming the param, for a param that is not a ``(name, tensor)`` pair, a
            ``tp_split_dims`` entry that names no param or no dimension of it, a split dimension
            that ``topology.tp`` does not divide, duplicate names, or ranks outside the topology.
    """
    if not 0 <= dp_rank < topology.dp or not 0 <= tp_rank < topology.tp:
        raise LayoutError(
            f"(dp_rank={dp_rank}, tp_rank={tp_rank}) is outside a {topology} topology"
        )
    split_dims = dict(tp_split_dims or {})
    specs: list[ParamSpec] = []
    fulls: list[torch.Tensor] = []
    for g, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise LayoutError(f"param group {g} is not a mapping with a 'params' key")
        params = group["params"]
        if isinstance(params, torch.Tensor) or not isinstance(params, Sequence):
            raise LayoutError(
                f"param group {g}: 'params' must be a list of (name, tensor) pairs, "
                f"got {type(params).__name__}"
            )
        for k, item in enumerate(params):
            if not (
                isinstance(item, tuple)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)
            ):
                what = f"{item[0]!r}" if isinstance(item, tuple) and item else f"#{k}"
                raise LayoutError(
                    f"param {what} of group {g} is not a (name, tensor) pair "
                    f"(got {type(item).__name__})"
                )
            name, full = item
            specs.append(
                ParamSpec(name, tuple(full.shape), tp_split_dim=split_dims.get(name, -1), group=g)
            )
            fulls.append(full)
    unknown = sorted(set(split_dims) - {s.name for s in specs})
    if unknown:
        raise LayoutError(f"tp_split_dims names params that are in no group: {unknown}")
    layout = arrange(
        specs,
        topology,
        bucket_numel=bucket_numel,
        param_alignment=param_alignment,
        bucket_alignment=bucket_alignment,
        buffer_of=buffer_of,
    )
    out_groups: list[dict] = []
    dist_metas: dict[torch.Tensor, MuonDistMeta] = {}
    index = 0
    for group in groups:
        named = []
        for _ in group["params"]:
            spec, place = specs[index], layout.placements[index]
            local = extract(fulls[index].detach(), layout.region(index, dp_rank, tp_rank))
            local.requires_grad_(False)
            dist_metas[local] = MuonDistMeta(
                place.buffer,
                place.bucket,
                layout.local_shape(index),
                place.global_range,
                spec.tp_split_dim,
            )
            named.append((spec.name, local))
            index += 1
        out = {**{k: v for k, v in group.items() if k != "params"}, "params": named}
        if not named:
            # torch names a group from its (name, tensor) pairs; an empty group has none and
            # would then count as unnamed, which torch refuses to mix with named groups.
            out.setdefault("param_names", [])
        out_groups.append(out)
    return ShardedParams(
        param_groups=out_groups,
        global_buffer_sizes=layout.global_buffer_sizes(),
        dist_metas=dist_metas,
        layout=layout,
        specs=specs,
    )


def shard_for_groups(
    groups: Sequence[Mapping[str, Any]],
    dp_group: dist.ProcessGroup | None,
    tp_group: dist.ProcessGroup | None,
    **kwargs: Any,
) -> ShardedParams:
    """:func:`shard_param_groups` with topology and ranks read from the two process groups."""
    topology = Topology(dp=dist.get_world_size(dp_group), tp=dist.get_world_size(tp_group))
    return shard_param_groups(
        groups, topology, dist.get_rank(dp_group), dist.get_rank(tp_group), **kwargs
    )


def shard_tensor(
    full: torch.Tensor, sharded: ShardedParams, name: str, dp_rank: int, tp_rank: int
) -> torch.Tensor:
    """The cut :func:`shard_param_groups` makes of param ``name``, applied to ``full``.

    ``full`` must have the param's full shape (a gradient, a reference copy of the param, ...).
    """
    index = sharded.index(name)
    spec = sharded.specs[index]
    if tuple(full.shape) != spec.shape:
        raise LayoutError(
            f"param {name!r}: tensor of shape {tuple(full.shape)} does not match the param's "
            f"shape {spec.shape}"
        )
    topology = sharded.layout.topology
    if not 0 <= dp_rank < topology.dp or not 0 <= tp_rank < topology.tp:
        raise LayoutError(
            f"(dp_rank={dp_rank}, tp_rank={tp_rank}) is outside a {topology} topology"
        )
    return extract(full.detach(), sharded.layout.region(index, dp_rank, tp_rank))
