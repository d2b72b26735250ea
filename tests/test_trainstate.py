"""The training job's own state (``extra=``, ``rank_extra=``) in the same commit as the
optimizer's: round trips through save, async_save and load (one process, and gloo worlds at the
same and at another number of ranks), the checks on what may be stored and asked for, the
manifest's strictness about it, verify, inspect and the offline tools carrying it."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import muonckpt
from muonckpt.cli import app
from muonckpt.distributed.launch import run_distributed
from muonckpt.format.manifest import piece_to_json
from muonckpt.offline import consolidate, convert, reshard

from .fixture_model import build, initial_params, single_process_optimizer, train


def torch_job(seed: int):
    """torch.optim.Muon for the matrices and AdamW for the rest, each with an LR scheduler."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim != 2]
    muon = torch.optim.Muon(matrices, lr=0.05)
    adamw = torch.optim.AdamW(vectors, lr=0.01)
    schedulers = {
        "muon": torch.optim.lr_scheduler.StepLR(muon, step_size=2, gamma=0.5),
        "adamw": torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=10),
    }
    return model, [muon, adamw], schedulers


def train_steps(model, opts, schedulers, steps: int) -> None:
    """Steps on data drawn from torch's global generator (so a resume needs its state)."""
    for _ in range(steps):
        x = torch.randn(4, 6)
        loss = model(x).square().mean()
        model.zero_grad()
        loss.backward()
        for opt in opts:
            opt.step()
        for scheduler in schedulers.values():
            scheduler.step()


def test_extra_round_trips_and_the_resume_is_bitwise(tmp_path):
    model, opts, schedulers = torch_job(0)
    train_steps(model, opts, schedulers, 3)
    tensors = {
        "ema": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }
    extra = {
        "step": 3,
        "schedulers": schedulers,
        "data": {"epoch": 0, "batch": 3, "files": ["a", "b"]},
        "tensors": tensors,
        "nested": [1, (2.5, None), {"k": torch.tensor(7)}],
    }
    muonckpt.save(opts, tmp_path / "ckpt", extra=extra, rank_extra={"rng": muonckpt.RNGState()})
    train_steps(model, opts, schedulers, 3)  # the uninterrupted run
    reference = [p.detach().clone() for p in model.parameters()]

    model2, opts2, schedulers2 = torch_job(1)  # other weights, generators and schedules
    got = {"schedulers": schedulers2, "data": None}
    mine = {"rng": muonckpt.RNGState()}
    muonckpt.load(opts2, tmp_path / "ckpt", extra=got, rank_extra=mine)
    assert got["step"] == 3
    assert got["data"] == {"epoch": 0, "batch": 3, "files": ["a", "b"]}
    assert got["nested"][:2] == [1, [2.5, None]]
    assert torch.equal(got["nested"][2]["k"], torch.tensor(7))
    assert got["schedulers"] is schedulers2  # restored in place, by load_state_dict
    for name, scheduler in schedulers.items():
        assert schedulers2[name].last_epoch == 3
        assert scheduler.last_epoch == 6
    for name, tensor in tensors.items():
        assert got["tensors"][name].dtype == tensor.dtype
        assert torch.equal(got["tensors"][name], tensor)
    train_steps(model2, opts2, schedulers2, 3)
    for p, want in zip(model2.parameters(), reference, strict=True):
        assert torch.equal(p.detach(), want)


def test_the_step_is_recorded_for_every_family(tmp_path):
    """torch.optim.Muon counts no step: it comes from extra; AdamW's own count otherwise."""
    model, opts, schedulers = torch_job(0)
    train_steps(model, opts, schedulers, 2)
    muonckpt.save(opts[0], tmp_path / "muon")
    muonckpt.save(opts[0], tmp_path / "muon-extra", extra={"step": 40})
    muonckpt.save(opts[1], tmp_path / "adamw")
    muonckpt.save(single_process_optimizer(5), tmp_path / "packaged")
    steps = {
        name: json.loads((tmp_path / name / "manifest.json").read_text())["step"]
        for name in ("muon", "muon-extra", "adamw", "packaged")
    }
    assert steps == {"muon": None, "muon-extra": 40, "adamw": 2, "packaged": 5}
    assert muonckpt.latest(tmp_path).name == "muon-extra"
    shown = CliRunner().invoke(app, ["inspect", str(tmp_path / "muon-extra")])
    assert shown.exit_code == 0, shown.output
    assert "step 40" in shown.output and 'extra: {"step": 40}' in shown.output


def test_async_save_holds_the_extra_of_its_call(tmp_path):
    model, opts, schedulers = torch_job(0)
    train_steps(model, opts, schedulers, 1)
    marker = torch.full((3,), 1.0)
    future = muonckpt.async_save(
        opts, tmp_path / "ckpt", extra={"step": 1, "marker": marker, "schedulers": schedulers}
    )
    marker.fill_(2.0)  # training goes on: neither reaches the checkpoint
    train_steps(model, opts, schedulers, 2)
    future.result()
    got: dict = {}
    muonckpt.load(torch_job(1)[1], tmp_path / "ckpt", extra=got)
    assert torch.equal(got["marker"], torch.full((3,), 1.0))
    assert got["schedulers"]["muon"]["last_epoch"] == 1


@pytest.mark.parametrize(
    "value,message",
    [
        ({1: "a"}, "extra: key 1 is not a string"),
        ({"lr": float("nan")}, "extra['lr']: nan cannot be stored"),
        ({"f": object()}, "extra['f']: a object is neither a JSON value"),
        ({"x": [torch.zeros(2, dtype=torch.complex64)]}, "extra['x'][0]: dtype torch.complex64"),
        ({"step": -1}, "extra['step'] must be the training step"),
        ({"step": "10"}, "extra['step'] must be the training step"),
        ({"deep": json.loads("[" * 30 + "]" * 30)}, "nested deeper than 24 levels"),
        ("not a dict", "extra must be a dict of values"),
    ],
)
def test_what_extra_cannot_hold_is_refused_before_anything_is_written(tmp_path, value, message):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(muonckpt.CheckpointError, match=message.replace("[", r"\[")):
        muonckpt.save(opt, tmp_path / "ckpt", extra=value)
    assert list(tmp_path.iterdir()) == []


def test_load_refuses_what_the_checkpoint_lacks_before_anything_changes(tmp_path):
    model, opts, schedulers = torch_job(0)
    train_steps(model, opts, schedulers, 1)
    muonckpt.save(opts, tmp_path / "plain")
    muonckpt.save(opts, tmp_path / "ckpt", extra={"step": 1, "data": {"batch": 1}})
    target = torch_job(1)[1]
    before = [p.detach().clone() for o in target for g in o.param_groups for p in g["params"]]
    cases = [
        (
            "ckpt",
            {"extra": {"data": {"batch": 0, "epoch": 0}}},
            r"\['data'\]\['epoch'\] is missing",
        ),
        ("ckpt", {"extra": {"scheduler": schedulers["muon"]}}, r"\['scheduler'\] is missing"),
        (
            "ckpt",
            {"extra": {"step": schedulers["muon"]}},
            r"\['step'\] was saved as int 1, not a state dict",
        ),
        ("ckpt", {"rank_extra": {"pos": 0}}, "holds no rank_extra"),
        ("plain", {"extra": {"step": 0}}, "holds no extra"),
    ]
    for name, arguments, message in cases:
        with pytest.raises(muonckpt.CheckpointError, match=message):
            muonckpt.load(target, tmp_path / name, **arguments)
        after = [p for o in target for g in o.param_groups for p in g["params"]]
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        assert all(not o.state for o in target)


def test_an_empty_extra_loads_a_checkpoint_saved_without_one(tmp_path):
    """One resume script for checkpoints with and without extra: an empty dict asks for no key."""
    model, opts, schedulers = torch_job(0)
    train_steps(model, opts, schedulers, 1)
    muonckpt.save(opts, tmp_path / "plain")
    extra: dict[str, object] = {}
    rank_extra: dict[str, object] = {}
    muonckpt.load(torch_job(1)[1], tmp_path / "plain", extra=extra, rank_extra=rank_extra)
    assert extra == {} and rank_extra == {}


def save_and_resume(ckpt: str, consolidated: bool, background: bool):
    """(2 gloo ranks) The fixture's packaged Muon at 2 x 1 saves extra and rank_extra, then a
    fresh optimizer at 1 x 2 loads them back."""
    rank = dist.get_rank()
    opt, sharded, d, t = build(2, 1, initial_params())
    train(opt, sharded, d, t, 0, 1)
    torch.manual_seed(100 + rank)  # each rank its own generator
    extra = {"step": 1, "lrs": [0.1, 0.2], "w": torch.arange(4.0)}
    rank_extra = {"rank": rank, "rng": muonckpt.RNGState(), "pos": torch.tensor([10 * rank])}
    saver = muonckpt.async_save if background else muonckpt.save
    done = saver(opt, ckpt, consolidated=consolidated, extra=extra, rank_extra=rank_extra)
    if background:
        done.result()
    expected = torch.rand(3)  # what the saved generator gives next
    opt2, *_ = build(1, 2, initial_params())
    torch.manual_seed(999)
    got, mine = {}, {"rng": muonckpt.RNGState()}
    muonckpt.load(opt2, ckpt, extra=got, rank_extra=mine)
    return {
        "extra": [got["step"], got["lrs"], got["w"].tolist()],
        "rank": [mine["rank"], mine["pos"].tolist()],
        "rng": torch.equal(torch.rand(3), expected),
    }


def load_at_one_rank(ckpt: str):
    """(1 gloo rank) extra loads at another number of ranks; rank_extra is refused."""
    opt, *_ = build(1, 1, initial_params())
    try:
        muonckpt.load(opt, ckpt, extra={}, rank_extra={})
    except muonckpt.CheckpointError as exc:
        refused = str(exc)
    got: dict = {}
    muonckpt.load(opt, ckpt, extra=got)
    return refused, got["lrs"]


@pytest.mark.dist
@pytest.mark.parametrize("consolidated,background", [(False, False), (True, True)])
def test_rank_extra_goes_back_to_its_rank(tmp_path, consolidated, background):
    ckpt = str(tmp_path / "ckpt")
    out = run_distributed(save_and_resume, 2, ckpt, consolidated, background, timeout=120)
    for rank, result in enumerate(out):
        assert result == {
            "extra": [1, [0.1, 0.2], [0.0, 1.0, 2.0, 3.0]],
            "rank": [rank, [10 * rank]],
            "rng": True,
        }
    assert muonckpt.verify(ckpt) == []
    ((refused, lrs),) = run_distributed(load_at_one_rank, 1, ckpt, timeout=120)
    assert "rank_extra was saved by 2 ranks and this load has 1" in refused
    assert lrs == [0.1, 0.2]


def disagreeing_save(ckpt: str):
    """(2 gloo ranks) Saves whose extra differ between the ranks, or that give rank_extra on
    one rank only; each rank's error."""
    rank = dist.get_rank()
    opt, sharded, d, t = build(2, 1, initial_params())
    train(opt, sharded, d, t, 0, 1)
    errors = []
    for arguments in (
        {"extra": {"rng": torch.tensor([rank])}},
        {"rank_extra": {} if rank else None},
    ):
        try:
            muonckpt.save(opt, ckpt, **arguments)
        except muonckpt.CheckpointError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.dist
def test_ranks_that_disagree_on_extra_save_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = run_distributed(disagreeing_save, 2, str(ckpt), timeout=120)
    for errors in out:
        assert len(errors) == 2
        assert (
            "disagree on extra (the same on every rank; per-rank values go in rank_extra)"
            in (errors[0])
        )
        assert "disagree on rank_extra given" in errors[1]
    assert not ckpt.exists()


def saved_with_extra(tmp_path: Path) -> Path:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    return muonckpt.save(
        opt,
        tmp_path / "ckpt",
        extra={"step": 1, "w": torch.arange(5)},
        rank_extra={"r": torch.ones(2)},
    )


def tampered(tmp_path: Path, change) -> Path:
    ckpt = saved_with_extra(tmp_path)
    body = json.loads((ckpt / "manifest.json").read_text())
    change(body)
    (ckpt / "manifest.json").write_text(json.dumps(body))
    return ckpt


def _tensor(body):
    return body["extra"]["global"]["tensors"][0]


MANIFEST_DAMAGE = [
    (lambda b: b.update(step=-3), "step must be a non-negative int"),
    (lambda b: b.update(step=True), "expected an int"),
    (lambda b: b["extra"].update(more=1), "extra has fields"),
    (lambda b: b["extra"]["global"]["values"].update(w=5), r"tensor path \['w'\] is not a null"),
    (lambda b: _tensor(b).update(path=[]), "a tensor with an empty path"),
    (lambda b: _tensor(b).update(path="w"), "a tensor's path must be a list"),
    (lambda b: b["extra"].update(files={}), "extra files must be a list"),
    (lambda b: _tensor(b).update(path=["w", 0]), "is not a null"),
    (lambda b: _tensor(b).update(dtype="F128"), "unknown dtype"),
    (lambda b: _tensor(b).update(checksums=[]), "0 checksums for 40 bytes"),
    (lambda b: _tensor(b).update(file="elsewhere.safetensors"), "unlisted file"),
    (lambda b: _tensor(b).update(size=1), "exactly the fields"),
    (lambda b: b["extra"]["files"][0].update(name="../x"), "not a plain file name"),
    (
        lambda b: b["extra"]["files"].append(
            {"name": b["files"][0]["name"], "bytes": b["files"][0]["bytes"]}
        ),
        "are the optimizer's files",
    ),
    (
        lambda b: b["extra"]["ranks"][0]["tensors"][0].update(file="extra.safetensors"),
        "share a file",
    ),
]


@pytest.mark.parametrize("change,message", MANIFEST_DAMAGE)
def test_the_manifest_extra_is_read_strictly(tmp_path, change, message):
    ckpt = tampered(tmp_path, change)
    with pytest.raises(muonckpt.CheckpointError, match=message):
        muonckpt.read_manifest(ckpt)
    assert len(muonckpt.verify(ckpt)) == 1


def test_verify_and_load_find_damaged_extra(tmp_path):
    ckpt = saved_with_extra(tmp_path)
    data = bytearray((ckpt / "extra.safetensors").read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor's data
    (ckpt / "extra.safetensors").write_bytes(bytes(data))
    problems = [str(p) for p in muonckpt.verify(ckpt)]
    assert len(problems) == 1 and "checksum" in problems[0], problems
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(muonckpt.CheckpointError, match="checksum"):
        muonckpt.load(opt, ckpt, extra={})
    assert not opt.state
    (ckpt / "extra-rank-00000-of-00001.safetensors").unlink()
    assert any("missing data file" in str(p) for p in muonckpt.verify(ckpt))


def test_the_offline_tools_carry_extra(tmp_path):
    ckpt = saved_with_extra(tmp_path)
    outputs = [
        consolidate(ckpt, tmp_path / "full"),
        reshard(ckpt, tmp_path / "resharded", dp=2, tp=1),
        convert(ckpt, tmp_path / "converted", to="torch"),
    ]
    for out in outputs:
        assert muonckpt.verify(out) == []
        got, mine = {}, {}
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
        muonckpt.load(opt, out, extra=got, rank_extra=mine)
        assert got["step"] == 1 and torch.equal(got["w"], torch.arange(5))
        assert torch.equal(mine["r"], torch.ones(2))
    shown = CliRunner().invoke(app, ["inspect", str(tmp_path / "resharded")])
    assert shown.exit_code == 0, shown.output
    assert 'extra: {"step": 1, "w": "<tensor I64 [5]>"}' in shown.output
    assert 'rank_extra: 1 ranks, rank 0: {"r": "<tensor F32 [2]>"}' in shown.output
    shutil.rmtree(tmp_path / "full")


@pytest.mark.cuda
def test_cuda_tensors_and_generators_round_trip(tmp_path):
    """extra tensors in CUDA memory, and the CUDA generators through RNGState."""
    model = torch.nn.Linear(4, 3).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    opt.step()
    torch.cuda.manual_seed(5)
    marker = torch.arange(6, device="cuda", dtype=torch.bfloat16)
    muonckpt.save(
        opt, tmp_path / "ckpt", extra={"marker": marker}, rank_extra={"rng": muonckpt.RNGState()}
    )
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(99)
    got, mine = {}, {"rng": muonckpt.RNGState()}
    muonckpt.load(opt, tmp_path / "ckpt", extra=got, rank_extra=mine)
    assert torch.equal(got["marker"], marker.cpu())  # restored in host memory
    assert len(mine["rng"].state_dict()["cuda"]) == torch.cuda.device_count()
    assert torch.equal(torch.rand(4, device="cuda"), expected)


TENSOR_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool)


@st.composite
def small_tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    values = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    return (values * draw(st.integers(-3, 3))).to(dtype)


LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5)
    | small_tensors()
)
TREES = st.dictionaries(
    st.text(max_size=4).filter(lambda key: key != "step"),  # extra["step"] must be a step
    st.recursive(
        LEAVES,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
        max_leaves=8,
    ),
    max_size=4,
)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


@settings(max_examples=40, deadline=None)
@given(TREES, TREES)
def test_any_tree_of_json_values_and_tensors_round_trips(extra, rank_extra):
    """Any keys (dots, slashes, empty, unicode), numbers, nesting and tensors (0-d, empty, any
    dtype) come back as saved, through the manifest and the files."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    with tempfile.TemporaryDirectory() as root:
        ckpt = muonckpt.save(opt, Path(root) / "ckpt", extra=extra, rank_extra=rank_extra)
        assert muonckpt.verify(ckpt) == []
        got, mine = {}, {}
        muonckpt.load(opt, ckpt, extra=got, rank_extra=mine)
    assert same(extra, got) and same(rank_extra, mine)


def test_a_value_shaped_like_a_manifest_piece_comes_back_as_saved(tmp_path):
    """The manifest's parser makes pieces of piece-shaped objects as it reads; a user's value
    of that shape in ``extra`` must come back as the plain JSON it was."""
    model, opts, schedulers = torch_job(0)
    train_steps(model, opts, schedulers, 1)
    plain = muonckpt.save(opts, tmp_path / "plain")
    piece = piece_to_json(muonckpt.read_manifest(plain).pieces[0])  # (version 3: an index's)
    muonckpt.save(opts, tmp_path / "ckpt", extra={"piece": piece, "pieces": [piece]})
    assert muonckpt.verify(tmp_path / "ckpt") == []
    restored = {"piece": None, "pieces": None}
    muonckpt.load(torch_job(1)[1], tmp_path / "ckpt", extra=restored)
    assert restored == {"piece": piece, "pieces": [piece]}


class _Versioned:
    """A stateful value whose ``load_state_dict`` refuses a state from a newer version."""

    def __init__(self, version: int) -> None:
        self.version = version

    def state_dict(self) -> dict:
        return {"version": self.version}

    def load_state_dict(self, state: dict) -> None:
        if state["version"] > 1:
            raise ValueError("saved by a newer version")
        self.version = state["version"]


def test_a_refused_load_state_dict_changes_nothing(tmp_path):
    """The job's state is restored all or nothing, before the optimizer changes: a stateful
    value that refuses leaves the optimizer, the params and the other values as they were."""
    model, opts, schedulers = torch_job(0)
    train_steps(model, opts, schedulers, 1)
    saved = {"step": 1, "scheduler": schedulers["muon"], "data": {"batch": 7}}
    muonckpt.save(opts, tmp_path / "ckpt", extra={**saved, "thing": _Versioned(5)})
    _, target, target_schedulers = torch_job(1)
    params = [p for o in target for g in o.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in params]
    scheduler = target_schedulers["muon"]
    for _ in range(3):
        scheduler.step()
    epoch = scheduler.last_epoch  # 3; the checkpoint's is 1
    trainer = {"step": 0, "scheduler": scheduler, "data": {"batch": 3}, "thing": _Versioned(0)}
    with pytest.raises(muonckpt.CheckpointError, match=r"\['thing'\]: its load_state_dict"):
        muonckpt.load(target, tmp_path / "ckpt", extra=trainer)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(not o.state for o in target)
    assert trainer["step"] == 0 and trainer["data"] == {"batch": 3}
    assert trainer["thing"].version == 0 and scheduler.last_epoch == epoch == 3


def test_a_manifest_no_reader_would_accept_is_never_committed(tmp_path, monkeypatch):
    """The writer holds the manifest to the reader's limit: past it the save fails and the
    checkpoint it would replace stays (here with the limit lowered to a few kB)."""
    model, opts, schedulers = torch_job(0)
    train_steps(model, opts, schedulers, 1)
    path = muonckpt.save(opts, tmp_path / "ckpt", extra={"step": 1})
    size = len((path / "manifest.json").read_bytes())
    monkeypatch.setattr(muonckpt.storage, "MAX_TEXT_BYTES", size + 1000)
    with pytest.raises(muonckpt.CheckpointError, match=r"more than the \d+ a reader accepts"):
        muonckpt.save(opts, path, extra={"step": 2, "note": "x" * 2000}, overwrite=True)
    assert muonckpt.read_manifest(path).recorded_step == 1
    assert muonckpt.verify(path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_the_manifests_step_is_the_step_the_save_recorded(tmp_path):
    """``Manifest.step`` is the manifest's ``"step"`` (what ``latest`` orders by), even for
    optimizers that count no step of their own (torch.optim.Muon)."""
    model, opts, schedulers = torch_job(0)
    train_steps(model, opts, schedulers, 1)
    path = muonckpt.save(opts[0], tmp_path / "ckpt", extra={"step": 7})
    assert json.loads((path / "manifest.json").read_text())["step"] == 7
    manifest = muonckpt.read_manifest(path)
    assert manifest.step == manifest.recorded_step == 7 and manifest.group_step is None
