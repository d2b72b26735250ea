"""Checkpoints moved between Muon implementations: packaged, torch.optim.Muon + AdamW, and
KellerJordan's MuonWithAuxAdam.

The implementations keep momentum in different forms (sum, EMA) under the same key. A converted
load must continue the saved run as closely as the two implementations agree when both start
from scratch (within 2x of that difference over the same 8 steps), and at least 10x closer than
a raw copy of the buffers. The grads are fixed per step, so only the optimizers differ.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path

import muon
import pytest
import torch

import muonckpt
from muonckpt import ConversionWarning, StateDictError
from muonckpt.distributed.launch import run_distributed

from .fixture_model import (
    ADAMW_HPARAMS,
    ADAMW_PARAMS,
    MUON_HPARAMS,
    MUON_PARAMS,
    build,
    full_grad,
    initial_params,
    train,
)

K, STEPS = 3, 8
BETAS, EPS = (0.95, 0.95), 1e-8


def packaged(params: dict[str, torch.nn.Parameter]) -> muonckpt.optim.muon.Muon:
    return muonckpt.optim.muon.Muon(
        [
            {"params": [(n, params[n]) for n in MUON_PARAMS], **MUON_HPARAMS},
            {"params": [(n, params[n]) for n in ADAMW_PARAMS], **ADAMW_HPARAMS},
        ],
        adamw_betas=BETAS,
        adamw_eps=EPS,
    )


def torch_pair(params) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.Muon(
            [(n, params[n]) for n in MUON_PARAMS],
            lr=MUON_HPARAMS["lr"],
            weight_decay=MUON_HPARAMS["weight_decay"],
            momentum=MUON_HPARAMS["momentum"],
            nesterov=True,
            adjust_lr_fn="match_rms_adamw",
        ),
        torch.optim.AdamW(
            [(n, params[n]) for n in ADAMW_PARAMS],
            lr=ADAMW_HPARAMS["lr"],
            weight_decay=ADAMW_HPARAMS["weight_decay"],
            betas=BETAS,
            eps=EPS,
        ),
    ]


def keller_jordan(params) -> torch.optim.Optimizer:
    """SingleDeviceMuonWithAuxAdam with one Muon group per matrix, each lr set so that its
    rule (sqrt(max(1, A/B))) gives the packaged Muon's step (0.2 * sqrt(max(A, B)))."""
    lr = MUON_HPARAMS["lr"]
    groups = [
        dict(
            params=[params[n]],
            lr=lr * 0.2 * math.sqrt(max(shape)) / math.sqrt(max(1, shape[0] / shape[1])),
            momentum=MUON_HPARAMS["momentum"],
            weight_decay=MUON_HPARAMS["weight_decay"]
            * lr
            / (lr * 0.2 * math.sqrt(max(shape)) / math.sqrt(max(1, shape[0] / shape[1]))),
            use_muon=True,
        )
        for n, shape in MUON_PARAMS.items()
    ]
    groups.append(
        dict(
            params=[params[n] for n in ADAMW_PARAMS],
            lr=ADAMW_HPARAMS["lr"],
            betas=BETAS,
            eps=EPS,
            weight_decay=ADAMW_HPARAMS["weight_decay"],
            use_muon=False,
        )
    )
    opt = muon.SingleDeviceMuonWithAuxAdam(groups)
    muonckpt.install_hooks(opt, names=params)
    return opt


BUILD = {"packaged": packaged, "torch": torch_pair, "keller-jordan": keller_jordan}


def fresh(zeros: bool = False) -> dict[str, torch.nn.Parameter]:
    return {
        n: torch.nn.Parameter(torch.zeros_like(t) if zeros else t.clone())
        for n, t in initial_params().items()
    }


def step_all(opts, params, first, steps) -> None:
    opts = opts if isinstance(opts, list) else [opts]
    for step in range(first, first + steps):
        for name, p in params.items():
            p.grad = full_grad(name, step)
        for opt in opts:
            opt.step()


def max_diff(a, b) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def continue_from(kind: str, ckpt, **load) -> dict[str, torch.Tensor]:
    params = fresh(zeros=True)
    opts = BUILD[kind](params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        muonckpt.load(opts, ckpt, **load)
    step_all(opts, params, K, STEPS)
    return {n: p.detach().clone() for n, p in params.items()}


def from_scratch(kind: str) -> dict[str, torch.Tensor]:
    params = fresh()
    step_all(BUILD[kind](params), params, 0, STEPS)
    return {n: p.detach().clone() for n, p in params.items()}


def save_packaged_2x2(path: str) -> None:
    """(gloo child) The fixture model trained K steps at 2 x 2, saved per rank."""
    opt, sharded, d, t = build(2, 2, initial_params())
    train(opt, sharded, d, t, 0, K)
    muonckpt.save(opt, path)


@pytest.fixture(scope="module")
def saved_by(tmp_path_factory) -> Callable[[str], Path]:
    """``saved_by(kind)``: the fixture model trained K steps by ``kind`` and saved, once per
    module (the packaged Muon's by a 2 x 2 launch). Shared: only read it."""
    root = tmp_path_factory.mktemp("saved-by")
    saved: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in saved:
            path = root / kind
            if kind == "packaged":
                run_distributed(save_packaged_2x2, 4, str(path), timeout=120)
            else:
                params = fresh()
                opts = BUILD[kind](params)
                step_all(opts, params, 0, K)
                muonckpt.save(opts, path)
            saved[kind] = path
        return saved[kind]

    return get


RAW = {"packaged": "sum", "torch": "ema", "keller-jordan": "ema"}
"""Each source's own momentum form: claiming it for the target makes a load copy the buffers
raw, as a plain load_state_dict would."""


@pytest.mark.dist
@pytest.mark.parametrize(
    "source,target",
    [
        ("packaged", "torch"),
        ("torch", "packaged"),
        ("packaged", "keller-jordan"),
        ("keller-jordan", "packaged"),
    ],
)
def test_converted_momentum_continues_the_run(saved_by, source, target):
    ckpt = saved_by(source)
    same = continue_from(source, ckpt)
    converted = continue_from(target, ckpt)
    raw = continue_from(target, ckpt, momentum_form=RAW[source])
    own = max_diff(from_scratch(source), from_scratch(target))
    gap, raw_gap = max_diff(converted, same), max_diff(raw, same)
    assert gap <= 2 * own, (gap, own)
    assert raw_gap >= 10 * gap, (raw_gap, gap)


@pytest.mark.dist
def test_load_reports_the_conversion_and_warns_about_settings(saved_by):
    ckpt = saved_by("packaged")
    params = fresh(zeros=True)
    muon_t, adamw_t = torch_pair(params)
    muon_t.param_groups[0]["adjust_lr_fn"] = None  # torch's default lr rule
    with pytest.warns(ConversionWarning, match='adjust_lr_fn="match_rms_adamw"'):
        report = muonckpt.load([muon_t, adamw_t], ckpt)
    muons = f"{len(MUON_PARAMS)} params"
    assert any("sum -> ema" in line and muons in line for line in report.converted)
    for name in MUON_PARAMS:
        assert muon_t.state[params[name]]["momentum_buffer"].abs().sum() > 0, name
    for name in ADAMW_PARAMS:
        step = adamw_t.state[params[name]]["step"]
        assert step.dtype == torch.float32 and step.dim() == 0 and float(step) == K, name


def _load_warned(ckpt: str) -> tuple[int, int]:
    """(gloo child, a DDP replica) A torch.optim.Muon at torch's default lr rule loads the packaged
    Muon's checkpoint: the load's warnings as reported, and as warned on this rank."""
    params = fresh(zeros=True)
    muon_t, adamw_t = torch_pair(params)
    muon_t.param_groups[0]["adjust_lr_fn"] = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConversionWarning)
        report = muonckpt.load([muon_t, adamw_t], ckpt)
    return len(report.warnings), sum(issubclass(w.category, ConversionWarning) for w in caught)


@pytest.mark.dist
def test_a_conversion_warning_is_warned_once_not_once_per_rank(saved_by):
    ranks = run_distributed(_load_warned, 2, str(saved_by("packaged")), timeout=120)
    assert ranks[0][0] > 0 and ranks == [ranks[0], (ranks[0][0], 0)], ranks


@pytest.mark.dist
def test_a_target_of_unknown_form_needs_momentum_form(saved_by):
    ckpt = saved_by("packaged")

    class MyMuon(torch.optim.SGD):
        """A Muon muonckpt has never heard of."""

    params = fresh(zeros=True)
    mine = MyMuon([(n, params[n]) for n in MUON_PARAMS], lr=0.1, momentum=0.9)
    adamw = torch_pair(params)[1]
    with pytest.raises(StateDictError, match=r"momentum_form='sum'.*momentum_form='ema'"):
        muonckpt.load([mine, adamw], ckpt)
    report = muonckpt.load([mine, adamw], ckpt, momentum_form="ema")
    assert any("sum -> ema" in line for line in report.converted)


@pytest.mark.dist
def test_optimizers_that_miss_params_are_refused(saved_by):
    ckpt = saved_by("packaged")
    params = fresh(zeros=True)
    with pytest.raises(muonckpt.CheckpointError, match="held by none"):
        muonckpt.load(torch_pair(params)[:1], ckpt)
    with pytest.raises(StateDictError, match="runs adamw"):
        muonckpt.load([torch.optim.AdamW(list(params.items()))], ckpt)  # Muon params into an AdamW


@pytest.mark.dist
@pytest.mark.parametrize(
    "source,target",
    [("packaged", "torch"), ("torch", "packaged"), ("packaged", "keller-jordan")],
)
def test_convert_output_continues_as_the_in_memory_conversion(saved_by, tmp_path, source, target):
    from typer.testing import CliRunner

    from muonckpt.cli import app

    ckpt = saved_by(source)
    out = tmp_path / "converted"
    result = CliRunner().invoke(app, ["convert", str(ckpt), "-o", str(out), "--to", target])
    assert result.exit_code == 0, result.output
    assert muonckpt.verify(out) == []
    manifest = muonckpt.read_manifest(out)
    assert all(g.optimizer["converted_from"] for g in manifest.groups)
    in_memory, offline = continue_from(target, ckpt), continue_from(target, out)
    for name, value in in_memory.items():
        assert torch.equal(offline[name], value), name


@pytest.mark.dist
def test_convert_refuses_an_unknown_implementation(saved_by, tmp_path):
    from typer.testing import CliRunner

    from muonckpt.cli import app

    ckpt = saved_by("torch")
    result = CliRunner().invoke(
        app, ["convert", str(ckpt), "-o", str(tmp_path / "x"), "--to", "jax"]
    )
    assert result.exit_code == 2 and "choose one of" in result.output
    said = " ".join(result.output.split())  # (the error box wraps it)
    listed = ("keller-jordan", "deepspeed", "megatron", "accelerate", "lightning")
    assert all(name in said for name in listed), said
    assert not (tmp_path / "x").exists()


def test_convert_keeps_the_file_metadata_of_each_kind(single_ckpt, tmp_path):
    from safetensors import safe_open

    src = single_ckpt(2)
    resharded = muonckpt.offline.reshard(src, tmp_path / "r", dp=2, tp=1)
    for source in (src, resharded, muonckpt.offline.consolidate(src, tmp_path / "c")):
        out = muonckpt.offline.convert(source, tmp_path / f"{source.name}-torch", to="torch")
        for entry in muonckpt.read_manifest(source).files:
            with (
                safe_open(source / entry.name, "np") as before,
                safe_open(out / entry.name, "np") as after,
            ):
                assert after.metadata() == before.metadata(), (source.name, entry.name)


def test_a_foreign_format_is_one_record_in_the_registry(tmp_path, monkeypatch):
    """A format added to the registry is found by its name and by its files, and convert's
    route reads from it, writes to it and refuses what does not fit it, naming the option."""
    from dataclasses import dataclass
    from pathlib import Path

    from muonckpt import interop
    from muonckpt.cli import routes
    from muonckpt.errors import OptionError
    from muonckpt.interop import registry

    @dataclass(frozen=True)
    class ReadOptions:
        model_prefix: str | None = None

    @dataclass(frozen=True)
    class WriteOptions:
        layout: str = "flat"

        def __post_init__(self):
            if self.layout != "flat":
                raise OptionError("choose one of flat", "--layout")

    assert interop.format_named("dcp") is interop.dcp.FORMAT
    fake = interop.ForeignFormat(
        name="fake",
        title="Fake",
        detect=lambda path: Path(path, "latest").is_file(),
        reader=lambda *args, **kwargs: None,
        read_options=ReadOptions,
        writer=lambda *args, **kwargs: None,
        write_options=WriteOptions,
        sources=("writer",),
        targets=("reader",),
    )
    monkeypatch.setattr(registry, "FORMATS", (*registry.FORMATS, fake))
    monkeypatch.setattr(routes, "FORMATS", registry.FORMATS)
    foreign, ours = tmp_path / "foreign", tmp_path / "ours"
    foreign.mkdir()
    ours.mkdir()
    (foreign / "latest").write_text("step-1")
    assert interop.detect(foreign) is fake and interop.detect(ours) is None
    options = {"layout": "flat", "model_prefix": None, "optimizer_prefix": "optimizer."}

    def route(src, **given):
        asked = {"to": None, "source": None, "output_format": "muonckpt", "renamed": False}
        return routes.route(src, **{**asked, **given}, overwrite=False, options=options)

    assert route(foreign, to="packaged", source="writer") == routes.Route(
        reads=fake, options=ReadOptions(None), source="writer", to="packaged"
    )
    assert route(ours, to="reader", output_format="fake") == routes.Route(
        writes=fake, options=WriteOptions("flat")
    )
    assert route(ours, to="torch") == routes.Route()
    refusals = [
        (
            {"output_format": "bogus"},
            "--format",
            "choose muonckpt or megatron or torchtitan or dcp or deepspeed or accelerate or "
            "lightning or fake",
        ),
        ({"to": "torch", "output_format": "fake"}, "--to", "choose one of reader"),
        ({"to": "packaged"}, "--from", "a Fake checkpoint does not record"),
        ({"to": "packaged", "source": "torch"}, "--from", "choose one of writer"),
    ]
    for given, option, message in refusals:
        with pytest.raises(OptionError, match=message) as refused:
            route(foreign, **given)
        assert refused.value.option == option


def test_each_formats_options_are_keywords_of_its_reader_and_writer():
    """The registry calls a format's public ``from_X``/``to_X`` with its options' fields (and
    :class:`Reading`'s) as keywords: each must be one the function takes."""
    import dataclasses
    import inspect

    from muonckpt import interop

    reading = [f.name for f in dataclasses.fields(interop.Reading)]
    for format_ in interop.FORMATS:
        calls = [(format_.reader, format_.read_options, reading)]
        if format_.writer is not None:
            calls.append((format_.writer, format_.write_options, ["to"]))
        for function, options, common in calls:
            taken = inspect.signature(function).parameters
            for name in [*common, *(f.name for f in dataclasses.fields(options))]:
                assert taken[name].kind is inspect.Parameter.KEYWORD_ONLY, (function, name)
