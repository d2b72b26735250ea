"""Writes a :class:`~muonckpt.format.writeplan.WritePlan` and commits the checkpoint: the one write
path.

Every checkpoint muonckpt produces (``save`` and ``async_save`` per rank or consolidated,
``consolidate``, ``reshard``, ``convert``; in one process or many) is written as three steps
of a :class:`Steps` protocol:

1. ``stage`` (:func:`stage`): every rank's checks, then the root creates the staging
   directory beside the target (:func:`muonckpt.storage.make_staging`);
2. ``write``: every rank writes its tensors (:func:`write_files` for whole files,
   :func:`write_share` for its share of files written together, :func:`write_tensors` from
   memory) and reports the pieces; the root builds the manifest from the reports and commits
   (:func:`commit`: manifest last, fsync, atomic swap);
3. ``retire`` (:func:`retire`): when a checkpoint was replaced, every rank deletes a share of
   its files.

The offline tools hand their work down (:func:`write_checkpoint`). A save takes the steps one
call at a time, each handed data: the outcome of what each rank did before a step
(:class:`~muonckpt.files.attempt.Attempt`: its values, or its refusal, which the step
raises on every rank) and, for the commit, the manifest's draft
(:func:`muonckpt.checkpoint.saving.commit`).

Across ranks the steps are :class:`muonckpt.distributed.group_steps.CollectiveSteps`, or for a
background save, which must not use the job's process groups,
:class:`~muonckpt.files.directory_steps.DirectorySteps` (messages as files); in one
process :class:`LocalSteps`. This module itself never calls torch.distributed and imports
torch only where a tensor crosses, so a single-process offline tool runs without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from .. import storage
from ..distributed.steps import disagreement
from ..errors import (
    CheckpointError,
    CheckpointWarning,
    InterruptedAfterCommit,
    MuonCkptError,
    StateDictError,
)
from ..format.manifest import (
    FORMAT_NAME,
    ExtraTensor,
    ExtraValues,
    FileEntry,
    Manifest,
    PieceTable,
    ValuePath,
    extra_to_json,
)
from ..format.names import MANIFEST_NAME
from ..format.writeplan import Plan, TensorWrite, specs_of
from ..layout.workplan import WorkUnit, split_work
from ..storage.safetensors_writer import prefetched
from . import _indexes
from ._indexes import check_manifest_fits as check_manifest_fits
from ._reports import Reports as Reports
from ._reports import Written as Written
from .attempt import Attempt
from .pieces import all_files


class HostCopy(Protocol):
    """Where a save's tensors pass on their way to a file (:class:`muonckpt.state.hostcopy.
    HostBuffers`, from the layer above, which this executor does not import)."""

    def to_host(self, tensor: Any) -> Any:
        """``tensor`` in host memory (a reused buffer's view for a device tensor)."""
        ...


Progress = Callable[[int, int, int, int], None]
"""``progress(done_bytes, total_bytes, done_tensors, total_tensors)``, called once at the start
and after each tensor is written."""

Fetch = Callable[[TensorWrite], Any]
"""The data of one planned tensor: a tensor of its dtype and element count, or its raw bytes
(1-D uint8 numpy), as :meth:`muonckpt.storage.SafetensorsWriter.write` takes them."""

T = TypeVar("T")


class Steps(Protocol):
    """A protocol run as named steps; each step's value, or any rank's failure, on every rank."""

    is_root: bool
    rank: int
    ranks: list[int]

    def each_then_root(
        self, step: str, each: Callable[[], Any], then: Callable[[list[Any]], T]
    ) -> T: ...


class LocalSteps:
    """:class:`Steps` in one process: each step runs its work here, failures propagate as they
    are."""

    def __init__(self) -> None:
        self.is_root, self.rank, self.ranks = True, 0, [0]

    def each_then_root(
        self, step: str, each: Callable[[], Any], then: Callable[[list[Any]], T]
    ) -> T:
        return then([each()])


def write_checkpoint(
    steps: Steps,
    final: str | os.PathLike[str],
    *,
    overwrite: bool,
    write: Callable[[Path], Written],
    manifest: Callable[[Reports], Manifest],
    create: Callable[[Path], None] = lambda staging: None,
    seal: Callable[[Path], None] = lambda staging: None,
    source: str | os.PathLike[str] | None = None,
) -> Path:
    """Stage, write and commit a checkpoint at ``final``; a protocol over ``steps``' ranks
    (:func:`stage`, then :func:`finish`): the offline tools' write.

    Args:
        write: (every rank) writes this rank's tensors into the staging directory.
        manifest: (the root) the checkpoint's manifest, from every rank's report.
        create: (the root) prepares the fresh staging directory (files written together).
        seal: (the root) once every rank has written, before the manifest (files written
            together get their names).
        source: a checkpoint being read, which ``final`` must not be inside or around.
    """
    staging = stage(steps, final, overwrite=overwrite, create=create, source=source)
    return finish(steps, staging, final, write=write, manifest=manifest, seal=seal, source=source)


class Agreeing(Protocol):
    """What a rank found before the ``stage`` step that the ranks must have alike."""

    @property
    def agreement(self) -> dict[str, Any] | None: ...

    @property
    def report(self) -> Any:
        """What the root judges together with the other ranks' (JSON; ``stage``'s ``judge``)."""


def stage(
    steps: Steps,
    final: str | os.PathLike[str],
    *,
    overwrite: bool,
    create: Callable[[Path], None] = lambda staging: None,
    source: str | os.PathLike[str] | None = None,
    checked: Attempt[Agreeing] | None = None,
    judge: Callable[[list[Any]], None] | None = None,
    mailbox: bool = False,
) -> Path:
    """The ``stage`` step: every rank hands in ``checked``, what it collected before (a save's
    :func:`muonckpt.checkpoint.saving.collect`): its refusal fails the step on every rank, and
    its ``agreement`` (what the ranks must have alike that is only known once it ran: a digest
    of values it took) is compared and its ``report`` judged (``judge``, on the root: a save's
    check of where the state is, whose :class:`StateDictError` is raised as one on every
    rank); when all passed and agree, the root checks the target and
    creates the staging directory (and, with ``mailbox``, the
    :class:`~muonckpt.storage.Mailbox` of a background finish); its path on every rank. (That
    the ranks were called alike, with the same arguments, is the operation's rendezvous,
    :func:`muonckpt.distributed.group_steps.rendezvous`, before this.)"""
    final = Path(final)

    def mine() -> list[Any] | None:
        if checked is None:
            return None
        found = checked.result()
        return [found.agreement, found.report if judge is not None else None]

    def make(found: list[list[Any] | None]) -> dict[str, str]:
        if found[0] is not None:
            given = [each or [None, None] for each in found]
            differ = disagreement([agreement or {} for agreement, _ in given], steps.ranks)
            if differ is not None:
                raise CheckpointError(f"the ranks disagree on {differ}; nothing was written")
            try:
                if judge is not None:
                    judge([report for _, report in given])
            except StateDictError as exc:
                return {"refused": str(exc)}
        staging = storage.store.create_staging(final, overwrite, source=source)
        try:
            create(staging)
            if mailbox:
                storage.Mailbox(storage.mailbox_path(staging)).create()
        except BaseException:
            storage.store.discard(staging)
            raise
        return {"staging": str(staging)}

    decided = steps.each_then_root("stage", mine, make)
    if "refused" in decided:  # the state dict does not fit its sharding: that error, on all
        raise StateDictError(f"stage: {decided['refused']}", agreed_by=steps.ranks)
    return Path(decided["staging"])


def abandon(staging: Path) -> None:
    """(the root) Remove a staging directory (and its mailbox) that will never be written."""
    storage.store.discard(staging)
    storage.Mailbox(storage.mailbox_path(staging)).remove()


Replaced = dict[str, Any]
"""A checkpoint the commit replaced: where it now is (``at``) and its files, for
:func:`retire`."""


def finish(
    steps: Steps,
    staging: Path,
    final: str | os.PathLike[str],
    *,
    write: Callable[[Path], Written],
    manifest: Callable[[Reports], Manifest],
    seal: Callable[[Path], None] = lambda staging: None,
    source: str | os.PathLike[str] | None = None,
) -> Path:
    """The ``write`` step (every rank writes, the root commits: with ``source``, the files
    read, only a manifest its own reader accepts) and, when a checkpoint was replaced, the
    ``retire`` step; a failure discards the staging directory."""
    final = Path(final)
    replaced = write_step(steps, staging, final, lambda: write(staging), manifest, seal, source)
    return retire(steps, replaced, final)


def write_step(
    steps: Steps,
    staging: Path,
    final: Path,
    written: Callable[[], Written],
    manifest: Callable[[Reports], Manifest],
    seal: Callable[[Path], None] = lambda staging: None,
    source: str | os.PathLike[str] | None = None,
) -> Replaced | None:
    """The ``write`` step: every rank's report of ``written()`` to the root, which merges them,
    builds the ``manifest`` and commits (:func:`commit`, of ``source``); the checkpoint it
    replaced (None also when something failed after the commit: that is a warning, and
    nothing is retired)."""
    across = len(steps.ranks) > 1  # reports cross ranks as JSON; in one process, as they are

    def commit_all(raw: list[Any]) -> Replaced | None:
        seal(staging)
        reports = [Written.from_json(r) for r in raw] if across else raw
        replaced = commit(staging, final, manifest(Reports.merged(reports, staging)), source)
        return (
            None
            if replaced is None
            else {"at": str(replaced), "files": storage.store.entries(replaced)}
        )

    committed: list[bool] = []

    def mark() -> None:
        committed.append(True)

    storage.watch_commit(final, mark, staging=staging)
    staged = storage.directory_identity(staging)  # another rank's swap keeps it: committed_as
    try:
        each = (lambda: written().to_json()) if across else written
        return steps.each_then_root("write", each, commit_all)
    except BaseException as exc:
        # After the swap (by this process, or by a root that died before telling the others)
        # the new checkpoint is whole, whatever came next.
        if committed or storage.committed_as(final, staged):
            after_commit(exc, final)
            return None
        if steps.is_root:
            storage.store.discard(staging)
        raise
    finally:
        storage.unwatch_commit(final, mark)


def after_commit(exc: BaseException, final: Path) -> Path:
    """What a failure after the commit becomes: an interruption (KeyboardInterrupt, SIGTERM in
    the CLI) an :class:`~muonckpt.errors.InterruptedAfterCommit` naming ``final``, any other
    BaseException raised again; an error is a :class:`CheckpointWarning` and the call succeeds
    (the new checkpoint is whole)."""
    if isinstance(exc, KeyboardInterrupt):
        raise InterruptedAfterCommit(final) from exc
    if not isinstance(exc, Exception):
        raise exc
    warnings.warn(f"committed {final}, but then: {exc}", CheckpointWarning, stacklevel=3)
    return final


def retire(steps: Steps, replaced: Replaced | None, final: str | os.PathLike[str]) -> Path:
    """The ``retire`` step, after the commit: every rank deletes its share of the ``replaced``
    checkpoint's files (nothing when none was); a failure is a warning (the new checkpoint is
    in place), an interruption is raised tagged (:func:`after_commit`). ``final``, as a path."""
    final = Path(final)
    try:
        _retire(steps, replaced, final)
    except BaseException as exc:
        return after_commit(exc, final)
    return final


def _retire(steps: Steps, replaced: Replaced | None, final: Path) -> None:
    """The ``retire`` step, after the commit: every rank deletes its share of the replaced
    checkpoint's files; a failure is a warning (the new checkpoint is in place)."""
    if replaced is not None and len(steps.ranks) == 1:
        storage.store.retire(replaced["at"])
    elif replaced is not None:
        share = replaced["files"][steps.ranks.index(steps.rank) :: len(steps.ranks)]
        try:
            steps.each_then_root(
                "retire",
                lambda: storage.store.retire(replaced["at"], share),
                lambda _: storage.store.retire(replaced["at"]),
            )
        except MuonCkptError as exc:  # committed: what is left of the old one is a warning
            warnings.warn(
                f"committed {final}, but the checkpoint it replaced may not be deleted "
                f"entirely ({replaced['at']}): {exc}",
                CheckpointWarning,
                stacklevel=3,
            )


def commit(staging: Path, final: Path, manifest: Manifest, source: object = None) -> Path | None:
    """(the root) The manifest, written last, fsync, and the atomic swap, which checks that
    every file the manifest lists is there at its size (and the manifest) right before it.

    Returns the directory now holding a checkpoint this replaced, for :meth:`storage.store.retire`.
    The manifest's coverage is checked first (every state tensor stored exactly once, as a
    reader requires), so that a faulty plan commits nothing rather than a checkpoint that
    ``verify`` and ``load`` would refuse; with ``source`` (the files a rewrite read, whose
    values may be odd) the manifest written is read back by their reader too, naming
    ``source`` (:func:`~._indexes.check_readable`).
    """
    gaps = manifest.coverage_problems()
    if gaps:
        more = f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else ""
        raise CheckpointError(
            f"the files written do not hold the whole state: {gaps[0]}{more}; nothing was "
            "committed",
            path=final,
        )
    limit = storage.MAX_TEXT_BYTES  # past it, committed, a checkpoint nothing could read
    storage.sync_files(staging, [f.name for f in all_files(manifest)])  # data before indexes
    manifest = _indexes.write_indexes(staging, manifest, final)
    size = storage.store.write_text(staging / MANIFEST_NAME, manifest.json_chunks(), limit=limit)
    if size > limit:
        extra = 0 if manifest.extra is None else len(json.dumps(extra_to_json(manifest.extra)))
        raise CheckpointError(
            f"its manifest would be {size} bytes, more than the {limit} a reader accepts: "
            f"{len(manifest.params)} params, extra / rank_extra {extra} bytes of it; nothing "
            "was committed",
            path=final,
        )
    if source is not None:
        _indexes.check_readable(staging / MANIFEST_NAME, source, final)
    listed = {entry.name: entry.bytes for entry in all_files(manifest)}
    listed.update((entry.name, entry.bytes) for entry in manifest.indexes)
    return storage.store.publish(staging, final, files={**listed, MANIFEST_NAME: size})


class _Meter:
    """Counts what was written for ``progress``; ``totals`` (bytes, tensors) asked for only
    when there is a progress to show (a plan made one file at a time counts in a pass)."""

    def __init__(self, totals: Callable[[], tuple[int, int]], progress: Progress | None) -> None:
        self.total, self.tensors = totals() if progress is not None else (0, 0)
        self.progress = progress
        self.done = self.written = 0
        if progress is not None:
            progress(0, self.total, 0, self.tensors)

    def tick(self, nbytes: int) -> None:
        self.done += nbytes
        self.written += 1
        if self.progress is not None:
            self.progress(self.done, self.total, self.written, self.tensors)


def write_files(
    plan: Plan,
    staging: Path,
    fetch: Fetch,
    progress: Progress | None = None,
    *,
    prefetch: bool = True,
    sync: bool = True,
) -> Written:
    """Write every file of ``plan`` (and its texts) into ``staging``, front to back, fetching
    each tensor when its turn comes: with ``prefetch``, the next one on a thread meanwhile
    (for reads from files) in a file whose tensors average 64 KiB or more (a handoff costs
    ~0.15 ms). Without ``sync`` each file is renamed into place unsynced:
    :func:`commit` fsyncs every data file in one parallel pass before it writes the indexes
    and the manifest (thousands of output files are not thousands of fsyncs in a row)."""
    meter = _Meter(lambda: (plan.total_bytes, plan.count), progress)
    pieces, sizes = PieceTable(), {}
    for file, writes in plan.by_file().items():
        specs, metadata = specs_of(writes), plan.files[file]
        with storage.SafetensorsWriter(staging / file, specs, metadata, sync=sync) as out:
            ahead = prefetch and sum(w.nbytes for w in writes) >= (64 << 10) * len(writes)
            fetched: Generator[tuple[TensorWrite, Any], None, None] = (
                prefetched(writes, fetch) if ahead else ((w, fetch(w)) for w in writes)
            )
            with contextlib.closing(fetched):  # on an error, the prefetch thread ends here
                for w, value in fetched:
                    out.write(w.tensor, value)
                    del value
                    meter.tick(w.nbytes)
            records = out.commit()
        sizes[file] = out.size
        pieces.extend(w.piece(*_sums(records[w.tensor])) for w in writes)
    _write_texts(plan, staging)
    return Written.of(list(plan.files), plan.iter_writes, pieces, sizes)


def write_tensors(
    plan: Plan,
    staging: Path,
    tensors: Mapping[tuple[str, str], Any],
    host: HostCopy | None,
) -> Written:
    """Write ``plan`` (:func:`write_files`) from ``tensors`` in memory, by (param, key): each
    copied through ``host``'s reused buffer when it is written (streamed), or as it is (a
    snapshot in host memory already, ``host`` None)."""

    def fetch(w: TensorWrite) -> Any:
        tensor = tensors[w.param, w.key]
        return (tensor if host is None else host.to_host(tensor)).reshape(-1)

    return write_files(plan, staging, fetch, prefetch=False)


def _sums(record: storage.TensorRecord) -> tuple[bytes, int]:
    return record.digests, record.chunk_bytes


def write_extra(
    staging: Path,
    file: str,
    values: Any,
    tensors: Sequence[tuple[ValuePath, str, tuple[int, ...], Any]],
) -> tuple[ExtraValues, FileEntry | None]:
    """One tree of the training job's own values (``extra``, or a rank's ``rank_extra``): its
    tensors (path, dtype, shape, data: a tensor, or its raw bytes) into ``file``, none when it
    has no tensor; the tree as the manifest records it, and the file."""
    if not tensors:
        return ExtraValues(values), None
    keys: dict[str, tuple[ValuePath, str, tuple[int, ...], Any]] = {}
    for item in tensors:
        key = "extra." + ".".join(map(str, item[0]))
        while key in keys:  # paths whose parts hold dots may meet: a key of its own
            key += "_"
        keys[key] = item
    specs = {key: (dtype, shape) for key, (_, dtype, shape, _) in keys.items()}
    with storage.SafetensorsWriter(staging / file, specs, {"format": FORMAT_NAME}) as out:
        for key in sorted(keys):
            out.write(key, keys[key][3])
        records = out.commit()
    stored = tuple(
        ExtraTensor(path, file, key, dtype, shape, records[key].checksums, records[key].chunk_bytes)
        for key, (path, dtype, shape, _) in keys.items()
    )
    return ExtraValues(values, stored), FileEntry(file, storage.file_size(staging / file))


def shared_files(plan: Plan, staging: Path) -> dict[str, storage.SharedSafetensorsFile]:
    """The files of ``plan`` as several processes write them together (same header for all)."""
    return {
        file: storage.SharedSafetensorsFile(staging / file, plan.specs(file), plan.files[file])
        for file in plan.files
    }


def create_shared(plan: Plan, staging: Path) -> None:
    """(one process) Every file's header, at its full length, before any process writes; and
    the plan's texts."""
    for output in shared_files(plan, staging).values():
        output.create()
    _write_texts(plan, staging)


def _write_texts(plan: Plan, staging: Path) -> None:
    for name, text in plan.texts.items():
        storage.store.write_text(staging / name, text)


def write_share(
    plan: Plan,
    index: int,
    count: int,
    staging: Path,
    fetch: Fetch,
    progress: Progress | None = None,
) -> Written:
    """Write share ``index`` of ``count`` of the tensors (:func:`share_of`) at their planned
    offsets in the files written together (made by :func:`create_shared`); every file of the
    plan is reported."""
    outputs = shared_files(plan, staging)
    share = share_of(plan, outputs, index, count)
    meter = _Meter(lambda: (sum(w.nbytes for w in share), len(share)), progress)
    pieces, current = [], None
    try:
        for w, value in prefetched(share, fetch):
            if current is not None and current != w.file:
                outputs[current].close()  # a share comes file by file: one open at a time
            current = w.file
            record = outputs[w.file].write(w.tensor, value)
            del value
            pieces.append(w.piece(*_sums(record)))
            meter.tick(w.nbytes)
    finally:
        for output in outputs.values():
            output.close()
    sizes = {file: output.size for file, output in outputs.items()}
    return Written.of(list(plan.files), lambda: iter(share), pieces, sizes)


def share_of(
    plan: Plan,
    outputs: Mapping[str, storage.SharedSafetensorsFile],
    index: int,
    count: int,
) -> list[TensorWrite]:
    """Share ``index`` of ``count`` of the plan's writes: a contiguous run of the output,
    balanced by bytes (:func:`muonckpt.layout.workplan.split_work`)."""
    writes = plan.writes
    by_unit = {(w.file, w.tensor): w for w in writes}
    units = [
        WorkUnit(w.file, w.tensor, outputs[w.file].record(w.tensor).offset, w.nbytes)
        for w in writes
    ]
    return [by_unit[u.file, u.key] for u in split_work(units, count)[index]]


def seal_shared(plan: Plan, staging: Path) -> None:
    """(one process, after every process wrote) give each file its name; :func:`commit`
    fsyncs them all in one parallel pass."""
    for output in shared_files(plan, staging).values():
        output.commit(sync=False)
