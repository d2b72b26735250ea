"""A load holds what it read compactly and copies into the state an optimizer already has.

A load into an optimizer that has state (a rollback inside a running job) must not hold a
second copy of that state: each state tensor torch would replace by one of the same dtype,
device and shape keeps its identity and gets the checkpoint's values. The result is exactly
what a load into a fresh optimizer gives, and training on from it is bitwise the same.
"""

from __future__ import annotations

import io

import muon
import pytest
import torch

import muonckpt
from muonckpt.distributed.launch import run_distributed
from muonckpt.errors import CheckpointError
from muonckpt.state.arena import ReadArena

from .load_cases import in_place_load_phase

SHAPES = {"w1": (6, 4), "w2": (4, 6), "b": (6,)}


def _params(zeros: bool = False) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(3)
    return {
        n: torch.nn.Parameter(torch.zeros(s) if zeros else torch.randn(s, generator=gen))
        for n, s in SHAPES.items()
    }


def _train(opt: torch.optim.Optimizer, params: dict, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        for name, p in params.items():
            gen = torch.Generator().manual_seed(step * 7 + len(name))
            p.grad = torch.randn(p.shape, generator=gen).to(p.device)
        opt.step()


OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(list(ps.items()), lr=0.01),
    "torch.optim.Muon": lambda ps: torch.optim.Muon(
        [(n, ps[n]) for n in ("w1", "w2")], lr=0.02, adjust_lr_fn="match_rms_adamw"
    ),
    "muon-optimizer (KellerJordan)": lambda ps: muon.SingleDeviceMuonWithAuxAdam(
        [
            {"params": [ps["w1"], ps["w2"]], "use_muon": True, "lr": 0.02},
            {"params": [ps["b"]], "use_muon": False, "lr": 0.01},
        ]
    ),
    "packaged Muon": lambda ps: muonckpt.optim.muon.Muon(
        [{"params": [(n, ps[n]) for n in ("w1", "w2")]}, {"params": [("b", ps["b"])]}],
        lr=0.02,
    ),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_load_into_an_optimizer_with_state_copies_into_its_own_tensors(kind, tmp_path):
    params = _params()
    opt = OPTIMIZERS[kind](params)
    _train(opt, params, 0, 3)
    muonckpt.save(opt, tmp_path / "ck")
    _train(opt, params, 3, 2)  # the state moves on; the load rolls it back
    own = {(id(p), k): v for p, s in opt.state.items() for k, v in s.items()}
    tensors = {key: v for key, v in own.items() if isinstance(v, torch.Tensor) and v.dim()}
    assert tensors, "the optimizer must have state tensors to reuse"

    muonckpt.load(opt, tmp_path / "ck")

    for (pid, key), before in tensors.items():
        p = next(p for p in opt.state if id(p) == pid)
        assert opt.state[p][key] is before, (key, "replaced instead of copied into")

    fresh_params = _params(zeros=True)
    fresh = OPTIMIZERS[kind](fresh_params)
    muonckpt.load(fresh, tmp_path / "ck")
    a, b = opt.state_dict(), fresh.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for index, entry in a["state"].items():
        for key, value in entry.items():
            other = b["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other) and value.dtype == other.dtype, (index, key)
            else:
                assert value == other, (index, key)
    _train(opt, params, 3, 2)
    _train(fresh, fresh_params, 3, 2)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held
    for name in SHAPES:
        if id(params[name]) in held:  # (torch.optim.Muon holds the matrices only)
            assert torch.equal(params[name], fresh_params[name]), name


def test_a_refused_load_leaves_the_optimizers_own_tensors_as_they_were(tmp_path):
    params = _params()
    opt = torch.optim.AdamW(list(params.items()), lr=0.01)
    _train(opt, params, 0, 2)
    muonckpt.save(opt, tmp_path / "ck")
    _train(opt, params, 2, 1)
    before = {k: v.clone() for k, v in opt.state[params["w1"]].items()}
    data = next((tmp_path / "ck").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-4:] = bytes(b ^ 0xFF for b in raw[-4:])  # the last tensor's data: a checksum fails
    data.write_bytes(bytes(raw))

    with pytest.raises(CheckpointError, match="checksum"):
        muonckpt.load(opt, tmp_path / "ck")

    for key, value in opt.state[params["w1"]].items():
        assert torch.equal(value, before[key]), key


def test_state_of_another_dtype_is_replaced_as_torch_replaces_it(tmp_path):
    """torch casts a loaded state value to its param's dtype; an optimizer's own tensor of
    another dtype is not the one torch would keep, so it is replaced, not copied into."""
    params = _params()
    opt = torch.optim.AdamW(list(params.items()), lr=0.01)
    _train(opt, params, 0, 2)
    muonckpt.save(opt, tmp_path / "ck")
    state = opt.state[params["w1"]]
    odd = state["exp_avg"] = state["exp_avg"].double()

    muonckpt.load(opt, tmp_path / "ck")

    assert opt.state[params["w1"]]["exp_avg"] is not odd
    assert opt.state[params["w1"]]["exp_avg"].dtype == torch.float32


def test_a_fresh_optimizers_new_state_holds_no_more_memory_than_its_own_bytes(tmp_path):
    """torch.save (and a deepcopy) of a view writes its whole storage: the state a load makes
    for a fresh optimizer must not view blocks that also hold the params' values, or the
    unused rest of a block (a few KiB of state were saved as 4 MiB)."""
    params = _params()
    opt = torch.optim.AdamW(list(params.items()), lr=0.01)
    _train(opt, params, 0, 2)
    muonckpt.save(opt, tmp_path / "ck")
    fresh = torch.optim.AdamW(list(_params(zeros=True).items()), lr=0.01)

    muonckpt.load(fresh, tmp_path / "ck")

    tensors = [v for s in fresh.state.values() for v in s.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    own = sum(t.nbytes for t in tensors)
    assert sum(storages.values()) <= own + 16 * len(tensors)
    saved = io.BytesIO()
    torch.save(fresh.state_dict(), saved)
    assert len(saved.getvalue()) < own + (16 << 10)


def test_a_tensor_the_optimizer_shares_between_params_is_not_copied_into_twice(tmp_path):
    """torch's load gives each param its own loaded tensor. Copying each param's values into
    one tensor that the optimizer shares between two params would leave the last param's
    values in both."""
    gen = torch.Generator().manual_seed(5)
    params = {n: torch.nn.Parameter(torch.randn(3, 4, generator=gen)) for n in ("a", "bb")}
    opt = torch.optim.AdamW(list(params.items()), lr=0.01)
    _train(opt, params, 0, 2)
    muonckpt.save(opt, tmp_path / "ck")
    saved = {n: opt.state[p]["exp_avg"].clone() for n, p in params.items()}
    assert not torch.equal(saved["a"], saved["bb"])
    opt.state[params["bb"]]["exp_avg"] = opt.state[params["a"]]["exp_avg"]

    muonckpt.load(opt, tmp_path / "ck")

    for name, p in params.items():
        assert torch.equal(opt.state[p]["exp_avg"], saved[name]), name


@pytest.mark.parametrize(
    "sizes",
    [
        [0, 1, 3, 16, 17, 4096],
        [70_000, 5, 0, 70_000, 8],  # reads of their own between packed ones
        [1000] * 50,  # several blocks
    ],
)
def test_the_arena_gives_back_each_read_as_written(sizes):
    arena = ReadArena(small=1 << 16, block=1 << 14)
    written = []
    for i, n in enumerate(sizes):
        slot, out = arena.reserve(n)
        assert slot == i and out.nbytes == n and out.dtype.name == "uint8"
        out[:] = (torch.arange(n) * (i + 1) % 251).to(torch.uint8).numpy()
        written.append(bytes(out))
    arena.trim()  # the block being filled shrinks to what it holds; every slot stays
    assert len(arena) == len(sizes)
    for slot, n in enumerate(sizes):
        got = arena.tensor(slot, torch.uint8, (n,))
        assert bytes(got.numpy()) == written[slot]


def test_arena_slots_view_as_any_dtype_and_share_memory():
    arena = ReadArena(small=1 << 16, block=1 << 12)
    values = {
        torch.float64: torch.randn(3, 2, dtype=torch.float64),
        torch.bfloat16: torch.randn(5, dtype=torch.bfloat16),
        torch.int32: torch.arange(7, dtype=torch.int32),
        torch.float32: torch.randn(2, 2),
    }
    slots = {}
    for dtype, value in values.items():
        slot, out = arena.reserve(value.numel() * value.element_size())
        out[:] = value.contiguous().view(torch.uint8).reshape(-1).numpy()
        slots[dtype] = slot
    for dtype, value in values.items():
        got = arena.tensor(slots[dtype], dtype, value.shape)
        assert got.dtype == dtype and torch.equal(got, value), dtype
    view = arena.tensor(slots[torch.float32], torch.float32, (4,))
    view.add_(1)
    assert torch.equal(
        arena.tensor(slots[torch.float32], torch.float32, (2, 2)), values[torch.float32] + 1
    )


@pytest.mark.dist
@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (1, 2)])
def test_a_distributed_load_copies_into_each_ranks_own_state(tmp_path, dp, tp):
    ranks = run_distributed(in_place_load_phase, dp * tp, str(tmp_path / "ck"), dp, tp, timeout=120)
    for rank in ranks:
        assert rank["kept"]
        assert rank["params"].keys() == rank["fresh"].keys()
        for name, value in rank["params"].items():
            assert torch.equal(value, rank["fresh"][name]), name


@pytest.mark.cuda
def test_a_load_into_cuda_state_copies_into_it_on_the_device(tmp_path):
    cuda = torch.device("cuda", 0)
    params = {n: torch.nn.Parameter(p.detach().to(cuda)) for n, p in _params().items()}
    opt = torch.optim.AdamW(list(params.items()), lr=0.01)
    _train(opt, params, 0, 3)
    muonckpt.save(opt, tmp_path / "ck")
    _train(opt, params, 3, 2)
    own = {n: opt.state[p]["exp_avg"] for n, p in params.items()}

    muonckpt.load(opt, tmp_path / "ck")

    fresh_params = _params(zeros=True)
    fresh = torch.optim.AdamW(list(fresh_params.items()), lr=0.01)
    muonckpt.load(fresh, tmp_path / "ck")
    for name, p in params.items():
        kept = opt.state[p]["exp_avg"]
        assert kept is own[name] and kept.device == cuda
        assert torch.equal(kept.cpu(), fresh.state[fresh_params[name]]["exp_avg"]), name
        assert torch.equal(p.detach().cpu(), fresh_params[name].detach()), name
