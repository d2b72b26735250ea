"""Offline consolidate / reshard / diff against real checkpoints of the tiny two-group model."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

import muonckpt
from muonckpt import offline, storage
from muonckpt.distributed.launch import run_distributed
from muonckpt.format import kinds
from muonckpt.format.manifest import GroupEntry, Manifest, ParamEntry
from muonckpt.offline import examine
from muonckpt.offline.inspection import ParamSummary

from .ckpt_cases import load_phase
from .fixture_model import (
    LAYOUT,
    MUON_PARAMS,
    N_STATE_TENSORS,
    PARAM_NAMES,
    SHAPES,
    STATE_KEYS,
    TP_SPLIT_DIMS,
    assemble,
    build,
    initial_params,
    local_params,
    numel,
    split_params_indivisible_by,
    train,
)

K, M = 2, 2
SRC, DST = (2, 2), (4, 2)


def save_both_and_continue(dp: int, tp: int, per_rank: str, consolidated: str) -> dict:
    """(gloo child) Train K steps, save per rank and consolidated, then train M more."""
    opt, sharded, dp_rank, tp_rank = build(dp, tp, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, K)
    muonckpt.save(opt, per_rank)
    muonckpt.save(opt, consolidated, consolidated=True)
    train(opt, sharded, dp_rank, tp_rank, K, M)
    return {"final": local_params(opt)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offline")
    per_rank, consolidated = tmp / "per-rank", tmp / "consolidated"
    out = run_distributed(
        save_both_and_continue, SRC[0] * SRC[1], *SRC, str(per_rank), str(consolidated), timeout=180
    )
    final = assemble(*SRC, [o["final"] for o in out])
    return {"per_rank": per_rank, "consolidated": consolidated, "final": final}


@pytest.mark.dist
def test_consolidate_matches_consolidated_save(saved, tmp_path):
    calls = []
    out = offline.consolidate(
        saved["per_rank"], tmp_path / "c", progress=lambda *update: calls.append(update)
    )
    assert muonckpt.verify(out) == []
    total = count = 0
    for file in ("optimizer.safetensors", "model.safetensors"):
        mine = safetensors.torch.load_file(out / file)
        theirs = safetensors.torch.load_file(saved["consolidated"] / file)
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert torch.equal(mine[key], value), key
        total += sum(v.numel() * v.element_size() for v in mine.values())
        count += len(mine)
    assert set(safetensors.torch.load_file(out / "model.safetensors")) == set(saved["final"])
    assert calls[0] == (0, total, 0, count) and calls[-1] == (total, total, count, count)
    assert len(calls) == count + 1
    manifest = muonckpt.read_manifest(out)
    assert manifest.kind == "consolidated"
    assert manifest.step == K
    with pytest.raises(muonckpt.CheckpointError, match="already exists"):
        offline.consolidate(saved["per_rank"], out)


@pytest.mark.dist
def test_sharded_consolidate_writes_an_index(saved, tmp_path):
    out = offline.consolidate(saved["consolidated"], tmp_path / "c", max_shard_size=800)
    index = json.loads((out / "optimizer.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 1
    assert files[0] == f"optimizer-00001-of-{len(files):05d}.safetensors"
    tensors = {}
    for name in files:
        tensors.update(safetensors.torch.load_file(out / name))
    assert sorted(tensors) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in tensors.values()
    )
    assert muonckpt.verify(out) == []
    assert all(r.equal for r in offline.diff(out, saved["per_rank"]))


@pytest.mark.dist
def test_reshard_then_load_is_bitwise(saved, tmp_path):
    out = offline.reshard(saved["per_rank"], tmp_path / "r", dp=DST[0], tp=DST[1], options=LAYOUT)
    assert muonckpt.verify(out) == []
    manifest = muonckpt.read_manifest(out)
    assert manifest.kind == "per-rank"
    assert manifest.topology == {"dp": DST[0], "tp": DST[1]}
    assert len(manifest.files) == DST[0] * DST[1]
    rows = offline.diff(saved["per_rank"], out)
    assert rows and all(r.equal and r.bitwise for r in rows)
    shards = run_distributed(load_phase, DST[0] * DST[1], *DST, str(out), K, M, timeout=180)
    full = assemble(*DST, shards)
    for name, value in saved["final"].items():
        assert torch.equal(full[name], value), name


@pytest.mark.dist
def test_reshard_refuses_an_indivisible_split(saved, tmp_path):
    bad = split_params_indivisible_by(3)[0]  # the first in the checkpoint's order
    with pytest.raises(muonckpt.LayoutError, match=f"param '{bad}'"):
        offline.reshard(saved["per_rank"], tmp_path / "r", dp=1, tp=3)
    assert not (tmp_path / "r").exists()


@pytest.mark.dist
def test_summarize_and_diff_notes(saved, tmp_path):
    info = offline.summarize(saved["per_rank"])
    assert info.kind == "per-rank" and info.topology == {"dp": 2, "tp": 2}
    assert info.step == K
    assert [p.name for p in info.params] == PARAM_NAMES
    for entry in info.params:
        name = entry.name
        keys = tuple(STATE_KEYS[name])
        assert entry == ParamSummary(
            name=name,
            shape=tuple(SHAPES[name]),
            dtypes={**dict.fromkeys(keys, "F32"), "param": "F32"},
            value_dtype="F32",
            scalars={},
            tp_split_dim=TP_SPLIT_DIMS.get(name, -1),
            group=0 if name in MUON_PARAMS else 1,
            state_keys=keys,
            bytes=(len(keys) + 1) * numel(name) * 4,  # its state and the param, float32
        ), name
    assert info.totals.files == SRC[0] * SRC[1]
    assert info.totals.tensors == N_STATE_TENSORS
    shown = json.loads(json.dumps(info.to_json()))  # what inspect --json prints
    assert list(shown) == [
        *("path", "kind", "format_version", "topology", "step", "extra", "groups", "params"),
        *("model", "totals"),
    ]
    assert shown["params"][0]["shape"] == list(SHAPES[PARAM_NAMES[0]])
    rows = offline.diff(saved["per_rank"], saved["consolidated"], atol=0.0)
    assert all(r.equal for r in rows)
    fields = ["param", "key", "max_abs", "max_rel", "equal", "bitwise", "note"]
    assert list(rows[0].to_json()) == fields


def test_streaming_writer_order_and_abort(tmp_path):
    from muonckpt.storage import SafetensorsReader, SafetensorsWriter

    specs = {"b": ("F32", (2, 3)), "a": ("I64", (4,))}
    with SafetensorsWriter(tmp_path / "x.safetensors", specs, {"k": "v"}) as out:
        assert out.pending == ["a", "b"]
        with pytest.raises(muonckpt.CheckpointError, match="sorted key order"):
            out.write("b", torch.zeros(2, 3))
    assert list(tmp_path.iterdir()) == []
    with SafetensorsWriter(tmp_path / "x.safetensors", specs, {"k": "v"}) as out:
        out.write("a", torch.arange(4))
        out.write("b", torch.ones(6))
        records = out.commit()
    assert records["a"].checksums and records["b"].shape == (2, 3)
    with SafetensorsReader(tmp_path / "x.safetensors") as reader:
        assert reader.metadata == {"k": "v"}
        assert torch.equal(
            reader.read_tensor("b", checksums=records["b"].checksums), torch.ones(2, 3)
        )
    loaded = safetensors.torch.load_file(tmp_path / "x.safetensors")
    assert torch.equal(loaded["a"], torch.arange(4))
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


def test_inspect_shows_the_step_of_an_optimizer_that_counts_per_param(tmp_path):
    """(issue 20) torch's AdamW keeps its step per param, as a 0-d tensor: inspect showed
    'step None'; it shows the count, as latest orders by it."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    assert offline.summarize(muonckpt.save(opt, tmp_path / "ckpt")).step == 3


def test_diff_across_momentum_forms_converts_as_load_does(tmp_path, single_ckpt):
    """(issue 21, item 7) The packaged Muon's sum-form momentum against the same state converted
    to torch's or KellerJordan's EMA form: diff converts B by load's own map (and says so),
    instead of reporting every buffer 10x off (mu = 0.9). Step counts compare wherever each
    implementation keeps them."""
    packaged = single_ckpt(2)
    for family in ("torch", "keller-jordan"):
        other = offline.convert(packaged, tmp_path / family, to=family)
        rows = offline.diff(packaged, other, rtol=1e-6)
        momentum = [r for r in rows if r.key == "momentum_buffer"]
        assert momentum and all(r.equal for r in momentum), momentum
        assert all("B converted ema -> sum" in (r.note or "") for r in momentum), momentum
        assert all(r.equal for r in rows), [r for r in rows if not r.equal]
        assert any(r.key == "step" and r.equal for r in rows)
        back = offline.diff(other, packaged, rtol=1e-6)
        assert all(r.equal for r in back), [r for r in back if not r.equal]


def test_diff_refuses_to_compare_state_of_different_roles_raw():
    muon = kinds.GroupKind("muonckpt.Muon", "muon", "sum", 0.9, True, "moonlight", 0.2)
    adamw = kinds.GroupKind("torch.optim.AdamW", "adamw", step_in="tensor")
    ema = kinds.GroupKind("torch.optim.Muon", "muon", "ema", 0.9, True, "aspect")

    def manifest(kind):
        group = GroupEntry({}, ("w",), kind.to_json())
        entry = ParamEntry("w", (2,), -1, 0, {"momentum_buffer": "F32"})
        return Manifest("per-rank", {"dp": 1, "tp": 1}, (group,), (entry,), (), ())

    ((reason, _),) = examine._momentum_scales(manifest(muon), manifest(adamw)).values()
    assert "not comparable" in reason and "adamw" in reason
    ((factor, note),) = examine._momentum_scales(manifest(muon), manifest(ema)).values()
    assert factor == pytest.approx(10.0) and "ema -> sum" in note
    assert examine._momentum_scales(manifest(ema), manifest(ema)) == {}


def test_packed_checksums_come_back_exactly_and_a_lying_one_is_still_caught(tmp_path):
    """Pieces and written records keep their checksums packed, 8 bytes each (memory at 100k
    params): every checksum comes back as the manifest lists it, multi-chunk pieces and
    leading zeros included, the manifest is written again byte for byte, a rewrite lists the
    checksums of the bytes it wrote, and a checksum that lies is still caught."""
    from muonckpt.format.manifest import pack_checksums, unpack_checksums
    from muonckpt.storage import CHUNK_BYTES, SafetensorsReader, checksum_chunks

    odd = ("0000000000000000", "00000000000000ff", "ffffffffffffffff", "0123456789abcdef")
    assert unpack_checksums(pack_checksums(odd)) == odd and unpack_checksums(b"") == ()
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(CHUNK_BYTES // 4 + 1000))  # two checksum chunks
    opt = torch.optim.AdamW([big, torch.nn.Parameter(torch.randn(3))])
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    opt.step()
    ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    text = (ckpt / "manifest.json").read_text()
    (index,) = json.loads(text)["indexes"]  # (format version 3: the pieces of the one file)
    rows = json.loads((ckpt / index["name"]).read_text())["pieces"]
    listed = [[row[5][i : i + 16] for i in range(0, len(row[5]), 16)] for row in rows]
    manifest = muonckpt.read_manifest(ckpt)
    assert [list(p.checksums) for p in manifest.pieces] == listed
    assert max(map(len, listed)) == 2 and manifest.to_json() == text

    full = offline.consolidate(ckpt, tmp_path / "full")
    rewritten = muonckpt.read_manifest(full)
    for piece in rewritten.pieces:
        with SafetensorsReader(full / piece.file) as reader:
            data = reader.read(piece.tensor).view(torch.uint8).numpy()
        assert piece.checksums == checksum_chunks(data, piece.chunk_bytes)
    assert sorted(map(list, (p.checksums for p in rewritten.pieces))) == sorted(listed)
    assert muonckpt.verify(full) == []

    true = max(listed, key=len)[1]
    lie = f"{int(true, 16) ^ 1:016x}"
    lying = (ckpt / index["name"]).read_bytes().replace(true.encode(), lie.encode())
    (ckpt / index["name"]).write_bytes(lying)  # a lie the index's own checksum agrees with
    checksum = storage.chunk_digest(lying)
    (ckpt / "manifest.json").write_text(text.replace(index["checksum"], checksum))
    (problem,) = muonckpt.verify(ckpt)
    assert "checksum mismatch in chunk 1" in str(problem) and lie in str(problem)
    with pytest.raises(muonckpt.CheckpointError, match="checksum mismatch in chunk 1"):
        offline.consolidate(ckpt, tmp_path / "again")
