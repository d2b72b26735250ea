"""FSDP2 / DCP with state not shaped like its param: dion's NorMuon (the cited port,
:mod:`.dion_normuon`, whose state dion makes for every param at construction: ``momentum``
shaped like the param, ``variance_neuron`` ``param[..., 0:1]``) over params under torch's
``fully_shard`` on CPU at world 2, its state DTensors sharded by rows as the params are, saved
through DCP as torchtitan and dion users do (``get_optimizer_state_dict``, flattened).

DCP keeps ``variance_neuron`` as one global ``(rows, 1)`` tensor in a chunk per rank. muonckpt's
DCP families keep no such state (docs/format.md §10), so ``from_dcp`` refuses it in one line
naming the param and the key, before anything is written."""

from __future__ import annotations

import pytest
import torch

from muonckpt import interop
from muonckpt.errors import CheckpointError

from .dion_normuon import NorMuon as DionNorMuon

SHAPES = {"w1": (16, 24), "w2": (24, 16), "b": (24,)}


def fsdp2_dion_to_dcp(path: str) -> None:
    """(each of 2 gloo ranks) The model fully sharded, dion's NorMuon over it with its state
    filled with known values by rows (as a step leaves it: DTensors sharded like the
    params), saved as DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = torch.nn.Module()
    gen = torch.Generator().manual_seed(5)
    for name, shape in SHAPES.items():
        model.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=gen)))
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model, mesh=mesh)
    named = dict(model.named_parameters())
    opt = DionNorMuon(
        [
            {"params": [named["w1"], named["w2"]]},
            {"params": [named["b"]], "algorithm": "adamw"},
        ]
    )
    for p in (named["w1"], named["w2"]):
        for value in opt.state[p].values():
            full = torch.randn(value.shape, generator=gen)
            value.copy_(distribute_tensor(full, mesh, value.placements, src_data_rank=None))
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    osd = get_optimizer_state_dict(model, opt, options=flat)
    dcp.save({"model": model.state_dict(), "optimizer": osd}, checkpoint_id=path)


@pytest.mark.dist
def test_fsdp2_row_state_in_dcp_is_refused_in_one_line_naming_param_and_key(tmp_path):
    from muonckpt.distributed.launch import run_distributed
    from muonckpt.interop.dcp import metadata as dcp_metadata

    src = tmp_path / "dcp"
    run_distributed(fsdp2_dion_to_dcp, 2, str(src), timeout=120)
    stored = dcp_metadata.read_index(src).tensors["optimizer.state.w1.variance_neuron"]
    assert stored.shape == (16, 1) and len(stored.chunks) == 2  # one chunk of rows per rank
    with pytest.raises(CheckpointError) as refused:
        interop.from_dcp(src, tmp_path / "out", source="dion", to=None)
    line = str(refused.value)
    assert "\n" not in line and "param 'w1'" in line and "state 'variance_neuron'" in line
    assert "shape [16, 1], not its param's [16, 24]" in line
    assert not (tmp_path / "out").exists()
