"""The S3 server the tests use, with the client alone (no muonckpt): its conditional writes
are what a commit on S3 relies on, so before any test measures muonckpt's commit, these show
that the server's conditional create and replace are atomic under concurrent requests (N
threads racing one key: exactly one wins, every other gets 412 Precondition Failed)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from .s3_server import S3Server

pytestmark = pytest.mark.dist

RACERS = 16
TRIALS = 5


def _race(server: S3Server, attempt: Any) -> Counter[str]:
    """Runs ``attempt(client, i)`` on RACERS threads released together; each outcome counted
    as the HTTP status it got (``"200"``, ``"412"``, ...)."""
    client = server.client(max_pool_connections=RACERS, retries={"max_attempts": 1})
    from botocore.exceptions import ClientError

    barrier = threading.Barrier(RACERS)
    outcomes: list[str] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        barrier.wait()
        try:
            attempt(client, i)
            status = "200"
        except ClientError as exc:
            status = str(exc.response["ResponseMetadata"]["HTTPStatusCode"])
        with lock:
            outcomes.append(status)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Counter(outcomes)


def test_conditional_create_is_atomic(s3_server: S3Server) -> None:
    """PutObject with ``If-None-Match: *``: one creator wins, the rest 412; the object holds
    the winner's bytes."""
    bucket = s3_server.bucket()
    client = s3_server.client()
    for trial in range(TRIALS):
        key = f"race/{trial}/manifest.json"

        def put(c: Any, i: int, key: str = key) -> None:
            c.put_object(Bucket=bucket, Key=key, Body=f"writer {i}".encode(), IfNoneMatch="*")

        assert _race(s3_server, put) == Counter({"200": 1, "412": RACERS - 1})
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read().startswith(b"writer ")


def test_conditional_replace_is_atomic(s3_server: S3Server) -> None:
    """PutObject with ``If-Match: <etag read>``: of N writers that read the same etag, one
    replaces the object, the rest 412."""
    bucket = s3_server.bucket()
    client = s3_server.client()
    for trial in range(TRIALS):
        key = f"race/{trial}/manifest.json"
        etag = client.put_object(Bucket=bucket, Key=key, Body=b"old")["ETag"]

        def replace(c: Any, i: int, key: str = key, etag: str = etag) -> None:
            c.put_object(Bucket=bucket, Key=key, Body=f"writer {i}".encode(), IfMatch=etag)

        assert _race(s3_server, replace) == Counter({"200": 1, "412": RACERS - 1})
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read() != b"old"


def test_conditional_multipart_complete_is_atomic(s3_server: S3Server) -> None:
    """CompleteMultipartUpload with ``If-None-Match: *``: of N uploads of one key, one
    completes, the rest 412 (then aborted, leaving no parts)."""
    bucket = s3_server.bucket()
    client = s3_server.client()
    key = "race/multipart/manifest.json"
    uploads = []
    for i in range(RACERS):
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        part = client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=f"writer {i}".encode()
        )
        uploads.append((upload, part["ETag"]))

    def complete(c: Any, i: int) -> None:
        upload, etag = uploads[i]
        c.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload,
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]},
            IfNoneMatch="*",
        )

    assert _race(s3_server, complete) == Counter({"200": 1, "412": RACERS - 1})
