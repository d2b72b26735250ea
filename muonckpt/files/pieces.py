"""Reading checkpoints without torch: the manifest, and verified reads of pieces.

What every reader of a checkpoint needs, kept free of torch so that ``muonckpt consolidate``
and ``reshard`` start in a fraction of a second and stay small: :func:`open_checkpoint`
(manifest, sizes and coverage checked), :class:`PieceReader`, which gathers any region of a
param's state as raw bytes from whichever pieces hold it, verifying checksums, and
:func:`verify`. A checkpoint is read through its :class:`muonckpt.storage.CheckpointFiles`,
chosen once from the place it is at (a local directory, or an ``s3://`` prefix, read by
ranged GETs of exactly the bytes needed and never listed) and handed down.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import replace

import numpy as np

from .. import storage
from ..errors import CheckpointError, StoreUnreachable
from ..events import logged
from ..format.manifest import (
    CONSOLIDATED,
    FORMAT_NAME,
    PER_RANK,
    ExtraTensor,
    IndexEntry,
    Manifest,
    ParamEntry,
    Piece,
    PieceTable,
    all_files,
)
from ..format.manifest_json import parse_manifest, parse_manifest_chunks
from ..format.names import INDEX_FILE, MANIFEST_NAME, MODEL_INDEX_FILE, rank_file
from ..format.piece_index import parse_index
from ..format.records import placed
from ..layout.topology import Region, Strided, strided_runs


def checkpoint_at(path: str | os.PathLike[str]) -> storage.CheckpointFiles:
    """The files of the checkpoint at ``path``: a local directory, or an ``s3://`` URL (any
    other URL refused in one line: :func:`muonckpt.storage.location`)."""
    return storage.files_at(storage.location(path))


def read_manifest(
    path: str | os.PathLike[str] | storage.CheckpointFiles, *, pieces: bool = True
) -> Manifest:
    """The parsed, schema-checked manifest of the checkpoint at ``path``: a directory, an
    ``s3://bucket/prefix`` URL (its ``manifest.json``, one GET), or the files of one.

    Of a version 3 checkpoint, with ``pieces`` the manifest holds every piece, read from
    every piece index (each checked against the size and checksum the manifest records);
    without, the top level alone (:attr:`Manifest.complete` False), whose pieces a reader
    then takes from the indexes it needs (:func:`load_pieces`)."""
    files = path if isinstance(path, storage.CheckpointFiles) else checkpoint_at(path)
    refusal = files.refusal()
    if refusal is not None:
        raise refusal
    manifest_path = files.at(MANIFEST_NAME)
    text = files.manifest_text()
    if text is None:
        raise _no_manifest(files)
    manifest = None
    if not isinstance(text, str):  # a large one, read as a stream
        with contextlib.suppress(CheckpointError):  # else named as the whole text shows it
            manifest = parse_manifest_chunks(text, manifest_path)
        text = None if manifest is not None else files.manifest_text(whole=True)
    if manifest is None:
        assert isinstance(text, str)  # (read whole: it was there)
        manifest = parse_manifest(text, manifest_path)
    return load_pieces(files, manifest, None) if pieces else manifest


def _no_manifest(files: storage.CheckpointFiles) -> CheckpointError:
    """Why there is no checkpoint where the manifest is missing: a folder of another's
    safetensors files, an interrupted save, or nothing of a checkpoint at all."""
    try:
        names = files.names()
    except OSError:
        names = []
    if names is None:  # a prefix in S3: nothing tells more than the missing manifest
        return CheckpointError(
            "no checkpoint: no manifest.json (not a muonckpt checkpoint, or its save did not "
            "commit)",
            path=files.at(MANIFEST_NAME),
        )
    data = [name for name in names if name.endswith(".safetensors")]
    if data and not _written_by_muonckpt(files, data):
        hf = " (a Hugging Face model folder: config.json)" if "config.json" in names else ""
        return CheckpointError(
            f"not a muonckpt checkpoint{hf}: safetensors files that muonckpt did not write "
            "and no manifest.json; muonckpt reads the directories that muonckpt.save, "
            "consolidate, reshard and convert write",
            path=files.location,
        )
    if data:
        return CheckpointError(
            "incomplete checkpoint: data files but no manifest.json (the save was "
            "interrupted or is not done)",
            path=files.at(MANIFEST_NAME),
        )
    return CheckpointError(
        "not a muonckpt checkpoint: no manifest.json and no .safetensors files",
        path=files.location,
    )


def indexes_for(manifest: Manifest, names: Iterable[str] | None) -> list[IndexEntry]:
    """The piece indexes holding pieces of any of the params ``names`` (None: every index)."""
    if names is None:
        return list(manifest.indexes)
    at = {entry.name: n for n, entry in enumerate(manifest.params)}
    positions = sorted(at[name] for name in set(names) if name in at)
    return [entry for entry in manifest.indexes if entry.holds_any(positions)]


def load_pieces(
    files: storage.CheckpointFiles, manifest: Manifest, names: Iterable[str] | None
) -> Manifest:
    """``manifest`` (version 3, read without its pieces) with the pieces of the indexes
    holding any of the params ``names`` (None: every index), each index checked, and the
    params ``names`` covered exactly once (``verify``'s check of every param, made whatever
    the indexes' checksums say: a region moved never puts one piece's bytes in another's
    place); a manifest of an older version (which holds its pieces, its coverage checked by
    :func:`open_checkpoint`) as it is."""
    if not manifest.indexes or (manifest.complete and manifest.pieces):
        return manifest
    names = None if names is None else list(names)
    chosen = indexes_for(manifest, names)
    pieces = PieceTable()
    for entry in chosen:
        pieces.extend(read_index(files, manifest, entry))
    complete = len(chosen) == len(manifest.indexes)
    manifest = replace(manifest, pieces=pieces, complete=complete)
    problems = [] if names is None else manifest.coverage_problems(names)
    if problems:
        raise CheckpointError(problems[0], path=files.at(MANIFEST_NAME))
    return manifest


INDEXES_READ: Counter[str] = Counter()
"""How often each piece index was read in this process, by name: what a test or a benchmark
looks at to see that a load read only its own (never reset here)."""


def data_name(manifest: Manifest, name: str) -> str:
    """The name, relative to the checkpoint, of file ``name`` of ``manifest``: beside the
    manifest, or under its save prefix (a checkpoint committed to S3, or copied from there
    object by object)."""
    return manifest.data_prefix + name


def read_index(
    files: storage.CheckpointFiles, manifest: Manifest, entry: IndexEntry
) -> tuple[Piece, ...]:
    """The pieces of one piece index: its size and checksum the manifest's, every piece
    schema-checked (:func:`muonckpt.format.piece_index.parse_index`); a CheckpointError
    naming the index file otherwise."""
    name = data_name(manifest, entry.name)
    path = files.at(name)
    INDEXES_READ[entry.name] += 1
    try:
        data = files.read_small(name)
    except CheckpointError as exc:
        raise changed_while_reading(files, manifest) or exc from None
    problem = None
    if len(data) != entry.bytes:
        problem = (
            f"piece index is {len(data)} bytes, the manifest says {entry.bytes} "
            "(truncated or replaced)"
        )
    elif (found := storage.chunk_digest(data)) != entry.checksum:
        problem = (
            f"piece index checksum mismatch: the manifest records {entry.checksum}, the file "
            f"hashes to {found}"
        )
    if problem is not None:  # a writer that replaced the checkpoint meanwhile, else damage
        raise changed_while_reading(files, manifest) or CheckpointError(problem, path=path)
    names = manifest.stored_names or tuple(p.name for p in manifest.params)
    try:
        return parse_index(data, entry, manifest.params, names)
    except CheckpointError as exc:
        raise CheckpointError(f"piece index refused: {exc}", path=path) from None


def _written_by_muonckpt(files: storage.CheckpointFiles, names: list[str]) -> bool:
    """Whether any of these safetensors files carries muonckpt's own header metadata (or
    cannot be read, so that a damaged file of ours is not called foreign)."""
    for name in names:
        try:
            with files.reader(name) as reader:
                if reader.metadata.get("format") == FORMAT_NAME:
                    return True
        except CheckpointError:
            return True
    return False


def open_checkpoint(
    path: str | os.PathLike[str] | storage.CheckpointFiles, *, pieces: bool = True
) -> tuple[storage.CheckpointFiles, Manifest]:
    """The files and manifest of a checkpoint whose pieces cover every state tensor once
    (at a directory, an ``s3://`` URL, or of the files given).

    Without ``pieces``, a version 3 checkpoint's top level alone: a load then reads the piece
    indexes of its share (:func:`load_pieces`, which checks those params' coverage), each
    data file's size checked when it is opened."""
    files = path if isinstance(path, storage.CheckpointFiles) else checkpoint_at(path)
    manifest = read_manifest(files, pieces=pieces)
    if not manifest.complete:
        return files, manifest
    problems = size_problems(manifest, files)
    if problems:
        raise changed_while_reading(files, manifest) or problems[0]
    problems = [
        CheckpointError(p, path=files.at(MANIFEST_NAME)) for p in manifest.coverage_problems()
    ]
    if problems:
        raise problems[0]
    return files, manifest


def changed_while_reading(
    files: storage.CheckpointFiles, manifest: Manifest
) -> CheckpointError | None:
    """The error to raise when the checkpoint's manifest is no longer ``manifest`` (a writer
    replaced the checkpoint while it was read), else None: a missing or resized data file is
    then a race, not damage. (In S3 a new save's objects are under a save prefix of its own,
    so the same file list under another ``data_prefix`` is another checkpoint, and a manifest
    of the etag read is the one read.)"""
    if files.manifest_kept():
        return None
    try:
        now = read_manifest(files, pieces=not manifest.indexes)
    except CheckpointError:
        now = None
    if now is not None and (now.files, now.indexes, now.pieces, now.extra, now.data_prefix) == (
        manifest.files,
        manifest.indexes,
        manifest.pieces if not manifest.indexes else (),
        manifest.extra,
        manifest.data_prefix,  # the same files under another save's prefix: another checkpoint
    ):
        return None
    return CheckpointError(
        "the checkpoint changed while reading (another writer replaced it): read it again",
        path=files.at(MANIFEST_NAME),
    )


def size_problems(manifest: Manifest, files: storage.CheckpointFiles) -> list[CheckpointError]:
    """Files that are symlinks, whose size differs from the manifest, or that are smaller than
    the pieces it puts in them (a checkpoint's data files are regular files of its own).

    Checked before coverage, so a manifest cannot make the coverage check walk regions larger
    than the data actually on disk.
    """
    problems = []
    claimed: dict[str, int] = {}
    model = manifest.model
    model_tensors = {t.name: t for t in model.tensors} if model is not None else {}
    placed = itertools.chain(
        ((p, manifest.param(p.param)) for p in manifest.pieces),
        ((p, model_tensors[p.param]) for p in (model.pieces if model is not None else ())),
    )
    for piece, held in placed:
        itemsize = storage.itemsize(held.dtype_of(piece.key))
        claimed[piece.file] = claimed.get(piece.file, 0) + piece.region.numel * itemsize
    for tensor in manifest.extra.tensors() if manifest.extra is not None else ():
        claimed[tensor.file] = claimed.get(tensor.file, 0) + tensor.nbytes
    names = [data_name(manifest, entry.name) for entry in all_files(manifest)]
    sizes = files.sizes(names)
    for entry, name in zip(all_files(manifest), names, strict=True):
        path = files.at(name)
        if files.symlinked(name):
            problems.append(
                CheckpointError("is a symlink, not a file of this checkpoint", path=path)
            )
            continue
        size = sizes[name]
        if size is None:
            problems.append(CheckpointError("missing data file", path=path))
            continue
        if size != entry.bytes:
            problems.append(
                CheckpointError(
                    f"file is {size} bytes, the manifest says {entry.bytes} "
                    "(truncated or replaced)",
                    path=path,
                )
            )
        elif claimed.get(entry.name, 0) > size:
            problems.append(
                CheckpointError(
                    f"the manifest puts {claimed[entry.name]} bytes of tensors in a "
                    f"{size}-byte file",
                    path=path,
                )
            )
    return problems


class PieceReader:
    """Reads pieces of a checkpoint with checksums, through a bounded cache of open files
    (:class:`muonckpt.storage.ReaderCache`): a checkpoint of any number of files reads within
    the process's open-file limit.

    With ``reuse_outputs=n``, :meth:`gather` returns views into a ring of ``n`` buffers that
    are reused, each result valid until ``n`` more gathers: streaming tools (which hold at most
    ``n`` results) then skip the page faults of fresh allocations, which on some machines cost
    several times the read itself.
    """

    def __init__(
        self,
        files: storage.CheckpointFiles,
        manifest: Manifest,
        *,
        reuse_outputs: int = 0,
        open_files: int | None = None,
    ) -> None:
        self.files = files
        self.manifest = manifest
        self._cache = storage.ReaderCache(open_files, files.reader)
        self._checked: set[str] = set()
        self._sizes = {f.name: f.bytes for f in all_files(manifest)}
        self._ring = [np.empty(0, dtype=np.uint8) for _ in range(reuse_outputs)]
        self._turn = 0

    def __enter__(self) -> PieceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._cache.close()

    @property
    def opens(self) -> int:
        """Files opened so far (reopenings after an eviction included)."""
        return self._cache.opens

    def at(self, file: str) -> storage.Location:
        """Where data file ``file`` of the checkpoint is."""
        return self.files.at(data_name(self.manifest, file))

    def reader(self, file: str) -> storage.SafetensorsReader:
        """The open reader of data file ``file``; use it at once (it may be closed once other
        files were opened)."""
        name = data_name(self.manifest, file)
        if name not in self._checked:
            size = self.files.size(name)
            if size is None:
                changed = changed_while_reading(self.files, self.manifest)
                raise changed or CheckpointError("missing data file", path=self.at(file))
            if size != self._sizes[file]:
                changed = changed_while_reading(self.files, self.manifest)
                raise changed or CheckpointError(
                    f"file is {size} bytes, the manifest says {self._sizes[file]}"
                    " (truncated or replaced)",
                    path=self.at(file),
                )
            self._checked.add(name)
        try:
            return self._cache.get(name)
        except CheckpointError as exc:  # gone or replaced meanwhile: the checkpoint, if so
            raise changed_while_reading(self.files, self.manifest) or exc from None

    def check_header(self, piece: Piece, entry: ParamEntry) -> storage.TensorRecord:
        reader = self.reader(piece.file)
        if piece.tensor not in reader:
            raise CheckpointError(
                f"tensor {piece.tensor!r} missing from the file",
                path=self.at(piece.file),
                param=piece.param,
            )
        record = reader.record(piece.tensor)
        dtype = entry.dtype_of(piece.key)
        if record.dtype != dtype or record.numel != piece.region.numel:
            raise CheckpointError(
                f"header says {record.dtype} x {record.numel} elements, the manifest "
                f"{dtype} x {piece.region.numel}",
                path=self.at(piece.file),
                param=piece.param,
            )
        full = self.manifest.kind == CONSOLIDATED  # stored at full shape, as load_file gives it
        if full and tuple(record.shape) != entry.shape_of(piece.key):
            raise CheckpointError(
                f"header says shape {tuple(record.shape)}, the manifest "
                f"{entry.shape_of(piece.key)}",
                path=self.at(piece.file),
                param=piece.param,
            )
        return record

    def check_extra(self, tensor: ExtraTensor, what: str) -> storage.TensorRecord:
        """The header of a tensor of ``extra`` (``what``: ``extra``, ``rank_extra[3]``) as
        the manifest describes it."""
        reader = self.reader(tensor.file)
        where = f"{what} {list(tensor.path)}"
        if tensor.tensor not in reader:
            raise CheckpointError(
                f"{where}: tensor {tensor.tensor!r} missing", path=self.at(tensor.file)
            )
        record = reader.record(tensor.tensor)
        if (record.dtype, tuple(record.shape)) != (tensor.dtype, tensor.shape):
            raise CheckpointError(
                f"{where}: header says {record.dtype} {list(record.shape)}, the manifest "
                f"{tensor.dtype} {list(tensor.shape)}",
                path=self.at(tensor.file),
            )
        return record

    def read_extra(self, tensor: ExtraTensor, what: str) -> np.ndarray:
        """The bytes of a tensor of ``extra``, checksums verified."""
        record = self.check_extra(tensor, what)
        out = np.empty(record.nbytes, dtype=np.uint8)
        whole = Strided(src=0, dst=0, length=record.numel, count=1, src_step=0, dst_step=0)
        self._read(tensor.file, tensor.tensor, out, [whole], tensor.checksums, tensor.chunk_bytes)
        return out

    def gather(
        self,
        pieces: Sequence[Piece],
        entry: ParamEntry,
        key: str,
        target: Region,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """The raw bytes of ``target``'s elements of stored tensor ``key`` (in the region's own
        order), as a 1-D uint8 array, read from the pieces overlapping it and verified; into
        ``out`` where given (of exactly that many bytes)."""
        size = storage.itemsize(entry.dtype_of(key))
        if out is None:
            out = self._output(target.numel * size)
        elif out.nbytes != target.numel * size:
            raise ValueError(f"out holds {out.nbytes} bytes, {target.numel * size} are read")
        filled = 0
        for piece in pieces:
            groups = strided_runs(piece.region, target)
            if groups:
                self._read_groups(out, piece, groups, entry)
                filled += sum(g.length * g.count for g in groups)
        if filled != target.numel:
            raise CheckpointError(
                f"pieces cover {filled} of the {target.numel} elements needed",
                path=self.files.at(MANIFEST_NAME),
                param=entry.name,
            )
        return out

    def _read_groups(
        self, out: np.ndarray, piece: Piece, groups: list[Strided], entry: ParamEntry
    ) -> None:
        self.check_header(piece, entry)
        self._read(piece.file, piece.tensor, out, groups, piece.checksums, piece.chunk_bytes)

    def _read(
        self,
        file: str,
        tensor: str,
        out: np.ndarray,
        groups: list[Strided],
        checksums: Sequence[str],
        chunk_bytes: int,
    ) -> None:
        """``groups`` of ``tensor`` read into ``out``, verified; a failure of a file that
        changed since it was opened is the checkpoint's, when a writer replaced it."""
        reader = self.reader(file)
        try:
            reader.read_groups(
                tensor, out.data, groups, checksums=checksums, chunk_bytes=chunk_bytes
            )
        except CheckpointError as exc:
            if reader.changed() is None:
                raise
            raise changed_while_reading(self.files, self.manifest) or exc from None

    def _output(self, nbytes: int) -> np.ndarray:
        if not self._ring:
            return np.empty(nbytes, dtype=np.uint8)
        slot = self._turn % len(self._ring)
        self._turn += 1
        if self._ring[slot].nbytes < nbytes:
            self._ring[slot] = np.empty(nbytes, dtype=np.uint8)
        return self._ring[slot][:nbytes]


@logged("verify")
def verify(path: str | os.PathLike[str]) -> list[CheckpointError]:
    """Every problem found in the checkpoint at ``path`` (empty: sound): a directory, or an
    ``s3://`` URL. Reads all data once.

    Every file the manifest names is checked (there, at its size, its header, every
    checksum). In a local directory a file no manifest names is a problem too; under an S3
    prefix it is not: an object a writer left that never committed (a killed save's
    ``s-<16 hex>/`` prefix) is never read, and is garbage for ``clean``. Object storage that
    cannot be used (no credentials, access denied, the server unreachable:
    :class:`~muonckpt.errors.StoreUnreachable`) is raised, not reported as the checkpoint's
    problem."""
    problems = _problems(path)
    unreachable = next((p for p in problems if isinstance(p, StoreUnreachable)), None)
    if unreachable is not None:
        raise unreachable
    return problems


def _problems(path: str | os.PathLike[str]) -> list[CheckpointError]:
    """:func:`verify`'s findings, whatever their cause."""
    try:
        files = checkpoint_at(path)
        manifest = read_manifest(files, pieces=False)
    except CheckpointError as exc:
        return [exc]
    manifest, refused = _with_every_index(files, manifest)
    problems = list(refused.values())
    try:
        problems += size_problems(manifest, files)
    except CheckpointError as exc:
        return [*problems, exc]
    problems = problems or [
        CheckpointError(p, path=files.at(MANIFEST_NAME)) for p in manifest.coverage_problems()
    ]
    problems += _topology_problems(manifest, files)
    problems += _unknown_files(files, manifest)
    with PieceReader(files, manifest) as reader:
        problems += [problem for _, problem in _tensor_problems(manifest, reader, None)]
        problems += _unread_tensors(manifest, reader)
    return _unique(problems)


def _tensor_problems(
    manifest: Manifest, reader: PieceReader, only: Collection[str] | None
) -> list[tuple[str, CheckpointError]]:
    """Every stored tensor's header and checksums checked (``verify``'s read of all data), of
    the data files ``only`` (None: all): each problem with its file."""
    model = manifest.model
    tensors = {e.name: e for e in model.tensors} if model is not None else {}
    problems: list[tuple[str, CheckpointError]] = []
    for piece in itertools.chain(manifest.pieces, model.pieces if model is not None else ()):
        if only is not None and piece.file not in only:
            continue
        try:
            held = tensors.get(piece.param) or manifest.param(piece.param)
            reader.check_header(piece, held)
            reader.reader(piece.file).verify(piece.tensor, piece.checksums, piece.chunk_bytes)
        except CheckpointError as exc:
            problems.append((piece.file, exc))
    for what, tree in manifest.extra.trees() if manifest.extra is not None else ():
        for tensor in tree.tensors:
            if only is not None and tensor.file not in only:
                continue
            try:
                reader.check_extra(tensor, what)
                reader.reader(tensor.file).verify(
                    tensor.tensor, tensor.checksums, tensor.chunk_bytes
                )
            except CheckpointError as exc:
                problems.append((tensor.file, exc))
    return problems


def file_problems(path: str | os.PathLike[str], names: Collection[str]) -> dict[str, str]:
    """(a directory holding some of a checkpoint's files: a node's copy of a local step) The
    data files of ``names`` found damaged, each with its first problem; what ``verify`` checks
    of them (there, at their size, every header and checksum). Every piece index is read,
    checked against the manifest; an index refused is a problem of its own (by its name, so
    that a sound copy of it can replace it) and of every file of ``names``; a manifest refused
    is raised."""
    files = checkpoint_at(path)
    manifest = read_manifest(files, pieces=False)
    manifest, problems = _with_every_index(files, manifest)
    if problems:
        refused = {index: str(problem) for index, problem in problems.items()}
        return {**dict.fromkeys(names, next(iter(refused.values()))), **refused}
    found: dict[str, str] = {}
    with PieceReader(files, manifest) as reader:
        for file, problem in _tensor_problems(manifest, reader, set(names)):
            found.setdefault(file, str(problem))
    return found


def _unread_tensors(manifest: Manifest, reader: PieceReader) -> list[CheckpointError]:
    """(verify) The first tensor of each data file that no piece, model piece or tensor of
    ``extra`` names: a writer stores none, and a piece pointed at it reads values no save
    put there. Counted per file, names compared only where it holds more tensors than are
    named in it: with each tensor named once (reported with coverage:
    :func:`muonckpt.format.coverage.shared_tensors`) and present
    (:meth:`PieceReader.check_header`), that is exactly where one is unread. Not checked
    while a piece index is refused (its pieces are then not known)."""
    if not manifest.complete:
        return []

    def named() -> Iterator[tuple[str, str]]:
        model = manifest.model
        yield from placed(manifest.pieces)
        yield from placed(model.pieces if model is not None else ())
        for _, tree in manifest.extra.trees() if manifest.extra is not None else ():
            yield from ((tensor.file, tensor.tensor) for tensor in tree.tensors)

    counts = Counter(file for file, _ in named())
    problems = []
    for entry in all_files(manifest):
        try:
            keys = reader.reader(entry.name).keys()
        except CheckpointError:
            continue  # reported with the pieces of the file
        if len(keys) > counts[entry.name]:
            read = {tensor for file, tensor in named() if file == entry.name}
            unread = [key for key in keys if key not in read]
            problems.append(
                CheckpointError(
                    f"tensor {unread[0]!r} is read by no piece ({len(unread)} such tensors)",
                    path=reader.at(entry.name),
                )
            )
    return problems


def _unknown_files(files: storage.CheckpointFiles, manifest: Manifest) -> list[CheckpointError]:
    """(verify, a local directory) The files no manifest names, and those that are symlinks:
    beside the manifest, or (a checkpoint copied down from S3) the save prefix beside it and
    the files in that."""
    known = {f.name for f in all_files(manifest)} | {INDEX_FILE, MODEL_INDEX_FILE}
    known |= {entry.name for entry in manifest.indexes}
    if not manifest.data_prefix:
        return _unknown_in(files, "", known | {MANIFEST_NAME})
    top = _unknown_in(files, "", {MANIFEST_NAME, manifest.data_prefix[:-1]})
    return top + _unknown_in(files, manifest.data_prefix, known)


def _unknown_in(
    files: storage.CheckpointFiles, under: str, known: set[str]
) -> list[CheckpointError]:
    """The names in the checkpoint (or its subdirectory ``under``) not ``known``, and those
    that are symlinks; none where the checkpoint is no directory of its own (in S3)."""
    problems = []
    try:
        names = files.names(under)
    except OSError as exc:
        where = files.at(under) if under else files.location
        return [CheckpointError(f"cannot be listed: {exc.strerror}", path=where)]
    for name in names or ():
        entry = files.at(under + name)
        if name not in known:
            problems.append(CheckpointError("unknown file in the checkpoint directory", path=entry))
        elif files.symlinked(under + name):
            problems.append(
                CheckpointError("is a symlink, not a file of the checkpoint's own", path=entry)
            )
    return problems


def _with_every_index(
    files: storage.CheckpointFiles, manifest: Manifest
) -> tuple[Manifest, dict[str, CheckpointError]]:
    """(verify) The manifest with the pieces of every piece index that reads sound, and the
    problems of those that do not, by index file."""
    if not manifest.indexes:
        return manifest, {}
    pieces = PieceTable()
    problems = {}
    for entry in manifest.indexes:
        try:
            pieces.extend(read_index(files, manifest, entry))
        except CheckpointError as exc:
            problems[entry.name] = exc
    return replace(manifest, pieces=pieces, complete=not problems), problems


def _topology_problems(manifest: Manifest, files: storage.CheckpointFiles) -> list[CheckpointError]:
    if manifest.kind != PER_RANK:
        return []
    world = manifest.topology.get("dp", 0) * manifest.topology.get("tp", 0)
    listed = {f.name for f in manifest.files}
    if len(listed) != world or listed != {rank_file(r, world) for r in range(world)}:
        return [
            CheckpointError(
                f"the manifest's topology {manifest.topology} implies {world} rank files, "
                f"it lists {len(listed)}: {sorted(listed)[:4]}",
                path=files.at(MANIFEST_NAME),
            )
        ]
    return []


def _unique(problems: list[CheckpointError]) -> list[CheckpointError]:
    seen, out = set(), []
    for problem in problems:
        if str(problem) not in seen:
            seen.add(str(problem))
            out.append(problem)
    return out
