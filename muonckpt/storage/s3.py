"""Objects in S3-compatible storage: ``s3://bucket/prefix`` URLs and one client that makes
every request muonckpt sends, with bounded retries, the conditional writes a commit relies on
(``If-None-Match: *``, ``If-Match: <etag>``), ranged reads, and multipart uploads whose memory
is bounded by part size x concurrency.

The client library is boto3 (the optional extra ``muonckpt[s3]``), imported when the first
client is made, so that a local-only install never needs it. Endpoint, region and credentials
come from boto3's standard configuration (environment, ``~/.aws`` files, profiles,
``AWS_ENDPOINT_URL`` for an S3-compatible server). botocore's own retries are off: every
request goes through :meth:`S3Client._call`, which retries what is transient (503 SlowDown,
5xx, throttling, timeouts, dropped connections) with exponential backoff and full jitter,
bounded in count and in time, then raises one :class:`~muonckpt.errors.CheckpointError` naming
the object and the last error.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import CheckpointError, PreconditionFailed, StoreUnreachable

SCHEME = "s3://"

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""S3's bucket names: 3 to 63 lowercase letters, digits, dots and hyphens."""

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "RequestTimeoutException",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "TooManyRequestsException",
    }
)
_TRANSIENT_STATUS = frozenset({500, 502, 503, 504})
_PLACE_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "NoSuchBucket",
        "PermanentRedirect",
        "AuthorizationHeaderMalformed",
    }
)
"""Error codes that say the place is at fault, not a checkpoint (:class:`StoreUnreachable`)."""

T = TypeVar("T")


def is_s3_url(path: object) -> bool:
    """Whether ``path`` is a string naming an ``s3://`` URL."""
    return isinstance(path, str) and path.startswith(SCHEME)


@dataclass(frozen=True)
class S3Url:
    """An object, or a prefix of objects, in a bucket: ``s3://bucket/key``. ``key`` has no
    leading or trailing ``/``; empty for the bucket's root."""

    bucket: str
    key: str

    @staticmethod
    def parse(text: str) -> S3Url:
        """``text`` as an :class:`S3Url`; a :class:`CheckpointError` naming it when it is not
        ``s3://BUCKET[/KEY]`` with a valid bucket name and no empty, ``.`` or ``..`` part."""
        if not text.startswith(SCHEME):
            raise CheckpointError(f"{text!r} is not an s3:// URL")
        bucket, _, key = text[len(SCHEME) :].partition("/")
        key = key.rstrip("/")  # (a leading "/" is an empty part: aws s3 reads it as a key's)
        if not _BUCKET.fullmatch(bucket):
            raise CheckpointError(f"{text!r}: {bucket!r} is not an S3 bucket name")
        if key and any(part in ("", ".", "..") for part in key.split("/")):
            raise CheckpointError(f"{text!r}: an empty, '.' or '..' part in its key")
        return S3Url(bucket, key)

    def child(self, name: str) -> S3Url:
        """The object or prefix ``name`` (one or more ``/``-separated parts) under this one."""
        return S3Url(self.bucket, f"{self.key}/{name}" if self.key else name)

    def __truediv__(self, name: str) -> S3Url:
        """:meth:`child`, as ``/`` joins a :class:`~pathlib.Path`: a checkpoint's place, local
        or in S3, names its files alike."""
        return self.child(name)

    @property
    def name(self) -> str:
        """The last part of the key (a checkpoint's name)."""
        return self.key.rpartition("/")[2]

    @property
    def parent(self) -> S3Url:
        """The prefix this one is directly under (where a run's checkpoints are listed)."""
        return S3Url(self.bucket, self.key.rpartition("/")[0])

    @property
    def prefix(self) -> str:
        """The key as a prefix of the objects under it (with a trailing ``/``)."""
        return f"{self.key}/" if self.key else ""

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


@dataclass(frozen=True)
class TransferSettings:
    """How requests are sent: multipart part size and parts in flight per upload (memory is
    at most ``part_size * (concurrency + 1)`` per upload), the ranged reads in flight, and the
    retry bounds."""

    part_size: int = 16 << 20
    concurrency: int = 8
    attempts: int = 8
    retry_seconds: float = 120.0
    backoff_base: float = 0.1
    backoff_cap: float = 5.0
    connect_timeout: float = 10.0
    read_timeout: float = 60.0

    def __post_init__(self) -> None:
        if not 5 << 20 <= self.part_size <= 5 << 30:
            raise ValueError(
                f"part_size must be 5 MiB to 5 GiB (S3's limits), not {self.part_size}"
            )
        if self.concurrency < 1 or self.attempts < 1:
            raise ValueError("concurrency and attempts must be at least 1")


@dataclass(frozen=True)
class Listed:
    """An object found by a listing: its key relative to the prefix listed, its size, when it
    was last written (seconds since the epoch); for an upload in progress, its id."""

    key: str
    size: int
    modified: float
    upload: str = ""


def _key_of(listed: Listed) -> str:
    return listed.key


@dataclass(frozen=True)
class ObjectInfo:
    """An object's size and etag (quotes included, as S3 sends it)."""

    size: int
    etag: str
    modified_ns: int = 0
    """When it was written (S3 keeps seconds), in nanoseconds."""


def _botocore() -> tuple[Any, Any]:
    try:
        return importlib.import_module("boto3"), importlib.import_module("botocore")
    except ImportError:
        raise CheckpointError(
            "s3:// URLs need boto3: pip install 'muonckpt[s3]'; nothing was read or written"
        ) from None


_CLIENTS: dict[tuple[TransferSettings, tuple[tuple[str, str], ...]], S3Client] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_client(settings: TransferSettings | None = None) -> S3Client:
    """This process's client for ``settings`` (the defaults when None) and the AWS
    environment as it is now (``AWS_*``: endpoint, profile, credentials, region), made at the
    first call with them (boto3's session and client take ~0.3 s): a process that changes its
    environment gets a client that follows it. A forked child makes its own."""
    settings = settings or TransferSettings()
    key = (settings, tuple(sorted(i for i in os.environ.items() if i[0].startswith("AWS_"))))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = S3Client(settings)
        return client


os.register_at_fork(after_in_child=_CLIENTS.clear)


class S3Client:
    """Every request muonckpt sends to S3, through one boto3 client (thread-safe; its
    connection pool sized for ``settings.concurrency``)."""

    def __init__(self, settings: TransferSettings | None = None) -> None:
        self.settings = settings or TransferSettings()
        self._part_checksums: dict[str, str] = {}
        """A multipart upload's checksum algorithm, declared when it starts and given with
        each part, as boto3's own managed upload does (the server then checks each part and
        combines their checksums at the completion rather than recomputing the object's);
        none where the AWS configuration asks for checksums only when required
        (``AWS_REQUEST_CHECKSUM_CALCULATION=when_required``: servers that refuse them)."""
        self._conditional_deletes: dict[str, bool] = {}
        """Per bucket, whether the server honours ``If-Match`` on DELETE (probed)."""
        boto3, botocore = _botocore()
        self._exceptions = importlib.import_module("botocore.exceptions")
        config = importlib.import_module("botocore.config").Config(
            retries={"total_max_attempts": 1, "mode": "standard"},  # ours alone retry
            max_pool_connections=max(10, 2 * self.settings.concurrency),
            connect_timeout=self.settings.connect_timeout,
            read_timeout=self.settings.read_timeout,
        )
        del botocore
        try:
            self._client: Any = boto3.session.Session().client("s3", config=config)
        except (self._exceptions.BotoCoreError, ValueError) as exc:  # a profile, an endpoint
            raise CheckpointError(
                "cannot make an S3 client of the AWS configuration (AWS_* environment, "
                f"~/.aws, profile): {type(exc).__name__}: {exc}"
            ) from None
        if getattr(self._client.meta.config, "request_checksum_calculation", None) != (
            "when_required"
        ):
            self._part_checksums = {"ChecksumAlgorithm": "CRC32"}

    # -- the one place requests are made ------------------------------------------------

    def _status(self, exc: BaseException) -> tuple[str, int]:
        response = getattr(exc, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code, status

    def _transient(self, exc: BaseException) -> bool:
        errors = self._exceptions
        if isinstance(exc, errors.ClientError):
            code, status = self._status(exc)
            return code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS
        return isinstance(
            exc,
            (errors.ConnectionError, errors.HTTPClientError, errors.ReadTimeoutError),
        )

    def _failure(self, what: str, url: S3Url, exc: BaseException, tries: int) -> CheckpointError:
        """The error of a request that failed for good: :class:`StoreUnreachable` where the
        place is at fault (:meth:`_unreachable`), else a :class:`CheckpointError` (an object
        missing, archived or corrupted in transit, a range it does not have, ...)."""
        errors = self._exceptions
        if isinstance(exc, errors.NoCredentialsError):
            why = "no AWS credentials were found (environment, ~/.aws, profile)"
        elif isinstance(exc, errors.ClientError):
            code, status = self._status(exc)
            message = exc.response.get("Error", {}).get("Message", "")
            why = f"{code or status}" + (f": {message}" if message else "")
        else:
            why = f"{type(exc).__name__}: {exc}"
        after = f" (after {tries} tries)" if tries > 1 else ""
        kind = StoreUnreachable if self._unreachable(exc) else CheckpointError
        return kind(f"cannot {what} {url}{after}: {why}")

    def _unreachable(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the place cannot be used, whatever object is asked for: no
        credentials, access denied to the caller (not an object's state: an archived
        object's 403 ``InvalidObjectState`` is the checkpoint's), no such bucket, or the
        server unreachable or failing (what :meth:`_transient` retried, still failing)."""
        errors = self._exceptions
        if isinstance(exc, (errors.NoCredentialsError, errors.PartialCredentialsError)):
            return True
        if isinstance(exc, errors.ClientError):
            code, status = self._status(exc)
            answerless = status in (401, 403) and code in ("", str(status), "Forbidden")
            return code in _PLACE_CODES or answerless or self._transient(exc)
        return self._transient(exc)  # connection refused, reset or timed out

    def _call(self, what: str, url: S3Url, request: Callable[[], T]) -> T:
        """``request()``, retried while it fails transiently, within the settings' bounds;
        a 412 raises :class:`PreconditionFailed`, anything else one ``CheckpointError``."""
        s = self.settings
        deadline = time.monotonic() + s.retry_seconds
        tries = 0
        while True:
            tries += 1
            try:
                return request()
            except Exception as exc:
                code, status = self._status(exc)
                if status == 412 or code == "PreconditionFailed":
                    raise PreconditionFailed(
                        f"cannot {what} {url}: its condition failed (HTTP 412)"
                    ) from None
                delay = random.uniform(0, min(s.backoff_cap, s.backoff_base * 2**tries))
                if (
                    not self._transient(exc)
                    or tries >= s.attempts
                    or time.monotonic() + delay > deadline
                ):
                    raise self._failure(what, url, exc, tries) from exc
            time.sleep(delay)

    def _missing(self, exc: CheckpointError) -> bool:
        """Whether ``exc`` says there is no such object (not: no such bucket, which a GET's
        answer tells apart; a HEAD's has no body to)."""
        cause = exc.__cause__
        if cause is None:
            return False
        code, status = self._status(cause)
        return status == 404 and code != "NoSuchBucket"

    # -- objects --------------------------------------------------------------------------

    def put(
        self,
        url: S3Url,
        data: bytes | bytearray | memoryview,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        """Write ``data`` as object ``url`` in one request: only when no object is there
        (``if_none_match``), or only over the one with etag ``if_match``. Returns the new
        etag; :class:`PreconditionFailed` when the condition fails."""
        extra: dict[str, str] = {}
        if if_none_match:
            extra["IfNoneMatch"] = "*"
        if if_match is not None:
            extra["IfMatch"] = if_match
        body = bytes(data)
        response = self._call(
            "write",
            url,
            lambda: self._client.put_object(Bucket=url.bucket, Key=url.key, Body=body, **extra),
        )
        return str(response["ETag"])

    def create(self, url: S3Url, data: bytes | bytearray | memoryview) -> str:
        """:meth:`put` only when no object is there (``If-None-Match: *``), of an object only
        this writer names (under its own save prefix): a 412 whose object holds exactly
        ``data`` is this write's own, its first answer lost and the retry refused. Returns
        the etag; :class:`PreconditionFailed` when another object is there."""
        try:
            return self.put(url, data, if_none_match=True)
        except PreconditionFailed:
            found = self.fetch(url, len(data) + 1)
            if found is None or found[0] != bytes(data):
                raise
            return found[1].etag

    def head(self, url: S3Url) -> ObjectInfo | None:
        """The object's size and etag; None when there is none."""
        try:
            response = self._call(
                "look up", url, lambda: self._client.head_object(Bucket=url.bucket, Key=url.key)
            )
        except CheckpointError as exc:
            if self._missing(exc):
                return None
            raise
        return ObjectInfo(
            int(response["ContentLength"]), str(response["ETag"]), _ns(response["LastModified"])
        )

    def fetch(self, url: S3Url, limit: int) -> tuple[bytes, ObjectInfo] | None:
        """The object's first ``limit`` bytes (all of it when it is smaller) with its whole
        size, etag and time, in one GET (a range past its end is answered with what there
        is); None when there is no object."""

        def request() -> tuple[bytes, ObjectInfo]:
            response = self._client.get_object(
                Bucket=url.bucket, Key=url.key, Range=f"bytes=0-{limit - 1}"
            )
            data: bytes = response["Body"].read()
            whole = str(response.get("ContentRange", "")).rpartition("/")[2]
            size = int(whole) if whole.isdigit() else len(data)
            return data, ObjectInfo(size, str(response["ETag"]), _ns(response["LastModified"]))

        try:
            return self._call("read", url, request)
        except CheckpointError as exc:
            if self._missing(exc):
                return None
            if exc.__cause__ is None or self._status(exc.__cause__)[1] != 416:
                raise
        info = self.head(url)  # an empty object: it has no byte 0 to range over
        return None if info is None else (b"", info)

    def get(
        self, url: S3Url, start: int = 0, end: int | None = None, *, if_match: str | None = None
    ) -> bytes | None:
        """Bytes ``[start, end)`` of the object (to its end when ``end`` is None), read by one
        ranged GET, only from the object with etag ``if_match`` when given
        (:class:`PreconditionFailed` otherwise); None when there is no object."""
        extra: dict[str, str] = {}
        if start or end is not None:
            extra["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if if_match is not None:
            extra["IfMatch"] = if_match

        def request() -> bytes:
            response = self._client.get_object(Bucket=url.bucket, Key=url.key, **extra)
            data: bytes = response["Body"].read()  # a dropped body is retried whole
            return data

        if end is not None and end <= start:
            return b""
        try:
            data = self._call("read", url, request)
        except CheckpointError as exc:
            if self._missing(exc):
                return None
            raise
        if end is not None and len(data) != end - start:
            raise CheckpointError(
                f"cannot read {url}: bytes {start}-{end} asked for, {len(data)} came back"
            )
        return data

    def read_into(self, url: S3Url, offset: int, out: memoryview, *, if_match: str) -> None:
        """Fill ``out`` with the object's bytes from ``offset``, in ranged GETs of at most
        one part each, ``settings.concurrency`` at a time (the read seam's S3 side)."""
        step = self.settings.part_size
        spans = [(s, min(s + step, len(out))) for s in range(0, len(out), step)]

        def one(span: tuple[int, int]) -> None:
            a, b = span
            data = self.get(url, offset + a, offset + b, if_match=if_match)
            if data is None:
                raise CheckpointError(f"cannot read {url}: it was deleted")
            out[a:b] = data

        if len(spans) <= 1:
            for span in spans:
                one(span)
            return
        with ThreadPoolExecutor(min(self.settings.concurrency, len(spans))) as pool:
            for future in [pool.submit(one, span) for span in spans]:
                future.result()

    def delete(self, url: S3Url, *, if_match: str | None = None) -> None:
        """Delete the object (none there is no error); only the one with etag ``if_match``
        when given."""
        extra = {"IfMatch": if_match} if if_match is not None else {}
        self._call(
            "delete",
            url,
            lambda: self._client.delete_object(Bucket=url.bucket, Key=url.key, **extra),
        )

    def honours_conditional_delete(self, probe: S3Url, body: bytes) -> bool:
        """Whether the server refuses a DELETE whose ``If-Match`` does not match (S3 does;
        some S3-compatible servers ignore the header and delete): probed once per bucket by
        this client, with object ``probe`` (holding ``body``) created, deleted with a wrong
        ``If-Match``, then deleted; the caller names it where what a failure leaves of it is
        known for its own."""
        known = self._conditional_deletes.get(probe.bucket)
        if known is None:
            self.create(probe, body)
            try:
                self.delete(probe, if_match='"0123456789abcdef0123456789abcdef"')
                known = self.head(probe) is not None  # (ignored: deleted anyway)
            except PreconditionFailed:
                known = True
            finally:
                self.delete(probe)
            self._conditional_deletes[probe.bucket] = known
        return known

    def delete_many(self, urls: Iterable[S3Url]) -> None:
        """Delete objects of one bucket, 1000 to a request; a key that could not be deleted
        raises, naming it."""
        by_bucket: dict[str, list[str]] = {}
        for url in urls:
            by_bucket.setdefault(url.bucket, []).append(url.key)
        for bucket, keys in by_bucket.items():
            for i in range(0, len(keys), 1000):
                batch = [{"Key": k} for k in keys[i : i + 1000]]
                response = self._call(
                    "delete",
                    S3Url(bucket, keys[i]),
                    functools.partial(
                        self._client.delete_objects,
                        Bucket=bucket,
                        Delete={"Objects": batch, "Quiet": True},
                    ),
                )
                for error in response.get("Errors", []):
                    raise CheckpointError(
                        f"cannot delete {S3Url(bucket, error['Key'])}: {error.get('Code')}"
                    )

    def listing(self, prefix: S3Url, *, delimiter: bool = False) -> tuple[list[str], list[str]]:
        """The keys under ``prefix`` (relative to it) and, with ``delimiter``, the names of
        the "directories" directly under it (without their ``/``), both sorted. One LIST per
        1000 keys."""
        keys: list[str] = []
        directories: list[str] = []
        base = prefix.prefix
        for page in self._pages(prefix, delimiter):
            keys += [o["Key"][len(base) :] for o in page.get("Contents", [])]
            directories += [p["Prefix"][len(base) : -1] for p in page.get("CommonPrefixes", [])]
        return sorted(keys), sorted(directories)

    def objects(self, prefix: S3Url) -> dict[str, ObjectInfo]:
        """The objects directly under ``prefix`` (not those under a further ``/``), by name
        relative to it, each with its size, etag and time. One LIST per 1000 keys."""
        base = prefix.prefix
        return {
            o["Key"][len(base) :]: ObjectInfo(
                int(o["Size"]), str(o["ETag"]), _ns(o["LastModified"])
            )
            for page in self._pages(prefix, True)
            for o in page.get("Contents", [])
        }

    def tree(self, prefix: S3Url) -> list[Listed]:
        """Every object under ``prefix``, however deep (its key relative to it, size and last
        change), sorted by key. One LIST per 1000 keys."""
        base = prefix.prefix
        found = (
            Listed(o["Key"][len(base) :], int(o["Size"]), o["LastModified"].timestamp())
            for page in self._pages(prefix, False)
            for o in page.get("Contents", [])
        )
        return sorted(found, key=_key_of)

    def _pages(self, prefix: S3Url, delimiter: bool) -> Iterator[dict[str, Any]]:
        """The pages of a LIST of the keys under ``prefix`` (with ``delimiter``: those directly
        under it, and its "directories")."""
        token: str | None = None
        while True:
            extra: dict[str, str] = {"Delimiter": "/"} if delimiter else {}
            if token is not None:
                extra["ContinuationToken"] = token
            page: dict[str, Any] = self._call(
                "list",
                prefix,
                functools.partial(
                    self._client.list_objects_v2,
                    Bucket=prefix.bucket,
                    Prefix=prefix.prefix,
                    **extra,
                ),
            )
            yield page
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def uploads(self, prefix: S3Url) -> list[Listed]:
        """The multipart uploads in progress under ``prefix``: each its key (relative to
        it), when it began and its id (:attr:`Listed.upload`; size 0)."""
        found: list[Listed] = []
        base = prefix.prefix
        markers: dict[str, str] = {}
        while True:
            page = self._call(
                "list the uploads under",
                prefix,
                functools.partial(
                    self._client.list_multipart_uploads,
                    Bucket=prefix.bucket,
                    Prefix=base,
                    **markers,
                ),
            )
            found += [
                Listed(u["Key"][len(base) :], 0, u["Initiated"].timestamp(), u["UploadId"])
                for u in page.get("Uploads", [])
            ]
            if not page.get("IsTruncated"):
                return found
            markers = {
                "KeyMarker": page["NextKeyMarker"],
                "UploadIdMarker": page["NextUploadIdMarker"],
            }

    # -- multipart ------------------------------------------------------------------------

    def upload(
        self, url: S3Url, chunks: Iterable[bytes | bytearray | memoryview], *, if_none_match: bool
    ) -> str:
        """Write the concatenation of ``chunks`` as object ``url``: one PUT when it fits in
        one part, else a multipart upload of ``settings.part_size`` parts, at most
        ``settings.concurrency`` in flight; completed only when no object is there
        (``if_none_match``). Any failure aborts the upload (no parts left behind) and raises.
        Returns the object's etag."""
        parts = _parts(chunks, self.settings.part_size)
        first = next(parts, b"")
        second = next(parts, None)
        if second is None:
            return self.create(url, first) if if_none_match else self.put(url, first)
        upload = self._call(
            "start an upload of",
            url,
            lambda: self._client.create_multipart_upload(
                Bucket=url.bucket, Key=url.key, **self._part_checksums
            ),
        )["UploadId"]
        try:
            done = self._send_parts(url, upload, _chain(first, second, parts))
            extra = {"IfNoneMatch": "*"} if if_none_match else {}
            response = self._call(
                "complete the upload of",
                url,
                lambda: self._client.complete_multipart_upload(
                    Bucket=url.bucket,
                    Key=url.key,
                    UploadId=upload,
                    MultipartUpload={"Parts": done},
                    **extra,
                ),
            )
        except BaseException:
            self._abort(url, upload)
            raise
        return str(response["ETag"])

    def _send_parts(self, url: S3Url, upload: str, parts: Iterator[bytes]) -> list[dict[str, Any]]:
        slots = threading.BoundedSemaphore(self.settings.concurrency)
        futures: list[Future[dict[str, Any]]] = []

        def send(number: int, body: bytes) -> dict[str, Any]:
            try:
                response = self._call(
                    f"upload part {number} of",
                    url,
                    lambda: self._client.upload_part(
                        Bucket=url.bucket,
                        Key=url.key,
                        UploadId=upload,
                        PartNumber=number,
                        Body=body,
                        **self._part_checksums,
                    ),
                )
                part = {"PartNumber": number, "ETag": response["ETag"]}
                if "ChecksumCRC32" in response:
                    part["ChecksumCRC32"] = response["ChecksumCRC32"]
                return part
            finally:
                slots.release()

        with ThreadPoolExecutor(self.settings.concurrency) as pool:
            try:
                for number, body in enumerate(parts, start=1):
                    slots.acquire()  # at most `concurrency` parts held: memory bounded
                    failed = next((f for f in futures if f.done() and f.exception()), None)
                    if failed is not None:
                        slots.release()
                        break
                    futures.append(pool.submit(send, number, body))
            finally:
                results = [f.result() for f in futures]  # the first failure raises
        return results

    def _abort(self, url: S3Url, upload: str) -> None:
        # The original failure is what the caller must see; `clean` aborts leftovers.
        with contextlib.suppress(CheckpointError):
            self.abort(url, upload)

    def abort(self, url: S3Url, upload: str) -> None:
        """Abort multipart upload ``upload`` of object ``url`` (its parts deleted)."""
        self._call(
            "abort the upload of",
            url,
            lambda: self._client.abort_multipart_upload(
                Bucket=url.bucket, Key=url.key, UploadId=upload
            ),
        )


def _ns(when: Any) -> int:
    """An S3 time (a ``datetime``) in nanoseconds since the epoch."""
    return int(when.timestamp()) * 1_000_000_000


def _parts(chunks: Iterable[bytes | bytearray | memoryview], size: int) -> Iterator[bytes]:
    """``chunks`` regrouped into ``size``-byte parts (the last one shorter); a chunk that is
    a part already (a file read a part at a time) is passed on as it is, not copied."""
    buffer = bytearray()
    for chunk in chunks:
        if not buffer and isinstance(chunk, bytes) and len(chunk) == size:
            yield chunk
            continue
        view = memoryview(chunk).cast("B")
        while len(view):
            take = min(size - len(buffer), len(view))
            buffer += view[:take]
            view = view[take:]
            if len(buffer) == size:
                yield bytes(buffer)
                buffer.clear()
    if buffer:
        yield bytes(buffer)


def _chain(first: bytes, second: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield second
    yield from rest
