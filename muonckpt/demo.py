"""``muonckpt demo``: train at one topology, reshard offline, resume at another, bit for bit.

A tiny two-group model (Muon matrices plus AdamW vectors and an embedding, some of them TP
split) is trained with the packaged :class:`~muonckpt.optim.muon.Muon` in gloo processes at dp x tp,
saved per rank with :func:`muonckpt.save` (state and params), resharded with
:func:`muonckpt.offline.tools.reshard` (the code path of ``muonckpt reshard``) to another dp x tp,
loaded there with :func:`muonckpt.load` into an optimizer built from zeros, so that the
checkpoint alone restores the params, and trained on. The final params are compared with an
uninterrupted single-process run.

Full params and gradients are generated identically on every rank from fixed seeds, so runs
at any topology are comparable element for element.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from . import settings
from .checkpoint.api import load, save
from .distributed import collectives
from .distributed.groups import grid_groups
from .distributed.launch import run_distributed
from .layout.topology import LayoutOptions, Topology
from .offline import tools as offline
from .optim.muon import Muon
from .optim.sharding import ShardedParams, shard_param_groups
from .state.regions import extract, insert_


@dataclass(frozen=True)
class ToyModel:
    """A two-group model of named params (Muon matrices, AdamW vectors), sharded with the
    packaged Muon at any dp x tp.

    Full params and gradients are generated identically on every rank from fixed seeds, so
    runs at any topology are comparable element for element. The demo has one; the test suite
    builds its own.
    """

    muon_params: dict[str, tuple[int, ...]]
    adamw_params: dict[str, tuple[int, ...]]
    tp_split_dims: dict[str, int]
    """Params absent here are TP-replicated."""
    layout: LayoutOptions
    seed: int
    """Seed of the initial params."""
    muon_hparams: dict[str, Any] = field(
        default_factory=lambda: {"use_muon": True, "lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}
    )
    adamw_hparams: dict[str, Any] = field(
        default_factory=lambda: {"lr": 0.01, "weight_decay": 0.01}
    )

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every param, in the optimizer's order (the Muon group first)."""
        return {**self.muon_params, **self.adamw_params}

    def initial_params(self) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        return {name: torch.randn(shape, generator=gen) for name, shape in self.shapes.items()}

    def zeros(self) -> dict[str, torch.Tensor]:
        return {name: torch.zeros(shape) for name, shape in self.shapes.items()}

    def full_grad(self, name: str, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(step * 1000 + sum(map(ord, name)))
        return torch.randn(self.shapes[name], generator=gen)

    def param_groups(self, params: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        """The two groups, as ``(name, tensor)`` pairs, with their hyperparameters."""
        return [
            {"params": [(n, params[n]) for n in self.muon_params], **self.muon_hparams},
            {"params": [(n, params[n]) for n in self.adamw_params], **self.adamw_hparams},
        ]

    def shard(
        self, params: dict[str, torch.Tensor], dp: int, tp: int, d: int, t: int
    ) -> ShardedParams:
        """Rank (d, t)'s ZeRO-1 + TP shards of ``params``."""
        return shard_param_groups(
            self.param_groups(params),
            Topology(dp, tp),
            d,
            t,
            tp_split_dims=self.tp_split_dims,
            options=self.layout,
        )

    def build(
        self, dp: int, tp: int, params: dict[str, torch.Tensor]
    ) -> tuple[Muon, ShardedParams | None, int, int]:
        """(optimizer, sharded params or None, dp_rank, tp_rank); 1 x 1 is the plain optimizer.

        At 1 x 1 no process group is needed; otherwise call it in each of dp * tp ranks.
        """
        if dp * tp == 1:
            groups = [
                {**g, "params": [(n, p.clone()) for n, p in g["params"]]}
                for g in self.param_groups(params)
            ]
            return Muon(groups), None, 0, 0
        dp_group, tp_group = grid_groups(dp, tp)
        d, t = collectives.group_rank(dp_group), collectives.group_rank(tp_group)
        sharded = self.shard(params, dp, tp, d, t)
        opt = Muon(sharded.param_groups)
        opt.enable_distributed_mode(
            sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas
        )
        return opt, sharded, d, t

    def train(
        self, opt: Muon, sharded: ShardedParams | None, d: int, t: int, first: int, steps: int
    ) -> None:
        """Steps ``first .. first+steps-1`` with each rank's cut of the same full gradients."""
        for step in range(first, first + steps):
            for group in opt.param_groups:
                for name, p in zip(group["param_names"], group["params"], strict=True):
                    grad = self.full_grad(name, step)
                    if sharded is not None:
                        grad = extract(grad, sharded.layout.region(sharded.index(name), d, t))
                    p.grad = grad.reshape(p.shape)
            opt.step()

    def assemble(
        self, dp: int, tp: int, shards: list[dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """Full params from every rank's local shards (rank order); an element no rank holds
        stays NaN, so that it fails any comparison."""
        if dp * tp == 1:
            return shards[0]
        sharded = self.shard(self.initial_params(), dp, tp, 0, 0)
        full = {name: torch.full(shape, float("nan")) for name, shape in self.shapes.items()}
        for rank, piece_of in enumerate(shards):
            d, t = Topology(dp, tp).coords(rank)
            for name, piece in piece_of.items():
                insert_(full[name], sharded.layout.region(sharded.index(name), d, t), piece)
        return full


def local_params(opt: Muon) -> dict[str, torch.Tensor]:
    """This rank's params by name (copies)."""
    return {
        n: p.detach().clone()
        for g in opt.param_groups
        for n, p in zip(g["param_names"], g["params"], strict=True)
    }


MODEL = ToyModel(
    muon_params={"w_in": (12, 20), "w_out": (16, 12), "w_mid": (10, 14)},
    adamw_params={"bias": (7,), "norm": (16,), "embed": (8, 12)},
    tp_split_dims={"w_in": 0, "w_out": 1, "norm": 0, "embed": 1},
    layout=LayoutOptions(bucket_numel=150),
    seed=1234,
)
"""The demo's model: buckets closed at 150 elements, several per buffer, at every topology."""
SHAPES = MODEL.shapes


@dataclass
class DemoRow:
    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    bitwise_equal: bool


@dataclass
class DemoResult:
    rows: list[DemoRow]
    checkpoint: Path
    resharded: Path
    seconds: dict[str, float] = field(default_factory=dict)
    kept: bool = True
    """Whether the checkpoints are still there (a ``workdir`` was given)."""

    @property
    def ok(self) -> bool:
        return all(r.bitwise_equal for r in self.rows)


def train_and_save(dp: int, tp: int, steps: int, ckpt: str) -> dict[str, torch.Tensor]:
    """(In a gloo child.) Train ``steps`` from the initial params, save per rank."""
    opt, sharded, d, t = MODEL.build(dp, tp, MODEL.initial_params())
    MODEL.train(opt, sharded, d, t, 0, steps)
    save(opt, ckpt)
    return local_params(opt)


def load_and_train(dp: int, tp: int, ckpt: str, first: int, steps: int) -> dict[str, torch.Tensor]:
    """(In a gloo child.) Build from zeros, load state and params from the checkpoint, train."""
    opt, sharded, d, t = MODEL.build(dp, tp, MODEL.zeros())
    load(opt, ckpt)
    MODEL.train(opt, sharded, d, t, first, steps)
    return local_params(opt)


def reference(steps: int) -> dict[str, torch.Tensor]:
    """(In a gloo child.) An uninterrupted single-process run."""
    opt, sharded, d, t = MODEL.build(1, 1, MODEL.initial_params())
    MODEL.train(opt, sharded, d, t, 0, steps)
    return local_params(opt)


def run_demo(
    *,
    dp: int = 2,
    tp: int = 2,
    to_dp: int = 4,
    to_tp: int = 2,
    steps: int = 4,
    workdir: str | Path | None = None,
    timeout: float = 300.0,
    log: Callable[[str], None] | None = None,
) -> DemoResult:
    """Train at dp x tp, save, reshard offline to to_dp x to_tp, resume, compare (see module).

    The checkpoints go under ``workdir`` (created if needed, kept); without it, under a new
    temporary directory that is removed before this returns (``DemoResult.kept`` False).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    Topology(dp, tp), Topology(to_dp, to_tp)  # validate before launching anything
    cores = settings.available_cores()
    settings.local_workers(dp * tp, cores, "dp x tp")  # each rank a local process
    settings.local_workers(to_dp * to_tp, cores, "to_dp x to_tp")
    if workdir is not None:
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        return _run(dp, tp, to_dp, to_tp, steps, work, timeout, log)
    with tempfile.TemporaryDirectory(prefix="muonckpt-demo-") as temporary:
        result = _run(dp, tp, to_dp, to_tp, steps, Path(temporary), timeout, log)
    return replace(result, kept=False)


def _run(
    dp: int,
    tp: int,
    to_dp: int,
    to_tp: int,
    steps: int,
    work: Path,
    timeout: float,
    log: Callable[[str], None] | None,
) -> DemoResult:
    say = log or (lambda _msg: None)
    ckpt, resharded = work / "ckpt", work / "resharded"
    seconds: dict[str, float] = {}

    clock = time.perf_counter()
    say(f"training {steps} steps at dp={dp} x tp={tp} and saving to {ckpt}")
    run_distributed(train_and_save, dp * tp, dp, tp, steps, str(ckpt), timeout=timeout)
    seconds["train+save"] = time.perf_counter() - clock

    clock = time.perf_counter()
    say(f"resharding to dp={to_dp} x tp={to_tp} at {resharded}")
    offline.reshard(
        ckpt,
        resharded,
        dp=to_dp,
        tp=to_tp,
        options=MODEL.layout,
        tp_split_dims=MODEL.tp_split_dims,
        overwrite=True,
    )
    seconds["reshard"] = time.perf_counter() - clock

    clock = time.perf_counter()
    say(
        f"resuming at dp={to_dp} x tp={to_tp} from the checkpoint alone (optimizer built from "
        f"zeros) for {steps} more steps"
    )
    shards = run_distributed(
        load_and_train, to_dp * to_tp, to_dp, to_tp, str(resharded), steps, steps, timeout=timeout
    )
    resumed = MODEL.assemble(to_dp, to_tp, shards)
    seconds["load+train"] = time.perf_counter() - clock

    clock = time.perf_counter()
    say(f"uninterrupted single-process reference for {2 * steps} steps")
    (expected,) = run_distributed(reference, 1, 2 * steps, timeout=timeout)
    seconds["reference"] = time.perf_counter() - clock

    rows = [
        DemoRow(
            name=name,
            shape=tuple(shape),
            max_abs_diff=float((resumed[name] - expected[name]).abs().max()),
            bitwise_equal=torch.equal(resumed[name], expected[name]),
        )
        for name, shape in SHAPES.items()
    ]
    return DemoResult(rows=rows, checkpoint=ckpt, resharded=resharded, seconds=seconds)
