"""A corruption matrix on real checkpoints: verify reports every damage, load never misbehaves.

Two checkpoints are saved once per module at dp=2 x tp=2 (one per-rank, one consolidated); each
test damages its own copy. For every damage ``muonckpt.verify`` must return CheckpointErrors
naming the damaged file (and param where there is one), and ``muonckpt.load`` into a plain
single-process optimizer must raise a MuonCkptError, never another exception and never succeed
silently. Damage that load legitimately never reads (an extra file, a lying topology field) is
caught by verify only; there load must still succeed and restore exactly the clean state.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import muonckpt
import muonckpt.offline
from muonckpt import CheckpointError, MuonCkptError, storage
from muonckpt.distributed.launch import run_distributed
from muonckpt.format.manifest import FORMAT_VERSION
from muonckpt.format.names import tensor_key as stored_key

from .ckpt_cases import save_phase
from .fixture_model import SHAPES, build, initial_params, train

STEPS = 2
KINDS = ("per-rank", "consolidated")
MANIFEST = "manifest.json"


def save_both(steps: int, root: str) -> None:
    """Both kinds from one launch (half the process start-up of two launches)."""
    for kind in KINDS:
        save_phase(2, 2, steps, f"{root}/{kind}", kind == "consolidated")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("saved")
    run_distributed(save_both, 4, STEPS, str(root), timeout=120)
    for kind in KINDS:
        assert muonckpt.verify(root / kind) == [], kind
    return {kind: root / kind for kind in KINDS}


@pytest.fixture(scope="module")
def clean_states(saved) -> dict[str, dict]:
    return {kind: _load(path) for kind, path in saved.items()}


@pytest.fixture(params=KINDS)
def ckpt(request, saved, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(saved[request.param], copy)
    return copy


def _load(path: Path) -> dict:
    opt, *_ = build(1, 1, initial_params())
    muonckpt.load(opt, path)
    return opt.state_dict()


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, entries in want["state"].items():
        assert got["state"][index].keys() == entries.keys()
        for key, value in entries.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def _manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / MANIFEST).read_text())


def _write_manifest(ckpt: Path, body: dict) -> None:
    (ckpt / MANIFEST).write_text(json.dumps(body, indent=1))


def _kind(ckpt: Path) -> str:
    return _manifest(ckpt)["kind"]


def _names(body: dict) -> list[str]:
    """The params' names of a manifest's text (version 4: ``[shared, rest, kind]``, the name
    the first ``shared`` characters of the previous one and then ``rest``)."""
    names = [""]
    for shared, rest, _ in body["params"]:
        names.append(names[-1][:shared] + rest)
    return names[1:]


def _pieces(ckpt: Path) -> list[dict]:
    """Every piece in the version 2 form, read from the piece indexes (version 3 on)."""
    body = _manifest(ckpt)
    names = _names(body)
    found = []
    for index in body["indexes"]:
        for at, key, tensor, _, _, sums in json.loads((ckpt / index["name"]).read_text())["pieces"]:
            stored = tensor or stored_key(names[at], key)
            found.append(
                {
                    "param": names[at],
                    "key": key,
                    "file": index["file"],
                    "tensor": stored,
                    "checksums": sums,
                    "index": index["name"],
                }
            )
    return found


def _piece(ckpt: Path, param: str = "w_in") -> dict:
    return next(p for p in _pieces(ckpt) if p["param"] == param)


def _edit_index(ckpt: Path, name: str, edit: Callable[[list], None]) -> None:
    """Edit the rows of piece index ``name``, the manifest's record of it (size, checksum,
    count) made to agree: a lie the index's own checksum does not catch."""
    path = ckpt / name
    body = json.loads(path.read_text())
    edit(body["pieces"])
    path.write_text(json.dumps(body))
    manifest = _manifest(ckpt)
    entry = next(i for i in manifest["indexes"] if i["name"] == name)
    entry.update(bytes=path.stat().st_size, checksum=storage.chunk_digest(path.read_bytes()))
    entry["pieces"] = len(body["pieces"])
    _write_manifest(ckpt, manifest)


def _as_version_2(ckpt: Path) -> None:
    """Rewrite a checkpoint's manifest as format version 2 wrote it (its pieces in it)."""
    manifest = muonckpt.read_manifest(ckpt)
    (ckpt / MANIFEST).write_text(dataclasses.replace(manifest, format_version=2).to_json())
    for index in manifest.indexes:
        (ckpt / index.name).unlink()


def _param_kind(ckpt: Path, param: str, change: Callable[[dict], None]) -> None:
    """Give ``param`` a kind of its own (the params table), changed by ``change``."""
    body = _manifest(ckpt)
    row = body["params"][_names(body).index(param)]
    kind = json.loads(json.dumps(body["param_kinds"][row[-1]]))
    change(kind)
    body["param_kinds"].append(kind)
    row[-1] = len(body["param_kinds"]) - 1
    _write_manifest(ckpt, body)


def _header(path: Path) -> tuple[int, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, raw[8 : 8 + length]


def _flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))


# Each damage edits a checkpoint copy in place and returns (file the errors must name, param
# they must name or None).
Damage = Callable[[Path], tuple[str, str | None]]


def flip_tensor_data(ckpt: Path) -> tuple[str, str | None]:
    piece = _piece(ckpt)
    path = ckpt / piece["file"]
    length, header = _header(path)
    begin, end = json.loads(header)[piece["tensor"]]["data_offsets"]
    _flip(path, 8 + length + (begin + end) // 2)
    return piece["file"], "w_in"


def _header_flip(anchor: Callable[[bytes, str], int], param: str | None) -> Damage:
    def damage(ckpt: Path) -> tuple[str, str | None]:
        piece = _piece(ckpt)
        path = ckpt / piece["file"]
        _, header = _header(path)
        _flip(path, anchor(header, piece["tensor"]))
        return piece["file"], param

    damage.__name__ = f"flip_header_{anchor.__name__}"
    return damage


def length_prefix(header: bytes, tensor: str) -> int:
    return 0


def tensor_key(header: bytes, tensor: str) -> int:
    return 8 + header.index(f'"{tensor}"'.encode()) + len('"state.')


def dtype_string(header: bytes, tensor: str) -> int:
    return 8 + header.index(b'"dtype":"', header.index(tensor.encode())) + len('"dtype":"')


def data_offsets(header: bytes, tensor: str) -> int:
    at = header.index(b'"data_offsets":[', header.index(tensor.encode()))
    return 8 + header.index(b"]", at) - 1  # last digit of the end offset


def closing_brace(header: bytes, tensor: str) -> int:
    return 8 + header.rstrip(b" ").rindex(b"}")


def truncate_file(ckpt: Path) -> tuple[str, str | None]:
    piece = _piece(ckpt)
    path = ckpt / piece["file"]
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 5])
    return piece["file"], None


def remove_data_file(ckpt: Path) -> tuple[str, str | None]:
    per_rank = _kind(ckpt) == "per-rank"
    name = "rank-00001-of-00004.safetensors" if per_rank else "optimizer.safetensors"
    (ckpt / name).unlink()
    return name, None


def grow_shape(ckpt: Path) -> tuple[str, str | None]:
    rows, cols = SHAPES["w_in"]
    index = _piece(ckpt, "w_in")["index"]
    _param_kind(ckpt, "w_in", lambda kind: kind.update(shape=[2 * rows, cols]))
    # per rank: a region of the index past the grown shape's rows; consolidated: a gap
    return (index if _kind(ckpt) == "per-rank" else MANIFEST), "w_in"


def remove_piece(ckpt: Path) -> tuple[str, str | None]:
    piece = _piece(ckpt, "w_out")
    at = _names(_manifest(ckpt)).index("w_out")
    _edit_index(ckpt, piece["index"], lambda rows: rows.remove(next(r for r in rows if r[0] == at)))
    return MANIFEST, "w_out"


def duplicate_piece(ckpt: Path) -> tuple[str, str | None]:
    piece = _piece(ckpt, "embed")
    at = _names(_manifest(ckpt)).index("embed")
    _edit_index(ckpt, piece["index"], lambda rows: rows.append(next(r for r in rows if r[0] == at)))
    return MANIFEST, "embed"


def change_dtype(ckpt: Path) -> tuple[str, str | None]:
    _param_kind(ckpt, "norm", lambda kind: kind["dtypes"].update(exp_avg="F16"))
    return _piece(ckpt, "norm")["file"], "norm"


def unknown_dtype(ckpt: Path) -> tuple[str, str | None]:
    """A dtype no safetensors file holds (the fuzz test's ``F32`` -> ``G32``): refused when the
    manifest is read, not a KeyError where a piece index is parsed."""
    _param_kind(ckpt, "norm", lambda kind: kind["dtypes"].update(exp_avg="G32"))
    return MANIFEST, "exp_avg"


def newer_format_version(ckpt: Path) -> tuple[str, str | None]:
    body = _manifest(ckpt)
    body["format_version"] = 99
    _write_manifest(ckpt, body)
    return MANIFEST, None


def other_checksum_algorithm(ckpt: Path) -> tuple[str, str | None]:
    body = _manifest(ckpt)
    body["checksum_algorithm"] = "crc32"
    _write_manifest(ckpt, body)
    return MANIFEST, None


def malformed_checksum(ckpt: Path) -> tuple[str, str | None]:
    piece = next(p for p in _pieces(ckpt) if p["checksums"])

    def malform(rows: list) -> None:
        row = next(r for r in rows if r[5])
        row[5] = "G" + row[5][1:]  # not a hex digit

    _edit_index(ckpt, piece["index"], malform)
    return piece["index"], None


def invalid_json(ckpt: Path) -> tuple[str, str | None]:
    text = (ckpt / MANIFEST).read_text()
    (ckpt / MANIFEST).write_text(text[: len(text) // 2])
    return MANIFEST, None


def missing_manifest(ckpt: Path) -> tuple[str, str | None]:
    (ckpt / MANIFEST).unlink()  # what an interrupted save looks like: data files, no marker
    return MANIFEST, None


DAMAGES: list[Damage] = [
    flip_tensor_data,
    _header_flip(length_prefix, None),
    _header_flip(tensor_key, "w_in"),
    _header_flip(dtype_string, "w_in"),
    _header_flip(data_offsets, "w_in"),
    _header_flip(closing_brace, None),
    truncate_file,
    remove_data_file,
    grow_shape,
    remove_piece,
    duplicate_piece,
    change_dtype,
    unknown_dtype,
    newer_format_version,
    other_checksum_algorithm,
    malformed_checksum,
    invalid_json,
    missing_manifest,
]


@pytest.mark.dist
@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__)
def test_damage_is_reported_by_verify_and_refused_by_load(ckpt, damage):
    file, param = damage(ckpt)
    problems = muonckpt.verify(ckpt)
    assert problems, "verify found nothing"
    assert all(isinstance(p, CheckpointError) for p in problems)
    text = "\n".join(map(str, problems))
    assert file in text
    if param is not None:
        assert param in text
    opt, *_ = build(1, 1, initial_params())
    with pytest.raises(MuonCkptError) as caught:
        muonckpt.load(opt, ckpt)
    assert file in str(caught.value)


@pytest.mark.dist
def test_newer_format_version_is_named_in_the_error(ckpt):
    newer_format_version(ckpt)
    (problem,) = muonckpt.verify(ckpt)
    assert "format version 99" in str(problem)
    with pytest.raises(CheckpointError, match="upgrade muonckpt"):
        muonckpt.load(build(1, 1, initial_params())[0], ckpt)


@pytest.mark.dist
def test_missing_manifest_reads_as_incomplete(ckpt):
    missing_manifest(ckpt)
    (problem,) = muonckpt.verify(ckpt)
    assert "incomplete" in str(problem)


@pytest.mark.dist
def test_extra_file_is_reported_by_verify_and_ignored_by_load(ckpt, clean_states):
    (ckpt / "notes.txt").write_text("not part of the checkpoint")
    problems = muonckpt.verify(ckpt)
    assert len(problems) == 1 and "notes.txt" in str(problems[0])
    assert "unknown file" in str(problems[0])
    # load reads only the files the manifest lists: the stray file cannot change its result
    _assert_same_state(_load(ckpt), clean_states[_kind(ckpt)])


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["per-rank"])
def test_lying_topology_is_reported_by_verify_and_ignored_by_load(
    saved, clean_states, tmp_path, kind
):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[kind], ckpt)
    body = _manifest(ckpt)
    body["topology"]["dp"] = 3
    _write_manifest(ckpt, body)
    problems = muonckpt.verify(ckpt)
    assert problems and all(isinstance(p, CheckpointError) for p in problems)
    assert MANIFEST in str(problems[0]) and "topology" in str(problems[0])
    # topology is descriptive only: load places data by each piece's region, so it is exact
    _assert_same_state(_load(ckpt), clean_states[kind])


def _swapped(name: str) -> list[int]:
    """The param's shape reversed: the same numel, another shape (the fixture's are not square)."""
    shape = list(reversed(SHAPES[name]))
    assert shape != list(SHAPES[name])
    return shape


@pytest.mark.dist
def test_same_numel_shape_edit_is_refused_by_load(ckpt):
    _param_kind(ckpt, "w_out", lambda kind: kind.update(shape=_swapped("w_out")))
    with pytest.raises(CheckpointError, match="w_out"):
        muonckpt.load(build(1, 1, initial_params())[0], ckpt)


@pytest.mark.dist
def test_same_numel_shape_edit_is_reported_by_verify(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["per-rank"], ckpt)
    _param_kind(ckpt, "w_out", lambda kind: kind.update(shape=_swapped("w_out")))
    assert muonckpt.verify(ckpt)


@pytest.mark.dist
@pytest.mark.parametrize("shape", [[5, 64], [1, 320]])
def test_a_dim_0_split_shape_edit_the_tp_blocks_do_not_cut_is_caught(saved, tmp_path, shape):
    """w_in (16, 20) is split on dim 0: at tp=2 its blocks are 160 elements, 8 rows of 20; a
    shape whose rows the blocks do not hold whole (5 or 1 rows for 2 blocks) is refused."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["per-rank"], ckpt)
    _param_kind(ckpt, "w_in", lambda kind: kind.update(shape=shape))
    problems = "\n".join(map(str, muonckpt.verify(ckpt)))
    assert "w_in" in problems and "lies outside param shape" in problems, problems
    with pytest.raises(CheckpointError, match="w_in"):
        muonckpt.load(build(1, 1, initial_params())[0], ckpt)


@pytest.mark.dist
def test_a_dim_0_split_shape_edit_the_tp_blocks_cut_alike_is_a_known_limit(saved, tmp_path):
    """(20, 16) for (16, 20): the same flat runs cut at the same rows-of-elements, every piece
    fits either shape and no file records another, so verify cannot tell (docs/reliability.md);
    a load refuses it, the optimizer's param being (16, 20)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["per-rank"], ckpt)
    _param_kind(ckpt, "w_in", lambda kind: kind.update(shape=[20, 16]))
    assert muonckpt.verify(ckpt) == []
    with pytest.raises(CheckpointError, match="w_in"):
        muonckpt.load(build(1, 1, initial_params())[0], ckpt)


def _single_process_opt(steps: int):
    opt, sharded, dp_rank, tp_rank = build(1, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, steps)
    return opt


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_save_over_existing_needs_overwrite(tmp_path):
    target = tmp_path / "ckpt"
    muonckpt.save(_single_process_opt(1), target)
    before = _snapshot(target)
    newer = _single_process_opt(2)
    with pytest.raises(CheckpointError, match="already exists"):
        muonckpt.save(newer, target)
    assert _snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

    muonckpt.save(newer, target, overwrite=True)
    assert _snapshot(target) != before
    assert muonckpt.verify(target) == []
    assert muonckpt.read_manifest(target).step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging / old dirs left
    _assert_same_state(_load(target), newer.state_dict())


@pytest.mark.parametrize("consolidated", [False, True], ids=["per-rank", "consolidated"])
@pytest.mark.parametrize(
    ("dropped", "problem"),
    [
        ("state", "does not hold exactly the state collected (left out: [("),
        ("param", "does not hold exactly the state collected (left out: [("),
    ],
    ids=["a state tensor", "a param's values"],
)
def test_a_save_whose_pieces_miss_a_tensor_commits_nothing(
    tmp_path, monkeypatch, consolidated, dropped, problem
):
    """(issue 22, part 2) Coverage is checked before the commit, as DCP validates its global
    plan before writing: a plan that leaves a tensor out (one write dropped: of a state
    tensor, or of a param's own values) fails the save naming what is missing, and the
    previous checkpoint stays whole; before, it was committed and only a later verify or load
    found the hole."""
    import muonckpt.checkpoint.saving as saving

    target = tmp_path / "ckpt"
    muonckpt.save(_single_process_opt(1), target, consolidated=consolidated)
    before = _snapshot(target)
    make = saving.consolidated_plan if consolidated else saving.rank_plan

    def short_of_one(*args, **kwargs):
        plan = make(*args, **kwargs)
        drop = next(w for w in plan.writes if (w.key == "param") == (dropped == "param"))
        return type(plan)(plan.files, tuple(w for w in plan.writes if w is not drop))

    monkeypatch.setattr(saving, make.__name__, short_of_one)
    with pytest.raises(CheckpointError, match="nothing was committed") as caught:
        muonckpt.save(_single_process_opt(2), target, consolidated=consolidated, overwrite=True)
    assert problem in str(caught.value)
    assert _snapshot(target) == before
    assert muonckpt.read_manifest(target).step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("consolidated", [False, True], ids=["per-rank", "consolidated"])
def test_a_manifest_short_of_a_piece_is_not_committed(tmp_path, monkeypatch, consolidated):
    """(issue 22, part 2) The root checks the coverage of the manifest it is about to commit
    (every listed tensor stored exactly once, as a reader requires): a piece lost between the
    ranks' writes and the commit (here, dropped from the manifest) fails the save, and the
    previous checkpoint stays whole."""
    import dataclasses

    from muonckpt.files import writing

    target = tmp_path / "ckpt"
    muonckpt.save(_single_process_opt(1), target, consolidated=consolidated)
    before = _snapshot(target)
    complete = writing.complete

    def short_of_a_piece(*args, **kwargs):
        manifest = complete(*args, **kwargs)
        return dataclasses.replace(manifest, pieces=manifest.pieces[1:])

    monkeypatch.setattr(writing, "complete", short_of_a_piece)
    with pytest.raises(CheckpointError, match=r"stored nowhere \(gap\); nothing was committed"):
        muonckpt.save(_single_process_opt(2), target, consolidated=consolidated, overwrite=True)
    assert _snapshot(target) == before
    assert muonckpt.read_manifest(target).step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.dist
def test_format_doc_reader_reassembles_every_tensor(saved):
    """The plain-Python reader in docs/format.md §9 matches the consolidated file exactly."""
    doc = (Path(__file__).parents[1] / "docs" / "format.md").read_text()
    code = doc.split("## 9.")[1].split("```python\n")[1].split("```")[0]
    reader: dict = {"__name__": "format_doc_reader"}
    exec(compile(code, "docs/format.md", "exec"), reader)
    want = {}
    for file in ("optimizer.safetensors", "model.safetensors"):
        with safe_open(saved["consolidated"] / file, "pt") as f:
            want.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    for kind in KINDS:
        for entry in muonckpt.read_manifest(saved[kind]).params:
            assert entry.value_dtype is not None
            for key in entry.tensor_keys:
                shape, values = reader["reassemble"](str(saved[kind]), entry.name, key)
                expected = want[stored_key(entry.name, key)]
                assert tuple(shape) == tuple(expected.shape)
                assert torch.equal(torch.tensor(values, dtype=expected.dtype), expected.flatten())


def _flat_params(opt) -> list[torch.Tensor]:
    return [p.detach().clone() for g in opt.param_groups for p in g["params"]]


def test_params_false_saves_state_only_and_a_default_load_says_so(tmp_path):
    trained = _single_process_opt(2)
    target = muonckpt.save(trained, tmp_path / "ckpt", params=False)
    manifest = muonckpt.read_manifest(target)
    assert not manifest.has_values and all(p.value_dtype is None for p in manifest.params)
    assert not any(piece.key == "param" for piece in manifest.pieces)
    fresh, *_ = build(1, 1, initial_params())
    before = _flat_params(fresh)
    with pytest.raises(CheckpointError, match="params=False"):
        muonckpt.load(fresh, target)
    assert all(torch.equal(a, b) for a, b in zip(before, _flat_params(fresh)))  # untouched
    assert not fresh.state
    muonckpt.load(fresh, target, params=False)
    _assert_same_state(fresh.state_dict(), trained.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before, _flat_params(fresh)))


def test_version_1_checkpoint_loads_state_only_or_says_why(tmp_path):
    """A checkpoint as format version 1 wrote it: no value_dtype, no values."""
    trained = _single_process_opt(2)
    target = muonckpt.save(trained, tmp_path / "ckpt", params=False)
    _as_version_2(target)
    body = _manifest(target)
    body["format_version"] = 1
    for param in body["params"]:
        dtypes = param.pop("dtypes")
        assert not param.pop("scalars")
        param["state_keys"] = sorted(dtypes)
        param["dtype"] = dtypes[param["state_keys"][0]]
    _write_manifest(target, body)
    assert muonckpt.verify(target) == []
    fresh, *_ = build(1, 1, initial_params())
    with pytest.raises(CheckpointError, match=r"format version 1.*params=False"):
        muonckpt.load(fresh, target)
    muonckpt.load(fresh, target, params=False)
    _assert_same_state(fresh.state_dict(), trained.state_dict())
    out = muonckpt.offline.consolidate(target, tmp_path / "c")
    assert muonckpt.read_manifest(out).format_version == FORMAT_VERSION
    assert muonckpt.verify(out) == []


def test_load_restores_params_into_an_optimizer_built_from_zeros(tmp_path):
    trained = _single_process_opt(2)
    target = muonckpt.save(trained, tmp_path / "ckpt")
    zeros = {name: torch.zeros_like(value) for name, value in initial_params().items()}
    fresh, *_ = build(1, 1, zeros)
    muonckpt.load(fresh, target)
    assert all(torch.equal(a, b) for a, b in zip(_flat_params(trained), _flat_params(fresh)))


def test_reserved_state_key_and_colliding_names_are_refused_before_writing(tmp_path):
    opt = _single_process_opt(1)
    p = opt.param_groups[0]["params"][0]
    opt.state[p]["param"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="reserved"):
        muonckpt.save(opt, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    clash = muonckpt.optim.muon.Muon(
        [
            {"params": [("w", torch.zeros(2, 2))], "use_muon": True},
            {"params": [("state.w.momentum_buffer", torch.zeros(4))]},
        ]
    )
    with pytest.raises(
        CheckpointError, match=re.escape("both be stored as 'state.w.momentum_buffer'")
    ):
        muonckpt.save(clash, tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def reserved_key_on_rank_1(path: str) -> str | None:
    """(gloo child, 2 x 2) Only rank 1's state has the reserved key."""
    import torch.distributed as dist

    opt, sharded, dp_rank, tp_rank = build(2, 2, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 1)
    if dist.get_rank() == 1:
        opt.state[opt.param_groups[0]["params"][0]]["param"] = torch.zeros(1)
    try:
        muonckpt.save(opt, path)
    except CheckpointError as exc:
        return str(exc)
    return None


@pytest.mark.dist
def test_a_problem_on_one_rank_fails_every_rank_before_writing(tmp_path):
    messages = run_distributed(reserved_key_on_rank_1, 4, str(tmp_path / "ckpt"), timeout=60)
    assert all(m is not None and "reserved" in m for m in messages)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.dist
def test_a_symlinked_data_file_is_reported_and_refused(ckpt, tmp_path):
    data = next(p for p in ckpt.iterdir() if p.suffix == ".safetensors")
    elsewhere = tmp_path / "elsewhere.safetensors"
    data.rename(elsewhere)
    data.symlink_to(elsewhere)
    problems = muonckpt.verify(ckpt)
    assert any("is a symlink" in str(p) and data.name in str(p) for p in problems)
    with pytest.raises(CheckpointError, match="is a symlink"):
        _load(ckpt)


@pytest.mark.dist
def test_same_numel_shape_edit_of_an_unsplit_param_is_caught_in_a_consolidated_checkpoint(
    saved, tmp_path
):
    """Unsplit, the regions are flat ranges that fit either shape: the full-shape headers of a
    consolidated checkpoint are what tells."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["consolidated"], ckpt)
    _param_kind(ckpt, "w_mid", lambda kind: kind.update(shape=_swapped("w_mid")))
    said = f"header says shape {SHAPES['w_mid']}"
    assert any(said in str(p) for p in muonckpt.verify(ckpt))
    with pytest.raises(CheckpointError, match="w_mid"):
        muonckpt.offline.consolidate(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_replaced_while_read_says_so_not_missing_file(tmp_path):
    """A reader that opened a per-rank checkpoint, replaced meanwhile by a consolidated one (other
    files): the race is named, not reported as damage."""
    from muonckpt.files.pieces import PieceReader, open_checkpoint
    from muonckpt.layout.topology import whole_region

    target = muonckpt.save(_single_process_opt(1), tmp_path / "ckpt")
    directory, manifest = open_checkpoint(target)
    muonckpt.save(_single_process_opt(2), target, consolidated=True, overwrite=True)
    entry = manifest.params[0]
    pieces = [p for p in manifest.pieces if p.param == entry.name and p.key == "param"]
    with (
        PieceReader(directory, manifest) as reader,
        pytest.raises(CheckpointError, match="changed while reading"),
    ):
        reader.gather(pieces, entry, "param", whole_region(entry.numel))
