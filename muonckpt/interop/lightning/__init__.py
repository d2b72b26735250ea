"""Lightning's ``.ckpt`` checkpoints of torch.optim.Muon + AdamW jobs, in and out.

Modules: :mod:`.reader` (:func:`from_lightning`: one ``torch.save`` file read by the
restricted unpickler), :mod:`.writer` (:func:`to_lightning`). Which optimizer index is which
param: :mod:`.._torch_optim` in, :mod:`.._torch_optim_out` out, shared with
:mod:`..accelerate`.
Here: ``FORMAT``, the format as :mod:`..registry` holds it, with its options.
"""

from __future__ import annotations

from .._torch_optim import TrainerReadOptions
from ..foreign import ForeignFormat, NoOptions
from .reader import SOURCE, from_lightning, is_lightning
from .writer import to_lightning

__all__ = ["FORMAT", "from_lightning", "is_lightning", "to_lightning"]


FORMAT: ForeignFormat[TrainerReadOptions, NoOptions] = ForeignFormat(
    name="lightning",
    title="Lightning",
    detect=is_lightning,
    reader=from_lightning,
    sources=(SOURCE,),
    read_options=TrainerReadOptions,
    writer=to_lightning,
    write_options=NoOptions,
    targets=(SOURCE,),
    records_source=True,
)
"""Lightning's ``.ckpt`` in the registry (:mod:`muonckpt.interop.registry`)."""
