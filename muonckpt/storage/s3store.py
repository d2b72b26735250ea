"""The storage seam for ``s3://`` targets (work in progress, issue 52): the commit protocol on
object storage, where the manifest is the commit.

A save is staged in a local scratch directory (the engine writes files there as it does for a
:class:`~.backend.PosixStore`); :meth:`S3Store.publish` uploads every staged file under a
*save prefix* of its own, ``<checkpoint>/s-<16 hex>/`` (so racing writers never write one
key and an overwrite never touches the objects of the checkpoint it replaces), then commits by
one conditional PutObject of ``<checkpoint>/manifest.json``, with ``data_prefix`` naming the
save prefix: ``If-None-Match: *`` where there was no checkpoint, ``If-Match`` the etag read
when staging where one is replaced. Exactly one writer commits; a loser removes only its own
save prefix and fails naming the target. After a commit, the objects the replaced manifest
named are deleted (what a crash leaves of them is for ``clean``).

Not yet: the manifest's ``data_prefix`` is not a field the format's reader knows (the next
step: a format version and ``files.pieces`` reading through :class:`~.byte_source.ObjectSource`),
the entry points still refuse URLs (``settings.local_path``), no lease heartbeat, no
``clean``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, CheckpointWarning, PreconditionFailed
from ..format.names import MANIFEST_NAME
from .durable import MAX_TEXT_BYTES, write_text_atomic
from .s3 import S3Client, S3Url

StrPath = str | os.PathLike[str]

SAVE_PREFIX_TAG = "s-"
"""A save prefix is ``s-`` and 16 hex digits; nothing else under a checkpoint is ours to
delete by prefix."""

STAGING_PREFIX = "muonckpt-s3-staging-"


def new_save_prefix() -> str:
    """A fresh save prefix, ``s-<16 hex>/`` (64 random bits; a collision fails the
    conditional create of the lease object, never overwrites)."""
    return f"{SAVE_PREFIX_TAG}{secrets.token_hex(8)}/"


@dataclass(frozen=True)
class Staged:
    """What :meth:`S3Store.create_staging` learnt and chose for one save."""

    final: S3Url
    overwrite: bool
    save_prefix: str
    replaces: str | None
    """The etag of the manifest read when staging, which the commit must replace; None when
    there was none."""
    replaced_text: str | None


def _url(target: StrPath) -> S3Url:
    return S3Url.parse(os.fspath(target))


def with_data_prefix(manifest: str, prefix: str) -> str:
    """The manifest text with ``data_prefix`` first in its top-level object."""
    body = manifest.lstrip()
    if not body.startswith("{"):
        raise CheckpointError("the staged manifest is not a JSON object")
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


def named_objects(manifest: str) -> list[str]:
    """The names of the objects a manifest names relative to its checkpoint: everything under
    its save prefix is listed by the caller; without one, its files and piece indexes."""
    value = json.loads(manifest)
    names = [f["name"] for f in value.get("files", []) if isinstance(f, dict)]
    names += [i["name"] for i in value.get("indexes", []) if isinstance(i, dict)]
    return [n for n in names if isinstance(n, str) and n and "/" not in n and n not in (".", "..")]


class S3Store:
    """:class:`~.backend.CheckpointStore` for ``s3://bucket/prefix`` targets (module
    docstring)."""

    def __init__(self, client: S3Client | None = None) -> None:
        self._client = client
        self._staged: dict[str, Staged] = {}

    @property
    def client(self) -> S3Client:
        if self._client is None:
            self._client = S3Client()
        return self._client

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
                f"{final}: foreign formats are not written to S3; write them to a local "
                "directory and copy them"
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
            raw = self.client.get(manifest, if_match=info.etag)
            if raw is None or data_prefix_of(raw.decode("utf-8", "replace")) is None:
                raise CheckpointError(f"{url}: its manifest.json is not a muonckpt manifest")
            etag, text = info.etag, raw.decode("utf-8")
        prefix = new_save_prefix()
        self.client.put(
            url.child(prefix + ".lease"),
            json.dumps({"host": os.uname().nodename, "pid": os.getpid()}).encode(),
            if_none_match=True,
        )
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX))
        self._staged[str(staging)] = Staged(url, overwrite, prefix, etag, text)
        return staging

    def put_text(
        self, path: StrPath, text: str | Iterable[str], *, limit: int | None = None
    ) -> int:
        return write_text_atomic(path, text, limit=limit)

    def _staged_of(self, staging: StrPath) -> Staged:
        staged = self._staged.get(str(staging))
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
        """Upload the staged files under the save prefix, then commit the manifest
        conditionally, then delete what the replaced manifest named. Returns None: the
        replaced checkpoint is retired here (its objects are not a directory to hand back)."""
        staged = self._staged_of(staging)
        local = Path(staging)
        self._check_sizes(local, files or {})
        names = sorted(n for n in os.listdir(local) if n != MANIFEST_NAME)
        try:
            self._upload(local, staged, names)
            text = (local / MANIFEST_NAME).read_text(encoding="utf-8")
            self._commit(staged, with_data_prefix(text, staged.save_prefix))
        except BaseException:
            self.discard(staging, quiet=True)
            raise
        self._forget(staging)
        try:  # committed: what fails now is a warning (clean removes what is left)
            if staged.replaced_text is not None:
                self._remove_named(staged.final, staged.replaced_text)
            self.client.delete(staged.final.child(staged.save_prefix + ".lease"))
        except CheckpointError as exc:
            warnings.warn(f"committed {staged.final}, but then: {exc}", CheckpointWarning, 2)
        return None

    def _check_sizes(self, local: Path, files: Mapping[str, int]) -> None:
        for name, size in files.items():
            try:
                found = os.stat(local / name).st_size
            except OSError:
                raise CheckpointError(f"{name} is missing; nothing was published") from None
            if found != size:
                raise CheckpointError(f"{name} is {found} bytes, not {size}; nothing published")

    def _upload(self, local: Path, staged: Staged, names: Sequence[str]) -> None:
        client = self.client

        def one(name: str) -> None:
            with open(local / name, "rb") as f:
                chunks = iter(lambda: f.read(client.settings.part_size), b"")
                client.upload(
                    staged.final.child(staged.save_prefix + name), chunks, if_none_match=True
                )

        workers = max(1, min(client.settings.concurrency, len(names)))
        with ThreadPoolExecutor(workers) as pool:
            for future in [pool.submit(one, n) for n in names]:
                future.result()

    def _commit(self, staged: Staged, manifest: str) -> None:
        """The commit: one conditional PutObject of the manifest. A 412 after a retried
        request may be our own first attempt's success whose answer was lost: the manifest
        then names our save prefix."""
        url = staged.final.child(MANIFEST_NAME)
        body = manifest.encode("utf-8")
        try:
            if staged.replaces is None:
                self.client.put(url, body, if_none_match=True)
            else:
                self.client.put(url, body, if_match=staged.replaces)
        except PreconditionFailed:
            now = self.client.get(url)
            if now is not None and data_prefix_of(now.decode("utf-8", "replace")) == (
                staged.save_prefix
            ):
                return
            raise CheckpointError(
                f"another save committed {staged.final} first (its manifest changed since "
                "this save began); this save's objects were removed, the other's kept"
            ) from None

    def _remove_named(self, checkpoint: S3Url, manifest: str) -> None:
        prefix = data_prefix_of(manifest)
        if prefix:
            self._remove_prefix(checkpoint, prefix)
        else:
            self.client.delete_many(checkpoint.child(n) for n in named_objects(manifest))

    def _remove_prefix(self, checkpoint: S3Url, prefix: str) -> None:
        if not (prefix.startswith(SAVE_PREFIX_TAG) and prefix.endswith("/")):
            raise CheckpointError(f"{checkpoint}: {prefix!r} is not a save prefix of muonckpt's")
        under = checkpoint.child(prefix.rstrip("/"))
        keys, _ = self.client.listing(under)
        self.client.delete_many(under.child(k) for k in keys)

    def _forget(self, staging: StrPath) -> None:
        self._staged.pop(str(staging), None)
        shutil.rmtree(staging, ignore_errors=True)

    def entries(self, directory: StrPath) -> list[str]:
        keys, directories = self.client.listing(_url(directory), delimiter=True)
        return sorted([*keys, *directories])

    def directories(self, root: StrPath) -> list[str]:
        return self.client.listing(_url(root), delimiter=True)[1]

    def discard(self, staging: StrPath, *, quiet: bool = False) -> list[str]:
        staged = self._staged.get(str(staging))
        if staged is not None:
            self._remove_prefix(staged.final, staged.save_prefix)
        self._forget(staging)
        return []

    def retire(self, directory: StrPath, files: Sequence[str] | None = None) -> None:
        """Nothing: :meth:`publish` retired what it replaced."""

    def remove_checkpoint(self, directory: StrPath) -> bool:
        """Delete a committed checkpoint: its manifest (only the one read: If-Match), then
        the objects it named."""
        url = _url(directory)
        manifest = url.child(MANIFEST_NAME)
        info = self.client.head(manifest)
        if info is None:
            return False
        raw = self.client.get(manifest, 0, min(info.size, MAX_TEXT_BYTES), if_match=info.etag)
        if raw is None:
            return False
        self.client.delete(manifest, if_match=info.etag)
        self._remove_named(url, raw.decode("utf-8", "replace"))
        return True
