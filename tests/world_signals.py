"""Signals between the ranks of a ``run_distributed`` world, through its rendezvous store: one
rank says that something has happened, another blocks until it has (a bounded wait on the
store, which answers the moment the key is set), instead of sleeping for long enough."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

PREFIX = "tests.world_signals/"
"""Beside the keys of torch and muonckpt in the same store."""


def _store(timeout: float) -> dist.TCPStore:
    """A client of the store ``run_distributed`` hosts for this world (its children's
    ``MASTER_ADDR`` and ``MASTER_PORT``)."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )


def announce(event: str) -> None:
    """Tell every rank of this world that ``event`` has happened."""
    _store(60.0).set(PREFIX + event, "1")


def await_event(event: str, timeout: float = 60.0) -> None:
    """Block until some rank has announced ``event``; a TimeoutError after ``timeout`` s."""
    try:
        _store(timeout).wait([PREFIX + event], timedelta(seconds=timeout))
    except dist.DistStoreError as exc:
        raise TimeoutError(f"no rank announced {event!r} within {timeout:.0f} s") from exc
