"""The write engine: every checkpoint muonckpt produces (``save`` and ``async_save`` per rank
or consolidated, ``consolidate``, ``reshard``, ``convert``, every foreign reader's output; the
DeepSpeed and Megatron writers' foreign files) is written by the same calls, each handed data
and returning data, over a :class:`Steps` protocol among the ranks that write it:

1. stage: the root opens the staging directory beside the target (:func:`open_staging`;
   :func:`stage` is the step for a producer with nothing to check across ranks, a save runs
   its own, :func:`muonckpt.checkpoint.saving.stage`, whose root checks, then opens it);
2. write: every rank writes its tensors (:func:`write_files` for whole files,
   :func:`write_share` for its share of files written together), pulling them in plan order
   (:func:`in_order`) from an iterator of (write, data) its producer made, and gets its report
   (:class:`Written`);
3. commit (:func:`commit`): every rank's report to the root, which completes the producer's
   :class:`Draft` of the manifest from them (:func:`~._reports.complete`) and publishes
   (:func:`publish`: the manifest last, fsync, the atomic swap);
4. retire (:func:`retire`): when a checkpoint was replaced, every rank deletes a share of its
   files.

Where the bytes go is the target's :class:`~muonckpt.storage.CheckpointStore`, which the entry
point takes (:func:`muonckpt.storage.store_for`) and hands to each call. Across ranks the
steps are :class:`muonckpt.distributed.group_steps.CollectiveSteps`, or for a background
save, which must not use the job's process groups,
:class:`~muonckpt.distributed.mailbox.MailboxSteps` (messages through the process group's
store); in one process :class:`LocalSteps`. This module itself never calls torch.distributed
and imports torch only where a tensor crosses, so a single-process offline tool runs without
it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from .. import storage
from ..errors import CheckpointError, CheckpointWarning, InterruptedAfterCommit, MuonCkptError
from ..format.manifest import (
    FORMAT_NAME,
    ExtraTensor,
    ExtraValues,
    FileEntry,
    Manifest,
    PieceTable,
    ValuePath,
    all_files,
    extra_to_json,
)
from ..format.names import MANIFEST_NAME
from ..format.writeplan import Plan, TensorWrite, specs_of
from ..layout.workplan import WorkUnit, split_work
from ..storage import access
from ..storage.places import Location, location
from ..storage.safetensors_writer import prefetched
from . import _indexes
from ._indexes import check_manifest_fits as check_manifest_fits
from ._reports import Draft as Draft
from ._reports import Reports as Reports
from ._reports import Written as Written
from ._reports import complete
from .attempt import Attempt
from .progress import Counted, Meter, Progress

Tensors = Iterator[tuple[TensorWrite, Any]]
"""What a producer hands the writer: each planned tensor (in :func:`in_order`) with its data,
a tensor of its dtype and element count, or its raw bytes (1-D uint8 numpy), as
:meth:`muonckpt.storage.SafetensorsWriter.write` takes them; made as the writer pulls it."""

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


def open_staging(
    store: storage.CheckpointStore,
    final: str | os.PathLike[str],
    *,
    overwrite: bool,
    source: str | os.PathLike[str] | None = None,
    output: str | None = None,
    shared: Plan | None = None,
) -> Path:
    """(the root) A fresh staging directory for ``final`` once the target is checked
    (:meth:`~muonckpt.storage.CheckpointStore.create_staging`: ``source``, a checkpoint being
    read, must not be inside or around it; ``output``, a foreign format's files); with
    ``shared``, the headers of the files the ranks write together (:func:`create_shared`)."""
    staging = store.create_staging(final, overwrite, source=source, output=output)
    try:
        if shared is not None:
            create_shared(store, shared, staging)
    except BaseException:
        store.discard(staging)
        raise
    return staging


def stage(
    steps: Steps,
    store: storage.CheckpointStore,
    final: str | os.PathLike[str],
    *,
    overwrite: bool,
    source: str | os.PathLike[str] | None = None,
    shared: Plan | None = None,
) -> Path:
    """The ``stage`` step of a producer whose ranks have nothing to compare: the root opens
    the staging directory (:func:`open_staging`); on every rank, the one it writes into
    (:meth:`~muonckpt.storage.CheckpointStore.join_staging`)."""
    decided = steps.each_then_root(
        "stage",
        lambda: None,
        lambda _: str(
            open_staging(store, final, overwrite=overwrite, source=source, shared=shared)
        ),
    )
    return store.join_staging(decided, steps.rank, final)


def abandon(store: storage.CheckpointStore, staging: Path) -> None:
    """(the root) Remove a staging directory that will never be written."""
    store.discard(staging)


Replaced = dict[str, Any]
"""A checkpoint the commit replaced: where it now is (``at``) and its files, for
:func:`retire`."""


def commit(
    steps: Steps,
    store: storage.CheckpointStore,
    staging: Path,
    final: str | os.PathLike[str],
    written: Attempt[Written],
    draft: Draft,
    *,
    source: str | os.PathLike[str] | None = None,
    shared: Plan | None = None,
) -> Replaced | None:
    """The ``write`` step: every rank hands in what it ``written`` (or its failure, which fails
    the step on every rank), its files first put where the root finds them
    (:meth:`~muonckpt.storage.CheckpointStore.send`: on object storage, uploaded by this rank
    in parallel with the others); the root gives the files written together (``shared``) their
    names (:func:`seal_shared`), completes ``draft`` from the merged reports and publishes
    (:func:`publish`; with ``source``, the files read, only a manifest their reader accepts).
    The checkpoint it replaced, for :func:`retire` (None also when something failed after
    the commit: that is a warning, and nothing is retired). A failure before the commit
    discards the staging directory."""
    where = location(final)
    across = len(steps.ranks) > 1  # reports cross ranks as JSON; in one process, as they are
    last = not steps.is_root  # the root writes the indexes and the manifest there next

    def report() -> Any:
        try:
            result = written.result()
        except BaseException:
            store.send(staging, final, upload=False, last=last)
            raise
        store.send(staging, final, last=last)
        return result.to_json() if across else result

    def commit_all(raw: list[Any]) -> Replaced | None:
        if shared is not None:
            seal_shared(shared, staging)
        reports = [Written.from_json(r) for r in raw] if across else raw
        manifest = complete(draft, Reports.merged(reports, staging))
        replaced = publish(store, staging, where, manifest, source)
        return None if replaced is None else {"at": str(replaced), "files": store.entries(replaced)}

    with store.watching(final, staging) as committed:
        try:
            return steps.each_then_root("write", report, commit_all)
        except BaseException as exc:
            # After the commit (by this process, or by a root that died before telling the
            # others) the new checkpoint is whole, whatever came next.
            if committed():
                after_commit(exc, where)
                return None
            if steps.is_root:
                store.discard(staging)
            raise


def after_commit(exc: BaseException, final: Location) -> Location:
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


def retire(
    steps: Steps,
    store: storage.CheckpointStore,
    replaced: Replaced | None,
    final: str | os.PathLike[str],
) -> Location:
    """The ``retire`` step, after the commit: every rank deletes its share of the ``replaced``
    checkpoint's files (nothing when none was); a failure is a warning (the new checkpoint is
    in place), an interruption is raised tagged (:func:`after_commit`). ``final``, as a
    local path or an S3 URL (:func:`muonckpt.storage.places.location`)."""
    where = location(final)
    try:
        _retire(steps, store, replaced, where)
    except BaseException as exc:
        return after_commit(exc, where)
    return where


def _retire(
    steps: Steps, store: storage.CheckpointStore, replaced: Replaced | None, final: Location
) -> None:
    """The ``retire`` step, after the commit: every rank deletes its share of the replaced
    checkpoint's files; a failure is a warning (the new checkpoint is in place)."""
    if replaced is not None and len(steps.ranks) == 1:
        store.retire(replaced["at"])
    elif replaced is not None:
        share = replaced["files"][steps.ranks.index(steps.rank) :: len(steps.ranks)]
        try:
            steps.each_then_root(
                "retire",
                lambda: store.retire(replaced["at"], share),
                lambda _: store.retire(replaced["at"]),
            )
        except MuonCkptError as exc:  # committed: what is left of the old one is a warning
            warnings.warn(
                f"committed {final}, but the checkpoint it replaced may not be deleted "
                f"entirely ({replaced['at']}): {exc}",
                CheckpointWarning,
                stacklevel=3,
            )


def publish(
    store: storage.CheckpointStore,
    staging: Path,
    final: Location,
    manifest: Manifest | None,
    source: object = None,
) -> Path | None:
    """(the root) The manifest, written last, fsync, and the atomic swap, which checks that
    every file the manifest lists is there at its size (and the manifest) right before it; a
    foreign format's files (``manifest`` None) as they are, never over anything.

    Returns the directory now holding a checkpoint this replaced, for :func:`retire`.
    The manifest's coverage is checked first (every state tensor stored exactly once, as a
    reader requires), so that a faulty plan commits nothing rather than a checkpoint that
    ``verify`` and ``load`` would refuse; with ``source`` (the files a rewrite read, whose
    values may be odd) the manifest written is read back by their reader too, naming
    ``source`` (:func:`~._indexes.check_readable`).
    """
    target = str(final)
    if manifest is None:
        return store.publish(staging, target, overwrite=False)
    gaps = manifest.coverage_problems()
    if gaps:
        more = f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else ""
        raise CheckpointError(
            f"the files written do not hold the whole state: {gaps[0]}{more}; nothing was "
            "committed",
            path=final,
        )
    limit = storage.MAX_TEXT_BYTES  # past it, committed, a checkpoint nothing could read
    store.sync_files(staging, [f.name for f in all_files(manifest)])  # data before indexes
    manifest = _indexes.write_indexes(staging, manifest, final)
    size = store.put_text(staging / MANIFEST_NAME, manifest.json_chunks(), limit=limit)
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
    return store.publish(staging, target, files={**listed, MANIFEST_NAME: size})


def in_order(plan: Plan) -> Iterator[TensorWrite]:
    """The writes of ``plan`` in the order :func:`write_files` writes them: file by file."""
    for writes in plan.by_file().values():
        yield from writes


def _pulled(
    tensors: Tensors, writes: Sequence[TensorWrite], ahead: bool
) -> Generator[tuple[TensorWrite, Any], None, None]:
    """The next ``len(writes)`` of ``tensors``, which must be ``writes`` in order; with
    ``ahead``, each next one pulled on a thread meanwhile
    (:func:`muonckpt.storage.safetensors_writer.prefetched`)."""
    taken = itertools.islice(tensors, len(writes))
    pulled = prefetched(tensors, len(writes)) if ahead else (item for item in taken)
    with contextlib.closing(pulled):  # on an error, the prefetch thread ends here
        for planned, found in itertools.zip_longest(writes, pulled):
            if found is None:
                raise CheckpointError(f"no tensor came for {planned.tensor!r}: the source ended")
            w, value = found
            if w is not planned and w != planned:
                raise CheckpointError(f"{w.tensor!r} came where {planned.tensor!r} was planned")
            yield w, value


def write_files(
    store: storage.CheckpointStore,
    plan: Plan,
    staging: Path,
    tensors: Tensors,
    progress: Progress | None = None,
    *,
    prefetch: bool = True,
    sync: bool = True,
) -> Written:
    """Write every file of ``plan`` (and its texts) into ``staging``, front to back, each
    tensor pulled from ``tensors`` when its turn comes: with ``prefetch``, the next one on a
    thread meanwhile (for reads from files) in a file whose tensors average 64 KiB or more (a
    handoff costs ~0.15 ms). Without ``sync`` each file is renamed into place unsynced:
    :func:`publish` fsyncs every data file in one parallel pass before it writes the indexes
    and the manifest (thousands of output files are not thousands of fsyncs in a row)."""
    meter = Meter(plan, progress)
    pieces, sizes = PieceTable(), {}
    for file, writes in plan.by_file().items():
        specs, metadata = specs_of(writes), plan.files[file]
        with storage.SafetensorsWriter(
            staging / file, specs, metadata, sync=sync, follow=store.follow
        ) as out:
            ahead = prefetch and sum(w.nbytes for w in writes) >= (64 << 10) * len(writes)
            pulled = _pulled(tensors, writes, ahead)
            with contextlib.closing(pulled):
                for w, value in pulled:
                    out.write(w.tensor, value)
                    del value
                    meter.tick(w.nbytes)
            records = out.commit()
        sizes[file] = out.size
        pieces.extend(w.piece(*_sums(records[w.tensor])) for w in writes)
    _write_texts(store, plan, staging)
    return Written.of(list(plan.files), plan, pieces, sizes)


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


def _shared_files(plan: Plan, staging: Path) -> dict[str, storage.SharedSafetensorsFile]:
    """The files of ``plan`` as several processes write them together (same header for all)."""
    return {
        file: storage.SharedSafetensorsFile(staging / file, plan.specs(file), plan.files[file])
        for file in plan.files
    }


def create_shared(store: storage.CheckpointStore, plan: Plan, staging: Path) -> None:
    """(one process) Every file's header, at its full length, before any process writes; and
    the plan's texts."""
    for output in _shared_files(plan, staging).values():
        output.create()
    _write_texts(store, plan, staging)


def _write_texts(store: storage.CheckpointStore, plan: Plan, staging: Path) -> None:
    for name, text in plan.texts.items():
        store.put_text(staging / name, text)


def share_of(plan: Plan, staging: Path, index: int, count: int) -> list[TensorWrite]:
    """Share ``index`` of ``count`` of the plan's writes into the files written together
    (made by :func:`create_shared`): a contiguous run of the output, balanced by bytes
    (:func:`muonckpt.layout.workplan.split_work`)."""
    outputs = _shared_files(plan, staging)
    writes = plan.writes
    by_unit = {(w.file, w.tensor): w for w in writes}
    units = [
        WorkUnit(w.file, w.tensor, outputs[w.file].record(w.tensor).offset, w.nbytes)
        for w in writes
    ]
    return [by_unit[u.file, u.key] for u in split_work(units, count)[index]]


def write_share(
    plan: Plan,
    staging: Path,
    share: Sequence[TensorWrite],
    tensors: Tensors,
    progress: Progress | None = None,
) -> Written:
    """Write ``share`` (:func:`share_of`), each tensor pulled from ``tensors`` (the next on a
    thread meanwhile), at its planned offset in the files written together; every file of the
    plan is reported."""
    outputs = _shared_files(plan, staging)
    meter = Meter(Counted(sum(w.nbytes for w in share), len(share)), progress)
    pieces, current = [], None
    pulled = _pulled(tensors, share, ahead=True)
    try:
        for w, value in pulled:
            if current is not None and current != w.file:
                outputs[current].close()  # a share comes file by file: one open at a time
            current = w.file
            record = outputs[w.file].write(w.tensor, value)
            del value
            pieces.append(w.piece(*_sums(record)))
            meter.tick(w.nbytes)
    finally:
        pulled.close()
        for output in outputs.values():
            output.close()
    sizes = {file: output.size for file, output in outputs.items()}
    return Written.of(list(plan.files), share, pieces, sizes)


def seal_shared(plan: Plan, staging: Path) -> None:
    """(one process, after every process wrote) give each file its name; :func:`publish`
    fsyncs them all in one parallel pass."""
    for output in _shared_files(plan, staging).values():
        output.commit(sync=False)


def commit_on_nodes(
    steps: Steps,
    store: storage.CheckpointStore,
    staging: Path,
    final: str | os.PathLike[str],
    written: Attempt[Written],
    copies: Attempt[dict[str, Any]],
    draft: Draft,
    placement: dict[str, Any],
    leader: bool,
) -> Path:
    """The commit of a checkpoint written in parts, one directory per node (the node-local
    tier). The ``write on nodes`` step (named apart from the ``write`` of a durable copy
    that may follow over the same mailbox): every rank hands in what it ``written`` and the
    ``copies`` of files it sent and received (``{"sent": {file: digest}, "received": {file:
    digest}}``; a failure of either fails the step on every rank), and the root checks that
    each rank's files reached every holder ``placement`` names with the digest they left
    with, completes ``draft`` and writes the piece indexes. The ``publish on nodes`` step:
    each node's ``leader`` puts the indexes and the manifest (the same on every node) into
    its ``staging`` and publishes it at its ``final`` by :func:`publish`'s rules (data files
    fsynced, indexes, the manifest last, the atomic swap) with the files it holds. A failure
    before the swap discards the node's staging directory. Returns this node's ``final``."""
    where = location(final)

    def report() -> Any:
        return {"written": written.result().to_json(), **copies.result()}

    def complete_all(raw: list[Any]) -> dict[str, Any]:
        _check_copies(raw, placement, steps.ranks)
        reports = Reports.merged([Written.from_json(r["written"]) for r in raw], staging)
        manifest = replace(complete(draft, reports), replicas=placement)
        gaps = manifest.coverage_problems()
        if gaps:
            raise CheckpointError(f"the files written do not hold the whole state: {gaps[0]}")
        manifest = _indexes.write_indexes(staging, manifest, where)
        names = [entry.name for entry in manifest.indexes]
        return {
            "manifest": manifest.to_json(),
            "indexes": {name: storage.read_text(staging / name) for name in names},
            "files": [[f.name, f.bytes] for f in all_files(manifest)],
        }

    def publish_here(done: dict[str, Any]) -> None:
        if not leader:
            return
        if not steps.is_root:
            storage.write_texts_durably(staging, done["indexes"], limit=storage.MAX_TEXT_BYTES)
        held = storage.present(staging, [(name, size) for name, size in done["files"]])
        store.sync_files(staging, held)
        size = store.put_text(staging / MANIFEST_NAME, done["manifest"])
        listed = {name: size for name, size in done["files"] if name in held}
        listed.update((name, len(text.encode())) for name, text in done["indexes"].items())
        replaced = store.publish(
            staging, str(where), files={**listed, MANIFEST_NAME: size}, overwrite=True
        )
        if replaced is not None:
            store.retire(replaced)

    try:
        done = steps.each_then_root("write on nodes", report, complete_all)
    except BaseException:
        if leader:
            store.discard(staging, quiet=True)
        raise
    try:
        steps.each_then_root("publish on nodes", lambda: publish_here(done), lambda _: None)
    except BaseException:
        if leader and access.exists(staging):
            store.discard(staging, quiet=True)
        raise
    return Path(str(where))


def _check_copies(raw: Sequence[Any], placement: dict[str, Any], ranks: Sequence[int]) -> None:
    """(the root) Every rank's files received by each holder ``placement`` names, with the
    XXH3-64 they were sent with; else a :class:`CheckpointError` naming the file and ranks."""
    for index, holders in enumerate(placement["holders"]):
        for file, digest in raw[index]["sent"].items():
            for holder in holders:
                got = raw[holder]["received"].get(file)
                if got != digest:
                    raise CheckpointError(
                        f"the copy of {file} from rank {ranks[index]} on rank {ranks[holder]} "
                        f"{'is missing' if got is None else 'differs from what was sent'}; "
                        "nothing was committed"
                    )
