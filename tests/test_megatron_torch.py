"""Megatron-Core's ``--ckpt-format torch`` checkpoints of its layer-wise Muon in: the committed
fixtures ``tests/fixtures/megatron/{tp2_dp1,tp1_dp2}_torch`` were written by
``megatron.training.checkpointing.save_checkpoint`` itself (``make_fixtures.py``). Their values
are checked bitwise against the truth with the torch_dist ones (``test_megatron.py``); here, the
CLI and the way out at the other layout, and the refusals: a hostile pickle (unrun), a master
that no model param holds, a DP rank's file missing, a pipeline-parallel layout."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import muonckpt
from muonckpt import CheckpointError
from muonckpt.cli import app
from muonckpt.interop import megatron
from muonckpt.storage import dcp_metadata, megatron_files

FIXTURES = Path(__file__).parent / "fixtures" / "megatron"
TORCH = ("tp2_dp1_torch", "tp1_dp2_torch")
OTHER = {"tp2_dp1_torch": ("tp1_dp2", 1, 2), "tp1_dp2_torch": ("tp2_dp1", 2, 1)}
"""Fixture -> the torch_dist fixture Megatron wrote at the other layout, its TP and DP."""


def _ckpt(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def _iteration(root: Path) -> Path:
    return root / "iter_0000003"


def test_the_torch_fixtures_are_megatron_s_own_files():
    for name in TORCH:
        iteration = _iteration(_ckpt(name))
        assert megatron.is_megatron(iteration) and megatron_files.is_torch_format(iteration)
        files = megatron_files.torch_files(iteration)
        tp, dp = (2, 1) if name.startswith("tp2") else (1, 2)
        assert len(files.model) == tp and all(len(o) == dp for o in files.optimizer)
        top = megatron_files.load(files.model[0])
        assert vars(top["args"])["ckpt_format"] == "torch" and top["iteration"] == 3


@pytest.mark.parametrize("name", TORCH)
def test_cli_in_then_out_at_the_other_layout(tmp_path, name):
    """``convert --from megatron`` of the torch format, then ``--to megatron`` at the other
    layout: a torch_dist checkpoint with the keys, shapes and chunks Megatron wrote there, its
    optimizer tensors the truth bitwise."""
    other, tp, dp = OTHER[name]
    ours, back = tmp_path / "ours", tmp_path / "back"
    runner = CliRunner()
    result = runner.invoke(
        app, ["convert", str(_ckpt(name)), "-o", str(ours), "--from", "megatron"]
    )
    assert result.exit_code == 0 and "layout torch" in result.output, result.output
    assert "left out rng_state (1 item)" in result.output
    assert muonckpt.verify(ours) == []
    args = ["convert", str(ours), "-o", str(back), "--to", "megatron", "--tp", str(tp)]
    result = runner.invoke(app, [*args, "--dp", str(dp)])
    assert result.exit_code == 0, result.output
    mine = dcp_metadata.read_index(megatron.iteration_dir(back))
    theirs = dcp_metadata.read_index(megatron.iteration_dir(_ckpt(other)))
    assert set(mine.tensors) == set(theirs.tensors)
    for fqn, item in mine.tensors.items():
        other_item = theirs.tensors[fqn]
        assert (item.shape, item.dtype) == (other_item.shape, other_item.dtype), fqn
        chunks = sorted((c.offsets, c.sizes) for c in item.chunks)
        assert chunks == sorted((c.offsets, c.sizes) for c in other_item.chunks), fqn
    again = megatron.from_megatron(back, tmp_path / "again").path
    truth = load_file(FIXTURES / name / "truth.safetensors")
    state = load_file(again / "optimizer.safetensors")
    for key, value in state.items():
        param, what = key[len("state.") :].rsplit(".", 1)
        assert torch.equal(value, truth[f"{param}.{what}"]), key


def _copy(name: str, tmp_path: Path) -> Path:
    root = tmp_path / name
    shutil.copytree(_ckpt(name), root)
    return root


def _rank0(root: Path) -> Path:
    return _iteration(root) / "mp_rank_00"


class _Hostile:
    marker: Path

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_pickle_is_refused_unrun(tmp_path):
    root = _copy("tp1_dp2_torch", tmp_path)
    _Hostile.marker = tmp_path / "ran"
    victim = _rank0(root) / "layer_wise_optimizer_1.pt"
    victim.write_bytes(pickle.dumps({"optimizer": _Hostile()}))
    with pytest.raises(CheckpointError, match="nothing of it was run") as info:
        megatron.from_megatron(root, tmp_path / "x")
    assert str(victim) in str(info.value) and "\n" not in str(info.value)
    assert not _Hostile.marker.exists() and not (tmp_path / "x").exists()


def _resave(path: Path, change) -> None:
    value = megatron_files.load(path)
    change(value)
    torch.save(value, path)


def _without_args(top: dict) -> None:
    del top["args"], top["rng_state"]  # (their stand-ins are not for saving)


def test_a_master_no_model_param_holds_is_refused_naming_the_item(tmp_path):
    root = _copy("tp2_dp1_torch", tmp_path)
    victim = _rank0(root) / "layer_wise_optimizer_0.pt"

    def change(chained):
        chained[0]["fp32_from_fp16_params"][0][1] += 1.0

    _resave(victim, change)
    with pytest.raises(CheckpointError, match="cannot be known") as info:
        megatron.from_megatron(root, tmp_path / "x")
    message = str(info.value)
    assert "chained optimizer 0, group 0, param id 1: no model param" in message
    assert str(victim) in message and "\n" not in message and not (tmp_path / "x").exists()


def test_params_of_equal_values_are_refused_not_guessed(tmp_path):
    """Two layers' norms made equal (weights and masters): which id is which is not known."""
    root = _copy("tp2_dp1_torch", tmp_path)
    for rank in ("mp_rank_00", "mp_rank_01"):
        where = _iteration(root) / rank
        names = (
            "decoder.layers.0.input_layernorm.weight",
            "decoder.layers.1.input_layernorm.weight",
        )

        def same_weights(top, names=names):
            top["model"][names[1]] = top["model"][names[0]].clone()
            _without_args(top)

        _resave(where / megatron_files.MODEL_FILE, same_weights)
        model = megatron_files.load(where / megatron_files.MODEL_FILE)["model"]

        def same_masters(chained, model=model, names=names):
            masters = chained[1]["fp32_from_fp16_params"][1]
            for i, m in enumerate(masters):
                if m.shape == model[names[1]].shape and torch.equal(
                    m.to(torch.bfloat16), model[names[0]]
                ):
                    masters[i] = m.clone()

        _resave(where / "layer_wise_optimizer_0.pt", same_masters)
    with pytest.raises(CheckpointError, match=r"2 model params .* cannot be known") as info:
        megatron.from_megatron(root, tmp_path / "x")
    assert "layer_wise_optimizer_0.pt" in str(info.value)


def test_a_missing_dp_rank_file_is_refused(tmp_path):
    root = _copy("tp1_dp2_torch", tmp_path)
    (_rank0(root) / "layer_wise_optimizer_1.pt").unlink()
    with pytest.raises(CheckpointError, match="data_parallel_size 2, but 1 layer_wise"):
        megatron.from_megatron(root, tmp_path / "x")
    _resave(_rank0(root) / megatron_files.MODEL_FILE, _without_args)
    with pytest.raises(CheckpointError, match="not in the model's order, as the ids of a DP-1"):
        megatron.from_megatron(root, tmp_path / "x")
    (_rank0(root) / "layer_wise_optimizer_0.pt").rename(_rank0(root) / "layer_wise_optimizer_1.pt")
    with pytest.raises(CheckpointError, match=r"DP ranks \[1\], not 0..N-1"):
        megatron.from_megatron(root, tmp_path / "x")


def test_a_pipeline_parallel_layout_is_refused(tmp_path):
    root = _copy("tp1_dp2_torch", tmp_path)
    _rank0(root).rename(_iteration(root) / "mp_rank_00_000")
    with pytest.raises(CheckpointError, match="pipeline- or expert-parallel"):
        megatron.from_megatron(root, tmp_path / "x")


def test_a_param_without_a_master_is_refused(tmp_path):
    root = _copy("tp2_dp1_torch", tmp_path)

    def drop_last(chained):
        group, masters = (
            chained[0]["optimizer"]["param_groups"][0],
            chained[0]["fp32_from_fp16_params"][0],
        )
        chained[0]["optimizer"]["state"].pop(group["params"].pop())
        masters.pop()

    _resave(_rank0(root) / "layer_wise_optimizer_0.pt", drop_last)
    with pytest.raises(CheckpointError, match=r"model param \S+ \(1 in all\) has no master"):
        megatron.from_megatron(root, tmp_path / "x")
