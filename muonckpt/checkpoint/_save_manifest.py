"""(internal) The manifest of a save as the call knows it (:func:`draft`, made by
:func:`muonckpt.checkpoint.saving.plan`), which the root completes at the commit from the
ranks' reports of what they wrote (:func:`muonckpt.files.writing.commit`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import storage
from ..files.writing import Draft
from ..format.manifest import GroupEntry, Manifest, ModelFile, ParamEntry, model_tensor
from ..state.describers import flat_params

if TYPE_CHECKING:
    from ..state.model_state import ModelTensors
    from ..state.placement import Optimizers
    from ..state.sharding_model import Sharding


def draft(
    groups: Sequence[GroupEntry],
    sharding: Sharding,
    kind: str,
    model: ModelTensors | None = None,
    given_step: int | None = None,
    device: str = "cpu",
) -> Draft:
    """A save's manifest before anything is written: the groups as taken at the save's start,
    the params from the grid (their dtypes and scalars the ranks report), its kind,
    ``model``'s other tensors and tied names (:class:`ModelFile`), and the step
    ``extra["step"]`` gave, else (recorded at the commit) the optimizer's count where it
    keeps one; the environment it runs in (:func:`environment`, on ``device``)."""
    params = tuple(
        ParamEntry(
            name=param.name,
            shape=tuple(param.full_shape),
            group=param.group,
            tp_split_dim=param.tp_split_dim,
            dtypes={},
        )
        for param in sharding.params
    )
    model_file = None
    if model is not None:
        model_file = ModelFile(
            tensors=tuple(
                model_tensor(name, t.shape, storage.dtype_name(t.dtype))
                for name, t in model.extras.items()
            ),
            pieces=(),
            aliases=dict(model.aliases),
        )
    manifest = Manifest(
        kind=kind,
        topology=dict(sharding.topology),
        groups=tuple(groups),
        params=params,
        files=(),
        pieces=(),
        model=model_file,
        recorded_step=given_step,
        environment=environment(device),
    )
    return Draft(manifest, record_step=True)


def environment(device: str) -> dict[str, Any]:
    """This process's environment as a manifest records it
    (:data:`~muonckpt.format.manifest.ENVIRONMENT_KEYS`), the state on a ``device`` of this type."""
    return {
        "torch": torch.__version__,
        "device": device,
        "intra_op_threads": torch.get_num_threads(),
        "inter_op_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def device_of(optimizer: Optimizers) -> str:
    """The type of device ``optimizer``'s params are on here (``cpu``: it holds none here)."""
    params = flat_params(optimizer)
    return params[0].device.type if params else "cpu"
