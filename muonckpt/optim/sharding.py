"""Shard a model's named parameters for ZeRO-1 + TP: what :class:`~muonckpt.optim.muon.Muon` needs.

:func:`shard_param_groups` turns param groups of a model's tensors (full, or this rank's TP
shards) into param groups of this rank's flat ZeRO-1 shards, plus the ``global_buffer_sizes``
and ``dist_metas`` that
:meth:`Muon.enable_distributed_mode <muonckpt.optim.muon.Muon.enable_distributed_mode>` takes. The
layout math is :func:`muonckpt.layout.topology.arrange`; the cut is
:func:`muonckpt.state.regions.extract`.

The shards are the optimizer's own tensors (Megatron's "main params"), not views of the model's:
each training step moves the model's grads in (:meth:`ShardedParams.grads_to_optimizer`) and the
updated params back out (:meth:`ShardedParams.params_to_model`), the two collectives a ZeRO-1
optimizer needs; they live in :mod:`muonckpt.distributed.collectives`. No file I/O here.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from ..distributed import collectives
from ..errors import LayoutError
from ..layout.topology import (
    BufferLayout,
    LayoutOptions,
    ParamSpec,
    Topology,
    arrange,
    tp_full_shape,
)
from ..state.regions import extract
from .muon import MuonDistMeta


@dataclass
class ShardedParams:
    """One rank's share of a model's params: what ``Muon`` and its distributed mode take."""

    param_groups: list[dict[str, Any]]
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
    model_params: list[torch.Tensor]
    """The tensors the groups were built from (the model's params), in :attr:`specs` order."""
    dp_rank: int
    tp_rank: int
    tp_local: bool = False
    """Whether :attr:`model_params` are this rank's TP shards rather than full tensors."""
    dp_group: collectives.Group = None
    tp_group: collectives.Group = None

    def index(self, name: str) -> int:
        """Position of param ``name`` in :attr:`specs`; :class:`LayoutError` if unknown."""
        found = self._positions.get(name)
        if found is None:
            raise LayoutError(f"unknown param {name!r}")
        return found

    @cached_property
    def _positions(self) -> dict[str, int]:
        """Each spec's position by name, made once: a search per lookup made a training step
        over 70k params (one lookup each) quadratic, minutes per step."""
        return {spec.name: i for i, spec in enumerate(self.specs)}

    def shards(self) -> list[torch.Tensor]:
        """The optimizer's tensors, in :attr:`specs` order."""
        return [p for group in self.param_groups for _, p in group["params"]]

    def cut(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's shard of a tensor shaped like model param ``index`` (a grad, say)."""
        return _cut(self.layout, tensor, index, self.dp_rank, self.tp_rank, self.tp_local)

    @torch.no_grad()
    def grads_to_optimizer(self, *, average: bool = True) -> None:
        """Give every optimizer shard its slice of its model param's grad, as ``.grad``.

        With ``average`` (the default), each grad is first averaged over the DP group (an
        all-reduce per param, in :attr:`specs` order on every rank): what data parallelism
        needs unless a wrapper such as DDP already averaged it. A missing grad counts as zeros.
        Call on every rank of the grid after ``backward()`` and before ``opt.step()``.
        """
        for index, (model_param, shard) in enumerate(
            zip(self.model_params, self.shards(), strict=True)
        ):
            grad = model_param.grad
            grad = torch.zeros_like(model_param) if grad is None else grad.detach().clone()
            if average:
                collectives.all_reduce_mean_(grad, self._group("dp"))
            shard.grad = self.cut(grad, index).reshape(shard.shape)

    @torch.no_grad()
    def params_to_model(self) -> None:
        """Copy the optimizer's shards back into the model's params: all-gather each bucket over
        DP (one collective per bucket) and, for full model params split by TP, each split param
        over TP. Call on every rank of the grid after ``opt.step()``, so that every rank's model
        holds the same, current weights. :func:`muonckpt.load` calls it itself for a
        :class:`ShardedParams` built by :func:`shard_for_groups` (:func:`following`).
        """
        shards = self.shards()
        dp = self.layout.topology.dp
        for b, buckets in enumerate(self.layout.buckets):
            for k, bucket in enumerate(buckets):
                members = [
                    i
                    for i, place in enumerate(self.layout.placements)
                    if (place.buffer, place.bucket) == (b, k)
                ]
                if not members:
                    continue
                dtypes = {shards[i].dtype for i in members}
                if len(dtypes) > 1:
                    raise LayoutError(
                        f"buffer {b} bucket {k} mixes dtypes {sorted(map(str, dtypes))}"
                    )
                share = bucket.size // dp
                local = torch.zeros(share, dtype=dtypes.pop(), device=shards[members[0]].device)
                start = bucket.offset + share * self.dp_rank
                for i in members:
                    lo, hi = self.layout.dp_range(i, self.dp_rank)
                    at = self.layout.placements[i].global_range[0] + lo - start
                    local[at : at + hi - lo] = shards[i].reshape(-1)
                gathered = collectives.all_gather_flat(local, self._group("dp"))
                for i in members:
                    lo, hi = self.layout.placements[i].global_range
                    shard = gathered[lo - bucket.offset : hi - bucket.offset]
                    self._to_model(i, shard.view(self.layout.local_shape(i)))

    def _to_model(self, index: int, tp_shard: torch.Tensor) -> None:
        split, tp = self.specs[index].tp_split_dim, self.layout.topology.tp
        if not self.tp_local and split >= 0 and tp > 1:
            tp_shard = torch.cat(collectives.all_gather_list(tp_shard, self._group("tp")), split)
        self.model_params[index].copy_(tp_shard)

    def _group(self, which: str) -> collectives.Group:
        topology = self.layout.topology
        size, group = (
            (topology.dp, self.dp_group) if which == "dp" else (topology.tp, self.tp_group)
        )
        if size > 1 and group is None:
            raise LayoutError(
                f"{which} > 1 but no {which.upper()} process group: build with shard_for_groups"
            )
        return group


def shard_param_groups(
    groups: Sequence[Mapping[str, Any]],
    topology: Topology,
    dp_rank: int,
    tp_rank: int,
    *,
    tp_split_dims: Mapping[str, int] | None = None,
    tp_local: bool = False,
    options: LayoutOptions = LayoutOptions(),
) -> ShardedParams:
    """Cut (``dp_rank``, ``tp_rank``)'s ZeRO-1 + TP shard of every param of ``groups``.

    Args:
        groups: ``[{"params": [(name, tensor), ...], "use_muon": True, ...}, ...]``, usually
            from ``model.named_parameters()``.
        topology: the dp x tp grid.
        dp_rank: this rank's position in the DP group.
        tp_rank: this rank's position in the TP group.
        tp_split_dims: param name -> dimension split across TP ranks (missing: -1, replicated).
        tp_local: the tensors are this rank's TP shards (a tensor-parallel model, as in
            Megatron) rather than full tensors (a model replicated on every rank).
        options: bucketing, alignment and buffers, as in :func:`muonckpt.layout.topology.arrange`
            (:class:`~muonckpt.layout.topology.LayoutOptions`; ``buffers_by="group"`` gives each
            param group its own buffer).

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
    specs, fulls = _param_specs(groups, topology, split_dims, tp_local)
    layout = arrange(specs, topology, options=options)
    out_groups, dist_metas = _shard_groups(groups, specs, fulls, layout, dp_rank, tp_rank, tp_local)
    return ShardedParams(
        param_groups=out_groups,
        global_buffer_sizes=layout.global_buffer_sizes(),
        dist_metas=dist_metas,
        layout=layout,
        specs=specs,
        model_params=fulls,
        dp_rank=dp_rank,
        tp_rank=tp_rank,
        tp_local=tp_local,
    )


def _param_specs(
    groups: Sequence[Mapping[str, Any]],
    topology: Topology,
    split_dims: Mapping[str, int],
    tp_local: bool,
) -> tuple[list[ParamSpec], list[torch.Tensor]]:
    """Every param of ``groups`` as the layout math sees it (its full shape, TP split and
    group), and its tensor, in packing order; a malformed group or param, or a split naming no
    param, refused (:class:`LayoutError`)."""
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
            name, tensor = item
            split = split_dims.get(name, -1)
            shape = tuple(tensor.shape)
            if tp_local and -1 < split < tensor.dim():
                shape = tp_full_shape(shape, split, topology.tp)
            specs.append(ParamSpec(name, shape, tp_split_dim=split, group=g))
            fulls.append(tensor)
    unknown = sorted(set(split_dims) - {s.name for s in specs})
    if unknown:
        raise LayoutError(f"tp_split_dims names params that are in no group: {unknown}")
    return specs, fulls


def _shard_groups(
    groups: Sequence[Mapping[str, Any]],
    specs: Sequence[ParamSpec],
    fulls: Sequence[torch.Tensor],
    layout: BufferLayout,
    dp_rank: int,
    tp_rank: int,
    tp_local: bool,
) -> tuple[list[dict[str, Any]], dict[torch.Tensor, MuonDistMeta]]:
    """The input groups with each param cut to this rank's shard (``(name, shard)`` pairs, every
    other key kept), and each shard's :class:`MuonDistMeta`."""
    out_groups: list[dict[str, Any]] = []
    dist_metas: dict[torch.Tensor, MuonDistMeta] = {}
    index = 0
    for group in groups:
        named = []
        for _ in group["params"]:
            spec, place = specs[index], layout.placements[index]
            local = _cut(layout, fulls[index], index, dp_rank, tp_rank, tp_local)
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
    return out_groups, dist_metas


def shard_for_groups(
    groups: Sequence[Mapping[str, Any]],
    dp_group: collectives.Group,
    tp_group: collectives.Group,
    **kwargs: Any,
) -> ShardedParams:
    """:func:`shard_param_groups` with topology and ranks read from the two process groups,
    which :meth:`ShardedParams.grads_to_optimizer` and :meth:`~ShardedParams.params_to_model`
    then use."""
    topology = Topology(dp=collectives.group_size(dp_group), tp=collectives.group_size(tp_group))
    dp_rank, tp_rank = collectives.group_rank(dp_group), collectives.group_rank(tp_group)
    sharded = shard_param_groups(groups, topology, dp_rank, tp_rank, **kwargs)
    sharded.dp_group, sharded.tp_group = dp_group, tp_group
    for shard in sharded.shards():
        _FOLLOWED[id(shard)] = sharded
    return sharded


_FOLLOWED: weakref.WeakValueDictionary[int, ShardedParams] = weakref.WeakValueDictionary()
"""Per optimizer shard (by id), the :class:`ShardedParams` from :func:`shard_for_groups` that
holds it, and whose model params therefore follow it. An entry lives as long as its
``ShardedParams``, which holds the shard: an id is never another tensor's meanwhile."""


def following(params: Iterable[torch.Tensor]) -> list[ShardedParams]:
    """The :class:`ShardedParams` built by :func:`shard_for_groups` whose shards are among
    ``params`` (an optimizer's), each once, in order of first appearance: the models that
    :meth:`ShardedParams.params_to_model` must update after those params are loaded."""
    found: dict[int, ShardedParams] = {}
    for p in params:
        sharded = _FOLLOWED.get(id(p))
        if sharded is not None:
            found.setdefault(id(sharded), sharded)
    return list(found.values())


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
    return _cut(sharded.layout, full, index, dp_rank, tp_rank, tp_local=False)


def _cut(
    layout: BufferLayout,
    tensor: torch.Tensor,
    index: int,
    dp_rank: int,
    tp_rank: int,
    tp_local: bool,
) -> torch.Tensor:
    """A copy of rank (``dp_rank``, ``tp_rank``)'s shard of ``tensor``, shaped like param
    ``index``: the ZeRO-1 slice of its TP shard (``tp_local``: ``tensor`` is the TP shard)."""
    if tp_local:
        lo, hi = layout.dp_range(index, dp_rank)
        return tensor.detach().reshape(-1)[lo:hi].clone()
    return extract(tensor.detach(), layout.region(index, dp_rank, tp_rank))
