"""Offline checkpoint tools: consolidate, reshard, summarize and diff, without an optimizer.

Library functions behind the ``muonckpt`` CLI, driven by a checkpoint's manifest and the pure
layout math of :mod:`muonckpt.layout.topology`. All file I/O goes through :mod:`muonckpt.storage`
and
:class:`muonckpt.files.pieces.PieceReader` (which verifies checksums on every read). A
single-process ``consolidate`` or ``reshard`` does not import torch.

``consolidate`` and ``reshard`` first plan the whole output (a :class:`_Job`: files, and which
elements of which param state each output tensor holds), then write it

* in this process, one file after another, streaming tensor by tensor; or
* with ``workers=N``, in N local processes (gloo; :mod:`muonckpt.offline.workers`), or with
  ``collective=True``, in every rank of an initialized default process group (torchrun): the
  output tensors are split among the ranks by bytes (:func:`muonckpt.layout.workplan.split_work`),
  each rank writes its share at the planned offsets of the shared files, and rank 0 writes the
  manifest last and commits.

Memory per process is what one output tensor needs, twice (the next one is read on a thread
while the current one is written): one full tensor for consolidate, one rank's piece of one
tensor for reshard, plus one source span. Outputs are written into a staging directory beside
the target, manifest last, and swapped in atomically (:func:`muonckpt.storage.swap_in`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import settings, storage
from ..errors import ArgumentError, CheckpointError, LayoutError
from ..files import writing
from ..files.pieces import PieceReader, open_checkpoint
from ..files.writing import Progress
from ..format.conversion import converted_manifest
from ..format.manifest import (
    CONSOLIDATED,
    FORMAT_NAME,
    FORMAT_VERSION,
    PER_RANK,
    Extra,
    ExtraTensor,
    ExtraValues,
    Manifest,
    ParamEntry,
    json_safe,
)
from ..format.names import (
    INDEX_FILE,
    MANIFEST_NAME,
    MODEL_INDEX_FILE,
    PARAM_KEY,
    STATE_STEM,
    VALUE_STEM,
)
from ..format.renames import Rename
from ..format.writeplan import (
    PerRankPlan,
    Plan,
    TensorWrite,
    WritePlan,
    consolidated_plan,
    shard_index,
    unique_tensor_keys,
)
from ..layout.topology import BufferLayout, LayoutOptions, ParamSpec, Region, Topology, arrange
from ..storage import access
from . import _model

# torch (and so collectives and workers) is imported only by the paths that need it: several
# processes (:mod:`muonckpt.offline.workers` runs the local ones), and diff.

MAX_RANKS = settings.MAX_LARGE_WORLD
"""The most ranks ``reshard`` writes files for, ``allow_large_world`` or not (without it,
:data:`muonckpt.settings.MAX_WORLD`): planning costs ranks x params."""

WORKER_TIMEOUT: float = 1800.0
"""Seconds one of several processes (``workers > 1``, torchrun) waits for the others at one
step (the rendezvous, each exchange of results) before the run fails. The run as a whole has
no limit: it ends when the work is done, a process fails, or the command is interrupted; and
no worker outlives the command (see :mod:`muonckpt.distributed.launch`)."""


@dataclass(frozen=True)
class _Job:
    """A rewrite of a checkpoint, decided from its manifest alone."""

    manifest: Manifest
    """The output's manifest, files and pieces still empty."""
    plan: Plan
    """Every output file and tensor."""


def consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_size: int | str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    workers: int = 1,
    collective: bool = False,
) -> Path:
    """Rewrite any checkpoint as a consolidated one: full-shape tensors ``state.<param>.<key>``
    in ``optimizer.safetensors`` and, where the checkpoint holds them, the params by name in
    ``model.safetensors``, with the model's other tensors (buffers, params no optimizer holds:
    the manifest's ``model``) whole, bit for bit, and its tied names in the files' headers,
    as a consolidated save given the model writes them.

    Args:
        src: a checkpoint directory (any kind, any source topology).
        dst: target directory; staged beside it and swapped in atomically.
        max_shard_size: past this many bytes of tensor data, split the state over
            ``optimizer-0000i-of-0000N.safetensors`` files plus an HF-style
            ``optimizer.safetensors.index.json`` (and the params likewise over ``model-*``);
            otherwise one ``optimizer.safetensors`` (and one ``model.safetensors``).
            A tensor larger than the limit gets a file of its own. An int, or a string as
            the CLI takes it (``"5GB"``, ``"500MB"``; :func:`muonckpt.settings.parse_size`).
        overwrite: replace an existing ``dst``.
        progress: a :data:`Progress`, called with the bytes and tensors written and their
            totals, at the start and after each tensor. With several processes it follows
            rank 0's share, scaled to the total.
        workers: processes on this machine that share the writing (a local gloo group);
            the output is the same, byte for byte, for any number. They start from a
            forkserver, so a calling script needs the ``if __name__ == "__main__":`` guard.
            At most :data:`muonckpt.settings.WORKERS_PER_CORE` per CPU core (more is
            refused before anything starts), and never more processes than output tensors.
        collective: every rank of the initialized default process group (torchrun) calls
            this with the same arguments, and the ranks share the writing.

    Memory: per process, one full tensor plus the span of one source piece (two in flight).
    """
    _check_workers(workers, collective)
    max_shard_size = settings.shard_size(max_shard_size)
    directory, manifest = open_checkpoint(src)
    items = [((e.name, k, e.dtype_of(k)), e.shape) for e in manifest.params for k in e.tensor_keys]
    items += _model.whole_items(manifest)
    job = _Job(
        _output_manifest(manifest, kind=CONSOLIDATED),
        consolidated_plan(items, max_shard_size, _model.tied_names(manifest)),
    )
    if (workers := _processes(workers, job, dst)) > 1:
        options = {"max_shard_size": max_shard_size, "overwrite": overwrite}
        from .workers import run_in_workers

        return run_in_workers(consolidate, workers, src, dst, options, progress, WORKER_TIMEOUT)
    called = {"max_shard_size": max_shard_size}
    return _write(
        "consolidate", job, directory, manifest, dst, overwrite, progress, collective, called
    )


def reshard(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    dp: int,
    tp: int,
    options: LayoutOptions = LayoutOptions(),
    tp_split_dims: Mapping[str, int] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    workers: int = 1,
    collective: bool = False,
    allow_large_world: bool = False,
) -> Path:
    """Rewrite any checkpoint as per-rank files for a ``dp`` x ``tp`` job.

    Rank ``r`` (TP rank fastest) gets ``rank-0000r-of-N.safetensors`` holding exactly what it
    owns under :func:`muonckpt.layout.topology.arrange` of the manifest's params (in manifest order,
    TP split dims and groups from the manifest) with the given ``options``; TP-replicated
    params are stored on TP rank 0 only, as :func:`muonckpt.save` does. The model's other
    tensors (buffers, params no optimizer holds: the manifest's ``model``) are stored once,
    whole (flat) and bit for bit, in rank 0's file, and listed in the manifest's ``model``
    with its tied names.

    Args:
        tp_split_dims: param name -> split dimension, overriding the manifest's (a checkpoint
            saved by a single process records every param as unsplit, -1).
        options: bucketing, alignment and buffers
        (:class:`~muonckpt.layout.topology.LayoutOptions`),
            as in :func:`muonckpt.layout.topology.arrange`; they decide which rank holds what, but
            any choice loads correctly.
        overwrite, progress, workers, collective: as in :func:`consolidate`.
        allow_large_world: allow more than :data:`muonckpt.settings.MAX_WORLD` ranks (up to
            :data:`MAX_RANKS`).

    Raises:
        LayoutError: naming the param, when ``tp`` does not divide a split dimension.
        OptionError: for more ranks than the cap, before anything is read.
    """
    _check_workers(workers, collective)
    topology = Topology(dp, tp)
    settings.world_size(
        topology.world_size, "--dp x --tp", "one file", allow_large=allow_large_world
    )
    directory, manifest = open_checkpoint(src)
    overrides = dict(tp_split_dims or {})
    unknown = sorted(set(overrides) - {e.name for e in manifest.params})
    if unknown:
        raise LayoutError(f"tp_split_dims names params that are not in the checkpoint: {unknown}")
    params = tuple(
        replace(e, tp_split_dim=overrides[e.name]) if e.name in overrides else e
        for e in manifest.params
    )
    unique_tensor_keys(((e.name, k) for e in params for k in e.tensor_keys), directory)
    specs = [ParamSpec(e.name, e.shape, tp_split_dim=e.tp_split_dim, group=e.group) for e in params]
    layout = arrange(specs, topology, options=options)
    job = _Job(
        _output_manifest(manifest, kind=PER_RANK, topology={"dp": dp, "tp": tp}, params=params),
        PerRankPlan(topology.world_size, _owners(manifest, params, layout)),
    )
    if (workers := _processes(workers, job, dst)) > 1:
        worker_options = {
            "dp": dp,
            "tp": tp,
            "options": options,
            "tp_split_dims": overrides,
            "overwrite": overwrite,
            "allow_large_world": allow_large_world,
        }
        from .workers import run_in_workers

        return run_in_workers(reshard, workers, src, dst, worker_options, progress, WORKER_TIMEOUT)
    called = {
        "dp": dp,
        "tp": tp,
        "options": json_safe(dataclasses.asdict(options)),
        "tp_split_dims": overrides,
    }
    return _write("reshard", job, directory, manifest, dst, overwrite, progress, collective, called)


def _owners(
    manifest: Manifest, params: Sequence[ParamEntry], layout: BufferLayout
) -> Callable[[int], Iterable[tuple[tuple[str, str, str], Region]]]:
    """What each rank holds under ``layout`` (:func:`_owned`), found from each param's place
    in its bucket (linear in params plus pieces); rank 0 also stores the model's other tensors,
    whole."""
    held: list[array[int]] = [array("q") for _ in range(layout.topology.world_size)]
    for index in range(len(params)):
        for rank in layout.owner_ranks(index):
            held[rank].append(index)

    def owned(rank: int) -> Iterable[tuple[tuple[str, str, str], Region]]:
        mine = _owned(params, layout, rank, held[rank])
        return itertools.chain(mine, _model.owned_whole(manifest)) if rank == 0 else mine

    return owned


def _owned(
    params: Sequence[ParamEntry], layout: BufferLayout, rank: int, indices: Iterable[int]
) -> Iterator[tuple[tuple[str, str, str], Region]]:
    """What ``rank`` holds under ``layout`` of the params at ``indices`` (those it owns
    elements of, :meth:`~muonckpt.layout.topology.BufferLayout.owner_ranks`): (param, key,
    dtype) and region, made as its plan takes them (not 300k tuples at once)."""
    coords = layout.topology.coords(rank)
    for index in indices:
        entry = params[index]
        region = layout.owner_region(index, *coords)
        for key in entry.tensor_keys:
            yield (entry.name, key, entry.dtype_of(key)), region


def _output_manifest(manifest: Manifest, **changes: Any) -> Manifest:
    """The manifest of a rewrite of ``manifest``: current format, files and pieces still empty,
    the model section's tensors and tied names carried (:mod:`._model`), their pieces too
    still empty."""
    model = _model.draft(manifest)
    return replace(
        manifest, **changes, files=(), pieces=(), format_version=FORMAT_VERSION, model=model
    )


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    rename: Rename | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Rewrite a checkpoint for another Muon implementation: ``packaged``
    (muonckpt.optim.muon.Muon),
    ``torch`` (torch.optim.Muon + AdamW) or ``keller-jordan`` (muon.MuonWithAuxAdam); and/or
    with its params renamed (``rename`` as in :func:`muonckpt.load`: ``{"module.": ""}``
    strips DDP's prefix). ``to=None`` keeps each group's implementation.

    Momentum is converted between sum and EMA form by ``1 - mu`` exactly as :func:`muonckpt.load`
    converts it in memory, AdamW step counts move to where the target keeps them, and each
    group records what it now holds (:func:`muonckpt.format.kinds.converted`); files, pieces and
    regions keep the source's layout. The model's other tensors (the manifest's ``model``) are
    kept bit for bit where they are, renamed with the params. Streams one tensor at a time,
    atomic like every output.

    Raises:
        CheckpointError: for a checkpoint whose groups do not say which optimizer saved them.
    """
    if to is None and rename is None:
        raise ArgumentError(
            "convert needs to= (another implementation), rename=, or both", argument="to"
        )
    directory, manifest = open_checkpoint(src)
    if rename is not None:
        manifest = manifest.renamed(rename)
    target, scales = converted_manifest(manifest, to, path=directory / MANIFEST_NAME)
    by_name = {e.name: e for e in target.params}
    shaped = manifest.kind == CONSOLIDATED
    writes = tuple(
        TensorWrite(
            piece.file,
            piece.param,
            piece.key,
            by_name[piece.param].dtype_of(piece.key),
            piece.region,
            by_name[piece.param].shape if shaped else (piece.region.numel,),
            scales[by_name[piece.param].group] if piece.key == "momentum_buffer" else 1.0,
        )
        for piece in manifest.pieces
    ) + _model.kept_writes(manifest, shaped)
    files = {f.name: {"format": FORMAT_NAME} for f in manifest.files}
    if manifest.kind == PER_RANK:  # per-rank files name their rank, as save writes them
        files = {
            f.name: {"format": FORMAT_NAME, "rank": str(r)} for r, f in enumerate(manifest.files)
        }
    elif tied := _model.tied_names(manifest):  # as consolidated_plan records them
        for w in writes:
            if w.key == PARAM_KEY:
                files[w.file].update(tied)
    texts = {  # rebuilt: the keys may be renamed
        name: _index_of(stem, files, writes)
        for stem, name in ((STATE_STEM, INDEX_FILE), (VALUE_STEM, MODEL_INDEX_FILE))
        if _has_index(directory / name)
    }
    plan = WritePlan(files, writes, texts)
    job = _Job(_output_manifest(target), plan)
    _check_manifest(job, dst)
    return _write("convert", job, directory, manifest, dst, overwrite, progress, collective=False)


def _has_index(path: Path) -> bool:
    """Whether the source has this index file; one that is not a regular file of its own (a
    symlink, a FIFO) is refused, as every reader refuses it."""
    if not (access.is_file(path) or access.is_symlink(path)):
        return False
    storage.read_text(path)
    return True


def _index_of(stem: str, files: Mapping[str, Any], writes: Sequence[TensorWrite]) -> str:
    """The Hugging Face index of one family of sharded files, of the tensors written."""
    family = [f for f in files if re.match(rf"{re.escape(stem)}[-.]", f)]
    return shard_index(
        [(f, sorted(w.tensor for w in writes if w.file == f)) for f in family],
        {w.tensor: w.nbytes for w in writes if w.file in family},
    )


def _check_workers(workers: int, collective: bool) -> None:
    settings.local_workers(workers, settings.available_cores())
    if workers > 1 and collective:
        raise ArgumentError(
            "workers > 1 and collective=True exclude each other", argument="collective"
        )
    if collective:
        from ..distributed import collectives

        if not collectives.is_distributed():
            raise CheckpointError("collective=True needs an initialized default process group")


def _processes(workers: int, job: _Job, dst: str | os.PathLike[str]) -> int:
    """The processes that share writing ``job`` when ``workers`` were asked for: never more
    than it has output tensors (the units :func:`muonckpt.layout.workplan.split_work` divides), so
    that none starts with nothing to do; none at all for a job whose manifest no reader would
    take (:func:`_check_manifest`)."""
    _check_manifest(job, dst)
    return min(workers, max(1, job.plan.count)) if workers > 1 else 1


def _check_manifest(job: _Job, dst: str | os.PathLike[str]) -> None:
    """Refuse ``job`` before anything is written when its manifest would pass the readers'
    limit (:func:`muonckpt.files.writing.check_manifest_fits`; the params' pieces, which
    the piece indexes list)."""
    writes = _model.params_writes(job.manifest, job.plan.iter_writes())
    writing.check_manifest_fits(job.manifest.params, writes, dst)


def _write(
    operation: str,
    job: _Job,
    directory: Path,
    manifest: Manifest,
    dst: str | os.PathLike[str],
    overwrite: bool,
    progress: Progress | None,
    collective: bool,
    called: dict[str, Any] | None = None,
) -> Path:
    """Write ``job`` from the checkpoint in ``directory``: in this process, or (``collective``)
    shared among the ranks of the default process group (:func:`_write_shared`)."""
    carried: list[Extra | None] = []  # the job's own state, copied by the root

    def carry(staging: Path) -> None:
        carried.append(_copy_extra(directory, manifest, staging))

    def finished(reports: writing.Reports) -> Manifest:
        written = _model.finished(job.manifest, reports.files, reports.pieces)
        return replace(written, extra=carried[0])

    if collective:
        shared = (directory, manifest, dst, overwrite, progress)
        return _write_shared(operation, job, *shared, called or {}, carry, finished)

    def write(staging: Path) -> writing.Written:
        with PieceReader(directory, manifest, reuse_outputs=2) as reader:
            fetch = _fetcher(manifest, reader)
            written = writing.write_files(job.plan, staging, fetch, progress, sync=False)
        carry(staging)
        return written

    return writing.write_checkpoint(
        writing.LocalSteps(),
        dst,
        overwrite=overwrite,
        write=write,
        manifest=finished,
        source=directory,
    )


def _fetcher(manifest: Manifest, reader: PieceReader) -> Callable[[TensorWrite], Any]:
    """Each planned tensor's data read from ``manifest``'s pieces (the model's other tensors'
    too), scaled where planned."""
    grouped, entry = _model.source_pieces(manifest), _model.Entries(manifest)

    def fetch(w: TensorWrite) -> Any:
        data = reader.gather(grouped[w.param, w.key], entry(w.param), w.key, w.region)
        if w.scale == 1.0:
            return data
        return storage.tensor_of_bytes(data, w.dtype).mul_(w.scale)

    return fetch


def _write_shared(
    operation: str,
    job: _Job,
    directory: Path,
    manifest: Manifest,
    dst: str | os.PathLike[str],
    overwrite: bool,
    progress: Progress | None,
    called: Mapping[str, Any],
    carry: Callable[[Path], None],
    finished: Callable[[writing.Reports], Manifest],
) -> Path:
    """Write ``job`` shared among the ranks of the default process group, rank 0 committing,
    once the ranks have met and agree that they read one checkpoint (its resolved directory
    and manifest) and were called alike (the output, ``overwrite`` and the ``called``
    options)."""
    from ..distributed import collectives, group_steps

    plan = job.plan
    ranks = collectives.group_ranks(None)
    arguments = {
        "source": os.path.realpath(directory),
        "manifest": manifest.digest(),
        "output": os.path.abspath(dst),
        "overwrite": overwrite,
        **called,
    }
    group_steps.rendezvous(operation, ranks, arguments, CheckpointError)
    steps = group_steps.CollectiveSteps(operation, ranks, ranks[0], CheckpointError)
    shown = None  # rank 0's progress stands for the whole job
    if steps.is_root and progress is not None:
        from .workers import scaled_progress

        shown = scaled_progress(progress, plan.total_bytes, plan.count)

    def write_share(staging: Path) -> writing.Written:
        with PieceReader(directory, manifest, reuse_outputs=2) as reader:
            share = ranks.index(steps.rank)
            fetch = _fetcher(manifest, reader)
            return writing.write_share(plan, share, len(ranks), staging, fetch, shown)

    def create(staging: Path) -> None:
        writing.create_shared(plan, staging)
        carry(staging)

    return writing.write_checkpoint(
        steps,
        dst,
        overwrite=overwrite,
        write=write_share,
        manifest=finished,
        create=create,
        seal=lambda staging: writing.seal_shared(plan, staging),
        source=directory,
    )


def _copy_extra(directory: Path, manifest: Manifest, staging: Path) -> Extra | None:
    """The training job's own state of the checkpoint in ``directory``, copied unchanged into
    ``staging`` (every tensor read verified, written as a save writes it)."""
    extra = manifest.extra
    if extra is None:
        return None
    trees, files = [], []
    with PieceReader(directory, manifest) as reader:
        for what, tree in extra.trees():
            stored: list[ExtraTensor] = []
            for file in dict.fromkeys(t.file for t in tree.tensors):
                items = [
                    (t.path, t.dtype, t.shape, reader.read_extra(t, what))
                    for t in tree.tensors
                    if t.file == file
                ]
                copied, entry = writing.write_extra(staging, file, tree.values, items)
                stored += copied.tensors
                files += [entry] if entry is not None else []
            trees.append(ExtraValues(tree.values, tuple(stored)))
    shared = trees.pop(0) if extra.shared is not None else None
    return Extra(shared, tuple(trees), tuple(files))
