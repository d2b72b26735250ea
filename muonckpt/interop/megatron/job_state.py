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
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError
from ...storage import torch_pickles
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


class _NotAsSaved(Exception):
    """A value that is not as Megatron-Core 0.19 saves it: left out, named, never guessed."""


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
                raise _NotAsSaved(f"held for ranks {sorted(rng)}, not every (PP, TP) rank")
            states = [_rng_list(rng[rank]) for rank in expected]
            if len({len(s) for s in states}) != 1:
                raise _NotAsSaved("of different numbers of DP ranks")
            if len(states[0]) > 1:
                layout["dp"] = len(states[0])  # --data-parallel-random-init: one per DP rank
            ranks["rng_state"] = states
        except _NotAsSaved as exc:
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
        raise _NotAsSaved(f"a {type(value).__name__}, not a list of states")
    return [_rng_tree(state) for state in value]


RNG_KEYS = {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state"}
RNG_KEYS |= {"rng_tracker_states"}
"""The RNG states of one rank, as ``get_rng_state`` saves them."""


def _rng_tree(state: Any) -> dict[str, Any]:
    if not isinstance(state, dict) or set(state) != RNG_KEYS:
        raise _NotAsSaved(f"keys {sorted(state) if isinstance(state, dict) else state!r:.60}")
    version, words, gauss = _tuple(state["random_rng_state"], 3, "random_rng_state")
    if not isinstance(words, tuple) or not all(type(w) is int for w in words):
        raise _NotAsSaved("random_rng_state's words are not ints")
    name, key, pos, has_gauss, cached = _tuple(state["np_rng_state"], 5, "np_rng_state")
    raw, dtype, shape = _array(key)
    trackers = state["rng_tracker_states"]
    if not isinstance(trackers, dict) or not all(isinstance(k, str) for k in trackers):
        raise _NotAsSaved("rng_tracker_states is not a dict by name")
    return {
        "random_rng_state": {"version": version, "words": list(words), "gauss": gauss},
        "np_rng_state": {
            "name": name,
            "key": raw,
            "dtype": dtype,
            "shape": shape,
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
        },
        "torch_rng_state": _tensor(state["torch_rng_state"], "torch_rng_state"),
        "cuda_rng_state": _tensor(state["cuda_rng_state"], "cuda_rng_state"),
        "rng_tracker_states": {k: _tensor(v, k) for k, v in trackers.items()},
    }


def _tuple(value: Any, size: int, what: str) -> tuple[Any, ...]:
    if not isinstance(value, tuple) or len(value) != size or not all(map(_plain_or_tuple, value)):
        raise _NotAsSaved(f"{what} is not a tuple of {size} plain values")
    return value


def _plain_or_tuple(value: Any) -> bool:
    return is_plain(value) or isinstance(value, (tuple, torch_pickles.Opaque))


def _tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise _NotAsSaved(f"{what} is not a generator state (1-D uint8)")
    return value


def _array(value: Any) -> tuple[torch.Tensor, str, list[int]]:
    """numpy's key array, pickled as ``_reconstruct(ndarray, (0,), b'b')`` with the state
    ``(1, shape, dtype, fortran, bytes)`` and read as a stand-in: its bytes, dtype and shape."""
    state = getattr(value, "state", None)
    if not isinstance(value, torch_pickles.Opaque) or not isinstance(state, tuple):
        raise _NotAsSaved("np_rng_state's key is not a numpy array")
    if len(state) != 5 or not isinstance(state[1], tuple) or not isinstance(state[4], bytes):
        raise _NotAsSaved("np_rng_state's key is not a numpy array")
    dtype = state[2]
    code = dtype.args[0] if isinstance(dtype, torch_pickles.Opaque) and dtype.args else None
    order = dtype.state[1] if isinstance(getattr(dtype, "state", None), tuple) else None
    if code not in ("u4", "u8") or order not in ("<", ">", "=", "|") or state[3]:
        raise _NotAsSaved(f"np_rng_state's key is of dtype {code!r}, not u4")
    shape = list(state[1])
    if not all(type(n) is int for n in shape) or math.prod(shape) * int(code[1]) != len(state[4]):
        raise _NotAsSaved("np_rng_state's key's bytes are not its shape's")
    raw = torch.frombuffer(bytearray(state[4]), dtype=torch.uint8)
    return raw, order + code, shape


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
    import numpy as np

    py, np_state = tree["random_rng_state"], tree["np_rng_state"]
    key = np.frombuffer(_bytes(np_state["key"]), dtype=np.dtype(np_state["dtype"]))
    return {
        "random_rng_state": (py["version"], tuple(py["words"]), py["gauss"]),
        "np_rng_state": (
            np_state["name"],
            key.reshape(np_state["shape"]).copy(),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        ),
        "torch_rng_state": tree["torch_rng_state"],
        "cuda_rng_state": tree["cuda_rng_state"],
        "rng_tracker_states": dict(tree["rng_tracker_states"]),
    }


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().numpy().tobytes())


def target_layout(saved: Mapping[str, Any], tp: int, dp: int) -> dict[str, int]:
    """The layout of a torch_dist output at TP ``tp``, DP ``dp`` in the words of ``saved``
    (the DP size only where the saved RNG states are per DP rank)."""
    layout = {"pp": 1, "tp": tp}
    return {**layout, "dp": dp} if "dp" in saved else layout
