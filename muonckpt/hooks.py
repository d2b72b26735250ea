"""Hooks that make a sharded optimizer's ``state_dict()`` complete and resumable anywhere.

A sharded optimizer keeps each param's state on the ranks that own it: pieces of a flat ZeRO-1
buffer in the packaged :class:`~muonckpt.Muon`, whole tensors on one owner rank in
KellerJordan-style Muon. The hooks here, attached through torch's optimizer hook API, turn that
into torch's ordinary state-dict format with every param's full-shape state:

* ``state_dict()`` (a collective over every rank that holds state) learns the complete list of
  params from the whole grid (a rank may leave out a param it owns no element of), then streams
  each param's pieces to the destination rank, which assembles full tensors one at a time in
  host memory (CPU tensors, whatever device the state lives on).
  Other ranks return a stub marked incomplete, so loading one by mistake fails loudly instead
  of silently restarting momentum at zero.
* ``load_state_dict(sd)`` matches params by name, validates names, keys and shapes, and keeps
  only this rank's share under the current topology. For a distributed packaged Muon the first
  call that needs the grid's param list (``state_dict``, ``load_state_dict``, ``save`` or
  ``load``) is a collective over the grid; the list is kept for later calls.

Memory: the destination holds the complete state in host memory plus one piece in flight on the
device of the process group (:func:`muonckpt.collectives.comm_device`); every other rank its own
share plus one piece (or one full param when delivering to all ranks).
"""

from __future__ import annotations

import math
import weakref
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import collectives
from .errors import StateDictError
from .grid import GridParams, RankReport, merge_reports
from .layout import Region, Topology, tp_full_shape, tp_region, whole_region
from .manifest import PARAM_KEY
from .regions import extract, insert_
from .storage import checksum_chunks
from .workplan import spread

HOST = torch.device("cpu")
"""Where gathered full tensors are assembled and delivered: host memory, as DCP's
``cpu_offload=True``, so a GPU never holds more than a piece or one param in flight."""
MARKER = "muonckpt"
"""Top-level key that tags state dicts produced by these hooks."""
FORMAT_VERSION = 1


class _Replicated:
    """The type of :data:`REPLICATED`."""

    def __repr__(self) -> str:
        return "muonckpt.REPLICATED"


REPLICATED = _Replicated()
"""What an ``owner`` rule returns for a param whose state every rank keeps identically (the
AdamW state of KellerJordan's ``MuonWithAuxAdam``): gathered from one rank, restored on all."""


@dataclass(frozen=True)
class Holding:
    """A global rank's share of a param's state: ``region`` of the full tensor."""

    rank: int
    region: Region


@dataclass(frozen=True)
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

    @property
    def held_numel(self) -> int:
        """Elements of this rank's param tensor (and of each state tensor shaped like it)."""
        return self.held.numel if self.held is not None else math.prod(self.full_shape)


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


class StateDictHooks:
    """The four hooks on one optimizer. ``all_ranks=True`` delivers the full state everywhere.

    ``describe(optimizer, collective)`` gives the optimizer's :class:`Sharding`; it is handed
    the optimizer at each call and must not hold it, or the weak mapping the hooks are kept in
    would keep the optimizer (its params and state) alive for good. ``ranks(optimizer,
    operation)`` gives the global ranks of its collectives without a collective on the process
    groups (the store at most, bounded), so that each can begin with a bounded rendezvous
    (default: this rank alone).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        describe: Callable[[torch.optim.Optimizer, bool], Sharding],
        *,
        ranks: Callable[[torch.optim.Optimizer, str], list[int]] | None = None,
        all_ranks: bool = False,
    ) -> None:
        self.describe = describe
        self.ranks = ranks or (lambda optimizer, operation: [collectives.global_rank()])
        self.all_ranks = all_ranks
        self._handles = [
            optimizer.register_state_dict_pre_hook(self._describe_for_gather),
            optimizer.register_state_dict_post_hook(self._gather),
            optimizer.register_load_state_dict_pre_hook(self._trim),
            optimizer.register_load_state_dict_post_hook(self._check_loaded),
        ]
        self._sharding: Sharding | None = None
        self._loading_local_share = False
        _HOOKS[optimizer] = self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def load_local_share(self, optimizer: torch.optim.Optimizer, share: dict[str, Any]) -> None:
        """Load a state dict already cut to this rank's share, in its own param indices (as
        :func:`muonckpt.load` builds it): torch's ``load_state_dict`` without the trim, the
        loaded share still checked."""
        self._loading_local_share = True
        try:
            optimizer.load_state_dict(share)
        finally:
            self._loading_local_share = False

    def _describe_for_gather(self, optimizer: torch.optim.Optimizer) -> None:
        operation = "state_dict()"
        ranks = self.ranks(optimizer, operation)
        collectives.rendezvous(operation, ranks, {"all_ranks": self.all_ranks}, StateDictError)
        self._sharding = self.describe(optimizer, True)

    def _gather(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any]:
        sharding = self._sharding or self.describe(optimizer, True)
        self._sharding = None
        full_state = gather_full_state(sharding, state_dict["state"], self.all_ranks)
        receives = full_state is not None
        marker = {
            "complete": receives,
            "format_version": FORMAT_VERSION,
            "source_topology": dict(sharding.topology),
            "source_rank": collectives.global_rank(),
        }
        return {
            "state": full_state if receives else {},
            "param_groups": canonical_groups(state_dict["param_groups"], sharding),
            MARKER: marker,
        }

    def _trim(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._loading_local_share:
            return dict(state_dict)
        return trim_state_dict(optimizer, state_dict, self.describe(optimizer, False))

    def _check_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After loading, every region-sharded state tensor must be exactly this rank's share."""
        flat = flat_params(optimizer)
        for param in self.describe(optimizer, False).local():
            if param.local is None:
                continue
            for key, value in optimizer.state.get(flat[param.index_here], {}).items():
                kind = describe_value(param, key, value)["kind"]
                if kind == "tensor" and value.numel() != param.local.numel:
                    raise StateDictError(
                        f"param {param.name!r}: loaded state {key!r} has {value.numel()} "
                        f"elements, this rank's share is {param.local.numel}"
                    )


_HOOKS: weakref.WeakKeyDictionary[torch.optim.Optimizer, StateDictHooks] = (
    weakref.WeakKeyDictionary()
)
"""Each hooked optimizer's hooks, kept beside it rather than as an attribute on it."""


def hooks_of(optimizer: torch.optim.Optimizer) -> StateDictHooks:
    """The muonckpt hooks of ``optimizer``; :class:`StateDictError` if it has none."""
    hooks = _HOOKS.get(optimizer)
    if hooks is None:
        raise StateDictError("optimizer has no muonckpt hooks: use muonckpt.Muon or install_hooks")
    return hooks


def flat_params(optimizer: Any) -> list[torch.Tensor]:
    """The optimizer's params in order over its groups (torch's state-dict indices)."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def canonical_groups(
    local_groups: Sequence[Mapping[str, Any]], sharding: Sharding
) -> list[dict[str, Any]]:
    """This rank's group settings, each listing every param of the grid's group by index."""
    groups = []
    for g, group in enumerate(local_groups):
        members = sharding.members(g)
        out = {**group, "params": members}
        if sharding.named or "param_names" in group:
            out["param_names"] = [sharding.params[i].name for i in members]
        groups.append(out)
    return groups


def check_agreement(sharding: Sharding, owners: Sequence[str] = ()) -> None:
    """Raise :class:`StateDictError` on every rank unless all agree on names and full shapes.

    A collective over ``sharding.participants``, run before any state moves, so a mismatch is
    an error instead of a hang or a scrambled gather. For owner-style sharding, where every
    rank holds every param.
    """
    fingerprint = [[p.name, list(p.full_shape)] for p in sharding.params] + [list(owners)]
    digest = zlib.crc32(repr(fingerprint).encode())

    def agreed(views: list[int]) -> None:
        if len(set(views)) != 1:
            raise StateDictError(
                "ranks disagree about the optimizer's params (names, order, full shapes or "
                "owners): every rank must hold every param, in the same order"
            )

    _steps(sharding.participants, sharding.destination).each_then_root(
        "agree", lambda: digest, agreed
    )


def _steps(ranks: Sequence[int], root: int) -> collectives.CollectiveSteps:
    """The protocol of a state-dict collective: any rank's failure a StateDictError on all."""
    return collectives.CollectiveSteps("state dict", ranks, root, StateDictError)


def gather_full_state(
    sharding: Sharding, local_state: Mapping[int, Mapping[str, Any]], all_ranks: bool = False
) -> dict[int, dict[str, Any]] | None:
    """Every param's full state by canonical index, on the destination (and every rank with
    ``all_ranks``); None elsewhere. ``local_state`` is keyed by this rank's flat param index.

    A collective over ``sharding.participants``. Raises :class:`StateDictError` on every rank
    when a declared owner lacks state another rank holds, or replicated state differs.
    """
    me = collectives.global_rank()
    entries = _gather_entry_metadata(sharding, local_state)
    receives = me == sharding.destination or all_ranks
    full_state: dict[int, dict[str, Any]] = {}
    failures: list[Exception] = []
    for index, param in enumerate(sharding.params):
        spec = entries[index]
        if spec is None:
            continue
        full_state[index] = {}
        for key, info in spec.items():
            value = _gather_value(param, key, info, local_state, sharding, all_ranks, failures)
            if receives:
                full_state[index][key] = value

    def fail_if_failed() -> None:
        if failures:
            raise failures[0]

    _steps(sharding.participants, sharding.destination).each_then_root(
        "state values", fail_if_failed, lambda _: None
    )
    return full_state if receives else None


def _gather_entry_metadata(
    sharding: Sharding, local_state: Mapping[int, Mapping[str, Any]], *, learn: bool = True
) -> list[dict[str, Any] | None]:
    """Every rank learns, per param, the state keys with their kind, dtype and shape (or value);
    with ``learn=False`` only whether they fit the sharding (an empty list).

    Every participant reports the state it holds, owner or not, so that the merge can tell a
    wrong owner rule from a param without state.
    """

    def mine() -> dict[str, Any]:
        described = {}
        for index, param in enumerate(sharding.params):
            entry = local_state.get(param.local_index) if param.local_index is not None else None
            if entry:
                described[str(index)] = {
                    key: describe_value(param, key, v, param.held_numel) for key, v in entry.items()
                }
                if param.replicated:  # the replicas must agree, not only in their keys
                    for key, info in described[str(index)].items():
                        if info["kind"] == "tensor":
                            info["digest"] = replica_digest(entry[key])
        return described

    def merged(reports: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
        entries = merge_entry_reports(sharding, reports)
        return entries if learn else []

    return _steps(sharding.participants, sharding.destination).each_then_root(
        "state keys", mine, merged
    )


def check_state_holders(sharding: Sharding, local_state: Mapping[int, Mapping[str, Any]]) -> None:
    """Raise :class:`StateDictError` on every rank unless the state each rank holds is where
    the sharding says (a declared owner holding none of it: a wrong owner rule). A collective
    over ``sharding.participants``: each rank's metadata to the destination, the verdict back."""
    _gather_entry_metadata(sharding, local_state, learn=False)


def merge_entry_reports(
    sharding: Sharding, reports: Sequence[Mapping[str, Mapping[str, Any]]]
) -> list[dict[str, Any] | None]:
    """Per param, the description of each state key, taken from its sources' reports.

    ``reports`` are the participants' (in order). Raises :class:`StateDictError` naming the
    param and ranks when a source lacks state another rank holds (a wrong owner rule), when
    replicated state differs between ranks, or when sources disagree about a key.
    """
    by_rank = dict(zip(sharding.participants, reports, strict=True))
    merged: list[dict[str, Any] | None] = []
    for index, param in enumerate(sharding.params):
        holders = [r for r in sharding.participants if str(index) in by_rank[r]]
        if not holders:
            merged.append(None)
            continue
        owners = [h.rank for h in param.sources if h.region.numel or len(param.sources) == 1]
        if param.replicated:
            owners = list(sharding.participants)
        # Every rank holds its param's values (a save reports them as PARAM_KEY); only the
        # optimizer's own state tells where the owner rule put the param.
        stateful = [r for r in holders if set(by_rank[r][str(index)]) - {PARAM_KEY}]
        seen = stateful or holders
        lacking = [r for r in owners if r not in seen]
        if lacking:
            raise StateDictError(
                f"param {param.name!r}: rank {seen[0]} holds state for it, but its declared "
                f"owner rank {lacking[0]} holds none: the owner rule does not match where the "
                "optimizer keeps its state"
            )
        for holding in param.sources:
            for key, info in by_rank[holding.rank][str(index)].items():
                if info["kind"] == "tensor" and info["numel"] != holding.region.numel:
                    raise StateDictError(
                        f"param {param.name!r}: state {key!r} holds {info['numel']} elements on "
                        f"rank {holding.rank}, its share of the param {holding.region.numel}"
                    )
        first = by_rank[owners[0]][str(index)]
        expected = _shape_free(first, param.replicated)
        for rank in owners:
            theirs = by_rank[rank][str(index)]
            drifted = [
                key
                for key, info in first.items()
                if key in theirs and info.get("digest") != theirs[key].get("digest")
            ]
            if param.replicated and drifted:
                raise StateDictError(
                    f"param {param.name!r}: state {drifted[0]!r} differs between ranks "
                    f"{owners[0]} and {rank}, whose replicas must be identical (the state of an "
                    "optimizer without hooks in a process group, or of a REPLICATED param): "
                    "the ranks' optimizers did not step alike (a sharded optimizer needs "
                    "muonckpt.install_hooks with its owner rule)"
                )
            differs = _differences(expected, _shape_free(theirs, param.replicated), owners[0], rank)
            if differs:
                raise StateDictError(
                    f"param {param.name!r}: ranks {owners[0]} and {rank} disagree about its "
                    f"state: {'; '.join(differs)}"
                )
        merged.append(dict(first))
    return merged


def _shape_free(entry: Mapping[str, Any], replicated: bool) -> Any:
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


def describe_value(
    param: ParamSharding, key: str, value: Any, numel: int | None = None
) -> dict[str, Any]:
    """How a state value travels: a tensor shaped like the param (sharded with it), a
    ``scalar`` (a 0-d tensor of a param that is not 0-d, such as torch's AdamW ``step``), or a
    plain ``value`` (a number, None). ``numel``: the elements of this rank's param tensor,
    which a state tensor must have (refused otherwise: muonckpt shards state with its param)."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        if value.dim() == 0 and len(param.full_shape) != 0:
            return {"kind": "scalar", "dtype": dtype, "value": value.item()}
        if numel is not None and value.numel() != numel:
            raise StateDictError(
                f"param {param.name!r}: state {key!r} has shape {tuple(value.shape)}, neither "
                "the param's shape nor a 0-d scalar: muonckpt stores only state shaped like "
                "its param (factored state such as Adafactor's is not supported)"
            )
        return {
            "kind": "tensor",
            "dtype": dtype,
            "shape": list(value.shape),
            "numel": value.numel(),
        }
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"kind": "value", "value": value}
    raise StateDictError(
        f"param {param.name!r}: state {key!r} is a {type(value).__name__}, which muonckpt "
        "cannot store (tensors, numbers, strings and None only)"
    )


def value_of(info: Mapping[str, Any]) -> Any:
    """A scalar or plain value back from its description."""
    if info["kind"] == "scalar":
        return torch.tensor(info["value"], dtype=getattr(torch, info["dtype"]), device=HOST)
    return info["value"]


def _gather_value(
    param: ParamSharding,
    key: str,
    info: Mapping[str, Any],
    local_state: Mapping[int, Mapping[str, Any]],
    sharding: Sharding,
    all_ranks: bool,
    failures: list[Exception],
) -> Any:
    """Assemble one full state value in host memory on the destination (and, if asked, on every
    rank). Pieces travel on the process group's device and are copied into the host tensor as
    each arrives.

    Every send and receive the metadata fixed happens even after a failure of this rank's own
    (a full tensor it cannot allocate, a piece it cannot produce): the failure goes to
    ``failures``, zeros travel instead, and the gather's last step raises it on every rank, so
    that no peer waits forever for a transfer that never comes.
    """
    if info["kind"] != "tensor":
        return value_of(info)
    me, dst = collectives.global_rank(), sharding.destination
    dtype = getattr(torch, info["dtype"])
    shape = param.full_shape
    full = _attempt(failures, torch.empty, shape, dtype=dtype, device=HOST) if me == dst else None
    for holding in param.sources:
        if holding.rank == me:
            index = param.index_here  # this rank holds a piece of it
            piece = _attempt(failures, lambda i=index: local_state[i][key].reshape(-1))
            if me != dst:
                collectives.send(_or_zeros(piece, holding.region.numel, dtype), dst)
            elif full is not None and piece is not None:
                _attempt(failures, insert_, full, holding.region, piece)
        elif me == dst:
            piece = collectives.recv((holding.region.numel,), dtype, holding.rank)
            if full is not None:
                _attempt(failures, insert_, full, holding.region, piece)
    if all_ranks:
        if me == dst:
            for rank in sharding.participants:
                if rank != dst:
                    collectives.send(_or_zeros(full, math.prod(shape), dtype).reshape(shape), rank)
        else:
            full = collectives.recv(shape, dtype, dst).to(HOST)
    return full


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


def trim_state_dict(
    optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], sharding: Sharding
) -> dict[str, Any]:
    """A complete state dict, re-keyed to ``optimizer``'s params and cut to this rank's share.

    Params are matched by name, so the source may order its groups' params differently.
    Raises :class:`StateDictError` naming the param on any mismatch.
    """
    marker = state_dict.get(MARKER)
    if isinstance(marker, Mapping) and not marker.get("complete", False):
        raise StateDictError(
            f"this state dict came from rank {marker.get('source_rank')}, which does not hold the "
            "complete state; load the one returned on the destination rank (rank 0 of the "
            "dp x tp grid), or gather with all_ranks=True"
        )
    saved_groups = state_dict.get("param_groups")
    saved_state = state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, Mapping):
        raise StateDictError("not an optimizer state dict: needs 'state' and 'param_groups'")
    new_groups = remap_groups(optimizer, saved_groups, sharding)
    by_name = {
        name: saved_state.get(index)
        for group in saved_groups
        for name, index in zip(_group_names(group), group["params"], strict=True)
    }
    any_state = any(v for v in by_name.values())
    flat = flat_params(optimizer)
    new_state: dict[int, dict[str, Any]] = {}
    for param in sharding.params:
        entry = by_name[param.name]
        if not entry:
            if any_state and param.expected_keys:
                raise StateDictError(f"state dict has no state for param {param.name!r}")
            continue
        if param.local_index is None:
            _check_keys(param, entry)
            continue
        kept = _cut_entry(param, entry, flat[param.local_index])
        if kept is not None:
            new_state[param.local_index] = kept
    return {"state": new_state, "param_groups": new_groups}


def remap_groups(
    optimizer: torch.optim.Optimizer, saved_groups: Sequence[Mapping[str, Any]], sharding: Sharding
) -> list[dict[str, Any]]:
    """Saved groups' settings (step included) laid over ``optimizer``'s groups, matched by name.

    Each group of the grid must hold exactly the params of the saved group at the same
    position; the result lists this rank's own params of each group, in its own indices.
    """
    saved_names = [n for g in saved_groups for n in _group_names(g)]
    _check_names(saved_names, [p.name for p in sharding.params])
    if len(saved_groups) != len(optimizer.param_groups):
        raise StateDictError(
            f"state dict has {len(saved_groups)} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    local_names = {p.local_index: p.name for p in sharding.local()}
    new_groups, start = [], 0
    for g, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups, strict=True)):
        names = [sharding.params[i].name for i in sharding.members(g)]
        if sorted(names) != sorted(_group_names(saved)):
            raise StateDictError(
                f"param group {g} holds {names}, the state dict's group {g} holds "
                f"{_group_names(saved)}"
            )
        settings = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        for key, value in settings.items():
            if isinstance(group.get(key), tuple) and isinstance(value, list):
                settings[key] = tuple(value)
        indices = list(range(start, start + len(group["params"])))
        settings["params"] = indices
        if "param_names" in group:
            settings["param_names"] = [local_names[i] for i in indices]
        new_groups.append(settings)
        start += len(indices)
    return new_groups


def _check_keys(param: ParamSharding, entry: Mapping[str, Any]) -> None:
    missing = [k for k in param.expected_keys if k not in entry]
    if missing:
        raise StateDictError(f"param {param.name!r}: state dict lacks state key(s) {missing}")


def _cut_entry(
    param: ParamSharding, entry: Mapping[str, Any], p: torch.Tensor
) -> dict[str, Any] | None:
    _check_keys(param, entry)
    if param.local is None:
        return None
    kept: dict[str, Any] = {}
    for key, value in entry.items():
        if describe_value(param, key, value)["kind"] != "tensor":
            kept[key] = value
            continue
        if tuple(value.shape) != param.full_shape:
            raise StateDictError(
                f"param {param.name!r}: state {key!r} has shape {tuple(value.shape)}, "
                f"expected the full shape {param.full_shape}"
            )
        piece = extract(value, param.local)
        kept[key] = piece.reshape(p.shape) if piece.numel() == p.numel() else piece
    return kept


def _group_names(group: Mapping[str, Any]) -> list[str]:
    names = group.get("param_names")
    if names is not None:
        return list(names)
    return [str(i) for i in group["params"]]


def _check_names(saved: Sequence[str], current: Sequence[str]) -> None:
    if sorted(saved) == sorted(current) and len(set(current)) == len(current):
        return
    only_saved = sorted(set(saved) - set(current))
    only_current = sorted(set(current) - set(saved))
    raise StateDictError(
        "param names differ between the state dict and the optimizer: "
        f"only in the state dict {only_saved}, only in the optimizer {only_current}"
    )


def param_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of all params in order: ``param_names`` entries, else flat indices as strings."""
    names: list[str] = []
    for group in optimizer.param_groups:
        group_names = group.get("param_names")
        names.extend(
            group_names
            if group_names
            else [str(len(names) + i) for i in range(len(group["params"]))]
        )
    return names


def _named(optimizer: torch.optim.Optimizer) -> bool:
    return any(group.get("param_names") for group in optimizer.param_groups)


def describe_grid(
    optimizer: torch.optim.Optimizer,
    report: Callable[[], RankReport],
    dp_group: collectives.Group,
    tp_group: collectives.Group,
    keys: Callable[[int], tuple[str, ...]],
) -> Sharding:
    """Sharding of a ZeRO-1 + TP optimizer over its whole dp x tp grid, from each rank's
    ``report()`` of the params it holds (in the layout math's terms, :class:`RankReport`).

    The grid's param list is learned once by a collective over the grid
    (:func:`muonckpt.grid.merge_reports`) and kept beside the optimizer in a weak mapping.
    """
    me = collectives.global_rank()
    ranks, grid = _grid_params(optimizer, report, dp_group, tp_group)
    topo = grid.topology
    coords = topo.coords(ranks.index(me))
    params = []
    for gp in grid.params:
        sources = []
        for rank in range(topo.world_size):
            region = gp.owner_region(topo, *topo.coords(rank))
            if region.numel:
                sources.append(Holding(ranks[rank], region))
        local_index = gp.local_index[ranks.index(me)]
        params.append(
            ParamSharding(
                name=gp.name,
                full_shape=gp.full_shape,
                sources=tuple(sources),
                local=gp.region(topo, *coords) if local_index is not None else None,
                held=gp.region(topo, *coords) if local_index is not None else None,
                local_index=local_index,
                group=gp.spec.group,
                expected_keys=keys(gp.spec.group),
                tp_split_dim=gp.spec.tp_split_dim,
                dtype=gp.spec.dtype,
            )
        )
    named = bool(grid.params) and grid.params[0].spec.name is not None
    return Sharding(params, ranks, ranks[0], {"dp": topo.dp, "tp": topo.tp}, named)


_GRIDS: weakref.WeakKeyDictionary[Any, tuple[tuple, list[int], GridParams]] = (
    weakref.WeakKeyDictionary()
)
"""Per distributed optimizer: (its local structure, the grid's global ranks, its params)."""


def _grid_params(
    optimizer: torch.optim.Optimizer,
    report: Callable[[], RankReport],
    dp_group: collectives.Group,
    tp_group: collectives.Group,
) -> tuple[list[int], GridParams]:
    """The grid's global ranks and canonical params (a collective the first time)."""
    flat = flat_params(optimizer)
    structure = (tuple(id(p) for p in flat), len(optimizer.param_groups))
    cached = _GRIDS.get(optimizer)
    if cached is not None and cached[0] == structure:
        return cached[1], cached[2]
    ranks, grid = learn_grid(optimizer, report, dp_group, tp_group)
    _GRIDS[optimizer] = (structure, ranks, grid)
    return ranks, grid


def learn_grid(
    optimizer: torch.optim.Optimizer,
    report: Callable[[], RankReport],
    dp_group: collectives.Group,
    tp_group: collectives.Group,
) -> tuple[list[int], GridParams]:
    """The grid's global ranks (:func:`grid_members`) and canonical params, from every rank's
    ``report()``: a collective over the grid (step ``params``), which fails on every rank when
    they disagree."""
    topo = Topology(collectives.group_size(dp_group), collectives.group_size(tp_group))
    ranks = grid_members(optimizer, dp_group, tp_group)

    def merge(reports: list[dict]) -> dict:
        return merge_reports([RankReport.from_json(r) for r in reports], topo).to_json()

    grid = GridParams.from_json(
        _steps(ranks, ranks[0]).each_then_root("params", lambda: report().to_json(), merge)
    )
    return ranks, grid


_GRID_RANKS: weakref.WeakKeyDictionary[Any, tuple[Any, Any, list[int]]] = (
    weakref.WeakKeyDictionary()
)
"""Per grid optimizer: its DP and TP groups and the grid's global ranks (learned once)."""


def grid_members(
    optimizer: Any,
    dp_group: collectives.Group,
    tp_group: collectives.Group,
    operation: str = "describe the grid",
) -> list[int]:
    """The global ranks of ``optimizer``'s dp x tp grid, indexed ``dp_rank * tp + tp_rank``:
    learned the first time by :func:`muonckpt.collectives.grid_ranks` (the first step of
    ``operation``, bounded), then kept beside the optimizer."""
    cached = _GRID_RANKS.get(optimizer)
    if cached is not None and cached[0] is dp_group and cached[1] is tp_group:
        return cached[2]
    ranks = collectives.grid_ranks(dp_group, tp_group, operation)
    _GRID_RANKS[optimizer] = (dp_group, tp_group, ranks)
    return ranks


def participants(optimizer: Any, operation: str) -> list[int]:
    """The global ranks of ``operation`` (``save``, ``load``, ...) over ``optimizer``, found
    without a collective on the process groups, so that the operation can begin with a
    bounded rendezvous among them (:func:`muonckpt.collectives.rendezvous`): its grid for a
    hooked optimizer, the world for one without hooks in a process group (:func:`describe`)."""
    hooks = _HOOKS.get(optimizer)
    if hooks is not None:
        return hooks.ranks(optimizer, operation)
    return collectives.group_ranks(None)


def named_params(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str | None, int, Any]]:
    """(name, or None for an unnamed optimizer; group index; param) of every param in order."""
    named = _named(optimizer)
    names = param_names(optimizer)
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            yield (names[index] if named else None), g, p
            index += 1


def dtype_name(tensor: torch.Tensor) -> str:
    """A tensor's dtype as the grid reports name it (``float32``)."""
    return str(tensor.dtype).removeprefix("torch.")


def _check_unique(names: Sequence[str]) -> None:
    counts = Counter(names)
    dupes = sorted(n for n, count in counts.items() if count > 1)
    if dupes:
        raise StateDictError(f"duplicate param names {dupes}: names must be unique")


def describe_whole(
    optimizer: torch.optim.Optimizer,
    keys: Callable[[int], tuple[str, ...]] = lambda group: (),
    names: Sequence[str] | None = None,
) -> Sharding:
    """Sharding of a single-process optimizer: every param whole, its state all local."""
    me = collectives.global_rank()
    names = list(names) if names is not None else param_names(optimizer)
    flat = [(p, g) for g, group in enumerate(optimizer.param_groups) for p in group["params"]]
    params = []
    for index, ((p, g), name) in enumerate(zip(flat, names, strict=True)):
        whole = whole_region(p.numel())
        params.append(
            ParamSharding(
                name,
                tuple(p.shape),
                (Holding(me, whole),),
                whole,
                index,
                g,
                keys(g),
                dtype=dtype_name(p),
            )
        )
    _check_unique([p.name for p in params])
    return Sharding(params, [me], me, {"dp": 1, "tp": 1}, _named(optimizer) or names is not None)


def describe(optimizer: torch.optim.Optimizer) -> Sharding:
    """How ``optimizer``'s state is sharded: from its muonckpt hooks (the packaged Muon, or
    :func:`install_hooks`), else, in a single process, every param whole and local.

    A collective over the optimizer's ranks where describing it needs one.
    """
    hooks = _HOOKS.get(optimizer)
    if hooks is not None:
        return hooks.describe(optimizer, True)
    if collectives.is_distributed() and collectives.group_size(None) > 1:
        return describe_replicated(optimizer)
    return describe_whole(optimizer)


def describe_replicated(optimizer: Any) -> Sharding:
    """Sharding of an optimizer without hooks in a process group: a replica on every rank of
    the world (DDP), its state the same everywhere, every param :data:`REPLICATED` (saved
    once, the ranks sharing the writing by :func:`muonckpt.workplan.spread`; loaded whole on
    every rank). A collective over the world: the
    ranks check that they hold the same params (a sharded optimizer such as upstream
    ``muon.Muon`` needs :func:`install_hooks`, and a gather or save checks that the replicas'
    state agrees, see :func:`replica_digest`)."""
    kind = type(optimizer)
    if kind.__module__ == UPSTREAM_MODULE and kind.__name__ in ("Muon", "MuonWithAuxAdam"):
        raise StateDictError(
            f"upstream muon.{type(optimizer).__name__} keeps each Muon param's state on one "
            "rank, not replicated: call muonckpt.install_hooks(optimizer) first"
        )
    world = collectives.group_size(None)
    writers = spread([p.numel() * p.element_size() for p in flat_params(optimizer)], world)
    return _describe_owned(
        optimizer, lambda i, p: REPLICATED, None, None, None, {}, True, writers=writers
    )


UPSTREAM_MODULE = "muon"
"""The module of KellerJordan's Muon (``pip install muon-optimizer``)."""
_UPSTREAM = {"Muon", "MuonWithAuxAdam", "SingleDeviceMuon", "SingleDeviceMuonWithAuxAdam"}


def upstream_owner(optimizer: torch.optim.Optimizer) -> Callable[[int, torch.Tensor], Any] | None:
    """The owner rule of upstream KellerJordan Muon classes, or None for any other optimizer.

    ``Muon`` and ``MuonWithAuxAdam`` give param ``k`` of each Muon group (in the group's own,
    size-sorted order) to rank ``k % world``; every rank runs AdamW on every param of the other
    groups (:data:`REPLICATED`). The single-device classes keep everything on their one rank.
    """
    kind = type(optimizer)
    if kind.__module__ != UPSTREAM_MODULE or kind.__name__ not in _UPSTREAM:
        return None
    if kind.__name__.startswith("SingleDevice"):
        return lambda index, p: 0
    rule: dict[int, Any] = {}
    start = 0
    world = collectives.group_size(None)
    for group in optimizer.param_groups:
        muon = group.get("use_muon", kind.__name__ == "Muon")
        for k in range(len(group["params"])):
            rule[start + k] = k % world if muon else REPLICATED
        start += len(group["params"])
    return lambda index, p: rule[index]


def install_hooks(
    optimizer: torch.optim.Optimizer,
    owner: Callable[[int, torch.Tensor], Any] | None = None,
    *,
    names: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
    group: collectives.Group = None,
    tp_group: collectives.Group = None,
    tp_split_dims: Mapping[str, int] | None = None,
    all_ranks: bool = False,
) -> StateDictHooks:
    """Make ``state_dict()``, :func:`muonckpt.save` and :func:`muonckpt.load` complete for an
    optimizer whose per-param state lives whole on an owner rank.

    After this, ``state_dict()`` (a collective over the ranks) returns on the first rank every
    param's state, and ``load_state_dict()`` of such a dict on any number of ranks keeps on each
    rank only the state of the params it now owns (and all of the replicated state).

    Args:
        optimizer: any torch optimizer; every rank holds every param (its TP shard of it with
            ``tp_group``).
        owner: ``owner(index, param)``: the rank of ``group`` that keeps the state of param
            ``index`` (counted in order over all param groups), or :data:`REPLICATED` when every
            rank keeps it identically. None: the rule of upstream KellerJordan ``muon.Muon``,
            ``muon.MuonWithAuxAdam`` and their single-device classes (see
            :func:`upstream_owner`); other optimizers need an explicit rule.
        names: ``model.named_parameters()`` or a ``{name: param}`` dict, so that checkpoints are
            keyed by name when the optimizer's groups carry no names.
        group: the ranks sharing the work, the DP group with ``tp_group`` (default: the world).
        tp_group: for a tensor-parallel optimizer whose params are TP shards, each owned whole
            by one rank of ``group`` (Megatron-Core's layer-wise layout); full shapes and
            regions follow ``tp_split_dims``.
        tp_split_dims: param name -> dimension split across ``tp_group`` (missing: replicated).
        all_ranks: deliver the complete state dict on every rank instead of the first.

    Raises:
        StateDictError: for an optimizer without a known rule and no ``owner``, or unknown
            names. A rule that does not match where the optimizer keeps its state raises when
            the state is gathered, naming the param, the declared owner and the holder.

    Example:
        >>> hooks = muonckpt.install_hooks(opt)  # upstream muon.MuonWithAuxAdam
        >>> sd = opt.state_dict()            # complete on rank 0
        >>> opt.load_state_dict(sd)          # on any world size: keeps this rank's share
    """
    rule = owner if owner is not None else upstream_owner(optimizer)
    if rule is None:
        raise StateDictError(
            f"install_hooks cannot tell where a {type(optimizer).__name__} keeps its state: "
            "pass owner=lambda index, param: rank (or muonckpt.REPLICATED)"
        )
    given = _names_by_param(optimizer, names)
    splits = dict(tp_split_dims or {})
    unknown = sorted(set(splits) - set(given if given is not None else param_names(optimizer)))
    if unknown:
        raise StateDictError(f"tp_split_dims names params the optimizer does not hold: {unknown}")
    local_only = owner is None and type(optimizer).__name__.startswith("SingleDevice")

    def describe_owners(optimizer: torch.optim.Optimizer, collective: bool) -> Sharding:
        if local_only:
            return describe_whole(optimizer, names=given)
        return _describe_owned(optimizer, rule, given, group, tp_group, splits, collective)

    def ranks(optimizer: torch.optim.Optimizer, operation: str) -> list[int]:
        if local_only:
            return [collectives.global_rank()]
        if tp_group is None:
            return collectives.group_ranks(group)
        return grid_members(optimizer, group, tp_group, operation)

    return StateDictHooks(optimizer, describe_owners, ranks=ranks, all_ranks=all_ranks)


def _names_by_param(
    optimizer: torch.optim.Optimizer,
    names: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None,
) -> list[str] | None:
    """Each flat param's name from ``names``; None to use the optimizer's own names."""
    if names is None:
        return None
    pairs = names.items() if isinstance(names, Mapping) else names
    by_id = {id(p): n for n, p in pairs}
    flat = flat_params(optimizer)
    missing = [i for i, p in enumerate(flat) if id(p) not in by_id]
    if missing:
        raise StateDictError(
            f"names= has no name for the optimizer's param(s) at flat index {missing[:8]} "
            f"(shapes {[tuple(flat[i].shape) for i in missing[:8]]})"
        )
    return [by_id[id(p)] for p in flat]


def _describe_owned(
    optimizer: torch.optim.Optimizer,
    owner: Callable[[int, torch.Tensor], Any],
    names: Sequence[str] | None,
    group: collectives.Group,
    tp_group: collectives.Group,
    splits: Mapping[str, int],
    collective: bool,
    writers: Sequence[int] | None = None,
) -> Sharding:
    """Sharding of an owner-rule optimizer; ``writers``: per param, the DP rank whose copy of
    a replicated param's state is saved (default the first)."""
    me = collectives.global_rank()
    if tp_group is None:
        ranks = collectives.group_ranks(group)
        topo = Topology(len(ranks), 1)
    else:
        ranks = grid_members(optimizer, group, tp_group)
        topo = Topology(collectives.group_size(group), collectives.group_size(tp_group))
    my_dp, my_tp = topo.coords(ranks.index(me))
    names = list(names) if names is not None else param_names(optimizer)
    flat = [(p, g) for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]]
    params, owners = [], []
    for index, ((p, g), name) in enumerate(zip(flat, names, strict=True)):
        split = splits.get(name, -1) if topo.tp > 1 else -1
        full = tp_full_shape(p.shape, split, topo.tp)
        block = math.prod(p.shape)
        tps = range(topo.tp) if split >= 0 else range(1)

        def region(t: int, full: tuple = full, split: int = split, block: int = block) -> Region:
            return tp_region(full, split, topo.tp, t, (0, block))

        rank = owner(index, p)
        replicated = rank is REPLICATED
        dp_owner = (writers[index] if writers else 0) if replicated else int(rank)
        if not 0 <= dp_owner < topo.dp:
            raise StateDictError(f"param {name!r}: owner rank {rank} is outside 0..{topo.dp - 1}")
        owners.append(repr(rank))
        mine = region(my_tp if split >= 0 else 0)
        keeps = replicated or dp_owner == my_dp
        params.append(
            ParamSharding(
                name=name,
                full_shape=full,
                sources=tuple(Holding(ranks[topo.rank(dp_owner, t)], region(t)) for t in tps),
                local=mine if keeps else None,
                local_index=index,
                group=g,
                tp_split_dim=splits.get(name, -1),
                dtype=dtype_name(p),
                held=mine,
                replicated=replicated,
            )
        )
    _check_unique([p.name for p in params])
    sharding = Sharding(
        params, ranks, ranks[0], {"dp": topo.dp, "tp": topo.tp}, _named(optimizer) or bool(names)
    )
    if collective:
        check_agreement(sharding, owners)
    return sharding


def gather_state_dict(
    optimizer: torch.optim.Optimizer, *, all_ranks: bool = False
) -> dict[str, Any]:
    """``optimizer.state_dict()``, delivered to every rank when ``all_ranks`` (a collective)."""
    hooks = hooks_of(optimizer)
    previous, hooks.all_ranks = hooks.all_ranks, all_ranks
    try:
        return optimizer.state_dict()
    finally:
        hooks.all_ranks = previous
