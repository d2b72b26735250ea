"""What the readers of accelerate and Lightning share: torch optimizers' ``state_dict()``\\ s
(torch.optim.Muon and torch.optim.AdamW, state keyed by param index) beside the model's
tensors (keyed by name), written as a consolidated muonckpt checkpoint keyed by the model's
names.

Which index is which param is never guessed. In this order (:func:`_names`):

1. the names the user gives (``names``: per optimizer, its params' names in index order);
2. ``param_names`` (an optimizer built from ``named_parameters()`` pairs saves them);
3. the model's own order: the unnamed params, in index order, are the model's remaining
   tensors one for one, shapes equal (one optimizer over ``model.parameters()`` of a model
   without buffers), where the model file keeps the model's order (Lightning's ``state_dict``;
   not ``model.safetensors``, whose header sorts the names);
4. the shapes: each unnamed param's shape is that of exactly one remaining model tensor and
   of no other unnamed param.

Given names that miss the model's by one prefix (``w1.weight`` for ``model.w1.weight``, or
``module.w1.weight`` for ``w1.weight``) take the one prefix that makes them all the model's.
Anything else is refused naming the file and what is ambiguous.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, StateDictError
from ..files.progress import Progress
from ..format import kinds
from ..format.conversion import converted_manifest
from ..format.manifest import (
    CONSOLIDATED,
    GroupEntry,
    Manifest,
    ParamEntry,
    Scalar,
    json_safe,
    model_tensor,
    tuple_paths,
)
from ..format.names import PARAM_KEY
from ..storage import torch_pickles
from ..storage.dtypes import dtype_name
from ..storage.foreign_limits import read_json
from ._consolidated import consolidated, conversion_notes, write_consolidated
from ._fields import listed_state, step_count, tensor
from ._trainer_state import TrainerState

MUON_SETTINGS = frozenset({"momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn"})
"""Settings every torch.optim.Muon group holds (its ``state_dict()`` does not name its class)."""
ADAMW_SETTINGS = frozenset({"betas", "eps", "amsgrad"})
"""Settings every torch.optim.AdamW (and Adam) group holds."""
STATE_KEYS = {
    "muon": {"momentum_buffer"},
    "adamw": {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"},
}
TORCH = kinds.DCP_FAMILIES["torch"]
HOLDS = "a file of accelerate or Lightning holds tensors, containers, numbers and strings only"


@dataclass(frozen=True)
class TrainerReadOptions:
    """The options of accelerate's and Lightning's readers as ``convert`` passes them:
    ``names`` (``--names``), a JSON file of each optimizer's params' names."""

    names: Path | None = None


@dataclass(frozen=True)
class OptimizerState:
    """One optimizer's ``state_dict()`` as the trainer saved it."""

    label: str
    """How messages call it: ``optimizer_1.bin``, ``optimizer_states[1]``."""
    path: Path
    """The file holding it (what a refusal names)."""
    state_dict: Any


@dataclass(frozen=True)
class ModelState:
    """The model's tensors as the trainer saved them."""

    tensors: dict[str, Any]
    """By name, in the file's order."""
    ordered: bool
    """Whether that order is the model's own (``named_parameters()``'s, buffers among them)."""


@dataclass
class _Param:
    """One index of one optimizer."""

    opt: int
    index: int
    group: int
    role: str
    state: dict[str, Any]
    saved_name: str | None
    shape: tuple[int, ...] | None
    """Its state tensors' shape; None: no state tensor (never stepped)."""


def _fail(message: str, optimizer: OptimizerState) -> CheckpointError:
    return CheckpointError(f"{optimizer.label}: {message}", path=optimizer.path)


def _role(settings: Mapping[str, Any], g: int, optimizer: OptimizerState) -> str:
    """``muon`` (torch.optim.Muon's settings) or ``adamw`` (AdamW's), else refused."""
    if "use_muon" not in settings and set(settings) >= MUON_SETTINGS:
        return "muon"
    if "use_muon" not in settings and set(settings) >= ADAMW_SETTINGS:
        return "adamw"
    shown = sorted(k for k in settings if k not in ("params", "param_names"))
    raise _fail(
        f"param_groups[{g}] has the settings {shown}: neither torch.optim.Muon's nor "
        "torch.optim.AdamW's, the optimizers muonckpt reads from this trainer",
        optimizer,
    )


def _kind(role: str, settings: Mapping[str, Any], g: int, opt: OptimizerState) -> kinds.GroupKind:
    if role == "adamw":
        decoupled = settings.get("decoupled_weight_decay", True)
        name = (
            "torch.optim.AdamW"
            if decoupled or not settings.get("weight_decay")
            else "torch.optim.Adam"
        )
        return kinds.GroupKind(name, "adamw", step_in="tensor")
    try:
        return TORCH.group_kind(role, settings)
    except StateDictError as exc:
        raise _fail(f"param_groups[{g}]: {exc}", opt) from None


def _params(opt: int, optimizer: OptimizerState) -> tuple[list[_Param], list[kinds.GroupKind]]:
    """Every index of ``optimizer``'s state dict, checked: groups of torch.optim.Muon or AdamW
    settings, each index in one group, state only of listed indices, of the group's keys,
    every state tensor of one shape."""
    import torch

    sd = optimizer.state_dict
    if (
        not isinstance(sd, dict)
        or not isinstance(sd.get("state"), dict)
        or not isinstance(sd.get("param_groups"), list)
    ):
        raise _fail("is not an optimizer's state_dict() (no 'state' and 'param_groups')", optimizer)
    params, group_kinds, seen = [], [], set()
    for g, settings in enumerate(sd["param_groups"]):
        ids = settings.get("params") if isinstance(settings, dict) else None
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise _fail(f"param_groups[{g}] lists no param indices", optimizer)
        names = settings.get("param_names")
        if names is not None and (
            not isinstance(names, list)
            or len(names) != len(ids)
            or not all(isinstance(n, str) for n in names)
        ):
            raise _fail(f"param_groups[{g}]['param_names'] is not one name per param", optimizer)
        role = _role(settings, g, optimizer)
        group_kinds.append(_kind(role, settings, g, optimizer))
        for at, index in enumerate(ids):
            if index in seen:
                raise _fail(f"param index {index} is in two groups", optimizer)
            seen.add(index)
            state = sd["state"].get(index, {})
            if not isinstance(state, dict) or not set(state) <= STATE_KEYS[role]:
                shown = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
                raise _fail(
                    f"the state of param index {index} is {shown}: not a {role} param's", optimizer
                )
            for k, v in state.items():
                what = f"the state {k!r} of param index {index}"
                if k == "step":
                    step_count(v, optimizer.path, f"{optimizer.label}: {what}")
                elif isinstance(v, torch.Tensor):
                    tensor(v, optimizer.path, f"{optimizer.label}: {what}")
            shapes = {
                tuple(v.shape)
                for k, v in state.items()
                if k != "step" and isinstance(v, torch.Tensor)
            }
            if len(shapes) > 1 or any(
                k != "step" and not isinstance(v, torch.Tensor) for k, v in state.items()
            ):
                raise _fail(
                    f"the state tensors of param index {index} are not of one shape", optimizer
                )
            name = names[at] if names is not None else None
            params.append(
                _Param(opt, index, g, role, state, name, shapes.pop() if shapes else None)
            )
    listed_state(sd["state"], seen, optimizer.path, optimizer.label)
    return params, group_kinds


NAMES_HINT = (
    "pass the names (--names FILE: a JSON list with, per optimizer, the list of its params' "
    "names in the order its param groups list them), or build the optimizer from "
    "model.named_parameters() so that it saves them"
)


def _names(
    params: list[_Param],
    optimizers: Sequence[OptimizerState],
    model: ModelState,
    given: Sequence[Sequence[str]] | None,
) -> tuple[list[str], str]:
    """Each param's model name (in ``params``' order), and how they were found."""
    names: list[str | None] = [p.saved_name for p in params]
    how = "param_names"
    if given is not None:
        names, how = _given(params, optimizers, given), "the names given"
    named = [(optimizers[p.opt], n) for p, n in zip(params, names, strict=True) if n is not None]
    if named:
        rewrite, note = _prefix(named, model.tensors)
        names, how = [None if n is None else rewrite(n) for n in names], how + note
    claimed = set(names)
    rest = [n for n in model.tensors if n not in claimed]
    unnamed = [p for p, n in zip(params, names, strict=True) if n is None]
    if unnamed:
        found, by = _unnamed(unnamed, rest, model, optimizers)
        it = iter(found)
        names = [next(it) if n is None else n for n in names]
        how = by if len(unnamed) == len(params) else f"{how} and {by}"
    done = [n for n in names if n is not None]
    _check(params, done, model, optimizers)
    return done, how


def _given(
    params: list[_Param], optimizers: Sequence[OptimizerState], given: Sequence[Sequence[str]]
) -> list[str | None]:
    """The names given, one list per optimizer, each as long as its params."""
    if len(given) != len(optimizers):
        raise CheckpointError(
            f"the names given are {len(given)} lists, for {len(optimizers)} optimizers "
            f"({', '.join(o.label for o in optimizers)})",
            path=optimizers[0].path,
        )
    out: list[str | None] = []
    for k, optimizer in enumerate(optimizers):
        count = sum(p.opt == k for p in params)
        if len(given[k]) != count or not all(isinstance(n, str) for n in given[k]):
            raise _fail(
                f"holds {count} params, the names given for it are {len(given[k])}", optimizer
            )
        out += list(given[k])
    return out


def _prefix(
    named: list[tuple[OptimizerState, str]], model: Mapping[str, Any]
) -> tuple[Callable[[str], str], str]:
    """How the names (each with its optimizer) map onto the model's: as they are, or with
    the one prefix replaced that makes every name the model's; and what was replaced."""
    names = [n for _, n in named]
    missing = [(o, n) for o, n in named if n not in model]
    if not missing:
        return (lambda n: n), ""
    optimizer, first = missing[0]
    candidates = {("", m[: len(m) - len(first)]) for m in model if m.endswith("." + first)}
    parts = first.split(".")
    for k in range(1, len(parts)):
        old = ".".join(parts[:k]) + "."
        candidates |= {(old, "")} if first[len(old) :] in model else set()
    fits = sorted(
        (old, new)
        for old, new in candidates
        if all(n.startswith(old) and new + n[len(old) :] in model for n in names)
    )
    if len(fits) != 1:
        why = (
            f"names {first!r}, which the model does not hold under any one prefix"
            if not fits
            else f"names {first!r}, which the model holds under several prefixes "
            f"({', '.join(repr(new or old) for old, new in fits)})"
        )
        raise _fail(f"{why}: {NAMES_HINT}", optimizer)
    old, new = fits[0]
    shown = f"prefix {old!r} dropped" if old else f"prefix {new!r} added"
    return (lambda n: new + n[len(old) :]), f" ({shown})"


def _unnamed(
    unnamed: list[_Param], rest: list[str], model: ModelState, optimizers: Sequence[OptimizerState]
) -> tuple[list[str], str]:
    """The names of params saved without one: by the model's order, else by their shapes."""
    shape = {n: tuple(model.tensors[n].shape) for n in rest}
    in_order = model.ordered and len(unnamed) == len(rest)
    if in_order and all(p.shape == shape[n] for p, n in zip(unnamed, rest, strict=True)):
        return rest, "the model's order"
    for p in unnamed:
        where = optimizers[p.opt]
        if p.shape is None:
            raise _fail(
                f"param index {p.index} has no state (never stepped): nothing but a name tells "
                f"which param it is; {NAMES_HINT}",
                where,
            )
        fits = [n for n in rest if shape[n] == p.shape]
        twins = sum(q.shape == p.shape for q in unnamed)
        if len(fits) != 1 or twins != 1:
            order = "" if model.ordered else "the model file does not keep the model's order, "
            could = f"could be any of {fits[:6]}" if fits else "matches no model tensor left"
            raise _fail(
                f"param index {p.index} of shape {list(p.shape)} {could} ({twins} unnamed "
                f"params have that shape; {order}its optimizer saved no param_names): "
                f"{NAMES_HINT}",
                where,
            )
    return [next(n for n in rest if shape[n] == p.shape) for p in unnamed], "their shapes"


def _check(
    params: list[_Param], names: list[str], model: ModelState, optimizers: Sequence[OptimizerState]
) -> None:
    """Every name a model tensor of the param's shape, no name twice."""
    seen: dict[str, _Param] = {}
    for p, name in zip(params, names, strict=True):
        where = optimizers[p.opt]
        if name not in model.tensors:
            raise _fail(
                f"param index {p.index} is named {name!r}, which the model does not hold", where
            )
        if name in seen:
            raise _fail(f"param index {p.index} and another are both named {name!r}", where)
        seen[name] = p
        held = tuple(model.tensors[name].shape)
        if p.shape is not None and p.shape != held:
            raise _fail(
                f"param index {p.index} ({name!r}) has state of shape {list(p.shape)}, the "
                f"model's tensor {list(held)}",
                where,
            )


def _step(value: Any, where: Path) -> Scalar:
    """AdamW's step count: a 0-d tensor (float32 in torch; an int64 one stays an int) or a
    number (checked by :func:`._fields.step_count` as the state was taken)."""
    return Scalar(*step_count(value, where, "step"))


def _manifest(
    params: list[_Param],
    names: list[str],
    group_kinds: list[list[kinds.GroupKind]],
    optimizers: Sequence[OptimizerState],
    model: ModelState,
    recorded: int | None,
) -> Manifest:
    """One group per param group (empty ones left out), optimizer by optimizer; the params
    group by group, each with its model tensor's dtype and its state's."""
    members: dict[tuple[int, int], list[tuple[_Param, str]]] = {}
    for p, name in zip(params, names, strict=True):
        members.setdefault((p.opt, p.group), []).append((p, name))
    groups, entries = [], []
    for (k, g), held in members.items():
        settings = optimizers[k].state_dict["param_groups"][g]
        hyper = {s: v for s, v in settings.items() if s not in ("params", "param_names")}
        tuples = tuple(tuple_paths(hyper))  # (betas, ns_coefficients: written back as tuples)
        hyper = json_safe(hyper, optimizers[k].path)
        held_names = tuple(n for _, n in held)
        groups.append(GroupEntry(hyper, held_names, group_kinds[k][g].to_json(), tuples))
        for p, name in held:
            value = model.tensors[name]
            dtypes = {PARAM_KEY: dtype_name(value.dtype)}
            dtypes.update({key: dtype_name(t.dtype) for key, t in p.state.items() if key != "step"})
            step = p.state.get("step")
            scalars = {"step": _step(step, optimizers[k].path)} if step is not None else {}
            entries.append(
                ParamEntry(name, tuple(value.shape), -1, len(groups) - 1, dtypes, scalars)
            )
    return Manifest(
        CONSOLIDATED, {"dp": 1, "tp": 1}, tuple(groups), tuple(entries), (), (),
        recorded_step=recorded,
    )  # fmt: skip


def convert_optimizers(
    model: ModelState,
    optimizers: Sequence[OptimizerState],
    dst: str | os.PathLike[str],
    *,
    names: str | os.PathLike[str] | Sequence[Sequence[str]] | None,
    to: str | None,
    overwrite: bool,
    progress: Progress | None,
    source: Path,
    recorded_step: int | None = None,
    trainer: TrainerState | None = None,
) -> tuple[Path, str, tuple[str, ...]]:
    """Write ``optimizers``' state and ``model``'s tensors as a consolidated muonckpt
    checkpoint at ``dst`` for the family ``to`` (None: torch.optim.Muon's and AdamW's own
    form), keyed by the model's names (``names``: :func:`given_names`, where the files do not
    say); the model's tensors no optimizer holds (buffers, frozen params) go in as the
    model's other tensors. Returns the path, the layout (how many optimizers, how the params
    were named, how many model tensors were carried beside them), and the momentum
    conversions. The ``trainer``'s own state, where the reader found one, goes into the
    output's ``extra`` (:mod:`._trainer_state`)."""
    given = given_names(names)
    if to is not None and to not in kinds.FAMILIES:
        raise CheckpointError(f"cannot convert to {to!r}: choose one of {sorted(kinds.FAMILIES)}")
    params: list[_Param] = []
    group_kinds = []
    for k, optimizer in enumerate(optimizers):
        held, held_kinds = _params(k, optimizer)
        params += held
        group_kinds.append(held_kinds)
    found, how = _names(params, optimizers, model, given)
    manifest = _manifest(params, found, group_kinds, optimizers, model, recorded_step)
    target, scales = converted_manifest(manifest, to, path=source)
    state = {name: p.state for p, name in zip(params, found, strict=True)}
    others = [
        model_tensor(n, tuple(t.shape), dtype_name(t.dtype))
        for n, t in model.tensors.items()
        if n not in state
    ]
    planned = consolidated(target, model_tensors=others)
    tensors = (
        (model.tensors.pop(name) if key == PARAM_KEY else state[name].pop(key)).clone()
        for name, key in planned.reads
    )
    path = write_consolidated(
        planned, scales, tensors, dst, overwrite=overwrite, progress=progress, source=source,
        trainer=trainer, step=recorded_step,
    )  # fmt: skip
    count = len(optimizers)
    layout = f"{count} optimizer{'s' * (count != 1)}, params named by {how}"
    if others:
        layout += f", {len(others)} more model tensor{'s' * (len(others) != 1)} carried"
    return path, layout, conversion_notes(manifest, target)


MAX_NAMES_BYTES = 64 << 20


def given_names(
    names: str | os.PathLike[str] | Sequence[Sequence[str]] | None,
) -> list[list[str]] | None:
    """The names a user gives: a JSON file (or its content) holding, per optimizer, the list
    of its params' names in the order its param groups list them; a flat list of names for
    a job of one optimizer."""
    if names is None:
        return None
    where = None
    if isinstance(names, (str, os.PathLike)):
        where = Path(names)
        names = read_json(where, limit=MAX_NAMES_BYTES)
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names):
        names = [names]
    if not isinstance(names, (list, tuple)) or not all(
        isinstance(row, (list, tuple)) and all(isinstance(n, str) for n in row) for row in names
    ):
        raise CheckpointError(
            "the names given are not a list, per optimizer, of its params' names", path=where
        )
    return [list(row) for row in names]


def load(path: Path) -> Any:
    """The content of the ``torch.save`` file ``path`` (``optimizer.bin``, a ``.ckpt``), by
    torch's restricted unpickler: tensors, containers, numbers and strings only."""
    return torch_pickles.load(path, {}, HOLDS)
