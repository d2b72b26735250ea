"""Format version 3 (issue 35): a small top-level manifest and one piece index per data file;
a load reads only the indexes of its params; version 2 checkpoints are still read; a lying
index is refused naming it; a Kimi-K2-shaped model's metadata fits with room to spare."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

import muonckpt
from muonckpt import CheckpointError, offline, storage
from muonckpt.distributed.launch import run_distributed
from muonckpt.files import pieces as pieces_module
from muonckpt.files._indexes import write_indexes
from muonckpt.files.pieces import checkpoint_at, indexes_for, load_pieces, read_manifest
from muonckpt.format.manifest import FORMAT_VERSION, PER_RANK, Manifest, ParamEntry, Piece
from muonckpt.format.names import MANIFEST_NAME, rank_file, tensor_key
from muonckpt.layout.topology import ParamSpec, Topology, arrange
from muonckpt.storage import durable

from .fixture_model import assemble, build, initial_params, local_params

V2 = Path(__file__).parent / "fixtures" / "v2"
V3 = Path(__file__).parent / "fixtures" / "v3"
REPO = Path(__file__).resolve().parents[1]


def _expected() -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(V2 / "expected.safetensors")


@pytest.mark.parametrize("version,fixtures", [(2, V2), (3, V3)])
def test_an_older_version_is_read_verified_and_rewritten_as_the_current(
    tmp_path, version, fixtures
):
    """The fixtures written by muonckpt at 6e48449 (version 2) and 75aaf4b (version 3), of
    the same run: read, verified, loaded into a fresh optimizer, consolidated and resharded
    into the current version, diffed equal."""
    expected = _expected()
    for kind in ("per-rank", "consolidated"):
        manifest = read_manifest(fixtures / kind)
        assert manifest.format_version == version and manifest.complete
        assert bool(manifest.indexes) == (version >= 3)
        assert muonckpt.verify(fixtures / kind) == []
    opt, *_ = build(1, 1, {n: torch.zeros_like(v) for n, v in initial_params().items()})
    muonckpt.load(opt, fixtures / "per-rank")
    for name, value in assemble(1, 1, [local_params(opt)]).items():
        assert torch.equal(value, expected[name]), name

    full = offline.consolidate(fixtures / "per-rank", tmp_path / "full")
    resharded = offline.reshard(fixtures / "consolidated", tmp_path / "r", dp=1, tp=2)
    for out in (full, resharded):
        assert read_manifest(out).format_version == FORMAT_VERSION and muonckpt.verify(out) == []
    got = safetensors.torch.load_file(full / "optimizer.safetensors")
    got.update(safetensors.torch.load_file(full / "model.safetensors"))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert all(row.equal for row in offline.diff(fixtures / "consolidated", resharded))


def _load_and_report(dp: int, tp: int, ckpt: str) -> dict:
    """(gloo child) Load into a fresh optimizer: which piece indexes this process read, and
    the params of which it holds elements."""
    from muonckpt.state.placement import describe

    zeros = {name: torch.zeros_like(value) for name, value in initial_params().items()}
    opt, *_ = build(dp, tp, zeros)
    pieces_module.INDEXES_READ.clear()
    muonckpt.load(opt, ckpt)
    held = [
        p.name
        for p in describe(opt).params
        if (p.local is not None and p.local.numel) or (p.held is None or p.held.numel)
    ]
    return {"read": sorted(pieces_module.INDEXES_READ), "held": held, "params": local_params(opt)}


@pytest.mark.dist
def test_a_load_reads_only_the_indexes_of_its_params(tmp_path):
    """A 2x2 load from an 8-rank checkpoint: each rank opens the top level and exactly the
    piece indexes holding pieces of the params it holds elements of (counted where they are
    read); together they read every one; the load is bitwise. (The fixture model's 6 params
    are spread over most files, so a rank here reads most indexes; the K2-shaped test below
    shows the share at scale.)"""
    ckpt = offline.reshard(V2 / "per-rank", tmp_path / "r", dp=4, tp=2)
    top = read_manifest(ckpt, pieces=False)
    every = {i.name for i in top.indexes}
    assert len(every) == 8
    out = run_distributed(_load_and_report, 4, 2, 2, str(ckpt), timeout=120)
    for o in out:
        assert set(o["read"]) == {i.name for i in indexes_for(top, o["held"])}, o["read"]
    assert set().union(*(o["read"] for o in out)) == every
    full = assemble(2, 2, [o["params"] for o in out])
    expected = _expected()
    assert all(torch.equal(value, expected[name]) for name, value in full.items())


def _params_of(ckpt: Path, index: str) -> set[str]:
    """The params a piece index lists pieces of (by its rows' positions)."""
    params = read_manifest(ckpt, pieces=False).params
    rows = json.loads((ckpt / index).read_text())["pieces"]
    return {params[row[0]].name for row in rows}


def _rewrite_index(ckpt: Path, name: str, edit) -> None:
    """Edit index ``name``'s rows and make the manifest's record of it agree (size, checksum):
    a lie its checksum cannot catch."""
    body = json.loads((ckpt / name).read_text())
    edit(body["pieces"])
    (ckpt / name).write_text(json.dumps(body))
    top = json.loads((ckpt / MANIFEST_NAME).read_text())
    entry = next(i for i in top["indexes"] if i["name"] == name)
    data = (ckpt / name).read_bytes()
    entry.update(bytes=len(data), checksum=storage.chunk_digest(data))
    (ckpt / MANIFEST_NAME).write_text(json.dumps(top))


def _adamw_ckpt(path: Path) -> Path:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return muonckpt.save(opt, path)


@pytest.mark.parametrize(
    "lie,said",
    [
        ("flipped byte", "piece index checksum mismatch"),
        ("region past the param", "lies outside param shape"),
        ("param not in its spans", "not held"),
        ("wrong checksum count", "checksums for"),
    ],
)
def test_a_lying_piece_index_is_refused_naming_it(tmp_path, lie, said):
    ckpt = _adamw_ckpt(tmp_path / "ckpt")
    (index,) = read_manifest(ckpt).indexes
    if lie == "flipped byte":
        data = bytearray((ckpt / index.name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (ckpt / index.name).write_bytes(bytes(data))
    else:

        def edit(rows: list) -> None:
            if lie == "region past the param":
                rows[0][3] = [24, 0, 24, 0, 10_000]
            elif lie == "param not in its spans":
                rows[0][0] = 7
            else:
                rows[0][5] += "0123456789abcdef"

        _rewrite_index(ckpt, index.name, edit)
    problems = muonckpt.verify(ckpt)
    assert any(index.name in str(p) and said in str(p) for p in problems), problems
    with pytest.raises(CheckpointError, match=said) as err:
        read_manifest(ckpt)
    assert index.name in str(err.value)
    opt = torch.optim.AdamW(
        [torch.nn.Parameter(torch.zeros(4, 6)), torch.nn.Parameter(torch.zeros(5))]
    )
    with pytest.raises(CheckpointError, match=index.name):
        muonckpt.load(opt, ckpt)


def _moe_shapes():
    spec = importlib.util.spec_from_file_location(
        "moe_shapes", REPO / "benchmarks" / "moe_shapes.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_k2_shaped_metadata_fits_and_a_rank_reads_only_its_indexes(tmp_path):
    """A Kimi-K2-shaped model (69,854 params, Megatron-length names) planned per rank at
    dp 64 (momentum and values: 140k pieces): its piece indexes and top level written as a
    commit writes them (:func:`write_indexes`), read back as a load reads them. The planning
    path, not a full save: the data of 70k params would take minutes here."""
    moe = _moe_shapes()
    shapes = moe.model_shapes("k2")
    assert len(shapes) == 69_854 and max(len(n) for n, _, _ in shapes) >= 75
    params = tuple(
        ParamEntry(name, shape, split, 0, {"momentum_buffer": "F32", "param": "F32"})
        for name, shape, split in shapes
    )
    dp = 64
    layout = arrange(
        [ParamSpec(e.name, e.shape, tp_split_dim=e.tp_split_dim) for e in params], Topology(dp, 1)
    )
    by_rank: list[list[Piece]] = [[] for _ in range(dp)]  # each rank's pieces, in param order
    for at, entry in enumerate(params):
        digest = (at * 2 + 1).to_bytes(8, "big")
        for rank in layout.owner_ranks(at):  # not params x ranks regions: 4.5M of them
            region = layout.owner_region(at, rank, 0)
            file = rank_file(rank, dp)
            by_rank[rank] += [
                Piece(entry.name, key, file, tensor_key(entry.name, key), region, digest, 4 << 20)
                for key in ("momentum_buffer", "param")
            ]
    pieces = [piece for share in by_rank for piece in share]
    from muonckpt.format.manifest import FileEntry, GroupEntry

    group = GroupEntry({"lr": 0.02}, tuple(e.name for e in params), {})
    files = tuple(FileEntry(rank_file(r, dp), 0) for r in range(dp))
    manifest = Manifest(PER_RANK, {"dp": dp, "tp": 1}, (group,), params, files, tuple(pieces))
    v2_bytes = sum(map(len, dataclasses.replace(manifest, format_version=2).json_chunks()))
    start = time.perf_counter()
    committed = write_indexes(tmp_path, manifest, tmp_path)
    durable.write_text_atomic(tmp_path / MANIFEST_NAME, committed.json_chunks())
    top_bytes = (tmp_path / MANIFEST_NAME).stat().st_size
    largest = max(i.bytes for i in committed.indexes)
    assert top_bytes < 10_000_000 < v2_bytes and largest < 2_000_000, (top_bytes, v2_bytes)
    top = read_manifest(tmp_path, pieces=False)
    assert top.params == params and len(top.indexes) == dp and not top.pieces
    names = moe.held_names(top, dp, 1, 5)
    share = load_pieces(checkpoint_at(tmp_path), top, names)
    assert {p.file for p in share.pieces} <= {rank_file(r, dp) for r in (4, 5, 6)}
    assert {p.param for p in share.pieces} >= set(names)
    assert set(pieces_module.INDEXES_READ) >= {i.name for i in indexes_for(top, names)}
    # an index rank 5 does not need, damaged: its load still plans; a full read names it
    unread = tmp_path / committed.indexes[40].name
    unread.write_bytes(unread.read_bytes().replace(b"[", b"(", 1))
    assert load_pieces(checkpoint_at(tmp_path), top, names).pieces == share.pieces
    with pytest.raises(CheckpointError, match=unread.name):
        read_manifest(tmp_path)
    print(
        f"K2 at dp {dp}: v2 manifest {v2_bytes} B, v3 top {top_bytes} B, largest index "
        f"{largest} B, {time.perf_counter() - start:.1f} s"
    )
    shutil.rmtree(tmp_path)


def test_front_coded_names_round_trip_and_a_lying_count_is_refused(tmp_path):
    """Version 4 (and on) writes each name as what it shares with the previous one and the rest:
    names that share nothing, share all of another and share across an escaped character read
    back as saved; a shared count past the previous name is refused naming the manifest."""
    names = ["layers.0.w", "layers.0.w.x", "layers.1.w", "z", 'q"\u00e9', 'q"\u00e9\u00e9']
    params = [torch.nn.Parameter(torch.randn(2, 3)) for _ in names]
    opt = torch.optim.SGD([{"params": params, "param_names": names}], lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    ckpt = muonckpt.save(opt, tmp_path / "c")
    body = json.loads((ckpt / MANIFEST_NAME).read_text())
    assert body["format_version"] == FORMAT_VERSION == 5
    assert [row[0] for row in body["params"]] == [0, 10, 7, 0, 0, 3]
    assert [p.name for p in read_manifest(ckpt).params] == names
    body["params"][3][0] = 11
    (ckpt / MANIFEST_NAME).write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match="shares 11 characters") as refused:
        read_manifest(ckpt)
    assert MANIFEST_NAME in str(refused.value)
