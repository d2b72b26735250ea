"""(internal) The manifest of a save as the call knows it (:func:`draft`, made by
:func:`muonckpt.checkpoint.saving.plan`), which the root completes at the commit from the
ranks' reports of what they wrote (:func:`muonckpt.files.writing.commit`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .. import storage
from ..files.writing import Draft
from ..format.manifest import GroupEntry, Manifest, ModelFile, ParamEntry, model_tensor

if TYPE_CHECKING:
    from ..state.model_state import ModelTensors
    from ..state.sharding_model import Sharding


def draft(
    groups: Sequence[GroupEntry],
    sharding: Sharding,
    kind: str,
    model: ModelTensors | None = None,
    given_step: int | None = None,
) -> Draft:
    """A save's manifest before anything is written: the groups as taken at the save's start,
    the params from the grid (their dtypes and scalars the ranks report), its kind,
    ``model``'s other tensors and tied names (:class:`ModelFile`), and the step
    ``extra["step"]`` gave, else (recorded at the commit) the optimizer's count where it
    keeps one."""
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
    )
    return Draft(manifest, record_step=True)
