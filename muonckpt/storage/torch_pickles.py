"""``torch.save`` files of other trainers (DeepSpeed's ZeRO files, Megatron-Core's
``--ckpt-format torch`` files, accelerate's ``optimizer.bin``, Lightning's ``.ckpt``), read
safely: only by ``torch.load(weights_only=True)``, torch's restricted unpickler,
with an allow-list of stand-in classes of muonckpt's own for the few foreign classes a
format's pickles name. The foreign package need not be installed,
nothing of the file runs, and any other global is refused before it resolves; the refusal
names the file and the global. Every file is opened as muonckpt opens its own
(:func:`~.durable.open_regular`), and read under :mod:`.foreign_limits`: its archive checked
before anything is decompressed, what it holds walked before anything of it is used.
"""

from __future__ import annotations

import os
import re
import types
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from . import access
from .durable import open_failure, open_regular
from .foreign_limits import check_archive, check_value

__all__ = ["Opaque", "load", "refusal", "save"]


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
    tensors, containers, numbers, strings and those classes only, within the limits of
    :mod:`.foreign_limits` (:func:`~.foreign_limits.check_archive` before the load,
    :func:`~.foreign_limits.check_value` after it).

    Raises:
        CheckpointError: naming ``path``, for a file that cannot be read, is truncated, is
            over a limit or is refused (``holds`` says what a file of its format holds).
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
            held = check_archive(f, path)
            with warnings.catch_warnings(), torch.serialization.safe_globals(allowed):
                warnings.simplefilter("ignore")  # torch's notes on a foreign file's protocol
                content = torch.load(f, map_location="cpu", weights_only=True)
        except CheckpointError:
            raise
        except OSError as exc:
            raise CheckpointError(f"cannot read: {exc.strerror}", path=path) from None
        except Exception as exc:
            raise CheckpointError(
                f"refused or unreadable, nothing of it was run ({holds}): "
                f"{type(exc).__name__}: {refusal(exc)}",
                path=path,
            ) from None
    check_value(content, path, held=held)
    return content


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GLOBAL = re.compile(r"GLOBAL (\S+)")
_BOILERPLATE = (
    "Weights only load failed",
    "Check the documentation",
    "In PyTorch 2.6",
    "Please file an issue",  # its line ends "WeightsUnpickler error:", the cause on the next
)


def save(path: Path, obj: Any, names: Mapping[type, str] | None = None) -> int:
    """Write ``obj`` to the new file ``path`` with ``torch.save``, fsynced; its size. What
    another trainer's ``torch.load`` reads. ``names``: stand-in classes written as the foreign
    classes they stand in for (``module.Class``), so that the trainer's load gets its own
    objects while nothing of the trainer is imported here. This module's writes and its
    restricted loads are the package's only pickling of torch files
    (``tests/test_no_pickle.py``)."""
    import pickle

    import torch

    class Pickler(pickle._Pickler):  # Python's pickler: its save_global can be given the name
        def save_global(self, obj: Any, name: str | None = None) -> None:
            qualified = (names or {}).get(obj) if isinstance(obj, type) else None
            if qualified is None:
                super().save_global(obj, name)  # type: ignore[misc]
                return
            module, _, attribute = qualified.rpartition(".")
            self.write(pickle.GLOBAL + f"{module}\n{attribute}\n".encode())  # type: ignore[attr-defined]
            self.memoize(obj)  # type: ignore[attr-defined]

    pickler = types.SimpleNamespace(Pickler=Pickler, __name__="pickle") if names else pickle
    with access.new_file(path) as f:
        torch.save(obj, f, pickle_module=pickler)
        return f.tell()


def refusal(exc: BaseException) -> str:
    """What a refusal of ``torch.load(weights_only=True)`` says was refused, in one line
    without terminal codes: the blocked global (``GLOBAL posix.system``) where it names one,
    else its first line past torch's advice on ``weights_only``."""
    text = _ANSI.sub("", str(exc))
    named = _GLOBAL.search(text)
    if named is not None:
        name = re.sub(r"[^\x21-\x7e]", "?", named.group(1).rstrip("."))[:120]
        return f"GLOBAL {name} is not allowed"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith(_BOILERPLATE)]
    return one_line(Exception((said or lines or [""])[0]))


def one_line(exc: BaseException) -> str:
    """An exception's message in an error line: one line, at most 200 characters."""
    return " ".join(str(exc).split())[:200]
