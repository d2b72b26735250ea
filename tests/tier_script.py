"""A rank of a job with the node-local tier, launched by ``torchrun`` as one of several
simulated nodes (each launcher with its own ``NODE_ROOT``, the node's local directory).

``python -m tests.tier_script save DIR DP TP STEPS [REPLICAS]``: trains ``STEPS`` steps at
``DP x TP``, saves with ``LocalTier(NODE_ROOT, replicas=REPLICAS, durable_every=1)`` to
``DIR/durable/step-S`` after each step S (each save's durable copy is the reference a
recovery is compared with; ``TIER_ASYNC`` set: by ``async_save``, its ``timeout`` the seconds
``TIER_ASYNC_TIMEOUT`` says), prints ``{"rank", "pid",
"saved"}`` (or how a save failed: ``"error"``, ``"library"``, ``"step"``) and waits to be
killed. ``TIER_DIE_AT=S``: node 1's ranks (``TIER_DIE_NODE``'s) exit in step S's save, in the
phase ``TIER_DIE_IN`` names (:data:`PHASES`; default ``copy``, while they receive the copies);
in a recovery, ``TIER_DIE_IN=fetch``: node 1's ranks exit while they receive the files they
lack.

``python -m tests.tier_script recover DIR DP TP STEP``: recovers at ``DP x TP`` from the
tier (the durable tier as the fallback), loads ``DIR/durable/step-STEP`` into a second
optimizer of the same layout, and prints ``{"rank", "tier", "step", "fetched", "refused",
"equal", "scale"}``: ``equal``, whether every state tensor and param, and the tensor of
``extra``, is bitwise what that load gives; ``scale``, the recovered ``extra`` tensor (the
step times 0..4).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import muonckpt
from muonckpt.checkpoint import saving
from muonckpt.files import writing
from muonckpt.storage.node_local import NodeStore, ReceivedFile

from .fixture_model import build, initial_params, train

PHASES = {
    "write": (saving, "write"),
    "copy": (ReceivedFile, "write"),
    "commit": (writing, "commit_on_nodes"),
    "publish": (NodeStore, "publish"),
    "fetch": (ReceivedFile, "write"),
}
"""Where node 1's ranks die (``TIER_DIE_IN``): the write into staging, the replica copy,
between the copy and the commit, the publish, a recovery's fetch."""


def _die_in(phase: str) -> None:
    """From now on, node 1's ranks exit (as a killed machine's) when they reach ``phase``."""
    if os.environ["GROUP_RANK"] == os.environ.get("TIER_DIE_NODE", "1"):
        owner, name = PHASES[phase]
        setattr(owner, name, lambda *_, **__: os._exit(1))


def _tier(replicas: int = 1) -> muonckpt.LocalTier:
    return muonckpt.LocalTier(os.environ["NODE_ROOT"], replicas=replicas, durable_every=1)


def save(where: Path, dp: int, tp: int, steps: int, replicas: int = 1) -> None:
    opt, sharded, d, t = build(dp, tp, initial_params())
    said: dict[str, Any] = {"rank": dist.get_rank(), "pid": os.getpid()}
    try:
        for step in range(1, steps + 1):
            train(opt, sharded, d, t, step - 1, 1)
            if step == int(os.environ.get("TIER_DIE_AT", "0")):
                _die_in(os.environ.get("TIER_DIE_IN", "copy"))
            path, tier = where / "durable" / f"step-{step}", _tier(replicas)
            extra = {"step": step, "scale": torch.arange(5.0) * step}  # a file of its own
            if os.environ.get("TIER_ASYNC"):
                timeout = float(os.environ.get("TIER_ASYNC_TIMEOUT", "1800"))
                saved = muonckpt.async_save(
                    opt, path, extra=extra, tier=tier, timeout=timeout
                ).result()
            else:
                saved = muonckpt.save(opt, path, extra=extra, tier=tier)
        said["saved"] = str(saved)
    except Exception as exc:
        said.update(error=str(exc), library=isinstance(exc, muonckpt.MuonCkptError), step=step)
    _say(said)
    threading.Event().wait()  # until the test kills this node


def _values(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    found = {}
    for group in opt.param_groups:
        for name, p in zip(group["param_names"], group["params"], strict=True):
            found[f"{name}/param"] = p.detach().clone()
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    found[f"{name}/{key}"] = value.clone()
    return found


def recover(where: Path, dp: int, tp: int, step: int) -> None:
    opt, _, _, _ = build(dp, tp, initial_params())
    if os.environ.get("TIER_DIE_IN") == "fetch":
        _die_in("fetch")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        extra: dict[str, Any] = {}
        got = muonckpt.recover(opt, _tier(), where / "durable", extra=extra)
    equal = None
    if (where / "durable" / f"step-{step}").exists():
        reference, _, _, _ = build(dp, tp, initial_params())
        saved: dict[str, Any] = {}
        muonckpt.load(reference, where / "durable" / f"step-{step}", extra=saved)
        mine = {**_values(opt), "extra.scale": extra["scale"]}
        theirs = {**_values(reference), "extra.scale": saved["scale"]}
        equal = mine.keys() == theirs.keys() and all(
            torch.equal(mine[k].view(torch.uint8), theirs[k].view(torch.uint8)) for k in mine
        )
    _say(
        {
            "rank": dist.get_rank(),
            "tier": got.tier,
            "step": got.step,
            "fetched": got.fetched,
            "refused": got.refused,
            "warnings": [str(w.message) for w in said],
            "equal": equal,
            "scale": extra["scale"].tolist(),
        }
    )


def _say(said: dict[str, Any]) -> None:
    """One JSON line on stdout, in one write: the ranks of torchrun share one pipe."""
    sys.stdout.write(json.dumps(said) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    timeout = float(os.environ.get("MUONCKPT_RENDEZVOUS_TIMEOUT", "60"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    torch.set_num_threads(1)
    mode, directory, *numbers = sys.argv[1:]
    {"save": save, "recover": recover}[mode](Path(directory), *map(int, numbers))
    dist.destroy_process_group()
