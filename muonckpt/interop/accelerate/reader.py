"""Hugging Face accelerate's ``Accelerator.save_state`` directories of torch.optim.Muon +
AdamW jobs, read into muonckpt's format.

:func:`from_accelerate` reads the directory (``model.safetensors`` or ``pytorch_model.bin``,
``optimizer.bin`` and ``optimizer_N.bin``: each a pickled ``optimizer.state_dict()`` keyed by
param index, read by the restricted unpickler) into a consolidated muonckpt checkpoint keyed
by the model's names, with each param's value, torch.optim.Muon's momentum and AdamW's
moments and step; the model's buffers go in as its other tensors. The schedulers' state
(``scheduler.bin``) and each process's RNG states (``random_states_N.pkl``) go into the
output's ``extra`` (:mod:`.job_state`); every other file is left out unread, listed by name.
Which index is which param: :mod:`._torch_optim`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ...errors import CheckpointError
from ...files.progress import Progress
from .._torch_optim import (
    ModelState,
    OptimizerState,
    convert_optimizers,
    load,
)
from ..foreign import Conversion
from . import job_state
from .files import accelerate_files, is_accelerate, read_model

__all__ = ["SOURCE", "from_accelerate", "is_accelerate"]

SOURCE = "accelerate"


def from_accelerate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    source: str = SOURCE,
    to: str | None = None,
    names: str | os.PathLike[str] | Sequence[Sequence[str]] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Conversion:
    """Convert the accelerate ``save_state`` directory ``src`` of a torch.optim.Muon + AdamW
    job into a consolidated muonckpt checkpoint at ``dst`` for the muonckpt family ``to``
    (None: torch's own form, EMA momentum).

    Args:
        names: which param each optimizer's indices are, where the files do not say (no
            ``param_names``, and shapes that do not tell): per optimizer, the list of its
            params' names in the order its param groups list them, or a JSON file of that.

    Memory: the model and every optimizer's state, once, plus one tensor.
    """
    if source != SOURCE:
        raise CheckpointError(f"an accelerate save_state is read as {SOURCE!r}, not {source!r}")
    files = accelerate_files(src)
    model = ModelState(read_model(files.model), ordered=files.model.suffix == ".bin")
    optimizers = [OptimizerState(p.name, p, load(p)) for p in files.optimizers]
    found = job_state.read(files.directory, files.others)
    path, layout, notes = convert_optimizers(
        model, optimizers, dst,
        names=names, to=to, overwrite=overwrite, progress=progress, source=files.directory,
        trainer=found.state,
    )  # fmt: skip
    unread = tuple(f"{n} (not read)" for n in files.others if n not in found.items)
    return Conversion(path, f"save_state of {layout}", unread + found.left, notes)
