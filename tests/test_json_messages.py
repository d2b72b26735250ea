"""The step protocol's JSON messages (``collectives.gather_json`` / ``broadcast_json``) over
real gloo processes: each size around the head transfer's inline limit, among a subset of the
ranks, in the order of ``ranks``."""

from __future__ import annotations

import json

import pytest

from muonckpt.distributed import collectives
from muonckpt.distributed.launch import run_distributed

INLINE = collectives._INLINE_BYTES
RANKS, ROOT = [2, 0, 3], 3
"""The ranks that exchange (rank 1 of the 4 takes no part), in their order, and the root."""


def _text(chars: int, rank: int) -> str:
    """Rank ``rank``'s message: ``chars`` characters, then a non-ASCII one and the rank."""
    return "x" * chars + f"é{rank}"


def _exchange(lengths: list[int]) -> list[dict]:
    """(each rank of :data:`RANKS`) For each length: every rank's text gathered on the root,
    which broadcasts what it received; what each rank got."""
    rank = collectives.global_rank()
    if rank not in RANKS:
        return []
    seen = []
    for chars in lengths:
        gathered = collectives.gather_json(_text(chars, rank), RANKS, ROOT)
        verdict = None if gathered is None else {"chars": chars, "gathered": gathered}
        seen.append(collectives.broadcast_json(verdict, RANKS, ROOT))
    return seen


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_messages_of_each_size_arrive_whole_in_the_order_of_ranks():
    fits = INLINE - len(json.dumps(_text(0, 0)))  # the longest text whose message fits
    lengths = [0, 10, fits - 1, fits, fits + 1, fits + 2, 3 * INLINE]
    assert len(json.dumps(_text(fits, 0))) == INLINE
    by_rank = run_distributed(_exchange, 4, lengths, timeout=100)
    assert by_rank[1] == []
    expected = [{"chars": n, "gathered": [_text(n, r) for r in RANKS]} for n in lengths]
    for rank in RANKS:
        assert by_rank[rank] == expected
