"""(internal) A load's share handed to the optimizers: :class:`Target` (how the checkpoint maps
onto them), :class:`Share` (this rank's share as read, nothing applied) and :class:`Taken`
(handed to their ``load_state_dict``, which may refuse; then applied, which cannot fail; or put
back), for :func:`muonckpt.checkpoint.loading.load`."""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .. import storage
from ..distributed.collectives import one_line
from ..errors import CheckpointError, MuonCkptError, StateDictError
from ..format import kinds
from ..format.manifest import Scalar
from ..state.arena import ReadArena
from ..state.describers import flat_params
from ..state.hooks import load_local_share
from ..state.paramnames import torch_dtype_name
from ..state.placement import Optimizers, optimizers_of
from ..state.sharding_model import Sharding
from ..state.values import ScalarValue

_LOG = logging.getLogger("muonckpt")


@dataclass
class Target:
    """The optimizer(s) to load into, and how the checkpoint's state maps onto them."""

    optimizer: Optimizers
    """One optimizer, or several as one."""
    sharding: Sharding
    groups: list[dict[str, Any]]
    maps: dict[str, kinds.KeyMap] | None
    """Per param name, the key map of a load across implementations; None: same optimizer."""
    steps_in: list[str | None]
    """Per target group, where an AdamW step count goes."""


class Staged(NamedTuple):
    """One param's state as read, in the target's keys: tensors in consecutive arena slots."""

    position: int
    """The param's index in the target's flat param order."""
    tensors: tuple[tuple[str, str], ...]
    """(state key, safetensors dtype) of each tensor, the first in slot ``first``."""
    first: int
    scalars: Mapping[str, Scalar]
    shapes: Mapping[str, tuple[int, ...]] = {}
    """The shape of each tensor not shaped like the param's tensor here, by key."""
    own_dtypes: frozenset[str] = frozenset()
    """The tensors the optimizer kept in another dtype than the param's (its saved values'),
    which keep theirs (an fp32 momentum of a bf16 param); the others follow the param's dtype
    as torch's ``load_state_dict`` casts them (a run resumed at another precision)."""


@dataclass
class Share:
    """This rank's share as read and checked, nothing applied: its bytes in one arena (a tensor
    each, held until every rank has read, would cost more than the state itself)."""

    arena: ReadArena
    """The state's bytes: a fresh optimizer's new state tensors view its blocks."""
    state: list[Staged]
    values: array[int]
    """Pairs (flat index, slot of ``value_bytes``) of the params' own values."""
    value_bytes: ReadArena = field(default_factory=ReadArena)
    """The params' own values, apart from the state's blocks: once copied into the params,
    nothing keeps them."""

    @property
    def nbytes(self) -> int:
        """The bytes read: the state's and the params' values."""
        return self.arena.nbytes + self.value_bytes.nbytes


class _Indices(list[int]):
    """A group's param indices for ``load_state_dict``: torch asks ``index in group["params"]``
    once per state value, which on a plain list makes a load quadratic in the params."""

    def __init__(self, indices: Iterable[int]) -> None:
        super().__init__(indices)
        self._members = frozenset(self)

    def __contains__(self, index: object) -> bool:
        return index in self._members


class Taken:
    """The optimizers' share handed to their ``load_state_dict`` (:meth:`take`, which may
    refuse, and writes into no tensor of theirs), then the loaded values copied into the
    tensors they kept and into the params (:meth:`finish`, which cannot fail). Until then
    :meth:`put_back` gives each optimizer back the ``state`` and groups it had: torch's
    ``load_state_dict`` makes new ones and leaves the old as they were.

    A state tensor the optimizer already has, which torch would replace by one of the same
    dtype, device and shape, is handed back to torch and the loaded values copied into it once
    every optimizer took its share: a load into an optimizer that has state (a rollback in a
    running job) holds no second copy of it, on the host or the device."""

    def __init__(self, plan: Target, share: Share) -> None:
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
        reused = bytearray(len(self.share.arena))
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
                values = _staged_values(staged, p, had, self.share.arena, reused, seen)
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
                    f"{which}: its load_state_dict refused the checkpoint's state ({one_line(exc)})"
                ) from exc
            del state, share_dict
            for staged in mine:
                self._kept_tensors(optimizer, flat[staged.position - first_param], staged, reused)
            first_group += len(optimizer.param_groups)
            first_param += count

    def _kept_tensors(
        self, optimizer: torch.optim.Optimizer, p: torch.Tensor, staged: Staged, reused: bytearray
    ) -> None:
        """After ``optimizer`` took ``staged``: each tensor of its own it kept, to be copied
        into (:meth:`finish`); each of :attr:`Staged.own_dtypes` it took cast to the param's
        dtype (torch's ``load_state_dict`` casts a floating param's state so) in its stored
        dtype again, as the optimizer had it (an fp32 momentum of a bf16 param)."""
        for slot, (key, stored) in enumerate(staged.tensors, staged.first):
            dtype, shape = storage.torch_dtype(stored), staged.shapes.get(key, p.shape)
            if reused[slot]:
                self.copies.append((_kept(optimizer, p, key, shape), slot, dtype))
                continue
            kept = optimizer.state.get(p, {}).get(key)
            cast = isinstance(kept, torch.Tensor) and kept.dtype != dtype
            if cast and key in staged.own_dtypes:
                own = self.share.arena.tensor(slot, dtype, shape)
                optimizer.state[p][key] = own.to(device=kept.device)

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


def put_back(undo: Sequence[Callable[[], list[str]]], failure: BaseException) -> None:
    """After a failed read step: everything it changed put back, last first. What could not
    be (a stateful value that refuses its own previous state) is named in a
    :class:`CheckpointError` raised from ``failure``."""
    left = [message for put_back in reversed(undo) for message in put_back()]
    if not left:
        return
    if isinstance(failure, Exception):
        raise CheckpointError(f"{failure}; {'; '.join(left)}") from failure
    _LOG.error("muonckpt.load was interrupted, and %s", "; ".join(left))


def _staged_values(
    staged: Staged,
    p: torch.Tensor,
    had: Mapping[str, Any],
    arena: ReadArena,
    reused: bytearray,
    seen: set[int],
) -> dict[str, Any]:
    """A param's state as its optimizer takes it: each tensor the optimizer's own where it can
    be reused (marked in ``reused``, its id in ``seen``: each gets one param's values), else
    a view of the arena, at its shape (always for a tensor kept in its own dtype, which
    :meth:`Taken._kept_tensors` gives back in that dtype); its scalars as the optimizer had
    them."""
    values: dict[str, Any] = {}
    for slot, (key, dtype) in enumerate(staged.tensors, staged.first):
        shape = staged.shapes.get(key, p.shape)
        reusable = key not in staged.own_dtypes and _reusable(had.get(key), p, key, shape)
        if reusable and id(had[key]) not in seen:
            values[key], reused[slot] = had[key], 1
            seen.add(id(had[key]))
        else:
            values[key] = arena.tensor(slot, storage.torch_dtype(dtype), shape)
    values.update({k: scalar_value(v) for k, v in staged.scalars.items()})
    return values


def _kept(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, key: str, shape: Sequence[int]
) -> torch.Tensor:
    """The tensor ``optimizer`` keeps for state ``key`` (of ``shape``) of ``p`` after its
    ``load_state_dict`` took its own tensor back (or, in an override, whatever it made of it)."""
    kept = optimizer.state.get(p, {}).get(key)
    if not isinstance(kept, torch.Tensor) or kept.shape != tuple(shape):
        raise StateDictError(
            f"{type(optimizer).__name__}.load_state_dict dropped or reshaped state {key!r} "
            "of a param that had it"
        )
    return kept


def _reusable(had: Any, p: torch.Tensor, key: str, shape: Sequence[int]) -> bool:
    """Whether ``had``, the optimizer's own value of state ``key`` of ``p``, has the dtype,
    device and shape (``shape``) torch's ``load_state_dict`` gives a loaded value (the
    param's dtype, for a floating param; a step count is kept as loaded, and so never
    reused)."""
    return (
        key != "step"
        and isinstance(had, torch.Tensor)
        and p.is_floating_point()
        and had.dtype == p.dtype
        and had.device == p.device
        and had.shape == tuple(shape)
    )


def scalar_value(scalar: Scalar) -> Any:
    """A stored scalar as the optimizer had it: a 0-d tensor of its dtype, or the number."""
    if scalar.dtype is None:
        return scalar.value
    dtype = torch_dtype_name(storage.torch_dtype(scalar.dtype))
    return ScalarValue(scalar.value, dtype).as_state()
