"""Faults between storage/s3.py's client and the server (through tests/s3_proxy.py): a burst of
503 SlowDown and dropped connections are retried with backoff and the request succeeds; faults
past the bound fail in one line naming the object and the last error, within the time bound;
a multipart upload that fails is aborted (no parts left behind)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

from muonckpt.errors import CheckpointError, PreconditionFailed
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


def test_a_burst_of_faults_is_retried(s3_server: S3Server, s3_proxy: FaultProxy) -> None:
    client = S3Client(SETTINGS)
    url = S3Url(s3_server.bucket(), "ckpt/manifest.json")
    client.put(url, b"through the proxy")
    s3_proxy.inject(slow_downs=3)
    assert client.get(url) == b"through the proxy"
    s3_proxy.inject(slow_downs=2, drops=2)
    client.put(url, b"second")
    assert s3_proxy.injected == 7
    assert client.get(url) == b"second"


def test_faults_past_the_bound_fail_in_one_line(s3_server: S3Server, s3_proxy: FaultProxy) -> None:
    client = S3Client(SETTINGS)
    url = S3Url(s3_server.bucket(), "ckpt/rank-00000-of-00001.safetensors")
    s3_proxy.inject(slow_downs=100)
    began = time.monotonic()
    with pytest.raises(CheckpointError) as caught:
        client.put(url, b"x")
    message = str(caught.value)
    assert str(url) in message and "SlowDown" in message and "after 6 tries" in message
    assert "\n" not in message and time.monotonic() - began < 10
    assert s3_proxy.injected == 6


def test_a_failed_multipart_upload_is_aborted(s3_server: S3Server, s3_proxy: FaultProxy) -> None:
    one_at_a_time = dataclasses.replace(SETTINGS, concurrency=1)
    client = S3Client(one_at_a_time)
    bucket = s3_server.bucket()
    url = S3Url(bucket, "ckpt/s-0123456789abcdef/big")
    data = bytes(range(256)) * (12 << 12)  # 12 MiB: three parts
    s3_proxy.inject(slow_downs=2)  # retried: the upload goes through
    client.upload(url, [data], if_none_match=True)
    assert client.get(url) == data
    other = S3Url(bucket, "ckpt/s-0123456789abcdef/big2")

    def failing() -> Iterator[bytes]:
        yield data
        # One part at a time: the next part's every try fails, then the abort goes through.
        s3_proxy.inject(slow_downs=one_at_a_time.attempts)
        yield data

    with pytest.raises(CheckpointError, match=r"upload part \d+ of .*after 6 tries.*SlowDown"):
        client.upload(other, failing(), if_none_match=True)
    assert s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert client.head(other) is None


def test_a_commit_whose_answer_was_lost_is_still_ours(
    s3_server: S3Server, s3_proxy: FaultProxy
) -> None:
    """The manifest's conditional PUT reaches the server, which commits, and its answer is
    lost: the client retries, gets 412 (the object is there now: its own), and the store
    finds its own save prefix in the manifest: committed, its objects kept (taking the 412 for
    a lost race would delete the committed checkpoint's data)."""
    from muonckpt.storage.s3store import S3Store, data_prefix_of

    client = S3Client(SETTINGS)
    target = f"s3://{s3_server.bucket()}/step-3"
    store = S3Store(client)
    staging = store.create_staging(target, False)
    (staging / "rank-00000-of-00001.safetensors").write_bytes(b"data")
    store.put_text(
        staging / "manifest.json", '{"files": [],\n"format_version": 4,\n"kind": "per-rank"}'
    )
    s3_proxy.lose_answer_to = "step-3/manifest.json"
    refused: list[str] = []
    put = client.put

    def watched_put(url: S3Url, data: bytes, **condition: object) -> str:
        try:
            return put(url, data, **condition)  # type: ignore[arg-type]
        except PreconditionFailed:
            refused.append(url.name)
            raise

    client.put = watched_put  # type: ignore[method-assign]
    store.publish(staging, target)
    assert s3_proxy.lose_answer_to is None  # the answer was lost once
    assert refused == ["manifest.json"]  # the retry was refused: the server had committed
    url = S3Url.parse(target)
    raw = client.get(url.child("manifest.json"))
    assert raw is not None
    prefix = data_prefix_of(raw.decode())
    assert prefix and client.get(url.child(prefix + "rank-00000-of-00001.safetensors")) == b"data"


def test_a_commit_whose_outcome_cannot_be_told_keeps_its_objects(
    s3_server: S3Server, s3_proxy: FaultProxy
) -> None:
    """The manifest's PUT reaches the server, which commits, its answer is lost and the
    server is then away for longer than the retries last: whether the save committed cannot
    be told, so it fails saying so and keeps its objects, which the committed manifest names
    (deleting them would leave a committed checkpoint without its data)."""
    from muonckpt.storage.s3store import S3Store, data_prefix_of

    client = S3Client(dataclasses.replace(SETTINGS, attempts=3, retry_seconds=0.5))
    target = f"s3://{s3_server.bucket()}/step-4"
    store = S3Store(client)
    staging = store.create_staging(target, False)
    (staging / "rank-00000-of-00001.safetensors").write_bytes(b"data")
    store.put_text(
        staging / "manifest.json", '{"files": [],\n"format_version": 4,\n"kind": "per-rank"}'
    )
    s3_proxy.lose_answer_to, s3_proxy.away_after_loss = "step-4/manifest.json", 2.0
    with pytest.raises(CheckpointError, match="whether this save committed cannot be told"):
        store.publish(staging, target)
    time.sleep(max(0.0, s3_proxy.down_until - time.monotonic()))
    url = S3Url.parse(target)
    raw = client.get(url.child("manifest.json"))
    assert raw is not None
    prefix = data_prefix_of(raw.decode())
    assert prefix and client.get(url.child(prefix + "rank-00000-of-00001.safetensors")) == b"data"


def test_the_server_unreachable_for_a_while(s3_server: S3Server, s3_proxy: FaultProxy) -> None:
    """For 1.5 s every request's connection is closed unanswered (the proxy stays listening:
    not a refused connection): the retries' backoff carries the
    request past it (within their time bound); an outage past the bound fails in one line."""
    slow = dataclasses.replace(SETTINGS, attempts=20, backoff_base=0.2, backoff_cap=0.5)
    client = S3Client(slow)
    url = S3Url(s3_server.bucket(), "ckpt/manifest.json")
    client.put(url, b"before")
    s3_proxy.down_until = time.monotonic() + 1.5
    began = time.monotonic()
    client.put(url, b"after")
    assert time.monotonic() - began >= 1.0 and s3_proxy.injected >= 1
    assert client.get(url) == b"after"
    brief = dataclasses.replace(slow, retry_seconds=1.0)
    s3_proxy.down_until = time.monotonic() + 30
    with pytest.raises(CheckpointError, match=r"cannot read s3://.*ckpt/manifest\.json") as caught:
        S3Client(brief).get(url)
    assert "\n" not in str(caught.value)
    s3_proxy.down_until = 0.0
