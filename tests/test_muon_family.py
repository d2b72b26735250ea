"""The Muon family's state through save, load, consolidate and reshard: state not shaped like
its param (NorMuon's ``(rows, 1)`` second moment, AdaMuon's flat ``v``, Moonlight's 2-D
momentum of a 3-D param), group settings that are tuples or lists of tuples, state dtypes
other than the param's; each optimizer from its package (pytorch-optimizer 4.1) or a cited
port (:mod:`.moonlight_muon`, and microsoft/dion's NorMuon, :mod:`.dion_normuon`).

Each is trained K steps, saved, loaded into an optimizer over params that are zeros and trained
M more: it must match an uninterrupted run bit for bit, and its state must come back with each
tensor's shape and dtype and each setting's Python type. In process; the other world size and
layouts, and FSDP2 / DCP with dion's ``(rows, 1)`` state, are the one 2-process launch of the
``at_world_2`` fixture.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import muonckpt
from muonckpt import offline
from muonckpt.errors import LayoutError

from .dion_normuon import NorMuon as DionNorMuon
from .moonlight_muon import MoonlightMuon

po = pytest.importorskip("pytorch_optimizer")
if not hasattr(po, "NorMuon"):  # (pytorch-optimizer 4.1 has NorMuon and AdaMuon)
    pytest.skip("pytorch-optimizer older than 4.1", allow_module_level=True)

K, M = 3, 2
SHAPES = {"w1": (16, 24), "w2": (24, 16), "experts": (4, 6, 8), "b": (24,)}


def make_params(zeros: bool = False, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(7)
    return {
        n: torch.nn.Parameter(
            torch.zeros(s, dtype=dtype) if zeros else torch.randn(s, generator=gen).to(dtype)
        )
        for n, s in SHAPES.items()
    }


def _muon_groups(ps, matrices=("w1", "w2")):
    """pytorch-optimizer's form: a use_muon group of matrices, an AdamW group of the rest."""
    rest = [n for n in ps if n not in matrices]
    return [
        {"params": [(n, ps[n]) for n in matrices], "use_muon": True},
        {"params": [(n, ps[n]) for n in rest], "use_muon": False},
    ]


OPTIMIZERS = {
    "NorMuon": lambda ps: po.NorMuon(_muon_groups(ps), lr=0.02),
    "AdaMuon": lambda ps: po.AdaMuon(_muon_groups(ps), lr=0.02),
    "dion": lambda ps: DionNorMuon(
        [
            {"params": [(n, ps[n]) for n in ("w1", "w2", "experts")]},
            {"params": [("b", ps["b"])], "algorithm": "adamw"},
        ],
        lr=0.02,
    ),
    "Moonlight": lambda ps: MoonlightMuon(
        lr=0.02,
        muon_params=[ps["w1"], ps["w2"], ps["experts"]],
        adamw_params=[ps["b"]],
    ),
}
"""Each variant that keeps more than momentum, or keeps it otherwise: docs/format.md §3b."""


def train(opt, params, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        for name, p in params.items():
            gen = torch.Generator().manual_seed(step * 31 + len(name))
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def assert_same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    """Every state value with its type, shape and dtype, every setting with its type."""
    for ga, gb in zip(a.param_groups, b.param_groups, strict=True):
        for key, value in ga.items():
            if key != "params":
                _same_value(value, gb[key], key)
    for pa, pb in zip(_flat(a), _flat(b), strict=True):
        sa, sb = a.state.get(pa, {}), b.state.get(pb, {})
        assert sa.keys() == sb.keys()
        for key, value in sa.items():
            _same_value(value, sb[key], key)


def _same_value(a, b, where) -> None:
    assert type(a) is type(b), (where, a, b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for x, y in zip(a, b, strict=True):
            _same_value(x, y, where)
    else:
        assert a == b, where


def _flat(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _resumed(kind, ckpt, dtype=torch.float32):
    params = make_params(zeros=True, dtype=dtype)
    opt = OPTIMIZERS[kind](params)
    muonckpt.load(opt, ckpt)
    return params, opt


@pytest.fixture(scope="module")
def trained():
    """Each optimizer after K steps, and its params after K + M uninterrupted ones."""
    runs = {}
    for kind, make in OPTIMIZERS.items():
        params = make_params()
        opt = make(params)
        train(opt, params, 0, K)
        reference = make_params()
        uninterrupted = make(reference)
        train(uninterrupted, reference, 0, K + M)
        runs[kind] = (params, opt, reference)
    return runs


@pytest.mark.parametrize("consolidated", [False, True])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_state_and_settings_come_back_as_they_were_and_resume_is_bitwise(
    trained, tmp_path, kind, consolidated
):
    _, opt, reference = trained[kind]
    ckpt = muonckpt.save(opt, tmp_path / "ckpt", consolidated=consolidated)
    assert muonckpt.verify(ckpt) == []
    fresh_params, fresh = _resumed(kind, ckpt)
    assert_same_state(opt, fresh)
    train(fresh, fresh_params, K, M)
    for name, p in fresh_params.items():
        assert torch.equal(p, reference[name]), (kind, name)


def test_the_manifest_records_each_shape_rule_and_each_tuple(trained, tmp_path):
    ckpt = muonckpt.save(trained["NorMuon"][1], tmp_path / "normuon")
    manifest = muonckpt.read_manifest(ckpt)
    assert manifest.format_version == 5
    row = manifest.param("w1").state_shapes["second_momentum_buffer"]
    assert (row.rule, row.shape) == ("row", (16, 1))
    assert manifest.groups[0].tuples == (("ns_coeffs", 0),)
    ckpt = muonckpt.save(trained["AdaMuon"][1], tmp_path / "adamuon")
    manifest = muonckpt.read_manifest(ckpt)
    flat = manifest.param("w1").state_shapes["v"]
    assert (flat.rule, flat.shape) == ("same", (384,))
    assert set(manifest.groups[0].tuples) == {("betas",), ("ns_coeffs", 0)}
    manifest = muonckpt.read_manifest(muonckpt.save(trained["dion"][1], tmp_path / "dion"))
    shapes = {n: manifest.param(n).state_shapes["variance_neuron"] for n in ("w1", "experts")}
    assert {n: (s.rule, s.shape) for n, s in shapes.items()} == {
        "w1": ("row", (16, 1)),
        "experts": ("own", (4, 6, 1)),  # a batch of matrices: kept whole with its param
    }
    assert manifest.param("b").scalars["step_dev"].dtype == "F32"  # a 0-d tensor
    ckpt = muonckpt.save(trained["Moonlight"][1], tmp_path / "moonlight")
    momentum = muonckpt.read_manifest(ckpt).param("2").state_shapes["momentum_buffer"]
    assert (momentum.rule, momentum.shape) == ("same", (4, 48))


NORMUONS = {"NorMuon": "second_momentum_buffer", "dion": "variance_neuron"}
"""pytorch-optimizer's NorMuon and dion's (the port), each with the key of its row statistic."""


@pytest.mark.parametrize("kind", sorted(NORMUONS))
def test_consolidate_and_reshard_keep_each_tensor_where_its_rule_allows(trained, tmp_path, kind):
    opt = trained[kind][1]
    ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    whole = offline.consolidate(ckpt, tmp_path / "consolidated")
    # each matrix's rows split over 2 TP ranks: its row statistic split with them
    rows = offline.reshard(whole, tmp_path / "tp2", dp=1, tp=2, tp_split_dims={"w1": 0, "w2": 0})
    for out in (whole, rows, offline.consolidate(rows, tmp_path / "back")):
        assert muonckpt.verify(out) == []
        differ = [r for r in offline.diff(ckpt, out) if not r.bitwise]
        assert not differ, differ
        _, fresh = _resumed(kind, out)
        assert_same_state(opt, fresh)


@pytest.mark.parametrize("kind", sorted(NORMUONS))
def test_a_reshard_that_would_cut_a_row_statistic_is_refused_in_one_line(trained, tmp_path, kind):
    ckpt = muonckpt.save(trained[kind][1], tmp_path / "ckpt")
    with pytest.raises(LayoutError) as refused:  # w1's columns split over 2 TP ranks
        offline.reshard(ckpt, tmp_path / "tp2", dp=1, tp=2, tp_split_dims={"w1": 1})
    message = str(refused.value)
    assert "\n" not in message and "'w1'" in message and f"'{NORMUONS[kind]}'" in message
    assert "1 x 2 layout" in message and "nothing was written" in message
    with pytest.raises(LayoutError, match=r"'w2'.*2 x 1 layout"):  # a ZeRO share ends mid-row
        offline.reshard(ckpt, tmp_path / "dp2", dp=2, tp=1)
    assert not (tmp_path / "tp2").exists() and not (tmp_path / "dp2").exists()


class KeepsFp32(torch.optim.Optimizer):
    """State in fp32 beside a bf16 param, as Emerging-Optimizers' Muown keeps its momentum
    and per-row statistics, with settings that are a tuple and a list of tuples."""

    def __init__(self, params):
        super().__init__(params, dict(lr=0.1, betas=(0.9, 0.99), coeffs=[(3.4, -4.7, 2.0)]))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            assert isinstance(group["betas"], tuple) and isinstance(group["coeffs"][0], tuple)
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros(p.shape, dtype=torch.float32)
                    state["v_norm"] = torch.zeros(p.shape[0], 1, dtype=torch.float32)
                grad = p.grad.float()
                state["momentum_buffer"].mul_(0.9).add_(grad)
                state["v_norm"].add_(grad.square().mean(1, keepdim=True))
                update = state["momentum_buffer"] / (state["v_norm"].sqrt() + 1)
                p.sub_(update.to(p.dtype), alpha=group["lr"])


def test_state_keeps_its_dtype_where_it_is_not_the_params(tmp_path):
    params = {"w": torch.nn.Parameter(torch.randn(8, 4).bfloat16())}
    opt = KeepsFp32(list(params.items()))
    train(opt, params, 0, K)
    ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    fresh_params = {"w": torch.nn.Parameter(torch.zeros(8, 4).bfloat16())}
    fresh = KeepsFp32(list(fresh_params.items()))
    muonckpt.load(fresh, ckpt)
    assert_same_state(opt, fresh)
    assert fresh.state[fresh_params["w"]]["momentum_buffer"].dtype == torch.float32


def test_a_rollback_gives_state_its_stored_dtype_too(tmp_path):
    """A load into an optimizer that has stepped already (a rollback), whose own tensor has
    the param's dtype, gives a state tensor kept in another dtype (a bf16 momentum of an
    fp32 param) back in that dtype, as a load into a fresh one does."""

    def make() -> tuple[torch.nn.Parameter, torch.optim.SGD]:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4, 4))
        return p, torch.optim.SGD([("w", p)], lr=0.1, momentum=0.9)

    p, opt = make()
    p.grad = torch.randn(4, 4)
    opt.step()
    opt.state[p]["momentum_buffer"] = opt.state[p]["momentum_buffer"].bfloat16()
    ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    again, stepped = make()
    again.grad = torch.randn(4, 4)
    stepped.step()  # its own fp32 momentum: the param's dtype
    muonckpt.load(stepped, ckpt)
    kept = stepped.state[again]["momentum_buffer"]
    assert kept.dtype == torch.bfloat16
    assert torch.equal(kept, opt.state[p]["momentum_buffer"])


def world_2_phase(root: str, saved: dict[str, str]) -> None:
    """(in each of 2 gloo processes) Each optimizer trained K steps as DDP replicas and saved
    per rank; each world-1 checkpoint of ``saved`` loaded into an owner layout (param ``i``'s
    state on rank ``i % 2``, ``install_hooks``), which saves it again per rank; and dion's
    NorMuon under FSDP2 saved through DCP (:func:`fsdp2_dion_to_dcp`)."""
    for kind, make in OPTIMIZERS.items():
        params = make_params()
        opt = make(params)
        train(opt, params, 0, K)
        muonckpt.save(opt, f"{root}/{kind}-replicas")
        owned = make(make_params(zeros=True))
        muonckpt.install_hooks(owned, owner=lambda index, p: index % 2)
        muonckpt.load(owned, saved[kind])
        rank = torch.distributed.get_rank()
        held = [i for i, p in enumerate(_flat(owned)) if _tensors(owned.state.get(p, {}))]
        assert held and all(i % 2 == rank for i in held), (kind, rank, held)
        muonckpt.save(owned, f"{root}/{kind}-owners")
    fsdp2_dion_to_dcp(f"{root}/dcp")


FSDP2_SHAPES = {"w1": (16, 24), "w2": (24, 16), "b": (24,)}


def fsdp2_dion_to_dcp(path: str) -> None:
    """(each of 2 gloo ranks) A model under torch's ``fully_shard`` (CPU, world 2), dion's
    NorMuon over it (whose state dion makes for every param at construction: ``momentum``,
    ``variance_neuron`` ``param[..., 0:1]``, DTensors sharded by rows as the params are) with
    its state filled with known values, saved through DCP as torchtitan and dion users do
    (``get_optimizer_state_dict``, flattened) at ``path``, its full state at ``-truth.pt``.
    Rank 0 converts it to muonckpt (``-muonckpt``) and back to DCP (``-out``); both ranks
    ``dcp.load`` that into a fresh FSDP2 job and check it equals the source, shard for
    shard. Last, ``-odd``: the same with a state ``(7, 1)`` split by rows of its own."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from muonckpt import interop

    model, opt, mesh = _fsdp2_dion(seed=5)
    gen = torch.Generator().manual_seed(6)
    for p in (model.w1, model.w2):
        for value in opt.state[p].values():
            full = torch.randn(value.shape, generator=gen)
            value.copy_(distribute_tensor(full, mesh, value.placements, src_data_rank=None))
    dcp.save(_dcp_state(model, opt), checkpoint_id=path)
    full = {  # (full_tensor: a collective of both ranks)
        f"{n}.{k}": v.full_tensor() if isinstance(v, DTensor) else v
        for n, p in model.named_parameters()
        for k, v in opt.state[p].items()
    }
    if torch.distributed.get_rank() == 0:
        torch.save(full, f"{path}-truth.pt")
        interop.from_dcp(path, f"{path}-muonckpt", source="dion-normuon", to=None)
        interop.to_dcp(f"{path}-muonckpt", f"{path}-out", to="dion-normuon")
    torch.distributed.barrier()
    fresh_model, fresh, _ = _fsdp2_dion(seed=9)
    loaded = _dcp_state(fresh_model, fresh)
    dcp.load(loaded, checkpoint_id=f"{path}-out")
    _set_dcp_state(fresh_model, fresh, loaded)
    for (name, p), q in zip(model.named_parameters(), fresh_model.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name
        assert opt.state[p].keys() == fresh.state[q].keys(), name
        for key, value in opt.state[p].items():
            shards = [
                t.to_local() if isinstance(t, DTensor) else t for t in (value, fresh.state[q][key])
            ]
            assert shards[0].shape == shards[1].shape and torch.equal(*shards), (name, key)
    assert [dict(g, params=0) for g in fresh.param_groups] == [
        dict(g, params=0) for g in opt.param_groups
    ]
    odd = torch.randn((7, 1), generator=gen)
    opt.state[model.w1]["odd"] = distribute_tensor(odd, mesh, [Shard(0)], src_data_rank=None)
    dcp.save(_dcp_state(model, opt), checkpoint_id=f"{path}-odd")


def _fsdp2_dion(seed: int):
    """A model of :data:`FSDP2_SHAPES` under ``fully_shard`` at world 2 (its params from
    ``seed``), dion's NorMuon over it, and the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Module()
    gen = torch.Generator().manual_seed(seed)
    for name, shape in FSDP2_SHAPES.items():
        model.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=gen)))
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model, mesh=mesh)
    opt = DionNorMuon(
        [{"params": [model.w1, model.w2]}, {"params": [model.b], "algorithm": "adamw"}]
    )
    return model, opt, mesh


def _dcp_state(model, opt) -> dict:
    """The job's state for ``dcp.save`` / ``dcp.load``: the model's, the optimizer's flattened."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    return {
        "model": model.state_dict(),
        "optimizer": get_optimizer_state_dict(model, opt, options=flat),
    }


def _set_dcp_state(model, opt, state: dict) -> None:
    """Put what ``dcp.load`` read into ``state`` back into the job."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optimizer"], options=flat)


def _tensors(state) -> list[str]:
    return [k for k, v in state.items() if isinstance(v, torch.Tensor)]


@pytest.fixture(scope="module")
def at_world_2(trained, tmp_path_factory):
    """The one 2-process launch of :func:`world_2_phase`; the directory it wrote."""
    from muonckpt.distributed.launch import run_distributed

    root = tmp_path_factory.mktemp("world2")
    saved = {kind: str(muonckpt.save(run[1], root / kind)) for kind, run in trained.items()}
    run_distributed(world_2_phase, 2, str(root), saved, timeout=120)
    return root


@pytest.mark.dist
def test_muon_family_at_world_2(trained, at_world_2):
    """Every optimizer: checkpoints of 2 DDP replicas and of a 2-rank owner layout (loaded
    there from one process's checkpoint) resume in one process bitwise."""
    for kind, (_, opt, reference) in trained.items():
        for layout in ("replicas", "owners"):
            fresh_params, fresh = _resumed(kind, at_world_2 / f"{kind}-{layout}")
            assert_same_state(opt, fresh)
            train(fresh, fresh_params, K, M)
            for name, p in fresh_params.items():
                assert torch.equal(p, reference[name]), (kind, layout, name)


@pytest.mark.dist
def test_fsdp2_row_state_moves_through_dcp_exactly(trained, at_world_2, tmp_path):
    """dion's NorMuon under FSDP2 through DCP (the launch of :func:`fsdp2_dion_to_dcp`): DCP
    keeps ``variance_neuron`` as one global ``(rows, 1)`` tensor in a chunk of rows per rank;
    ``from_dcp`` reads every state tensor at its own shape, equal to the optimizer's, with its
    rule (``row``) as a native save records it; ``to_dcp`` of that wrote what ``dcp.load``
    took into a fresh FSDP2 job equal to the source (checked in the launch). A state split
    into chunks that are not its param's row shards has no rule: refused in one line naming
    param, key and both shapes, nothing written."""
    from muonckpt import interop
    from muonckpt.errors import CheckpointError
    from muonckpt.interop.dcp import metadata as dcp_metadata

    src = at_world_2 / "dcp"
    stored = dcp_metadata.read_index(src).tensors["optimizer.state.w1.variance_neuron"]
    assert stored.shape == (16, 1) and len(stored.chunks) == 2  # one chunk of rows per rank
    out = interop.from_dcp(src, tmp_path / "out", source="dion-normuon", to=None).path
    truth = torch.load(at_world_2 / "dcp-truth.pt")
    manifest = muonckpt.read_manifest(out)
    for entry in manifest.params:
        shapes = {k: (s.rule, s.shape) for k, s in entry.state_shapes.items()}
        rows = FSDP2_SHAPES[entry.name][0]
        assert shapes == ({} if entry.name == "b" else {"variance_neuron": ("row", (rows, 1))})
    assert manifest.param("b").scalars["step_dev"].dtype == "F32"
    step_dev = manifest.param("b").scalars["step_dev"].value
    tensors = load_file(out / "optimizer.safetensors")
    tensors = {k.removeprefix("state."): v for k, v in tensors.items()} | {"b.step_dev": step_dev}
    assert tensors.keys() == truth.keys()
    for key, value in truth.items():
        assert torch.equal(torch.as_tensor(tensors[key]), value), key  # (its shape too)
    _, opt, _ = trained["dion"]  # a native save of the port: out to DCP and in, exactly
    interop.to_dcp(at_world_2 / "dion", tmp_path / "dion-dcp", to="dion-normuon")
    back = interop.from_dcp(
        tmp_path / "dion-dcp", tmp_path / "back", source="dion-normuon", to=None
    )
    tensors = load_file(back.path / "optimizer.safetensors")
    names = {p: n for n, p in zip(SHAPES, _flat(opt))}
    for p, keys in opt.state.items():
        for key in (k for k, v in keys.items() if isinstance(v, torch.Tensor) and v.dim()):
            value = keys[key]
            assert torch.equal(tensors[f"state.{names[p]}.{key}"], value), (names[p], key)
    with pytest.raises(CheckpointError) as refused:
        interop.from_dcp(at_world_2 / "dcp-odd", tmp_path / "odd", source="dion-normuon")
    line = str(refused.value)
    assert "\n" not in line and "param 'w1'" in line and "state 'odd'" in line
    assert "shape [7, 1], not its param's [16, 24]" in line and "no shape rule" in line
    assert not (tmp_path / "odd").exists()


def test_torch_muon_with_3d_expert_params_round_trips_where_torch_takes_them(tmp_path):
    """torch.optim.Muon's batched [..., M, N] matrices (pytorch #190597, #197202): run where
    the installed torch takes a 3-D param; skipped, with torch's reason, where it refuses."""
    experts = torch.nn.Parameter(torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(3)))
    try:
        opt = torch.optim.Muon([("experts", experts)], lr=0.02)
        train(opt, {"experts": experts}, 0, K)
    except ValueError as refused:  # torch 2.13: "Muon only supports 2D parameters ..."
        pytest.skip(f"torch {torch.__version__} refuses a 3-D param in torch.optim.Muon: {refused}")
    ckpt = muonckpt.save(opt, tmp_path / "ckpt")
    fresh = torch.nn.Parameter(torch.zeros(4, 6, 8))
    again = torch.optim.Muon([("experts", fresh)], lr=0.02)
    muonckpt.load(again, ckpt)
    assert_same_state(opt, again)


def test_a_load_into_a_variant_built_otherwise_warns_naming_the_difference(trained, tmp_path):
    ckpt = muonckpt.save(trained["NorMuon"][1], tmp_path / "ckpt")
    params = make_params(zeros=True)
    plain = po.NorMuon(_muon_groups(params), lr=0.02, nesterov=False, update_scale="match_rms")
    with pytest.warns(muonckpt.ConversionWarning) as caught:
        muonckpt.load(plain, ckpt)
    (message,) = {str(w.message) for w in caught}
    assert "group 0 (pytorch_optimizer" in message and "NorMuon)" in message
    assert (
        "nesterov False -> True" in message
        and "update_scale 'match_rms' -> 'preserve_norm'" in message
    )
    assert plain.param_groups[0]["nesterov"] is True  # the checkpoint's, as torch loads it


def test_inspect_lists_each_state_key_with_its_rule_and_shape(trained, tmp_path):
    from typer.testing import CliRunner

    from muonckpt.cli import app

    ckpt = muonckpt.save(trained["NorMuon"][1], tmp_path / "ckpt")
    summary = offline.summarize(ckpt)
    w1 = next(p for p in summary.params if p.name == "w1")
    assert w1.state_shapes == {"second_momentum_buffer": ("row", (16, 1))}
    assert w1.bytes == (16 * 24 + 16) * 4 + 16 * 24 * 4  # momentum, row statistic, values
    shown = CliRunner().invoke(app, ["inspect", str(ckpt)])
    assert shown.exit_code == 0 and "(row" in shown.output and "16x1)" in shown.output


def test_state_saved_in_its_params_dtype_follows_the_params_dtype_on_load(trained, tmp_path):
    """A run resumed at another precision: state the optimizer kept in its param's dtype is
    cast to the new param's dtype, as torch's load_state_dict does."""
    ckpt = muonckpt.save(trained["NorMuon"][1], tmp_path / "ckpt")
    params = make_params(zeros=True, dtype=torch.bfloat16)
    opt = OPTIMIZERS["NorMuon"](params)
    muonckpt.load(opt, ckpt, params=False)
    state = opt.state[params["w1"]]
    assert state["momentum_buffer"].dtype == state["second_momentum_buffer"].dtype == torch.bfloat16
