"""The packaged Muon's second-moment variants (``second_moment="row"``: NorMuon's row
normalization; ``"element"``: AdaMuon's element-wise second moment), their ``update_sq`` state
ZeRO-1 + TP sharded: trained at dp x tp, saved, resumed at other topologies from zeros, and
equal bit for bit to an uninterrupted single-process run, as the seed's test holds the plain
Muon to (the oracle discipline of tests/test_checkpoint.py: the reference and every run in a
gloo child, one thread each).

The row statistic is computed over whole rows where the whole orthogonalized matrix is (its
Newton-Schulz worker, or each holder), so the state is the same whatever the layout.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import muonckpt
from muonckpt import StateDictError, offline
from muonckpt.distributed.launch import run_distributed
from muonckpt.optim.muon import UPDATE_SQ

from .fixture_model import MODEL, MUON_HPARAMS, MUON_PARAMS, local_params

K, M = 2, 2
MODES = ("row", "element")
VARIANTS = {
    mode: replace(MODEL, muon_hparams={**MUON_HPARAMS, "second_moment": mode}) for mode in MODES
}


def save_variants(dp: int, tp: int, root: str, steps: int) -> None:
    """(gloo child) Each variant trained ``steps`` steps at dp x tp, saved per rank."""
    for mode, model in VARIANTS.items():
        opt, sharded, d, t = model.build(dp, tp, model.initial_params())
        model.train(opt, sharded, d, t, 0, steps)
        muonckpt.save(opt, f"{root}/{mode}")


def resume_variants(
    dp: int, tp: int, src: str, first: int, steps: int, dst: str | None
) -> dict[str, dict[str, torch.Tensor]]:
    """(gloo child) Each variant resumed from ``src`` into an optimizer built from zeros,
    trained ``steps`` more, saved to ``dst`` where given; its params here, by variant."""
    out = {}
    for mode, model in VARIANTS.items():
        zeros = {n: torch.zeros_like(v) for n, v in model.initial_params().items()}
        opt, sharded, d, t = model.build(dp, tp, zeros)
        muonckpt.load(opt, f"{src}/{mode}")
        model.train(opt, sharded, d, t, first, steps)
        if dst is not None:
            muonckpt.save(opt, f"{dst}/{mode}")
        out[mode] = local_params(opt)
    return out


def resume_in_one_process(src: str, first: int, steps: int) -> dict[str, dict[str, bool]]:
    """(one process, one thread) Each variant resumed at 1 x 1 against the uninterrupted
    reference of ``first + steps`` steps computed here: which params are bitwise equal."""
    resumed = resume_variants(1, 1, src, first, steps, None)
    equal = {}
    for mode, model in VARIANTS.items():
        opt, _, _, _ = model.build(1, 1, model.initial_params())
        model.train(opt, None, 0, 0, 0, first + steps)
        reference = local_params(opt)
        equal[mode] = {n: torch.equal(p, reference[n]) for n, p in resumed[mode].items()}
    return equal


def test_the_variants_keep_their_second_moment_shaped_like_the_param():
    for mode, model in VARIANTS.items():
        opt, _, _, _ = model.build(1, 1, model.initial_params())
        model.train(opt, None, 0, 0, 0, 1)
        assert opt.state_keys(0) == ("momentum_buffer", UPDATE_SQ)
        for p in opt.param_groups[0]["params"]:
            second = opt.state[p][UPDATE_SQ]
            assert second.dtype == torch.float32 and second.shape == p.shape
            if mode == "row":  # one statistic per row, repeated along it
                assert torch.equal(second, second[:, :1].expand_as(second))


@pytest.mark.dist
def test_saved_at_2x2_resumes_in_one_process_bitwise(tmp_path):
    run_distributed(save_variants, 4, 2, 2, str(tmp_path), K, timeout=120)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a gloo child runs (one thread): the same bits
    try:
        equal = resume_in_one_process(str(tmp_path), K, M)
    finally:
        torch.set_num_threads(threads)
    assert all(all(by_param.values()) for by_param in equal.values()), equal
    manifest = muonckpt.read_manifest(tmp_path / "row")
    assert manifest.groups[0].optimizer["second_moment"] == "row"
    assert all(UPDATE_SQ in manifest.param(n).state_keys for n in MUON_PARAMS)
    with pytest.raises(StateDictError, match=r"second_moment='row'.*cannot be converted"):
        offline.convert(tmp_path / "row", tmp_path / "torch", to="torch")
    assert not (tmp_path / "torch").exists()


@pytest.mark.dist
@pytest.mark.slow
def test_2x2_then_4x2_then_1x1_is_bitwise(tmp_path):
    """The issue's chain: K steps at 2 x 2, M more at 4 x 2, M more in one process."""
    first, second = tmp_path / "2x2", tmp_path / "4x2"
    run_distributed(save_variants, 4, 2, 2, str(first), K, timeout=120)
    run_distributed(resume_variants, 8, 4, 2, str(first), K, M, str(second), timeout=180)
    (equal,) = run_distributed(resume_in_one_process, 1, str(second), K + M, M, timeout=120)
    assert all(all(by_param.values()) for by_param in equal.values()), equal


def test_a_variant_loads_only_into_a_muon_with_a_place_for_its_second_moment(tmp_path):
    model = VARIANTS["row"]
    opt, _, _, _ = model.build(1, 1, model.initial_params())
    model.train(opt, None, 0, 0, 0, 1)
    ckpt = muonckpt.save(opt, tmp_path / "row")
    plain, _, _, _ = MODEL.build(1, 1, MODEL.initial_params())
    with pytest.warns(muonckpt.ConversionWarning, match=r"second_moment '\(none\)' -> 'row'"):
        muonckpt.load(plain, ckpt)  # the checkpoint's settings replace the built ones
    assert plain.param_groups[0]["second_moment"] == "row"
    groups = MODEL.param_groups(MODEL.initial_params())
    torch_opts = [
        torch.optim.Muon(groups[0]["params"], lr=0.05),
        torch.optim.AdamW(groups[1]["params"], lr=0.01),
    ]
    with pytest.raises(StateDictError, match=r"second moment of its update \(update_sq\)"):
        muonckpt.load(torch_opts, ckpt)
    other, _, _, _ = MODEL.build(1, 1, MODEL.initial_params())
    MODEL.train(other, None, 0, 0, 0, 1)
    plain_ckpt = muonckpt.save(other, tmp_path / "plain")  # no second moment to give ...
    with pytest.raises(muonckpt.CheckpointError, match=r"lacks state key\(s\) \['update_sq'\]"):
        muonckpt.load(plain, plain_ckpt)  # ... the row variant that `plain` now is
