"""The test suite's own model: two groups of named params, sharded at any dp x tp.

Owned by the tests, independent of the demo's model (which may change freely); both are a
:class:`muonckpt.demo.ToyModel`, so the sharding, training and reassembly code is one.
Every kind of param the layout and the checkpoint code treat differently is here once:

========  ========  ======  ================================================
name      shape     group   TP
========  ========  ======  ================================================
w_in      (16, 20)  Muon    split on dim 0 (rows)
w_out     (12, 24)  Muon    split on dim 1 (columns)
w_mid     (10, 14)  Muon    replicated (and not square, so a swapped shape differs)
bias      (7,)      AdamW   replicated, 1-D, of odd size
norm      (20,)     AdamW   split on dim 0, 1-D
embed     (6, 16)   AdamW   split on dim 1
========  ========  ======  ================================================

Every split dim is divisible by 1, 2 and 4 (the tp sizes the tests run); tp=3 divides only
w_out's (see :func:`split_params_indivisible_by`). ``BUCKET_NUMEL`` makes several buckets of
one ZeRO-1 buffer at every topology the tests use, so params of several buckets, and buckets
some DP ranks hold nothing of, are covered.

Full params and gradients are generated identically on every rank from fixed seeds, so runs at
any topology are comparable element for element. Counts the tests assert (params, state
tensors) are derived here from the tables, never written out by hand.
"""

from __future__ import annotations

import math

from muonckpt.demo import ToyModel
from muonckpt.demo import local_params as local_params  # part of the fixture's API
from muonckpt.layout.topology import LayoutOptions
from muonckpt.optim.muon import Muon

MUON_PARAMS: dict[str, tuple[int, ...]] = {"w_in": (16, 20), "w_out": (12, 24), "w_mid": (10, 14)}
ADAMW_PARAMS: dict[str, tuple[int, ...]] = {"bias": (7,), "norm": (20,), "embed": (6, 16)}
SHAPES: dict[str, tuple[int, ...]] = {**MUON_PARAMS, **ADAMW_PARAMS}
"""Every param, in the optimizer's order (the Muon group first)."""
TP_SPLIT_DIMS: dict[str, int] = {"w_in": 0, "w_out": 1, "norm": 0, "embed": 1}
"""Params absent here are TP-replicated."""
MUON_HPARAMS = {"use_muon": True, "lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}
ADAMW_HPARAMS = {"lr": 0.01, "weight_decay": 0.01}
BUCKET_NUMEL = 150
LAYOUT = LayoutOptions(bucket_numel=BUCKET_NUMEL)
"""The layout the tests shard at: buckets closed at ``BUCKET_NUMEL`` elements."""

MUON_STATE_KEYS = ("momentum_buffer",)
ADAMW_STATE_KEYS = ("exp_avg", "exp_avg_sq")
STATE_KEYS: dict[str, tuple[str, ...]] = {
    **{name: MUON_STATE_KEYS for name in MUON_PARAMS},
    **{name: ADAMW_STATE_KEYS for name in ADAMW_PARAMS},
}
"""The state tensors the packaged Muon keeps per param after a step."""

PARAM_NAMES: list[str] = list(SHAPES)
N_PARAMS: int = len(SHAPES)
N_GROUPS: int = 2
N_STATE_TENSORS: int = sum(len(keys) for keys in STATE_KEYS.values())
"""State tensors in a checkpoint (params not counted)."""


def numel(name: str) -> int:
    return math.prod(SHAPES[name])


def shape_text(name: str) -> str:
    """A shape as ``muonckpt inspect`` prints it: ``16x20``."""
    return "x".join(map(str, SHAPES[name]))


def split_params_indivisible_by(tp: int) -> list[str]:
    """Names of the TP-split params whose split dim ``tp`` does not divide, in order."""
    return [n for n, d in TP_SPLIT_DIMS.items() if SHAPES[n][d] % tp]


MODEL = ToyModel(
    muon_params=MUON_PARAMS,
    adamw_params=ADAMW_PARAMS,
    tp_split_dims=TP_SPLIT_DIMS,
    layout=LAYOUT,
    seed=2468,
    muon_hparams=MUON_HPARAMS,
    adamw_hparams=ADAMW_HPARAMS,
)
"""The model itself; its methods are this module's functions below."""
initial_params = MODEL.initial_params
full_grad = MODEL.full_grad
param_groups = MODEL.param_groups
shard = MODEL.shard
build = MODEL.build
train = MODEL.train
assemble = MODEL.assemble


def single_process_optimizer(steps: int) -> Muon:
    """The plain (1 x 1) optimizer after ``steps`` steps; no process group needed."""
    opt, sharded, d, t = build(1, 1, initial_params())
    train(opt, sharded, d, t, 0, steps)
    return opt
