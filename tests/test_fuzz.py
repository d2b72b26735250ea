"""Fuzzing the two parsers that read untrusted bytes: ``manifest.json`` and safetensors headers.

Manifest: a real manifest (single-process save) is mutated structurally (random JSON values at
random paths, deleted keys, values swapped in from elsewhere in the manifest, duplicated list
items) and textually (byte flips, truncation, inserted bytes). ``parse_manifest`` must return a
Manifest or raise CheckpointError; ``verify`` and ``load`` on a checkpoint holding the mutated
manifest may raise only MuonCkptError. A load that succeeds must restore the original state
tensors bit for bit, and exactly the hyperparameters the (mutated) manifest lists.

Safetensors: a small file is mutated in its length prefix (lies up to 2**64 - 1), its header
bytes (flips) and its header JSON (random values, huge shapes, offsets past EOF, negative or
non-int fields), or truncated. ``SafetensorsReader`` and ``read`` must raise only
CheckpointError, each case must finish within a second, and the reader must never ask torch for
a buffer larger than the file, whatever the header claims (every ``torch.empty`` it makes is
recorded). A checksummed read that succeeds must return exactly the bytes originally written.

Every example runs under a SIGALRM watchdog, so a hang fails the test instead of stalling it.
The bugs it found are fixed and kept as regression tests at the end.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import shutil
import signal
import struct
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import event as _event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import muonckpt
from muonckpt import CheckpointError, MuonCkptError, storage
from muonckpt.format.manifest import Manifest
from muonckpt.format.manifest_json import parse_manifest
from muonckpt.storage import safetensors_writer

from .fixture_model import build, initial_params, single_process_optimizer

EXAMPLES = 200
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run: a failure is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
HANG_LIMIT_S = 5
MEMORY_LIMIT = 50 << 20


def event(name: str) -> None:
    """Count an outcome (``--hypothesis-show-statistics``); a no-op outside a fuzz example."""
    if currently_in_test_context():
        _event(name)


@contextlib.contextmanager
def watchdog(seconds: int = HANG_LIMIT_S) -> Iterator[None]:
    """Fail (instead of hanging) if the block runs longer than ``seconds``."""

    def fire(signum: int, frame: object) -> None:
        raise AssertionError(f"hang: still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------------------------
# A real checkpoint, saved once per module.


@pytest.fixture(scope="module")
def original(tmp_path_factory, single_ckpt) -> dict[str, Any]:
    ckpt = single_ckpt(1)
    assert muonckpt.verify(ckpt) == []
    work = tmp_path_factory.mktemp("fuzz") / "work"
    shutil.copytree(ckpt, work)
    text = (ckpt / "manifest.json").read_text()
    state = single_process_optimizer(1).state_dict()  # what the checkpoint holds
    return {"dir": work, "text": text, "body": json.loads(text), "state": state}


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys / indices) into a JSON value, the root included."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)] + [value]
    return [value]


EDGE_INTS = [0, 1, -1, 2, 7, 8, 2**31, 2**32 - 1, 2**40, 2**53 + 1, 2**63, 2**64 - 1, 2**64]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from(EDGE_INTS + [-x for x in EDGE_INTS])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["", ".", "..", "../x", "a/b", "F32", "BF16", "per-rank", "consolidated"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
huge_shapes = st.sampled_from([[2**40, 2**40], [2**63], [2**64, 0], [2**20] * 6, [0, 2**70]])


def _resolve(body: Any, path: tuple) -> tuple[Any, Any] | None:
    """(container, key) of ``path`` in ``body``, or None if it no longer resolves."""
    node = body
    for step in path[:-1]:
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError):
            return None
    if not path:
        return None
    container, key = node, path[-1]
    if isinstance(container, dict) and key in container:
        return container, key
    if isinstance(container, list) and isinstance(key, int) and key < len(container):
        return container, key
    return None


@st.composite
def structural_mutation(draw, body: dict) -> tuple[dict, list[str]]:
    """A deep copy of ``body`` with 1-3 edits; also a log of the edits (for failure reports)."""
    body = copy.deepcopy(body)
    paths = _paths(body)
    leaves = _leaves(body)
    log = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "replace", "swap", "delete", "duplicate", "shape"]))
        if not path:  # the root itself
            body = draw(json_values)
            log.append(f"root := {body!r}")
            continue
        where = _resolve(body, path)
        if where is None:
            continue
        container, key = where
        if op == "replace":
            container[key] = draw(json_values)
        elif op == "swap":
            container[key] = copy.deepcopy(draw(st.sampled_from(leaves)))
        elif op == "shape":
            container[key] = draw(huge_shapes)
        elif op == "delete":
            del container[key]
        elif op == "duplicate" and isinstance(container, list):
            container.insert(key, copy.deepcopy(container[key]))
        log.append(f"{op} {list(path)} -> {container[key] if op != 'delete' else '-'}")
    return body, log


@st.composite
def text_mutation(draw, text: str) -> bytes:
    data = bytearray(text.encode())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "flip", "truncate", "insert", "delete"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[at] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8) | st.sampled_from([b"[" * 50]))
        else:
            del data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


def _check_parse(data: str | bytes) -> Manifest | None:
    try:
        with watchdog():
            manifest = parse_manifest(data, "x")
            manifest.coverage_problems()
    except CheckpointError:
        event("parse: CheckpointError")
        return None
    assert isinstance(manifest, Manifest)
    event("parse: Manifest")
    return manifest


def _normalized(value: Any) -> str:
    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return json.dumps(plain(value), sort_keys=True)


def _check_verify_and_load(original: dict, data: str | bytes) -> None:
    ckpt: Path = original["dir"]
    (ckpt / "manifest.json").write_bytes(data if isinstance(data, bytes) else data.encode())
    with watchdog():
        problems = muonckpt.verify(ckpt)
    assert isinstance(problems, list)
    assert all(isinstance(p, CheckpointError) for p in problems)
    opt = build(1, 1, initial_params())[0]
    try:
        with watchdog():
            muonckpt.load(opt, ckpt)
    except MuonCkptError as exc:
        event(f"load: {type(exc).__name__}")
        return
    event(f"load: succeeded ({'clean' if not problems else 'verify found problems'})")
    # The mutation was harmless to the data: every state tensor is restored bit for bit ...
    got, want = opt.state_dict(), original["state"]
    assert got["state"].keys() == want["state"].keys()
    for index, entries in want["state"].items():
        assert got["state"][index].keys() == entries.keys()
        for key, value in entries.items():
            assert got["state"][index][key].dtype == value.dtype
            assert torch.equal(got["state"][index][key], value), (index, key)
    # ... and the hyperparameters are exactly those the manifest lists (they are not checked).
    manifest = muonckpt.read_manifest(ckpt)
    if any(g.optimizer.get("converted_from") for g in manifest.groups):
        return  # a converted checkpoint loads into the target's own settings (by design)
    assert len(got["param_groups"]) == len(manifest.groups)
    for group, entry in zip(got["param_groups"], manifest.groups):
        settings_ = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        assert _normalized(settings_) == _normalized(entry.hyperparams)


def _restore(original: dict) -> None:
    (original["dir"] / "manifest.json").write_text(original["text"])


# ---------------------------------------------------------------------------------------------
# Manifest fuzzing.


def test_unmutated_manifest_round_trips(original):
    manifest = parse_manifest(original["text"], "x")
    assert manifest.to_json() == original["text"]
    _check_verify_and_load(original, original["text"])


@FUZZ
@given(data=st.data())
def test_structural_mutations_parse_or_raise_checkpoint_error(original, data):
    body, _ = data.draw(structural_mutation(original["body"]))
    text = json.dumps(body, indent=1)
    _check_parse(text)
    _check_parse(text.encode())


@FUZZ
@given(data=st.data())
def test_text_mutations_parse_or_raise_checkpoint_error(original, data):
    raw = data.draw(text_mutation(original["text"]))
    _check_parse(raw)
    with contextlib.suppress(UnicodeDecodeError):
        _check_parse(raw.decode())


@FUZZ
@given(data=st.data())
def test_structural_mutations_never_break_verify_or_load(original, data):
    body, log = data.draw(structural_mutation(original["body"]))
    try:
        _check_verify_and_load(original, json.dumps(body, indent=1))
    except AssertionError as exc:
        raise AssertionError(f"mutations {log}: {exc}") from exc
    finally:
        _restore(original)


@FUZZ
@given(data=st.data())
def test_text_mutations_never_break_verify_or_load(original, data):
    raw = data.draw(text_mutation(original["text"]))
    try:
        _check_verify_and_load(original, raw)
    finally:
        _restore(original)


# ---------------------------------------------------------------------------------------------
# Safetensors header fuzzing.

TENSORS = {
    "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b": torch.arange(5, dtype=torch.int64),
    "c": torch.ones(2, 3, dtype=torch.bfloat16),
    "empty": torch.empty(0, 4, dtype=torch.float16),
    "scalar": torch.tensor(7, dtype=torch.uint8),
}


@pytest.fixture(scope="module")
def st_file(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("st")
    path = root / "clean.safetensors"
    records = safetensors_writer.write_safetensors(
        path, TENSORS, {"format": "muonckpt"}, chunk_bytes=16
    )
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return {
        "raw": raw,
        "length": length,
        "header": json.loads(raw[8 : 8 + length]),
        "records": records,
        "target": root / "fuzzed.safetensors",
    }


def _encode(header: Any, data: bytes) -> bytes:
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data


@st.composite
def header_mutation(draw, clean: dict) -> bytes:
    raw, length = clean["raw"], clean["length"]
    data = raw[8 + length :]
    kind = draw(st.sampled_from(["prefix", "flip", "json", "json", "json", "truncate"]))
    if kind == "prefix":
        lie = draw(
            st.sampled_from([2**63, 2**64 - 1, 2**32, 100_000_001, 100_000_000, 0, 1])
            | st.integers(0, 2**64 - 1)
            | st.integers(max(0, length - 16), length + 16)
        )
        return struct.pack("<Q", lie) + raw[8:]
    if kind == "flip":
        out = bytearray(raw)
        for _ in range(draw(st.integers(1, 4))):
            out[draw(st.integers(0, 8 + length - 1))] ^= draw(st.integers(1, 255))
        return bytes(out)
    if kind == "truncate":
        return raw[: draw(st.integers(0, len(raw) - 1))]
    header = copy.deepcopy(clean["header"])
    key = draw(st.sampled_from(sorted(header)))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "new key"]))
    value = draw(
        json_values
        | huge_shapes
        | st.lists(st.integers(-(2**64), 2**64), min_size=2, max_size=2)
        | st.sampled_from([[0, 2**40], [len(data), len(data) + 48], [-48, 0], [48, 0], [0.0, 48]])
        | st.lists(st.floats() | st.text(max_size=2) | st.booleans(), max_size=3)
    )
    if field == "entry":
        header[key] = value
    elif field == "new key":
        header[draw(st.text(max_size=6))] = value
    elif isinstance(header[key], dict):
        header[key][field] = value
    return _encode(header, data)


def _read_everything(reader: storage.SafetensorsReader, clean: dict, data) -> None:
    keys = reader.keys()  # a list (the reader is not iterable)
    for key in keys:
        rec = reader.record(key)
        with contextlib.suppress(CheckpointError):
            reader.read(key)
        if rec.numel:
            lo = data.draw(st.integers(0, rec.numel))
            with contextlib.suppress(CheckpointError):
                reader.read(key, lo, data.draw(st.integers(lo, rec.numel)))
        original = clean["records"].get(key)
        if original is None:
            continue
        try:
            got = reader.read(key, checksums=original.checksums, chunk_bytes=original.chunk_bytes)
        except CheckpointError:
            continue
        # A checksummed read that succeeds returns exactly the bytes written for that key.
        written = TENSORS[key].reshape(-1).view(torch.uint8)
        assert torch.equal(got.view(torch.uint8), written), key


class _AllocationRecorder:
    """While :meth:`recording`, records the size of every ``torch.empty`` and of every header
    read of muonckpt.storage."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        empty, pread = torch.empty, storage.SafetensorsReader._pread

        def recorded_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
            dtype = kwargs.get("dtype", torch.float32)
            self.sizes.append(math.prod(int(a) for a in args) * dtype.itemsize)
            return empty(*args, **kwargs)

        def recorded_pread(
            reader: storage.SafetensorsReader, offset: int, n: int, what: str
        ) -> bytes:
            self.sizes.append(n)
            return pread(reader, offset, n, what)

        with (
            mock.patch.object(torch, "empty", recorded_empty),
            mock.patch.object(storage.SafetensorsReader, "_pread", recorded_pread),
        ):
            yield


@FUZZ
@given(data=st.data())
def test_lying_safetensors_headers_fail_fast_with_checkpoint_error(st_file, data):
    blob = data.draw(header_mutation(st_file))
    path: Path = st_file["target"]
    path.write_bytes(blob)
    recording = _AllocationRecorder()
    tracemalloc.start()
    try:
        with watchdog(), recording.recording():
            try:
                with storage.SafetensorsReader(path) as reader:
                    _read_everything(reader, st_file, data)
                event("reader: opened")
            except CheckpointError as exc:
                assert str(path) in str(exc)
                event("reader: CheckpointError")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_LIMIT, f"{peak} bytes traced"
    # Whatever the header claims, no buffer is larger than the file itself.
    assert max(recording.sizes, default=0) <= len(blob), recording.sizes


def test_huge_shape_header_is_refused_without_allocating(tmp_path):
    path = tmp_path / "huge.safetensors"
    header = {"x": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 2**82]}}
    path.write_bytes(_encode(header, b"\0" * 64))
    recording = _AllocationRecorder()
    with recording.recording(), pytest.raises(CheckpointError):
        storage.SafetensorsReader(path)
    assert max(recording.sizes) <= path.stat().st_size


@pytest.mark.parametrize("lie", [2**63, 2**64 - 1, 100_000_001])
def test_length_prefix_lie_is_refused_before_reading(tmp_path, lie):
    path = tmp_path / "lie.safetensors"
    path.write_bytes(struct.pack("<Q", lie) + b"{}      ")
    recording = _AllocationRecorder()
    with recording.recording(), pytest.raises(CheckpointError):
        storage.SafetensorsReader(path)
    assert recording.sizes == [8]  # the prefix itself, nothing the prefix asked for


# ---------------------------------------------------------------------------------------------
# Bugs this fuzzer found, fixed; kept as regression tests.


def test_deeply_nested_manifest_raises_checkpoint_error():
    with pytest.raises(CheckpointError):
        parse_manifest("[" * 100_000, "x")


@pytest.mark.parametrize(
    "step,message",
    [
        ("x", "expected an int, got 'x'"),
        (1.5, "expected an int, got 1.5"),
        (True, "expected an int, got True"),
        (None, "expected an int, got None"),
        (-1, "expected a non-negative int, got -1"),
    ],
)
def test_a_step_that_is_not_a_non_negative_int_is_refused(original, step, message):
    """A group's step that ``muonckpt inspect`` and load would read as a number is refused at
    parse time, naming the value (this case once passed whether it was refused or not)."""
    body = copy.deepcopy(original["body"])
    body["groups"][0]["hyperparams"]["step"] = step
    with pytest.raises(CheckpointError, match=re.escape(message)):
        parse_manifest(json.dumps(body), "x")


def test_verify_of_a_huge_lying_topology_does_not_hang(original):
    body = copy.deepcopy(original["body"])
    body["topology"]["dp"] = 10**12
    (original["dir"] / "manifest.json").write_text(json.dumps(body))
    try:
        with watchdog(1):  # short: the hang also fills memory with rank-file names
            problems = muonckpt.verify(original["dir"])
    finally:
        _restore(original)
    assert problems, "a topology of 10**12 ranks over one rank file verified clean"
    assert "topology" in str(problems[0]) and str(10**12) in str(problems[0])
