"""muonckpt.storage: safetensors writing/reading, partial reads, checksums, damage detection."""

from __future__ import annotations

import inspect
import json
import math
import os
import struct
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from muonckpt import storage
from muonckpt.errors import CheckpointError, CheckpointWarning
from muonckpt.format.manifest import CHECKSUM_ALGORITHM
from muonckpt.layout.topology import Strided
from muonckpt.storage import (
    SafetensorsReader,
    TensorRecord,
    backend,
    byte_view,
    checksum_chunks,
    dtype_name,
    entries,
    read_text,
    torch_dtype,
)
from muonckpt.storage.durable import write_text_atomic
from muonckpt.storage.safetensors_writer import write_safetensors
from muonckpt.storage.transaction import retire, swap_in

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def sample() -> dict[str, torch.Tensor]:
    base = torch.randn(6, 10)
    return {
        "w.f32": torch.randn(3, 5),
        "w.bf16": torch.randn(4, 7).bfloat16(),
        "w.f16": torch.randn(9).half(),
        "w.f64": torch.randn(2, 2, 2, dtype=torch.float64),
        "i64": torch.arange(-5, 12),
        "i32": torch.arange(7, dtype=torch.int32),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.arange(200, 256, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "empty.bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        "noncontig.t": base.t(),
        "noncontig.slice": base[:, ::3],
    }


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b)


def test_dtype_names() -> None:
    for dt in DTYPES:
        assert torch_dtype(dtype_name(dt)) == dt
    assert torch_dtype("BF16") == torch.bfloat16
    with pytest.raises(CheckpointError):
        torch_dtype("F4")
    with pytest.raises(CheckpointError):
        dtype_name(torch.complex64)


def test_round_trip(tmp_path: Path) -> None:
    tensors = sample()
    path = tmp_path / "a.safetensors"
    records = write_safetensors(path, tensors, {"step": "7", "note": "ünïcode"}, chunk_bytes=16)
    assert set(records) == set(tensors)
    with SafetensorsReader(path) as r:
        assert r.keys() == sorted(tensors)
        assert r.metadata == {"step": "7", "note": "ünïcode"}
        for key, t in tensors.items():
            rec = records[key]
            assert isinstance(rec, TensorRecord)
            assert rec.dtype == dtype_name(t.dtype) and rec.shape == tuple(t.shape)
            assert rec.nbytes == t.numel() * t.element_size()
            assert len(rec.checksums) == math.ceil(rec.nbytes / 16)
            info = r.record(key)
            assert (info.offset, info.nbytes, info.shape) == (rec.offset, rec.nbytes, rec.shape)
            assert_same(r.read_tensor(key), t)
            assert_same(r.read_tensor(key, checksums=rec.checksums, chunk_bytes=16), t)
    assert records["empty"].checksums == ()


def test_records_point_at_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    t = torch.arange(1000, dtype=torch.int32)
    rec = write_safetensors(path, {"x": t, "a": torch.ones(3)}, chunk_bytes=1024)["x"]
    raw = path.read_bytes()
    data = raw[rec.offset : rec.offset + rec.nbytes]
    assert data == t.numpy().tobytes()
    # The checksums are what the format names them: XXH3-64 of each 1024-byte chunk, computed
    # here with xxhash itself rather than with the module's own helper.
    assert CHECKSUM_ALGORITHM == "xxh3-64"
    chunks = [data[i : i + 1024] for i in range(0, len(data), 1024)]
    assert rec.checksums == tuple(xxhash.xxh3_64_hexdigest(c) for c in chunks)
    assert len(rec.checksums) == 4 and rec.chunk_bytes == 1024
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert header_len % 8 == 0


def test_large_tensor_checksummed_on_worker(tmp_path: Path) -> None:
    t = torch.randn(1 << 19)  # 2 MiB: checksummed on the worker thread while written
    path = tmp_path / "big.safetensors"
    rec = write_safetensors(path, {"t": t}, chunk_bytes=1 << 16)["t"]
    assert rec.checksums == checksum_chunks(t.numpy(), 1 << 16)
    with SafetensorsReader(path) as r:
        assert_same(r.read_tensor("t", checksums=rec.checksums, chunk_bytes=1 << 16), t)


def test_safetensors_loads_ours(tmp_path: Path) -> None:
    tensors = sample()
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, tensors, {"format": "pt", "k": "v"})
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for key, t in tensors.items():
        assert_same(loaded[key], t)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "k": "v"}


def test_we_load_safetensors(tmp_path: Path) -> None:
    tensors = {k: v.contiguous() for k, v in sample().items()}
    path = tmp_path / "theirs.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "x": "1"})
    with SafetensorsReader(path) as r:
        assert r.metadata == {"format": "pt", "x": "1"}
        assert r.keys() == sorted(tensors)
        for key, t in tensors.items():
            assert_same(r.read_tensor(key), t)
            n = t.numel()
            assert_same(r.read(key, n // 3, n - n // 4), t.reshape(-1)[n // 3 : n - n // 4])


def test_no_metadata(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    write_safetensors(path, {"x": torch.ones(2)})
    with SafetensorsReader(path) as r:
        assert r.metadata == {}
    assert_same(load_file(path)["x"], torch.ones(2))


def test_partial_reads(tmp_path: Path) -> None:
    t = torch.randn(7, 13).bfloat16()
    path = tmp_path / "a.safetensors"
    rec = write_safetensors(path, {"t": t, "u": torch.arange(5)}, chunk_bytes=10)["t"]
    flat = t.reshape(-1)
    with SafetensorsReader(path) as r:
        for a, b in [(0, 0), (0, 1), (5, 5), (3, 40), (1, 91), (90, 91), (0, 91)]:
            assert_same(r.read("t", a, b), flat[a:b])
            assert_same(r.read("t", a, b, checksums=rec.checksums, chunk_bytes=10), flat[a:b])
        assert_same(r.read("t", 50), flat[50:])
        for a, b in [(-1, 3), (5, 4), (0, 92)]:
            with pytest.raises(CheckpointError, match="range"):
                r.read("t", a, b)
        with pytest.raises(CheckpointError, match="'nope'"):
            r.read("nope")
        with pytest.raises(CheckpointError, match=r"a\.safetensors"):
            r.record("nope")
        with pytest.raises(CheckpointError, match="checksums given"):
            r.read("t", 0, 3, checksums=rec.checksums[:-1], chunk_bytes=10)


def test_flipped_data_byte(tmp_path: Path) -> None:
    t = torch.arange(64, dtype=torch.float32)  # 256 bytes: 8 chunks of 32
    path = tmp_path / "a.safetensors"
    rec = write_safetensors(path, {"t": t}, chunk_bytes=32)["t"]
    raw = bytearray(path.read_bytes())
    raw[rec.offset + 100] ^= 0x01  # chunk 3 = elements 24..31
    path.write_bytes(bytes(raw))
    with SafetensorsReader(path) as r:
        # Untouched chunks still read, with or without checksums.
        assert_same(r.read("t", 0, 24, checksums=rec.checksums, chunk_bytes=32), t[:24])
        assert_same(r.read("t", 32, 64, checksums=rec.checksums, chunk_bytes=32), t[32:])
        # Any range touching chunk 3 fails.
        for a, b in [(24, 25), (20, 40), (31, 32), (0, 64)]:
            with pytest.raises(CheckpointError, match="checksum mismatch") as info:
                r.read("t", a, b, checksums=rec.checksums, chunk_bytes=32)
            assert info.value.param == "t" and "a.safetensors" in str(info.value)
        with pytest.raises(CheckpointError, match="chunk 3"):
            r.read_tensor("t", checksums=rec.checksums, chunk_bytes=32)
        # Without checksums the corruption goes unnoticed.
        assert not torch.equal(r.read("t"), t)


def write_raw(path: Path, header: object, data: bytes = b"", *, raw_header: bytes | None = None):
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def bad_files(tmp: Path) -> dict[str, Path]:
    good = tmp / "good.safetensors"
    write_safetensors(good, {"a": torch.arange(4, dtype=torch.int32), "b": torch.ones(2)})
    raw = good.read_bytes()
    ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    files = {}

    def add(name: str, header: object = None, data: bytes = b"\0" * 8, **kw) -> None:
        files[name] = write_raw(tmp / f"{name}.safetensors", header, data, **kw)

    (tmp / "short.safetensors").write_bytes(b"\x05\0\0")
    files["short"] = tmp / "short.safetensors"
    (tmp / "truncated.safetensors").write_bytes(raw[:-3])
    files["truncated"] = tmp / "truncated.safetensors"
    (tmp / "huge_len.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + raw[8:])
    files["huge_len"] = tmp / "huge_len.safetensors"
    (tmp / "len_past_end.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    files["len_past_end"] = tmp / "len_past_end.safetensors"
    flipped = bytearray(raw)
    flipped[8] ^= 0x20  # '{' -> '['
    (tmp / "flipped_header.safetensors").write_bytes(bytes(flipped))
    files["flipped_header"] = tmp / "flipped_header.safetensors"
    add("bad_json", raw_header=b'{"a": {"dtype": "F32",')
    add("bad_utf8", raw_header=b'{"\xff\xfe": 1}  ')
    add("not_object", [1, 2, 3])
    add("entry_not_object", {"a": 5})
    add("unknown_dtype", {"a": {**ok, "dtype": "Q7"}})
    add("negative_shape", {"a": {**ok, "shape": [-2]}})
    add("float_shape", {"a": {**ok, "shape": [2.0]}})
    add("bool_shape", {"a": {**ok, "shape": [True, 2]}})
    add("offsets_not_pair", {"a": {**ok, "data_offsets": [0]}})
    add("offsets_not_int", {"a": {**ok, "data_offsets": [0, "8"]}})
    add("offsets_reversed", {"a": {**ok, "data_offsets": [8, 0]}})
    add("size_mismatch", {"a": {**ok, "shape": [3]}})
    add("past_end", {"a": {**ok, "data_offsets": [4, 12]}})
    add("huge_shape", {"a": {**ok, "shape": [1 << 40, 1 << 40], "data_offsets": [0, 8]}})
    add("overlap", {"a": ok, "b": {**ok, "data_offsets": [4, 12]}}, b"\0" * 12)
    add("bad_metadata", {"__metadata__": {"k": 1}, "a": ok})
    add("metadata_not_dict", {"__metadata__": ["k"], "a": ok})
    entry = json.dumps(ok).encode()
    add("duplicate_key", raw_header=b'{"a": ' + entry + b', "a": ' + entry + b"}")
    add("deep_json", raw_header=b"[" * 100_000 + b"]" * 100_000)
    return files


REASONS = {
    "short": "shorter than",
    "truncated": "past the end",
    "huge_len": "limit",
    "len_past_end": "past the end",
    "flipped_header": "JSON",
    "bad_json": "JSON",
    "bad_utf8": "UTF-8",
    "not_object": "not an object",
    "entry_not_object": "not an object",
    "unknown_dtype": "unknown dtype",
    "negative_shape": "shape",
    "float_shape": "shape",
    "bool_shape": "shape",
    "offsets_not_pair": "data_offsets",
    "offsets_not_int": "data_offsets",
    "offsets_reversed": "data_offsets",
    "size_mismatch": "needs 12",
    "past_end": "past the end",
    "huge_shape": "needs",
    "overlap": "overlap",
    "bad_metadata": "__metadata__",
    "metadata_not_dict": "__metadata__",
    "duplicate_key": "duplicate key",
    "deep_json": "JSON",
}


def test_damaged_files_raise(tmp_path: Path) -> None:
    files = bad_files(tmp_path)
    assert set(files) == set(REASONS)
    for name, path in files.items():
        with pytest.raises(CheckpointError) as info:
            SafetensorsReader(path)
        message = str(info.value)
        assert path.name in message and REASONS[name] in message, (name, message)
        assert info.value.path == path, name


@pytest.mark.parametrize("window", [1, 3, 7, 64, 4 << 20])
def test_a_header_read_a_window_at_a_time_reads_as_a_whole(tmp_path, monkeypatch, window):
    """The reader takes a header in windows (a header of 300k tensors is 30 MB): wherever a
    window cuts (a key, a character of several UTF-8 bytes, a number, the metadata), the
    file reads as it does whole, without the full parse, and a damaged file is refused with
    the same message."""
    from muonckpt.storage import safetensors_header

    path = tmp_path / "t.safetensors"
    tensors = {
        "ä€𝄞.weight": make(torch.float32, (2, 3)),
        "b": make(torch.int8, (1234,)),
        "c" * 300: torch.zeros(0),
        "d": make(torch.bfloat16, (5, 1)),
    }
    metadata = {"format": "muonckpt", "note": "ü€ " * 500}
    written = write_safetensors(path, tensors, metadata)
    damaged = bad_files(tmp_path)
    refused = {}
    for name, bad in damaged.items():
        with pytest.raises(CheckpointError) as info:
            SafetensorsReader(bad)
        refused[name] = str(info.value)

    def whole(*args: object) -> None:
        raise AssertionError("a sound header was parsed whole")

    monkeypatch.setattr(safetensors_header, "HEADER_WINDOW", window)
    with monkeypatch.context() as patched:
        patched.setattr(SafetensorsReader, "_judge_header", whole)
        with SafetensorsReader(path) as reader:
            assert reader.metadata == metadata and reader.keys() == sorted(tensors)
            for key, tensor in tensors.items():
                record = reader.record(key)
                assert (record.dtype, record.shape, record.offset, record.nbytes) == (
                    written[key].dtype,
                    written[key].shape,
                    written[key].offset,
                    written[key].nbytes,
                )
                assert_same(reader.read_tensor(key), tensor)
    for name, bad in damaged.items():
        with pytest.raises(CheckpointError) as info:
            SafetensorsReader(bad)
        assert str(info.value) == refused[name], name


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"missing\.safetensors"):
        SafetensorsReader(tmp_path / "missing.safetensors")


def test_truncated_after_open(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    rec = write_safetensors(path, {"t": torch.arange(100, dtype=torch.int64)})["t"]
    with SafetensorsReader(path) as r:
        with open(path, "r+b") as f:
            f.truncate(rec.offset + 80)
        assert_same(r.read("t", 0, 10), torch.arange(10))
        with pytest.raises(CheckpointError, match="truncated") as info:
            r.read("t", 5, 20)
        assert "a.safetensors" in str(info.value)


def test_closed_reader(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    write_safetensors(path, {"t": torch.ones(3)})
    r = SafetensorsReader(path)
    r.close()
    r.close()
    with pytest.raises(CheckpointError, match="closed"):
        r.read("t")


def test_write_rejects_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    with pytest.raises(CheckpointError, match=r"a\.safetensors"):
        write_safetensors(path, {"c": torch.ones(2, dtype=torch.complex64)})
    with pytest.raises(CheckpointError):
        write_safetensors(path, {"x": torch.ones(2)}, {"k": 1})  # type: ignore[dict-item]
    with pytest.raises(CheckpointError):
        write_safetensors(path, {"__metadata__": torch.ones(2)})
    assert list(tmp_path.iterdir()) == []


def test_write_leaves_no_temp_files_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    write_safetensors(path, {"x": torch.ones(2)})
    write_safetensors(path, {"y": torch.zeros(3)})
    assert [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]
    with SafetensorsReader(path) as r:
        assert r.keys() == ["y"]


def test_write_error_is_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "no_such_dir" / "a.safetensors"
    with pytest.raises(CheckpointError, match=r"a\.safetensors"):
        write_safetensors(path, {"x": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"m\.json"):
        write_text_atomic(path.with_name("m.json"), "{}")


def test_write_cleans_up_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    path = tmp_path / "a.safetensors"
    with pytest.raises(CheckpointError, match="No space left"):
        write_safetensors(path, {"x": torch.ones(2)})
    with pytest.raises(CheckpointError, match="No space left"):
        write_text_atomic(tmp_path / "m.json", "{}")
    assert list(tmp_path.iterdir()) == []


def test_write_text_atomic(tmp_path: Path) -> None:
    path = tmp_path / "manifest.json"
    write_text_atomic(path, '{"a": "ü"}')
    assert path.read_text(encoding="utf-8") == '{"a": "ü"}'
    write_text_atomic(path, "second")
    assert path.read_text(encoding="utf-8") == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_checksum_chunks() -> None:
    data = bytes(range(10))
    assert len(checksum_chunks(data, 3)) == 4
    assert checksum_chunks(data[:0], 3) == ()
    assert checksum_chunks(data, 100) == checksum_chunks(bytearray(data), 100)
    assert checksum_chunks(data, 3) == checksum_chunks(np.arange(10, dtype=np.uint8), 3)
    assert checksum_chunks(data, 3)[:3] != checksum_chunks(bytes(range(1, 11)), 3)[:3]
    with pytest.raises(ValueError):
        checksum_chunks(data, 0)


@st.composite
def tensor_and_range(draw: st.DrawFn) -> tuple[torch.Tensor, int, int, int]:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    t = make(dtype, shape, seed=draw(st.integers(0, 1000)))
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)
    n = t.numel()
    a = draw(st.integers(0, n))
    b = draw(st.integers(a, n))
    chunk = draw(st.integers(1, 40))
    return t, a, b, chunk


@settings(max_examples=60, deadline=None)
@given(tensor_and_range())
def test_partial_read_property(case: tuple[torch.Tensor, int, int, int]) -> None:
    t, a, b, chunk = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.safetensors"
        rec = write_safetensors(
            path, {"pad": torch.ones(3, dtype=torch.int8), "t": t}, chunk_bytes=chunk
        )
        expected = t.reshape(-1)[a:b]
        with SafetensorsReader(path) as r:
            assert_same(r.read("t", a, b), expected)
            assert_same(
                r.read("t", a, b, checksums=rec["t"].checksums, chunk_bytes=chunk), expected
            )
            assert_same(r.read_tensor("t"), t)


def test_read_text(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    write_text_atomic(path, "ünï")
    assert read_text(path) == "ünï"
    path.write_bytes(b"\xff")
    with pytest.raises(CheckpointError, match=r"m\.json"):
        read_text(path)
    with pytest.raises(CheckpointError, match="nope"):
        read_text(tmp_path / "nope")


def test_swap_in(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    data = "rank-00000-of-00001.safetensors"  # retire deletes only a checkpoint's files
    for text in ["first", "second"]:
        staging = tmp_path / f".ckpt.staging-{text}"
        staging.mkdir()
        manifest = f'{{"format": "muonckpt", "text": "{text}"}}'
        write_text_atomic(staging / "manifest.json", manifest)
        (staging / data).write_text(text)
        replaced = swap_in(staging, final, overwrite=True)
        assert read_text(final / "manifest.json") == manifest
        if text == "first":
            assert replaced is None
        else:  # the old checkpoint, its manifest already gone, waits to be retired
            # with the lease this process holds until it is retired (clean leaves it alone)
            assert replaced is not None and entries(replaced) == [".muonckpt-lease", data]
            assert (replaced / data).read_text() == "first"
            retire(replaced, [data])
            assert entries(replaced) == [".muonckpt-lease"]
            retire(replaced)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_swap_in_failure_keeps_old(tmp_path: Path) -> None:
    final = tmp_path / "ckpt"
    final.mkdir()
    write_text_atomic(final / "manifest.json", "old")
    with pytest.raises(CheckpointError, match="ckpt"):
        swap_in(tmp_path / "missing", final)
    assert read_text(final / "manifest.json") == "old"


def test_the_posix_store_is_the_storage_seam(tmp_path: Path) -> None:
    """:class:`PosixStore` has every operation of :class:`CheckpointStore` with its parameters,
    is the store the checkpoint code writes through, and does each on real files: a staging
    directory holding its lease, durable writes, a publish that checks what it publishes and
    replaces a checkpoint, listing, and removing only muonckpt's own files; a URL other than
    ``s3://`` has no store."""
    operations = {
        name
        for name, member in vars(storage.CheckpointStore).items()
        if callable(member) and not name.startswith("_")
    }
    assert operations == {
        "create_staging",
        "put_text",
        "publish",
        "entries",
        "directories",
        "discard",
        "retire",
        "remove_checkpoint",
        "join_staging",
        "follow",
        "send",
        "sync_files",
        "watching",
    }
    store = backend.PosixStore()
    assert isinstance(storage.store_for(tmp_path), backend.PosixStore)
    for name in operations:
        wanted = list(inspect.signature(getattr(storage.CheckpointStore, name)).parameters.values())
        given = inspect.signature(getattr(store, name)).parameters.values()
        shape = [(p.name, p.kind, p.default) for p in given]
        assert shape == [(p.name, p.kind, p.default) for p in wanted[1:]], name

    final, data = tmp_path / "ckpt", "rank-00000-of-00001.safetensors"
    for step in (1, 2):
        staging = store.create_staging(final, overwrite=step == 2)
        assert staging.name.startswith(".ckpt.staging-")
        assert store.entries(staging) == [".muonckpt-lease"]
        assert store.put_text(staging / data, "x" * step) == step
        assert store.put_text(staging / "x.index.json", "{}", limit=1) == 2  # past it: none
        manifest = f'{{"format": "muonckpt", "step": {step}}}'
        size = store.put_text(staging / "manifest.json", manifest)
        assert store.entries(staging) == [".muonckpt-lease", "manifest.json", data]
        with pytest.raises(
            CheckpointError, match=f"not committed: .*{data} is {step} bytes, not 9"
        ):
            store.publish(staging, final, files={data: 9})
        replaced = store.publish(staging, final, files={data: step, "manifest.json": size})
        assert store.entries(final) == ["manifest.json", data]
        assert read_text(final / "manifest.json") == manifest
        if step == 1:
            assert replaced is None
        else:  # the old checkpoint aside, its manifest gone, its lease held until retired
            assert replaced is not None and store.entries(replaced) == [".muonckpt-lease", data]
            store.retire(replaced, [data])
            assert store.entries(replaced) == [".muonckpt-lease"]
            store.retire(replaced)
        assert store.entries(tmp_path) == ["ckpt"]

    staging = store.create_staging(tmp_path / "other", overwrite=False)
    (staging / "notes.txt").write_text("a user's")
    assert store.discard(staging, quiet=True) == ["notes.txt (not a checkpoint file: kept)"]
    assert store.entries(staging) == ["notes.txt"]
    (final / "README.md").write_text("a user's")
    with pytest.raises(CheckpointError, match="refusing to replace it"):
        store.create_staging(final, overwrite=True)
    with pytest.warns(CheckpointWarning, match="README.md"):
        assert store.remove_checkpoint(final) is False
    assert store.entries(final) == ["README.md"]
    (final / "README.md").unlink()
    (final / data).write_text("x")
    assert store.remove_checkpoint(final) is True and not final.exists()
    (tmp_path / "link").symlink_to(staging)
    assert store.directories(tmp_path) == [staging.name]  # no symlinks, no files
    assert store.directories(tmp_path / "missing") == []
    with pytest.raises(CheckpointError, match="not a directory of checkpoints"):
        store.directories(staging / "notes.txt")
    with pytest.raises(CheckpointError, match="URL, not a local path"):
        storage.store_for("gs://bucket/ckpt")
    assert type(storage.store_for("s3://bucket/ckpt")).__name__ == "S3Store"


@st.composite
def _strided_reads(draw: st.DrawFn) -> tuple[int, int, list[Strided]]:
    """A tensor of ``numel`` int16 elements, a checksum chunk size, and strided copy groups
    (each one's rows inside the tensor) placed one after another in the output."""
    numel = draw(st.integers(1, 300))
    chunk = draw(st.integers(1, 64))
    groups, dst = [], 0
    for _ in range(draw(st.integers(1, 4))):
        length = draw(st.integers(1, numel))
        count = draw(st.integers(1, 4))
        step = draw(st.integers(length, numel)) if count > 1 else 0
        last_src = numel - length - (count - 1) * step
        if last_src < 0:
            count, step, last_src = 1, 0, numel - length
        src = draw(st.integers(0, last_src))
        groups.append(Strided(src, dst, length, count, step, length))
        dst += length * count
    return numel, chunk, groups


@settings(max_examples=150, deadline=None)
@given(_strided_reads(), st.booleans(), st.sampled_from([1, 1 << 16]), st.randoms())
def test_read_groups_places_rows_and_verifies(case, corrupt, direct_bytes, rnd) -> None:
    """Every group placed and verified; with ``direct_bytes`` 1 every single run longer than
    a chunk is read straight into the output, with its partly needed end chunks through the
    scratch buffer."""
    numel, chunk, groups = case
    data = torch.randint(-(2**15), 2**15, (numel,), dtype=torch.int16)
    expected = torch.cat([data[r.src : r.src + r.length] for g in groups for r in g.runs()])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        rec = write_safetensors(path, {"t": data}, chunk_bytes=chunk)["t"]
        if corrupt:
            # Flip a byte some group reads (a run's first or last chunk, or one between,
            # read straight into the output): the verified read must refuse it.
            read = [e for g in groups for r in g.runs() for e in range(r.src, r.src + r.length)]
            raw = bytearray(path.read_bytes())
            raw[rec.offset + rnd.choice(read) * 2 + rnd.randrange(2)] ^= 0xFF
            path.write_bytes(bytes(raw))
        out = torch.zeros(len(expected), dtype=torch.int16)
        with (
            SafetensorsReader(path) as r,
            mock.patch.object(storage.safetensors_reader, "_DIRECT_BYTES", direct_bytes),
        ):
            if corrupt:
                with pytest.raises(CheckpointError, match="checksum mismatch in chunk"):
                    r.read_groups(
                        "t", byte_view(out), groups, checksums=rec.checksums, chunk_bytes=chunk
                    )
                return
            r.read_groups("t", byte_view(out), groups, checksums=rec.checksums, chunk_bytes=chunk)
            assert torch.equal(out, expected)
            out.zero_()
            r.read_groups("t", byte_view(out), groups)  # unverified: the same bytes
            assert torch.equal(out, expected)


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(0, 400),
    chunk=st.integers(1, 64),
    window=st.integers(1, 200),
    victim=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_verify_checks_every_chunk_window_by_window(numel, chunk, window, victim) -> None:
    data = torch.randint(-(2**15), 2**15, (numel,), dtype=torch.int16)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        rec = write_safetensors(path, {"t": data}, chunk_bytes=chunk)["t"]
        corrupt = victim is not None and rec.nbytes > 0
        if corrupt:
            raw = bytearray(path.read_bytes())
            raw[rec.offset + victim % rec.nbytes] ^= 0xFF
            path.write_bytes(bytes(raw))
        with (
            SafetensorsReader(path) as r,
            mock.patch.object(storage.safetensors_reader, "_VERIFY_WINDOW", window),
        ):
            if corrupt:
                bad = victim % rec.nbytes // chunk
                with pytest.raises(CheckpointError, match=f"checksum mismatch in chunk {bad} "):
                    r.verify("t", rec.checksums, chunk)
            else:
                r.verify("t", rec.checksums, chunk)
            with pytest.raises(CheckpointError, match="checksums given"):
                r.verify("t", (*rec.checksums, "0" * 16), chunk)


def test_read_groups_refuses_groups_outside_tensor_or_output(tmp_path: Path) -> None:
    data = torch.arange(100, dtype=torch.int16)
    write_safetensors(tmp_path / "t.safetensors", {"t": data})
    out = torch.zeros(10, dtype=torch.int16)
    with SafetensorsReader(tmp_path / "t.safetensors") as r:
        for bad in (
            Strided(95, 0, 10, 1, 0, 0),  # past the tensor
            Strided(0, 5, 10, 1, 0, 0),  # past the output
            Strided(0, 0, 2, 3, 50, 2),  # third row past the tensor
            Strided(-1, 0, 2, 1, 0, 0),
        ):
            with pytest.raises(CheckpointError, match="outside the tensor"):
                r.read_groups("t", byte_view(out), [bad])
        r.read_groups("t", byte_view(out), [Strided(1, 0, 2, 5, 20, 2)])
    assert torch.equal(out, torch.tensor([1, 2, 21, 22, 41, 42, 61, 62, 81, 82], dtype=torch.int16))


def test_read_of_a_file_truncated_after_open_raises(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"t": torch.arange(1000, dtype=torch.int32)})
    with SafetensorsReader(path) as r:
        os.truncate(path, path.stat().st_size - 100)
        with pytest.raises(CheckpointError, match="file truncated"):
            r.read("t")


def test_a_new_file_is_made_as_open_makes_one(tmp_path: Path) -> None:
    """(issue 51 review) Files the formats write through ``storage.access.new_file`` get the
    mode ``open()`` gives (0o666 less the umask), not an executable 0o777: DCP's and
    Megatron's outputs were 0755 when the DCP writer went through the storage seam."""
    from muonckpt.storage import access

    with access.new_file(tmp_path / "new") as f:
        f.write(b"x")
    (tmp_path / "plain").write_bytes(b"x")
    assert (tmp_path / "new").stat().st_mode == (tmp_path / "plain").stat().st_mode
