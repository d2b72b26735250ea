"""Hugging Face accelerate's ``Accelerator.save_state`` directories of torch.optim.Muon +
AdamW jobs, read only.

Modules: :mod:`.reader` (:func:`from_accelerate`), :mod:`.files` (the
directory's model and optimizer files found and read safely). Which optimizer index is which
param: :mod:`.._torch_optim`, shared with :mod:`..lightning`.
Here: ``FORMAT``, the format as :mod:`..registry` holds it, with its options.
"""

from __future__ import annotations

from pathlib import Path

from .._torch_optim import TrainerReadOptions
from ..foreign import Conversion, ForeignFormat, NoOptions, Reading
from .reader import SOURCE, from_accelerate, is_accelerate

__all__ = ["FORMAT", "from_accelerate", "is_accelerate"]


def _read(src: Path, dst: Path, reading: Reading, options: TrainerReadOptions) -> Conversion:
    return from_accelerate(
        src,
        dst,
        source=reading.source,
        to=reading.to,
        names=options.names,
        overwrite=reading.overwrite,
        progress=reading.progress,
    )


FORMAT: ForeignFormat[TrainerReadOptions, NoOptions] = ForeignFormat(
    name="accelerate",
    title="accelerate",
    detect=is_accelerate,
    read=_read,
    sources=(SOURCE,),
    read_options=TrainerReadOptions,
    records_source=True,
)
"""accelerate's ``save_state`` in the registry (:mod:`muonckpt.interop.registry`): read only."""
