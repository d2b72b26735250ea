"""A load reads only what verify accepts (issue 50, finding 1): a piece index whose regions were
edited, its checksum re-recorded in the manifest, is refused by ``load`` on every rank before
any byte is applied, naming the param, as ``verify`` reports it; and the one coverage check
both make (:func:`muonckpt.format.coverage.tensor_coverage`) agrees with counting elements."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import muonckpt
from muonckpt import CheckpointError, storage
from muonckpt.distributed.launch import run_distributed
from muonckpt.format.coverage import tensor_coverage
from muonckpt.format.manifest import ParamEntry, Piece
from muonckpt.layout.topology import Region, matrix_view, tp_region

from .fixture_model import build, initial_params, train

PARAM = "w_out"
"""12 x 24, split on dim 1: saved at 2 x 1 its values are two flat runs, one per rank file;
loaded at 1 x 2 each rank's column block has elements of both, so a run moved by one gives
each rank as many elements as it needs, shifted (what only coverage tells)."""

Bounds = list[int]  # [cols, block_start, block_width, start, stop], as an index row holds it


def _moved(by: int) -> Callable[[Bounds], None]:
    def edit(bounds: Bounds) -> None:
        bounds[3] += by
        bounds[4] += by

    return edit


def _stop(by: int) -> Callable[[Bounds], None]:
    def edit(bounds: Bounds) -> None:
        bounds[4] += by

    return edit


def _past_the_data(bounds: Bounds) -> None:
    rows = 12  # w_out is 12 x 24
    bounds[3], bounds[4] = rows * bounds[2], rows * bounds[2] + bounds[4] - bounds[3]


def _outside_the_tensor(bounds: Bounds) -> None:
    bounds[1] = bounds[0] - bounds[2] + 1  # the block one column past the last


EDITS: dict[str, tuple[str, Callable[[Bounds], None]]] = {
    # name: (the piece edited: the first run of block 0, or the last; the edit of its region)
    "moved by one": ("first", _moved(1)),
    "moved back by one": ("last", _moved(-1)),
    "overlap": ("first", _stop(1)),
    "gap": ("first", _stop(-1)),
    "past the data": ("first", _past_the_data),
    "outside the tensor": ("first", _outside_the_tensor),
}
"""Region edits of a piece of ``PARAM``'s values; each keeps the index well-formed JSON."""


def edit_index(ckpt: Path, case: str) -> None:
    """Edit one piece of ``PARAM``'s values in its piece index as ``case`` says, and record
    the index's new size and checksum in the manifest the way the writer computes them."""
    which, edit = EDITS[case]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    names = [""]
    for shared, rest, _ in manifest["params"]:  # version 4: front-coded names
        names.append(names[-1][:shared] + rest)
    at = names[1:].index(PARAM)
    rows = []
    for entry in manifest["indexes"]:
        body = json.loads((ckpt / entry["name"]).read_text())
        rows += [(entry, body, row) for row in body["pieces"] if row[:2] == [at, "param"]]
    block = sorted((r for r in rows if r[2][3][1] == 0), key=lambda r: r[2][3][3])
    entry, body, row = block[0] if which == "first" else block[-1]
    edit(row[3])
    text = json.dumps(body).encode()
    (ckpt / entry["name"]).write_bytes(text)
    entry.update(bytes=len(text), checksum=storage.chunk_digest(text))
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state and its params, copied."""
    tensors = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    for state in opt.state.values():
        tensors += [v.clone() for v in state.values() if torch.is_tensor(v)]
    return tensors


def _unchanged(before: list[torch.Tensor], opt: torch.optim.Optimizer) -> bool:
    after = _state(opt)
    return len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after))


def damaged_loads(root: str) -> dict[str, object]:
    """(gloo child) Save at 2 x 1, then (rank 0) a copy per edit, then load each at 1 x 2:
    the error each load raised here and whether the optimizer and params kept their values."""
    opt, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 2)
    muonckpt.save(opt, f"{root}/clean")
    if dist.get_rank() == 0:
        for case in EDITS:
            shutil.copytree(f"{root}/clean", f"{root}/{case}")
            edit_index(Path(root, case), case)
    dist.barrier()
    opt, sharded, dp_rank, tp_rank = build(1, 2, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 1)  # values the checkpoint does not hold
    found: dict[str, object] = {}
    for case in EDITS:
        before = _state(opt)
        try:
            muonckpt.load(opt, f"{root}/{case}")
            error = "no error"
        except CheckpointError as exc:
            error = str(exc)
        found[case] = (error, _unchanged(before, opt))
    return found


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> tuple[Path, list[dict[str, object]]]:
    root = tmp_path_factory.mktemp("coverage")
    ranks = run_distributed(damaged_loads, 2, str(root), timeout=120)
    return root, ranks


@pytest.mark.dist
@pytest.mark.parametrize("case", EDITS)
def test_an_edited_piece_region_is_reported_by_verify_and_refused_by_load_on_every_rank(
    loaded, case
):
    root, ranks = loaded
    problems = "\n".join(map(str, muonckpt.verify(root / case)))
    assert PARAM in problems, problems
    for rank, found in enumerate(ranks):
        error, unchanged = found[case]  # type: ignore[index]
        assert error.startswith("load (read): ") and PARAM in error, (rank, error)
        assert unchanged, rank
    errors = {found[case][0] for found in ranks}  # type: ignore[index]
    assert len(errors) == 1, errors  # one refusal, raised on every rank


@pytest.mark.dist
@pytest.mark.parametrize("case", EDITS)
def test_an_edited_piece_region_is_refused_by_a_load_in_one_process(loaded, case):
    """The load that reads every piece: the moved region's gap and overlap cancel in the
    count of elements read, and only coverage tells."""
    root, _ = loaded
    opt, *_ = build(1, 1, initial_params())
    before = _state(opt)
    with pytest.raises(CheckpointError, match=PARAM):
        muonckpt.load(opt, root / case)
    assert _unchanged(before, opt)
    muonckpt.load(opt, root / "clean")  # the same optimizer loads the clean checkpoint


# The coverage check against counting every element


@st.composite
def layouts(draw) -> tuple[ParamEntry, list[Piece]]:
    """A small param at some TP split, its pieces the runs a save writes (each TP block cut
    into runs), then maybe damaged: one piece moved, grown, shrunk, dropped or repeated, or a
    whole-width piece (a flat run) added."""
    shape = (draw(st.integers(1, 5)), draw(st.integers(1, 6)))
    split = draw(st.sampled_from([-1, 0, 1]))
    tp = draw(st.sampled_from([t for t in (1, 2, 3) if split < 0 or shape[split] % t == 0]))
    entry = ParamEntry("w", shape, split, 0, {"param": "F32"})
    rows, cols = matrix_view(shape, split)
    per_block = rows * cols // tp
    pieces = []
    for t in range(tp):
        cuts = sorted(draw(st.lists(st.integers(0, per_block), max_size=3)))
        for lo, hi in zip([0, *cuts], [*cuts, per_block], strict=True):
            region = tp_region(shape, split, tp, t, (lo, hi))
            pieces.append(Piece("w", "param", "f", "t", region, b"", 1))
    damage = draw(st.sampled_from(["none", "move", "grow", "shrink", "drop", "repeat", "flat"]))
    at = draw(st.integers(0, len(pieces) - 1))
    r = pieces[at].region
    by = draw(st.sampled_from([-1, 1]))
    changed = {
        "move": Region(r.cols, r.block_start, r.block_width, r.start + by, r.stop + by),
        "grow": Region(r.cols, r.block_start, r.block_width, r.start, r.stop + 1),
        "shrink": Region(r.cols, r.block_start, r.block_width, r.start, r.stop - 1),
    }.get(damage)
    if changed is not None and changed.start >= 0:
        pieces[at] = Piece("w", "param", "f", "t", changed, b"", 1)
    elif damage == "drop":
        del pieces[at]
    elif damage == "repeat":
        pieces.append(pieces[at])
    elif damage == "flat":
        lo = draw(st.integers(0, rows * cols - 1))
        flat = Region(rows * cols, 0, rows * cols, lo, draw(st.integers(lo, rows * cols)))
        pieces.append(Piece("w", "param", "f", "t", flat, b"", 1))
    return entry, pieces


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_coverage_finds_a_fault_where_an_element_is_not_stored_once(layout):
    entry, pieces = layout
    counts = np.zeros(entry.numel + 2 * max(entry.numel, 1), dtype=np.int64)
    for piece in pieces:
        for lo, hi in piece.region.intervals():
            counts[lo:hi] += 1
    found = tensor_coverage(entry, "param", pieces)
    sound = bool((counts[: entry.numel] == 1).all() and not counts[entry.numel :].any())
    assert (found == []) == sound, (found, [p.region for p in pieces])
    if found:  # the elements named are the ones at fault (where they lie inside the tensor)
        lo, hi = (int(x) for x in found[0].split("[")[1].split(")")[0].split(", "))
        named = counts[lo:hi] if lo < hi <= entry.numel else counts[:0]
        assert (named == 0).all() if "nowhere" in found[0] else (named >= 2).all(), found
