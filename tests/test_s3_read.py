"""The read seam on S3: a safetensors file uploaded as an object reads through
``SafetensorsReader(url, source=ObjectSource(...))`` bitwise as the local file does (whole
tensors, element ranges, strided groups, checksums verified), and an object replaced after it
was opened reads as changed, never as a mix of two versions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from muonckpt.errors import CheckpointError
from muonckpt.format.manifest import unpack_checksums
from muonckpt.storage import SafetensorsReader
from muonckpt.storage.byte_source import HEAD_PREFETCH, ObjectSource
from muonckpt.storage.s3 import S3Client, S3Url, TransferSettings
from muonckpt.storage.safetensors_writer import write_safetensors

from .s3_server import S3Server

pytestmark = pytest.mark.dist

CHUNK = 64 << 10  # small checksum chunks, so that ranges cross several


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(52)
    return {
        "a": torch.randn(1000, 300, generator=g),  # 1.2 MB: past the prefetched head
        "b": torch.randn(77, generator=g).to(torch.bfloat16),
        "c": torch.arange(12, dtype=torch.int64),
        "empty": torch.empty(0, 3),
    }


def _upload(tmp_path: Path, server: S3Server) -> tuple[Path, S3Url, S3Client, dict[str, tuple]]:
    local = tmp_path / "rank-00000-of-00001.safetensors"
    records = write_safetensors(local, _tensors(), {"k": "v"}, chunk_bytes=CHUNK)
    sums = {k: unpack_checksums(r.digests) for k, r in records.items()}
    client = S3Client(TransferSettings(part_size=5 << 20, concurrency=4))
    url = S3Url(server.bucket(), "ckpt/s-0123456789abcdef/" + local.name)
    client.upload(url, [local.read_bytes()], if_none_match=True)
    return local, url, client, sums


def test_object_reads_bitwise_as_the_file(tmp_path: Path, s3_server: S3Server) -> None:
    local, url, client, sums = _upload(tmp_path, s3_server)
    with (
        SafetensorsReader(local) as disk,
        SafetensorsReader(str(url), source=ObjectSource(client, url)) as obj,
    ):
        assert obj.keys() == disk.keys() and obj.metadata == disk.metadata == {"k": "v"}
        assert local.stat().st_size > HEAD_PREFETCH
        for key in sorted(disk.keys()):
            assert obj.record(key) == disk.record(key)
            whole = obj.read_tensor(key, checksums=sums[key], chunk_bytes=CHUNK)
            assert torch.equal(whole.view(torch.uint8), disk.read_tensor(key).view(torch.uint8))
            obj.verify(key, sums[key], CHUNK)
        n = disk.record("a").numel
        for start, stop in [(0, 1), (5, n - 7), (n // 3, n // 3 + 40000), (n - 1, n)]:
            got = obj.read("a", start, stop, checksums=sums["a"], chunk_bytes=CHUNK)
            assert torch.equal(got, disk.read("a", start, stop))
        assert obj.changed() is None


def test_a_replaced_object_reads_as_changed(tmp_path: Path, s3_server: S3Server) -> None:
    local, url, client, _ = _upload(tmp_path, s3_server)
    reader = SafetensorsReader(str(url), source=ObjectSource(client, url))
    try:
        # (Other bytes: an object put again with the same bytes has the same etag, its MD5,
        # and reads on as the same object, which it is, byte for byte.)
        client.put(url, local.read_bytes()[:-1] + b"!")
        assert reader.changed() == "another object was put in its place"
        with pytest.raises(CheckpointError, match="another object was put in its place"):
            reader.read("a", 0, 200000)
        client.delete(url)
        assert reader.changed() == "it was deleted"
    finally:
        reader.close()
    with pytest.raises(CheckpointError, match="no such object"):
        ObjectSource(client, url)


def test_a_damaged_object_fails_its_checksum(tmp_path: Path, s3_server: S3Server) -> None:
    local, url, client, sums = _upload(tmp_path, s3_server)
    data = bytearray(local.read_bytes())
    offset = SafetensorsReader(local).record("a").offset + 300000
    data[offset] ^= 0xFF
    client.put(url, bytes(data))
    with (
        SafetensorsReader(str(url), source=ObjectSource(client, url)) as obj,
        pytest.raises(CheckpointError, match="checksum mismatch"),
    ):
        obj.read_tensor("a", checksums=sums["a"], chunk_bytes=CHUNK)
