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

import logging

from ._namespace import lazy_names

logging.getLogger(__name__).addHandler(logging.NullHandler())  # silent unless configured

__version__ = "0.1.0"

_PUBLIC: dict[str, str] = {
    "save": ".checkpoint.api",
    "async_save": ".checkpoint.api",
    "load": ".checkpoint.api",
    "LoadReport": ".checkpoint.api",
    "latest": ".files.retention",
    "clean": ".files.retention",
    "verify": ".files.pieces",
    "doctor": ".offline.doctor",
    "read_manifest": ".files.pieces",
    "install_hooks": ".state.hooks",
    "gather_state_dict": ".state.hooks",
    "REPLICATED": ".state.sharding_model",
    "RNGState": ".state.trainstate",
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
