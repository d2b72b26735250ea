"""``torch.save`` files of other trainers (DeepSpeed's ZeRO files, Megatron-Core's
``--ckpt-format torch`` files, accelerate's ``optimizer.bin``, Lightning's ``.ckpt``), read
safely: only by ``torch.load(weights_only=True)``, torch's restricted unpickler,
with an allow-list of stand-in classes of muonckpt's own for the few foreign classes a
format's pickles name. The foreign package need not be installed,
nothing of the file runs, and any other global is refused before it resolves; the refusal
names the file. Every file is opened as muonckpt opens its own
(:func:`~.durable.open_regular`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .dcp_metadata import one_line
from .durable import open_failure, open_regular

__all__ = ["Opaque", "load"]


class Opaque:
    """Stands in for a foreign value muonckpt reads past and never uses (a numpy array in an
    RNG state, an enum in a trainer's arguments): what it was built from and its pickled
    state, kept as data; nothing of the foreign class runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


def load(path: Path, stand_ins: Mapping[str, type], holds: str) -> Any:
    """The content of the ``torch.save`` file ``path``, by torch's restricted unpickler with
    ``stand_ins`` (a foreign class's qualified name -> the class its pickles become here):
    tensors, containers, numbers, strings and those classes only.

    Raises:
        CheckpointError: naming ``path``, for a file that cannot be read or is refused
            (``holds`` says what a file of its format holds).
    """
    import torch

    try:
        fd = open_regular(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {open_failure(exc)}", path=path) from None
    with os.fdopen(fd, "rb") as f:
        allowed: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
            (cls, name) for name, cls in stand_ins.items()
        ]
        try:
            with warnings.catch_warnings(), torch.serialization.safe_globals(allowed):
                warnings.simplefilter("ignore")  # torch's notes on a foreign file's protocol
                return torch.load(f, map_location="cpu", weights_only=True)
        except OSError as exc:
            raise CheckpointError(f"cannot read: {exc.strerror}", path=path) from None
        except Exception as exc:
            raise CheckpointError(
                f"refused or unreadable, nothing of it was run ({holds}): "
                f"{type(exc).__name__}: {_first_line(exc)}",
                path=path,
            ) from None


def _first_line(exc: BaseException) -> str:
    """The line of torch's refusal that names what was refused."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return one_line(Exception((named or lines or [""])[0]))
