"""Hugging Face accelerate's ``save_state`` directories, found and read safely.

The directory holds the model (``model.safetensors``, or ``pytorch_model.bin`` without safe
serialization), one ``optimizer.bin`` per optimizer (``optimizer_1.bin``, ... for more: each
a pickled ``optimizer.state_dict()``), ``random_states_{rank}.pkl`` and, when the job
registered them, ``scheduler.bin``, ``sampler.bin``, ``scaler.pt``, ``custom_checkpoint_N.pkl``.
Pickles are read by :func:`muonckpt.interop._torch_optim.load` (no stand-ins: plain tensors,
containers, numbers and strings); the files muonckpt does not need (the RNG states) are never
opened.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...storage import access
from ...storage.durable import entries
from ...storage.safetensors_reader import SafetensorsReader
from .._torch_optim import load

__all__ = ["AccelerateFiles", "accelerate_files", "is_accelerate", "read_model"]

OPTIMIZER = "optimizer.bin"
OPTIMIZER_FILE = re.compile(r"^optimizer(?:_(\d+))?\.bin$")
MODEL_FILES = ("model.safetensors", "pytorch_model.bin")
MORE_MODELS = re.compile(r"^(?:model|pytorch_model)_\d+\.(?:safetensors|bin)$")


def optimizer_file(index: int) -> str:
    """The name accelerate gives optimizer ``index``'s file."""
    return OPTIMIZER if index == 0 else f"optimizer_{index}.bin"


def is_accelerate(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an accelerate ``save_state`` directory: ``optimizer.bin`` beside a
    model file (presence only; nothing is read)."""
    path = Path(path)
    return access.is_file(path / OPTIMIZER) and any(access.is_file(path / m) for m in MODEL_FILES)


@dataclass(frozen=True)
class AccelerateFiles:
    """The files of one accelerate ``save_state`` directory."""

    directory: Path
    model: Path
    optimizers: tuple[Path, ...]
    """``optimizer.bin``, ``optimizer_1.bin``, ..., in the order the job prepared them."""
    others: tuple[str, ...]
    """Every other entry's name, sorted (the RNG states, a scheduler's file): never opened."""


def accelerate_files(src: str | os.PathLike[str]) -> AccelerateFiles:
    """The model and optimizer files of the ``save_state`` directory ``src``; a gap in the
    optimizers' numbers, a second model or no model is refused naming the file."""
    directory = Path(src)
    if not access.is_dir(directory):
        raise CheckpointError("is not a directory: not an accelerate save_state", path=directory)
    names = entries(directory)
    found = {}
    for name in names:
        match = OPTIMIZER_FILE.match(name)
        if match:
            found[int(match.group(1) or 0)] = directory / name
    if 0 not in found:
        raise CheckpointError(
            "holds no optimizer state: not an accelerate save_state", path=directory / OPTIMIZER
        )
    for index in range(max(found) + 1):
        if index not in found:
            raise CheckpointError(
                f"is missing, though optimizer files up to {found[max(found)].name} are there",
                path=directory / optimizer_file(index),
            )
    models = [name for name in MODEL_FILES if name in names]
    more = sorted(name for name in names if MORE_MODELS.match(name))
    if more:
        raise CheckpointError(
            f"is the state of a job of {len(more) + 1} models: muonckpt reads the state of one "
            "model and its optimizers",
            path=directory / more[0],
        )
    if len(models) != 1:
        what = "both " + " and ".join(models) if models else f"no {' or '.join(MODEL_FILES)}"
        raise CheckpointError(f"holds {what}: not one model's state", path=directory)
    used = {models[0], *(p.name for p in found.values())}
    return AccelerateFiles(
        directory,
        directory / models[0],
        tuple(found[i] for i in sorted(found)),
        tuple(sorted(set(names) - used)),
    )


def read_model(path: Path) -> dict[str, Any]:
    """The tensors of an accelerate model file, by name: ``model.safetensors`` (its names
    sorted, as its header keeps them), or ``pytorch_model.bin`` (a pickled state dict, in its
    order)."""
    import torch

    if path.suffix == ".safetensors":
        with SafetensorsReader(path) as reader:
            keys = reader.keys()
            return {key: reader.read_tensor(key) for key in keys}
    tensors = load(path)
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
    ):
        raise CheckpointError("is not a state dict of named tensors", path=path)
    return dict(tensors)
