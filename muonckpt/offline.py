"""Offline checkpoint tools: consolidate, reshard, summarize and diff, without an optimizer.

Library functions behind the ``muonckpt`` CLI, driven by a checkpoint's manifest and the pure
layout math of :mod:`muonckpt.layout`. All file I/O goes through :mod:`muonckpt.storage` and
:class:`muonckpt.pieces.PieceReader` (which verifies checksums on every read). A single-process
``consolidate`` or ``reshard`` does not import torch.

``consolidate`` and ``reshard`` first plan the whole output (a :class:`_Job`: files, and which
elements of which param state each output tensor holds), then write it

* in this process, one file after another, streaming tensor by tensor; or
* with ``workers=N``, in N local processes (gloo), or with ``collective=True``, in every rank
  of an initialized default process group (torchrun): the output tensors are split among the
  ranks by bytes (:func:`muonckpt.workplan.split_work`), each rank writes its share at the
  planned offsets of the shared files, and rank 0 writes the manifest last and commits.

Memory per process is what one output tensor needs, twice (the next one is read on a thread
while the current one is written): one full tensor for consolidate, one rank's piece of one
tensor for reshard, plus one source span. Outputs are written into a staging directory beside
the target, manifest last, and swapped in atomically (:func:`muonckpt.storage.swap_in`).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import kinds, storage, writing
from .errors import CheckpointError, LayoutError, MuonCkptError
from .layout import LayoutOptions, ParamSpec, Topology, arrange, whole_region
from .manifest import (
    CONSOLIDATED,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    MANIFEST_NAME,
    MODEL_INDEX_FILE,
    PER_RANK,
    GroupEntry,
    Manifest,
    ParamEntry,
    Scalar,
    json_safe,
)
from .pieces import PieceReader, open_checkpoint
from .retention import checkpoint_step
from .writeplan import (
    TensorWrite,
    WritePlan,
    consolidated_plan,
    per_rank_plan,
    unique_tensor_keys,
)
from .writing import Progress

if TYPE_CHECKING:
    import torch

# torch (and so collectives and launch) is imported only by the paths that need it: several
# processes, and diff.

MAX_RANKS = 1 << 16
"""The most ranks ``reshard`` writes files for: planning costs ranks x params."""

WORKER_TIMEOUT: float = 1800.0
"""Seconds one of several processes (``workers > 1``, torchrun) waits for the others at one
step (the rendezvous, each exchange of results) before the run fails. The run as a whole has
no limit: it ends when the work is done, a process fails, or the command is interrupted; and
no worker outlives the command (see :mod:`muonckpt.launch`)."""

__all__ = [
    "MAX_RANKS",
    "WORKER_TIMEOUT",
    "Progress",
    "consolidate",
    "convert",
    "diff",
    "open_checkpoint",
    "reshard",
    "summarize",
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
    ``model.safetensors`` (loadable with ``model.load_state_dict(load_file(...))``).

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
    items = [((e.name, k, e.dtype_of(k)), e.shape) for e in manifest.params for k in e.tensor_keys]
    job = _Job(
        _output_manifest(manifest, kind=CONSOLIDATED), consolidated_plan(items, max_shard_size)
    )
    if workers > 1:
        options = {"max_shard_size": max_shard_size, "overwrite": overwrite}
        return _spawn(consolidate, workers, src, dst, options, progress)
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
        replace(e, tp_split_dim=overrides.get(e.name, e.tp_split_dim)) for e in manifest.params
    )
    unique_tensor_keys(((e.name, k) for e in params for k in e.tensor_keys), directory)
    specs = [ParamSpec(e.name, e.shape, tp_split_dim=e.tp_split_dim, group=e.group) for e in params]
    layout = arrange(specs, topology, options=options)
    owned_by_rank = [
        [
            ((entry.name, key, entry.dtype_of(key)), region)
            for index, entry in enumerate(params)
            if (region := layout.owner_region(index, *topology.coords(rank))).numel
            for key in entry.tensor_keys
        ]
        for rank in range(topology.world_size)
    ]
    job = _Job(
        _output_manifest(manifest, kind=PER_RANK, topology={"dp": dp, "tp": tp}, params=params),
        per_rank_plan(owned_by_rank),
    )
    if workers > 1:
        worker_options = {
            "dp": dp,
            "tp": tp,
            "options": options,
            "tp_split_dims": overrides,
            "overwrite": overwrite,
        }
        return _spawn(reshard, workers, src, dst, worker_options, progress)
    called = {
        "dp": dp,
        "tp": tp,
        "options": json_safe(dataclasses.asdict(options)),
        "tp_split_dims": overrides,
    }
    return _write("reshard", job, directory, manifest, dst, overwrite, progress, collective, called)


def _output_manifest(manifest: Manifest, **changes: Any) -> Manifest:
    """The manifest of a rewrite of ``manifest``: current format, files and pieces still empty."""
    return replace(manifest, **changes, files=(), pieces=(), format_version=FORMAT_VERSION)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Rewrite a checkpoint for another Muon implementation: ``packaged`` (muonckpt.Muon),
    ``torch`` (torch.optim.Muon + AdamW) or ``keller-jordan`` (muon.MuonWithAuxAdam).

    Momentum is converted between sum and EMA form by ``1 - mu`` exactly as :func:`muonckpt.load`
    converts it in memory, AdamW step counts move to where the target keeps them, and each
    group records what it now holds (:func:`muonckpt.kinds.converted`); files, pieces and
    regions keep the source's layout. Streams one tensor at a time, atomic like every output.

    Raises:
        CheckpointError: for a checkpoint whose groups do not say which optimizer saved them.
    """
    directory, manifest = open_checkpoint(src)
    groups, scales = [], []
    for g, group in enumerate(manifest.groups):
        if not group.optimizer:
            raise CheckpointError(
                f"group {g} does not say which optimizer saved it (format 1): cannot convert",
                path=directory / MANIFEST_NAME,
            )
        source = kinds.GroupKind.from_json(group.optimizer)
        target = kinds.converted(source, to)
        factor = kinds.state_mapping(source, target, f"group {g}", None).keys
        scales.append(factor.get("momentum_buffer", ("", 1.0))[1])
        hyper = dict(group.hyperparams)
        step = manifest.latest_step(group.params)
        if target.step_in == "group" and step is not None:
            hyper["step"] = step
        groups.append(replace(group, hyperparams=hyper, optimizer=target.to_json()))
    params = tuple(_converted_steps(manifest, e, groups[e.group]) for e in manifest.params)
    by_name = {e.name: e for e in params}
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
    texts = {
        name: storage.read_text(directory / name)
        for name in (INDEX_FILE, MODEL_INDEX_FILE)
        if (directory / name).is_file()
    }
    files = {f.name: {"format": FORMAT_NAME} for f in manifest.files}
    if manifest.kind == PER_RANK:  # per-rank files name their rank, as save writes them
        files = {
            f.name: {"format": FORMAT_NAME, "rank": str(r)} for r, f in enumerate(manifest.files)
        }
    plan = WritePlan(files, writes, texts)
    job = _Job(_output_manifest(manifest, groups=tuple(groups), params=params), plan)
    return _write("convert", job, directory, manifest, dst, overwrite, progress, collective=False)


def _converted_steps(manifest: Manifest, entry: ParamEntry, group: GroupEntry) -> ParamEntry:
    """The param with its AdamW step count where the target keeps it."""
    step_in = group.optimizer.get("step_in")
    step = manifest.step_of(entry)
    scalars = {k: v for k, v in entry.scalars.items() if k != "step"}
    if step is not None and entry.state_keys and step_in == "tensor":
        scalars["step"] = Scalar(float(step), "F32")
    elif step is not None and entry.state_keys and step_in == "int":
        scalars["step"] = Scalar(int(step), None)
    return replace(entry, scalars=scalars)


def _check_workers(workers: int, collective: bool) -> None:
    if workers < 1:
        raise CheckpointError(f"workers must be positive, got {workers}")
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

    def finished(reports: writing.Reports) -> Manifest:
        return replace(job.manifest, files=tuple(reports.files), pieces=tuple(reports.pieces))

    if not collective:

        def write(staging: Path) -> writing.Written:
            with PieceReader(directory, manifest, reuse_outputs=2) as reader:
                return writing.write_files(plan, staging, lambda w: fetch(reader, w), progress)

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
        shown = _scaled(progress, plan.total_bytes, len(plan.writes))

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

    return writing.write_checkpoint(
        steps,
        dst,
        overwrite=overwrite,
        write=write_share,
        manifest=finished,
        create=lambda staging: writing.create_shared(plan, staging),
        seal=lambda staging: writing.seal_shared(plan, staging),
        source=directory,
    )


def _scaled(progress: Progress, total: int, tensors: int) -> Progress:
    """Rank 0's progress through its own share, shown as a fraction of the whole job."""

    def scaled(done: int, share: int, written: int, share_tensors: int) -> None:
        fraction = done / share if share else written / share_tensors if share_tensors else 1.0
        progress(round(fraction * total), total, round(fraction * tensors), tensors)

    return scaled


def _spawn(
    operation: Callable[..., Path],
    workers: int,
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: dict[str, Any],
    progress: Progress | None,
) -> Path:
    """Run ``operation(src, dst, **options, collective=True)`` in ``workers`` gloo processes;
    rank 0's progress comes back through a queue.

    The target is checked here first, so a refused output starts no process. Rank 0 stages
    at a path chosen here, so that when the run fails or this process is interrupted
    (KeyboardInterrupt, SIGTERM in the CLI) the staging directory is removed here once the
    workers are gone, whatever state they were killed in. Warnings of the workers
    (:class:`~muonckpt.errors.CheckpointWarning`) are issued again here.
    """
    import uuid
    import warnings

    from .errors import CheckpointWarning
    from .launch import run_distributed

    storage.check_target(dst, options["overwrite"], source=src)
    token = uuid.uuid4().hex[:8]
    queue = mp.get_context("forkserver").Queue() if progress is not None else None
    relay = threading.Thread(target=_relay, args=(queue, progress), daemon=True)
    if queue is not None:
        relay.start()
    try:
        results = run_distributed(
            _worker,
            workers,
            operation,
            str(src),
            str(dst),
            options,
            queue,
            token,
            timeout=None,
            wait_timeout=WORKER_TIMEOUT,
        )
    except BaseException:
        storage.discard(storage.staging_path(dst, token))
        raise
    finally:
        if queue is not None:
            queue.put(None)
            relay.join(timeout=10)
    for result in results:
        for message in result.get("warnings", []):
            warnings.warn(message, CheckpointWarning, stacklevel=3)
    failed = [r for r in results if "error" in r]
    if failed:
        error = CheckpointError(failed[0]["error"])
        if hasattr(error, "add_note"):  # Python 3.11+: shown with the traceback (--debug)
            error.add_note(f"the worker's traceback:\n{failed[0].get('traceback', '')}")
        raise error
    return Path(dst)


def _relay(queue: Any, progress: Progress) -> None:
    while (update := queue.get()) is not None:
        progress(*update)


def _worker(
    operation: Callable[..., Path],
    src: str,
    dst: str,
    options: dict[str, Any],
    queue: Any,
    token: str,
) -> dict[str, Any]:
    """(one of the ``workers`` processes) Its part of the collective operation.

    Rank 0 stages at the path ``token`` names, and if the parent dies (the lifeline of
    :mod:`muonckpt.launch`) it first makes sure it never commits, then removes that staging
    directory, then dies.
    """
    import traceback
    import warnings

    from . import collectives, launch
    from .errors import CheckpointWarning

    if collectives.global_rank() == 0:
        staging = storage.preset_staging(dst, token)

        def abandon() -> None:
            storage.abandon_commits()
            storage.discard(staging)

        launch.on_orphaned(abandon)
    progress = None if queue is None else lambda *update: queue.put(update)
    outcome: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        try:
            operation(src, dst, **options, progress=progress, collective=True)
        except MuonCkptError as exc:
            outcome["error"] = str(exc)
            outcome["traceback"] = traceback.format_exc()
    shown = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    if shown:
        outcome["warnings"] = shown
    return outcome


def summarize(src: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``muonckpt inspect`` shows: kind, topology, step, groups, params and totals.

    Reads only the manifest (and checks that its pieces cover every state tensor once).
    """
    directory, manifest = open_checkpoint(src)
    params = [
        {
            "name": e.name,
            "shape": list(e.shape),
            "dtypes": dict(e.dtypes),
            "value_dtype": e.value_dtype,
            "scalars": {k: v.value for k, v in e.scalars.items()},
            "tp_split_dim": e.tp_split_dim,
            "group": e.group,
            "state_keys": list(e.state_keys),
            "bytes": sum(e.numel * storage.itemsize(e.dtype_of(k)) for k in e.tensor_keys),
        }
        for e in manifest.params
    ]
    return {
        "path": str(directory),
        "kind": manifest.kind,
        "format_version": manifest.format_version,
        "topology": dict(manifest.topology),
        "step": checkpoint_step(manifest),
        "groups": [
            {"hyperparams": dict(g.hyperparams), "params": list(g.params)} for g in manifest.groups
        ],
        "params": params,
        "totals": {
            "params": len(params),
            "tensors": sum(len(e.state_keys) for e in manifest.params),
            "values": sum(e.value_dtype is not None for e in manifest.params),
            "bytes": sum(p["bytes"] for p in params),
            "file_bytes": sum(f.bytes for f in manifest.files),
            "files": len(manifest.files),
            "pieces": len(manifest.pieces),
        },
    }


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> list[dict[str, Any]]:
    """Compare two checkpoints (any kinds, any topologies) as logical tensors.

    One row per (param, stored key): ``max_abs`` and ``max_rel`` differences and ``equal``
    (every element within ``atol + rtol * |b|``; NaNs equal NaNs); a row per scalar state
    value (equal or not, exactly), and one per param group whose settings differ. A param or
    key on only one side, or of different shape or dtype, is a row with ``equal`` False and a
    ``note``.
    Memory: one full tensor from each side at a time.
    """
    if atol < 0 or rtol < 0:
        raise CheckpointError(f"atol and rtol must be non-negative, got {atol}, {rtol}")
    dir_a, man_a = open_checkpoint(a)
    dir_b, man_b = open_checkpoint(b)
    params_a = {e.name: e for e in man_a.params}
    params_b = {e.name: e for e in man_b.params}
    names = [e.name for e in man_a.params] + [
        e.name for e in man_b.params if e.name not in params_a
    ]
    pieces_a, pieces_b = man_a.pieces_of(), man_b.pieces_of()
    rows: list[dict[str, Any]] = []

    def row(param: str, key: str | None, note: str | None = None, **values: Any) -> None:
        rows.append(
            {
                "param": param,
                "key": key,
                "max_abs": None,
                "max_rel": None,
                "equal": False,
                "bitwise": False,
                "note": note,
                **values,
            }
        )

    with PieceReader(dir_a, man_a) as read_a, PieceReader(dir_b, man_b) as read_b:
        for name in names:
            ea, eb = params_a.get(name), params_b.get(name)
            if ea is None or eb is None:
                row(name, None, f"param only in {'A' if eb is None else 'B'}")
                continue
            if ea.shape != eb.shape:
                row(name, None, f"A has shape {list(ea.shape)}, B {list(eb.shape)}")
                continue
            keys = list(ea.tensor_keys) + [k for k in eb.tensor_keys if k not in ea.tensor_keys]
            for key in keys:
                if key not in ea.tensor_keys or key not in eb.tensor_keys:
                    row(name, key, f"stored only in {'A' if key in ea.tensor_keys else 'B'}")
                    continue
                dtype_a, dtype_b = ea.dtype_of(key), eb.dtype_of(key)
                if dtype_a != dtype_b:
                    row(name, key, f"A is {dtype_a}, B {dtype_b}")
                    continue
                whole = whole_region(ea.numel)
                x = storage.tensor_of_bytes(
                    read_a.gather(pieces_a[name, key], ea, key, whole), dtype_a
                )
                y = storage.tensor_of_bytes(
                    read_b.gather(pieces_b[name, key], eb, key, whole), dtype_b
                )
                row(name, key, **_compare(x, y, atol, rtol))
                del x, y
            for key in sorted(set(ea.scalars) | set(eb.scalars)):
                sa, sb = ea.scalars.get(key), eb.scalars.get(key)
                if sa is None or sb is None:
                    row(name, key, f"stored only in {'A' if sb is None else 'B'}")
                elif sa == sb:
                    row(name, key, None, equal=True, bitwise=True)
                else:
                    row(name, key, f"A is {sa.value!r}, B {sb.value!r}")
    for g, (ga, gb) in enumerate(zip(man_a.groups, man_b.groups, strict=False)):
        if ga.hyperparams != gb.hyperparams:
            changed = sorted(
                k
                for k in set(ga.hyperparams) | set(gb.hyperparams)
                if ga.hyperparams.get(k) != gb.hyperparams.get(k)
            )
            row(f"group {g}", "hyperparams", f"settings differ: {changed}")
    if len(man_a.groups) != len(man_b.groups):
        row("groups", None, f"A has {len(man_a.groups)} param groups, B {len(man_b.groups)}")
    return rows


def _compare(x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> dict[str, Any]:
    import torch

    if x.numel() == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "equal": True}
    bitwise = torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    x64, y64 = x.to(torch.float64), y.to(torch.float64)
    both_nan = torch.isnan(x64) & torch.isnan(y64)
    delta = (x64 - y64).abs().masked_fill(both_nan, 0.0)
    rel = delta / y64.abs().clamp_min(torch.finfo(torch.float64).tiny)
    max_abs, max_rel = float(delta.max()), float(rel.max())
    if math.isnan(max_abs):
        max_abs = max_rel = math.inf
    close = bitwise or bool(torch.isclose(x64, y64, rtol=rtol, atol=atol, equal_nan=True).all())
    return {"max_abs": max_abs, "max_rel": max_rel, "equal": close, "bitwise": bitwise}
