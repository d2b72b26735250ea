"""Each piece is a stored tensor of its own (issue 50, round 2, finding F5): a piece-index row
pointed at another stored tensor of its data file with the same shape and dtype, its checksums
copied from that tensor's piece and the index's size and checksum re-recorded, passes every
checksum. ``verify`` reports it and ``load`` refuses it (two pieces naming one tensor), on every
rank of a load that reads only its own indexes, before any value changes; a data file's tensor
that no piece names is reported by ``verify``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch.distributed as dist

import muonckpt
from muonckpt import CheckpointError, storage
from muonckpt.distributed.launch import run_distributed
from muonckpt.format.coverage import shared_tensors
from muonckpt.format.manifest import Piece
from muonckpt.layout.topology import Region

from .fixture_model import build, initial_params, single_process_optimizer, train
from .test_load_coverage import _state, _unchanged

PARAM = "w_out"


def point_momentum_at_values(ckpt: Path) -> None:
    """In the first index holding ``PARAM``, point its momentum piece at the tensor holding
    its values (the same region, shape and dtype), with that piece's checksums, and record the
    index's new size and checksum in the manifest the way the writer computes them."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    names = [""]
    for shared, rest, _ in manifest["params"]:  # version 4: front-coded names
        names.append(names[-1][:shared] + rest)
    at = names[1:].index(PARAM)
    for entry in manifest["indexes"]:
        body = json.loads((ckpt / entry["name"]).read_text())
        rows = {row[1]: row for row in body["pieces"] if row[0] == at}
        if rows:
            break
    momentum, values = rows["momentum_buffer"], rows["param"]
    momentum[2] = values[2] if values[2] is not None else PARAM  # the default key of values
    momentum[5] = values[5]
    text = json.dumps(body).encode()
    (ckpt / entry["name"]).write_bytes(text)
    entry.update(bytes=len(text), checksum=storage.chunk_digest(text))
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_a_piece_pointed_at_another_stored_tensor_is_reported_and_refused(tmp_path):
    saved = single_process_optimizer(3)
    muonckpt.save(saved, tmp_path / "ck")
    point_momentum_at_values(tmp_path / "ck")
    problems = [str(p) for p in muonckpt.verify(tmp_path / "ck")]
    assert any("read by two pieces" in p and PARAM in p for p in problems), problems
    opt = single_process_optimizer(1)
    before = _state(opt)
    with pytest.raises(CheckpointError, match=r"read by two pieces.*'w_out'"):
        muonckpt.load(opt, tmp_path / "ck")
    assert _unchanged(before, opt)


def two_rank_loads(root: str) -> str:
    """(gloo child) Save at 2 x 1, (rank 0) point a piece of rank 0's index at another tensor,
    then load at 2 x 1: each rank reads its own index alone; the error raised here."""
    opt, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 2)
    muonckpt.save(opt, f"{root}/ck")
    if dist.get_rank() == 0:
        point_momentum_at_values(Path(root, "ck"))
    dist.barrier()
    opt, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 1)
    before = _state(opt)
    try:
        muonckpt.load(opt, f"{root}/ck")
    except CheckpointError as exc:
        return f"{_unchanged(before, opt)} {exc}"
    return "no error"


@pytest.mark.dist
def test_a_load_reading_its_own_indexes_refuses_the_piece_on_every_rank(tmp_path):
    ranks = run_distributed(two_rank_loads, 2, str(tmp_path), timeout=120)
    for rank, found in enumerate(ranks):
        assert found.startswith("True load (read): ") and "read by two pieces" in found, (
            rank,
            found,
        )


def _with_tensor_added(path: Path, name: str) -> None:
    """Rewrite safetensors file ``path`` with one more 4-byte F32 tensor ``name`` at the end
    of its data (the others' offsets unchanged)."""
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    body = data[8 + size :]
    header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [len(body), len(body) + 4]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body + b"\0" * 4)


def test_a_stored_tensor_no_piece_reads_is_reported_by_verify(tmp_path):
    muonckpt.save(single_process_optimizer(1), tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck/manifest.json").read_text())
    file = tmp_path / "ck" / manifest["files"][0]["name"]
    _with_tensor_added(file, "state.w_out.stray")
    manifest["files"][0]["bytes"] = file.stat().st_size
    (tmp_path / "ck/manifest.json").write_text(json.dumps(manifest))
    problems = [str(p) for p in muonckpt.verify(tmp_path / "ck")]
    assert problems == [
        f"tensor 'state.w_out.stray' is read by no piece (1 such tensors) (file {file})"
    ], problems


def _piece(param: str, key: str, file: str, tensor: str) -> Piece:
    return Piece(param, key, file, tensor, Region(4, 0, 4, 0, 4), b"", 1)


def test_shared_tensors_names_the_first_tensor_two_pieces_name():
    pieces = [_piece("a", "param", "f", "a"), _piece("b", "param", "f", "b")]
    assert shared_tensors(pieces) == []
    assert shared_tensors(pieces, [_piece("c", "param", "g", "a")]) == []  # another file
    found = shared_tensors(pieces, [_piece("c", "param", "f", "b")])
    assert found == [
        "file 'f' tensor 'b' is read by two pieces, of param 'b' state 'param' and of param "
        "'c' state 'param' (each piece is a tensor of its own)"
    ]
