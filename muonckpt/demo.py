"""``muonckpt demo``: train at one topology, reshard offline, resume at another, bit for bit.

A tiny language model (:class:`TinyLM`: an embedding, an RMS norm, a residual MLP block and an
output matrix; the matrices updated by Muon, the rest by AdamW, some of them TP split) is
trained with the packaged :class:`~muonckpt.optim.Muon` in gloo processes at dp x tp: each
step a forward and a backward pass on each DP rank's share of a fixed synthetic batch, the
grads averaged over DP (:meth:`~muonckpt.optim.ShardedParams.grads_to_optimizer`), the update,
the new weights all-gathered back into every rank's model. It is saved per rank with
:func:`muonckpt.save` (state and params), resharded with :func:`muonckpt.offline.reshard` (the
code path of ``muonckpt reshard``) to another dp x tp, loaded there with :func:`muonckpt.load`
into a model and optimizer built from zeros, so that the checkpoint alone restores the weights,
and trained on. The final params are compared with an uninterrupted single-process run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import offline, settings
from .checkpoint.api import load, save
from .distributed import collectives, groups
from .distributed.groups import grid_groups
from .distributed.launch import run_distributed
from .errors import ArgumentError
from .layout.topology import LayoutOptions, Topology
from .optim.muon import Muon
from .optim.sharding import ShardedParams, shard_for_groups, shard_param_groups
from .state.regions import extract, insert_
from .storage import access

__all__ = ["MODEL", "SHAPES", "DemoResult", "DemoRow", "TinyLM", "run_demo"]
"""The demo's run and model. :class:`ToyModel` and :func:`local_params`, on which the demo and
the test suite both build (tests/fixture_model.py), are not public: they change with the
tests."""


@dataclass(frozen=True)
class ToyModel:
    """A two-group model of named params (Muon matrices, AdamW vectors), sharded with the
    packaged Muon at any dp x tp, trained on synthetic gradients.

    Full params and gradients are generated identically on every rank from fixed seeds, so
    runs at any topology are comparable element for element. The test suite's model is one
    (its params form no network); the demo's, :class:`TinyLM`, computes its gradients.
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


GRAD_QUANTUM = 2.0**-16
""":class:`TinyLM` rounds each micro-batch's gradient to a multiple of this (fixed point)."""
GRAD_BOUND = 2.0**-2
"""... and clips it to +-this. The DP average then sums ``dp`` times at most ``micro_batches``
such gradients, in any order: below ``2**24`` quanta, exact in float32, while ``dp *
micro_batches`` is at most ``2**24 * GRAD_QUANTUM / GRAD_BOUND`` (:data:`MOST_SUMMANDS`)."""
MOST_SUMMANDS = round(2**24 * GRAD_QUANTUM / GRAD_BOUND)


@dataclass(frozen=True)
class TinyLM(ToyModel):
    """A tiny next-token model on the params of a :class:`ToyModel`, trained for real.

    ``embed`` (vocab x width) -> RMS norm (``norm``) -> plus ``w_mid @ relu(w_in @ x + bias)``
    -> ``w_out`` (vocab x width) gives the logits; the target of each token is a fixed
    permutation of it. The model is replicated on every rank (its params full tensors); each
    step's batch, ``micro_batches`` of ``micro_batch_size`` tokens drawn from the step's seed, is
    the same everywhere, and DP rank ``d`` takes the micro-batches ``d, d + dp, ...``.

    Float addition is not associative, so grads averaged over 2 ranks and over 4 differ in
    their last bits. To let a run at one dp x tp equal a run at another bit for bit (what the
    demo shows), each micro-batch's gradient is rounded to a multiple of :data:`GRAD_QUANTUM`
    before it is summed: the sums, on a rank and in the DP all-reduce, are then exact whatever
    the grouping, and every topology steps with the same gradient.
    """

    micro_batches: int = 4
    micro_batch_size: int = 32

    @property
    def vocab(self) -> int:
        return self.shapes["embed"][0]

    def initial_params(self) -> dict[str, torch.Tensor]:
        """Matrices scaled by 1 / sqrt(fan in), the norm's weight ones, the bias zeros."""
        gen = torch.Generator().manual_seed(self.seed)
        params = {}
        for name, shape in self.shapes.items():
            if len(shape) == 1:
                params[name] = torch.ones(shape) if name == "norm" else torch.zeros(shape)
            else:
                scale = 1.0 if name == "embed" else shape[1] ** -0.5
                params[name] = torch.randn(shape, generator=gen) * scale
        return params

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets) of step ``step``, each ``micro_batches`` x ``micro_batch_size``."""
        gen = torch.Generator().manual_seed(self.seed * 1000 + step)
        tokens = torch.randint(
            self.vocab, (self.micro_batches, self.micro_batch_size), generator=gen
        )
        return tokens, (5 * tokens + 3) % self.vocab

    @staticmethod
    def loss(
        params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """The mean cross-entropy of the model with ``params`` on one micro-batch."""
        x = F.rms_norm(F.embedding(tokens, params["embed"]), params["norm"].shape, params["norm"])
        x = x + F.linear(F.relu(F.linear(x, params["w_in"], params["bias"])), params["w_mid"])
        return F.cross_entropy(F.linear(x, params["w_out"]), targets)

    def build(
        self, dp: int, tp: int, params: dict[str, torch.Tensor]
    ) -> tuple[Muon, ShardedParams | None, int, int]:
        """(optimizer, sharded params or None, dp_rank, tp_rank) of a model holding copies of
        ``params``; at 1 x 1 the plain optimizer updates the model's params themselves.

        Otherwise call it in each of dp * tp ranks: the optimizer holds this rank's shards
        (:func:`~muonckpt.optim.shard_for_groups`), so that :func:`muonckpt.load` gives the
        model the checkpoint's weights by itself.
        """
        model = {name: p.clone().requires_grad_() for name, p in params.items()}
        if dp * tp == 1:
            return Muon(self.param_groups(model)), None, 0, 0
        dp_group, tp_group = groups.grid_groups(dp, tp)
        sharded = shard_for_groups(
            self.param_groups(model),
            dp_group,
            tp_group,
            tp_split_dims=self.tp_split_dims,
            options=self.layout,
        )
        opt = Muon(sharded.param_groups)
        opt.enable_distributed_mode(
            sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas
        )
        return opt, sharded, sharded.dp_rank, sharded.tp_rank

    def train(
        self, opt: Muon, sharded: ShardedParams | None, d: int, t: int, first: int, steps: int
    ) -> None:
        """Steps ``first .. first+steps-1``, each a forward, a backward and an update."""
        self.fit(opt, sharded, first, steps)

    def fit(self, opt: Muon, sharded: ShardedParams | None, first: int, steps: int) -> list[float]:
        """:meth:`train`, returning each step's loss over this rank's micro-batches (at dp=1,
        the batch's loss)."""
        if sharded is None:
            model = dict(local_params(opt, copy=False))
            dp, d = 1, 0
        else:
            model = {
                spec.name: p for spec, p in zip(sharded.specs, sharded.model_params, strict=True)
            }
            dp, d = sharded.layout.topology.dp, sharded.dp_rank
        losses = []
        for step in range(first, first + steps):
            losses.append(self.backward(model, step, d, dp))
            if sharded is not None:
                sharded.grads_to_optimizer()  # averaged over DP: the mean of dp * each sum
            opt.step()
            if sharded is not None:
                sharded.params_to_model()
        return losses

    def backward(self, model: dict[str, torch.Tensor], step: int, d: int, dp: int) -> float:
        """Set each param's ``.grad`` to ``dp`` times the sum of DP rank ``d``'s micro-batches'
        gradients of the batch's mean loss, each in fixed point; return their loss."""
        tokens, targets = self.batch(step)
        sums = {name: torch.zeros_like(p) for name, p in model.items()}
        loss = 0.0
        for m in range(d, self.micro_batches, dp):
            share = self.loss(model, tokens[m], targets[m]) / self.micro_batches
            grads = torch.autograd.grad(share, list(model.values()))
            for total, grad in zip(sums.values(), grads, strict=True):
                total += (grad / GRAD_QUANTUM).round().clamp(
                    -GRAD_BOUND / GRAD_QUANTUM, GRAD_BOUND / GRAD_QUANTUM
                ) * GRAD_QUANTUM
            loss += share.item()
        for name, p in model.items():
            p.grad = sums[name] * dp
        return loss


def local_params(opt: Muon, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """This rank's params by name (copies, unless ``copy`` is False)."""
    return {
        n: p.detach().clone() if copy else p
        for g in opt.param_groups
        for n, p in zip(g["param_names"], g["params"], strict=True)
    }


MODEL = TinyLM(
    muon_params={"w_in": (24, 12), "w_mid": (12, 24), "w_out": (16, 12)},
    adamw_params={"embed": (16, 12), "norm": (12,), "bias": (24,)},
    tp_split_dims={"w_in": 0, "w_out": 1, "norm": 0, "embed": 1},
    layout=LayoutOptions(bucket_numel=150),
    seed=1234,
)
"""The demo's model: a vocabulary of 16, width 12, hidden 24; buckets closed at 150 elements,
several per buffer, at every topology."""
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
    losses: list[float]
    """The uninterrupted run's loss at each step."""
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


def reference(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """(In a gloo child.) An uninterrupted single-process run: its params and losses."""
    opt, sharded, _, _ = MODEL.build(1, 1, MODEL.initial_params())
    losses = MODEL.fit(opt, sharded, 0, steps)
    return local_params(opt), losses


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
        raise ArgumentError(f"steps must be at least 1, got {steps}", argument="steps")
    Topology(dp, tp), Topology(to_dp, to_tp)  # validate before launching anything
    cores = settings.available_cores()
    settings.local_workers(dp * tp, cores, "dp x tp")  # each rank a local process
    settings.local_workers(to_dp * to_tp, cores, "to_dp x to_tp")
    if max(dp, to_dp) * MODEL.micro_batches > MOST_SUMMANDS:
        raise ArgumentError(
            f"dp={max(dp, to_dp)} is more than the demo's exact grad sums allow "
            f"({MOST_SUMMANDS // MODEL.micro_batches})",
            argument="dp",
        )
    if workdir is not None:
        work = access.make_directories(workdir)
        return _run(dp, tp, to_dp, to_tp, steps, work, timeout, log)
    with access.temporary_directory("muonckpt-demo-") as temporary:
        result = _run(dp, tp, to_dp, to_tp, steps, temporary, timeout, log)
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
    ((expected, losses),) = run_distributed(reference, 1, 2 * steps, timeout=timeout)
    seconds["reference"] = time.perf_counter() - clock
    say(f"its loss: {losses[0]:.4f} at the first step, {losses[-1]:.4f} at the last")

    rows = [
        DemoRow(
            name=name,
            shape=tuple(shape),
            max_abs_diff=float((resumed[name] - expected[name]).abs().max()),
            bitwise_equal=torch.equal(resumed[name], expected[name]),
        )
        for name, shape in SHAPES.items()
    ]
    return DemoResult(
        rows=rows, losses=losses, checkpoint=ckpt, resharded=resharded, seconds=seconds
    )
