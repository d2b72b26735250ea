"""muonckpt: checkpoint, inspect and reshard the sharded optimizer state of Muon."""

from .errors import CheckpointError, CollectiveError, LayoutError, MuonCkptError, StateDictError
from .optim import Muon, MuonDistMeta, adjusted_lr, newton_schulz, normalize_range

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "LayoutError",
    "Muon",
    "MuonCkptError",
    "MuonDistMeta",
    "StateDictError",
    "adjusted_lr",
    "newton_schulz",
    "normalize_range",
]
