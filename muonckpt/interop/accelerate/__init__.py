"""Hugging Face accelerate's ``Accelerator.save_state`` directories of torch.optim.Muon +
AdamW jobs, in and out.

Modules: :mod:`.reader` (:func:`from_accelerate`), :mod:`.writer` (:func:`to_accelerate`),
:mod:`.files` (the directory's model and optimizer files found and read safely). Which
optimizer index is which param: :mod:`.._torch_optim` in, :mod:`.._torch_optim_out` out,
shared with :mod:`..lightning`.
Here: ``FORMAT``, the format as :mod:`..registry` holds it, with its options.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._torch_optim import TrainerReadOptions
from ..foreign import ForeignFormat
from .reader import SOURCE, from_accelerate, is_accelerate
from .writer import to_accelerate

__all__ = ["FORMAT", "AccelerateWriteOptions", "from_accelerate", "is_accelerate", "to_accelerate"]


@dataclass(frozen=True)
class AccelerateWriteOptions:
    """:func:`to_accelerate`'s options as ``convert`` passes them (``--world``: the number of
    processes the job resumes at, where each process's RNG states are written back)."""

    world: int | None = None


FORMAT: ForeignFormat[TrainerReadOptions, AccelerateWriteOptions] = ForeignFormat(
    name="accelerate",
    title="accelerate",
    detect=is_accelerate,
    reader=from_accelerate,
    sources=(SOURCE,),
    read_options=TrainerReadOptions,
    writer=to_accelerate,
    write_options=AccelerateWriteOptions,
    targets=(SOURCE,),
    records_source=True,
)
"""accelerate's ``save_state`` in the registry (:mod:`muonckpt.interop.registry`)."""
