"""The column-wise piece store (:class:`muonckpt.format.records.PieceTable`), the grouping by
tensor over it (:class:`muonckpt.format.manifest.PieceIndex`) and the merge of ranks' reports
into one table in (file, tensor) order (:class:`muonckpt.files._reports.Reports`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muonckpt.files._reports import Reports, Written
from muonckpt.format.manifest import Piece, PieceIndex, PieceTable
from muonckpt.format.names import tensor_key
from muonckpt.layout.topology import Region

BIG = 1 << 40  # bounds past 32 bits (a tensor of more than 2**31 elements)


@st.composite
def pieces(draw) -> list[Piece]:
    """Pieces with default and renamed tensor keys, one or several checksums, large bounds."""
    out = []
    for _ in range(draw(st.integers(0, 12))):
        param = draw(st.sampled_from(["w", "layers.0.w", "embed", "x" * 80]))
        key = draw(st.sampled_from(["momentum_buffer", "exp_avg", "param"]))
        tensor = draw(st.sampled_from([tensor_key(param, key), "renamed.t", "w"]))
        start = draw(st.integers(0, BIG))
        region = Region(BIG, draw(st.integers(0, 3)), 2, start, start + draw(st.integers(0, 9)))
        digests = draw(st.binary(min_size=8, max_size=24).map(lambda b: b[: len(b) // 8 * 8]))
        file = draw(st.sampled_from(["rank-00000-of-00002.safetensors", "optimizer.safetensors"]))
        out.append(Piece(param, key, file, tensor, region, digests, draw(st.integers(1, BIG))))
    return out


@settings(max_examples=60, deadline=None)
@given(pieces())
def test_a_table_gives_back_every_piece_as_it_was_given(given_pieces):
    table = PieceTable(given_pieces)
    assert len(table) == len(given_pieces)
    assert list(table) == given_pieces
    assert table == tuple(given_pieces) and tuple(given_pieces) == table
    assert [table[i] for i in range(-len(table), 0)] == given_pieces
    assert table[1:3] == tuple(given_pieces[1:3])
    assert list(table.placed()) == [(p.file, p.tensor) for p in given_pieces]
    with pytest.raises(IndexError):
        table[len(table)]


def test_a_table_differs_from_other_pieces_and_is_not_hashable():
    region = Region(4, 0, 4, 0, 4)
    a = Piece("w", "exp_avg", "f.safetensors", "state.w.exp_avg", region, b"\0" * 8, 16)
    b = Piece("w", "exp_avg", "f.safetensors", "state.w.exp_avg", region, b"\1" * 8, 16)
    assert PieceTable([a]) != PieceTable([b]) and PieceTable([a]) != PieceTable([a, a])
    assert PieceTable([a]) != "a"
    with pytest.raises(TypeError):
        hash(PieceTable([a]))


def _piece(param: str, key: str, file: str, start: int) -> Piece:
    region = Region(8, 0, 8, start, start + 4)
    return Piece(param, key, file, tensor_key(param, key), region, bytes(8), 4 << 20)


def test_a_piece_index_groups_rows_and_extra_pieces_by_tensor():
    table = PieceTable(
        [
            _piece("w", "exp_avg", "a", 0),
            _piece("v", "exp_avg", "a", 0),
            _piece("w", "exp_avg", "b", 4),
        ]
    )
    model = [_piece("buffer", "param", "a", 0)]
    index = PieceIndex(table, model)
    assert index["w", "exp_avg"] == (table[0], table[2])
    assert index["v", "exp_avg"] == (table[1],)
    assert index["buffer", "param"] == (model[0],)
    assert index["w", "exp_avg_sq"] == () and index["u", "exp_avg"] == ()


def test_reports_merge_into_file_then_tensor_order(tmp_path):
    """Two ranks that wrote parts of two files, reported out of order: one table in the order
    of the files' first mention, tensor keys sorted within a file; one rank's own table kept."""
    first = [_piece("w", "exp_avg", "b", 0), _piece("a", "exp_avg", "a", 0)]
    second = [_piece("v", "exp_avg", "b", 0), _piece("c", "exp_avg", "a", 0)]
    reports = [
        Written(["b", "a"], PieceTable(first), {}, sizes={"a": 1, "b": 2}),
        Written(["b", "a"], PieceTable(second), {}, sizes={}),
    ]
    merged = Reports.merged(reports, tmp_path)
    assert [(p.file, p.tensor) for p in merged.pieces] == [
        ("b", "state.v.exp_avg"),
        ("b", "state.w.exp_avg"),
        ("a", "state.a.exp_avg"),
        ("a", "state.c.exp_avg"),
    ]
    alone = Written(["a"], PieceTable([second[1]]), {}, sizes={"a": 1})
    assert Reports.merged([alone], tmp_path).pieces is alone.pieces
