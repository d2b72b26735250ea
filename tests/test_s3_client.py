"""storage/s3.py's client against the real server (tests/s3_server.py): conditional writes,
ranged reads, bounded multipart uploads (aborted on failure), listing, deletion, and the
one-line errors for a missing bucket or missing credentials."""

from __future__ import annotations

import os

import pytest

from muonckpt.errors import CheckpointError, PreconditionFailed
from muonckpt.storage.s3 import (
    S3Client,
    S3Url,
    TransferSettings,
    _parts,
    is_s3_url,
)

from .s3_server import S3Server

pytestmark = pytest.mark.dist

MIB = 1 << 20
SMALL_PARTS = TransferSettings(part_size=5 * MIB, concurrency=2, attempts=2, retry_seconds=5.0)


def _payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed) % 251 for i in range(256)) * (n // 256) + b"x" * (n % 256)


def test_urls_parse_and_refuse() -> None:
    url = S3Url.parse("s3://my-bucket/runs/a/step-10/")
    assert (url.bucket, url.key, url.name, url.prefix) == (
        "my-bucket",
        "runs/a/step-10",
        "step-10",
        "runs/a/step-10/",
    )
    assert str(url.child("manifest.json")) == "s3://my-bucket/runs/a/step-10/manifest.json"
    assert S3Url.parse("s3://my-bucket").prefix == ""
    assert is_s3_url("s3://b/x") and not is_s3_url("/tmp/x")
    bad_urls = ("s3://A_B/x", "s3://b", "s3://bucket/a//b", "s3://bucket//b", "s3://bucket/a/../b")
    for bad in (*bad_urls, "gs://b/x"):
        with pytest.raises(CheckpointError):
            S3Url.parse(bad)


def test_parts_regroup_chunks_exactly() -> None:
    chunks = [b"a" * 3, b"b" * 10, memoryview(b"c" * 4), bytearray(b"d")]
    parts = list(_parts(chunks, 5))
    assert [len(p) for p in parts] == [5, 5, 5, 3]
    assert b"".join(parts) == b"".join(bytes(c) for c in chunks)


def test_conditional_put_head_get(s3_server: S3Server) -> None:
    client = S3Client(SMALL_PARTS)
    url = S3Url(s3_server.bucket(), "ckpt/manifest.json")
    assert client.head(url) is None
    assert client.get(url) is None
    etag = client.put(url, b"first", if_none_match=True)
    with pytest.raises(PreconditionFailed, match=r"manifest\.json"):
        client.put(url, b"second", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        client.put(url, b"second", if_match='"0123456789abcdef0123456789abcdef"')
    info = client.head(url)
    assert info is not None and (info.size, info.etag) == (5, etag)
    assert client.get(url) == b"first"
    assert client.get(url, 1, 4) == b"irs"
    new = client.put(url, b"second", if_match=etag)
    with pytest.raises(PreconditionFailed):  # the etag read before is spent
        client.put(url, b"third", if_match=etag)
    with pytest.raises(PreconditionFailed):  # a read pinned to the old object
        client.get(url, 0, 2, if_match=etag)
    assert client.get(url, 0, 2, if_match=new) == b"se"
    with pytest.raises(PreconditionFailed):
        client.delete(url, if_match=etag)
    client.delete(url, if_match=new)
    assert client.head(url) is None


def test_multipart_upload_and_ranged_read_into(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = S3Client(SMALL_PARTS)
    bucket = s3_server.bucket()
    url = S3Url(bucket, "ckpt/s-0123456789abcdef/rank-00000-of-00001.safetensors")
    data = _payload(12 * MIB + 17)
    chunks = [data[i : i + 3 * MIB + 1] for i in range(0, len(data), 3 * MIB + 1)]
    etag = client.upload(url, chunks, if_none_match=True)
    assert "-3" in etag  # a multipart etag: 3 parts of 5 MiB, 5 MiB, 2 MiB + 17
    held = s3_server.client().head_object(Bucket=bucket, Key=url.key, ChecksumMode="ENABLED")
    assert "ChecksumCRC32" in held, held  # declared, each part checked by the server
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")  # (not declared)
    S3Client(SMALL_PARTS).upload(url.parent.child("plain"), chunks, if_none_match=True)
    plain = s3_server.client().head_object(
        Bucket=bucket, Key=url.parent.child("plain").key, ChecksumMode="ENABLED"
    )
    assert "ChecksumCRC32" not in plain
    monkeypatch.delenv("AWS_REQUEST_CHECKSUM_CALCULATION")
    out = bytearray(len(data) - 100)
    client.read_into(url, 50, memoryview(out), if_match=etag)
    assert out == data[50:-50]
    # A second upload of the key, conditional: refused, and its parts aborted.
    with pytest.raises(PreconditionFailed):
        client.upload(url, [data], if_none_match=True)
    raw = s3_server.client()
    assert raw.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    # A small one is one PUT.
    small = S3Url(bucket, "ckpt/small")
    client.upload(small, [b"ab", b"c"], if_none_match=True)
    assert client.get(small) == b"abc"


def test_listing_and_delete_many(s3_server: S3Server) -> None:
    client = S3Client(SMALL_PARTS)
    bucket = s3_server.bucket()
    root = S3Url(bucket, "runs")
    names = ["step-1/manifest.json", "step-1/s-a/x", "step-2/manifest.json", "top"]
    for n in names:
        client.put(root.child(n), b"1")
    client.put(S3Url(bucket, "runsX/other"), b"1")  # shares the text, not the prefix
    keys, directories = client.listing(root, delimiter=True)
    assert (keys, directories) == (["top"], ["step-1", "step-2"])
    assert client.listing(root)[0] == sorted(names)
    client.delete_many(root.child(n) for n in names)
    assert client.listing(root) == ([], [])
    assert client.listing(S3Url(bucket, "runsX"))[0] == ["other"]


def test_missing_bucket_and_credentials_are_one_line(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = S3Url("no-such-bucket-muonckpt", "ckpt/manifest.json")
    with pytest.raises(CheckpointError) as caught:
        S3Client(SMALL_PARTS).put(url, b"x")
    message = str(caught.value)
    assert "NoSuchBucket" in message and str(url) in message and "\n" not in message
    bucket = s3_server.bucket()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    assert "AWS_ACCESS_KEY_ID" not in os.environ
    with pytest.raises(CheckpointError, match="no AWS credentials") as caught:
        S3Client(SMALL_PARTS).head(S3Url(bucket, "x"))
    assert "\n" not in str(caught.value)
