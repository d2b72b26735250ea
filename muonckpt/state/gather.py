"""The collective gather: every param's full state assembled from the ranks that hold it.

Every rank reports the state it holds (step ``state keys``: keys, kinds, dtypes, a digest of
replicated tensors); the destination merges the reports against the layout
(:func:`merge_entry_reports`: a wrong owner rule, drifted replicas or disagreeing ranks fail on
every rank here, before any data moves); then each param's pieces travel by ``send``/``recv``
to the destination (and on to every rank when asked), which assembles full tensors one at a
time in host memory; the last step, ``state values``, raises any rank's failure on every rank.

Memory: the destination holds the complete state in host memory plus one piece in flight on the
device of the process group (:func:`muonckpt.distributed.collectives.comm_device`); every other
rank its own share plus one piece (or one full param when delivering to all ranks).

The values it moves, classified, are :mod:`.values`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch

from ..distributed import collectives
from ..errors import StateDictError
from ..format.names import PARAM_KEY
from ..layout.state_shapes import state_region
from ..storage import checksum_chunks
from .describers import state_dict_steps
from .regions import insert_
from .sharding_model import ParamSharding, Sharding
from .values import (
    HOST,
    ParamReport,
    ParamState,
    StateValue,
    TensorValue,
    ValueReport,
    reported_shape,
    reported_value,
)


def gather_full_state(
    sharding: Sharding,
    local: Callable[[], Mapping[int, ParamState]],
    all_ranks: bool = False,
) -> dict[int, ParamState] | None:
    """Every param's full state (and values where ``local`` has them) by canonical index, on
    the destination (and every rank with ``all_ranks``); None elsewhere. ``local()`` gives this
    rank's, keyed by its flat param index; it runs inside the first step, so that a value it
    refuses fails every rank.

    A collective over ``sharding.participants``. Raises :class:`StateDictError` on every rank
    when a declared owner lacks state another rank holds, or replicated state differs.
    """
    me = collectives.global_rank()
    held: list[Mapping[int, ParamState]] = []
    entries = _gather_entry_metadata(sharding, local, held)
    receives = me == sharding.destination or all_ranks
    full_state: dict[int, ParamState] = {}
    failures: list[Exception] = []

    def state_piece(key: str) -> Callable[[int], torch.Tensor]:
        return lambda i: cast(TensorValue, held[0][i].state[key]).tensor

    def values_piece(i: int) -> torch.Tensor:
        return cast(torch.Tensor, held[0][i].values)

    for index, param in enumerate(sharding.params):
        spec, value_spec = entries["state"][index], entries["values"][index]
        if spec is None and value_spec is None:
            continue
        state: dict[str, StateValue] = {}
        for key, info in (spec or {}).items():
            value = _gather_value(param, info, state_piece(key), sharding, all_ranks, failures)
            if receives and value is not None:
                state[key] = value
        values = None
        if value_spec is not None:
            info = value_spec[PARAM_KEY]
            values = _gather_value(param, info, values_piece, sharding, all_ranks, failures)
        if receives:
            full_state[index] = ParamState(state, values.as_state() if values else None)

    def fail_if_failed() -> None:
        if failures:
            raise failures[0]

    state_dict_steps(sharding.participants, sharding.destination).each_then_root(
        "state values", fail_if_failed, lambda _: None
    )
    return full_state if receives else None


def _gather_entry_metadata(
    sharding: Sharding,
    local: Callable[[], Mapping[int, ParamState]],
    held: list[Mapping[int, ParamState]],
) -> dict[str, list[ParamReport | None]]:
    """Every rank learns, per param, the state keys with their kind, dtype and shape (or value)
    and the params' values (``state``, ``values``). ``held`` receives this rank's
    :class:`ParamState`\\ s.

    Every participant reports the state it holds, owner or not, so that the merge can tell a
    wrong owner rule from a param without state.
    """

    def mine() -> EntryReports:
        held.append(local())
        return entry_reports(sharding, held[0])

    return state_dict_steps(sharding.participants, sharding.destination).each_then_root(
        "state keys", mine, lambda reports: _merged(sharding, reports)
    )


EntryReports = dict[str, dict[str, ParamReport]]
"""One rank's report of the state and values it holds: ``{"state": {param index: {key:
report}}, "values": {param index: {"param": report}}}`` (JSON)."""


def entry_reports(sharding: Sharding, local: Mapping[int, ParamState]) -> EntryReports:
    """This rank's :data:`EntryReports` of ``local`` (by flat param index), replicas' tensors
    with their digests (the replicas must agree, not only in their keys)."""
    state: dict[str, ParamReport] = {}
    values: dict[str, ParamReport] = {}
    for index, param in enumerate(sharding.params):
        entry = local.get(param.local_index) if param.local_index is not None else None
        if entry is None:
            continue
        if entry.state:
            state[str(index)] = {key: v.report() for key, v in entry.state.items()}
            if param.replicated:
                for key, v in entry.state.items():
                    if isinstance(v, TensorValue):
                        state[str(index)][key]["digest"] = replica_digest(v.tensor)
        if entry.values is not None:
            report = TensorValue(entry.values).report()
            if param.replicated:
                report["digest"] = replica_digest(entry.values)
            values[str(index)] = {PARAM_KEY: report}  # named as the files name them
    return {"state": state, "values": values}


def _merged(
    sharding: Sharding, reports: Sequence[EntryReports]
) -> dict[str, list[ParamReport | None]]:
    state = merge_entry_reports(sharding, [r["state"] for r in reports])
    values = merge_entry_reports(sharding, [r["values"] for r in reports])
    return {"state": state, "values": values}


def state_holders_report(sharding: Sharding, local: Mapping[int, ParamState]) -> EntryReports:
    """What this rank tells :func:`check_state_holders`: the state it holds (the params' own
    values left out: every rank holds its own)."""
    return entry_reports(sharding, {i: ParamState(held.state) for i, held in local.items()})


def check_state_holders(sharding: Sharding, reports: Sequence[EntryReports]) -> None:
    """Raise :class:`StateDictError` unless the state each rank holds (``reports``, the
    participants' :func:`state_holders_report`\\ s in order) is where the sharding says (a
    declared owner holding none of it: a wrong owner rule). Pure: a save runs it on the root
    of the step that compares the ranks' reports anyway (``stage``)."""
    _merged(sharding, reports)


def merge_entry_reports(
    sharding: Sharding, reports: Sequence[Mapping[str, ParamReport]]
) -> list[ParamReport | None]:
    """Per param, the description of each state key, taken from its sources' reports.

    ``reports`` are the participants' (in order). Raises :class:`StateDictError` naming the
    param and ranks when a source lacks state another rank holds (a wrong owner rule), when
    replicated state differs between ranks, or when sources disagree about a key.
    """
    by_rank = dict(zip(sharding.participants, reports, strict=True))
    merged: list[ParamReport | None] = []
    for index, param in enumerate(sharding.params):
        holders = [r for r in sharding.participants if str(index) in by_rank[r]]
        if not holders:
            merged.append(None)
            continue
        owners = [h.rank for h in param.sources if h.region.numel or len(param.sources) == 1]
        if param.replicated:
            owners = list(sharding.participants)
        seen = holders
        lacking = [r for r in owners if r not in seen]
        if lacking:
            raise StateDictError(
                f"param {param.name!r}: rank {seen[0]} holds state for it, but its declared "
                f"owner rank {lacking[0]} holds none: the owner rule does not match where the "
                "optimizer keeps its state"
            )
        for holding in param.sources:
            for key, info in by_rank[holding.rank].get(str(index), {}).items():
                if info["kind"] != "tensor":
                    continue
                held = state_region(reported_shape(info), param.full_shape, holding.region)
                if held is None or info["numel"] != held.numel:
                    raise StateDictError(
                        f"param {param.name!r}: state {key!r} holds {info['numel']} elements on "
                        f"rank {holding.rank}, its share of the param {holding.region.numel}"
                    )
        first = by_rank[owners[0]][str(index)]
        expected = _shape_free(first, param.replicated)
        for rank in owners[1:]:
            theirs = by_rank[rank][str(index)]
            drifted = param.replicated and [
                key
                for key, info in first.items()
                if key in theirs and info.get("digest") != theirs[key].get("digest")
            ]
            if drifted:
                raise StateDictError(
                    f"param {param.name!r}: state {drifted[0]!r} differs between ranks "
                    f"{owners[0]} and {rank}, whose replicas must be identical (the state of an "
                    "optimizer without hooks in a process group, or of a REPLICATED param): "
                    "the ranks' optimizers did not step alike (a sharded optimizer needs "
                    "muonckpt.install_hooks with its owner rule; each process's own optimizer "
                    "is saved with local=True)"
                )
            described = _shape_free(theirs, param.replicated)
            if described != expected:
                differs = _differences(expected, described, owners[0], rank)
                raise StateDictError(
                    f"param {param.name!r}: ranks {owners[0]} and {rank} disagree about its "
                    f"state: {'; '.join(differs)}"
                )
        merged.append(dict(first))
    return merged


def _shape_free(entry: Mapping[str, ValueReport], replicated: bool) -> Any:
    """What ranks must agree on: keys, kinds and dtypes (and shapes and values if replicated;
    shards of one tensor differ in shape)."""
    return {
        key: (info["kind"], info.get("dtype"))
        + ((tuple(info.get("shape", ())), info.get("value")) if replicated else ())
        for key, info in entry.items()
    }


def _differences(a: Mapping[str, Any], b: Mapping[str, Any], rank_a: int, rank_b: int) -> list[str]:
    """What differs between two ranks' :func:`_shape_free` descriptions, key by key (a key
    held by one rank only, or its kind, dtype, shape or value)."""
    fields = ("kind", "dtype", "shape", "value")
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            out.append(f"state {key!r} only on rank {rank_a if key in a else rank_b}")
        elif a[key] != b[key]:
            out += [
                f"state {key!r} {name} {x!r} on rank {rank_a}, {y!r} on rank {rank_b}"
                for name, x, y in zip(fields, a[key], b[key], strict=False)
                if x != y
            ]
    return out


_DIGEST_CHUNK = 1 << 22
"""Words a replica digest reads at a time (bounding its temporary memory to ~100 MiB)."""


def replica_digest(tensor: torch.Tensor) -> list[Any]:
    """A cheap fingerprint of a tensor's bytes, computed where the tensor is: in host memory
    the checkpoint's own checksum (XXH3-64) of its bytes; on a device two int64 sums (wrapping)
    of its bytes as 32-bit words, plain and weighted by position, so that nothing crosses to
    the host. Replicas that differ in any word, or hold the same words in another order,
    differ here (with overwhelming likelihood). Replicas compared must be on one device type."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.device.type == "cpu":
        return list(checksum_chunks(data.numpy(), chunk_bytes=max(1, data.numel())))
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    words = data.view(torch.int32)
    sums = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _DIGEST_CHUNK):
        chunk = words[start : start + _DIGEST_CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=chunk.device)
        sums[0] += chunk.sum()
        sums[1] += (chunk * (weights * 2654435761 + 1)).sum()
    return sums.tolist()


def _gather_value(
    param: ParamSharding,
    info: ValueReport,
    local_piece: Callable[[int], torch.Tensor],
    sharding: Sharding,
    all_ranks: bool,
    failures: list[Exception],
) -> StateValue | None:
    """Assemble one full state value in host memory on the destination (and, if asked, on every
    rank; a tensor is None elsewhere); ``local_piece(i)``: this rank's piece, by its flat
    param index. Pieces travel on the process group's device and are copied into the host
    tensor as each arrives.

    Every send and receive the metadata fixed happens even after a failure of this rank's own
    (a full tensor it cannot allocate, a piece it cannot produce): the failure goes to
    ``failures``, zeros travel instead, and the gather's last step raises it on every rank, so
    that no peer waits forever for a transfer that never comes.
    """
    if info["kind"] != "tensor":
        return reported_value(info)
    me, dst = collectives.global_rank(), sharding.destination
    dtype = getattr(torch, info["dtype"])
    stored = reported_shape(info)
    shape = param.full_shape if stored is None else stored.shape
    full = _attempt(failures, torch.empty, shape, dtype=dtype, device=HOST) if me == dst else None
    for holding in param.sources:
        region = state_region(stored, param.full_shape, holding.region)
        assert region is not None  # (merge_entry_reports refused a layout that cuts it)
        if holding.rank == me:
            index = param.index_here  # this rank holds a piece of it
            piece = _attempt(failures, lambda i=index: local_piece(i).reshape(-1))
            if me != dst:
                collectives.send(_or_zeros(piece, region.numel, dtype), dst)
            elif full is not None and piece is not None:
                _attempt(failures, insert_, full, region, piece)
        elif me == dst:
            piece = collectives.recv((region.numel,), dtype, holding.rank)
            if full is not None:
                _attempt(failures, insert_, full, region, piece)
    if all_ranks:
        if me == dst:
            for rank in sharding.participants:
                if rank != dst:
                    collectives.send(_or_zeros(full, math.prod(shape), dtype).reshape(shape), rank)
        else:
            full = collectives.recv(shape, dtype, dst).to(HOST)
    return TensorValue(full, stored) if full is not None else None


def _attempt(failures: list[Exception], work: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``work(*args, **kw)``, or None with the exception recorded (the first is raised later)."""
    try:
        return work(*args, **kw)
    except Exception as exc:
        failures.append(exc)
        return None


def _or_zeros(tensor: torch.Tensor | None, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """What a rank sends in place of a tensor it failed to produce: zeros of the agreed size."""
    if tensor is not None and tensor.numel() == numel and tensor.dtype == dtype:
        return tensor
    return torch.zeros(numel, dtype=dtype)
