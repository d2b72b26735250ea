"""The options of a save, defined once: :class:`SaveOptions`, which :func:`muonckpt.save` and
:func:`muonckpt.async_save` build from their keywords (and check) at the call, then hand down
whole to every step of the save."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import settings
from ..errors import OptionError
from ..files.progress import Progress
from ..storage.places import location
from ..storage.s3 import S3Url


@dataclass(frozen=True)
class LocalTier:
    """A fast tier beside the durable target: each rank's share written to its node's own
    directory and copied to ``replicas`` other nodes' (docs/format.md, "The node-local tier"),
    the durable target written every ``durable_every`` saves. A node is what the launcher says
    it is (``node``, else torchrun's ``GROUP_RANK``), never the host name. Recover with
    :func:`muonckpt.recover`."""

    root: str | os.PathLike[str]
    """This node's directory of local steps (a node's own disk, or ``/dev/shm``): each save
    writes ``root/NAME``, NAME the durable target's last component. May differ per node."""
    replicas: int = 1
    """On how many other nodes each rank's share is copied (at least 1; fewer than the
    nodes)."""
    durable_every: int = 0
    """Also write the durable target (the save's ``path``) every this many tiered saves of
    the process, counted from its first (0: never; 1: every save)."""
    keep_last: int | None = 2
    """Local steps each node keeps (the new one among them; None: all)."""
    node: int | None = None
    """This process's node (None: torchrun's ``GROUP_RANK``)."""

    def __post_init__(self) -> None:
        settings.local_path(os.fspath(self.root))
        _check_count("replicas", self.replicas, least=1)
        _check_count("durable_every", self.durable_every, least=0)
        if self.keep_last is not None:
            _check_count("keep_last", self.keep_last, least=1, none="or None")
        if self.node is not None:
            _check_count("node", self.node, least=0, none="or None")

    def node_id(self) -> int:
        """This process's node: :attr:`node`, else torchrun's ``GROUP_RANK``."""
        if self.node is not None:
            return self.node
        found = os.environ.get("GROUP_RANK")
        if found is None or not found.isdigit():
            raise OptionError(
                "LocalTier needs the node of this process: launch with torchrun (GROUP_RANK) "
                "or pass LocalTier(node=...)"
            )
        return int(found)

    def agreement(self) -> dict[str, Any]:
        """What every rank's tier must have alike (not the root, which is each node's own)."""
        return {
            "replicas": self.replicas,
            "durable_every": self.durable_every,
            "keep_last": self.keep_last,
        }


@dataclass(frozen=True)
class SaveOptions:
    """How to save: the keywords of :func:`muonckpt.save` (and, with ``timeout``, of
    :func:`muonckpt.async_save`), checked when the record is made (a ``timeout`` that is not
    positive, a ``max_shard_size`` that is no size are refused there; ``keep_last`` and the
    values of ``extra`` in the save's stage step, where every rank's refusal is every rank's).
    """

    consolidated: bool = False
    """Gather full-shape tensors on rank 0 and write the state as ``state.<param>.<key>`` in
    ``optimizer.safetensors`` and the params by name in ``model.safetensors``
    (:func:`muonckpt.format.writeplan.consolidated_plan`), instead of one file per rank (no
    gathering; only metadata crosses ranks)."""
    max_shard_size: int | str | None = None
    """With ``consolidated``, split each family of files past this many bytes, HF style: an
    int, or a string as the CLI and Hugging Face take it (``"5GB"`` is 5 * 10**9 bytes,
    ``"5GiB"`` 5 * 2**30; :func:`muonckpt.settings.parse_size`). As bytes:
    :attr:`shard_bytes`."""
    params: bool = True
    """Also save the optimizer's params (the default), so that :func:`muonckpt.load` restores
    them; False saves the optimizer state only, for weights kept elsewhere."""
    overwrite: bool = False
    """Replace an existing checkpoint at the path (otherwise an error)."""
    keep_last: int | None = None
    """After the commit, delete the older complete muonckpt checkpoints of the path's run
    beside it (directly under its parent, named as it is but for its step, each checkpoint's
    step as its manifest records it: ``step-10`` beside ``step-30``, never ``seed2-step-10``
    beside ``seed1-step-30``) so that ``keep_last`` remain, the new one always among them. A
    new checkpoint that records no step, or whose name does not hold it once, deletes nothing
    and warns (:func:`muonckpt.files.retention.prune`)."""
    model: torch.nn.Module | None = None
    """With ``consolidated``, the model the params belong to (the optimizer's param names must
    be its ``state_dict()`` names): ``model.safetensors`` then holds its whole
    ``state_dict()``, buffers and params no optimizer holds taken from the destination rank's
    model, tied names stored once and recorded in the file's metadata (alias -> stored name,
    as ``safetensors.torch.save_model`` does), so that ``safetensors.torch.load_model(model,
    ...)`` loads it strictly."""
    extra: Mapping[str, Any] | None = None
    """The training job's own state, saved in the same atomic commit: a dict of JSON values
    (numbers, strings, booleans, None, lists, dicts with string keys), tensors (on any device;
    copied to host memory at the call) and objects with ``state_dict()`` /
    ``load_state_dict()`` (an LR scheduler), saved as their state dict. Every rank passes the
    same (compared by a digest: ranks that differ fail the save, nothing written); rank 0
    stores it. ``extra["step"]``, a non-negative int, is the step the checkpoint records
    (``inspect``, :func:`muonckpt.latest`)."""
    rank_extra: Mapping[str, Any] | None = None
    """Each rank's own values, as ``extra`` but stored per rank (RNG states:
    :class:`muonckpt.RNGState`; a data loader's position); every rank passes one, or none
    does."""
    local: bool = False
    """The optimizer is this process's alone, not a DDP replica: saved by this process alone,
    whatever process group is initialized (each rank its own optimizer to its own path, or one
    rank only). Without it an optimizer without hooks in a process group is a replica on every
    rank of the world, and every rank must call ``save``. Refused for an optimizer that keeps
    state on other ranks."""
    background: bool = False
    """Write and commit in the background (:func:`muonckpt.async_save`), from host copies
    taken at the call."""
    timeout: float | None = None
    """(``background``) Seconds (positive) rank 0 waits at each step for the slowest rank
    before the save fails on every rank still there (the others wait twice that for rank
    0)."""
    progress: Progress | None = None
    """This rank's own report of its files written (:data:`muonckpt.offline.Progress`): each
    rank may pass its own, or none (not compared across ranks)."""
    tier: LocalTier | None = None
    """Write to the node-local tier (:class:`LocalTier`) and its replicas; the durable
    ``path`` every ``tier.durable_every`` saves. A per-rank save only."""
    shard_bytes: int | None = field(init=False)
    """``max_shard_size`` as bytes (None: no split)."""

    def __post_init__(self) -> None:
        if self.background:
            settings.seconds(self.timeout, "timeout")
        object.__setattr__(self, "shard_bytes", settings.shard_size(self.max_shard_size))
        if self.tier is not None and (self.consolidated or self.local):
            raise OptionError("a LocalTier save is a per-rank save of the grid's ranks")

    @property
    def operation(self) -> str:
        """The save's name in its messages."""
        return "async_save" if self.background else "save"

    def agreement(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """What every rank's call must have alike (the rendezvous compares it)."""
        where = location(path)
        return {
            "path": str(where) if isinstance(where, S3Url) else os.path.abspath(path),
            "consolidated": self.consolidated,
            "max_shard_size": self.shard_bytes,
            "params": self.params,
            "overwrite": self.overwrite,
            "keep_last": self.keep_last,
            "timeout": self.timeout,
            "model given": self.model is not None,
            "tier": None if self.tier is None else self.tier.agreement(),
        }


def _check_count(name: str, value: object, *, least: int, none: str = "") -> None:
    """Refuse a setting that is not an int of at least ``least`` (a bool is not a count)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        alternative = f" {none}" if none else ""
        raise OptionError(f"{name} must be an int >= {least}{alternative}, got {value!r}")
