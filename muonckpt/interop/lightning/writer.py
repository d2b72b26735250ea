"""Lightning out: any muonckpt checkpoint as a ``.ckpt`` that ``Trainer.fit(model,
ckpt_path=...)`` of a torch.optim.Muon + AdamW LightningModule resumes from, at any world size
(:func:`to_lightning`)."""

from __future__ import annotations

import collections
import os
from pathlib import Path

from ...errors import OptionError
from ...files.pieces import PieceReader
from ...files.progress import Progress
from ...storage import torch_pickles
from .._foreign_out import not_carried, open_local, staged_output
from .._torch_optim_out import TRAINER_STATE, torch_job_state
from .._trainer_state import carried, recorded
from ..foreign import Conversion
from . import job_state
from .reader import SOURCE

CHECKPOINT = "last.ckpt"
"""The file written in the output directory (Lightning's name for the newest checkpoint)."""
LIGHTNING_VERSION = "2.6.6"
"""The Lightning version the file says wrote it (its load migrates older ones)."""


def to_lightning(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str = SOURCE,
    progress: Progress | None = None,
) -> Conversion:
    """Write the muonckpt checkpoint ``src`` (any kind, any topology) as the new directory
    ``dst`` holding ``last.ckpt``: ``state_dict`` (the LightningModule's, by the checkpoint's
    names: a checkpoint read from Lightning keeps its ``model.`` prefixes, another is renamed
    first with ``convert --rename``; tied names included), ``optimizer_states`` (torch.optim.Muon's
    ``state_dict()``, then torch.optim.AdamW's, in the job :mod:`.._torch_optim_out` describes:
    ``configure_optimizers`` returns them in that order), ``global_step``, and the job's own state a
    conversion from Lightning carried (:mod:`.job_state`: ``loops``, ``lr_schedulers``,
    ``callbacks``, ``epoch``, ``hyper_parameters``), so the fit loop, the schedule and the step
    go on where they were; from another source an empty ``lr_schedulers`` (the trainer starts
    its loops and schedulers afresh; another trainer's state is listed as left out). Every
    rank of a ddp job reads the one file, so ``Trainer.fit(model, ckpt_path=dst /
    "last.ckpt")`` resumes it at any world size.
    ``progress`` is told each tensor read.

    Memory: the whole checkpoint once.
    """
    if to != SOURCE:
        raise OptionError(f"Lightning output is for {SOURCE!r}, not {to!r}", "--to")
    directory, files, manifest = open_local(src)
    with staged_output(dst, directory, SOURCE) as (_, staging):
        with PieceReader(files, manifest) as reader:
            job = torch_job_state(manifest, reader, directory, progress)
        state_dict = collections.OrderedDict(job.model)
        state_dict.update((alias, job.model[stored]) for alias, stored in job.aliases.items())
        step = manifest.recorded_step or manifest.latest_step([e.name for e in manifest.params])
        trainer = carried(files, manifest, job_state.NAME)
        checkpoint = {
            "global_step": step or 0,
            "pytorch-lightning_version": LIGHTNING_VERSION,
            "state_dict": state_dict,
            "optimizer_states": job.optimizers,
            "lr_schedulers": [],
            **trainer.shared,
        }
        torch_pickles.save(staging / CHECKPOINT, checkpoint)
    afresh = () if recorded(manifest) is not None else (TRAINER_STATE,)  # (else each named)
    left = [*job.left, *afresh, *not_carried(manifest, trainer)]
    layout = f"{CHECKPOINT} of {len(job.optimizers)} optimizer(s): {', '.join(job.classes)}"
    return Conversion(Path(dst), layout, tuple(left), tuple(job.notes))
