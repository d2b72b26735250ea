"""The ``muonckpt`` logger's events: silent by default (a NullHandler), one record per start,
end and failure of save, async_save, load and the offline tools, on rank 0 only unless
``MUONCKPT_LOG_RANKS=all`` asks for every rank."""

from __future__ import annotations

import logging

import pytest
import torch

import muonckpt
from muonckpt import events


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def events(self) -> list[tuple[str, str]]:
        return [(r.muonckpt["operation"], r.muonckpt["event"]) for r in self.records]


@pytest.fixture
def records():
    logger = logging.getLogger("muonckpt")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _optimizer() -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.ones(4, 3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    return opt


def test_the_logger_is_silent_by_default():
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("muonckpt").handlers)


def test_save_load_and_tools_log_start_and_end_with_their_facts(tmp_path, records):
    opt = _optimizer()
    path = muonckpt.save(opt, tmp_path / "ckpt")
    muonckpt.async_save(opt, tmp_path / "ckpt", overwrite=True).result()
    muonckpt.load(_optimizer(), path)
    muonckpt.verify(path)
    muonckpt.offline.summarize(path)
    muonckpt.offline.consolidate(src=path, dst=tmp_path / "whole")  # (paths by keyword)
    list(muonckpt.offline.iter_diff(path, tmp_path / "whole"))
    expected = ["save", "async_save", "load", "verify", "inspect", "consolidate", "diff"]
    assert records.events() == [(op, e) for op in expected for e in ("start", "end")]
    ends = {r.muonckpt["operation"]: r.muonckpt for r in records.records[1::2]}
    assert ends["save"]["path"] == str(path) and ends["save"]["ranks"] == 1
    assert ends["save"]["bytes"] > 48 and ends["load"]["bytes"] >= 3 * 48  # state and param
    assert ends["consolidate"]["path"] == f"{path} -> {tmp_path / 'whole'}"
    assert all(e["duration_s"] >= 0 for e in ends.values())
    assert records.records[1].getMessage().startswith(f"muonckpt.save end: {path} in ")


def test_a_failure_is_one_record_naming_the_error(tmp_path, records):
    with pytest.raises(muonckpt.CheckpointError):
        muonckpt.load(_optimizer(), tmp_path / "missing")
    assert records.events() == [("load", "start"), ("load", "failed")]
    failed = records.records[1]
    assert failed.levelno == logging.ERROR and "CheckpointError" in failed.muonckpt["error"]


def test_other_ranks_log_only_when_asked(records, monkeypatch):
    with events.Event("save", "p", rank=1, ranks=2):
        pass
    assert records.events() == []
    monkeypatch.setenv(events.RANKS_VARIABLE, "all")
    with events.Event("save", "p", rank=1, ranks=2):
        pass
    assert records.events() == [("save", "start"), ("save", "end")]
