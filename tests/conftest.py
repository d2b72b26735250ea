"""Fixtures shared by several test files, and the tiers' hooks: a test outside the ``dist``
tier may not start a process, and each run ends with its tier, size and wall time.

``tests`` is a package (``tests/__init__.py``), so pytest imports every test module as
``tests.<name>`` with the repository root on ``sys.path``, helper modules are imported
relatively, and a gloo child finds a test's module-level function by that same name.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import time
from collections.abc import Callable, Generator
from pathlib import Path

import pytest
import torch

import muonckpt
from muonckpt.distributed.launch import run_distributed

from .fixture_model import assemble, single_process_optimizer
from .resume_cases import phase
from .s3_proxy import s3_proxy  # noqa: F401 (the fixtures of the S3 tests)
from .s3_server import s3_server  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
"""The repository root: the working directory for subprocesses that import ``tests.*``."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped where torch sees no CUDA device."""
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(skip)


TIERS = {
    "not dist": ("the fast tier", 90.0),
    "not slow and not trainers": ("the whole suite", 600.0),
    "trainers": ("the trainers tier", None),
}
"""Each tier by its ``-m`` expression: its name and its time budget in seconds on 2 idle cores
(issue 31; the trainers tier has none: DeepSpeed's first run JIT-builds its ops);
``python -m pytest`` is ``-m "not slow and not trainers"`` (pyproject.toml's addopts)."""

_RUN: dict[str, float] = {}

_OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")


def pytest_sessionstart(session: pytest.Session) -> None:
    _RUN["start"] = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's last line: its tier, its size and its wall time (pytest's summary included),
    measured here rather than quoted in the docs. The tests are counted from their reports,
    which reach the controller whether they ran in it or in xdist's workers."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or "start" not in _RUN or config.getoption("collectonly"):
        return
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    seconds = time.monotonic() - _RUN["start"]
    tests = {r.nodeid for kind in _OUTCOMES for r in reporter.stats.get(kind, ())}
    expression = config.getoption("markexpr")
    whole = config.args_source is pytest.Config.ArgsSource.TESTPATHS
    selection = f'-m "{expression}"' if expression else "no -m"
    name, budget = TIERS.get(expression, (selection, None))
    label = f"{name} ({selection})" if whole else f"the tests named ({selection})"
    workers = config.getoption("numprocesses", None) or 1
    line = (
        f"{label}: {len(tests)} tests in {seconds:.1f} s on {os.cpu_count()} cores"
        f" ({workers} worker{'s' if workers != 1 else ''})"
    )
    if whole and budget is not None:
        line += f", budget {budget:.0f} s on 2 idle cores"
    reporter.write_sep("-", line)


class StartedProcessError(AssertionError):
    """A test not marked ``dist`` started a process."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _refusing_processes_unless_dist(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from _refusing_processes_unless_dist(item))


def _refusing_processes_unless_dist(item: pytest.Item) -> Generator[None, object, object]:
    """Runs a test's setup or call; unless it is marked ``dist``, every way to start a process
    (``subprocess``, ``multiprocessing``, hence ``run_distributed``, and ``os.fork``) raises
    instead, and the test fails even if it caught that error, so the fast tier
    (``-m "not dist"``) stays free of processes."""
    if item.get_closest_marker("dist") is not None:
        return (yield)
    refusal = f"{item.nodeid} starts a process: mark it @pytest.mark.dist"
    refused: list[str] = []

    def refuse(*args: object, **kwargs: object) -> None:
        refused.append(refusal)
        raise StartedProcessError(refusal)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        patch.setattr(os, "fork", refuse)
        patch.setattr(os, "posix_spawn", refuse)
        result = yield
    if refused:
        raise StartedProcessError(refusal)
    return result


@pytest.fixture(scope="session")
def single_ckpt(tmp_path_factory) -> Callable[[int], Path]:
    """``single_ckpt(steps)``: a per-rank checkpoint of the fixture model trained ``steps``
    steps in this process (1 x 1), saved once per session. Shared: copy it before damaging it."""
    root = tmp_path_factory.mktemp("single")
    saved: dict[int, Path] = {}

    def get(steps: int) -> Path:
        if steps not in saved:
            saved[steps] = muonckpt.save(single_process_optimizer(steps), root / f"steps-{steps}")
        return saved[steps]

    return get


@pytest.fixture(scope="session")
def reference_params() -> Callable[[int], dict[str, torch.Tensor]]:
    """``reference_params(steps)``: full params after an uninterrupted single-process run of
    ``steps`` steps, computed once per session in a gloo child (like every run it is compared
    with, so the thread settings match)."""
    done: dict[int, dict[str, torch.Tensor]] = {}

    def get(steps: int) -> dict[str, torch.Tensor]:
        if steps not in done:
            shards = run_distributed(phase, 1, 1, 1, None, None, 0, steps, None, timeout=60)
            done[steps] = assemble(1, 1, shards)
        return done[steps]

    return get
