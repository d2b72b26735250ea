"""The training job's own state in Megatron's checkpoints, in and out
(:mod:`muonckpt.interop._trainer_state`).

``megatron.training``'s ``save_checkpoint`` saves beside the model and optimizer the
``iteration``, ``num_floating_point_operations_so_far``, the ``opt_param_scheduler``'s state dict,
the training ``args`` (``consumed_train_samples``: the data loader's position) and, per TP and PP
rank (DP rank 0's; every DP rank's with ``--data-parallel-random-init``), its ``rng_state``: a
list of ``{random_rng_state, np_rng_state, torch_rng_state, cuda_rng_state, rng_tracker_states}``
(torch_dist: the item ``rng_state/shard_{pp}.{tp}_{PP}.{TP}``; torch: in each
``mp_rank_XX/model_optim_rng.pt``). :func:`job_state` reads them into a
:class:`~.._trainer_state.TrainerState`: the args' plain values (their enums and
``signal.Signals`` left out, listed), the RNG states as JSON and tensors (numpy's key as its
bytes). :func:`written` gives them back in Megatron's own form for a torch_dist output at TP ``tp``
and DP ``dp``: the RNG states only at the TP and PP sizes they were saved at (Megatron's load
itself ignores them at another), and ``args`` whose sizes are the output's, with ``no_save_rng``
where no RNG state is written, so that ``load_checkpoint`` seeds afresh instead of failing.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from .. import _rng_states as rng_states
from .._rng_states import NotAsSaved
from .._trainer_state import Carried, TrainerState, is_plain
from .files import Namespace

__all__ = ["NAME", "RNG_ITEM", "iteration_of", "job_state", "rng_item", "target_layout", "written"]

NAME = "megatron"
RNG_ITEM = re.compile(r"rng_state/shard_(\d+)\.(\d+)_(\d+)\.(\d+)")
"""A torch_dist checkpoint's RNG item: ``rng_state/shard_{pp}.{tp}_{PP}.{TP}``."""
SHARED = ("iteration", "num_floating_point_operations_so_far", "opt_param_scheduler")
"""The common state's values for the whole job that travel as they are."""
RESTORE = {
    "rng_state": "Megatron's load_checkpoint ignores RNG states at another TP or PP size "
    "itself (the output's args say no_save_rng): the job's RNG starts from its --seed",
}
"""How a job restores each per-rank value where a target leaves it out."""


def rng_item(pp: int, tp: int, pp_size: int, tp_size: int) -> str:
    """The torch_dist item of the RNG states of PP rank ``pp``, TP rank ``tp``."""
    return f"rng_state/shard_{pp}.{tp}_{pp_size}.{tp_size}"


def job_state(
    common: Mapping[str, Any], rng: Mapping[tuple[int, int], Any], sizes: tuple[int, int]
) -> tuple[TrainerState, list[str]]:
    """The trainer state of a checkpoint: ``common``, its common state (or a torch-format
    ``model_optim_rng.pt``), ``rng``: each (PP rank, TP rank)'s ``rng_state`` as read, of PP and
    TP sizes ``sizes``; with the lines saying what of it is left out (an arg Megatron's own
    class holds; RNG states not as Megatron saves them, or not of every rank)."""
    left: list[str] = []
    shared = {k: common[k] for k in SHARED if k in common and is_plain(common[k])}
    left += [f"{k} (not plain data)" for k in SHARED if k in common and k not in shared]
    args = common.get("args")
    if isinstance(args, Namespace):
        kept = {k: v for k, v in sorted(vars(args).items()) if is_plain(v)}
        dropped = sorted(set(vars(args)) - set(kept))
        if dropped:
            left.append(
                f"args {', '.join(dropped)} (Megatron's own classes: the loading job's own "
                "settings hold)"
            )
        shared["args"] = kept
    pp_size, tp_size = sizes
    ranks: dict[str, list[Any]] = {}
    layout = {"pp": pp_size, "tp": tp_size}
    expected = [(p, t) for p in range(pp_size) for t in range(tp_size)]
    if rng:
        try:
            if sorted(rng) != expected:
                raise NotAsSaved(f"held for ranks {sorted(rng)}, not every (PP, TP) rank")
            states = [_rng_list(rng[rank]) for rank in expected]
            if len({len(s) for s in states}) != 1:
                raise NotAsSaved("of different numbers of DP ranks")
            if len(states[0]) > 1:
                layout["dp"] = len(states[0])  # --data-parallel-random-init: one per DP rank
            ranks["rng_state"] = states
        except NotAsSaved as exc:
            left.append(f"rng_state ({exc}): {RESTORE['rng_state']}")
    return TrainerState(NAME, shared, layout if ranks else {}, ranks, RESTORE), left


def iteration_of(common: Mapping[str, Any]) -> int | None:
    """The iteration a Megatron checkpoint was saved at (None where it records none)."""
    iteration = common.get("iteration")
    return iteration if type(iteration) is int and iteration >= 0 else None


def _rng_list(value: Any) -> list[dict[str, Any]]:
    """One rank's ``rng_state`` (a list of one state per DP rank) as trees of JSON and
    tensors."""
    if not isinstance(value, list) or not value:
        raise NotAsSaved(f"a {type(value).__name__}, not a list of states")
    return [_rng_tree(state) for state in value]


RNG_KEYS = {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state"}
RNG_KEYS |= {"rng_tracker_states"}
"""The RNG states of one rank, as ``get_rng_state`` saves them."""


def _rng_tree(state: Any) -> dict[str, Any]:
    if not isinstance(state, dict) or set(state) != RNG_KEYS:
        raise NotAsSaved(f"keys {sorted(state) if isinstance(state, dict) else state!r:.60}")
    trackers = state["rng_tracker_states"]
    if not isinstance(trackers, dict) or not all(isinstance(k, str) for k in trackers):
        raise NotAsSaved("rng_tracker_states is not a dict by name")
    return {
        "random_rng_state": rng_states.python_tree(state["random_rng_state"], "random_rng_state"),
        "np_rng_state": rng_states.numpy_tree(state["np_rng_state"], "np_rng_state"),
        "torch_rng_state": rng_states.generator(state["torch_rng_state"], "torch_rng_state"),
        "cuda_rng_state": rng_states.generator(state["cuda_rng_state"], "cuda_rng_state"),
        "rng_tracker_states": {k: rng_states.generator(v, k) for k, v in trackers.items()},
    }


def written(
    state: Carried, tp: int, dp: int, values: dict[str, Any], common: dict[str, Any], where: Path
) -> None:
    """Put the carried trainer ``state`` into a torch_dist output at TP ``tp``, DP ``dp``:
    ``common`` (the common state) gets the job's values and ``args`` (sizes the output's,
    ``no_save_rng`` where no RNG state is written); ``values`` each rank's RNG item. A state
    not of the form :func:`job_state` gives is refused, naming ``where`` (the manifest)."""
    common.update({k: state.shared[k] for k in SHARED if k in state.shared})
    rng = state.ranks.get("rng_state")
    try:
        if rng is not None and len(rng) != tp:
            raise ValueError(f"{len(rng)} ranks' RNG states for TP {tp}")
        for t, per_dp in enumerate(rng or ()):  # (as saved: the shard's object, in a list)
            values[rng_item(0, t, 1, tp)] = [[_rng_state(tree) for tree in per_dp]]
        args = argparse.Namespace(**state.shared["args"]) if "args" in state.shared else None
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"extra['trainer'] is not Megatron's state as a conversion stores it "
            f"({type(exc).__name__}: {exc})",
            path=where,
        ) from None
    if args is not None:
        vars(args).update(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, data_parallel_size=dp,
            world_size=tp * dp, ckpt_format="torch_dist", use_dist_ckpt=True,
            no_save_rng=rng is None,
        )  # fmt: skip
        common["args"] = args


def _rng_state(tree: Mapping[str, Any]) -> dict[str, Any]:
    """One DP rank's RNG states in Megatron's form (``random.setstate``'s tuples, numpy's
    array), from their tree."""
    return {
        "random_rng_state": rng_states.python_state(tree["random_rng_state"]),
        "np_rng_state": rng_states.numpy_state(tree["np_rng_state"]),
        "torch_rng_state": tree["torch_rng_state"],
        "cuda_rng_state": tree["cuda_rng_state"],
        "rng_tracker_states": dict(tree["rng_tracker_states"]),
    }


def target_layout(saved: Mapping[str, Any], tp: int, dp: int) -> dict[str, int]:
    """The layout of a torch_dist output at TP ``tp``, DP ``dp`` in the words of ``saved``
    (the DP size only where the saved RNG states are per DP rank)."""
    layout = {"pp": 1, "tp": tp}
    return {**layout, "dp": dp} if "dp" in saved else layout
