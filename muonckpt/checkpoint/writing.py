"""Writes a :class:`~muonckpt.format.writeplan.WritePlan` and commits the checkpoint: the one write
path.

Every checkpoint muonckpt produces (``save`` and ``async_save`` per rank or consolidated,
``consolidate``, ``reshard``, ``convert``; in one process or many) is written as three steps
of a :class:`Steps` protocol (:func:`write_checkpoint`, or :func:`stage` and then
:func:`finish`, when a save runs its own work between them):

1. ``stage``: every rank's checks, then the root creates the staging directory beside the
   target (:meth:`muonckpt.storage.CheckpointStore.create_staging`);
2. ``write``: every rank writes its tensors (:func:`write_files` for whole files,
   :func:`write_share` for its share of files written together) and reports the pieces; the
   root builds the manifest from the reports and commits (:func:`commit`: manifest last,
   atomic publish, :meth:`muonckpt.storage.CheckpointStore.publish`);
3. ``retire``: when a checkpoint was replaced, every rank deletes a share of its files.

Across ranks the steps are :class:`muonckpt.distributed.group_steps.CollectiveSteps`, or for a
background save, which must not use the job's process groups, :class:`DirectorySteps` (messages as
files); in one process :class:`LocalSteps`. This module itself never calls torch.distributed and
imports torch only where a tensor crosses, so a single-process offline tool runs without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from .. import storage
from ..distributed.steps import Outcome, StepProtocol, disagreement
from ..errors import CheckpointError, CheckpointWarning, MuonCkptError, mark_committed
from ..format.manifest import (
    FORMAT_NAME,
    MANIFEST_NAME,
    ExtraTensor,
    ExtraValues,
    FileEntry,
    Manifest,
    ManifestSize,
    ParamEntry,
    Piece,
    ValuePath,
    extra_to_json,
    piece_to_json,
)
from ..format.manifest_json import piece_from_json
from ..format.writeplan import TensorWrite, WritePlan
from ..layout.workplan import WorkUnit, split_work
from ..storage.safetensors_writer import beside
from .pieces import all_files

Progress = Callable[[int, int, int, int], None]
"""``progress(done_bytes, total_bytes, done_tensors, total_tensors)``, called once at the start
and after each tensor is written."""

Fetch = Callable[[TensorWrite], Any]
"""The data of one planned tensor: a tensor of its dtype and element count, or its raw bytes
(1-D uint8 numpy), as :meth:`muonckpt.storage.SafetensorsWriter.write` takes them."""

T = TypeVar("T")
R = TypeVar("R")


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


@dataclass
class Written:
    """What one rank wrote: its files (in order) and the pieces in them."""

    files: list[str]
    pieces: list[Piece]
    dtypes: Mapping[tuple[str, str], str]
    """(param, key) -> safetensors dtype, of every piece."""
    extra: Any = None
    """Anything else the caller reports to the root (JSON)."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Each safetensors file's size as planned (header and data), which the manifest lists:
    never what a file measures after the write, so that a file cut short under the save is
    refused by the commit's check instead of listed at its cut size."""

    def to_json(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "pieces": [piece_to_json(p) for p in self.pieces],
            "dtypes": [[param, key, dtype] for (param, key), dtype in self.dtypes.items()],
            "extra": self.extra,
            "sizes": self.sizes,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Written:
        return cls(
            list(raw["files"]),
            [piece_from_json(p) for p in raw["pieces"]],
            {(param, key): dtype for param, key, dtype in raw["dtypes"]},
            raw["extra"],
            dict(raw["sizes"]),
        )


@dataclass
class Reports:
    """Every rank's :class:`Written`, merged on the root: files in order, the pieces in
    (file, tensor key) order, each file's size in the staging directory."""

    files: list[FileEntry]
    pieces: list[Piece]
    dtypes: Mapping[tuple[str, str], str]
    extras: list[Any]


class _Lazy(Mapping[tuple[str, str], str]):
    """A mapping made when first read: the offline tools' commit never reads the dtypes of
    300k written tensors, and a dict of them was 30 MB alive at the commit."""

    def __init__(self, make: Callable[[], dict[tuple[str, str], str]]) -> None:
        self._make: Callable[[], dict[tuple[str, str], str]] | None = make
        self._made: dict[tuple[str, str], str] = {}

    def _mapping(self) -> dict[tuple[str, str], str]:
        if self._make is not None:
            self._made, self._make = self._make(), None
        return self._made

    def __getitem__(self, item: tuple[str, str]) -> str:
        return self._mapping()[item]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())


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
    (:func:`stage`, then :func:`finish`).

    Args:
        write: (every rank) writes this rank's tensors into the staging directory.
        manifest: (the root) the checkpoint's manifest, from every rank's report.
        create: (the root) prepares the fresh staging directory (files written together).
        seal: (the root) once every rank has written, before the manifest (files written
            together get their names).
        source: a checkpoint being read, which ``final`` must not be inside or around.
    """
    staging = stage(steps, final, overwrite=overwrite, create=create, source=source)
    return finish(steps, staging, final, write=write, manifest=manifest, seal=seal)


def stage(
    steps: Steps,
    final: str | os.PathLike[str],
    *,
    overwrite: bool,
    create: Callable[[Path], None] = lambda staging: None,
    source: str | os.PathLike[str] | None = None,
    check: Callable[[], dict[str, Any] | None] = lambda: None,
    mailbox: bool = False,
) -> Path:
    """The ``stage`` step: every rank runs ``check``, which may return what the ranks must
    have alike that is only known once it ran (a digest of values it took); when all pass and
    agree, the root checks the target and creates the staging directory (and, with
    ``mailbox``, the :class:`~muonckpt.storage.Mailbox` of a background finish); its path on
    every rank. (That the ranks were called alike, with the same arguments, is the
    operation's rendezvous, :func:`muonckpt.distributed.group_steps.rendezvous`, before this.)"""
    final = Path(final)

    def make(found: list[dict[str, Any] | None]) -> str:
        if found[0] is not None:
            differ = disagreement([given or {} for given in found], steps.ranks)
            if differ is not None:
                raise CheckpointError(f"the ranks disagree on {differ}; nothing was written")
        staging = storage.store.create_staging(final, overwrite, source=source)
        try:
            create(staging)
            if mailbox:
                storage.Mailbox(storage.mailbox_path(staging)).create()
        except BaseException:
            storage.store.discard(staging)
            raise
        return str(staging)

    return Path(steps.each_then_root("stage", check, make))


def abandon(staging: Path) -> None:
    """(the root) Remove a staging directory (and its mailbox) that will never be written."""
    storage.store.discard(staging)
    storage.Mailbox(storage.mailbox_path(staging)).remove()


def finish(
    steps: Steps,
    staging: Path,
    final: str | os.PathLike[str],
    *,
    write: Callable[[Path], Written],
    manifest: Callable[[Reports], Manifest],
    seal: Callable[[Path], None] = lambda staging: None,
) -> Path:
    """The ``write`` step (every rank writes, the root commits) and, when a checkpoint was
    replaced, the ``retire`` step; a failure discards the staging directory."""
    final = Path(final)
    across = len(steps.ranks) > 1  # reports cross ranks as JSON; in one process, as they are

    def commit_all(raw: list[Any]) -> dict[str, Any] | None:
        seal(staging)
        reports = [Written.from_json(r) for r in raw] if across else raw
        names = dict.fromkeys(name for r in reports for name in r.files)
        sizes = {name: size for r in reports for name, size in r.sizes.items()}
        files = [
            FileEntry(name, sizes[name] if name in sizes else storage.file_size(staging / name))
            for name in names
        ]
        in_file: dict[str, list[Piece]] = {name: [] for name in names}
        for report in reports:
            for piece in report.pieces:
                in_file[piece.file].append(piece)
        merged = Reports(
            files,
            [p for file in in_file.values() for p in sorted(file, key=attrgetter("tensor"))],
            _Lazy(lambda: {k: v for r in reports for k, v in r.dtypes.items()}),
            [r.extra for r in reports],
        )
        replaced = commit(staging, final, manifest(merged))
        return (
            None
            if replaced is None
            else {"at": str(replaced), "files": storage.store.entries(replaced)}
        )

    committed: list[bool] = []

    def mark() -> None:
        committed.append(True)

    storage.watch_commit(final, mark)
    staged = storage.directory_identity(staging)  # another rank's swap keeps it: committed_as
    try:
        each = (lambda: write(staging).to_json()) if across else (lambda: write(staging))
        replaced = steps.each_then_root("write", each, commit_all)
    except BaseException as exc:
        # After the swap (by this process, or by a root that died before telling the others)
        # the new checkpoint is whole, whatever came next.
        if committed or storage.committed_as(final, staged):
            return after_commit(exc, final)
        if steps.is_root:
            storage.store.discard(staging)
        raise
    finally:
        storage.unwatch_commit(final, mark)
    try:
        _retire(steps, replaced, final)
    except BaseException as exc:
        return after_commit(exc, final)
    return final


def after_commit(exc: BaseException, final: Path) -> Path:
    """What a failure after the commit becomes: an interruption (KeyboardInterrupt, SIGTERM in
    the CLI) is raised again, tagged :func:`~muonckpt.errors.mark_committed`; an error is a
    :class:`CheckpointWarning` and the call succeeds (the new checkpoint is whole)."""
    if not isinstance(exc, Exception):
        mark_committed(exc, final)
        raise exc
    warnings.warn(f"committed {final}, but then: {exc}", CheckpointWarning, stacklevel=3)
    return final


def _retire(steps: Steps, replaced: dict[str, Any] | None, final: Path) -> None:
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


class DirectorySteps(StepProtocol):
    """:class:`Steps` whose messages are files of a :class:`~muonckpt.storage.Mailbox`, for
    the ranks of a background save (which must not use the job's process groups).

    Every rank leaves its outcome of a step (``<step>-<rank>``); the root waits up to
    ``timeout`` seconds for all of them and leaves the step's outcome (``<step>-outcome``),
    which the others wait for up to twice that (the root itself may wait ``timeout`` for the
    slowest rank). Waits are bounded, so a rank that never reports fails the step on the
    others instead of hanging them.

    Every rank ends a step with the same outcome, also when ranks give up on each other: the
    step is decided once, by whoever first claims ``<step>-decision``
    (:meth:`~muonckpt.storage.Mailbox.claim`). The root claims it before it acts (its
    ``then`` may commit a checkpoint, which cannot be taken back), or with the failure it
    found; a rank that gives up waiting for the root claims it with its error, and a root that
    finds the claim taken acts on nothing and passes that error on. Only a root that claimed
    and then gives no outcome for another ``timeout`` leaves the others unsure (they say so).
    With one rank there is nobody to tell, and no mailbox.
    """

    def __init__(
        self,
        operation: str,
        mailbox: storage.Mailbox,
        ranks: Sequence[int],
        root: int,
        rank: int,
        timeout: float,
        error: type[MuonCkptError],
    ) -> None:
        super().__init__(operation, ranks, root, error, rank)
        self.mailbox, self.timeout = mailbox, timeout

    def _exchange(
        self, step: str, mine: Outcome, decide: Callable[[list[Outcome]], Outcome]
    ) -> Outcome:
        if len(self.ranks) == 1:
            return decide([mine])  # nobody to tell: no mailbox
        tag = step.replace(" ", "-")
        if self.is_root:
            outcome = self._decide(tag, mine, decide)
            with contextlib.suppress(CheckpointError):  # the others then time out and say so
                self.mailbox.post(f"{tag}-outcome", outcome)
            return outcome
        return self._await_outcome(tag, mine)

    def _decide(
        self, tag: str, mine: Outcome, decide: Callable[[list[Outcome]], Outcome]
    ) -> Outcome:
        """(the root) Every rank's outcome (its own as it is), then the step's: acted on only
        once claimed."""
        names = {rank: f"{tag}-{rank}" for rank in self.ranks if rank != self.root}
        found, missing = self.mailbox.wait(list(names.values()), self.timeout)
        outcomes = [mine if rank == self.root else found.get(names[rank]) for rank in self.ranks]
        if missing:
            late = [rank for rank, name in names.items() if name in missing]
            failed: Outcome | None = {
                "error": f"rank(s) {late} did not finish within {self.timeout:g} s"
            }
        else:
            failed = next((o for o in outcomes if o is not None and "error" in o), None)
        decision = failed if failed is not None else {"acting": self.root}
        if not self.mailbox.claim(f"{tag}-decision", decision):
            return self.mailbox.read(f"{tag}-decision")  # a rank gave up first: its error
        return failed if failed is not None else decide(cast(list[Outcome], outcomes))

    def _await_outcome(self, tag: str, mine: Outcome) -> Outcome:
        """(every other rank) Report ``mine``, then the root's outcome of the step; if it
        does not come in time, this rank's own failure, unless the root already took the
        decision."""
        with contextlib.suppress(CheckpointError):  # a mailbox gone is reported below
            self.mailbox.post(f"{tag}-{self.rank}", mine)
        found, missing = self.mailbox.wait([f"{tag}-outcome"], 2 * self.timeout)
        if not missing:
            return found[f"{tag}-outcome"]
        if not self.mailbox.exists():
            why = f"rank {self.root} gave up waiting for this rank (its mailbox is gone)"
            return {"error": f"rank {self.rank}: {why}"}
        abort = {
            "error": f"rank {self.rank}: rank {self.root} gave no outcome within "
            f"{2 * self.timeout:g} s"
        }
        if self.mailbox.claim(f"{tag}-decision", abort):
            return abort
        decision = self.mailbox.read(f"{tag}-decision")
        if "error" in decision:
            return decision
        found, missing = self.mailbox.wait([f"{tag}-outcome"], self.timeout)
        if not missing:
            return found[f"{tag}-outcome"]
        return {
            "error": f"rank {self.rank}: rank {self.root} went on with the step but gave no "
            f"outcome within {3 * self.timeout:g} s: whether it took effect is unknown"
        }

    def leave(self) -> None:
        """(every rank, once done with the protocol) Say so; the root then waits up to
        ``timeout`` for the others and removes the mailbox."""
        if len(self.ranks) == 1:
            return
        with contextlib.suppress(CheckpointError):  # the root gave up on this rank already
            self.mailbox.post(f"done-{self.rank}", None)
        if self.is_root:
            self.mailbox.wait([f"done-{rank}" for rank in self.ranks], self.timeout)
            self.mailbox.remove()


def commit(staging: Path, final: Path, manifest: Manifest) -> Path | None:
    """(the root) The manifest, written last, fsync, and the atomic swap, which checks that
    every file the manifest lists is there at its size (and the manifest) right before it.

    Returns the directory now holding a checkpoint this replaced, for :meth:`storage.store.retire`.
    The manifest's coverage is checked first (every state tensor stored exactly once, as a
    reader requires), so that a faulty plan commits nothing rather than a checkpoint that
    ``verify`` and ``load`` would refuse.
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
    size = storage.store.write_text(staging / MANIFEST_NAME, manifest.json_chunks(), limit=limit)
    if size > limit:
        extra = 0 if manifest.extra is None else len(json.dumps(extra_to_json(manifest.extra)))
        raise CheckpointError(
            f"its manifest would be {size} bytes, more than the {limit} a reader accepts: "
            f"{len(manifest.params)} params and {len(manifest.pieces)} pieces (stored "
            f"tensors), extra / rank_extra {extra} bytes of it; nothing was committed",
            path=final,
        )
    listed = {entry.name: entry.bytes for entry in all_files(manifest)}
    return storage.store.publish(staging, final, files={**listed, MANIFEST_NAME: size})


def check_manifest_fits(
    params: Iterable[ParamEntry], writes: Iterable[TensorWrite], final: object
) -> None:
    """Refuse, before any data is written, a write whose manifest would be more than a reader
    accepts (:data:`muonckpt.storage.MAX_TEXT_BYTES`): counted from its ``params`` and its
    planned ``writes`` (:class:`~muonckpt.format.manifest.ManifestSize`, a lower bound: groups and
    ``extra`` are not counted, and :func:`commit` checks the whole manifest again), naming
    the counts."""
    size = ManifestSize()
    for entry in params:
        size.add_param(entry)
    chunk = storage.CHUNK_BYTES
    for w in writes:
        size.add_piece(w.param, w.key, w.file, w.tensor, w.region, w.nbytes, chunk)
    if size.bytes > storage.MAX_TEXT_BYTES:
        raise CheckpointError(
            f"its manifest would be at least {size.bytes} bytes, more than the "
            f"{storage.MAX_TEXT_BYTES} a reader accepts: {size.params} params and "
            f"{size.pieces} pieces (stored tensors; about {size.bytes // max(size.pieces, 1)} "
            "bytes each); nothing was written. Store fewer, larger tensors (params=False "
            "leaves out the pieces of the params' own values)",
            path=final,
        )


class _Meter:
    def __init__(self, sizes: Sequence[int], progress: Progress | None) -> None:
        self.total, self.tensors, self.progress = sum(sizes), len(sizes), progress
        self.done = self.written = 0
        if progress is not None:
            progress(0, self.total, 0, self.tensors)

    def tick(self, nbytes: int) -> None:
        self.done += nbytes
        self.written += 1
        if self.progress is not None:
            self.progress(self.done, self.total, self.written, self.tensors)


def write_files(
    plan: WritePlan,
    staging: Path,
    fetch: Fetch,
    progress: Progress | None = None,
    *,
    prefetch: bool = True,
) -> Written:
    """Write every file of ``plan`` (and its texts) into ``staging``, front to back, fetching
    each tensor when its turn comes: with ``prefetch``, the next one on a thread meanwhile
    (for reads from files; state already in memory is written straight, since a thread
    handoff per tensor costs more than it saves for many small tensors)."""
    meter = _Meter([w.nbytes for w in plan.writes], progress)
    pieces, sizes = [], {}
    for file, writes in plan.by_file().items():
        with storage.SafetensorsWriter(staging / file, plan.specs(file), plan.files[file]) as out:
            fetched: Generator[tuple[TensorWrite, Any], None, None] = (
                prefetched(writes, fetch) if prefetch else ((w, fetch(w)) for w in writes)
            )
            with contextlib.closing(fetched):  # on an error, the prefetch thread ends here
                for w, value in fetched:
                    out.write(w.tensor, value)
                    del value
                    meter.tick(w.nbytes)
            records = out.commit()
        sizes[file] = out.size
        pieces += [w.piece(*_sums(records[w.tensor])) for w in writes]
    _write_texts(plan, staging)
    return _written(list(plan.files), plan.writes, pieces, sizes)


def _sums(record: storage.TensorRecord) -> tuple[bytes, int]:
    return record.digests, record.chunk_bytes


def _written(
    files: list[str], writes: Sequence[TensorWrite], pieces: list[Piece], sizes: dict[str, int]
) -> Written:
    dtypes = _Lazy(lambda: {(w.param, w.key): w.dtype for w in writes})
    return Written(files, pieces, dtypes, sizes=sizes)


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


def shared_files(plan: WritePlan, staging: Path) -> dict[str, storage.SharedSafetensorsFile]:
    """The files of ``plan`` as several processes write them together (same header for all)."""
    return {
        file: storage.SharedSafetensorsFile(staging / file, plan.specs(file), plan.files[file])
        for file in plan.files
    }


def create_shared(plan: WritePlan, staging: Path) -> None:
    """(one process) Every file's header, at its full length, before any process writes; and
    the plan's texts."""
    for output in shared_files(plan, staging).values():
        output.create()
    _write_texts(plan, staging)


def _write_texts(plan: WritePlan, staging: Path) -> None:
    for name, text in plan.texts.items():
        storage.store.write_text(staging / name, text)


def write_share(
    plan: WritePlan,
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
    meter = _Meter([w.nbytes for w in share], progress)
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
    return _written(list(plan.files), share, pieces, sizes)


def share_of(
    plan: WritePlan,
    outputs: Mapping[str, storage.SharedSafetensorsFile],
    index: int,
    count: int,
) -> list[TensorWrite]:
    """Share ``index`` of ``count`` of the plan's writes: a contiguous run of the output,
    balanced by bytes (:func:`muonckpt.layout.workplan.split_work`)."""
    by_unit = {(w.file, w.tensor): w for w in plan.writes}
    units = [
        WorkUnit(w.file, w.tensor, outputs[w.file].record(w.tensor).offset, w.nbytes)
        for w in plan.writes
    ]
    return [by_unit[u.file, u.key] for u in split_work(units, count)[index]]


def seal_shared(plan: WritePlan, staging: Path) -> None:
    """(one process, after every process wrote) fsync each file and give it its name."""
    for output in shared_files(plan, staging).values():
        output.commit()


def prefetched(items: Sequence[T], produce: Callable[[T], R]) -> Generator[tuple[T, R], None, None]:
    """``(item, produce(item))`` in order, producing the next item on a thread meanwhile.

    Reading (page-cache copies, xxhash) and writing (write, xxhash) both release the GIL, so a
    reader one tensor ahead of the writer keeps two cores busy. At most two produced values are
    alive, and ``produce`` for item ``i + 2`` starts only once the consumer is done with item
    ``i``: a :class:`~muonckpt.checkpoint.pieces.PieceReader` with ``reuse_outputs=2`` can produce
    them.
    """
    if not items:
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = beside(pool, produce, items[0])
        for index, item in enumerate(items):
            value = pending.result()
            if index + 1 < len(items):
                pending = beside(pool, produce, items[index + 1])
            yield item, value
            del value
