"""A reader of an S3 checkpoint while another save overwrites it, again and again, against
the real server: every load it completes is one of the saved states bitwise, never a mix of
two; what it cannot complete fails with the library's error saying that the checkpoint was
replaced while it was read (or is gone for an instant between its objects), never with
another state."""

from __future__ import annotations

import threading

import pytest
import torch

import muonckpt
from muonckpt.errors import CheckpointError

from .fixture_model import build, initial_params, single_process_optimizer
from .s3_cases import state_of
from .s3_server import S3Server

pytestmark = pytest.mark.dist

OVERWRITES = 8


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_reader_during_overwrites_never_sees_a_mix(s3_server: S3Server) -> None:
    url = f"s3://{s3_server.bucket()}/run/latest"
    saved = [single_process_optimizer(step) for step in range(1, OVERWRITES + 2)]
    states = [state_of(opt) for opt in saved]
    muonckpt.save(saved[0], url)
    done = threading.Event()
    outcomes: list[str] = []

    def overwrite() -> None:
        try:
            for opt in saved[1:]:
                muonckpt.save(opt, url, overwrite=True)
        finally:
            done.set()

    writer = threading.Thread(target=overwrite)
    writer.start()
    zeros = {name: torch.zeros_like(value) for name, value in initial_params().items()}
    while not done.is_set() or not outcomes:
        reader = build(1, 1, zeros)[0]
        try:
            muonckpt.load(reader, url)
        except CheckpointError as exc:
            outcomes.append("refused")
            said = str(exc)
            assert "changed while reading" in said or "missing" in said, said
            continue
        loaded = state_of(reader)
        matches = [i for i, state in enumerate(states) if _same(loaded, state)]
        assert len(matches) == 1, "a load that is none of the saved states"
        outcomes.append(f"state {matches[0]}")
    writer.join()
    assert any(o.startswith("state") for o in outcomes), outcomes
    final = build(1, 1, zeros)[0]
    muonckpt.load(final, url)
    assert _same(state_of(final), states[-1])
    assert muonckpt.verify(url) == []
