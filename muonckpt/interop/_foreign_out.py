"""What every foreign format's writer shares: the new directory it writes into, published only
once complete (:func:`staged_output`), each tensor of the muonckpt checkpoint read whole
(:func:`read_whole`), the refusal of params the target trainer would put in the other
optimizer (:func:`check_split`), and what a muonckpt checkpoint holds that no foreign format
carries (:func:`not_carried`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .. import settings, storage
from ..errors import CheckpointError
from ..files import writing
from ..files.pieces import PieceReader, open_checkpoint
from ..format.manifest import Manifest, ParamEntry, PieceIndex
from ..layout.topology import whole_region
from ._trainer_state import KEY, Carried, left_out, recorded

if TYPE_CHECKING:
    import torch


def open_local(src: str | os.PathLike[str]) -> tuple[Path, storage.CheckpointFiles, Manifest]:
    """The directory, files and manifest of the muonckpt checkpoint a foreign format is
    written from: a local one (a URL is refused in one line: copy it to a directory first)."""
    directory = settings.local_path(src)
    files, manifest = open_checkpoint(directory)
    return directory, files, manifest


@contextmanager
def staged_output(
    dst: str | os.PathLike[str], source: Path, output: str
) -> Iterator[tuple[storage.CheckpointStore, Path]]:
    """The store of ``dst`` (what a writer writes its own small files through) and a staging
    directory beside ``dst`` (which must not exist) to write the files of foreign format
    ``output`` into, published at ``dst`` when the block ends, by the write engine
    (:func:`~muonckpt.files.writing.open_staging`, :func:`~muonckpt.files.writing.publish`);
    if anything fails, it is discarded (only the files the format writes, then the lease,
    which records the format: ``clean`` removes as much after a crash) and the error goes
    on."""
    store = storage.store_for(settings.local_path(dst))
    staging = writing.open_staging(store, dst, overwrite=False, source=source, output=output)
    try:
        yield store, staging
        writing.publish(store, staging, Path(dst), None)
    except BaseException:
        writing.abandon(store, staging)
        raise


def read_whole(
    reader: PieceReader, pieces: PieceIndex, entry: ParamEntry, key: str
) -> torch.Tensor:
    """Stored tensor ``key`` of ``entry`` (a param, or a model tensor), whole and at its shape,
    read from the pieces that hold it and verified: a tensor of its own."""
    shape = entry.shape_of(key)
    data = reader.gather(pieces[entry.name, key], entry, key, whole_region(math.prod(shape)))
    return storage.tensor_of_bytes(data, entry.dtype_of(key)).reshape(shape)


def check_split(
    manifest: Manifest,
    placed: Iterable[tuple[str, bool]],
    puts_in_muon: Callable[[str, tuple[int, ...]], bool | None],
    rule: str,
    directory: Path,
) -> None:
    """Refuse, before anything is written, a checkpoint whose Muon / Adam split is not one the
    target trainer makes: ``placed`` is each param's name and whether the checkpoint has it in
    Muon, ``puts_in_muon`` where the trainer puts a param of that name and shape (True: Muon,
    False: its Adam, None: either), ``rule`` that rule in words. Its load would take such a
    param's state for the other optimizer's, or refuse the files with an error that does not
    name the cause."""
    moved = [
        (name, muon)
        for name, muon in placed
        if puts_in_muon(name, manifest.param(name).shape) not in (None, muon)
    ]
    if moved:
        shown = ", ".join(
            f"{name!r} ({'Muon' if muon else 'Adam'} here, {'Adam' if muon else 'Muon'} there)"
            for name, muon in moved[:6]
        )
        more = f" and {len(moved) - 6} more" if len(moved) > 6 else ""
        raise CheckpointError(
            f"{rule}, so {len(moved)} param(s) would change optimizer: {shown}{more}; nothing "
            "was written (resume them in a trainer that keeps this split)",
            path=directory,
        )


def not_carried(manifest: Manifest, trainer: Carried | None = None) -> tuple[str, ...]:
    """What a muonckpt checkpoint holds beyond the model and the optimizer that a foreign
    format's output does not carry: the job's own state saved with the optimizer, and of the
    trainer state a conversion stored (:mod:`._trainer_state`) what the writer left out
    (``trainer``'s, or all of it where the writer takes none)."""
    extra = manifest.extra
    if extra is None:
        return ()
    values = extra.shared.values if extra.shared is not None else {}
    stored = {"step", KEY} if recorded(manifest) is not None else set()  # (by the conversion)
    own = extra.ranks or not isinstance(values, dict) or set(values) - stored
    mine = ("extra / rank_extra (the job's own state, saved with the optimizer)",) if own else ()
    return mine + (trainer.left if trainer is not None else left_out(manifest))
