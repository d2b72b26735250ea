"""The training job's own state in torchtitan's checkpoints, in and out
(:mod:`muonckpt.interop._trainer_state`).

torchtitan's ``CheckpointManager`` saves beside the model and optimizer, flattened into DCP
items: ``lr_scheduler.*`` (``LRSchedulersContainer.state_dict()``: in 0.3.0 its
``last_epoch``), ``train_state.*`` (the step and token counts, where the job saves one) and
``dataloader.*`` (``ParallelAwareDataloader.state_dict()``: ``dp_rank_{r}``, each DP rank's
position pickled by torchtitan, and ``world_size``; ``None`` without a data loader). :func:`read`
takes the plain values as they are and the data loader's positions as per-rank bytes, never
unpickled (uint8 tensors, for the DP size ``world_size`` says); :func:`values` gives them back as
the same items. torchtitan's own load refuses a data loader's state at another DP degree
(``dataloader resharding is not supported yet``), and the writer of torchtitan's checkpoints
does not know the DP size they are loaded at: the positions are written back as saved, with
their ``world_size``, for torchtitan to check.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from .._trainer_state import Carried, Found, TrainerState, is_plain
from ..dcp import files as dcp_files
from ..dcp import metadata as dcp_metadata

__all__ = ["NAME", "read", "values"]

NAME = "torchtitan"
SHARED = ("lr_scheduler", "train_state")
"""The job states whose plain values travel as they are (by their first name component)."""
_RANK = re.compile(r"dataloader\.dp_rank_(\d+)")
RESTORE = {
    "dataloader": "torchtitan's own load refuses a data loader's state at another DP degree: "
    "exclude 'dataloader' from loading there (CheckpointManager.Config.exclude_from_loading)",
}


def read(index: dcp_metadata.DcpIndex, step: int | None) -> Found:
    """The job's own state of torchtitan's checkpoint ``index`` (``step``: its ``step-N``)."""
    shared: dict[str, dict[str, Any]] = {}
    used: set[str] = set()
    left: list[str] = []
    for fqn, item in sorted(index.values.items()):
        head, _, rest = fqn.partition(".")
        if head in SHARED and rest:
            value = dcp_files.read_value(index, item)
            if is_plain(value):
                shared.setdefault(head, {})[rest] = value
                used.add(fqn)
            else:
                left.append(f"{fqn} (not plain data)")
    ranks, layout = _dataloader(index, used, left)
    state = TrainerState(NAME, shared, layout, ranks, RESTORE)
    return Found(state, step, frozenset(used), tuple(left))


def _dataloader(
    index: dcp_metadata.DcpIndex, used: set[str], left: list[str]
) -> tuple[dict[str, list[Any]], dict[str, int]]:
    """Each DP rank's data loader position (its pickled bytes, as a uint8 tensor) and the DP
    size, where the checkpoint holds one for every rank ``world_size`` says."""
    whole = index.values.get("dataloader")
    if whole is not None and dcp_files.read_value(index, whole) is None:
        used.add("dataloader")  # (saved without a data loader: nothing to carry)
        return {}, {}
    found = {int(m[1]): fqn for fqn in index.values if (m := _RANK.fullmatch(fqn))}
    if not found:
        return {}, {}
    world = "dataloader.world_size"
    size = dcp_files.read_value(index, index.values[world]) if world in index.values else None
    positions = [dcp_files.read_value(index, index.values[found[r]]) for r in sorted(found)]
    if type(size) is not int or sorted(found) != list(range(size)):
        left.append(f"dataloader (positions of DP ranks {sorted(found)}, world_size {size!r})")
        return {}, {}
    if not all(isinstance(p, bytes) for p in positions):
        left.append("dataloader (positions that are not torchtitan's pickled bytes)")
        return {}, {}
    used.update({*found.values(), world})
    tensors = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in positions]
    return {"dataloader": tensors}, {"dp": size}


def values(state: Carried) -> dict[str, Any]:
    """The DCP items of a carried torchtitan job state: ``lr_scheduler.*``,
    ``train_state.*``, and the data loader's ``dataloader.dp_rank_{r}`` and ``world_size``."""
    out = {
        f"{head}.{key}": value
        for head, part in state.shared.items()
        if isinstance(part, Mapping)
        for key, value in part.items()
    }
    positions = state.ranks.get("dataloader")
    if positions:
        for r, tensor in enumerate(positions):
            out[f"dataloader.dp_rank_{r}"] = bytes(tensor.contiguous().numpy().tobytes())
        out["dataloader.world_size"] = len(positions)
    return out
