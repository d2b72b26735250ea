"""Load a checkpoint into an optimizer at its own topology: read -> map -> apply.

Every rank opens the checkpoint and agrees with the others that it is one (``open``), plans
how the checkpoint's state maps onto the target (the same optimizer, or another implementation
by :mod:`muonckpt.format.conversion`'s rules), reads and checks only the byte ranges of its own
share (``read``) and hands it to the optimizers (torch's ``load_state_dict``, the trim passed by)
and the stateful values of ``extra`` / ``rank_extra`` to theirs, each of which may refuse; only
when every rank has, copies the loaded values into the tensors kept and the params. A failure
anywhere puts back everything on every rank: all or nothing."""

from __future__ import annotations

import logging
import os
import warnings
from array import array
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .. import storage
from ..distributed import collectives, group_steps
from ..distributed.steps import disagreement
from ..errors import CheckpointError, ConversionWarning, MuonCkptError, StateDictError
from ..format import conversion, kinds
from ..format.manifest import (
    MANIFEST_NAME,
    PARAM_KEY,
    Manifest,
    ParamEntry,
    Rename,
    Scalar,
    prefix_hint,
)
from ..layout.topology import Region, whole_region
from ..optim.sharding import following
from ..state import trainstate
from ..state.arena import ReadArena
from ..state.gather import ScalarValue
from ..state.hooks import load_local_share, remap_groups
from ..state.paramnames import torch_dtype_name
from ..state.placement import (
    Joined,
    Optimizers,
    ParamSharding,
    Sharding,
    describe,
    flat_params,
    optimizers_of,
    participants,
    replica_hint,
)
from .pieces import PieceReader, open_checkpoint


@dataclass
class LoadReport:
    """What :func:`load` did beyond copying bytes (also logged, and warned for settings)."""

    converted: list[str] = field(default_factory=list)
    """Momentum converted between forms, per group: which params, from which form, by what."""
    warnings: list[str] = field(default_factory=list)
    """Target settings that cannot continue the saved trajectory, and what would."""


@dataclass
class _Target:
    """The optimizer(s) to load into, and how the checkpoint's state maps onto them."""

    optimizer: Optimizers
    """One optimizer, or several as one."""
    sharding: Sharding
    groups: list[dict[str, Any]]
    maps: dict[str, kinds.KeyMap] | None
    """Per param name, the key map of a load across implementations; None: same optimizer."""
    steps_in: list[str | None]
    """Per target group, where an AdamW step count goes."""


def load(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    params: bool = True,
    momentum_form: str | None = None,
    rename: Rename | None = None,
    extra: MutableMapping[str, Any] | None = None,
    rank_extra: MutableMapping[str, Any] | None = None,
    local: bool = False,
) -> LoadReport:
    """Load a checkpoint of any kind and source topology into ``optimizer`` at its topology.

    Restores the optimizer state and, by default, the optimizer's params (each rank its own
    share, bitwise): a resumed run needs nothing but the checkpoint. A model whose weights are
    not the optimizer's params (the packaged Muon's shards from
    :func:`muonckpt.optim.sharding.shard_for_groups`) gets them back too: ``load`` then calls
    :meth:`muonckpt.optim.sharding.ShardedParams.params_to_model` itself, on every rank.

    The target may be another Muon implementation than the one that saved, or several
    optimizers that together hold every param (``[torch.optim.Muon(...),
    torch.optim.AdamW(...)]`` for a packaged Muon + AdamW checkpoint). Momentum is then
    converted between sum and EMA form by ``1 - mu`` (:mod:`muonckpt.format.kinds`), AdamW state and
    step counts are mapped as each optimizer keeps them, the target keeps its own settings,
    and settings that cannot continue the saved trajectory are warned about.

    Every rank reads the manifest and then only the bytes of the pieces overlapping its own
    share, verifying their checksums, and holds it until every rank has read (small tensors
    packed together: a tensor object each would cost more than their bytes). State the
    optimizer already has, of the dtype, device and shape torch would give the loaded value,
    keeps its tensors: the checkpoint's values are copied into them, so a rollback inside a
    running job holds no second copy of the state. New small state tensors (a fresh
    optimizer's) view the shared blocks they were read into: ``torch.save`` of one of them
    alone writes its whole block.
    In distributed mode a collective over the grid (for optimizers without hooks in a process
    group, DDP replicas, the world: every rank reads the whole state): a bounded rendezvous
    where the ranks agree on the call and its arguments, then they agree that they opened one
    checkpoint (its resolved directory and manifest) and that every share was read and taken;
    any rank's failure is every rank's.

    All or nothing: a load that fails (damage, a mismatch, a stateful value or an optimizer
    whose ``load_state_dict`` refuses, on any rank) leaves the optimizers, the params and the
    model, and every value of ``extra`` / ``rank_extra`` as they were. Stateful values are
    handed their saved state first (their previous ``state_dict()`` copied to put them back),
    then the optimizers theirs (the state and groups they had kept aside); nothing is written
    into a tensor, a param or a plain value until every rank has taken its share.

    Args:
        optimizer: an optimizer :func:`muonckpt.save` takes, at any topology, or a list of them.
        path: a checkpoint directory.
        params: restore the params too (the default; the checkpoint must hold them). False
            restores the optimizer state only, for weights loaded elsewhere.
        momentum_form: ``"sum"`` or ``"ema"``: the momentum form of a target whose form
            muonckpt does not know (required then), or an override for one it knows.
        rename: the checkpoint's param names as the optimizer has them: prefix replacements
            (``{"module.": ""}`` strips DDP's prefix, ``{"_orig_mod.": ""}`` torch.compile's,
            ``{"": "model."}`` adds one; the longest matching prefix applies) or a function of
            the saved name. Names that differ by a prefix only are refused naming the prefix
            and this fix.
        extra: a dict to fill with the ``extra`` saved with the checkpoint, in place: a
            stateful value in it (an LR scheduler) gets ``load_state_dict`` of its saved
            state, a dict is filled key by key, anything else is replaced, and keys only the
            checkpoint has are added. Every key it holds must be in the checkpoint.
        rank_extra: the same for this rank's ``rank_extra``: the values the rank of the same
            place in the grid saved. Only at the number of ranks that saved (per-rank values
            such as RNG states or data positions do not carry over to another; load without
            it there and derive them afresh, from ``extra``).
        local: the optimizer is this process's alone, not a DDP replica: loaded by this process
            alone, whatever process group is initialized (as :func:`muonckpt.save`'s
            ``local``). Without it an optimizer without hooks in a process group is a replica,
            and every rank of the world must call ``load``.

    Returns:
        A :class:`LoadReport` of the conversions made and the settings warned about.

    Raises:
        CheckpointError: naming the file and param on any damage or mismatch, or the value of
            ``extra`` / ``rank_extra`` whose ``load_state_dict`` refused (and any loaded before
            it that then refused its own previous state too: the one thing a failed load can
            leave changed, named). StateDictError: for a target that cannot take the state,
            naming the optimizer whose ``load_state_dict`` refused it.
    """
    targets = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    joined = targets[0] if len(targets) == 1 else Joined(targets, local=local)
    arguments = {
        "path": os.path.abspath(path),
        "params": params,
        "momentum_form": momentum_form,
        "rename": rename if rename is None or isinstance(rename, Mapping) else _named(rename),
        "extra given": extra is not None,
        "rank_extra given": rank_extra is not None,
    }
    ranks = participants(joined, "load", local=local)
    hint = replica_hint(joined)
    group_steps.rendezvous("load", ranks, arguments, CheckpointError, hint=hint)
    sharding = describe(joined, local=local)  # a collective the first time
    models = following(p for o in targets for p in flat_params(o)) if params else []
    steps = group_steps.CollectiveSteps(
        "load", sharding.participants, sharding.destination, CheckpointError
    )
    opened: list[tuple[Path, Manifest]] = []

    def open_it() -> dict[str, Any]:
        directory, manifest = open_checkpoint(path)
        if rename is not None:
            manifest = manifest.renamed(rename)
        if params and not manifest.has_values:
            raise CheckpointError(
                "the checkpoint holds no param values (saved with params=False, or by format "
                f"version {manifest.format_version}); load it with params=False to restore "
                "the optimizer state only",
                path=directory / MANIFEST_NAME,
            )
        _check_job_state(manifest, directory, extra, rank_extra, len(sharding.participants))
        opened.append((directory, manifest))
        if len(steps.ranks) == 1:
            return {}  # nobody to agree with: no digest of a large manifest
        return {
            "checkpoint": os.path.realpath(directory),
            "manifest": manifest.digest(),
            "models that follow the params": len(models),  # each a collective below
        }

    if len(steps.ranks) > 1:  # (in one process every failure is raised as it is)
        steps.each_then_root("open", open_it, lambda opened: _agreed_load(opened, steps.ranks))
    else:
        open_it()
    report = LoadReport()
    me = sharding.participants.index(collectives.global_rank())
    undo: list[Callable[[], list[str]]] = []  # what puts back what the read step changed
    taken: list[tuple[_Taken, trainstate.Restore]] = []

    def read_share() -> None:
        # Taken, not kept: once the share is read nothing holds the manifest, and the state
        # the load makes (into a fresh optimizer) takes its place in memory instead of adding
        # to it.
        directory, manifest = opened.pop()
        _check_prefix(manifest, sharding, directory)
        plan = _plan(joined, sharding, manifest, momentum_form, report)
        _check_covered(manifest, plan, directory)
        with PieceReader(directory, manifest) as reader:
            share = _read(plan, manifest, reader, params, directory)
            asked = _read_job_state(manifest, reader, extra, rank_extra, me)
        # What may refuse happens inside the step, so that a refusal on any rank fails every
        # rank, each putting back what it changed: the job's stateful values first, then the
        # optimizers take their share (no tensor of theirs written into yet).
        restore = trainstate.Restore(asked)
        undo.append(restore.put_back)
        restore.load_objects()
        state = _Taken(plan, share)
        undo.append(state.put_back)
        state.take()
        taken.append((state, restore))

    try:
        if len(steps.ranks) > 1:
            steps.each_then_root("read", read_share, lambda _: None)  # all or none change
        else:
            read_share()
    except BaseException as exc:
        _put_back(undo, exc)
        raise
    ((state, restore),) = taken
    state.finish()  # from here on nothing can refuse
    restore.assign()
    for sharded in models:  # the model's weights from the loaded shards: never forgotten
        sharded.params_to_model()
    for message in report.converted:
        _LOG.info("muonckpt.load: converted %s", message)
    for message in report.warnings:
        warnings.warn(message, ConversionWarning, stacklevel=2)
    return report


_LOG = logging.getLogger("muonckpt")


def _named(function: Callable[..., Any]) -> str:
    """A function as the ranks of one call can compare it (its qualified name)."""
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', '?')}"


def _check_job_state(
    manifest: Manifest,
    directory: Path,
    extra: Mapping[str, Any] | None,
    rank_extra: Mapping[str, Any] | None,
    world: int,
) -> None:
    """A load that asks for the job's own state must find it, ``rank_extra`` at the number of
    ranks that saved it."""
    saved = manifest.extra
    where = directory / MANIFEST_NAME
    if extra is not None and (saved is None or saved.shared is None):
        raise CheckpointError(
            "the checkpoint holds no extra (saved without extra=); load it without extra=",
            path=where,
        )
    if rank_extra is None:
        return
    if saved is None or not saved.ranks:
        raise CheckpointError(
            "the checkpoint holds no rank_extra (saved without rank_extra=); load it "
            "without rank_extra=",
            path=where,
        )
    if len(saved.ranks) != world:
        raise CheckpointError(
            f"rank_extra was saved by {len(saved.ranks)} ranks and this load has {world}: "
            "per-rank values (RNG states, data positions) do not carry over to another number "
            "of ranks; load without rank_extra= and derive them afresh (from extra=)",
            path=where,
        )


def _read_job_state(
    manifest: Manifest,
    reader: PieceReader,
    extra: MutableMapping[str, Any] | None,
    rank_extra: MutableMapping[str, Any] | None,
    rank: int,
) -> list[tuple[str, MutableMapping[str, Any], dict[str, Any]]]:
    """(name, target, saved tree) of what the load asks for, its tensors read and verified, every
    asked-for key checked present: nothing changes yet."""
    out: list[tuple[str, MutableMapping[str, Any], dict[str, Any]]] = []
    saved = manifest.extra
    if saved is None:  # (asked for nothing: a load that asks needs it, checked when opened)
        return out
    asked = [("extra", extra, saved.shared)]
    if rank_extra is not None:
        asked.append((f"rank_extra[{rank}]", rank_extra, saved.ranks[rank]))
    for what, target, tree in asked:
        if target is None or tree is None:
            continue
        tensors = {
            t.path: storage.tensor_of_bytes(reader.read_extra(t, what), t.dtype).reshape(t.shape)
            for t in tree.tensors
        }
        saved = trainstate.rebuild(tree.values, tensors)
        lacking = trainstate.missing(target, saved, what)
        if lacking:
            raise CheckpointError(
                f"the checkpoint's {what} does not hold what the load asks for: "
                f"{'; '.join(lacking[:8])}",
                path=reader.directory / MANIFEST_NAME,
            )
        out.append((what, target, saved))
    return out


def _agreed_load(arguments: list[dict[str, Any]], ranks: Sequence[int]) -> None:
    """(the root of a load) Every rank opened the same checkpoint, the same manifest, and was
    asked the same: a mix of checkpoints never loads."""
    differ = disagreement(arguments, ranks)
    if differ is not None:
        raise CheckpointError(
            f"the ranks of one load disagree on {differ}: a load reads one checkpoint on every "
            "rank (a path re-pointed or replaced while they opened it, or different paths?)"
        )


def _check_prefix(manifest: Manifest, sharding: Sharding, directory: Path) -> None:
    """Names that differ by a wrapper's prefix (DDP's ``module.``, torch.compile's
    ``_orig_mod.``) are refused naming the prefix and the ``rename`` that maps them."""
    hint = prefix_hint((e.name for e in manifest.params), (p.name for p in sharding.params))
    if hint is not None:
        raise CheckpointError(hint, path=directory / MANIFEST_NAME)


def _plan(
    optimizer: Optimizers,
    sharding: Sharding,
    manifest: Manifest,
    momentum_form: str | None,
    report: LoadReport,
) -> _Target:
    """How the checkpoint's state maps onto ``optimizer``: name for name into the same
    optimizer, else by :mod:`muonckpt.format.conversion`'s rules (its notes go to ``report``)."""
    source = [
        kinds.GroupKind.from_json(g.optimizer) if g.optimizer else None for g in manifest.groups
    ]
    target = conversion.group_kinds(optimizers_of(optimizer))
    steps_in = [k.step_in for k in target]
    if not conversion.needs_mapping(source, target, momentum_form):
        groups = remap_groups(optimizer, _torch_groups(manifest), sharding)
        return _Target(optimizer, sharding, groups, None, steps_in)
    mapping = conversion.load_mapping(
        manifest, source, target, ((p.name, p.group) for p in sharding.params), momentum_form
    )
    report.converted += mapping.converted
    report.warnings += mapping.warnings
    groups = _own_groups(optimizer, target, sharding, manifest)
    return _Target(optimizer, sharding, groups, mapping.maps, steps_in)


def _own_groups(
    optimizer: Optimizers,
    computed: Sequence[kinds.GroupKind],
    sharding: Sharding,
    manifest: Manifest,
) -> list[dict[str, Any]]:
    """The target's own group settings in local indices; a group that counts steps itself (the
    packaged AdamW) takes the checkpoint's count."""
    groups, start = [], 0
    for g, (group, computes) in enumerate(zip(optimizer.param_groups, computed, strict=True)):
        settings = {k: v for k, v in group.items() if k != "params"}
        settings["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        names = (p.name for p in sharding.params if p.group == g)
        step = conversion.group_step(manifest, names, computes.step_in, counts="step" in group)
        if step is not None:
            settings["step"] = step
        groups.append(settings)
    return groups


def _check_covered(manifest: Manifest, plan: _Target, directory: Path) -> None:
    """Loading across optimizers, every checkpoint param must land in exactly one of them."""
    if plan.maps is None:
        return  # the same optimizer: remap_groups has matched every name
    names = [p.name for p in plan.sharding.params]
    missing = sorted({e.name for e in manifest.params} - set(names))
    if missing:
        raise CheckpointError(
            f"the optimizers must together hold every param of the checkpoint: held by none "
            f"{missing[:8]}",
            path=directory / MANIFEST_NAME,
        )


class _Staged(NamedTuple):
    """One param's state as read, in the target's keys: tensors in consecutive arena slots."""

    position: int
    """The param's index in the target's flat param order."""
    tensors: tuple[tuple[str, str], ...]
    """(state key, safetensors dtype) of each tensor, the first in slot ``first``."""
    first: int
    scalars: Mapping[str, Scalar]


@dataclass
class _Share:
    """This rank's share as read and checked, nothing applied: its bytes in one arena (a tensor
    each, held until every rank has read, would cost more than the state itself)."""

    arena: ReadArena
    """The state's bytes: a fresh optimizer's new state tensors view its blocks."""
    state: list[_Staged]
    values: array
    """Pairs (flat index, slot of ``value_bytes``) of the params' own values."""
    value_bytes: ReadArena = field(default_factory=ReadArena)
    """The params' own values, apart from the state's blocks: once copied into the params,
    nothing keeps them."""


def _read(
    plan: _Target, manifest: Manifest, reader: PieceReader, params: bool, directory: Path
) -> _Share:
    """This rank's share of the state (in the target's keys) and of its params' values."""
    grouped = manifest.pieces_of()
    share = _Share(ReadArena(), [], array("q"))

    def read(entry: ParamEntry, key: str, region: Region, arena: ReadArena = share.arena) -> int:
        slot, out = arena.reserve(region.numel * storage.itemsize(entry.dtype_of(key)))
        reader.gather(grouped[entry.name, key], entry, key, region, out)
        return slot

    flat = flat_params(plan.optimizer)
    layouts: dict[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]] = {}  # one each
    checked: set[Scalar] = set()  # scalars that make the optimizer's value
    for param in plan.sharding.params:
        entry = manifest.param(param.name)
        _check_param(entry, param, directory)
        if param.local_index is None:
            continue
        p = flat[param.index_here]
        if param.local is not None and (entry.state_keys or entry.scalars):
            _check_share(param, param.local, p)
            if plan.maps is None:
                tensors = tuple((k, entry.dtype_of(k)) for k in entry.state_keys)
                first = len(share.arena)
                for key in entry.state_keys:
                    read(entry, key, param.local)
                scalars = entry.scalars
            else:
                tensors, first, scalars = _mapped(plan, param, entry, manifest, read, share.arena)
            if tensors not in layouts:  # a dtype this torch lacks fails before any change
                layouts[tensors] = tensors
                for _, dtype in tensors:
                    storage.torch_dtype(dtype)
            for scalar in scalars.values():
                if scalar not in checked:
                    _scalar_value(scalar)
                    checked.add(scalar)
            share.state.append(_Staged(param.local_index, layouts[tensors], first, scalars))
        if params:
            held = param.held or whole_region(entry.numel)
            _check_value(entry, held, p, directory)
            share.values.extend(
                (param.local_index, read(entry, PARAM_KEY, held, share.value_bytes))
            )
    share.arena.trim()
    return share


def _mapped(
    plan: _Target,
    param: ParamSharding,
    entry: ParamEntry,
    manifest: Manifest,
    read: Callable[[ParamEntry, str, Region], int],
    arena: ReadArena,
) -> tuple[tuple[tuple[str, str], ...], int, Mapping[str, Scalar]]:
    """A param's state in the target's keys and forms: (key, dtype) per tensor read, the first
    tensor's slot, and the step scalar."""
    assert plan.maps is not None  # (a load across implementations)
    key_map = plan.maps[param.name]
    tensors, first = [], len(arena)
    for key, (source_key, factor) in key_map.keys.items():
        if source_key in entry.state_keys:
            dtype = entry.dtype_of(source_key)
            slot = read(entry, source_key, param.region_here)
            if factor != 1.0:
                numel = (param.region_here.numel,)
                arena.tensor(slot, storage.torch_dtype(dtype), numel).mul_(factor)
            tensors.append((key, dtype))
    step = conversion.step_scalar(plan.steps_in[param.group], manifest.step_of(entry))
    scalars = {"step": step} if key_map.step and tensors and step is not None else {}
    return tuple(tensors), first, scalars


class _Indices(list):
    """A group's param indices for ``load_state_dict``: torch asks ``index in group["params"]``
    once per state value, which on a plain list makes a load quadratic in the params."""

    def __init__(self, indices: Iterable[int]) -> None:
        super().__init__(indices)
        self._members = frozenset(self)

    def __contains__(self, index: object) -> bool:
        return index in self._members


class _Taken:
    """The optimizers' share handed to their ``load_state_dict`` (:meth:`take`, which may
    refuse, and writes into no tensor of theirs), then the loaded values copied into the
    tensors they kept and into the params (:meth:`finish`, which cannot fail). Until then
    :meth:`put_back` gives each optimizer back the ``state`` and groups it had: torch's
    ``load_state_dict`` makes new ones and leaves the old as they were.

    A state tensor the optimizer already has, which torch would replace by one of the same
    dtype, device and shape, is handed back to torch and the loaded values copied into it once
    every optimizer took its share: a load into an optimizer that has state (a rollback in a
    running job) holds no second copy of it, on the host or the device."""

    def __init__(self, plan: _Target, share: _Share) -> None:
        self.plan, self.share = plan, share
        self.params = flat_params(plan.optimizer)
        self.before: list[tuple[torch.optim.Optimizer, Any, Any]] = []
        """(optimizer, its state, its param groups) as they were, for each one asked so far."""
        self.copies: list[tuple[torch.Tensor, int, torch.dtype]] = []
        """(a state tensor the optimizer kept, the arena slot of its loaded values, dtype)."""

    def take(self) -> None:
        """Hand each optimizer its share (in its own indices); a refusal is raised as a
        :class:`StateDictError` naming the optimizer."""
        owners = optimizers_of(self.plan.optimizer)
        arena, reused = self.share.arena, bytearray(len(self.share.arena))
        seen: set[int] = set()  # ids of the tensors copied into: each gets one param's values
        first_group = first_param = 0
        for number, optimizer in enumerate(owners):
            groups = self.plan.groups[first_group : first_group + len(optimizer.param_groups)]
            count = sum(len(g["params"]) for g in optimizer.param_groups)
            flat = self.params[first_param : first_param + count]
            mine = [s for s in self.share.state if first_param <= s.position < first_param + count]
            state: dict[int, dict[str, Any]] = {}
            for staged in mine:
                p = flat[staged.position - first_param]
                had = optimizer.state.get(p, {})
                values: dict[str, Any] = {}
                for slot, (key, dtype) in enumerate(staged.tensors, staged.first):
                    if _reusable(had.get(key), p, key) and id(had[key]) not in seen:
                        values[key], reused[slot] = had[key], 1
                        seen.add(id(had[key]))
                    else:
                        values[key] = arena.tensor(slot, storage.torch_dtype(dtype), p.shape)
                values.update({k: _scalar_value(v) for k, v in staged.scalars.items()})
                state[staged.position - first_param] = values
            share_dict = {
                "state": state,
                "param_groups": [
                    {**g, "params": _Indices(i - first_param for i in g["params"])} for g in groups
                ],
            }
            self.before.append((optimizer, optimizer.state, optimizer.param_groups))
            try:
                load_local_share(optimizer, share_dict)
            except MuonCkptError:
                raise
            except Exception as exc:
                which = type(optimizer).__name__
                if len(owners) > 1:
                    which = f"optimizer {number} ({which})"
                raise StateDictError(
                    f"{which}: its load_state_dict refused the checkpoint's state "
                    f"({trainstate.said(exc)})"
                ) from exc
            del state, share_dict
            for staged in mine:
                p = flat[staged.position - first_param]
                for slot, (key, dtype) in enumerate(staged.tensors, staged.first):
                    if reused[slot]:
                        kept = _kept(optimizer, p, key)
                        self.copies.append((kept, slot, storage.torch_dtype(dtype)))
            first_group += len(optimizer.param_groups)
            first_param += count

    def finish(self) -> None:
        """The loaded values into the state tensors the optimizers kept, then into the params."""
        self.before = []  # the old state goes: nothing holds it now
        share = self.share
        with torch.no_grad():
            for kept, slot, dtype in self.copies:
                kept.copy_(share.arena.tensor(slot, dtype, kept.shape))
            for index, slot in zip(share.values[::2], share.values[1::2], strict=True):
                p = self.params[index]
                p.copy_(share.value_bytes.tensor(slot, p.dtype, p.shape))
        self.copies = []

    def put_back(self) -> list[str]:
        """Each optimizer asked so far back to the state and groups it had (always possible:
        no tensor of theirs was written into); nothing is left changed."""
        for optimizer, state, groups in reversed(self.before):
            optimizer.state, optimizer.param_groups = state, groups
        self.before, self.copies = [], []
        return []


def _put_back(undo: Sequence[Callable[[], list[str]]], failure: BaseException) -> None:
    """After a failed read step: everything it changed put back, last first. What could not
    be (a stateful value that refuses its own previous state) is named in a
    :class:`CheckpointError` raised from ``failure``."""
    left = [message for put_back in reversed(undo) for message in put_back()]
    if not left:
        return
    if isinstance(failure, Exception):
        raise CheckpointError(f"{failure}; {'; '.join(left)}") from failure
    _LOG.error("muonckpt.load was interrupted, and %s", "; ".join(left))


def _kept(optimizer: torch.optim.Optimizer, p: torch.Tensor, key: str) -> torch.Tensor:
    """The tensor ``optimizer`` keeps for state ``key`` of ``p`` after its ``load_state_dict``
    took its own tensor back (or, in an override, whatever it made of it)."""
    kept = optimizer.state.get(p, {}).get(key)
    if not isinstance(kept, torch.Tensor) or kept.shape != p.shape:
        raise StateDictError(
            f"{type(optimizer).__name__}.load_state_dict dropped or reshaped state {key!r} "
            "of a param that had it"
        )
    return kept


def _reusable(had: Any, p: torch.Tensor, key: str) -> bool:
    """Whether ``had``, the optimizer's own value of state ``key`` of ``p``, has the dtype,
    device and shape torch's ``load_state_dict`` gives a loaded value (the param's, for a
    floating param; a step count is kept as loaded, and so never reused)."""
    return (
        key != "step"
        and isinstance(had, torch.Tensor)
        and p.is_floating_point()
        and had.dtype == p.dtype
        and had.device == p.device
        and had.shape == p.shape
    )


def _scalar_value(scalar: Scalar) -> Any:
    """A stored scalar as the optimizer had it: a 0-d tensor of its dtype, or the number."""
    if scalar.dtype is None:
        return scalar.value
    dtype = torch_dtype_name(storage.torch_dtype(scalar.dtype))
    return ScalarValue(scalar.value, dtype).as_state()


def _check_value(entry: ParamEntry, held: Region, p: torch.Tensor, directory: Path) -> None:
    """The saved values fit the optimizer's param: its dtype, this rank's elements of it."""
    dtype = storage.torch_dtype(entry.dtype_of(PARAM_KEY))
    if dtype != p.dtype or held.numel != p.numel():
        raise CheckpointError(
            f"saved values are {dtype} x {held.numel} elements here, the optimizer's "
            f"param {p.dtype} x {p.numel()}",
            path=directory / MANIFEST_NAME,
            param=entry.name,
        )


def _check_share(param: ParamSharding, region: Region, p: torch.Tensor) -> None:
    """This rank's share of a param's state has the elements of its tensor here."""
    if region.numel != p.numel():
        raise StateDictError(
            f"param {param.name!r}: this rank's share of its state is {region.numel} "
            f"elements, its tensor here {p.numel()}"
        )


def _torch_groups(manifest: Manifest) -> list[dict[str, Any]]:
    return [
        {**g.hyperparams, "param_names": list(g.params), "params": list(g.params)}
        for g in manifest.groups
    ]


def _check_param(entry: ParamEntry, param: ParamSharding, directory: Path) -> None:
    if param.full_shape is not None and tuple(entry.shape) != tuple(param.full_shape):
        raise CheckpointError(
            f"checkpoint shape {entry.shape} differs from the optimizer's full shape "
            f"{tuple(param.full_shape)}",
            path=directory / MANIFEST_NAME,
            param=param.name,
        )
    missing = [k for k in param.expected_keys if entry.state_keys and k not in entry.state_keys]
    if missing:
        raise CheckpointError(
            f"checkpoint lacks state key(s) {missing}",
            path=directory / MANIFEST_NAME,
            param=param.name,
        )
