"""Where a checkpoint's tensors are stored: its file names and the keys of its tensors.

Pure: the names alone, as docs/format.md gives them. The manifest (:mod:`.manifest`) records
which file and key hold each piece; a change to how files or tensors are named goes here.
"""

from __future__ import annotations

MANIFEST_NAME = "manifest.json"
"""The manifest, written last by a save: its commit marker."""
PARAM_KEY = "param"
"""The piece key of a param's own values, beside its state keys (never a state key itself)."""

STATE_STEM = "optimizer"
"""Consolidated state goes to ``optimizer.safetensors`` (or ``optimizer-0000i-of-0000N``)."""
VALUE_STEM = "model"
"""Consolidated param values go to ``model.safetensors``, keyed by param name, as HF has it."""
CONSOLIDATED_FILE = f"{STATE_STEM}.safetensors"
INDEX_FILE = f"{STATE_STEM}.safetensors.index.json"
MODEL_FILE = f"{VALUE_STEM}.safetensors"
MODEL_INDEX_FILE = f"{VALUE_STEM}.safetensors.index.json"


def tensor_key(param: str, key: str) -> str:
    """The key a stored tensor has in its file: the param's name for its values, else torch's
    flattened optimizer-state key ``state.<param name>.<state key>``."""
    return param if key == PARAM_KEY else f"state.{param}.{key}"


def index_file(stem: str) -> str:
    """The Hugging Face style index of a family of sharded files."""
    return f"{stem}.safetensors.index.json"


def stem_of(key: str) -> str:
    """The consolidated file family of a stored tensor: values to ``model``, state to
    ``optimizer``."""
    return VALUE_STEM if key == PARAM_KEY else STATE_STEM


def rank_file(rank: int, world_size: int) -> str:
    """The file of rank ``rank``'s pieces in a per-rank checkpoint."""
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


EXTRA_FILE = "extra.safetensors"
"""The tensors of a save's ``extra`` (the training job's own state, the same on every rank)."""


def extra_rank_file(rank: int, world_size: int) -> str:
    """The tensors of rank ``rank``'s ``rank_extra`` (its own values: RNG, data position)."""
    return f"extra-rank-{rank:05d}-of-{world_size:05d}.safetensors"
