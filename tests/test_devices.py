"""The device every tensor handed to torch.distributed is on (``collectives.comm_device``), with
real process groups of each kind that init_process_group accepts on a CPU-only torch.

Backends as torch 2.13 (CPU build) takes them: ``gloo`` serves CPU and CUDA
(``cpu:gloo,cuda:gloo``), so does the explicit mixed ``cpu:gloo,cuda:gloo``; ``cpu:gloo``
serves CPU only; ``cuda:gloo`` serves CUDA only and refuses every CPU tensor. ``nccl``,
``cuda:nccl`` and ``cpu:gloo,cuda:nccl`` are not tested here: a CPU build of torch refuses them
at ``init_process_group`` ("Distributed package doesn't have NCCL built in");
tests/test_cuda.py runs NCCL where a GPU is present. Nor is the routing of CUDA tensors through
a group's CPU backend, which needs a GPU (tests/test_cuda.py, a ``cpu:gloo`` group).
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import muonckpt
from muonckpt.distributed import collectives
from muonckpt.distributed.launch import run_distributed

from .fixture_model import build, initial_params

WORLD = 2


def _outcome(work) -> str:
    """What ``work()`` gives, or the type and message of what it raises, as text."""
    try:
        return f"ok: {work()}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _sgd(rank: int) -> torch.optim.SGD:
    """A tiny SGD with momentum, each param's state on the rank its index names, stepped once."""
    params = [torch.nn.Parameter(torch.full((3, 2), float(i + 1))) for i in range(2)]
    opt = torch.optim.SGD(list(zip(["a", "b"], params)), lr=0.1, momentum=0.9)
    muonckpt.install_hooks(opt, owner=lambda index, param: index % WORLD)
    for index, p in enumerate(params):
        p.grad = torch.ones_like(p) if index % WORLD == rank else None
    opt.step()
    return opt


def probe(root: str) -> dict[str, str]:
    """Each check's outcome in this rank's default group (whatever its backend)."""
    rank = dist.get_rank()
    cuda_sub = dist.new_group(list(range(WORLD)), backend="cuda:gloo")
    out = {
        "default": _outcome(lambda: collectives.comm_device(None)),
        "subgroup": _outcome(lambda: collectives.comm_device(dist.new_group(list(range(WORLD))))),
        "cuda:gloo subgroup": _outcome(lambda: collectives.comm_device(cuda_sub)),
        "ints over cuda:gloo subgroup": _outcome(
            lambda: collectives.all_gather_ints([rank], cuda_sub)
        ),
        "cpu mean over cuda:gloo subgroup": _outcome(
            lambda: collectives.all_reduce_mean_(torch.ones(2), cuda_sub)
        ),
        "raw cpu tensor over cuda:gloo subgroup": _outcome(
            lambda: dist.all_reduce(torch.ones(1), group=cuda_sub)
        ),
    }
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        # as on a GPU machine: the group then serves CUDA, but by gloo only
        out["cuda:gloo subgroup with CUDA"] = _outcome(lambda: collectives.comm_device(cuda_sub))
    opt = _sgd(rank)
    out["state_dict"] = _outcome(lambda: sorted(opt.state_dict()["state"]))
    out["save"] = _outcome(lambda: muonckpt.save(opt, Path(root) / "sgd", overwrite=True).name)
    out["load"] = _outcome(lambda: type(muonckpt.load(opt, Path(root) / "sgd")).__name__)
    packaged, _, _, _ = build(WORLD, 1, initial_params())
    out["packaged save"] = _outcome(
        lambda: muonckpt.save(packaged, Path(root) / "packaged", overwrite=True).name
    )
    return out


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict[str, list[dict[str, str]]]:
    """Every rank's outcomes, per backend of the default group."""
    return {
        backend: run_distributed(
            probe, WORLD, str(tmp_path_factory.mktemp("devices")), backend=backend, timeout=60
        )
        for backend in ("gloo", "cpu:gloo", "cpu:gloo,cuda:gloo", "cuda:gloo")
    }


def test_outside_a_process_group_tensors_stay_on_the_cpu():
    assert collectives.comm_device(None) == torch.device("cpu")


@pytest.mark.dist
@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo", "cpu:gloo,cuda:gloo"])
def test_a_group_that_serves_cpu_communicates_on_the_cpu_and_everything_runs(probed, backend):
    for out in probed[backend]:
        assert out["default"] == "ok: cpu"
        assert out["subgroup"] == "ok: cpu"  # a new group has the default group's backend
        assert out["state_dict"] in ("ok: [0, 1]", "ok: []")  # complete on rank 0 only
        assert out["save"] == "ok: sgd"
        assert out["load"] == "ok: LoadReport"
        assert out["packaged save"] == "ok: packaged"
    assert probed[backend][0]["state_dict"] == "ok: [0, 1]"


@pytest.mark.dist
@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo", "cpu:gloo,cuda:gloo", "cuda:gloo"])
def test_a_cuda_only_group_without_cuda_is_a_collective_error_naming_it(probed, backend):
    """Whatever the default group, a cuda:gloo group on this CPU-only machine needs CUDA: the
    device choice says so, and so does muonckpt's first collective on it, where torch itself
    raises a RuntimeError that does not say what to do."""
    needs_cuda = (
        "CollectiveError: the process group with backend 'cuda:gloo' needs CUDA tensors, and "
        "this process has no usable CUDA device"
    )
    for out in probed[backend]:
        assert out["cuda:gloo subgroup"].startswith(needs_cuda)
        assert out["ints over cuda:gloo subgroup"].startswith(needs_cuda)
        assert out["cpu mean over cuda:gloo subgroup"].startswith(needs_cuda)
        assert out["raw cpu tensor over cuda:gloo subgroup"] == (
            "RuntimeError: No backend type associated with device type cpu"
        )


@pytest.mark.dist
def test_a_cuda_only_default_group_fails_every_operation_at_its_first_collective(probed):
    """In a cuda:gloo world every muonckpt operation that communicates fails on every rank with
    the CollectiveError, before any tensor moves (no hang, no torch RuntimeError)."""
    needs_cuda = "CollectiveError: the process group with backend 'cuda:gloo' needs CUDA"
    for out in probed["cuda:gloo"]:
        assert out["default"].startswith(needs_cuda)
        assert out["subgroup"].startswith(needs_cuda)
        # a hooked optimizer's state_dict() and save(); the packaged Muon's first describe
        for check in ("state_dict", "save", "packaged save"):
            assert out[check].startswith(needs_cuda), (check, out[check])


@pytest.mark.dist
def test_a_group_served_for_cuda_by_gloo_alone_is_refused_even_with_cuda(probed):
    """gloo's send and receive move host memory, and such a group refuses CPU tensors: where
    CUDA is present the device choice refuses the group instead of handing gloo CUDA memory."""
    for out in probed["gloo"]:
        assert out["cuda:gloo subgroup with CUDA"].startswith(
            "CollectiveError: the process group with backend 'cuda:gloo' serves CUDA tensors by "
            "gloo only"
        )
