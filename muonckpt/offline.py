"""Offline checkpoint tools: consolidate, reshard, summarize and diff, without an optimizer.

Library functions behind the ``muonckpt`` CLI, driven by a checkpoint's manifest and the pure
layout math of :mod:`muonckpt.layout`. All file I/O goes through :mod:`muonckpt.storage` and
:class:`muonckpt.pieces.PieceReader` (which verifies checksums on every read). A single-process
``consolidate`` or ``reshard`` does not import torch.

``consolidate`` and ``reshard`` first plan the whole output (a :class:`_Job`: files, and which
elements of which param state each output tensor holds), then write it

* in this process, one file after another, streaming tensor by tensor; or
* with ``workers=N``, in N local processes (gloo; :mod:`muonckpt.workers`), or with
  ``collective=True``, in every rank of an initialized default process group (torchrun): the
  output tensors are split among the ranks by bytes (:func:`muonckpt.workplan.split_work`),
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
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import kinds, storage, writing
from .conversion import converted_manifest
from .dcp import LAYOUTS, DcpConversion, from_dcp, is_dcp, to_dcp
from .errors import CheckpointError, LayoutError, MuonCkptError
from .inspection import (
    DiffRow,
    ExtraSummary,
    GroupSummary,
    ModelSummary,
    ParamSummary,
    Summary,
    Totals,
)
from .layout import (
    BufferLayout,
    LayoutOptions,
    ParamSpec,
    Region,
    Topology,
    arrange,
    whole_region,
)
from .manifest import (
    CONSOLIDATED,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    MANIFEST_NAME,
    MODEL_INDEX_FILE,
    PARAM_KEY,
    PER_RANK,
    STATE_STEM,
    VALUE_STEM,
    Extra,
    ExtraTensor,
    ExtraValues,
    Manifest,
    ParamEntry,
    Piece,
    Rename,
    json_safe,
)
from .pieces import PieceReader, open_checkpoint
from .workplan import check_workers
from .writeplan import (
    TensorWrite,
    WritePlan,
    consolidated_plan,
    per_rank_plan,
    shard_index,
    unique_tensor_keys,
)
from .writing import Progress

# torch (and so collectives and workers) is imported only by the paths that need it: several
# processes (:mod:`muonckpt.workers` runs the local ones), and diff.

MAX_RANKS = 1 << 16
"""The most ranks ``reshard`` writes files for: planning costs ranks x params."""

WORKER_TIMEOUT: float = 1800.0
"""Seconds one of several processes (``workers > 1``, torchrun) waits for the others at one
step (the rendezvous, each exchange of results) before the run fails. The run as a whole has
no limit: it ends when the work is done, a process fails, or the command is interrupted; and
no worker outlives the command (see :mod:`muonckpt.launch`)."""

__all__ = [
    "LAYOUTS",
    "MAX_RANKS",
    "WORKER_TIMEOUT",
    "DcpConversion",
    "DiffRow",
    "Progress",
    "Summary",
    "consolidate",
    "convert",
    "diff",
    "from_dcp",
    "is_dcp",
    "iter_diff",
    "open_checkpoint",
    "reshard",
    "summarize",
    "to_dcp",
]


@dataclass(frozen=True)
class _Job:
    """A rewrite of a checkpoint, decided from its manifest alone."""

    manifest: Manifest
    """The output's manifest, files and pieces still empty."""
    plan: WritePlan
    """Every output file and tensor."""


def consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_shard_size: int | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    workers: int = 1,
    collective: bool = False,
) -> Path:
    """Rewrite any checkpoint as a consolidated one: full-shape tensors ``state.<param>.<key>``
    in ``optimizer.safetensors`` and, where the checkpoint holds them, the params by name in
    ``model.safetensors`` (the optimizer's params by name; buffers and tied names only in a
    consolidated save given the model, which this does not carry).

    Args:
        src: a checkpoint directory (any kind, any source topology).
        dst: target directory; staged beside it and swapped in atomically.
        max_shard_size: past this many bytes of tensor data, split the state over
            ``optimizer-0000i-of-0000N.safetensors`` files plus an HF-style
            ``optimizer.safetensors.index.json`` (and the params likewise over ``model-*``);
            otherwise one ``optimizer.safetensors`` (and one ``model.safetensors``).
            A tensor larger than the limit gets a file of its own.
        overwrite: replace an existing ``dst``.
        progress: a :data:`Progress`, called with the bytes and tensors written and their
            totals, at the start and after each tensor. With several processes it follows
            rank 0's share, scaled to the total.
        workers: processes on this machine that share the writing (a local gloo group);
            the output is the same, byte for byte, for any number. They start from a
            forkserver, so a calling script needs the ``if __name__ == "__main__":`` guard.
        collective: every rank of the initialized default process group (torchrun) calls
            this with the same arguments, and the ranks share the writing.

    Memory: per process, one full tensor plus the span of one source piece (two in flight).
    """
    _check_workers(workers, collective)
    directory, manifest = open_checkpoint(src)
    items = (((e.name, k, e.dtype_of(k)), e.shape) for e in manifest.params for k in e.tensor_keys)
    job = _Job(
        _output_manifest(manifest, kind=CONSOLIDATED), consolidated_plan(items, max_shard_size)
    )
    if workers > 1:
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
) -> Path:
    """Rewrite any checkpoint as per-rank files for a ``dp`` x ``tp`` job.

    Rank ``r`` (TP rank fastest) gets ``rank-0000r-of-N.safetensors`` holding exactly what it
    owns under :func:`muonckpt.layout.arrange` of the manifest's params (in manifest order,
    TP split dims and groups from the manifest) with the given ``options``; TP-replicated
    params are stored on TP rank 0 only, as :func:`muonckpt.save` does.

    Args:
        tp_split_dims: param name -> split dimension, overriding the manifest's (a checkpoint
            saved by a single process records every param as unsplit, -1).
        options: bucketing, alignment and buffers (:class:`~muonckpt.layout.LayoutOptions`),
            as in :func:`muonckpt.layout.arrange`; they decide which rank holds what, but any
            choice loads correctly.
        overwrite, progress, workers, collective: as in :func:`consolidate`.

    Raises:
        LayoutError: naming the param, when ``tp`` does not divide a split dimension.
    """
    _check_workers(workers, collective)
    topology = Topology(dp, tp)
    if topology.world_size > MAX_RANKS:
        raise LayoutError(
            f"reshard to {topology.world_size} ranks: muonckpt plans at most {MAX_RANKS} "
            "(one file per rank)"
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
        per_rank_plan([_owned(params, layout, rank) for rank in range(topology.world_size)]),
    )
    del specs, layout  # planned: not held while the job is written
    if workers > 1:
        worker_options = {
            "dp": dp,
            "tp": tp,
            "options": options,
            "tp_split_dims": overrides,
            "overwrite": overwrite,
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


def _owned(
    params: Sequence[ParamEntry], layout: BufferLayout, rank: int
) -> Iterator[tuple[tuple[str, str, str], Region]]:
    """What ``rank`` holds under ``layout``: (param, key, dtype) and region, made as its plan
    takes them (not 300k tuples at once)."""
    coords = layout.topology.coords(rank)
    for index, entry in enumerate(params):
        region = layout.owner_region(index, *coords)
        if region.numel:
            for key in entry.tensor_keys:
                yield (entry.name, key, entry.dtype_of(key)), region


def _output_manifest(manifest: Manifest, **changes: Any) -> Manifest:
    """The manifest of a rewrite of ``manifest``: current format, files and pieces still empty;
    the model's other tensors (``save(..., model=)``) are not carried."""
    return replace(
        manifest, **changes, files=(), pieces=(), format_version=FORMAT_VERSION, model=None
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
    """Rewrite a checkpoint for another Muon implementation: ``packaged`` (muonckpt.optim.Muon),
    ``torch`` (torch.optim.Muon + AdamW) or ``keller-jordan`` (muon.MuonWithAuxAdam); and/or
    with its params renamed (``rename`` as in :func:`muonckpt.load`: ``{"module.": ""}``
    strips DDP's prefix). ``to=None`` keeps each group's implementation.

    Momentum is converted between sum and EMA form by ``1 - mu`` exactly as :func:`muonckpt.load`
    converts it in memory, AdamW step counts move to where the target keeps them, and each
    group records what it now holds (:func:`muonckpt.kinds.converted`); files, pieces and
    regions keep the source's layout. Streams one tensor at a time, atomic like every output.

    Raises:
        CheckpointError: for a checkpoint whose groups do not say which optimizer saved them.
    """
    if to is None and rename is None:
        raise CheckpointError("convert needs to= (another implementation), rename=, or both")
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
    )
    files = {f.name: {"format": FORMAT_NAME} for f in manifest.files}
    if manifest.kind == PER_RANK:  # per-rank files name their rank, as save writes them
        files = {
            f.name: {"format": FORMAT_NAME, "rank": str(r)} for r, f in enumerate(manifest.files)
        }
    texts = {  # rebuilt: the keys may be renamed, and the model's other tensors are not carried
        name: _index_of(stem, files, writes)
        for stem, name in ((STATE_STEM, INDEX_FILE), (VALUE_STEM, MODEL_INDEX_FILE))
        if _has_index(directory / name)
    }
    plan = WritePlan(files, writes, texts)
    job = _Job(_output_manifest(target), plan)
    return _write("convert", job, directory, manifest, dst, overwrite, progress, collective=False)


def _has_index(path: Path) -> bool:
    """Whether the source has this index file; one that is not a regular file of its own (a
    symlink, a FIFO) is refused, as every reader refuses it."""
    if not (path.is_file() or path.is_symlink()):
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
    check_workers(workers)
    if workers > 1 and collective:
        raise CheckpointError("workers > 1 and collective=True exclude each other")
    if collective:
        from . import collectives

        if not collectives.is_distributed():
            raise CheckpointError("collective=True needs an initialized default process group")


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
    shared among the ranks of the default process group, rank 0 committing, once the ranks
    have met and agree that they read one checkpoint (its resolved directory and manifest)
    and were called alike (the output, ``overwrite`` and the ``called`` options)."""
    grouped = manifest.pieces_of()
    plan = job.plan

    def fetch(reader: PieceReader, w: TensorWrite) -> Any:
        data = reader.gather(grouped[w.param, w.key], manifest.param(w.param), w.key, w.region)
        if w.scale == 1.0:
            return data
        return storage.tensor_of_bytes(data, w.dtype).mul_(w.scale)

    carried: list[Extra | None] = []  # the job's own state, copied by the root

    def carry(staging: Path) -> None:
        carried.append(_copy_extra(directory, manifest, staging))

    def finished(reports: writing.Reports) -> Manifest:
        files, pieces = tuple(reports.files), tuple(reports.pieces)
        return replace(job.manifest, files=files, pieces=pieces, extra=carried[0])

    if not collective:

        def write(staging: Path) -> writing.Written:
            with PieceReader(directory, manifest, reuse_outputs=2) as reader:
                written = writing.write_files(plan, staging, lambda w: fetch(reader, w), progress)
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
    from . import collectives

    ranks = collectives.group_ranks(None)
    arguments = {
        "source": os.path.realpath(directory),
        "manifest": manifest.digest(),
        "output": os.path.abspath(dst),
        "overwrite": overwrite,
        **(called or {}),
    }
    collectives.rendezvous(operation, ranks, arguments, CheckpointError)
    steps = collectives.CollectiveSteps(operation, ranks, ranks[0], CheckpointError)
    shown = None  # rank 0's progress stands for the whole job
    if steps.is_root and progress is not None:
        from .workers import scaled_progress

        shown = scaled_progress(progress, plan.total_bytes, len(plan.writes))

    def write_share(staging: Path) -> writing.Written:
        with PieceReader(directory, manifest, reuse_outputs=2) as reader:
            return writing.write_share(
                plan,
                ranks.index(steps.rank),
                len(ranks),
                staging,
                lambda w: fetch(reader, w),
                shown,
            )

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


def summarize(src: str | os.PathLike[str]) -> Summary:
    """What ``muonckpt inspect`` shows: kind, topology, step, groups, params, the model file's
    other tensors and tied names (``save(..., model=)``; None without), and totals.

    Reads only the manifest (and checks that its pieces cover every state tensor once).
    """
    directory, manifest = open_checkpoint(src)
    params = tuple(
        ParamSummary(
            name=e.name,
            shape=tuple(e.shape),
            dtypes=dict(e.dtypes),
            value_dtype=e.value_dtype,
            scalars={k: v.value for k, v in e.scalars.items()},
            tp_split_dim=e.tp_split_dim,
            group=e.group,
            state_keys=tuple(e.state_keys),
            bytes=sum(e.numel * storage.itemsize(e.dtype_of(k)) for k in e.tensor_keys),
        )
        for e in manifest.params
    )
    return Summary(
        path=str(directory),
        kind=manifest.kind,
        format_version=manifest.format_version,
        topology=dict(manifest.topology),
        step=manifest.step,
        extra=_extra_summary(manifest),
        groups=tuple(GroupSummary(dict(g.hyperparams), tuple(g.params)) for g in manifest.groups),
        params=params,
        model=None
        if manifest.model is None
        else ModelSummary(
            tensors={e.name: tuple(e.shape) for e in manifest.model.tensors},
            aliases=dict(manifest.model.aliases),
        ),
        totals=Totals(
            params=len(params),
            tensors=sum(len(e.state_keys) for e in manifest.params),
            values=sum(e.value_dtype is not None for e in manifest.params),
            bytes=sum(p.bytes for p in params),
            file_bytes=sum(f.bytes for f in manifest.files),
            files=len(manifest.files),
            pieces=len(manifest.pieces),
        ),
    )


def _extra_summary(manifest: Manifest) -> ExtraSummary | None:
    """The job's own state for ``inspect``: ``extra``'s values, each tensor as ``"<tensor
    DTYPE [shape]>"``, and how many ranks saved ``rank_extra`` with rank 0's values so shown."""
    extra = manifest.extra
    if extra is None:
        return None

    def shown(tree: ExtraValues) -> Any:
        values = json.loads(json.dumps(tree.values))
        for t in tree.tensors:
            holder = values
            for step in t.path[:-1]:
                holder = holder[step]
            holder[t.path[-1]] = f"<tensor {t.dtype} {list(t.shape)}>"
        return values

    return ExtraSummary(
        values=None if extra.shared is None else shown(extra.shared),
        ranks=len(extra.ranks),
        rank_0_values=shown(extra.ranks[0]) if extra.ranks else None,
    )


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> list[DiffRow]:
    """Compare two checkpoints (any kinds, any topologies, any Muon implementations) as logical
    tensors: the rows of :func:`iter_diff`, as a list."""
    return list(iter_diff(a, b, atol=atol, rtol=rtol))


DIFF_CHUNK = 1 << 20
"""Elements compared at a time where two tensors are not bitwise equal (float64 temporaries
of this size, not of the whole tensor)."""


def iter_diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> Iterator[DiffRow]:
    """Compare two checkpoints (any kinds, any topologies) as logical tensors, one row at a
    time.

    One row per (param, stored key): ``max_abs`` and ``max_rel`` differences and ``equal``
    (every element within ``atol + rtol * |b|``; NaNs equal NaNs) and ``bitwise``; a row per
    scalar state value (equal or not, exactly; a step count compared wherever each side keeps
    it), and one per param group whose settings differ. A param or key on only one side, or of
    different shape or dtype, is a row with ``equal`` False and a ``note``.

    Checkpoints of different momentum forms (the packaged Muon's sum form against torch's or
    KellerJordan's EMA form) are compared as :func:`muonckpt.load` and :func:`convert` would
    resume them: B's momentum is converted into A's form by the same map
    (:func:`muonckpt.kinds.state_mapping`), and the row's ``note`` says so; groups that cannot
    be converted (different roles) are a row with ``equal`` False, never compared raw.

    Memory: one full tensor from each side at a time, in reused buffers, and temporaries of
    :data:`DIFF_CHUNK` elements; rows are yielded as they are made.
    """
    if atol < 0 or rtol < 0:
        raise CheckpointError(f"atol and rtol must be non-negative, got {atol}, {rtol}")
    dir_a, man_a = open_checkpoint(a)
    dir_b, man_b = open_checkpoint(b)

    def entry(manifest: Manifest, name: str) -> ParamEntry | None:
        try:  # the manifest's own index of its params: no second dict of 100k names
            return manifest.param(name)
        except CheckpointError:
            return None

    names = itertools.chain(
        (e.name for e in man_a.params),
        (e.name for e in man_b.params if entry(man_a, e.name) is None),
    )
    pieces_a, pieces_b = man_a.pieces_of(), man_b.pieces_of()
    scales = _momentum_scales(man_a, man_b)

    def row(param: str, key: str | None, note: str | None = None, **values: Any) -> DiffRow:
        return DiffRow(param, key, note=note, **values)

    with (
        PieceReader(dir_a, man_a, reuse_outputs=1) as read_a,
        PieceReader(dir_b, man_b, reuse_outputs=1) as read_b,
    ):
        for name in names:
            ea, eb = entry(man_a, name), entry(man_b, name)
            if ea is None or eb is None:
                yield row(name, None, f"param only in {'A' if eb is None else 'B'}")
                continue
            if ea.shape != eb.shape:
                yield row(name, None, f"A has shape {list(ea.shape)}, B {list(eb.shape)}")
                continue
            keys = list(ea.tensor_keys) + [k for k in eb.tensor_keys if k not in ea.tensor_keys]
            for key in keys:
                if key not in ea.tensor_keys or key not in eb.tensor_keys:
                    yield row(name, key, f"stored only in {'A' if key in ea.tensor_keys else 'B'}")
                    continue
                dtype_a, dtype_b = ea.dtype_of(key), eb.dtype_of(key)
                if dtype_a != dtype_b:
                    yield row(name, key, f"A is {dtype_a}, B {dtype_b}")
                    continue
                scale: float | str = 1.0
                note: str | None = None
                if key == "momentum_buffer":
                    scale, note = scales.get((ea.group, eb.group), (1.0, None))
                if isinstance(scale, str):  # the forms cannot be converted: never compared raw
                    yield row(name, key, scale)
                    continue
                whole = whole_region(ea.numel)
                x = read_a.gather(pieces_a[name, key], ea, key, whole)
                y = read_b.gather(pieces_b[name, key], eb, key, whole)
                yield row(name, key, note, **_compare(x, y, dtype_a, scale, atol, rtol))
                del x, y
            yield from _scalar_rows(man_a, man_b, ea, eb, row)
        yield from _model_rows(man_a, man_b, read_a, read_b, row, atol, rtol)
        yield from _extra_rows(man_a, man_b, read_a, read_b, row)
    same_step = man_a.step == man_b.step
    note = None if same_step else f"A at step {man_a.step}, B at step {man_b.step}"
    yield row("checkpoint", "step", note, equal=same_step, bitwise=same_step)
    for g, (ga, gb) in enumerate(zip(man_a.groups, man_b.groups, strict=False)):
        if ga.hyperparams != gb.hyperparams:
            changed = sorted(
                k
                for k in set(ga.hyperparams) | set(gb.hyperparams)
                if ga.hyperparams.get(k) != gb.hyperparams.get(k)
            )
            yield row(f"group {g}", "hyperparams", f"settings differ: {changed}")
    if len(man_a.groups) != len(man_b.groups):
        yield row("groups", None, f"A has {len(man_a.groups)} param groups, B {len(man_b.groups)}")


def _model_rows(
    man_a: Manifest,
    man_b: Manifest,
    read_a: PieceReader,
    read_b: PieceReader,
    row: Callable[..., DiffRow],
    atol: float,
    rtol: float,
) -> Iterator[DiffRow]:
    """Rows of a model file's other tensors (``save(..., model=)``: buffers) and its aliases."""
    model_a, model_b = man_a.model, man_b.model
    tensors_a = {t.name: t for t in model_a.tensors} if model_a is not None else {}
    tensors_b = {t.name: t for t in model_b.tensors} if model_b is not None else {}
    for name in [*tensors_a, *(n for n in tensors_b if n not in tensors_a)]:
        ta, tb = tensors_a.get(name), tensors_b.get(name)
        if ta is None or tb is None:
            yield row(name, PARAM_KEY, f"model tensor only in {'A' if tb is None else 'B'}")
            continue
        if ta.shape != tb.shape or ta.dtype_of(PARAM_KEY) != tb.dtype_of(PARAM_KEY):
            yield row(name, PARAM_KEY, "model tensors of different shapes or dtypes")
            continue
        whole = whole_region(ta.numel)
        x = read_a.gather(_model_pieces(man_a, name), ta, PARAM_KEY, whole)
        y = read_b.gather(_model_pieces(man_b, name), tb, PARAM_KEY, whole)
        yield row(
            name,
            PARAM_KEY,
            "model tensor",
            **_compare(x, y, ta.dtype_of(PARAM_KEY), 1.0, atol, rtol),
        )
    aliases_a = model_a.aliases if model_a is not None else {}
    aliases_b = model_b.aliases if model_b is not None else {}
    if aliases_a or aliases_b:
        same = dict(aliases_a) == dict(aliases_b)
        note = None if same else f"A ties {dict(aliases_a)}, B {dict(aliases_b)}"
        yield row("model", "aliases", note, equal=same, bitwise=same)


def _model_pieces(manifest: Manifest, name: str) -> list[Piece]:
    pieces = manifest.model.pieces if manifest.model is not None else ()
    return [p for p in pieces if p.param == name]


def _extra_rows(
    man_a: Manifest,
    man_b: Manifest,
    read_a: PieceReader,
    read_b: PieceReader,
    row: Callable[..., DiffRow],
) -> Iterator[DiffRow]:
    """Rows of the job's own state (``extra``, each rank's ``rank_extra``): its JSON values
    per tree, its tensors by their bytes."""
    trees_a = dict(man_a.extra.trees()) if man_a.extra is not None else {}
    trees_b = dict(man_b.extra.trees()) if man_b.extra is not None else {}
    for what in [*trees_a, *(n for n in trees_b if n not in trees_a)]:
        ta, tb = trees_a.get(what), trees_b.get(what)
        if ta is None or tb is None:
            yield row(what, None, f"saved only in {'A' if tb is None else 'B'}")
            continue
        same = ta.values == tb.values
        note = None if same else "the values differ"
        yield row(what, "values", note, equal=same, bitwise=same)
        tensors_b = {t.path: t for t in tb.tensors}
        for tensor in ta.tensors:
            other = tensors_b.get(tensor.path)
            at = f"{what}{''.join(f'[{step!r}]' for step in tensor.path)}"
            if other is None or (other.dtype, other.shape) != (tensor.dtype, tensor.shape):
                yield row(at, None, "a tensor in A, not of this dtype and shape in B")
                continue
            same = bool(
                np.array_equal(read_a.read_extra(tensor, what), read_b.read_extra(other, what))
            )
            yield row(at, None, None if same else "the bytes differ", equal=same, bitwise=same)


def _momentum_scales(
    man_a: Manifest, man_b: Manifest
) -> dict[tuple[int, int], tuple[float | str, str | None]]:
    """(A's group, B's group) -> (factor, note) turning B's Muon momentum into A's form, by
    the map :func:`muonckpt.load` uses; the factor is the reason as a string where the groups
    cannot be compared (their roles differ). Pairs whose forms agree, or where a side does not
    record its form (format 1), are left out (compared as stored)."""
    groups_b = {e.name: e.group for e in man_b.params}
    pairs = {(e.group, groups_b[e.name]) for e in man_a.params if e.name in groups_b}
    out: dict[tuple[int, int], tuple[float | str, str | None]] = {}
    for ga, gb in pairs:
        raw_a, raw_b = man_a.groups[ga].optimizer, man_b.groups[gb].optimizer
        if not raw_a or not raw_b:
            continue
        kind_a, kind_b = kinds.GroupKind.from_json(raw_a), kinds.GroupKind.from_json(raw_b)
        if kind_a.momentum_form == kind_b.momentum_form or None in (kind_a.role, kind_b.role):
            continue
        try:
            mapping = kinds.state_mapping(kind_b, kind_a, f"of group {gb}", None)
        except MuonCkptError as exc:
            out[ga, gb] = (f"not comparable: {exc}", None)
            continue
        factor = mapping.keys.get("momentum_buffer", ("", 1.0))[1]
        out[ga, gb] = (factor, f"B converted {mapping.note}" if mapping.note else None)
    return out


def _scalar_rows(
    man_a: Manifest,
    man_b: Manifest,
    ea: ParamEntry,
    eb: ParamEntry,
    row: Callable[..., DiffRow],
) -> Iterator[DiffRow]:
    """A param's scalar rows; its step count compared as a number wherever each side keeps it
    (torch: a 0-d tensor per param, KellerJordan: an int per param, packaged: in the group)."""
    keys = set(ea.scalars) | set(eb.scalars)
    if "step" in keys and ea.state_keys and eb.state_keys:
        keys.discard("step")
        step_a, step_b = man_a.step_of(ea), man_b.step_of(eb)
        if step_a == step_b:
            yield row(ea.name, "step", None, equal=True, bitwise=True)
        else:
            yield row(ea.name, "step", f"A is {step_a!r}, B {step_b!r}")
    for key in sorted(keys):
        sa, sb = ea.scalars.get(key), eb.scalars.get(key)
        if sa is None or sb is None:
            yield row(ea.name, key, f"stored only in {'A' if sb is None else 'B'}")
        elif sa == sb:
            yield row(ea.name, key, None, equal=True, bitwise=True)
        else:
            yield row(ea.name, key, f"A is {sa.value!r}, B {sb.value!r}")


def _compare(
    x: np.ndarray, y: np.ndarray, dtype: str, scale: float, atol: float, rtol: float
) -> dict[str, Any]:
    """Raw bytes ``x`` and ``y`` (of ``dtype``; ``y`` times ``scale`` first) compared: bitwise
    by their bytes, else element by element in :data:`DIFF_CHUNK` pieces as float64."""
    if scale == 1.0 and np.array_equal(x, y):
        return {"max_abs": 0.0, "max_rel": 0.0, "equal": True, "bitwise": True}
    import torch

    tx, ty = storage.tensor_of_bytes(x, dtype), storage.tensor_of_bytes(y, dtype)
    if scale != 1.0:
        ty = ty.mul_(scale)  # in B's reused buffer, as convert scales it
    bitwise, max_abs, max_rel, close = True, 0.0, 0.0, True
    for lo in range(0, tx.numel(), DIFF_CHUNK):
        cx, cy = tx[lo : lo + DIFF_CHUNK], ty[lo : lo + DIFF_CHUNK]
        same = torch.equal(cx.view(torch.uint8), cy.view(torch.uint8))
        bitwise = bitwise and same
        if same:
            continue
        x64, y64 = cx.to(torch.float64), cy.to(torch.float64)
        delta = (x64 - y64).abs().masked_fill_(torch.isnan(x64) & torch.isnan(y64), 0.0)
        rel = delta / y64.abs().clamp_min(torch.finfo(torch.float64).tiny)
        chunk_abs, chunk_rel = float(delta.max()), float(rel.max())
        if math.isnan(chunk_abs) or math.isnan(chunk_rel):
            chunk_abs = chunk_rel = math.inf
        max_abs, max_rel = max(max_abs, chunk_abs), max(max_rel, chunk_rel)
        close = close and bool(torch.isclose(x64, y64, rtol=rtol, atol=atol, equal_nan=True).all())
    return {"max_abs": max_abs, "max_rel": max_rel, "equal": close, "bitwise": bitwise}
