"""accelerate out: any muonckpt checkpoint as the directory ``Accelerator.save_state`` writes
for a torch.optim.Muon + AdamW job, which ``accelerator.load_state`` restores at any world
size (:func:`to_accelerate`)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ...errors import OptionError
from ...files.pieces import PieceReader
from ...files.progress import Progress
from ...format.manifest import Manifest
from ...format.names import MANIFEST_NAME
from ...storage import CheckpointFiles, torch_pickles
from ...storage.safetensors_writer import write_safetensors
from .._foreign_out import not_carried, open_local, staged_output
from .._torch_optim_out import TRAINER_STATE, torch_job_state
from .._trainer_state import Carried, carried, recorded
from ..foreign import Conversion
from . import job_state
from .files import MODEL_FILES, optimizer_file
from .reader import SOURCE


def to_accelerate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str = SOURCE,
    world: int | None = None,
    progress: Progress | None = None,
) -> Conversion:
    """Write the muonckpt checkpoint ``src`` (any kind, any topology) as an accelerate
    ``save_state`` directory at the new ``dst``: ``model.safetensors`` (the model's state dict:
    each param's values and the model's other tensors; of a tie, the stored name alone, as
    accelerate saves it) and ``optimizer.bin`` (torch.optim.Muon's ``state_dict()``), then
    ``optimizer_1.bin`` (torch.optim.AdamW's), in the job :mod:`.._torch_optim_out` describes:
    the job prepares its optimizers in that order. DDP keeps one copy of that state on every
    rank, so ``accelerator.load_state(dst)`` restores it at any world size. The job's own state
    a conversion from accelerate carried (:mod:`.job_state`) goes back too: the schedulers'
    ``scheduler.bin``, and each process's ``random_states_{rank}.pkl`` where ``world`` (the
    number of processes the job resumes at) is the number they were saved at; else they are
    left out and listed (accelerate's load goes on without them), never handed to other
    ranks. ``progress`` is told each tensor read.

    Memory: the whole checkpoint once.
    """
    if to != SOURCE:
        raise OptionError(f"accelerate output is for {SOURCE!r}, not {to!r}", "--to")
    directory, files, manifest = open_local(src)
    with staged_output(dst, directory, SOURCE) as (_, staging):
        with PieceReader(files, manifest) as reader:
            job = torch_job_state(manifest, reader, directory, progress)
        write_safetensors(staging / MODEL_FILES[0], job.model, {"format": "pt"})
        for index, state in enumerate(job.optimizers):
            torch_pickles.save(staging / optimizer_file(index), state)
        trainer = _carried(files, manifest, world)
        job_state.written(trainer, staging, directory / MANIFEST_NAME)
    left = [f"{alias} (tied to {stored}: saved once, as accelerate does)" for alias, stored in
            sorted(job.aliases.items())]  # fmt: skip
    afresh = () if recorded(manifest) is not None else (TRAINER_STATE,)  # (else each named)
    left += [*job.left, *afresh, *not_carried(manifest, trainer)]
    layout = f"save_state of {len(job.optimizers)} optimizer(s): {', '.join(job.classes)}"
    return Conversion(Path(dst), layout, tuple(left), tuple(job.notes))


def _carried(files: CheckpointFiles, manifest: Manifest, world: int | None) -> Carried:
    """What of ``manifest``'s trainer state an accelerate job of ``world`` processes takes: the
    per-rank RNG states only at the number they were saved at, and only where ``world`` says
    it (accelerate's load does not check it)."""
    layout = {"processes": world} if world is not None else None
    trainer = carried(files, manifest, job_state.NAME, layout)
    if world is not None or not trainer.ranks:
        return trainer
    unknown = tuple(
        f"{name} (per process: give --world, the number of processes the job resumes at; "
        f"written only at the number they were saved at): {job_state.RESTORE[name]}"
        for name in trainer.ranks
    )
    return replace(trainer, ranks={}, left=trainer.left + unknown)
