"""A rank of a training job whose launcher (or rank 0) is killed while it trains: it joins the
default group from the environment (``env://``, as torchrun or a cluster's launcher sets it),
takes a step, prints ``{"rank": R, "pid": P}``, waits until the test is done killing (the FIFO
``DIR/go-R`` is opened and closed at its other end), then saves, and prints how its save
ended: ``{"rank": R, "saved": path}`` or ``{"rank": R, "type": ..., "library": ...,
"message": ...}``.

``python -m tests.orphan_script DIR`` under torchrun, or with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set (rank 0 then hosts the store).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import muonckpt

from .fixture_model import build, initial_params, train


def main(directory: str) -> None:
    where = Path(directory)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    opt, sharded, dp_rank, tp_rank = build(world, 1, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 1)
    _say({"rank": rank, "pid": os.getpid()})
    (where / f"go-{rank}").read_bytes()  # the test kills the launcher or rank 0 meanwhile
    outcome: dict[str, Any] = {"rank": rank}
    try:
        outcome["saved"] = str(muonckpt.save(opt, where / "ckpt"))
    except Exception as exc:
        outcome.update(type=type(exc).__name__, message=str(exc))
        outcome["library"] = isinstance(exc, muonckpt.MuonCkptError)
    _say(outcome)
    os._exit(0)  # the group lost a member: no orderly teardown


def _say(said: dict[str, Any]) -> None:
    """One JSON line on stdout, in one write: the ranks of torchrun share one pipe."""
    sys.stdout.write(json.dumps(said) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
