"""muonckpt: checkpoint, inspect and reshard the sharded optimizer state of Muon.

The public names below load their modules (and torch) on first use, so that the command line's
``--help`` and the torch-free modules (``errors``, ``layout``, ``manifest``) import quickly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointError,
    CheckpointWarning,
    CollectiveError,
    ConversionWarning,
    LayoutError,
    MuonCkptError,
    StateDictError,
)
from .layout import LayoutOptions, ParamSpec, Topology, arrange

if TYPE_CHECKING:
    from .checkpoint import LoadReport, async_save, load, save
    from .collectives import (
        default_group_from_env,
        global_rank,
        grid_groups,
        rendezvous_timeout,
        set_rendezvous_timeout,
    )
    from .demo import run_demo
    from .hooks import gather_state_dict, install_hooks
    from .kinds import DCP_FAMILIES, FAMILIES
    from .optim import Muon, MuonDistMeta, adjusted_lr, newton_schulz, normalize_range
    from .pieces import read_manifest, verify
    from .placement import REPLICATED
    from .retention import clean, latest
    from .sharding import ShardedParams, shard_for_groups, shard_param_groups
    from .trainstate import RNGState

__version__ = "0.1.0"

_LAZY = {
    "DCP_FAMILIES": "kinds",
    "FAMILIES": "kinds",
    "LoadReport": "checkpoint",
    "async_save": "checkpoint",
    "REPLICATED": "placement",
    "clean": "retention",
    "latest": "retention",
    "load": "checkpoint",
    "read_manifest": "pieces",
    "RNGState": "trainstate",
    "save": "checkpoint",
    "verify": "pieces",
    "gather_state_dict": "hooks",
    "default_group_from_env": "collectives",
    "global_rank": "collectives",
    "grid_groups": "collectives",
    "rendezvous_timeout": "collectives",
    "set_rendezvous_timeout": "collectives",
    "install_hooks": "hooks",
    "Muon": "optim",
    "MuonDistMeta": "optim",
    "adjusted_lr": "optim",
    "newton_schulz": "optim",
    "normalize_range": "optim",
    "run_demo": "demo",
    "ShardedParams": "sharding",
    "shard_for_groups": "sharding",
    "shard_param_groups": "sharding",
}

__all__ = [
    "DCP_FAMILIES",
    "FAMILIES",
    "REPLICATED",
    "CheckpointError",
    "CheckpointWarning",
    "CollectiveError",
    "ConversionWarning",
    "LayoutError",
    "LayoutOptions",
    "LoadReport",
    "Muon",
    "MuonCkptError",
    "MuonDistMeta",
    "ParamSpec",
    "RNGState",
    "ShardedParams",
    "StateDictError",
    "Topology",
    "adjusted_lr",
    "arrange",
    "async_save",
    "clean",
    "default_group_from_env",
    "gather_state_dict",
    "global_rank",
    "grid_groups",
    "install_hooks",
    "latest",
    "load",
    "newton_schulz",
    "normalize_range",
    "read_manifest",
    "rendezvous_timeout",
    "run_demo",
    "save",
    "set_rendezvous_timeout",
    "shard_for_groups",
    "shard_param_groups",
    "verify",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
