"""Untrusted DCP input is bounded (issue 30, items 5, 6, 8 and 12): hostile DCP directories
made from a real ``torch.distributed.checkpoint.save``, then edited as an attacker or an
accident would, through the real command line and the Python API.

A stored chunk that is a stride-0 expansion (declared 4 TiB, or padded to its declared bytes),
two items sharing bytes; a ``.distcp`` that is a FIFO, a symlink to one, or a symlink out of
the directory; ``.metadata`` fields of the real classes with values of the wrong type or out
of range (a sweep: every field muonckpt uses times a dozen wrong values); settings that are
tensors or nested lists; a directory without ``.metadata``. Each is one ``error:`` line (exit
code 2) or one :class:`MuonCkptError`, naming the file, and nothing is written.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from muonckpt import MuonCkptError, interop

from . import dcp_cases
from .conftest import REPO

ADAM = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
DATA = "__0_0.distcp"


@pytest.fixture
def saved(tmp_path) -> Path:
    """A real single-process DCP save (torch's recipe layout) of a Muon matrix ``w`` (6 x 4)
    and an AdamW vector ``b``, all in one ``.distcp``."""
    src = tmp_path / "dcp"
    dcp_cases.single_process_dcp(src, "momentum_buffer", "momentum", {}, ADAM)
    assert sorted(p.name for p in src.iterdir()) == [".metadata", DATA]
    return src


def _metadata(src: Path) -> Any:
    return pickle.loads((src / ".metadata").read_bytes())  # our own file: plain pickle


def _write_metadata(src: Path, metadata: Any) -> None:
    (src / ".metadata").write_bytes(pickle.dumps(metadata))


def _storage_key(metadata: Any, fqn: str) -> MetadataIndex:
    (key,) = [k for k in metadata.storage_data if k.fqn == fqn]
    return key


def _store(src: Path, metadata: Any, fqn: str, tensor: torch.Tensor) -> None:
    """Append ``torch.save(tensor)`` (its storage as it is) to the data file and point
    ``fqn``'s one chunk there, declaring the tensor's shape: a chunk edited in place."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    data = buffer.getvalue()
    start = (src / DATA).stat().st_size
    with open(src / DATA, "ab") as f:
        f.write(data)
    item = metadata.state_dict_metadata[fqn]
    item.size = torch.Size(tensor.shape)
    item.chunks = [ChunkStorageMetadata(torch.Size([0] * tensor.dim()), torch.Size(tensor.shape))]
    del metadata.storage_data[_storage_key(metadata, fqn)]
    key = MetadataIndex(fqn, [0] * tensor.dim(), 0)
    metadata.storage_data[key] = _StorageInfo(DATA, start, len(data))


def _cli(src: Path, out: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    argv = ["convert", str(src), "-o", str(out), "--from", "torch", "--to", "packaged"]
    return subprocess.run(
        [sys.executable, "-m", "muonckpt.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def _one_error_line(done: subprocess.CompletedProcess[str], *words: str) -> str:
    """The run's one ``error:`` line (exit code 2, no traceback), holding ``words``."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _refused(src: Path, out: Path, *words: str) -> str:
    """The API's refusal: one line, a MuonCkptError holding ``words``; nothing written."""
    with pytest.raises(MuonCkptError) as caught:
        interop.from_dcp(src, out, source="torch", to="packaged")
    message = str(caught.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)
    assert not out.exists()
    return message


@pytest.mark.dist
def test_a_stride_0_chunk_declared_at_4_tib_is_refused_before_anything_is_read(saved, tmp_path):
    """A 4 TiB tensor whose stored chunk is one float expanded: refused from the metadata (its
    storage entry holds a few hundred bytes), never built; before, an allocator traceback."""
    metadata = _metadata(saved)
    n = 1 << 20
    for fqn in ("model.w", "optimizer.state.w.momentum_buffer"):
        _store(saved, metadata, fqn, torch.zeros(1).expand(n, n))
    _write_metadata(saved, metadata)
    assert sum(p.stat().st_size for p in saved.iterdir()) < 64 * 1024
    words = ("'model.w'", "sizes [1048576, 1048576] need 4398046511104 bytes", ".metadata")
    _refused(saved, tmp_path / "api", *words)
    _one_error_line(_cli(saved, tmp_path / "cli"), *words)
    assert not (tmp_path / "cli").exists()


DENSE = "not a dense tensor of exactly its 262144 bytes"


@pytest.mark.dist
@pytest.mark.parametrize(
    "stored,words",
    [
        (torch.ones(256 * 256)[:1].expand(256, 256), ("strides [0, 0] from element 0", DENSE)),
        (torch.ones(512, 256)[:256], ("strides [256, 1] from element 0 of 524288 bytes", DENSE)),
        (torch.ones(256, 256).to_sparse(), ("a chunk is a torch.sparse_coo tensor",)),
    ],
    ids=["stride-0", "view-into-more", "sparse"],
)
def test_a_chunk_not_stored_as_exactly_its_dense_bytes_is_refused(saved, tmp_path, stored, words):
    """A chunk whose stored bytes pass the metadata's bound but that is, read, a stride-0
    expansion of one float (over a storage of the declared size), a view into twice its bytes
    or a sparse tensor: refused naming the data file, nothing written (before: converted, the
    expansion as a tensor of one repeated value; the sparse one a NotImplementedError)."""
    metadata = _metadata(saved)
    for fqn in ("model.w", "optimizer.state.w.momentum_buffer"):
        _store(saved, metadata, fqn, stored)
    _write_metadata(saved, metadata)
    words = (*words, DATA)
    _refused(saved, tmp_path / "api", *words)
    _one_error_line(_cli(saved, tmp_path / "cli"), *words)
    assert not (tmp_path / "cli").exists()


def test_two_items_stored_in_the_same_bytes_are_refused(saved, tmp_path):
    """Output never exceeds input: the momentum pointed at the param's bytes (each item read
    twice from one range) is refused naming both; before, converted."""
    metadata = _metadata(saved)
    info = metadata.storage_data[_storage_key(metadata, "model.w")]
    metadata.storage_data[_storage_key(metadata, "optimizer.state.w.momentum_buffer")] = info
    _write_metadata(saved, metadata)
    _refused(saved, tmp_path / "out", "'model.w'", "'optimizer.state.w.momentum_buffer'", DATA)


def _fifo(src: Path, name: str) -> Path:
    path = src / name
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


@pytest.mark.dist
def test_a_fifo_distcp_or_a_symlink_to_one_is_refused_never_blocks(saved, tmp_path):
    """The data file a FIFO, then a symlink to a FIFO outside, then a symlink to a copy of the
    real file outside the directory: each refused at once, one line (before: the first two
    blocked ``convert --from`` forever, the timeout here; the third was read)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(saved / DATA, outside / "copy.distcp")
    os.mkfifo(outside / "fifo")
    cases = [
        (lambda: _fifo(saved, DATA), "not a regular file"),
        (lambda: (saved / DATA).symlink_to(outside / "fifo"), "a symlink"),
        (lambda: (saved / DATA).symlink_to(outside / "copy.distcp"), "a symlink"),
    ]
    for n, (make, why) in enumerate(cases):
        (saved / DATA).unlink()
        make()
        # the command line first, under its timeout: a read that blocks fails there
        _one_error_line(_cli(saved, tmp_path / f"cli{n}", timeout=90), DATA, why)
        assert not (tmp_path / f"cli{n}").exists()
        _refused(saved, tmp_path / f"api{n}", DATA, why)
    _fifo(saved, ".metadata")
    _one_error_line(_cli(saved, tmp_path / "md", timeout=90), ".metadata", "not a regular file")


@pytest.mark.dist
def test_a_directory_without_metadata_is_an_incomplete_dcp_checkpoint(saved, tmp_path):
    """An interrupted DCP save (its ``.distcp`` files, no ``.metadata``) is named as such,
    with the directory; before, the CLI said --from is for DCP checkpoints. A muonckpt
    checkpoint and an empty directory given with --from are each named for what they are."""
    ours = interop.from_dcp(saved, tmp_path / "ours", source="torch").path
    _one_error_line(_cli(ours, tmp_path / "cli"), "a muonckpt checkpoint, not DCP", str(ours))
    (saved / ".metadata").unlink()
    words = ("an incomplete DCP checkpoint: no .metadata", str(saved))
    _refused(saved, tmp_path / "api", *words)
    _one_error_line(_cli(saved, tmp_path / "cli"), *words)
    assert sorted(p.name for p in saved.iterdir()) == [DATA]
    (saved / DATA).unlink()
    _one_error_line(_cli(saved, tmp_path / "cli"), "not a DCP checkpoint: no .metadata")
    assert not (tmp_path / "cli").exists()


@pytest.mark.parametrize(
    "fqn,value,words",
    [
        ("optimizer.param_groups.w.lr", torch.zeros(3, 3), "holds a tensor of [3, 3], not a"),
        ("optimizer.param_groups.w.lr", [[0.1]], "holds a list, not a setting"),
        ("optimizer.param_groups.w.lr", ["x" * (1 << 20)] * 50, "more than 1048576 char"),
        ("optimizer.param_groups.w.lr", "x" * (2 << 20), "more than 1048576 characters"),
        ("optimizer.param_groups.w.lr", float("nan"), "holds nan, not a finite setting"),
        ("optimizer.param_groups.w.nesterov", [1, 2], "'nesterov' is [1, 2], not a bool"),
        ("optimizer.param_groups.w.nesterov", "False", "'nesterov' is 'False', not a bool"),
    ],
    ids=["tensor", "nested", "wide", "long", "nan", "nesterov-list", "nesterov-str"],
)
def test_settings_that_are_not_settings_are_refused_in_one_line(saved, tmp_path, fqn, value, words):
    """A setting stored as a 3 x 3 tensor, a nested list, a list of fifty references to one
    megabyte string (a small pickle, 50 MB of manifest; a thousand are over the limit on text
    of every foreign file, test_foreign_limits.py), a 2 MiB string, NaN, or a
    nesterov that is not a bool: one line naming the item and ``.metadata`` (before: a
    multi-line tensor repr, errors naming no file, the manifest built, nesterov taken as
    True)."""
    metadata = _metadata(saved)
    key = _storage_key(metadata, fqn)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    start = (saved / DATA).stat().st_size
    with open(saved / DATA, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[key] = _StorageInfo(DATA, start, len(buffer.getvalue()))
    _write_metadata(saved, metadata)
    name = fqn.rsplit(".", 2)[1] if "nesterov" in fqn else fqn
    _refused(saved, tmp_path / "out", repr(name), words, ".metadata")


WRONG: tuple[Any, ...] = (
    None,
    "x",
    b"x",
    1.5,
    -1,
    1 << 70,
    True,
    [],
    {"a": 1},
    [None],
    ["x"],
    (1.5, 2),
    (-1, 4),
    torch.float16,
    ChunkStorageMetadata(torch.Size([0]), torch.Size([1])),
)
"""Values no field muonckpt reads may hold (or, for the dtype, hold here)."""


def _fields(metadata: Any) -> dict[str, Callable[[Any, Any], None]]:
    """Field -> how to put a value there, for every field of the metadata muonckpt reads."""
    tensor, values = "model.w", "optimizer.param_groups.w.lr"

    def item(md: Any) -> Any:
        return md.state_dict_metadata[tensor]

    def entry(md: Any, fqn: str = tensor) -> Any:
        return md.storage_data[_storage_key(md, fqn)]

    def rekeyed(md: Any, field: str, value: Any) -> None:
        old = _storage_key(md, tensor)
        new = copy.copy(old)
        object.__setattr__(new, field, value)
        md.storage_data = {new if k is old else k: v for k, v in md.storage_data.items()}

    def renamed(md: Any, value: Any) -> None:
        md.state_dict_metadata = {
            (value if k == tensor else k): v for k, v in md.state_dict_metadata.items()
        }

    def put(get: Callable[[Any], Any], name: str) -> Callable[[Any, Any], None]:
        return lambda md, value: setattr(get(md), name, value)

    def put_item(fqn: str) -> Callable[[Any, Any], None]:
        return lambda md, value: md.state_dict_metadata.__setitem__(fqn, value)

    def put_entry(fqn: str) -> Callable[[Any, Any], None]:
        return lambda md, value: md.storage_data.__setitem__(_storage_key(md, fqn), value)

    return {
        "state_dict_metadata": put(lambda md: md, "state_dict_metadata"),
        "storage_data": put(lambda md: md, "storage_data"),
        "state_dict_metadata key": renamed,
        "tensor item": put_item(tensor),
        "bytes item": put_item(values),
        "properties": put(item, "properties"),
        "properties.dtype": put(lambda md: item(md).properties, "dtype"),
        "properties.layout": put(lambda md: item(md).properties, "layout"),
        "size": put(item, "size"),
        "chunks": put(item, "chunks"),
        "chunks[0]": lambda md, value: item(md).chunks.__setitem__(0, value),
        "chunks[0].offsets": put(lambda md: item(md).chunks[0], "offsets"),
        "chunks[0].sizes": put(lambda md: item(md).chunks[0], "sizes"),
        "storage key.fqn": lambda md, value: rekeyed(md, "fqn", value),
        "storage key.offset": lambda md, value: rekeyed(md, "offset", value),
        "storage entry": put_entry(tensor),
        "storage entry (bytes item)": put_entry(values),
        "relative_path": put(entry, "relative_path"),
        "offset": put(entry, "offset"),
        "length": put(entry, "length"),
        "transform_descriptors": put(entry, "transform_descriptors"),
    }


def test_a_sweep_of_wrong_field_values_each_gives_one_line_naming_the_file(saved, tmp_path):
    """Every metadata field muonckpt reads, set to each of :data:`WRONG` (the real classes,
    pickled as DCP pickles them): each is one MuonCkptError line naming ``.metadata`` (or the
    data file it points to), nothing written; none a traceback. Before: TypeError,
    ValueError, AttributeError and OverflowError tracebacks, and some converted."""
    metadata = _metadata(saved)
    fields = _fields(metadata)
    failures, seen = [], 0
    for field, put in fields.items():
        for value in WRONG:
            if field == "transform_descriptors" and value in (None, []):
                continue  # no transforms: plain DCP, as torch writes it
            edited = copy.deepcopy(metadata)
            try:
                put(edited, value)
                data = pickle.dumps(edited)
            except (TypeError, pickle.PicklingError):
                continue  # an unhashable key, or not picklable: no dict or file can hold it
            case = tmp_path / f"case-{seen}"
            seen += 1
            shutil.copytree(saved, case)
            (case / ".metadata").write_bytes(data)
            out = tmp_path / f"out-{seen}"
            try:
                interop.from_dcp(case, out, source="torch", to="packaged")
                failures.append(f"{field} = {value!r}: converted")
            except MuonCkptError as exc:
                message = str(exc)
                if "\n" in message or f"(file {case}/" not in message:
                    failures.append(f"{field} = {value!r}: {message!r}")
            except Exception as exc:  # the test's point: report every traceback, not the first
                failures.append(f"{field} = {value!r}: {type(exc).__name__}: {exc}")
            if out.exists():
                failures.append(f"{field} = {value!r}: wrote {out}")
            shutil.rmtree(case)
    print(f"{seen} mutations of {len(fields)} fields, {len(failures)} not refused in one line")
    assert seen >= 290
    assert not failures, "\n".join(failures)


@pytest.mark.dist
@pytest.mark.parametrize(
    "through_the_cli",
    [
        pytest.param(("size", "length"), id="size,length"),
        pytest.param(
            ("chunks[0].sizes", "properties", "relative_path"), id="others", marks=pytest.mark.slow
        ),
    ],
)
def test_some_wrong_fields_through_the_command_line(saved, tmp_path, through_the_cli):
    """Five field mutations of the sweep, each refused by the API naming its field and
    ``.metadata``, and as a user's ``muonckpt convert`` meets them (those ``through_the_cli``:
    a wrong type and a value out of range in the default tier, the other three in the slow
    one; the command prints the API's message): one ``error:`` line each naming the field
    and ``.metadata``, exit code 2, nothing written."""
    metadata = _metadata(saved)
    fields = _fields(metadata)
    cases = [
        ("size", "x", "state_dict_metadata['model.w'].size"),
        ("chunks[0].sizes", (1.5, 2), "chunks[0].sizes[0]"),
        ("properties", None, "state_dict_metadata['model.w'].properties"),
        ("length", 1 << 70, ".length"),
        ("relative_path", 7, ".relative_path"),
    ]
    for n, (field, value, named) in enumerate(cases):
        case = tmp_path / f"case-{n}"
        shutil.copytree(saved, case)
        edited = copy.deepcopy(metadata)
        fields[field](edited, value)
        _write_metadata(case, edited)
        _refused(case, tmp_path / f"api-{n}", named, str(case / ".metadata"))
        if field in through_the_cli:
            _one_error_line(_cli(case, tmp_path / f"out-{n}"), named, str(case / ".metadata"))
            assert not (tmp_path / f"out-{n}").exists()


def test_a_dense_chunk_stored_column_major_is_read_not_refused(tmp_path, monkeypatch):
    """``torch.save`` (and so DCP's writer) keeps a tensor's strides when its storage is exactly
    its own: a column-major matrix (a transposed init, a ``zeros_like`` of one) is a real DCP
    chunk of exactly its bytes. It was refused as 'not a dense tensor'; it converts to the same
    values as the row-major save."""
    from muonckpt.offline.examine import diff

    save = dcp_cases.dcp.save

    def column_major(state_dict: dict[str, Any], checkpoint_id: str) -> Any:
        momentum = "state.w.momentum_buffer"
        state_dict["model"]["w"] = state_dict["model"]["w"].t().contiguous().t()
        state_dict["optimizer"][momentum] = state_dict["optimizer"][momentum].t().contiguous().t()
        assert state_dict["model"]["w"].stride() == (1, 6)
        return save(state_dict, checkpoint_id=checkpoint_id)

    dcp_cases.single_process_dcp(tmp_path / "rows", "momentum_buffer", "momentum", {}, ADAM)
    monkeypatch.setattr(dcp_cases.dcp, "save", column_major)
    dcp_cases.single_process_dcp(tmp_path / "columns", "momentum_buffer", "momentum", {}, ADAM)
    for name in ("rows", "columns"):
        interop.from_dcp(tmp_path / name, tmp_path / f"{name}.out", source="torch", to="packaged")
    rows = diff(tmp_path / "rows.out", tmp_path / "columns.out")
    assert rows and all(row.equal for row in rows), rows
