"""muonckpt: checkpoint, inspect and reshard the sharded optimizer state of Muon.

The top level holds what a training script calls (``_PUBLIC``, the one list of it); the rest
are the public namespaces (``NAMESPACES``): :mod:`muonckpt.optim` (the packaged Muon and its
ZeRO-1 sharder), :mod:`muonckpt.layout` (the layout math), :mod:`muonckpt.distributed` (process
groups, the rendezvous timeout, local launches), :mod:`muonckpt.format` (the optimizer families
a checkpoint records), :mod:`muonckpt.offline` (the offline tools), :mod:`muonckpt.interop`
(foreign formats), :mod:`muonckpt.errors`, :mod:`muonckpt.settings` and :mod:`muonckpt.demo`.

The names load their modules (and torch) on first use, so that the command line's ``--help``
and the torch-free layers (``errors``, ``layout``, ``format``) import quickly.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re

from ._namespace import lazy_names

logging.getLogger(__name__).addHandler(logging.NullHandler())  # silent unless configured

__version__ = "0.1.0"

_TORCH_FLOOR = (2, 13)
"""The lowest torch release the fast tier has passed on (pyproject.toml's ``torch>=``; how it
was found, and the job that reruns it: README.md, Development)."""


def _torch_too_old(found: str) -> str | None:
    """The one line an installed torch of version ``found`` is refused with, or None when it is
    :data:`_TORCH_FLOOR` or newer (``2.13.0+cpu``, ``2.14.0.dev20260101`` pass)."""
    release = tuple(int(part) for part in re.findall(r"\d+", found)[:2])
    if release >= _TORCH_FLOOR:
        return None
    needed = ".".join(map(str, _TORCH_FLOOR))
    return (
        f"muonckpt needs torch>={needed}, and torch {found} is installed: "
        f"pip install 'torch>={needed}'"
    )


def _check_torch() -> None:
    """Refuse an older torch at ``import muonckpt``, in one line, from the ``torch/version.py``
    every torch build ships (run alone: torch itself is not imported, and ``importlib.metadata``
    would cost the command line more than the check); ``MUONCKPT_ALLOW_OLD_TORCH=1`` (the job
    that tries a lower floor) lets it through."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return  # no torch: the first module that needs it says so
    where = os.path.join(os.path.dirname(spec.origin), "version.py")
    version_spec = importlib.util.spec_from_file_location("muonckpt._torch_version", where)
    if version_spec is None or version_spec.loader is None:
        return
    version = importlib.util.module_from_spec(version_spec)
    version_spec.loader.exec_module(version)
    refusal = _torch_too_old(str(version.__version__))
    if refusal is not None and not os.environ.get("MUONCKPT_ALLOW_OLD_TORCH"):
        raise ImportError(refusal)


_check_torch()

_PUBLIC: dict[str, str] = {
    "save": ".checkpoint.api",
    "async_save": ".checkpoint.api",
    "load": ".checkpoint.api",
    "LoadReport": ".checkpoint.api",
    "LocalTier": ".checkpoint.options",
    "recover": ".checkpoint.tiers",
    "Recovery": ".checkpoint.tiers",
    "latest": ".checkpoint.newest",
    "clean": ".files.retention",
    "verify": ".files.pieces",
    "doctor": ".offline.doctor",
    "read_manifest": ".files.pieces",
    "install_hooks": ".state.hooks",
    "gather_state_dict": ".state.hooks",
    "REPLICATED": ".state.sharding_model",
    "RNGState": ".state.trainstate",
    "ProgressLines": ".files.progress",
    "MuonCkptError": ".errors",
    "CheckpointError": ".errors",
    "ArgumentError": ".errors",
    "StateDictError": ".errors",
    "LayoutError": ".errors",
    "CollectiveError": ".errors",
    "CheckpointWarning": ".errors",
    "ConversionWarning": ".errors",
}
"""The top-level names (``__all__``), each with the module that defines it."""

NAMESPACES = (
    "optim",
    "layout",
    "distributed",
    "format",
    "offline",
    "interop",
    "errors",
    "settings",
    "demo",
)
"""The public namespaces, which ``muonckpt.NAME`` imports on first use as it does the names;
each lists its names in ``__all__``. The one list: ``tests/test_public_api.py`` checks every
namespace here and that README.md, docs/design.md and this module's docstring name exactly
these, in this order."""

__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, NAMESPACES)
