"""The storage seam for ``s3://`` targets (issue 52): the commit protocol on object storage,
where the manifest is the commit.

Every object a save writes is under a *save prefix* of its own, ``<checkpoint>/s-<16 hex>/``
(so racing writers never write one key and an overwrite never touches the objects of the
checkpoint it replaces), and the save commits by one conditional PutObject of
``<checkpoint>/manifest.json`` whose ``data_prefix`` names its save prefix: ``If-None-Match:
*`` where there was no checkpoint, ``If-Match`` the etag read when staging where one is
replaced. Exactly one writer commits; a loser removes only its own save prefix and fails
naming the target. After a commit, the objects the replaced manifest named are deleted (what a
crash leaves of them is for ``clean``).

Each rank writes its files into a local scratch directory of its own host,
``$TMPDIR/muonckpt-s3-<16 hex>/rank-<rank>`` (the name the root's :meth:`S3Store.create_staging`
returns is sent to every rank, each derives its own from it: :meth:`S3Store.join_staging`),
uploads them itself (:meth:`S3Store.send`, multipart with part size x concurrency bounded, in
parallel with the other ranks, before it reports in the ``write`` step) and deletes its
scratch copies. The root then uploads the piece indexes and commits (:meth:`S3Store.publish`).
Nothing needs a directory every rank shares.

While a save runs, its root renews ``<save prefix>.lease`` every :data:`LEASE_BEAT_S`
seconds; ``clean`` (:meth:`S3Store.leftovers`) removes a save prefix no committed manifest
names only when its lease is older than :data:`LEASE_STALE_S` (or absent) and nothing under
it (lease, objects, uploads in progress) changed for ``older_than`` seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError, CheckpointWarning, PreconditionFailed
from ..format.manifest import PREFIXED_VERSION, all_files
from ..format.manifest_json import parse_manifest
from ..format.names import INDEX_FILE, MANIFEST_NAME, MODEL_INDEX_FILE
from . import lease
from .durable import MAX_TEXT_BYTES, write_text_atomic
from .s3 import Listed, S3Client, S3Url, shared_client
from .streamed_upload import StreamedUpload

StrPath = str | os.PathLike[str]

SAVE_PREFIX_TAG = "s-"
"""A save prefix is ``s-`` and 16 hex digits; nothing else under a checkpoint is ours to
delete by prefix."""

_SAVE_PREFIX = re.compile(r"s-([0-9a-f]{16})")
_SCRATCH = re.compile(r"muonckpt-s3-([0-9a-f]{16})")
LEASE = ".lease"
"""The object under a save prefix that marks the save as running while its root renews it."""
LEASE_BEAT_S = 10.0
"""How often a save's root renews its lease."""
LEASE_STALE_S = 120.0
"""A lease not renewed for this long is a dead save's (12 beats: a margin for clocks that
differ between the server and the host running ``clean``)."""


def new_save_prefix() -> str:
    """A fresh save prefix, ``s-<16 hex>/`` (64 random bits; a collision fails the
    conditional create of the lease object, never overwrites)."""
    return f"{SAVE_PREFIX_TAG}{secrets.token_hex(8)}/"


def _save_prefix_of(staging: StrPath) -> str:
    """The save prefix of a scratch directory (the root's name for it, or a rank's own)."""
    for part in reversed(Path(staging).parts):
        found = _SCRATCH.fullmatch(part)
        if found is not None:
            return f"{SAVE_PREFIX_TAG}{found.group(1)}/"
    raise CheckpointError("not a staging directory of an S3 save", path=staging)


def _scratch(save_prefix: str) -> Path:
    """This host's scratch directory of the save ``save_prefix``."""
    return Path(tempfile.gettempdir()) / f"muonckpt-s3-{save_prefix[2:-1]}"


class _Heartbeat:
    """The lease of a running save, renewed on a thread every :data:`LEASE_BEAT_S` seconds
    until :meth:`stop` (a failed renewal is retried at the next beat)."""

    def __init__(self, client: S3Client, lease: S3Url) -> None:
        self._stop = threading.Event()
        self._client, self._lease = client, lease
        self._thread = threading.Thread(target=self._run, name="muonckpt-s3-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(LEASE_BEAT_S):
            with contextlib.suppress(CheckpointError):
                self._client.put(self._lease, _lease_body())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


SCRATCH_LEASE = "s3 scratch"
"""What the lease of a rank's scratch directory says it is (:mod:`.lease`)."""


def _scratch_files(local: Path) -> list[str]:
    """The files a rank wrote into its scratch directory ``local`` (not its lease)."""
    return sorted(n for n in os.listdir(local) if not lease.LEASE_FILE.match(n))


def _leave(local: Path) -> None:
    """This process is done with its scratch directory ``local``: its lease given up."""
    lease.give_up(local)
    lease.release(local)


def _sweep_scratch() -> None:
    """Remove this host's scratch directories of ranks that died mid-save (killed, out of
    memory: nothing of theirs ran to remove them): those whose lease, which a live rank holds
    locked, is free (:func:`.lease.leftover`). Only real directories of this user are looked
    at (a symlink planted in a shared ``$TMPDIR`` is never followed, another user's directory
    never entered), each emptied through a descriptor of the directory checked, and one
    without a lease muonckpt wrote is left alone; a save's directory goes once its last
    rank's has."""
    for top in Path(tempfile.gettempdir()).glob("muonckpt-s3-*"):
        if _SCRATCH.fullmatch(top.name) is None or _foreign(top):
            continue
        try:
            ranks = [d for d in top.iterdir() if d.name.startswith("rank-")]
        except OSError:  # gone meanwhile
            continue
        for directory in ranks:
            if _foreign(directory):
                continue
            with lease.leftover(directory) as found:
                if found.kept_because is not None:  # (a rank between its mkdir and its lease
                    continue  # too: its directory, empty, is never removed)
                _empty(directory)
            with contextlib.suppress(OSError):
                directory.rmdir()
                top.rmdir()  # (when that was its last rank's)


def _foreign(directory: Path) -> bool:
    """Whether ``directory`` is not a real directory of this user's (a symlink, a file,
    another user's, or gone)."""
    try:
        info = os.lstat(directory)
    except OSError:
        return True
    return not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()


def _empty(directory: Path) -> None:
    """Delete the files of scratch directory ``directory`` (its lease last), through a
    descriptor of it opened without following a symlink, so that a directory swapped for a
    link meanwhile is never the one emptied."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        for name in sorted(os.listdir(fd), key=lease.deletion_order):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def _wait_all(streams: Sequence[StreamedUpload]) -> None:
    """Wait for every upload in ``streams``; the first failure raised once all have ended
    (the others abandoned: none is left running)."""
    failed: BaseException | None = None
    for stream in streams:
        if failed is not None:
            stream.abandon()
            continue
        try:
            stream.wait()
        except BaseException as exc:
            failed = exc
    if failed is not None:
        raise failed


def _lease_body() -> bytes:
    return json.dumps({"host": os.uname().nodename, "pid": os.getpid()}).encode()


@dataclass
class Staged:
    """What :meth:`S3Store.create_staging` learnt and chose for one save (on its root)."""

    final: S3Url
    overwrite: bool
    save_prefix: str
    replaces: str | None
    """The etag of the manifest read when staging, which the commit must replace; None when
    there was none."""
    replaced_text: str | None
    heartbeat: _Heartbeat = field(repr=False)


def _by_save(listed: Iterable[Listed]) -> dict[tuple[str, str], list[Listed]]:
    """What a listing of a root holds under each ``<checkpoint>/s-<16 hex>/``, by (checkpoint,
    save prefix); every other key is left out (never ours to delete)."""
    found: dict[tuple[str, str], list[Listed]] = {}
    for item in listed:
        parts = item.key.split("/", 2)
        if len(parts) == 3 and _SAVE_PREFIX.fullmatch(parts[1]):
            found.setdefault((parts[0], parts[1] + "/"), []).append(item)
    return found


def _url(target: StrPath) -> S3Url:
    return S3Url.parse(os.fspath(target))


_VERSION_LINE = re.compile(r'^"format_version": \d+,$', re.M)
"""The top-level ``format_version`` as :meth:`~muonckpt.format.manifest.Manifest.json_chunks`
writes it: a line of its own (nested values never start a line with a key)."""


def with_data_prefix(manifest: str, prefix: str) -> str:
    """The manifest text muonckpt staged, with ``data_prefix`` first in its top-level object
    and its format version :data:`~muonckpt.format.manifest.PREFIXED_VERSION` (what a
    reader that knows no ``data_prefix`` refuses)."""
    body = manifest.lstrip()
    version = f'"format_version": {PREFIXED_VERSION},'
    body, found = _VERSION_LINE.subn(version, body)
    if not body.startswith("{") or found != 1:
        raise CheckpointError("the staged manifest is not one muonckpt wrote; nothing committed")
    return "{" + json.dumps("data_prefix") + ":" + json.dumps(prefix) + "," + body[1:]


def data_prefix_of(manifest: str) -> str | None:
    """The ``data_prefix`` a committed manifest names (``""`` when none: files beside it);
    None when it is no JSON object."""
    try:
        value = json.loads(manifest)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    prefix = value.get("data_prefix", "")
    return prefix if isinstance(prefix, str) else None


def named_objects(manifest: str, source: S3Url) -> list[str]:
    """The names of the files a manifest without a save prefix names beside it (every data
    file, extra's included, the piece indexes, the index texts of a consolidated save)."""
    parsed = parse_manifest(manifest, source)
    names = [f.name for f in all_files(parsed)] + [i.name for i in parsed.indexes]
    return [*names, INDEX_FILE, MODEL_INDEX_FILE]


class S3Store:
    """:class:`~.backend.CheckpointStore` for ``s3://bucket/prefix`` targets (module
    docstring)."""

    def __init__(self, client: S3Client | None = None) -> None:
        self._client = client
        self._staged: dict[str, Staged] = {}
        self._committed: set[str] = set()
        self._joined: dict[Path, S3Url] = {}
        """Each scratch directory a rank of this process writes into: its save prefix."""
        self._streams: dict[Path, StreamedUpload] = {}
        """Each file uploaded as it is written (:meth:`follow`), until :meth:`send`."""

    @property
    def client(self) -> S3Client:
        if self._client is None:
            self._client = shared_client()
        return self._client

    # -- one save ---------------------------------------------------------------------------

    def create_staging(
        self,
        final: StrPath,
        overwrite: bool,
        *,
        source: StrPath | None = None,
        output: str | None = None,
    ) -> Path:
        if output is not None:
            raise CheckpointError(
                f"{final}: foreign formats are not written to S3; stage the files locally "
                "and copy them"
            )
        url = _url(final)
        manifest = url.child(MANIFEST_NAME)
        etag = text = None
        info = self.client.head(manifest)
        if info is not None:
            if not overwrite:
                raise CheckpointError(
                    f"{url} already holds a checkpoint; pass overwrite=True to replace it"
                )
            raw = (
                None
                if info.size > MAX_TEXT_BYTES
                else self.client.get(manifest, if_match=info.etag)
            )
            try:
                text = None if raw is None else raw.decode("utf-8")
                parse_manifest(text or "", url)
            except (CheckpointError, UnicodeDecodeError):
                raise CheckpointError(
                    f"{url}: its manifest.json is not a muonckpt manifest; nothing replaced"
                ) from None
            etag = info.etag
        prefix = new_save_prefix()
        lease = url.child(prefix + LEASE)
        scratch = _scratch(prefix)
        scratch.mkdir(mode=0o700)
        try:
            self.client.create(lease, _lease_body())
        except BaseException:
            scratch.rmdir()
            raise
        beat = _Heartbeat(self.client, lease)
        self._staged[prefix] = Staged(url, overwrite, prefix, etag, text, beat)
        return scratch

    def join_staging(self, staging: str, rank: int, final: StrPath) -> Path:
        """This rank's own scratch directory on its host, from the name the root's
        :meth:`create_staging` returned: every rank writes only its own files there."""
        prefix = _save_prefix_of(staging)
        _sweep_scratch()
        mine = _scratch(prefix) / f"rank-{rank:05d}"
        mine.mkdir(mode=0o700, parents=True, exist_ok=True)
        lease.take(mine, SCRATCH_LEASE)
        self._joined[mine] = _url(final).child(prefix[:-1])
        return mine

    def follow(self, path: Path, fd: int) -> StreamedUpload | None:
        """A data file written into a scratch directory of :meth:`join_staging` is uploaded
        as it is written (:class:`~.streamed_upload.StreamedUpload`, reading ``fd``), once the
        upload of the rank's previous file has ended, and :meth:`send` waits for it; None
        elsewhere."""
        saved = self._joined.get(path.parent)
        if saved is None:
            return None
        for earlier in [s for p, s in self._streams.items() if p.parent == path.parent]:
            earlier.wait()  # one upload in flight per rank: memory part size x (concurrency + 1)
        stream = StreamedUpload(self.client, saved.child(path.name), fd)
        self._streams[path] = stream
        return stream

    def put_text(
        self, path: StrPath, text: str | Iterable[str], *, limit: int | None = None
    ) -> int:
        return write_text_atomic(path, text, limit=limit)

    def send(
        self, staging: StrPath, final: StrPath, *, upload: bool = True, last: bool = True
    ) -> None:
        """(every rank, before it reports in the ``write`` step) Wait for the files this rank
        wrote into its scratch directory ``staging`` that were uploaded as they were written
        (:meth:`follow`), upload the others under the save prefix, in parallel, then delete
        the scratch copies (without ``upload``, after a failed write: abandon the uploads
        and only delete the copies); with ``last``, the directory too (the root keeps it
        for the indexes and the manifest)."""
        local = Path(staging)
        names = _scratch_files(local)
        streams = [self._streams.pop(p) for p in list(self._streams) if p.parent == local]
        try:
            if upload:
                _wait_all(streams)
                streamed = {stream.url.name for stream in streams}
                rest = [name for name in names if name not in streamed]
                self._upload(local, _url(final).child(_save_prefix_of(staging)[:-1]), rest)
        finally:
            for stream in streams:
                stream.abandon()  # (a finished upload: nothing more)
            if last:
                self._joined.pop(local, None)
                _leave(local)
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(local / name)
            if last:
                with contextlib.suppress(OSError):
                    os.rmdir(local)
                    os.rmdir(local.parent)  # (the last rank of this host to leave)

    def sync_files(self, directory: StrPath, names: Iterable[str]) -> None:
        """Nothing: every rank's files were uploaded whole before it reported
        (:meth:`send`)."""

    def _staged_of(self, staging: StrPath) -> Staged:
        staged = self._staged.get(_save_prefix_of(staging))
        if staged is None:
            raise CheckpointError("not a staging directory of this store", path=staging)
        return staged

    def publish(
        self,
        staging: StrPath,
        final: StrPath,
        *,
        files: Mapping[str, int] | None = None,
        overwrite: bool | None = None,
    ) -> Path | None:
        """Upload what the root wrote after :meth:`send` (the piece indexes), check that every
        file the manifest lists is there at its size (one LIST of the save prefix), commit
        the manifest conditionally, then delete what the replaced manifest named. Returns
        None: the replaced checkpoint is retired here (its objects are no directory to hand
        back)."""
        staged = self._staged_of(staging)
        local = Path(staging)
        saved = staged.final.child(staged.save_prefix[:-1])
        try:
            names = [n for n in _scratch_files(local) if n != MANIFEST_NAME]
            self._upload(local, saved, names)
            self._check_sizes(local, saved, files or {})
            text = (local / MANIFEST_NAME).read_text(encoding="utf-8")
            manifest = with_data_prefix(text, staged.save_prefix)
        except BaseException:
            self.discard(staging, quiet=True)
            raise
        self._commit_or_keep(staged, staging, manifest)
        self._committed.add(staged.save_prefix)
        self._forget(staged)
        try:  # committed: what fails now is a warning (clean removes what is left)
            if staged.replaced_text is not None:
                self._remove_named(staged.final, staged.replaced_text)
            self.client.delete(saved.child(LEASE))
        except CheckpointError as exc:
            warnings.warn(f"committed {staged.final}, but then: {exc}", CheckpointWarning, 2)
        return None

    def _check_sizes(self, local: Path, saved: S3Url, files: Mapping[str, int]) -> None:
        uploaded = {o.key: o.size for o in self.client.tree(saved)}
        for name, size in files.items():
            try:
                found = os.stat(local / name).st_size if name == MANIFEST_NAME else uploaded[name]
            except (OSError, KeyError):
                raise CheckpointError(f"{name} is missing; nothing was published") from None
            if found != size:
                raise CheckpointError(f"{name} is {found} bytes, not {size}; nothing published")

    def _upload(self, local: Path, saved: S3Url, names: Sequence[str]) -> None:
        """Upload files ``names`` of ``local`` under ``saved``: those of one part at most
        ``concurrency`` at a time, then each larger one in turn, ``concurrency`` parts at a
        time (memory at most part size x (concurrency + 1))."""
        client = self.client
        part = client.settings.part_size

        def one(name: str) -> None:
            with open(local / name, "rb") as f:
                chunks = iter(lambda: f.read(part), b"")
                client.upload(saved.child(name), chunks, if_none_match=True)

        sizes = {name: os.stat(local / name).st_size for name in names}
        small = [name for name in names if sizes[name] <= part]
        if small:
            with ThreadPoolExecutor(min(client.settings.concurrency, len(small))) as pool:
                for future in [pool.submit(one, name) for name in small]:
                    future.result()
        for name in names:
            if sizes[name] > part:
                one(name)

    def _commit_or_keep(self, staged: Staged, staging: StrPath, manifest: str) -> None:
        """:meth:`_commit`, and this save's objects removed only when it certainly did not
        commit (another save did; or, after a failed request, the manifest read back names
        another): a request that may have reached the server leaves them for ``clean`` when
        the outcome cannot be told, for the manifest may name them."""
        try:
            self._commit(staged, manifest)
        except PreconditionFailed:  # another save's manifest is the one committed
            self.discard(staging, quiet=True)
            raise CheckpointError(
                f"another save committed {staged.final} first (its manifest changed since "
                "this save began); this save's objects were removed, the other's kept"
            ) from None
        except Exception as exc:
            try:
                ours = self._names(staged.final, staged.save_prefix)
            except CheckpointError:
                self._forget(staged)  # its lease goes stale: clean tells what is left
                raise CheckpointError(
                    f"{staged.final}: whether this save committed cannot be told ({exc}); "
                    "its objects were kept (muonckpt clean removes them if no manifest "
                    "names them)"
                ) from exc
            if not ours:
                self.discard(staging, quiet=True)
                raise
        except BaseException:  # interrupted: the PUT may have landed; clean decides later
            self._forget(staged)
            raise

    def _commit(self, staged: Staged, manifest: str) -> None:
        """The commit: one conditional PutObject of the manifest; its
        :class:`PreconditionFailed` when another save's manifest is there. A 412 after a
        retried request may be our own first attempt's success whose answer was lost: the
        manifest then names our save prefix."""
        url = staged.final.child(MANIFEST_NAME)
        body = manifest.encode("utf-8")
        try:
            if staged.replaces is None:
                self.client.put(url, body, if_none_match=True)
            else:
                self.client.put(url, body, if_match=staged.replaces)
        except PreconditionFailed:
            if not self._names(staged.final, staged.save_prefix):
                raise

    def _names(self, checkpoint: S3Url, save_prefix: str) -> bool:
        """Whether the manifest now at ``checkpoint`` names ``save_prefix``."""
        now = self.client.get(checkpoint.child(MANIFEST_NAME))
        return now is not None and data_prefix_of(now.decode("utf-8", "replace")) == save_prefix

    @contextlib.contextmanager
    def watching(self, final: StrPath, staging: StrPath) -> Iterator[Callable[[], bool]]:
        """Whether the save staged in ``staging`` is committed at ``final``: committed by this
        process, or the manifest there names its save prefix (a rank whose root died right
        after the commit); a manifest that cannot be read counts as not committed."""
        url, prefix = _url(final), _save_prefix_of(staging)

        def committed() -> bool:
            if prefix in self._committed:
                return True
            try:
                return self._names(url, prefix)
            except CheckpointError:
                return False

        yield committed

    def _remove_named(self, checkpoint: S3Url, manifest: str) -> None:
        prefix = data_prefix_of(manifest)
        if prefix:
            self._remove_prefix(checkpoint, prefix)
        else:
            names = named_objects(manifest, checkpoint)
            self.client.delete_many(checkpoint.child(n) for n in names)

    def _saved(self, checkpoint: S3Url, prefix: str) -> S3Url:
        """The objects of save prefix ``prefix`` under ``checkpoint``; refused unless it is
        one (``s-<16 hex>/``)."""
        if not _SAVE_PREFIX.fullmatch(prefix.rstrip("/")) or not prefix.endswith("/"):
            raise CheckpointError(f"{checkpoint}: {prefix!r} is not a save prefix of muonckpt's")
        return checkpoint.child(prefix.rstrip("/"))

    def _remove_prefix(self, checkpoint: S3Url, prefix: str) -> None:
        """Delete every object under a save prefix, its lease last: what a crash leaves of it
        still holds the lease by which ``clean`` knows it for muonckpt's."""
        under = self._saved(checkpoint, prefix)
        keys, _ = self.client.listing(under)
        self.client.delete_many(under.child(k) for k in keys if k != LEASE)
        if LEASE in keys:
            self.client.delete(under.child(LEASE))

    def _forget(self, staged: Staged) -> None:
        self._staged.pop(staged.save_prefix, None)
        staged.heartbeat.stop()
        scratch = _scratch(staged.save_prefix)
        for joined in [p for p in self._joined if p.parent == scratch]:
            del self._joined[joined]
            _leave(joined)
        shutil.rmtree(scratch, ignore_errors=True)

    def discard(self, staging: StrPath, *, quiet: bool = False) -> list[str]:
        staged = self._staged.get(_save_prefix_of(staging))
        if staged is not None:
            self._forget(staged)
            self._remove_prefix(staged.final, staged.save_prefix)
        return []

    # -- checkpoints --------------------------------------------------------------------------

    def entries(self, directory: StrPath) -> list[str]:
        keys, directories = self.client.listing(_url(directory), delimiter=True)
        return sorted([*keys, *directories])

    def directories(self, root: StrPath) -> list[str]:
        return self.client.listing(_url(root), delimiter=True)[1]

    def retire(self, directory: StrPath, files: Sequence[str] | None = None) -> None:
        """Nothing: :meth:`publish` retired what it replaced."""

    def remove_checkpoint(self, directory: StrPath) -> bool:
        """Delete a committed checkpoint: its manifest (only the one read: If-Match), then
        the objects it named. Refused where the server ignores If-Match on DELETE
        (:meth:`~.s3.S3Client.honours_conditional_delete`): there a checkpoint saved at the
        same place meanwhile could be the one deleted."""
        url = _url(directory)
        probe = url.child(new_save_prefix() + LEASE)  # a stale lease for clean if left behind
        if not self.client.honours_conditional_delete(probe, _lease_body()):
            raise CheckpointError(
                f"{url}: the server ignores If-Match on DELETE, so deleting this checkpoint "
                "could delete one saved there meanwhile; delete old checkpoints by hand there"
            )
        manifest = url.child(MANIFEST_NAME)
        info = self.client.head(manifest)
        if info is None:
            return False
        raw = self.client.get(manifest, 0, min(info.size, MAX_TEXT_BYTES), if_match=info.etag)
        if raw is None:
            return False
        text = raw.decode("utf-8", "replace")
        prefix = data_prefix_of(text)
        if prefix:  # a lease first: what a crash leaves of the objects is known for ours
            self.client.put(self._saved(url, prefix).child(LEASE), _lease_body())
        self.client.delete(manifest, if_match=info.etag)
        self._remove_named(url, text)
        return True

    def leftovers(
        self, root: StrPath, older_than: float
    ) -> tuple[list[S3Url], list[tuple[S3Url, str]]]:
        """(``clean``) Remove the save prefixes ``<root>/<checkpoint>/s-<16 hex>/`` that no
        committed manifest names, that are known for muonckpt's (they hold its lease, or
        ``<checkpoint>`` holds a muonckpt manifest: a look-alike name alone is never enough),
        whose lease is absent or older than :data:`LEASE_STALE_S`, and under which nothing
        (lease, objects, uploads in progress) changed for more than ``older_than`` seconds:
        their objects, and their multipart uploads aborted; and under a committed save prefix,
        the multipart uploads older than ``older_than`` (a committed save's objects are all
        complete: such an upload is one whose start's answer was lost). Nothing else is ever
        deleted.
        Returns the prefixes removed, and the others no manifest names with why each was
        kept.

        One LIST of everything under ``root`` and one of its uploads, made before the
        manifests are read: a save that commits meanwhile had a fresh lease in the listing."""
        url = _url(root)
        objects = _by_save(self.client.tree(url))
        uploads = _by_save(self.client.uploads(url))
        named: dict[str, str | None] = {}
        """Per checkpoint read: the save prefix its muonckpt manifest names (``""``: none);
        None when it has no manifest. Absent from it: a manifest that is not muonckpt's."""
        read: set[str] = set()
        removed: list[S3Url] = []
        skipped: list[tuple[S3Url, str]] = []
        now = time.time()
        for checkpoint, prefix in sorted({*objects, *uploads}):
            if checkpoint not in read:
                read.add(checkpoint)
                named |= self._named_prefix(url, checkpoint)
            where = url.child(checkpoint).child(prefix.rstrip("/"))
            if checkpoint not in named:
                skipped.append((where, "its checkpoint's manifest.json is not muonckpt's"))
                continue
            if named[checkpoint] == prefix:  # committed: its objects are all complete, so an
                for upload in uploads.get((checkpoint, prefix), []):  # upload there is a lost one
                    if now - upload.modified > older_than:
                        self.client.abort(url.child(upload.key), upload.upload)
                continue
            held = objects.get((checkpoint, prefix), [])
            going = uploads.get((checkpoint, prefix), [])
            lease = next((now - o.modified for o in held if o.key.endswith("/" + LEASE)), None)
            age = now - max(o.modified for o in [*held, *going])
            if lease is None and named[checkpoint] is None:
                skipped.append((where, "no lease of muonckpt's and no checkpoint: not its"))
            elif lease is not None and lease <= LEASE_STALE_S:
                skipped.append((where, f"its save is running (lease renewed {lease:.0f} s ago)"))
            elif age <= older_than:
                skipped.append((where, f"changed {age:.0f} s ago, not older than {older_than:g} s"))
            else:
                for upload in going:
                    self.client.abort(url.child(upload.key), upload.upload)
                last = [o for o in held if o.key.endswith("/" + LEASE)]  # known for ours
                self.client.delete_many(url.child(o.key) for o in held if o not in last)
                self.client.delete_many(url.child(o.key) for o in last)
                removed.append(where)
        return removed, skipped

    def _named_prefix(self, root: S3Url, checkpoint: str) -> dict[str, str | None]:
        """``{checkpoint: the save prefix its manifest names}`` (``""``: none; None: no
        manifest there); ``{}`` when its manifest is not a muonckpt manifest (one longer than
        a reader reads is not: only its first bytes are fetched)."""
        at = root.child(checkpoint)
        found = self.client.fetch(at.child(MANIFEST_NAME), MAX_TEXT_BYTES + 1)
        if found is None:
            return {checkpoint: None}
        raw = found[0]
        if len(raw) > MAX_TEXT_BYTES:
            return {}
        try:
            return {checkpoint: parse_manifest(raw.decode("utf-8", "replace"), at).data_prefix}
        except CheckpointError:
            return {}
