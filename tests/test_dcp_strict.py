"""A strict DCP round trip (issue 34, item 3): a GPT-style FSDP2 job (tied head, a causal-mask
buffer, torch.optim.Muon + AdamW built from named params) saves DCP with ``get_state_dict``;
through muonckpt and back to DCP, a job at world 2 and (through a ``reshard`` to 3 x 1 on
the way) at world 3 loads it with a plain strict ``dcp.load`` of its whole state, and every
param, buffer and state tensor is the source's, bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from typer.testing import CliRunner

import muonckpt
from muonckpt import interop, offline
from muonckpt.cli import app
from muonckpt.distributed.launch import run_distributed

from .tiny_gpt import TinyGPT, optimizers, train

STEPS = 2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _job(seed: int):
    model = TinyGPT(seed=seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    return model, optimizers(list(model.named_parameters()))


def _full(value):
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def _everything(model, opts) -> dict[str, torch.Tensor]:
    """Every param and buffer of the model and every state tensor, in full, by name."""
    out = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in opt.state[p].items():
                    out[f"state.{names[p]}.{key}"] = _full(value)
    return out


def _train_and_save(path: str) -> dict[str, torch.Tensor]:
    model, opts = _job(seed=0)
    train(model, opts, 0, STEPS)
    msd, osd = get_state_dict(model, opts, options=FLAT)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)
    return _everything(model, opts)


def _load_strictly(path: str) -> dict[str, torch.Tensor]:
    model, opts = _job(seed=1)
    msd, osd = get_state_dict(model, opts, options=FLAT)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=path)  # strict: every key of the job's state must be found
    set_state_dict(
        model,
        opts,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=FLAT,
    )
    return _everything(model, opts)


@pytest.mark.dist
def test_a_gpt_style_fsdp2_job_round_trips_and_loads_strictly(tmp_path):
    src = str(tmp_path / "job")
    job = run_distributed(_train_and_save, 2, src, timeout=120)[0]
    # (issue 57) --from torch alone converts for torch, and the way back writes the layout read
    ck = CliRunner().invoke(app, ["convert", src, "-o", str(tmp_path / "ck"), "--from", "torch"])
    assert ck.exit_code == 0 and "DCP layout recipe" in ck.output, ck.output
    assert "left out" not in ck.output  # buffers, the tied head and param_names are carried
    assert (
        muonckpt.read_manifest(tmp_path / "ck").groups[0].optimizer["optimizer"]
        == "torch.optim.Muon"
    )
    resharded = offline.reshard(tmp_path / "ck", tmp_path / "3x1", dp=3, tp=1)  # carries them too
    for world, muon in ((2, tmp_path / "ck"), (3, resharded)):
        out = tmp_path / f"dcp{world}"
        argv = ["convert", str(muon), "-o", str(out), "--to", "torch", "--format", "dcp"]
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 0 and "left out" not in result.output, result.output
        assert "DCP layout recipe" in result.output, result.output
        loaded = run_distributed(_load_strictly, world, str(out), timeout=120)[0]
        assert loaded.keys() == job.keys()
        for name, value in job.items():
            assert torch.equal(loaded[name], value), (world, name)


def test_from_dcp_tells_a_tied_name_from_an_equal_shaped_tensor(tmp_path):
    """In one process: a copy bitwise equal to a param becomes its alias; a tensor of the same
    shape with other values, and a buffer, become the model file's tensors; the torchtitan
    layout's top-level items, not told from the job's, are left out and reported."""
    w = torch.randn(3, 4)
    src = tmp_path / "dcp"
    model = {"w": w, "head": w.clone(), "other": w + 1, "mask": torch.ones(2)}
    optimizer = {"state.w.momentum_buffer": torch.ones(3, 4), "param_groups.w.momentum": 0.9}
    dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=str(src))
    ck = interop.from_dcp(src, tmp_path / "ck", source="torch", to="torch")
    assert ck.left_out == ()
    manifest = muonckpt.read_manifest(ck.path)
    assert manifest.model is not None and manifest.model.aliases == {"head": "w"}
    assert sorted(t.name for t in manifest.model.tensors) == ["mask", "other"]
    out = interop.to_dcp(ck.path, tmp_path / "back", to="torch", layout="recipe")
    state = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
    dcp.load(state, checkpoint_id=str(out.path))
    assert all(torch.equal(state["model"][k], v) for k, v in model.items())
    titan = tmp_path / "titan"
    dcp.save({**model, "optimizer": optimizer}, checkpoint_id=str(titan))
    left = interop.from_dcp(titan, tmp_path / "t", source="torch", to="torch").left_out
    assert set(left) == {"head (1 item)", "other (1 item)", "mask (1 item)"}
