"""What a consolidated save given the model (``save(..., model=model)``) writes beyond the
optimizer's params: the model's other ``state_dict()`` tensors (buffers, params no optimizer
holds) and its tied names, found as safetensors finds shared tensors (by storage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ArgumentError, CheckpointError
from ..format.renames import prefix_fix
from ..storage import unstorable_kind


@dataclass(frozen=True)
class ModelTensors:
    """What ``save(..., model=model)`` adds to a consolidated ``model.safetensors``."""

    extras: dict[str, torch.Tensor]
    """The model's state_dict tensors no optimizer param stands for (buffers, frozen params),
    by name."""
    aliases: dict[str, str]
    """Tied names: alias -> the name the tensor is stored under."""


def model_tensors(
    model: torch.nn.Module | None, held: list[str], consolidated: bool, params: bool
) -> ModelTensors | None:
    """What ``model`` adds beyond the optimizer's params (named ``held``), checked: every
    optimizer param must be an entry of its ``state_dict()``; tensors shared by several names
    (tied weights) are stored once. None without a model."""
    if model is None:
        return None
    if not isinstance(model, torch.nn.Module):
        raise ArgumentError(
            f"model= takes a torch.nn.Module, got {type(model).__name__}", argument="model"
        )
    if not consolidated or not params:
        raise ArgumentError(
            "model= completes a consolidated model.safetensors: save with consolidated=True "
            "and params=True",
            argument="model",
        )
    state = model.state_dict(keep_vars=True)
    missing = sorted(set(held) - set(state))
    if missing:
        fix = prefix_fix(held, state)
        differ = f"; the names differ by the prefix {fix}" if fix else ""
        raise ArgumentError(
            f"the optimizer's params {missing[:4]} are not entries of the model's "
            f"state_dict(){differ}: give the optimizer the names model.named_parameters() "
            "gives, for the model passed as model=",
            argument="model",
        )
    by_tensor: dict[Any, list[str]] = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"model state {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        if (kind := unstorable_kind(tensor)) is not None:
            raise CheckpointError(f"model state {name!r} is {kind}, which cannot be stored")
        by_tensor.setdefault(_storage_identity(tensor), []).append(name)
    extras, aliases, stored_params = {}, {}, set(held)
    for names in by_tensor.values():
        stored = next((n for n in names if n in stored_params), names[0])
        if stored not in stored_params:
            extras[stored] = state[stored]
        aliases.update({n: stored for n in names if n != stored and n not in stored_params})
    return ModelTensors(extras, aliases)


def _storage_identity(tensor: torch.Tensor) -> Any:
    """Equal for two state_dict entries that are one tensor (tied weights), as safetensors
    tells shared tensors apart."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return ("alone", id(tensor))
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )
