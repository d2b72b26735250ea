"""Load phases run inside gloo children: ranks that would read different checkpoints."""

from __future__ import annotations

import torch
import torch.distributed as dist

import muonckpt
from muonckpt.checkpoint import loading

from .fixture_model import MODEL, build, initial_params, local_params, train
from .world_signals import announce, await_event


def mixed_load_phase(first: str, second: str, how: str) -> dict[str, object]:
    """Rank 0 loads ``first``; rank 1 loads ``second`` (``"paths"``), or ``first`` after
    saving other state over it once rank 0 has opened it (``"replaced"``), or ``first`` as
    well (``"damaged"``: the test damaged what only rank 1 reads; ``"rename"``: rank 1 maps
    the names, rank 0 does not). Returns the error and whether this rank's optimizer kept its
    own state and params."""
    opt, sharded, dp_rank, tp_rank = build(2, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 1)
    before = local_params(opt)
    momenta = [s["momentum_buffer"].clone() for s in opt.state.values() if "momentum_buffer" in s]
    opt.state_dict()  # the grid is learned (a collective) once, here: load then opens at once
    dist.barrier()
    path = first
    if dist.get_rank() == 1 and how == "paths":
        path = second
    if how == "replaced":  # between the ranks' opens (after the rendezvous, which they pass)
        original = loading.open_checkpoint

        def open_in_turn(where, **how_to_open):
            if dist.get_rank() == 0:
                found = original(where, **how_to_open)
                announce("rank 0 opened")
                return found
            await_event("rank 0 opened")
            other, *_ = build(1, 1, initial_params())
            muonckpt.save(other, first, overwrite=True)  # a single-process checkpoint
            return original(where, **how_to_open)

        loading.open_checkpoint = open_in_turn
    rename = {"": ""} if how == "rename" and dist.get_rank() == 1 else None
    try:
        muonckpt.load(opt, path, rename=rename)
        error = "no error"
    except muonckpt.CheckpointError as exc:
        error = str(exc)
    after = local_params(opt)
    kept = all(torch.equal(after[n], v) for n, v in before.items()) and all(
        torch.equal(s["momentum_buffer"], m)
        for s, m in zip(
            (s for s in opt.state.values() if "momentum_buffer" in s), momenta, strict=True
        )
    )
    return {"error": error, "kept": kept}


def in_place_load_phase(path: str, dp: int, tp: int) -> dict[str, object]:
    """Train 2 steps at ``dp`` x ``tp``, save, train 1 more, load the checkpoint back into the
    same optimizer and train 1 again. Returns whether every state tensor kept its identity,
    and this rank's params, beside those of an optimizer built from zeros that loaded the
    same checkpoint and trained the same step."""
    opt, sharded, d, t = build(dp, tp, initial_params())
    train(opt, sharded, d, t, 0, 2)
    muonckpt.save(opt, path)
    train(opt, sharded, d, t, 2, 1)
    own = [(p, k, v) for p, s in opt.state.items() for k, v in s.items() if torch.is_tensor(v)]
    muonckpt.load(opt, path)
    kept = bool(own) and all(opt.state[p][k] is v for p, k, v in own)
    train(opt, sharded, d, t, 2, 1)
    fresh, fresh_sharded, *_ = build(dp, tp, MODEL.zeros())
    muonckpt.load(fresh, path)
    train(fresh, fresh_sharded, d, t, 2, 1)
    return {"kept": kept, "params": local_params(opt), "fresh": local_params(fresh)}
