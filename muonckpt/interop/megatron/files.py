"""Megatron-Core's ``--ckpt-format torch`` files, found and read safely.

``megatron.training``'s ``save_checkpoint`` writes, for the layer-wise distributed optimizer,
``iter_N/mp_rank_XX/model_optim_rng.pt`` (DP rank 0 of TP rank ``XX``: the training ``args``,
the ``model``'s state dict, ``optimizer.state_dict()``, the RNG states) and beside it one
``layer_wise_optimizer_{d}.pt`` per DP rank ``d`` (that rank's ``ChainedOptimizer.state_dict()``:
state keyed by integer ids). They are ``torch.save`` files read only through
:func:`~muonckpt.storage.torch_pickles.load` with :data:`STAND_INS`: ``argparse.Namespace`` becomes
:class:`Namespace` (its attributes only); the numpy arrays of the RNG states and the enums of the
``args`` become :class:`~.torch_pickles.Opaque`; any other global is refused, naming the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...storage import access, torch_pickles
from .._rng_states import NUMPY_STAND_INS

__all__ = [
    "ITERATION_DIR",
    "LATEST",
    "MODEL_FILE",
    "STAND_INS",
    "Namespace",
    "TorchFiles",
    "is_torch_format",
    "load",
    "torch_files",
]

MODEL_FILE = "model_optim_rng.pt"
LATEST = "latest_checkpointed_iteration.txt"
"""The file naming a Megatron checkpoint root's newest iteration."""
ITERATION_DIR = re.compile(r"iter_\d{7}")
"""The name of an iteration's directory, as Megatron writes it."""
_TP_DIR = re.compile(r"mp_rank_(\d+)(_\d+)?(_\d+)?")
_OPTIM_FILE = re.compile(r"layer_wise_optimizer_(\d+)\.pt")


class Namespace:
    """Stand-in for ``argparse.Namespace`` (Megatron's training ``args``): attributes only."""


STAND_INS: dict[str, type] = {
    "argparse.Namespace": Namespace,
    **NUMPY_STAND_INS,
    **dict.fromkeys(
        (
            "signal.Signals",
            "megatron.core.enums.ModelType",
            "megatron.core.enums.Fp8Recipe",
            "megatron.core.enums.Fp4Recipe",
            "megatron.core.transformer.enums.ModelType",
            "megatron.core.transformer.enums.AttnBackend",
            "megatron.core.transformer.enums.AttnMaskType",
            "megatron.core.transformer.enums.CudaGraphScope",
        ),
        torch_pickles.Opaque,
    ),
}
"""The foreign globals a ``--ckpt-format torch`` file may name -> what they become here."""


@dataclass(frozen=True)
class TorchFiles:
    """A torch-format iteration's files: per TP rank, its ``model_optim_rng.pt`` and its DP
    ranks' ``layer_wise_optimizer_{d}.pt``, in rank order."""

    model: tuple[Path, ...]
    optimizer: tuple[tuple[Path, ...], ...]


def is_torch_format(directory: Path) -> bool:
    """Whether ``directory`` holds ``mp_rank_XX/model_optim_rng.pt`` (presence only: a FIFO in
    its place too, which :func:`load` refuses as not a regular file)."""
    return access.is_dir(directory) and any(
        _TP_DIR.fullmatch(n) and access.exists(directory / n / MODEL_FILE)
        for n in access.list_names(directory)
    )


def torch_files(directory: Path) -> TorchFiles:
    """The files of the torch-format iteration ``directory``; refused, naming the directory,
    where the TP ranks or any TP rank's DP ranks are not 0..N-1 or two names are one rank's,
    where pipeline or expert parallelism made the names (``mp_rank_XX_YYY``: not read), or
    where a file is missing."""
    tp_dirs: dict[int, Path] = {}
    for p in _listed(directory):
        match = _TP_DIR.fullmatch(p.name)
        if match is None:
            continue
        if match[2] or match[3]:
            raise CheckpointError(
                f"{p.name}: a pipeline- or expert-parallel torch-format checkpoint (muonckpt "
                "reads TP x DP ones only)",
                path=directory,
            )
        _add(tp_dirs, int(match[1]), p, "TP", directory)
    if not tp_dirs or sorted(tp_dirs) != list(range(len(tp_dirs))):
        raise CheckpointError(
            f"holds TP ranks {sorted(tp_dirs)}, not 0..N-1 (mp_rank_XX)", path=directory
        )
    models, optimizers = [], []
    for t in sorted(tp_dirs):
        where = tp_dirs[t]
        if not access.exists(where / MODEL_FILE):  # (not a regular file: refused reading it)
            raise CheckpointError(f"no {MODEL_FILE}", path=where)
        ranks: dict[int, Path] = {}
        for p in _listed(where):
            if (m := _OPTIM_FILE.fullmatch(p.name)) is not None:
                _add(ranks, int(m[1]), p, "DP", where)
        if not ranks or sorted(ranks) != list(range(len(ranks))):
            raise CheckpointError(
                f"holds layer_wise_optimizer files of DP ranks {sorted(ranks)}, not 0..N-1 "
                "(a torch-format checkpoint of the layer-wise optimizer has one per DP rank)",
                path=where,
            )
        models.append(where / MODEL_FILE)
        optimizers.append(tuple(ranks[d] for d in sorted(ranks)))
    if len({len(o) for o in optimizers}) != 1:
        raise CheckpointError(
            f"its TP ranks hold {[len(o) for o in optimizers]} DP ranks' optimizer files, not "
            "the same number",
            path=directory,
        )
    return TorchFiles(tuple(models), tuple(optimizers))


def _listed(directory: Path) -> list[Path]:
    """The entries of ``directory``, by name."""
    return [directory / name for name in access.list_names(directory)]


def _add(ranks: dict[int, Path], rank: int, path: Path, kind: str, directory: Path) -> None:
    """``path`` as ``kind`` rank ``rank``'s, refused where another name is that rank's too
    (``mp_rank_01`` beside ``mp_rank_1``: which one the save wrote cannot be known)."""
    if rank in ranks:
        raise CheckpointError(
            f"{ranks[rank].name} and {path.name} both name {kind} rank {rank}", path=directory
        )
    ranks[rank] = path


def load(path: Path) -> Any:
    """The content of one of Megatron's ``torch.save`` files
    (:func:`~muonckpt.storage.torch_pickles.load` with :data:`STAND_INS`)."""
    holds = "a Megatron torch-format file holds tensors, its args and RNG states only"
    return torch_pickles.load(path, STAND_INS, holds)
