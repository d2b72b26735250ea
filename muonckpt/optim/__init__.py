"""The packaged Muon: the optimizer (ZeRO-1 + TP, bitwise the seed's design), its ZeRO-1 param
sharder, and where each matrix's Newton-Schulz runs.

A change to the Muon update, to how params are sharded for training, or to the Newton-Schulz
plan goes here. Modules: :mod:`.muon` (the optimizer), :mod:`.sharding` (params sharded for
ZeRO-1 + TP; grads in, params out each step), :mod:`.nsplan` (pure: the worker of each matrix).
"""

from __future__ import annotations

from .muon import NS_COEFFICIENTS, Muon, MuonDistMeta, adjusted_lr, newton_schulz, normalize_range
from .sharding import ShardedParams, shard_for_groups, shard_param_groups, shard_tensor

__all__ = [
    "NS_COEFFICIENTS",
    "Muon",
    "MuonDistMeta",
    "ShardedParams",
    "adjusted_lr",
    "newton_schulz",
    "normalize_range",
    "shard_for_groups",
    "shard_param_groups",
    "shard_tensor",
]
