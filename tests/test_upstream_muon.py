"""Upstream KellerJordan Muon (``pip install muon-optimizer``), as its users build it.

``muon.Muon`` and ``muon.MuonWithAuxAdam`` run in gloo processes on a small model: trained K
steps at world 4, saved (per rank and consolidated) with ``install_hooks(opt, names=...)`` and
upstream's own owner rule, then resumed at world 2 and 3, and in one process with the
single-device classes, into optimizers built from zeros; M more steps must equal an
uninterrupted single-device run bit for bit.
"""

from __future__ import annotations

import muon
import pytest
import torch
import torch.distributed as dist

import muonckpt
from muonckpt import StateDictError
from muonckpt.distributed.launch import run_distributed

K, M = 3, 2
MATRICES = 12
"""Upstream all-gathers chunks of world-size params, which gloo needs to be of one shape, and
pads with len % world empty tensors: twelve same-shaped matrices fit worlds 1, 2, 3 and 4."""


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.blocks = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(8, 12, generator=gen)) for _ in range(MATRICES)
        )
        self.bias = torch.nn.Parameter(torch.randn(12, generator=gen))
        self.gain = torch.nn.Parameter(torch.randn(3, generator=gen))


def make_model(zeros: bool = False) -> Net:
    model = Net()
    if zeros:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return model


def make_opt(model: Net, kind: str, single: bool):
    matrices = list(model.blocks)
    if kind == "Muon":
        cls = muon.SingleDeviceMuon if single else muon.Muon
        return cls(matrices, lr=0.05, weight_decay=0.1, momentum=0.9)
    cls = muon.SingleDeviceMuonWithAuxAdam if single else muon.MuonWithAuxAdam
    return cls(
        [
            dict(params=[model.bias, model.gain], lr=0.01, use_muon=False),
            dict(params=matrices, lr=0.05, momentum=0.9, use_muon=True),
        ]
    )


def set_grads(model: Net, step: int) -> None:
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(step * 100 + sum(map(ord, name)))
        p.grad = torch.randn(p.shape, generator=gen)


def train(model, opt, first, steps) -> None:
    for step in range(first, first + steps):
        set_grads(model, step)
        opt.step()


def snapshot(model: Net) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def build(kind: str, zeros: bool):
    single = not dist.is_initialized()
    model = make_model(zeros)
    opt = make_opt(model, kind, single)
    muonckpt.install_hooks(opt, names=model.named_parameters())
    return model, opt


def save_phase(kind: str, root: str) -> dict[str, torch.Tensor]:
    model, opt = build(kind, zeros=False)
    train(model, opt, 0, K)
    muonckpt.save(opt, f"{root}/per-rank")
    muonckpt.save(opt, f"{root}/consolidated", consolidated=True)
    saving = muonckpt.async_save(opt, f"{root}/background")
    after = snapshot(model)
    train(model, opt, K, 1)  # training goes on: the background checkpoint keeps step K
    saving.result(timeout=120)
    return after


def resume_phase(kind: str, ckpts: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Each checkpoint resumed into its own optimizer built from zeros: the params after M
    more steps, by checkpoint."""
    resumed = {}
    for ckpt in ckpts:
        model, opt = build(kind, zeros=True)
        muonckpt.load(opt, ckpt)
        train(model, opt, K, M)
        resumed[ckpt] = snapshot(model)
    return resumed


def reference(kind: str, steps: int) -> dict[str, torch.Tensor]:
    """The optimizer's params after ``steps`` uninterrupted single-device steps."""
    model = make_model()
    opt = make_opt(model, kind, single=True)
    train(model, opt, 0, steps)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    return {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in held}


@pytest.fixture(scope="module", params=["Muon", "MuonWithAuxAdam"])
def saved(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    after = run_distributed(save_phase, 4, kind, str(root), timeout=180)
    return kind, root, after


@pytest.mark.dist
def test_training_at_world_4_matches_single_device(saved):
    kind, _, after = saved
    expected = reference(kind, K)
    for params in after:
        for name, value in expected.items():
            assert torch.equal(params[name], value), name


@pytest.mark.dist
def test_checkpoint_holds_every_momentum_and_the_replicated_adamw_state(saved):
    kind, root, _ = saved
    for ckpt in ("per-rank", "consolidated", "background"):
        assert muonckpt.verify(root / ckpt) == []
        manifest = muonckpt.read_manifest(root / ckpt)
        by_name = {p.name: p for p in manifest.params}
        for i in range(MATRICES):
            assert by_name[f"blocks.{i}"].state_keys == ("momentum_buffer",)
        if kind == "MuonWithAuxAdam":
            for name in ("bias", "gain"):
                assert by_name[name].state_keys == ("exp_avg", "exp_avg_sq")
                assert by_name[name].scalars["step"].value == K  # upstream's plain int
        assert manifest.has_values


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 1])
def test_resume_at_another_world_size_from_zeros_is_bitwise(saved, world):
    """Each of the three checkpoints (per rank, consolidated, background), resumed by one
    launch at ``world``."""
    kind, root, _ = saved
    expected = reference(kind, K + M)
    ckpts = [str(root / ckpt) for ckpt in ("per-rank", "consolidated", "background")]
    if world == 1:
        results = [resume_phase(kind, ckpts)]  # the single-device class, no group
    else:
        results = run_distributed(resume_phase, world, kind, ckpts, timeout=180)
    for resumed in results:
        assert list(resumed) == ckpts
        for ckpt, params in resumed.items():
            for name, value in expected.items():
                assert torch.equal(params[name], value), (ckpt, name)


def wrong_rule(kind: str, root: str) -> dict[str, str | None]:
    """The owner rule the docs used to give (a flat index modulo the world size): what
    ``state_dict()`` and each kind of save raise (neither may write a checkpoint that lacks
    the momentum the rule misplaces)."""
    model = make_model()
    opt = make_opt(model, kind, single=False)
    world = dist.get_world_size()
    muonckpt.install_hooks(opt, owner=lambda i, p: i % world, names=model.named_parameters())
    train(model, opt, 0, 1)
    raised: dict[str, str | None] = {}
    for case, call in (
        ("state_dict", opt.state_dict),
        ("consolidated", lambda: muonckpt.save(opt, f"{root}/ckpt", consolidated=True)),
        ("per-rank", lambda: muonckpt.save(opt, f"{root}/ckpt")),
    ):
        raised[case] = None
        try:
            call()
        except StateDictError as exc:
            raised[case] = str(exc)
    return raised


@pytest.mark.dist
def test_the_old_flat_index_rule_raises_instead_of_losing_state(tmp_path):
    ranks = run_distributed(wrong_rule, 4, "MuonWithAuxAdam", str(tmp_path), timeout=120)
    for case in ("state_dict", "consolidated", "per-rank"):
        messages = [raised[case] for raised in ranks]
        assert messages[0] is not None and len(set(messages)) == 1, case
        assert "param 'blocks." in messages[0]
        assert "declared owner rank" in messages[0] and "holds state" in messages[0]
    assert list(tmp_path.iterdir()) == []  # nothing committed, no staging left


def test_other_optimizers_need_an_explicit_owner():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(StateDictError, match="owner="):
        muonckpt.install_hooks(opt)
