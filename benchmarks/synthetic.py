"""The synthetic Muon optimizer state every benchmark saves, loads and converts.

Transformer-shaped fp32 state, hidden size 1024: per layer qkv (3072x1024, TP dim 0), proj
(1024x1024, TP dim 1), up (4096x1024, TP dim 0), down (1024x4096, TP dim 1) in a Muon group
(one momentum buffer each) and two norms (AdamW, two moments each, TP-replicated), plus an
8192x1024 embedding (AdamW, TP dim 0); as many layers as the size needs. Values are random
instead of trained (bf16 Newton-Schulz is slow on CPUs), which changes nothing for I/O.
The functions taking ``dp``/``tp`` run inside a process group of dp x tp ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

import muonckpt
from muonckpt.distributed.groups import grid_groups
from muonckpt.format.kinds import ADAMW_STATE_KEYS, MUON_STATE_KEYS
from muonckpt.layout.topology import Region, Topology, strided_runs
from muonckpt.state.placement import describe
from muonckpt.state.regions import copy_groups_

Shapes = dict[str, tuple[tuple[int, ...], int]]


def model_shapes(state_bytes: int, hidden: int = 1024) -> Shapes:
    """name -> (shape, tp_split_dim) for enough layers to make ``state_bytes`` of fp32 state."""
    layer = {
        "attn.qkv.weight": ((3 * hidden, hidden), 0),
        "attn.proj.weight": ((hidden, hidden), 1),
        "mlp.up.weight": ((4 * hidden, hidden), 0),
        "mlp.down.weight": ((hidden, 4 * hidden), 1),
        "norm1.weight": ((hidden,), -1),
        "norm2.weight": ((hidden,), -1),
    }
    per_layer = sum(math.prod(s) * 4 * len(state_keys(k, s)) for k, (s, _) in layer.items())
    layers = max(1, state_bytes // per_layer)
    shapes = {"embed.weight": ((8 * hidden, hidden), 0)}
    for i in range(layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def state_keys(name: str, shape: tuple[int, ...]) -> tuple[str, ...]:
    """Muon for 2-D params except the embedding, AdamW for the rest."""
    muon = len(shape) == 2 and not name.startswith("embed")
    return MUON_STATE_KEYS if muon else ADAMW_STATE_KEYS


def state_bytes(shapes: Shapes) -> int:
    """Bytes of the whole (unsharded, unreplicated) fp32 optimizer state."""
    return sum(math.prod(s) * 4 * len(state_keys(n, s)) for n, (s, _) in shapes.items())


def largest_tensor_bytes(shapes: Shapes) -> int:
    return max(math.prod(s) * 4 for s, _ in shapes.values())


def param_of(tensor_key: str) -> str:
    """``state.<param>.<key>`` -> ``<param>``."""
    return tensor_key[len("state.") : tensor_key.rindex(".")]


def build_optimizer(shapes: Shapes, dp: int, tp: int, **muon_options) -> muonckpt.optim.Muon:
    """This rank's ZeRO-1 + TP sharded Muon over the shapes (no state yet); ``muon_options``
    go to :class:`muonckpt.optim.Muon`."""
    dp_group, tp_group = grid_groups(dp, tp)
    muon, adamw = [], []
    for name, (shape, _) in shapes.items():  # untouched ``empty`` pages cost no memory
        target = muon if state_keys(name, shape) == MUON_STATE_KEYS else adamw
        target.append((name, torch.empty(shape)))
    sharded = muonckpt.optim.shard_param_groups(
        [{"params": muon, "use_muon": True}, {"params": adamw}],
        Topology(dp, tp),
        dist.get_rank(dp_group),
        dist.get_rank(tp_group),
        tp_split_dims={n: d for n, (_, d) in shapes.items() if d >= 0},
        options=muonckpt.layout.topology.LayoutOptions(bucket_numel=40_000_000),
    )
    opt = muonckpt.optim.Muon(sharded.param_groups, **muon_options)
    opt.enable_distributed_mode(sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas)
    return opt


def fill_state(opt: muonckpt.optim.Muon) -> dict[str, torch.Tensor]:
    """Random state, as after some steps; returns the tensors a rank writes, by file key."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    local = {}
    for group in opt.param_groups:
        group["step"] = 10
        keys = MUON_STATE_KEYS if group.get("use_muon") else ADAMW_STATE_KEYS
        for name, p in zip(group["param_names"], group["params"], strict=True):
            for key in keys:
                value = torch.empty_like(p).uniform_(-1, 1, generator=gen)
                opt.state[p][key] = value
                local[f"state.{name}.{key}"] = value
    return local


def local_regions(opt: muonckpt.optim.Muon) -> dict[str, Region]:
    """param name -> the region of the full tensor this rank holds."""
    return {p.name: p.local for p in describe(opt).params}


def naive_payload(
    opt: muonckpt.optim.Muon, local: dict[str, torch.Tensor], shapes: Shapes, tp: int
):
    """What a hand-written per-rank ``torch.save`` holds: local tensors, regions, full shapes.

    TP-replicated params (the norms) are saved by TP rank 0 only, as muonckpt does.
    """
    regions = local_regions(opt)
    payload: dict = {"state": {}, "regions": {}, "shapes": {}}
    for tkey, tensor in local.items():
        name = param_of(tkey)
        if shapes[name][1] < 0 and dist.get_rank() % tp:
            continue
        r = regions[name]
        payload["state"][tkey] = tensor
        payload["regions"][tkey] = [r.cols, r.block_start, r.block_width, r.start, r.stop]
        payload["shapes"][tkey] = list(shapes[name][0])
    return payload


def naive_share(files: Iterable[Path], regions: dict[str, Region]) -> dict[str, torch.Tensor]:
    """The naive load with reshard: ``torch.load`` each old rank's file, keep what is ours.

    Files are loaded one at a time, so the peak is this rank's share plus one old rank file.
    """
    own: dict[str, torch.Tensor] = {}
    for file in files:
        part = torch.load(file, weights_only=True)
        for tkey, piece in part["state"].items():
            target = regions[param_of(tkey)]
            groups = strided_runs(Region(*part["regions"][tkey]), target)
            if groups:
                if tkey not in own:
                    own[tkey] = torch.empty(target.numel, dtype=piece.dtype)
                copy_groups_(own[tkey], piece.reshape(-1), groups)
        del part
    return own


def dtensor_state(shapes: Shapes, dp: int, tp: int) -> dict:
    """The same state as DTensors for PyTorch DCP, on a (dp, tp) CPU device mesh.

    DCP cannot express ZeRO-1's flat bucket slices, so each rank holds FSDP-style blocks
    instead: placements ``[Shard(0), Shard(tp_split_dim)]``, ``Replicate()`` on tp for unsplit
    params. Same keys, shapes, dtype and total bytes; random values (not this rank's Muon state).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(dist.get_rank())
    state = {}
    for name, (shape, split) in shapes.items():
        placements = [Shard(0), Shard(split) if split >= 0 else Replicate()]
        local_shape = list(shape)
        local_shape[0] //= dp
        if split >= 0:
            local_shape[split] //= tp
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        for key in state_keys(name, shape):
            local = torch.empty(local_shape).uniform_(-1, 1, generator=gen)
            state[f"state.{name}.{key}"] = DTensor.from_local(
                local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
            )
    return state
