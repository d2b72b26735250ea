"""The library's errors as data (issue 31): every error type lives in ``muonckpt.errors``, each
carries the facts its message names as fields set where it is raised, a bad argument is an
``ArgumentError`` (a ``ValueError`` and a ``CheckpointError``) naming the argument, and an
interruption after the commit says which checkpoint was committed."""

from __future__ import annotations

import copy
import importlib
import pickle
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import muonckpt
from muonckpt import errors, offline, settings
from muonckpt.distributed import group_steps
from muonckpt.distributed.launch import run_distributed
from muonckpt.errors import (
    ArgumentError,
    CheckpointError,
    DistributedRunError,
    InterruptedAfterCommit,
    MuonCkptError,
    PeerLostError,
)

from .fixture_model import single_process_optimizer


def _subclasses(kind: type) -> set[type]:
    found = set(kind.__subclasses__())
    return found.union(*(_subclasses(k) for k in kind.__subclasses__()))


def test_every_error_type_is_defined_in_errors_and_listed_there():
    for module in pkgutil.walk_packages(muonckpt.__path__, "muonckpt."):
        if not module.name.endswith("__main__"):  # (it runs the command line)
            importlib.import_module(module.name)
    for kind in _subclasses(MuonCkptError):
        assert kind.__module__ == "muonckpt.errors", kind
    listed = {getattr(errors, name) for name in errors.__all__}
    defined = {
        value
        for value in vars(errors).values()
        if isinstance(value, type)
        and issubclass(value, (Exception, Warning, KeyboardInterrupt))
        and value.__module__ == "muonckpt.errors"
    }
    assert listed == defined
    assert muonckpt.ArgumentError is ArgumentError
    assert muonckpt.distributed.DistributedRunError is DistributedRunError


@pytest.fixture(scope="module")
def opt() -> torch.optim.Optimizer:
    return single_process_optimizer(1)


BAD_ARGUMENTS: dict[str, tuple[str, Callable[[Any, Path], object]]] = {
    "keep_last": ("keep_last", lambda opt, p: muonckpt.save(opt, p / "c", keep_last=0)),
    "max_shard_size": (
        "max_shard_size",
        lambda opt, p: muonckpt.save(opt, p / "c", consolidated=True, max_shard_size="5XB"),
    ),
    "timeout": ("timeout", lambda opt, p: muonckpt.async_save(opt, p / "c", timeout=-1)),
    "local": ("local", lambda opt, p: muonckpt.save(opt, p / "c", local="yes")),
    "model": ("model", lambda opt, p: muonckpt.save(opt, p / "c", model=object())),
    "extra": ("extra", lambda opt, p: muonckpt.save(opt, p / "c", extra={"step": -1})),
    "extra's values": ("extra", lambda opt, p: muonckpt.save(opt, p / "c", extra={"f": {1}})),
    "rank_extra": ("rank_extra", lambda opt, p: muonckpt.save(opt, p / "c", rank_extra=[1])),
    "no optimizer": ("optimizer", lambda opt, p: muonckpt.save([], p / "c")),
    "older_than": ("older_than", lambda opt, p: muonckpt.clean(p, older_than=-1)),
    "atol": ("atol", lambda opt, p: offline.diff(p / "a", p / "b", atol=float("nan"))),
    "to": ("to", lambda opt, p: offline.convert(p / "a", p / "b")),
    "processes": ("workers", lambda opt, p: settings.local_workers(0, 4)),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_a_bad_argument_is_a_value_error_and_a_library_error_naming_it(opt, tmp_path, case):
    """Refused before anything is written, as a ValueError (Python's own refusal of a value),
    a MuonCkptError and a CheckpointError (what these were before), the argument a field."""
    argument, call = BAD_ARGUMENTS[case]
    with pytest.raises(ArgumentError) as caught:
        call(opt, tmp_path)
    error = caught.value
    assert isinstance(error, ValueError)
    assert isinstance(error, MuonCkptError)
    assert isinstance(error, CheckpointError)
    assert error.argument == argument
    assert argument in str(error), str(error)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_file_is_no_argument_error(tmp_path):
    """A checkpoint that is not there, or not a checkpoint, is a CheckpointError naming its
    path, not a bad argument."""
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(CheckpointError) as caught:
            muonckpt.read_manifest(path)
        assert not isinstance(caught.value, ArgumentError)
        assert caught.value.path == path


def test_a_step_failure_names_the_rank_that_failed_and_the_ranks_that_agreed():
    steps = group_steps.CollectiveSteps("save", [0], 0, CheckpointError)

    def refuse() -> None:
        raise KeyError("missing")

    with pytest.raises(CheckpointError) as caught:
        steps.each_then_root("write", refuse, list)
    assert (caught.value.rank, caught.value.agreed_by) == (0, [0])
    assert caught.value.path is None


def test_an_interruption_after_the_commit_names_the_committed_checkpoint(
    opt, tmp_path, monkeypatch
):
    """A Ctrl-C while the replaced checkpoint is deleted: the new one is whole, and the
    interruption (still a KeyboardInterrupt) says where, as a field."""
    from muonckpt.storage import backend

    path = muonckpt.save(opt, tmp_path / "ckpt")

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(backend.PosixStore, "retire", staticmethod(interrupted))
    with pytest.raises(InterruptedAfterCommit) as caught:
        muonckpt.save(opt, path, overwrite=True)
    assert isinstance(caught.value, KeyboardInterrupt)
    assert caught.value.path == str(path)
    assert type(caught.value.__cause__) is KeyboardInterrupt
    monkeypatch.undo()
    assert muonckpt.verify(path) == []


def test_an_interruption_before_the_commit_is_raised_as_it_was(opt, tmp_path, monkeypatch):
    """An interruption before the commit is the interruption itself: nothing was committed."""
    from muonckpt.files import writing

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(writing, "write_files", interrupted)
    with pytest.raises(KeyboardInterrupt) as caught:
        muonckpt.save(opt, tmp_path / "ckpt")
    assert type(caught.value) is KeyboardInterrupt
    assert not (tmp_path / "ckpt").exists()


ERRORS = [
    CheckpointError(
        "truncated", path=Path("/c/x.safetensors"), param="w", rank=2, agreed_by=[0, 2]
    ),
    ArgumentError("keep_last must be an int", argument="keep_last"),
    PeerLostError("lost the connection to rank 3 (reset)", peers=[3]),
    DistributedRunError("rank 1 of 2 failed: E: x", "Traceback ...", rank=1),
    errors.LayoutError("topology needs dp >= 1"),
    InterruptedAfterCommit("/c/step-10"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_pickle_and_copy_with_their_fields(error):
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(again) is type(error)
        assert str(again) == str(error)
        assert again.args == error.args
        assert vars(again) == vars(error)


def test_the_messages_are_as_before():
    """The fields are facts beside the message, which names them as it always did."""
    assert str(ERRORS[0]) == "truncated (file /c/x.safetensors, param 'w')"
    assert str(ERRORS[3]) == "rank 1 of 2 failed: E: x\nTraceback ..."
    assert ERRORS[3].summary == "rank 1 of 2 failed: E: x"


def fail_on_rank_1() -> None:
    if torch.distributed.get_rank() == 1:
        raise RuntimeError("rank one gave up")


@pytest.mark.dist
def test_a_failed_child_names_its_rank():
    with pytest.raises(DistributedRunError) as caught:
        run_distributed(fail_on_rank_1, 2, timeout=60)
    assert caught.value.rank == 1
    assert caught.value.summary.startswith("rank 1 of 2 failed: RuntimeError: rank one gave up")
