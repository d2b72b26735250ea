"""An optimizer's params by name, in order, and dtypes in torch's spelling: what the describers
(:mod:`muonckpt.state.describers`, :mod:`muonckpt.state.owners`) and the packaged Muon's report
of its own layout share, so that the Muon reports without calling back into the module that
reads its report."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch


class HasParamGroups(Protocol):
    """A ``torch.optim.Optimizer``, or several as one (:class:`muonckpt.state.placement.Joined`)."""

    @property
    def param_groups(self) -> Sequence[dict[str, Any]]: ...


def param_names(optimizer: HasParamGroups) -> list[str]:
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


def is_named(optimizer: HasParamGroups) -> bool:
    """Whether any group carries ``param_names`` (torch's named optimizers)."""
    return any(group.get("param_names") for group in optimizer.param_groups)


def named_params(optimizer: HasParamGroups) -> Iterator[tuple[str | None, int, Any]]:
    """(name, or None for an unnamed optimizer; group index; param) of every param in order."""
    named = is_named(optimizer)
    names = param_names(optimizer)
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            yield (names[index] if named else None), g, p
            index += 1


@functools.cache
def torch_dtype_name(dtype: torch.dtype) -> str:
    """A tensor's dtype in torch's spelling (``float32``), as the grid reports and state values
    name it (the files' safetensors spelling, ``F32``, is :func:`muonckpt.storage.dtype_name`)."""
    return str(dtype).removeprefix("torch.")
