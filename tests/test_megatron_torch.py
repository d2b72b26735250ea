"""Megatron-Core's ``--ckpt-format torch`` checkpoints of its layer-wise Muon in: the committed
fixtures ``tests/fixtures/megatron/{tp2_dp1,tp1_dp2}_torch`` were written by
``megatron.training.checkpointing.save_checkpoint`` itself (``make_fixtures.py``). Their values
are checked bitwise against the truth with the torch_dist ones (``test_megatron.py``); here, the
CLI and the way out at the other layout, and the refusals: a hostile pickle (unrun), a master
that no model param holds, a DP rank's file missing, a pipeline-parallel layout, TP ranks'
directories other than the training args record, two names for one rank, state of an id no
param group lists."""

from __future__ import annotations

import argparse
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
from muonckpt.interop.dcp import metadata as dcp_metadata
from muonckpt.interop.megatron import files as megatron_files
from muonckpt.interop.megatron import reader as megatron

from . import hostile_files
from .hostile_files import refused

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
    optimizer tensors the truth bitwise; the RNG states, per TP rank, carried in and left out
    (named) at the other TP size."""
    other, tp, dp = OTHER[name]
    ours, back = tmp_path / "ours", tmp_path / "back"
    runner = CliRunner()
    result = runner.invoke(
        app, ["convert", str(_ckpt(name)), "-o", str(ours), "--from", "megatron"]
    )
    assert result.exit_code == 0 and "layout torch" in result.output, result.output
    assert "rng_state" not in result.output  # (carried: test_megatron.py's job tests)
    assert muonckpt.verify(ours) == []
    args = ["convert", str(ours), "-o", str(back), "--to", "megatron", "--tp", str(tp)]
    result = runner.invoke(app, [*args, "--dp", str(dp)])
    assert result.exit_code == 0, result.output
    assert f"wrote {back}: Megatron-Core" in result.output
    assert "rng_state (per rank, saved at PP 1 TP" in " ".join(result.output.split())
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


def _sizes_only(top: dict) -> None:
    """The training args cut to their parallel sizes (a real ``argparse.Namespace``)."""
    sizes = {k: v for k, v in vars(top["args"]).items() if k.endswith("parallel_size")}
    _without_args(top)
    top["args"] = argparse.Namespace(**sizes)


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
            _sizes_only(top)

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


def _convert(root: Path) -> list[str]:
    return [str(root), "--from", "megatron"]


def test_tp_rank_directories_other_than_the_args_record_are_refused(tmp_path):
    """A TP-1 save (its args: tensor_model_parallel_size 1) beside a stale ``mp_rank_01/`` of
    an earlier save of the iteration was read as TP 2, every TP-split param at twice its shape
    (fifth adversarial pass, F3); so was the other way, a TP-2 save missing ``mp_rank_01/``.
    Without args, two TP ranks' directories cannot be told from one and a stale one."""
    stale = _copy("tp1_dp2_torch", tmp_path)
    shutil.copytree(_rank0(stale), _iteration(stale) / "mp_rank_01")
    said = "args of mp_rank_00 say tensor_model_parallel_size 1, but 2 mp_rank_XX directories"
    refused(_convert(stale), tmp_path / "x", said, f"(file {_iteration(stale)})")
    lost = _copy("tp2_dp1_torch", tmp_path)
    shutil.rmtree(_iteration(lost) / "mp_rank_01")
    said = "tensor_model_parallel_size 2, but 1 mp_rank_XX directories (one per TP rank) are"
    refused(_convert(lost), tmp_path / "x", said, "(one missing?)", str(_iteration(lost)))
    bare = _copy("tp2_dp1_torch", tmp_path / "bare")
    _resave(_rank0(bare) / megatron_files.MODEL_FILE, _without_args)
    said = "2 mp_rank_XX directories, but no training args of mp_rank_00 record its tensor_model"
    refused(_convert(bare), tmp_path / "x", said, "cannot be known", str(_iteration(bare)))


def test_two_names_for_one_rank_are_refused_naming_both(tmp_path):
    """``mp_rank_1/`` beside ``mp_rank_01/``, ``layer_wise_optimizer_01.pt`` beside
    ``layer_wise_optimizer_1.pt``: one of each was taken, silently (fifth pass, F4)."""
    root = _copy("tp2_dp1_torch", tmp_path)
    shutil.copytree(_iteration(root) / "mp_rank_01", _iteration(root) / "mp_rank_1")
    said = "mp_rank_01 and mp_rank_1 both name TP rank 1"
    refused(_convert(root), tmp_path / "x", said, str(_iteration(root)))
    root = _copy("tp1_dp2_torch", tmp_path)
    shutil.copy(
        _rank0(root) / "layer_wise_optimizer_1.pt", _rank0(root) / "layer_wise_optimizer_01.pt"
    )
    said = "layer_wise_optimizer_01.pt and layer_wise_optimizer_1.pt both name DP rank 1"
    refused(_convert(root), tmp_path / "x", said, str(_rank0(root)))


ORPHANS = {
    "megatron-torch": ("megatron/tp1_dp2_torch/checkpoint", "*/*/layer_wise_optimizer_0.pt"),
    "accelerate": ("accelerate/named/state", "optimizer_1.bin"),
    "lightning": ("lightning/named/checkpoints", "*.ckpt"),
}
"""A torch reader -> its fixture and the file whose optimizer state gets an orphan."""


@pytest.mark.parametrize("reader", sorted(ORPHANS))
def test_state_of_an_id_no_param_group_lists_is_refused(reader, tmp_path):
    """A param's state stored under its id as a str (``'1'`` for ``1``): the Megatron torch
    reader dropped it, 7 momentum buffers of 8 written, exit 0 (fifth pass, F6); refused now
    by the check the accelerate and Lightning readers share (``_fields.listed_state``)."""
    fixture, name = ORPHANS[reader]
    root = hostile_files.copy(FIXTURES.parent / fixture, tmp_path / "src")
    victim = next(root.glob(name))

    moved = []

    def str_key(value):
        state = (
            value[0]["optimizer"]["state"] if reader == "megatron-torch"
            else value["optimizer_states"][0]["state"] if reader == "lightning"
            else value["state"]
        )  # fmt: skip
        moved.append(min(state))
        state[str(moved[0])] = state.pop(moved[0])

    hostile_files.resave(victim, str_key)
    said = f"holds state of param index '{moved[0]}', which no param group lists"
    src = victim if reader == "lightning" else root
    refused([str(src), "--to", "torch"], tmp_path / "x", said, str(victim))
