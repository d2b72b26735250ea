"""Faults between storage/s3.py's client and the server (through tests/s3_proxy.py): a burst of
503 SlowDown and dropped connections are retried with backoff and the request succeeds; faults
past the bound fail in one line naming the object and the last error, within the time bound;
a multipart upload that fails is aborted (no parts left behind)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

from muonckpt.errors import CheckpointError
from muonckpt.storage.s3 import S3Client, S3Url, TransferSettings

from .s3_proxy import FaultProxy
from .s3_server import S3Server

pytestmark = pytest.mark.dist

SETTINGS = TransferSettings(
    part_size=5 << 20,
    concurrency=2,
    attempts=6,
    retry_seconds=20.0,
    backoff_base=0.01,
    backoff_cap=0.05,
    read_timeout=10.0,
)


@pytest.fixture
def proxy(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        yield proxy
    finally:
        proxy.close()


def test_a_burst_of_faults_is_retried(s3_server: S3Server, proxy: FaultProxy) -> None:
    client = S3Client(SETTINGS)
    url = S3Url(s3_server.bucket(), "ckpt/manifest.json")
    client.put(url, b"through the proxy")
    proxy.inject(slow_downs=3)
    assert client.get(url) == b"through the proxy"
    proxy.inject(slow_downs=2, drops=2)
    client.put(url, b"second")
    assert proxy.injected == 7
    assert client.get(url) == b"second"


def test_faults_past_the_bound_fail_in_one_line(s3_server: S3Server, proxy: FaultProxy) -> None:
    client = S3Client(SETTINGS)
    url = S3Url(s3_server.bucket(), "ckpt/rank-00000-of-00001.safetensors")
    proxy.inject(slow_downs=100)
    began = time.monotonic()
    with pytest.raises(CheckpointError) as caught:
        client.put(url, b"x")
    message = str(caught.value)
    assert str(url) in message and "SlowDown" in message and "after 6 tries" in message
    assert "\n" not in message and time.monotonic() - began < 10
    assert proxy.injected == 6


def test_a_failed_multipart_upload_is_aborted(s3_server: S3Server, proxy: FaultProxy) -> None:
    one_at_a_time = dataclasses.replace(SETTINGS, concurrency=1)
    client = S3Client(one_at_a_time)
    bucket = s3_server.bucket()
    url = S3Url(bucket, "ckpt/s-0123456789abcdef/big")
    data = bytes(range(256)) * (12 << 12)  # 12 MiB: three parts
    proxy.inject(slow_downs=2)  # retried: the upload goes through
    client.upload(url, [data], if_none_match=True)
    assert client.get(url) == data
    other = S3Url(bucket, "ckpt/s-0123456789abcdef/big2")

    def failing() -> Iterator[bytes]:
        yield data
        # One part at a time: the next part's every try fails, then the abort goes through.
        proxy.inject(slow_downs=one_at_a_time.attempts)
        yield data

    with pytest.raises(CheckpointError, match=r"upload part \d+ of .*after 6 tries.*SlowDown"):
        client.upload(other, failing(), if_none_match=True)
    assert s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert client.head(other) is None
