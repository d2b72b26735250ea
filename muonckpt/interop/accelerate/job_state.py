"""The training job's own state in accelerate's ``save_state`` directories, in and out
(:mod:`muonckpt.interop._trainer_state`).

Beside the model and the optimizers, ``Accelerator.save_state`` writes each prepared
scheduler's ``state_dict()`` (``scheduler.bin``, ``scheduler_1.bin``, ...) and each process's
RNG states (``random_states_{rank}.pkl``: accelerate's ``step``, Python's, numpy's and torch's
generator states). :func:`read` takes the schedulers that are JSON data as they are, and the
RNG states of every process, read by the restricted unpickler (numpy's array as its bytes:
:mod:`.._rng_states`), as per-rank values for that number of processes; :func:`written` writes
them back under the same names. accelerate's ``load_state`` reads ``random_states_{rank}.pkl``
by the process's own rank and goes on without it where it is missing, so the writer puts the
RNG states back only at the number of processes they were saved at.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...storage import torch_pickles
from .. import _rng_states as rng_states
from .._torch_optim import HOLDS, load
from .._trainer_state import Carried, Found, TrainerState, is_plain

__all__ = ["NAME", "read", "written"]

NAME = "accelerate"
RNG_FILE = re.compile(r"random_states_(\d+)\.pkl")
SCHEDULER_FILE = re.compile(r"scheduler(?:_(\d+))?\.bin")
RESTORE = {
    "random_states": "accelerate's load_state goes on without them ('Could not load random "
    "states'): each process's RNG starts from the job's seed",
}
_TREES: dict[str, Callable[[Any, str], Any]] = {
    "random_state": rng_states.python_tree,
    "numpy_random_seed": rng_states.numpy_tree,
    "torch_manual_seed": rng_states.generator,
}
_STATES: dict[str, Callable[[Any], Any]] = {
    "random_state": rng_states.python_state,
    "numpy_random_seed": rng_states.numpy_state,
    "torch_manual_seed": lambda tensor: tensor,
}


def scheduler_file(index: int) -> str:
    """The name accelerate gives scheduler ``index``'s file."""
    return "scheduler.bin" if index == 0 else f"scheduler_{index}.bin"


def read(directory: Path, names: tuple[str, ...]) -> Found:
    """The job's own state among the files ``names`` of the ``save_state`` ``directory``."""
    left: list[str] = []
    used: set[str] = set()
    schedulers = _numbered(names, SCHEDULER_FILE)
    shared: dict[str, Any] = {}
    if schedulers:
        states = [load(directory / name) for name in schedulers]
        if list(map(scheduler_file, range(len(states)))) == schedulers and is_plain(states):
            shared["schedulers"] = states
            used.update(schedulers)
        else:
            left += [f"{name} (not a scheduler's state of JSON data)" for name in schedulers]
    ranks: dict[str, list[Any]] = {}
    layout: dict[str, int] = {}
    found = _numbered(names, RNG_FILE)
    if found:
        try:
            if found != [f"random_states_{r}.pkl" for r in range(len(found))]:
                raise rng_states.NotAsSaved(f"files {found}, not one per process from 0")
            ranks["random_states"] = [_rng_tree(directory / name) for name in found]
            layout["processes"] = len(found)
            used.update(found)
        except rng_states.NotAsSaved as exc:
            left.append(f"random_states ({exc}): {RESTORE['random_states']}")
    return Found(
        TrainerState(NAME, shared, layout, ranks, RESTORE), None, frozenset(used), tuple(left)
    )


def _numbered(names: tuple[str, ...], pattern: re.Pattern[str]) -> list[str]:
    """The names ``pattern`` matches, by their number (none: 0)."""
    found = [(int(m[1] or 0), name) for name in names if (m := pattern.fullmatch(name))]
    return [name for _, name in sorted(found)]


def _rng_tree(path: Path) -> dict[str, Any]:
    """One process's RNG states as a tree of JSON values and tensors."""
    state = torch_pickles.load(path, rng_states.NUMPY_STAND_INS, HOLDS)
    if not isinstance(state, dict) or not set(state) <= {"step", *_TREES}:
        shown = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise rng_states.NotAsSaved(
            f"{path.name} holds {shown}, not the CPU states accelerate saves"
        )
    step = state.get("step")
    if step is not None and type(step) is not int:
        raise rng_states.NotAsSaved(f"{path.name}'s step is not an int")
    tree = {key: convert(state[key], key) for key, convert in _TREES.items() if key in state}
    return tree if step is None else {"step": step, **tree}


def written(state: Carried, staging: Path, where: Path) -> list[str]:
    """Write the carried accelerate job ``state`` into the ``save_state`` being staged at
    ``staging``: its schedulers' files and each process's RNG states; the names written. A
    state not of the form :func:`read` gives is refused, naming ``where`` (the manifest)."""
    names = []
    try:
        for index, scheduler in enumerate(state.shared.get("schedulers", ())):
            names.append(scheduler_file(index))
            torch_pickles.save(staging / names[-1], scheduler)
        for rank, tree in enumerate(state.ranks.get("random_states", ())):
            names.append(f"random_states_{rank}.pkl")
            torch_pickles.save(staging / names[-1], _rng_state(tree))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"extra['trainer'] is not accelerate's state as a conversion stores it "
            f"({type(exc).__name__}: {exc})",
            path=where,
        ) from None
    return names


def _rng_state(tree: Mapping[str, Any]) -> dict[str, Any]:
    """One process's RNG states as accelerate pickles them, from their tree."""
    state = {key: restore(tree[key]) for key, restore in _STATES.items() if key in tree}
    return {"step": tree["step"], **state} if "step" in tree else state
