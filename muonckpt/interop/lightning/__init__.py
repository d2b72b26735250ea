"""Lightning's ``.ckpt`` checkpoints of torch.optim.Muon + AdamW jobs, read only.

Module: :mod:`.reader` (:func:`from_lightning`: one ``torch.save`` file read
by the restricted unpickler). Which optimizer index is which param: :mod:`.._torch_optim`,
shared with :mod:`..accelerate`.
Here: ``FORMAT``, the format as :mod:`..registry` holds it, with its options.
"""

from __future__ import annotations

from pathlib import Path

from .._torch_optim import TrainerReadOptions
from ..foreign import Conversion, ForeignFormat, NoOptions, Reading
from .reader import SOURCE, from_lightning, is_lightning

__all__ = ["FORMAT", "from_lightning", "is_lightning"]


def _read(src: Path, dst: Path, reading: Reading, options: TrainerReadOptions) -> Conversion:
    return from_lightning(
        src,
        dst,
        source=reading.source,
        to=reading.to,
        names=options.names,
        overwrite=reading.overwrite,
        progress=reading.progress,
    )


FORMAT: ForeignFormat[TrainerReadOptions, NoOptions] = ForeignFormat(
    name="lightning",
    title="Lightning",
    detect=is_lightning,
    read=_read,
    sources=(SOURCE,),
    read_options=TrainerReadOptions,
    records_source=True,
)
"""Lightning's ``.ckpt`` in the registry (:mod:`muonckpt.interop.registry`): read only."""
