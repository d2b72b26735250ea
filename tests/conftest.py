"""Fixtures shared by several test files.

``tests`` is a package (``tests/__init__.py``), so pytest imports every test module as
``tests.<name>`` with the repository root on ``sys.path``, helper modules are imported
relatively, and a gloo child finds a test's module-level function by that same name.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import muonckpt
from muonckpt.distributed.launch import run_distributed

from .fixture_model import assemble, single_process_optimizer
from .resume_cases import phase

REPO = Path(__file__).resolve().parents[1]
"""The repository root: the working directory for subprocesses that import ``tests.*``."""


STARTS_PROCESSES = re.compile(r"run_distributed\(|subprocess|Popen|workers=|--workers|_spawn\(")
"""What a test (or a fixture or module function it names) calls when it starts other processes."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that start processes are marked ``dist`` (``-m "not dist"`` is the fast tier);
    tests marked ``cuda`` are skipped where torch sees no CUDA device."""
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.dist)
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(skip)


def _starts_processes(item: pytest.Item) -> bool:
    """Whether the test's source, its fixtures' or that of a function of its module that it
    names (one level deep) starts processes."""
    function = getattr(item, "function", None)
    if function is None:
        return False
    sources = [_source(function)]
    info = getattr(item, "_fixtureinfo", None)
    for definitions in info.name2fixturedefs.values() if info else ():
        sources += [_source(d.func) for d in definitions]
    module = vars(inspect.getmodule(function) or object)
    names = set(re.findall(r"\b(\w+)\(", " ".join(sources)))
    sources += [_source(module[n]) for n in names if inspect.isfunction(module.get(n))]
    return any(STARTS_PROCESSES.search(source) for source in sources)


def _source(function: Callable[..., object]) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


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
