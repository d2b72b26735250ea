"""A manifest ``verify`` calls sound never makes a tool crash (issue 20, "a strict reader").

The fields of a small real checkpoint's manifest (group hyperparameters and optimizer
descriptions, momentum, steps, scalars and their dtypes, shapes, split dims, group indices,
regions, chunk sizes, topology) are mutated: a value of another type or out of range, or the
key deleted. Every mutation goes through ``verify``; where it calls the checkpoint sound, every
other tool runs on it too: ``load`` into the optimizer that saved it, ``consolidate``,
``reshard``, ``convert`` to each implementation, ``inspect`` (``summarize``) and ``diff``
against the original, and the CLI's ``inspect`` and ``diff``. Each may fail only with
muonckpt's own errors (the CLI: exit code 1 or 2 and no traceback).
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import muonckpt
from muonckpt import MuonCkptError, offline
from muonckpt.cli import app

from .fixture_model import build, initial_params, single_process_optimizer
from .test_fuzz import event, watchdog

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)

EDGE = [0, 1, -1, 2, 0.5, 1.0, 0.999999, -0.5, 1e30, -1e30, 2**31, 2**53 + 1, 2**63, 2**64]
values = st.one_of(
    st.sampled_from(EDGE),
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(["sum", "ema", "F32", "I32", "BOOL", "U8", "group", "tensor", "int", "muon"]),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _leaf_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(value, dict):
        out = [prefix] if prefix else []
        return out + [p for k, v in value.items() for p in _leaf_paths(v, (*prefix, k))]
    if isinstance(value, list):
        return [prefix] + [p for i, v in enumerate(value) for p in _leaf_paths(v, (*prefix, i))]
    return [prefix]


@functools.cache
def _mutable_paths(text: str) -> tuple[list[tuple], list[tuple]]:
    """Every field's path, and those drawn more often: most mutations of pieces and files are
    damage verify finds; fields that verify passes on to the tools (settings, kinds, steps,
    scalars, split dims, groups) are where a tool could crash."""
    paths = [p for p in _leaf_paths(json.loads(text)) if p and p[0] in FIELDS]
    soft = [p for p in paths if p[0] in ("groups", "topology") or "scalars" in p]
    soft += [p for p in paths if p[0] == "params" and p[2:3] in (("tp_split_dim",), ("group",))]
    return paths, soft


FIELDS = ("groups", "params", "topology", "pieces", "files", "format_version", "kind")


@st.composite
def field_mutation(draw, body: dict) -> tuple[dict, list[str]]:
    paths, soft = _mutable_paths(json.dumps(body))
    body = copy.deepcopy(body)
    log = []
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(soft) if draw(st.integers(0, 3)) else st.sampled_from(paths))
        node = body
        try:
            for step in path[:-1]:
                node = node[step]
            node[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue
        if isinstance(node, dict) and draw(st.integers(0, 4)) == 0:
            del node[path[-1]]
            log.append(f"delete {list(path)}")
        else:
            node[path[-1]] = draw(values)
            log.append(f"{list(path)} := {node[path[-1]]!r}")
    return body, log


def _adamw_opt() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return opt


def _fresh_adamw() -> torch.optim.Optimizer:
    torch.manual_seed(0)
    return torch.optim.AdamW(torch.nn.Linear(4, 3).parameters())


CASES = {
    "packaged": (lambda: single_process_optimizer(1), lambda: build(1, 1, initial_params())[0]),
    "adamw": (_adamw_opt, _fresh_adamw),
}


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory) -> dict[str, Any]:
    make, fresh = CASES[request.param]
    root = tmp_path_factory.mktemp(f"tools-{request.param}")
    original = muonckpt.save(make(), root / "original")
    text = (original / "manifest.json").read_text()
    return {
        "root": root,
        "original": original,
        "body": json.loads(text),
        "fresh": fresh,
    }


def _tools(ckpt: Path, out: Path, saved: dict) -> dict[str, Any]:
    return {
        "load": lambda: muonckpt.load(saved["fresh"](), ckpt),
        "consolidate": lambda: offline.consolidate(ckpt, out / "full"),
        "reshard": lambda: offline.reshard(ckpt, out / "2x1", dp=2, tp=1),
        "convert torch": lambda: offline.convert(ckpt, out / "torch", to="torch"),
        "convert packaged": lambda: offline.convert(ckpt, out / "packaged", to="packaged"),
        "convert keller-jordan": lambda: offline.convert(ckpt, out / "kj", to="keller-jordan"),
        "summarize": lambda: offline.summarize(ckpt),
        "diff": lambda: offline.diff(ckpt, saved["original"]),
        "diff back": lambda: offline.diff(saved["original"], ckpt),
    }


def _run_every_tool(saved: dict, body: Any, log: list[str]) -> None:
    ckpt = saved["root"] / "mutated"
    out = saved["root"] / "out"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(saved["original"], ckpt)
    out.mkdir()
    (ckpt / "manifest.json").write_text(json.dumps(body))
    with watchdog():
        problems = muonckpt.verify(ckpt)
    if problems:
        event("verify: problems")
        return
    event("verify: sound")
    for name, tool in _tools(ckpt, out, saved).items():
        try:
            with watchdog(20):
                tool()
            event(f"{name}: ok")
        except MuonCkptError as exc:
            event(f"{name}: {type(exc).__name__}")
        except Exception as exc:  # the bug this test looks for
            raise AssertionError(f"{name} raised {exc!r} after mutations {log}") from exc
    runner = CliRunner()
    for argv in (["inspect", str(ckpt)], ["diff", str(ckpt), str(saved["original"]), "-d"]):
        result = runner.invoke(app, argv)
        assert result.exit_code in (0, 1, 2), (argv, log, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            argv,
            log,
            repr(result.exception),
        )
        assert "Traceback" not in result.output, (argv, log, result.output)


@FUZZ
@given(data=st.data())
def test_a_manifest_verify_calls_sound_never_crashes_a_tool(saved, data):
    body, log = data.draw(field_mutation(saved["body"]))
    _run_every_tool(saved, body, log)


def test_the_unmutated_checkpoint_passes_every_tool(saved):
    _run_every_tool(saved, saved["body"], [])
