"""muonckpt: checkpoint, inspect and reshard the sharded optimizer state of Muon."""

from .checkpoint import load, read_manifest, save, verify
from .errors import CheckpointError, CollectiveError, LayoutError, MuonCkptError, StateDictError
from .hooks import gather_state_dict, install_hooks
from .layout import ParamSpec, Topology, arrange
from .optim import Muon, MuonDistMeta, adjusted_lr, newton_schulz, normalize_range
from .sharding import ShardedParams, shard_for_groups, shard_param_groups

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "LayoutError",
    "Muon",
    "MuonCkptError",
    "MuonDistMeta",
    "ParamSpec",
    "ShardedParams",
    "StateDictError",
    "Topology",
    "adjusted_lr",
    "arrange",
    "gather_state_dict",
    "install_hooks",
    "load",
    "newton_schulz",
    "normalize_range",
    "read_manifest",
    "save",
    "shard_for_groups",
    "shard_param_groups",
    "verify",
]
