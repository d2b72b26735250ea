"""Saves to S3 run inside gloo children (``run_distributed``) and a writer process killed
mid-save (``python -m tests.s3_save_cases URL PAUSE``), on the suite's fixture model.

Each gloo child is given the server's AWS environment and a temporary directory of its own,
as a rank on a host of its own would have: nothing is shared between the ranks but the
process group and the bucket."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

import torch.distributed as dist

import muonckpt
from muonckpt.storage import s3store

from .fixture_model import build, initial_params, single_process_optimizer, train


def save_to_both(
    dp: int, tp: int, env: dict[str, str], scratch: list[str], local: str, url: str
) -> list[str]:
    """Save per-rank and consolidated, each to a local directory and to S3, and per-rank to
    S3 in the background; what the saves to S3 returned, and what is left in this rank's own
    temporary directory."""
    os.environ.update(env)
    mine = scratch[dist.get_rank()]
    tempfile.tempdir = mine  # this rank's "host"
    opt, sharded, dp_rank, tp_rank = build(dp, tp, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 2)
    out = []
    for kind, consolidated in (("per-rank", False), ("consolidated", True)):
        muonckpt.save(opt, f"{local}/{kind}", consolidated=consolidated)
        saved = muonckpt.save(opt, f"{url}/{kind}", consolidated=consolidated, keep_last=1)
        out.append(str(saved))
    # in the background: its ranks agree through the process group's store, not files
    out.append(str(muonckpt.async_save(opt, f"{url}/async").result()))
    return [*out, *(n for n in os.listdir(mine) if n.startswith("muonckpt-s3-"))]


def save_one_rank_cannot_reach(
    dp: int, tp: int, env: dict[str, str], scratch: list[str], url: str, away: str
) -> list[str]:
    """Save to S3 where rank 1 reaches the server only through ``away`` (a proxy answering
    every request 503): the error every rank raises, and what is left in its own temporary
    directory."""
    os.environ.update(env)
    if dist.get_rank() == 1:
        os.environ["AWS_ENDPOINT_URL"] = away
    mine = scratch[dist.get_rank()]
    tempfile.tempdir = mine
    opt, sharded, dp_rank, tp_rank = build(dp, tp, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, 1)
    try:
        muonckpt.save(opt, url)
    except muonckpt.CheckpointError as exc:
        return [str(exc), *(n for n in os.listdir(mine) if n.startswith("muonckpt-s3-"))]
    return ["saved"]


def _pause_at(where: str) -> None:
    """Make the ``count``-th upload of a file (``upload:COUNT``) or the commit (``commit``)
    say ``paused`` on stdout and wait to be killed."""
    what, _, count = where.partition(":")

    def pause() -> None:
        print("paused", flush=True)
        time.sleep(120)

    if what == "commit":
        commit = s3store.S3Store._commit

        def paused_commit(self: s3store.S3Store, *args: Any) -> None:
            pause()
            commit(self, *args)

        s3store.S3Store._commit = paused_commit  # type: ignore[method-assign]
        return
    client = s3store.S3Client
    upload = client.upload
    seen = [0]

    def paused_upload(self: s3store.S3Client, *args: Any, **kwargs: Any) -> str:
        seen[0] += 1
        if seen[0] == int(count):
            pause()
        return upload(self, *args, **kwargs)

    client.upload = paused_upload  # type: ignore[method-assign]


if __name__ == "__main__":  # a writer saving over URL, killed where PAUSE says
    target, where = sys.argv[1:3]
    _pause_at(where)
    muonckpt.save(single_process_optimizer(3), target, overwrite=True)
    print("committed", flush=True)
