"""(issues 22 and 31) A save and a load read top to bottom.

Every call into a package module during a real save or load is recorded (``sys.setprofile``,
and ``threading.setprofile`` for a background save's thread), closures, lambdas and callbacks
included, with the package modules on the stack at that moment. Two things are asserted:

- **No return up the stack.** Control never comes back to a module it left (issue 31: a save
  went ``saving`` -> ``writing.stage`` -> back into ``saving``'s ``check`` closure, and
  ``writing.write_files`` called ``saving``'s ``fetch`` lambda per tensor), except as a
  callback straight into the module that called (``X -> Y -> X``: the step protocol running
  the work its caller handed it, the commit watcher).
- **The steps in order.** The entry point calls each step of the save (describe and agree,
  collect, stage, plan, write, commit, retire, prune) and of the load (describe and agree,
  open, map, read, apply) itself, once, in that order; a background save runs the same
  steps, write to prune on its own thread.
- **One write engine.** A save, a background save, ``consolidate`` and a DeepSpeed import
  make the same calls of the write engine (:mod:`muonckpt.files.writing`), in the same
  order; and no parameter of its API, nor of any function of ``muonckpt.files``, is a
  callable (a producer hands the engine data: a plan, an iterator of its tensors, a draft of
  the manifest), the user's own progress report apart.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import threading
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import muonckpt
import muonckpt.files
from muonckpt import offline
from muonckpt.distributed.launch import run_distributed
from muonckpt.files import writing
from muonckpt.interop import from_deepspeed

from .fixture_model import build, initial_params, single_process_optimizer, train

_SAVING, _WRITING = "muonckpt.checkpoint.saving", "muonckpt.files.writing"
_API, _LOADING = "muonckpt.checkpoint.api", "muonckpt.checkpoint.loading"
_PER_MODULE = ("muonckpt.checkpoint.", "muonckpt.files.", "muonckpt.offline.", "muonckpt.interop.")
"""Packages whose modules are told apart: save and load, the files' engine, and the offline
tools and foreign formats that produce checkpoints through it."""

SAVE_STEPS = {
    (_SAVING, "agree"): "describe and agree",
    (_SAVING, "collect"): "collect",
    (_SAVING, "stage"): "stage",
    (_SAVING, "plan"): "plan",
    (_SAVING, "write"): "write",
    (_WRITING, "commit"): "commit",
    (_WRITING, "retire"): "retire",
    ("muonckpt.files.retention", "prune"): "prune",
}
"""(module, function) of each step of a save, as the entry point calls them."""

SAVE_CALLERS = {"_prepare": list(SAVE_STEPS.values())[:4], "_write_and_commit": ["write"]}
"""The entry point's functions that call the steps: the first four in the caller's thread,
the rest where the write runs."""

LOAD_STEPS = {
    (_LOADING, "_agree"): "describe and agree",
    (_LOADING, "_open"): "open",
    (_LOADING, "_agree_open"): "the ranks agree they opened one checkpoint",
    (_LOADING, "_map"): "map",
    (_LOADING, "_read_and_take"): "read",
    (_LOADING, "_agree_read"): "the ranks agree every share was taken",
    (_LOADING, "_apply"): "apply",
}


@dataclass
class Trace:
    """What a traced run did: each step called (name, the function that called it, the
    thread), each return up the stack (the package modules on the stack, outermost first),
    and every module it entered."""

    steps: dict[tuple[str, str], str]
    called: list[tuple[str, str, int]] = field(default_factory=list)
    returns_up: list[str] = field(default_factory=list)
    modules: set[str] = field(default_factory=set)

    def record(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = _module(frame)
        if module is None:
            return
        self.modules.add(module)
        step = self.steps.get((module, frame.f_code.co_qualname))
        if step is not None:
            caller = frame.f_back.f_code.co_name if frame.f_back is not None else "?"
            self.called.append((step, caller, threading.get_ident()))
        back = _return_up(_package_stack(frame))
        if back is not None and back not in self.returns_up:
            self.returns_up.append(back)

    def order(self) -> list[str]:
        return [step for step, _, _ in self.called]


def _module(frame: FrameType | None) -> str | None:
    """The save and load module ``frame`` runs in, or for the layers below them the layer
    (``muonckpt.storage``: its modules' calls among themselves are its own)."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    if not name.startswith("muonckpt."):
        return None
    return name if name.startswith(_PER_MODULE) else ".".join(name.split(".")[:2])


def _package_stack(frame: FrameType) -> list[tuple[str, bool]]:
    """The package modules on the stack down to ``frame``, outermost first, each run of one
    module once, with whether the run was entered through something handed down."""
    frames: list[FrameType] = []
    at: FrameType | None = frame
    while at is not None:
        frames.append(at)
        at = at.f_back
    stack: list[tuple[str, bool]] = []
    for at in reversed(frames):
        module = _module(at)
        if module is not None and (not stack or stack[-1][0] != module):
            stack.append((module, _handed_down(at)))
    return stack


CALLED, PULLED = 1, 2
"""How a frame runs work its caller was handed (:func:`_handed_down`): called back (a closure,
a lambda, a special method), or pulled (a generator: data, taken as whoever holds it needs)."""


def _handed_down(frame: FrameType) -> int:
    """Whether ``frame`` runs something its caller was handed: :data:`PULLED` for a generator
    (the tensors a producer hands the write engine, an index's pieces handed to its writer,
    pulled as they are written, however far down), :data:`CALLED` for a closure or a lambda,
    or a special method of a value (``__contains__`` of the group indices torch asks), else 0."""
    name, flags = frame.f_code.co_name, frame.f_code.co_flags
    if flags & inspect.CO_GENERATOR:
        return PULLED
    return CALLED if flags & inspect.CO_NESTED or name[:2] == name[-2:] == "__" else 0


def _return_up(stack: list[tuple[str, int]]) -> str | None:
    """The stack, if control came back to a module of :data:`_PER_MODULE` it had left other
    than as a callback straight into the module that called (``X -> Y -> X``, ``Y`` running a
    closure ``X`` handed it) or as a generator of its own being pulled (data ``X`` handed
    down, taken by whoever holds it). (Lower layers' own callbacks, a JSON decoder's hook, are
    theirs.)"""
    reduced: list[str] = []
    for module, handed_down in stack:
        if handed_down == PULLED and module in reduced:
            del reduced[reduced.index(module) + 1 :]  # X's generator, pulled: data, not control
        elif handed_down and len(reduced) >= 2 and reduced[-2] == module:
            reduced.pop()  # Y ran work X handed it: back in X
        elif module in reduced and module.startswith(_PER_MODULE):
            return " -> ".join([*reduced, module])
        elif module in reduced:
            del reduced[reduced.index(module) + 1 :]
        else:
            reduced.append(module)
    return None


def _traced(steps: dict[tuple[str, str], str], work: Callable[[], Any]) -> Trace:
    trace = Trace(steps)
    threading.setprofile(trace.record)  # a background save's thread, started inside
    sys.setprofile(trace.record)
    try:
        work()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return trace


def test_the_tracer_finds_a_callback_up_the_stack():
    """The rule catches the crossings of issue 31, and passes the step protocol's callbacks."""
    down, back = False, True  # entered by a call down, or through a closure handed down
    api, saving, writing = _API, _SAVING, _WRITING
    steps = [(writing, down), ("steps", down), ("collectives", down), ("steps", back)]
    check = [(api, down), (saving, down), *steps, (saving, back)]
    assert _return_up(check) == f"{api} -> {saving} -> {writing} -> steps -> {saving}"
    write = [(api, down), *steps, (saving, back), (writing, down)]  # saving's write closure
    assert _return_up(write) == f"{api} -> {writing} -> steps -> {saving} -> {writing}"
    stage = [(api, down), *steps, (writing, back), ("storage", down), (writing, back)]
    assert _return_up(stage) is None  # the protocol, the commit watcher: callbacks
    pulled = [(api, down), (writing, down), ("storage", down), ("format", down), (writing, PULLED)]
    assert _return_up(pulled) is None  # writing's generator, pulled two layers down: data
    called = [*pulled[:-1], (writing, CALLED)]  # a closure called back from there: control
    assert _return_up(called) == f"{api} -> {writing} -> storage -> format -> {writing}"


def _saved(work: Callable[[], Any], background: bool) -> Trace:
    trace = _traced(SAVE_STEPS, work)
    assert trace.returns_up == []
    assert trace.order() == list(SAVE_STEPS.values())
    for step, caller, thread in trace.called:
        first = step in SAVE_CALLERS["_prepare"]
        assert caller == ("_prepare" if first else "_write_and_commit"), (step, caller)
        assert (thread == threading.get_ident()) == (first or not background), step
    return trace


@pytest.mark.parametrize("consolidated", [False, True], ids=["per-rank", "consolidated"])
def test_a_save_calls_its_steps_in_order_and_never_returns_up(tmp_path, consolidated):
    optimizer = single_process_optimizer(1)
    path = tmp_path / "step-1"
    trace = _saved(
        lambda: muonckpt.save(optimizer, path, consolidated=consolidated, keep_last=2), False
    )
    assert muonckpt.verify(path) == []
    assert {_API, _SAVING, _WRITING, "muonckpt.state"} <= trace.modules


def test_a_background_save_runs_the_same_steps_write_to_prune_on_its_thread(tmp_path):
    optimizer = single_process_optimizer(1)
    path = tmp_path / "step-1"
    _saved(lambda: muonckpt.async_save(optimizer, path, keep_last=2).result(timeout=60), True)
    assert muonckpt.verify(path) == []


def test_a_load_opens_maps_reads_and_applies_in_order(tmp_path):
    muonckpt.save(single_process_optimizer(2), tmp_path / "ckpt")
    optimizer = single_process_optimizer(1)
    trace = _traced(LOAD_STEPS, lambda: muonckpt.load(optimizer, tmp_path / "ckpt"))
    assert trace.returns_up == []
    assert trace.order() == list(LOAD_STEPS.values())
    assert {caller for _, caller, _ in trace.called} == {"_load"}  # load's, and load_node_copy's


def _save_and_load_across_ranks(path: str, dp: int, tp: int) -> list[Any]:
    """(each rank) The packaged Muon at dp x tp after a step, saved per rank and loaded back:
    this rank's returns up the stack, the steps of each in order, and the modules entered."""
    optimizer, sharded, dp_rank, tp_rank = build(dp, tp, initial_params())
    train(optimizer, sharded, dp_rank, tp_rank, 0, 1)
    saved = _traced(SAVE_STEPS, lambda: muonckpt.save(optimizer, path, keep_last=1))
    loaded = _traced(LOAD_STEPS, lambda: muonckpt.load(optimizer, path))
    return [
        saved.returns_up + loaded.returns_up,
        saved.order(),
        loaded.order(),
        sorted(saved.modules),
    ]


@pytest.mark.dist
@pytest.mark.parametrize(("dp", "tp"), [(2, 1), (1, 2)])
def test_a_per_rank_save_and_load_of_the_distributed_muon_read_top_to_bottom(tmp_path, dp, tp):
    """The path issue 22 traced (a per-rank save of the distributed packaged Muon, whose grid
    is described on the first save), and its load: on each rank, the steps in order and no
    return up the stack."""
    path = str(tmp_path / "step-1")
    ranks = run_distributed(_save_and_load_across_ranks, dp * tp, path, dp, tp)
    for rank, (returns_up, save_order, load_order, modules) in enumerate(ranks):
        assert returns_up == [], (rank, returns_up)
        steps = list(SAVE_STEPS.values())
        assert save_order == (steps if rank == 0 else steps[:-1]), rank  # the root prunes
        assert load_order == list(LOAD_STEPS.values()), rank
        for module in ("checkpoint.api", "state", "layout"):
            assert f"muonckpt.{module}" in modules, (rank, modules)
    assert muonckpt.verify(path) == []


ENGINE_STEPS = {
    (_WRITING, name): name
    for name in ("open_staging", "write_files", "commit", "publish", "retire")
}
"""The write engine's calls every producer makes: the root opens the staging directory, the
writer pulls the producer's tensors into the plan's files, the commit (the root completes the
draft and publishes it), the retire."""

DEEPSPEED = Path(__file__).parent / "fixtures" / "deepspeed" / "w2_z1_torchadam_fp32" / "ckpt"


@pytest.mark.parametrize(
    "producer", ["save", "async_save", "consolidate", "from_deepspeed"], ids=str
)
def test_every_producer_makes_the_same_write_engine_calls_in_order(tmp_path, producer):
    optimizer = single_process_optimizer(1)
    muonckpt.save(optimizer, tmp_path / "saved")
    path = tmp_path / "out"
    work = {
        "save": lambda: muonckpt.save(optimizer, path),
        "async_save": lambda: muonckpt.async_save(optimizer, path).result(timeout=60),
        "consolidate": lambda: offline.consolidate(tmp_path / "saved", path),
        "from_deepspeed": lambda: from_deepspeed(DEEPSPEED, path),
    }[producer]
    trace = _traced(ENGINE_STEPS, work)
    assert trace.returns_up == []
    assert trace.order() == list(ENGINE_STEPS.values())
    assert muonckpt.verify(path) == []


def _engine_functions() -> list[tuple[str, Callable[..., Any]]]:
    """Every public function of ``muonckpt.files`` (and public class's constructor and public
    methods)."""
    found = []
    for info in pkgutil.iter_modules(muonckpt.files.__path__, "muonckpt.files."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(value):
                found.append((f"{module.__name__}.{name}", value))
            elif inspect.isclass(value):
                for method, function in vars(value).items():
                    function = getattr(function, "__func__", function)  # class, static
                    public = not method.startswith("_") or method == "__init__"
                    if inspect.isfunction(function) and public:
                        found.append((f"{module.__name__}.{name}.{method}", function))
    return found


def test_no_parameter_of_the_write_engine_is_a_callable():
    """(issue 51) Producers hand the engine data, never work to call back: no parameter is
    annotated a callable (the user's own :data:`~muonckpt.files.progress.Progress` apart, and
    :class:`~muonckpt.files.progress.ProgressLines`, one)
    and no default is a function. A protocol's steps (``each_then_root``) run the closures
    of the module that called the protocol, which is how a step is made."""
    functions = _engine_functions()
    assert len(functions) > 20
    for where, function in functions:
        if where.endswith(".each_then_root") or ".ProgressLines." in where:
            continue  # (ProgressLines is a Progress: the user's own callback, made by the user)
        hints = typing.get_type_hints(function)
        for name, parameter in inspect.signature(function).parameters.items():
            hint = hints.get(name)
            called = [typing.get_origin(h) for h in (hint, *typing.get_args(hint))]
            progress = hint in (writing.Progress, writing.Progress | None)
            assert progress or Callable not in called, (where, name, hint)
            assert not inspect.isfunction(parameter.default), (where, name)
