"""DeepSpeed ZeRO checkpoint files, read safely and written plainly.

A DeepSpeed checkpoint directory holds ``latest`` (the tag of the newest save) and one
directory per tag (``global_step3``) with one ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt``
per rank (``bf16_zero_pp_rank_...`` for a bf16 run) and the model states: one
``mp_rank_00_model_states.pt`` at ZeRO-1/2, one ``zero_pp_rank_{r}_mp_rank_00_model_states.pt``
per rank at ZeRO-3; a save with tensor or pipeline parallelism adds ``mp_rank_01_*`` files, which
muonckpt does not read (:func:`rank_files` refuses them). They are ``torch.save`` files whose
pickles name a few DeepSpeed classes. They are read only through
:func:`~muonckpt.storage.torch_pickles.load` (torch's restricted unpickler) with stand-ins of
this module's own for exactly those classes (:data:`STAND_INS`): DeepSpeed need not be
installed, nothing of the file runs, and any other global is refused before it resolves.
Written files hold plain tensors, dicts, lists, numbers and strings (``torch.save``), and
the stand-ins a loader assigns as they are (ZeRO-3's loss scaler), pickled under DeepSpeed's
names (:func:`save`); each is created new and fsynced.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ...storage import access, torch_pickles
from ...storage.durable import file_size, fsync_dir, read_text

LATEST = "latest"
MODEL_STATES = "mp_rank_00_model_states.pt"
DEEPSPEED_FILE = re.compile(
    r"^(?:(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim|model)_states"
    r"|mp_rank_(\d+)_model_states)\.pt$"
)
"""A name of a file DeepSpeed writes into a tag directory, loosely (any digits): a rank's
optimizer file or ZeRO-3 model states file (prefix, rank, model-parallel rank, which) or the
ZeRO-1/2 model states file (model-parallel rank)."""
MAX_TAG_BYTES = 4096


def rank_file(rank: int, bf16: bool = False) -> str:
    """The name of rank ``rank``'s optimizer file."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def rank_model_file(rank: int) -> str:
    """The name of rank ``rank``'s model states file at ZeRO-3 (its module's tensors are
    empty there: the weights are the optimizer files' fp32 partitions)."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def model_states(directory: Path, stage: int) -> Path:
    """The model states file a save at ZeRO ``stage`` keeps ``param_shapes`` in: rank 0's at
    ZeRO-3, the one file at ZeRO-1/2."""
    return directory / (rank_model_file(0) if stage == ZeroStage.weights else MODEL_STATES)


@dataclass
class FragmentAddress:
    """Stands in for ``deepspeed.utils.tensor_fragment.fragment_address``."""

    numel: int
    start: int


class ZeroStage(enum.IntEnum):
    """Stands in for ``deepspeed.runtime.zero.config.ZeroStageEnum``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class LossScalerState:
    """Stands in for DeepSpeed's loss scalers: their attributes, nothing else."""


STAND_INS: dict[str, type] = {
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerState,
}
"""DeepSpeed's qualified class name -> what its pickles become here."""


def is_tag_directory(path: Path) -> bool:
    """Whether ``path`` is a ``global_stepN`` directory: it holds the model states or rank 0's
    optimizer file (an entry of that name of any kind, so that what is wrong with a partial
    or odd one is named by the reader, not met as a usage error)."""
    names = (MODEL_STATES, rank_model_file(0), rank_file(0), rank_file(0, bf16=True))
    return any(access.lexists(path / name) for name in names)


def is_deepspeed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DeepSpeed ZeRO checkpoint: a tag directory, or a directory with
    ``latest`` (an entry of any kind) and a tag directory (presence only; nothing is read)."""
    path = Path(path)
    if is_tag_directory(path):
        return True
    if not access.lexists(path / LATEST):
        return False
    try:
        names = access.list_names(path)
    except OSError:
        return False
    return any(access.is_dir(path / n) and is_tag_directory(path / n) for n in names)


def tag_directory(src: str | os.PathLike[str]) -> Path:
    """The tag directory ``src`` means: itself when it holds rank files, else the one its
    ``latest`` names (a plain name of a directory beside it)."""
    src = Path(src)
    if is_tag_directory(src):
        return src
    latest = src / LATEST
    if not access.lexists(latest):
        raise CheckpointError(
            f"not a DeepSpeed checkpoint: no {LATEST} and no {rank_file(0)}", path=src
        )
    tag = read_text(latest, limit=MAX_TAG_BYTES).strip()
    if not tag or tag in (".", "..") or "/" in tag or "\0" in tag or "\n" in tag:
        raise CheckpointError(f"names {tag[:80]!r}, not a tag directory's name", path=latest)
    if not access.is_dir(src / tag):
        raise CheckpointError(f"names {tag!r}, which is not a directory beside it", path=latest)
    return src / tag


def _canonical(rank: str | None, model: bool, bf16: bool) -> tuple[str, str]:
    """The name DeepSpeed gives a file of rank ``rank`` (None: the one model states file),
    a model states file or an optimizer file, and what messages call it."""
    if rank is None:
        return MODEL_STATES, "the model states"
    if model:
        return rank_model_file(int(rank)), f"rank {int(rank)}'s model states"
    return rank_file(int(rank), bf16), f"rank {int(rank)}'s optimizer file"


def rank_files(directory: Path) -> list[Path]:
    """The optimizer files of ranks 0 .. n-1 in ``directory``, in rank order. Refused naming
    the file: a file of a model-parallel rank other than 0, a DeepSpeed name not spelled as
    DeepSpeed writes it (``zero_pp_rank_01_...``: a second name for rank 1), a gap in the
    ranks, or both bf16 and plain names."""
    found: dict[int, Path] = {}
    prefixes = set()
    try:
        names = access.list_names(directory)
    except OSError as exc:
        raise CheckpointError(f"cannot list: {exc.strerror}", path=directory) from None
    for name in names:
        match = DEEPSPEED_FILE.match(name)
        if not match:
            continue
        bf16, rank, mp_rank = match.group(1) is not None, match.group(2), match.group(3)
        mp_rank = mp_rank or match.group(5)
        if int(mp_rank) != 0:
            raise CheckpointError(
                f"a file of model-parallel rank {int(mp_rank)}: a save with tensor or pipeline "
                "parallelism, which muonckpt does not read (DeepSpeed ZeRO-1/2/3 without it only)",
                path=directory / name,
            )
        model = match.group(4) == "model"
        canonical, what = _canonical(rank, model, bf16)
        if name != canonical:
            beside = ", which is also there: two files for one rank" if canonical in names else ""
            raise CheckpointError(
                f"not the name DeepSpeed gives {what} ({canonical}{beside})",
                path=directory / name,
            )
        if rank is not None and not model:
            prefixes.add(bf16)
            found[int(rank)] = directory / name
    if len(prefixes) > 1:
        raise CheckpointError(
            "holds both bf16_zero_pp_rank_* and zero_pp_rank_* files", path=directory
        )
    if not found:
        raise CheckpointError(
            f"holds no {rank_file(0)} (nor any rank's): the save did not finish", path=directory
        )
    for rank in range(max(found) + 1):
        if rank not in found:
            missing = directory / rank_file(rank, prefixes == {True})
            raise CheckpointError(
                f"rank {rank}'s optimizer file is missing (ranks up to {max(found)} are there)",
                path=missing,
            )
    return [found[rank] for rank in sorted(found)]


def total_size(paths: list[Path]) -> int:
    """The bytes of the files ``paths`` together, as they are on disk (nothing read)."""
    return sum(map(file_size, paths))


def load(path: Path) -> Any:
    """The content of the ``torch.save`` file ``path``, by torch's restricted unpickler with
    :data:`STAND_INS` (:func:`~muonckpt.storage.torch_pickles.load`): tensors, containers,
    numbers, strings and those classes only."""
    holds = f"a DeepSpeed file holds tensors and {len(STAND_INS)} DeepSpeed classes only"
    return torch_pickles.load(path, STAND_INS, holds)


_DEEPSPEED_NAMES = {
    stand_in: name
    for name, stand_in in reversed(STAND_INS.items())  # (a loss scaler: the static one)
}


def loss_scaler() -> LossScalerState:
    """DeepSpeed's static loss scaler of scale 1 (what an fp32 or bf16 job keeps), as a
    stand-in that :func:`save` writes as DeepSpeed's ``LossScaler``."""
    scaler = LossScalerState()
    scaler.__dict__.update(cur_scale=1.0, dynamic=False)
    return scaler


def save(path: Path, obj: Any) -> int:
    """Write ``obj`` (plain tensors, dicts, lists, numbers, strings; stand-ins of
    :data:`STAND_INS`, written as DeepSpeed's classes) to the new file ``path`` with
    ``torch.save``, fsynced; its size."""
    return torch_pickles.save(path, obj, _DEEPSPEED_NAMES)


def finish(staging: Path, tag: str) -> None:
    """Write ``latest`` naming ``tag`` and make the tag directory durable."""
    fsync_dir(staging / tag)
    with access.new_file(staging / LATEST) as f:
        f.write(tag.encode())
