"""muonckpt: checkpoint, inspect and reshard the sharded optimizer state of Muon.

The top level holds what a training script calls (``_PUBLIC``, the one list of it); the
rest are namespaces: :mod:`muonckpt.optim` (the packaged Muon and its math),
:mod:`muonckpt.sharding` (the ZeRO-1 param sharder), :mod:`muonckpt.layout` (the layout math),
:mod:`muonckpt.collectives` (process groups and the rendezvous timeout), :mod:`muonckpt.kinds`
(optimizer families), :mod:`muonckpt.offline` (the offline tools), :mod:`muonckpt.demo` and
:mod:`muonckpt.settings` (the bounds of the settings, sizes as ``"5GB"``, local paths).

The names load their modules (and torch) on first use, so that the command line's ``--help``
and the torch-free modules (``errors``, ``layout``, ``manifest``) import quickly.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__version__ = "0.1.0"

_PUBLIC: dict[str, str] = {
    "save": "checkpoint",
    "async_save": "checkpoint",
    "load": "checkpoint",
    "LoadReport": "checkpoint",
    "latest": "retention",
    "clean": "retention",
    "verify": "pieces",
    "read_manifest": "pieces",
    "install_hooks": "hooks",
    "gather_state_dict": "hooks",
    "REPLICATED": "placement",
    "RNGState": "trainstate",
    "MuonCkptError": "errors",
    "CheckpointError": "errors",
    "StateDictError": "errors",
    "LayoutError": "errors",
    "CollectiveError": "errors",
    "CheckpointWarning": "errors",
    "ConversionWarning": "errors",
}
"""The top-level names (``__all__``), each with the module that defines it."""

_MOVED: dict[str, str] = {
    "Muon": "optim",
    "MuonDistMeta": "optim",
    "adjusted_lr": "optim",
    "newton_schulz": "optim",
    "normalize_range": "optim",
    "ShardedParams": "sharding",
    "shard_for_groups": "sharding",
    "shard_param_groups": "sharding",
    "LayoutOptions": "layout",
    "ParamSpec": "layout",
    "Topology": "layout",
    "arrange": "layout",
    "default_group_from_env": "collectives",
    "global_rank": "collectives",
    "grid_groups": "collectives",
    "rendezvous_timeout": "collectives",
    "set_rendezvous_timeout": "collectives",
    "run_demo": "demo",
    "FAMILIES": "kinds",
    "DCP_FAMILIES": "kinds",
}
"""Names the top level held up to 0.1.0, each with its namespace: they still work, with a
:class:`DeprecationWarning`, for one release."""

_NAMESPACES = frozenset(
    {
        "optim",
        "sharding",
        "layout",
        "collectives",
        "launch",
        "kinds",
        "offline",
        "demo",
        "errors",
        "settings",
    }
)
"""The public modules, which ``muonckpt.NAME`` imports on first use as it does the names."""

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _NAMESPACES:
        return importlib.import_module(f".{name}", __name__)
    if name in _MOVED:
        where = f"{__name__}.{_MOVED[name]}"
        warnings.warn(
            f"{__name__}.{name} moved to {where}.{name}; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(where), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | _NAMESPACES)
