"""Offline checkpoint tools: consolidate, reshard, summarize and diff, without an optimizer.

Library functions behind the ``muonckpt`` CLI, driven by a checkpoint's manifest and the pure
layout math of :mod:`muonckpt.layout.topology`. All file I/O goes through :mod:`muonckpt.storage`
and
:class:`muonckpt.files.pieces.PieceReader` (which verifies checksums on every read). A
single-process ``consolidate`` or ``reshard`` does not import torch.

``consolidate`` and ``reshard`` first plan the whole output (a :class:`_Job`: files, and which
elements of which param state each output tensor holds), then write it

* in this process, one file after another, streaming tensor by tensor; or
* with ``collective=True``, in every rank of an initialized default process group (torchrun):
  the output tensors are split among the ranks by bytes
  (:func:`muonckpt.layout.workplan.split_work`), each rank writes its share at the planned
  offsets of the shared files, and rank 0 writes the manifest last and commits.

Either way through the write engine's calls (:mod:`muonckpt.files.writing`): stage, write
(each tensor read from the source's pieces as the writer pulls it), commit, retire.

Memory per process is what one output tensor needs, twice (the next one is read on a thread
while the current one is written): one full tensor for consolidate, one rank's piece of one
tensor for reshard, plus one source span. Outputs are written into a staging directory beside
the target, manifest last, and swapped in atomically (:func:`muonckpt.files.writing.publish`).
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
from ..events import logged
from ..files import writing
from ..files.attempt import Attempt
from ..files.pieces import PieceReader, data_name, open_checkpoint
from ..files.progress import Progress
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
    extra_to_json,
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
from ..layout.state_shapes import state_region
from ..layout.topology import BufferLayout, LayoutOptions, ParamSpec, Region, Topology, arrange
from ..storage.places import Location, target
from . import _model

# torch (and so collectives) is imported only by the paths that need it: several processes
# (torchrun), and diff.

WORKER_TIMEOUT: float = 1800.0
"""Seconds one of several processes (torchrun) waits for the others at one step (the
rendezvous, each exchange of results) before the run fails. The run as a whole has no limit:
it ends when the work is done, a process fails, or the command is interrupted."""


@dataclass(frozen=True)
class _Job:
    """A rewrite of a checkpoint, decided from its manifest alone."""

    manifest: Manifest
    """The output's manifest, files and pieces still empty."""
    plan: Plan
    """Every output file and tensor."""


@logged("consolidate", paths=2)
def consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_size: int | str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    collective: bool = False,
) -> Location:
    """Rewrite any checkpoint as a consolidated one: full-shape tensors ``state.<param>.<key>``
    in ``optimizer.safetensors`` and, where the checkpoint holds them, the params by name in
    ``model.safetensors``, with the model's other tensors (buffers, params no optimizer holds:
    the manifest's ``model``) whole, bit for bit, and its tied names in the files' headers,
    as a consolidated save given the model writes them.

    Args:
        src: a checkpoint directory or an ``s3://bucket/prefix`` URL (any kind, any source
            topology).
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
        collective: every rank of the initialized default process group (torchrun) calls
            this with the same arguments, and the ranks share the writing; the output is the
            same, byte for byte, for any number of ranks.

    Memory: per process, one full tensor plus the span of one source piece (two in flight).
    """
    _check_collective(collective)
    max_shard_size = settings.shard_size(max_shard_size)
    checkpoint, manifest = open_checkpoint(src)
    items = [
        ((e.name, k, e.dtype_of(k)), e.shape_of(k)) for e in manifest.params for k in e.tensor_keys
    ]
    items += _model.whole_items(manifest)
    job = _Job(
        _output_manifest(manifest, kind=CONSOLIDATED),
        consolidated_plan(items, max_shard_size, _model.tied_names(manifest)),
    )
    called = {"max_shard_size": max_shard_size}
    return _write(
        "consolidate", job, checkpoint, manifest, dst, overwrite, progress, collective, called
    )


@logged("reshard", paths=2)
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
    collective: bool = False,
    allow_large_world: bool = False,
) -> Location:
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
        overwrite, progress, collective: as in :func:`consolidate`.
        allow_large_world: allow more than :data:`muonckpt.settings.MAX_WORLD` ranks (up to
            :data:`muonckpt.settings.MAX_LARGE_WORLD`).

    Raises:
        LayoutError: naming the param, when ``tp`` does not divide a split dimension.
        OptionError: for more ranks than the cap, before anything is read.
    """
    _check_collective(collective)
    topology = Topology(dp, tp)
    settings.world_size(
        topology.world_size, "--dp x --tp", "one file", allow_large=allow_large_world
    )
    checkpoint, manifest = open_checkpoint(src)
    overrides = dict(tp_split_dims or {})
    unknown = sorted(set(overrides) - {e.name for e in manifest.params})
    if unknown:
        raise LayoutError(f"tp_split_dims names params that are not in the checkpoint: {unknown}")
    params = tuple(
        replace(e, tp_split_dim=overrides[e.name]) if e.name in overrides else e
        for e in manifest.params
    )
    unique_tensor_keys(((e.name, k) for e in params for k in e.tensor_keys), checkpoint.location)
    specs = [ParamSpec(e.name, e.shape, tp_split_dim=e.tp_split_dim, group=e.group) for e in params]
    layout = arrange(specs, topology, options=options)
    _check_state_fits(params, layout)
    job = _Job(
        _output_manifest(manifest, kind=PER_RANK, topology={"dp": dp, "tp": tp}, params=params),
        PerRankPlan(topology.world_size, _owners(manifest, params, layout)),
    )
    called = {
        "dp": dp,
        "tp": tp,
        "options": json_safe(dataclasses.asdict(options)),
        "tp_split_dims": overrides,
    }
    return _write(
        "reshard", job, checkpoint, manifest, dst, overwrite, progress, collective, called
    )


def _check_state_fits(params: Sequence[ParamEntry], layout: BufferLayout) -> None:
    """Refuse, before anything is written, a layout that would cut a state tensor its shape
    rule keeps whole (:func:`muonckpt.layout.state_shapes.state_region`), naming the param,
    the key and the layout."""
    topology = layout.topology
    for index, entry in enumerate(params):
        for key, stored in entry.state_shapes.items():
            for rank in layout.owner_ranks(index):
                region = layout.owner_region(index, *topology.coords(rank))
                if state_region(stored, entry.shape, region) is None:
                    raise LayoutError(
                        f"param {entry.name!r}: state {key!r} is {stored.rule} state of shape "
                        f"{stored.shape}, which the {topology.dp} x {topology.tp} layout would "
                        f"cut (rank {rank} would hold elements [{region.start}, {region.stop}) "
                        f"of column block {region.block_start}+{region.block_width} of the "
                        f"param's {entry.shape}); nothing was written"
                    )


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
            kept = state_region(entry.state_shapes.get(key), entry.shape, region)
            assert kept is not None  # (_check_state_fits refused a layout that cuts it)
            yield (entry.name, key, entry.dtype_of(key)), kept


def _output_manifest(manifest: Manifest, **changes: Any) -> Manifest:
    """The manifest of a rewrite of ``manifest``: current format, files and pieces still empty
    (and beside it: the source's save prefix is the source's; a local step's placement, its
    own), the model section's tensors
    and tied names carried (:mod:`._model`), their pieces too still empty; the job's own state
    is the copy the root reports (:func:`_write_rank`)."""
    model = _model.draft(manifest)
    return replace(
        manifest,
        **changes,
        files=(),
        pieces=(),
        data_prefix="",
        format_version=FORMAT_VERSION,
        model=model,
        extra=None,
        replicas=None,  # a rewrite is a checkpoint of its own, in one place
    )


@logged("convert", paths=2)
def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str | None = None,
    rename: Rename | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Location:
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
    checkpoint, manifest = open_checkpoint(src)
    if rename is not None:
        manifest = manifest.renamed(rename)
    target, scales = converted_manifest(manifest, to, path=checkpoint.at(MANIFEST_NAME))
    by_name = {e.name: e for e in target.params}
    shaped = manifest.kind == CONSOLIDATED
    writes = tuple(
        TensorWrite(
            piece.file,
            piece.param,
            piece.key,
            by_name[piece.param].dtype_of(piece.key),
            piece.region,
            by_name[piece.param].shape_of(piece.key) if shaped else (piece.region.numel,),
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
        if _has_index(checkpoint, data_name(manifest, name))
    }
    plan = WritePlan(files, writes, texts)
    job = _Job(_output_manifest(target), plan)
    return _write("convert", job, checkpoint, manifest, dst, overwrite, progress, collective=False)


def _has_index(checkpoint: storage.CheckpointFiles, name: str) -> bool:
    """Whether the source has this index file; one that is not a regular file of its own (a
    symlink) is refused, as every reader refuses it."""
    if checkpoint.size(name) is None and not checkpoint.symlinked(name):
        return False
    checkpoint.small_text(name)
    return True


def _index_of(stem: str, files: Mapping[str, Any], writes: Sequence[TensorWrite]) -> str:
    """The Hugging Face index of one family of sharded files, of the tensors written."""
    family = [f for f in files if re.match(rf"{re.escape(stem)}[-.]", f)]
    return shard_index(
        [(f, sorted(w.tensor for w in writes if w.file == f)) for f in family],
        {w.tensor: w.nbytes for w in writes if w.file in family},
    )


def _check_collective(collective: bool) -> None:
    if collective:
        from ..distributed import collectives

        if not collectives.is_distributed():
            raise CheckpointError("collective=True needs an initialized default process group")


def _check_manifest(job: _Job, dst: str | os.PathLike[str]) -> None:
    """Refuse ``job`` before anything is written when its manifest would pass the readers'
    limit (:func:`muonckpt.files.writing.check_manifest_fits`; the params' pieces, which
    the piece indexes list)."""
    writes = _model.params_writes(job.manifest, job.plan.iter_writes())
    writing.check_manifest_fits(job.manifest.params, writes, dst)


def _write(
    operation: str,
    job: _Job,
    checkpoint: storage.CheckpointFiles,
    manifest: Manifest,
    dst: str | os.PathLike[str],
    overwrite: bool,
    progress: Progress | None,
    collective: bool,
    called: dict[str, Any] | None = None,
) -> Location:
    """Write ``job`` from ``checkpoint`` through the write engine: in this
    process, or (``collective``) shared among the ranks of the default process group, once
    they have met and agree that they read one checkpoint (its resolved directory and
    manifest) and were called alike (the output, ``overwrite`` and the ``called`` options); a
    job whose manifest no reader would take is refused first (:func:`_check_manifest`)."""
    _check_manifest(job, dst)
    dst = target(dst)
    if collective and isinstance(dst, str):  # (an s3:// URL)
        raise CheckpointError(
            f"{operation} with collective=True writes files several ranks share, which cannot "
            "go to S3 from several hosts: run it in one process (collective=False), or write "
            "to a local directory and copy it",
            path=dst,
        )
    store, plan = storage.store_for(dst), job.plan
    steps: writing.Steps = writing.LocalSteps()
    if collective:
        from ..distributed import collectives, group_steps

        ranks = collectives.group_ranks(None)
        arguments = {
            "source": checkpoint.resolved(),
            "manifest": manifest.digest(),
            "output": os.path.abspath(dst),
            "overwrite": overwrite,
            **(called or {}),
        }
        group_steps.rendezvous(operation, ranks, arguments, CheckpointError)
        steps = group_steps.CollectiveSteps(operation, ranks, ranks[0], CheckpointError)
    shared = plan if collective else None
    source = str(checkpoint.location)
    staging = writing.stage(steps, store, dst, overwrite=overwrite, source=source, shared=shared)
    written = _write_rank(steps, store, job, checkpoint, manifest, staging, progress, shared)
    draft = writing.Draft(job.manifest)
    replaced = writing.commit(
        steps, store, staging, dst, written, draft, source=source, shared=shared
    )
    return writing.retire(steps, store, replaced, dst)


def _write_rank(
    steps: writing.Steps,
    store: storage.CheckpointStore,
    job: _Job,
    checkpoint: storage.CheckpointFiles,
    manifest: Manifest,
    staging: Path,
    progress: Progress | None,
    shared: Plan | None,
) -> Attempt[writing.Written]:
    """This rank's files: every file of the plan (in one process), or its share of the files
    written together (``shared``, rank 0's progress standing for the whole job); on the root,
    the job's own state copied. Its report, or its failure, which the commit raises."""
    plan = job.plan
    try:
        with PieceReader(checkpoint, manifest, reuse_outputs=2) as reader:
            if shared is None:
                tensors = _read(manifest, reader, writing.in_order(plan))
                written = writing.write_files(store, plan, staging, tensors, progress, sync=False)
            else:
                me, count = steps.ranks.index(steps.rank), len(steps.ranks)
                share = writing.share_of(plan, staging, me, count)
                shown = None  # rank 0's progress stands for the whole job
                if progress is not None and steps.is_root:
                    shown = _scaled(progress, plan)
                tensors = _read(manifest, reader, iter(share))
                written = writing.write_share(plan, staging, share, tensors, shown)
        if steps.is_root:
            extra = _copy_extra(checkpoint, manifest, staging)
            written.extra = None if extra is None else extra_to_json(extra)
    except BaseException as exc:
        return Attempt(failure=exc)
    return Attempt(written)


def _read(
    manifest: Manifest, reader: PieceReader, writes: Iterator[TensorWrite]
) -> writing.Tensors:
    """Each of ``writes`` with its data read from ``manifest``'s pieces (the model's other
    tensors' too), scaled where planned."""
    grouped, entry = _model.source_pieces(manifest), _model.Entries(manifest)
    for w in writes:
        data = reader.gather(grouped[w.param, w.key], entry(w.param), w.key, w.region)
        yield w, data if w.scale == 1.0 else storage.tensor_of_bytes(data, w.dtype).mul_(w.scale)


def _scaled(progress: Progress, plan: Plan) -> Progress:
    """Rank 0's progress through its own share, shown as a fraction of the whole job."""
    total, tensors = plan.total_bytes, plan.count

    def scaled(done: int, share: int, written: int, share_tensors: int) -> None:
        fraction = done / share if share else written / share_tensors if share_tensors else 1.0
        progress(round(fraction * total), total, round(fraction * tensors), tensors)

    return scaled


def _copy_extra(
    checkpoint: storage.CheckpointFiles, manifest: Manifest, staging: Path
) -> Extra | None:
    """The training job's own state of ``checkpoint``, copied unchanged into
    ``staging`` (every tensor read verified, written as a save writes it)."""
    extra = manifest.extra
    if extra is None:
        return None
    trees, files = [], []
    with PieceReader(checkpoint, manifest) as reader:
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
