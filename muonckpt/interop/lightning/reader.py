"""Lightning's ``epoch=E-step=S.ckpt`` checkpoints of torch.optim.Muon + AdamW jobs, read into
muonckpt's format.

:func:`from_lightning` reads the file (one ``torch.save`` pickle, by the restricted
unpickler: ``state_dict``, the LightningModule's tensors in the model's order, and
``optimizer_states``, each optimizer's ``state_dict()`` keyed by param index) into a
consolidated muonckpt checkpoint keyed by the LightningModule's names (``model.w1.weight``;
``muonckpt.load(..., rename={"model.": ""})`` loads them into the bare model's optimizer),
with each param's value, torch.optim.Muon's momentum, AdamW's moments and step, and
``global_step`` as the checkpoint's step; the module's buffers go in as the model's other
tensors. The job's own state (``global_step``, ``epoch``, ``loops``, ``lr_schedulers``,
``callbacks``, ``hyper_parameters``) goes into the output's ``extra`` (:mod:`.job_state`);
anything else is left out, listed by name.
Which index is which param: :mod:`._torch_optim`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ...errors import CheckpointError
from ...files.progress import Progress
from ...storage import access
from .._torch_optim import (
    ModelState,
    OptimizerState,
    convert_optimizers,
    load,
)
from ..foreign import Conversion
from . import job_state

__all__ = ["SOURCE", "from_lightning", "is_lightning"]

SOURCE = "lightning"
USED = ("state_dict", "optimizer_states")
SUFFIX = ".ckpt"


def is_lightning(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a Lightning checkpoint: a ``.ckpt`` file (its name only)."""
    path = Path(path)
    return path.suffix == SUFFIX and access.is_file(path)


def from_lightning(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    source: str = SOURCE,
    to: str | None = None,
    names: str | os.PathLike[str] | Sequence[Sequence[str]] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Conversion:
    """Convert the Lightning checkpoint ``src`` (a ``.ckpt`` file) of a torch.optim.Muon +
    AdamW job into a consolidated muonckpt checkpoint at ``dst`` for the muonckpt family ``to``
    (None: torch's own form, EMA momentum). ``names`` as for
    :func:`~.accelerate.from_accelerate`.

    Memory: the whole checkpoint once, plus one tensor.
    """
    import torch

    if source != SOURCE:
        raise CheckpointError(f"a Lightning checkpoint is read as {SOURCE!r}, not {source!r}")
    path = Path(src)
    if not is_lightning(path):
        raise CheckpointError("is not a Lightning checkpoint (a .ckpt file)", path=path)
    top = load(path)
    model = top.get("state_dict") if isinstance(top, dict) else None
    if not isinstance(model, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()
    ):
        raise CheckpointError("holds no 'state_dict' of named tensors", path=path)
    states = top.get("optimizer_states")
    if not isinstance(states, list) or not states:
        raise CheckpointError(
            "holds no 'optimizer_states' (saved with save_weights_only, or by a strategy "
            "that keeps the optimizer elsewhere)",
            path=path,
        )
    optimizers = [OptimizerState(f"optimizer_states[{k}]", path, s) for k, s in enumerate(states)]
    step = top.get("global_step")
    step = step if type(step) is int and step >= 0 else None
    found = job_state.read(top, step)
    path_out, layout, notes = convert_optimizers(
        ModelState(dict(model), ordered=True), optimizers, dst,
        names=names, to=to, overwrite=overwrite, progress=progress,
        source=path, recorded_step=step, trainer=found.state,
    )  # fmt: skip
    kept = {*USED, *found.items}
    left = tuple(str(key) for key in top if key not in kept) + found.left
    return Conversion(path_out, layout, left, notes)
