"""The ``muonckpt`` command line: a thin typer layer over :mod:`muonckpt.offline.tools`: the
commands
parse, call and hand what they got to :mod:`.output`; how a command ends (its exit code, its
errors as one line) is :mod:`.exits`'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import typer

from ..errors import CheckpointError
from ..settings import local_path
from . import output
from .exits import PROBLEM, Group, catch_stop_signals
from .options import (
    S3_SCHEME,
    AllowLargeWorld,
    BucketAlignment,
    BucketNumel,
    BuffersBy,
    ConvertFrom,
    ConvertTo,
    Dst,
    Force,
    Layout,
    MegatronDp,
    MegatronTp,
    MergeExperts,
    ModelBuffers,
    ModelPrefix,
    Names,
    OptimizerPrefix,
    OutputFormat,
    ParamAlignment,
    Quiet,
    Renames,
    Root,
    Source,
    SplitExperts,
    TpSplit,
    World,
    ZeroStage,
    checkpoint_source,
    size_parameter,
)

if TYPE_CHECKING:
    from .routes import Route

# The library is imported by the commands that use it, so that --help and usage errors answer
# at once; torch (~2.7 s to import on the benchmark machine) only by those that need it:
# consolidate and reshard in one process, inspect and verify run without it.


app = typer.Typer(
    cls=Group,
    help="Checkpoint, inspect and reshard the sharded optimizer state of Muon.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _global(
    ctx: typer.Context,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No progress bar and no summary lines.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")] = False,
) -> None:
    """Checkpoint, inspect and reshard the sharded optimizer state of Muon."""
    ctx.obj = {"quiet": quiet, "debug": debug}


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun (and any env:// launcher) sets for each process."""


@contextmanager
def _ranks(ctx: typer.Context) -> Iterator[bool]:
    """Under torchrun: join its gloo group (unless joined), quiet every rank but 0, yield True.

    Otherwise yield False.
    """
    if not all(name in os.environ for name in TORCHRUN_ENV):
        yield False
        return
    from .. import offline
    from ..distributed import default_group_from_env, global_rank

    with default_group_from_env(timedelta(seconds=offline.WORKER_TIMEOUT)):
        if global_rank() != 0:
            ctx.obj = {**(ctx.obj or {}), "quiet": True}
        yield True


@app.command()
def consolidate(
    ctx: typer.Context,
    src: Source,
    dst: Dst,
    max_shard_size: Annotated[
        int | None,
        typer.Option(
            "--max-shard-size",
            parser=size_parameter,
            metavar="SIZE",
            help="Split into HF-style optimizer-0000i-of-0000N files past this size (5GB, 500MB).",
        ),
    ] = None,
    force: Force = False,
    quiet: Quiet = False,
) -> None:
    """Rewrite any checkpoint as full-shape tensors: optimizer.safetensors and model.safetensors.

    The state as state.<param>.<key>, the params by name (where the checkpoint holds them).

    Example: muonckpt consolidate ckpt/step-1000 -o ckpt/full --max-shard-size 5GB

    Under torchrun: torchrun --nproc-per-node 4 -m muonckpt.cli consolidate ckpt/step-1000
    -o ckpt/full
    """
    from .. import offline

    shards = {"max_shard_size": max_shard_size}
    _rewrite(ctx, quiet, offline.consolidate, src, dst, force, True, **shards)


@app.command()
def reshard(
    ctx: typer.Context,
    src: Source,
    dp: Annotated[int, typer.Option("--dp", min=1, help="Data-parallel size of the new job.")],
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel size of the new job.")],
    dst: Dst,
    bucket_numel: BucketNumel = None,
    param_alignment: ParamAlignment = 1,
    bucket_alignment: BucketAlignment = 1,
    buffers_by: BuffersBy = "none",
    tp_split: TpSplit = None,
    force: Force = False,
    allow_large_world: AllowLargeWorld = False,
    quiet: Quiet = False,
) -> None:
    """Rewrite any checkpoint as one file per rank of a dp x tp job.

    Example: muonckpt reshard ckpt/step-1000 --dp 4 --tp 2 -o ckpt/step-1000-dp4-tp2

    Under torchrun: torchrun --nproc-per-node 4 -m muonckpt.cli reshard ckpt/step-1000
    --dp 4 --tp 2 -o ckpt/4x2

    Bucketed: muonckpt reshard ckpt/step-1000 --dp 4 --tp 2 --bucket-numel 40000000 -o out

    The layout options are those of muonckpt.layout.topology.LayoutOptions; any choice loads
    correctly.
    """
    from ..layout import LayoutOptions

    options = LayoutOptions(
        bucket_numel=bucket_numel,
        param_alignment=param_alignment,
        bucket_alignment=bucket_alignment,
        buffers_by=cast(Literal["none", "group"], buffers_by),  # checked there, as every field
    )
    splits = {}
    for item in tp_split or []:
        name, sep, dim = item.rpartition("=")
        if not sep or not name or not dim.lstrip("-").isdigit():
            raise typer.BadParameter(f"{item!r} is not NAME=DIM", param_hint="--tp-split")
        splits[name] = int(dim)
    from .. import offline

    settings = {
        "dp": dp,
        "tp": tp,
        "options": options,
        "tp_split_dims": splits,
        "allow_large_world": allow_large_world,
    }
    _rewrite(ctx, quiet, offline.reshard, src, dst, force, True, **settings)


@app.command()
def convert(
    ctx: typer.Context,
    src: Source,
    dst: Dst,
    to: ConvertTo = None,
    rename: Renames = None,
    source: ConvertFrom = None,
    output_format: OutputFormat = "muonckpt",
    layout: Layout = None,
    world: World = None,
    zero_stage: ZeroStage = None,
    tp: MegatronTp = None,
    dp: MegatronDp = None,
    model_prefix: ModelPrefix = None,
    optimizer_prefix: OptimizerPrefix = "optimizer.",
    names: Names = None,
    model_buffers: ModelBuffers = False,
    split_experts: SplitExperts = False,
    merge_experts: MergeExperts = False,
    allow_large_world: AllowLargeWorld = False,
    force: Force = False,
    quiet: Quiet = False,
) -> None:
    """Rewrite a checkpoint for another Muon implementation, renamed, or from/to PyTorch DCP,
    DeepSpeed, Megatron-Core, accelerate or Lightning.

    The packaged Muon keeps sum-form momentum, torch.optim.Muon and KellerJordan's Muon EMA
    form: the buffers are scaled by 1 - mu (or its inverse) and AdamW step counts move to where
    the target keeps them, exactly as muonckpt.load converts in memory. A DCP checkpoint SRC
    (a directory with .metadata) becomes a consolidated muonckpt checkpoint (--from names its
    writer); --format dcp writes DCP that torch.distributed.checkpoint.load reads at any
    world size. A DeepSpeed ZeRO-1/2/3 checkpoint SRC (its directory with latest, or one
    global_stepN) becomes one too; --to deepspeed --world N writes DeepSpeed's own files for N
    ranks, at the ZeRO stage it was read at (--zero-stage chooses). A Megatron-Core torch_dist
    checkpoint SRC (its root or one iter_N) becomes one too; --to megatron --tp T --dp D
    writes a torch_dist checkpoint for Megatron's layer-wise Muon at TP T, DP D. An accelerate
    save_state directory or a Lightning .ckpt becomes one too; --to accelerate and --to
    lightning write them back (torch.optim.Muon, then AdamW). --to torchtitan stacks experts
    that --split-experts split again.

    Example: muonckpt convert ckpt/step-1000 -o ckpt/step-1000-torch --to torch

    Example: muonckpt convert titan/step-300 -o ckpt/step-300 --from torchtitan --to packaged

    Example: muonckpt convert ckpt/step-300 -o titan/step-300-back --to torchtitan

    Example: muonckpt convert ds/ckpt -o ckpt/from-ds --from deepspeed --to packaged

    Example: muonckpt convert ckpt/from-ds -o ds/ckpt-world3 --to deepspeed --world 3

    Example: muonckpt convert ckpt/from-mcore -o mcore/tp1-dp2 --to megatron --tp 1 --dp 2

    Names: muonckpt convert ckpt/step-1000 -o ckpt/plain --rename module.= --rename _orig_mod.=
    """
    from ..errors import OptionError
    from .routes import route as route_of

    prefixes = _renames(rename)
    options = {
        "layout": layout,
        "world": world,
        "zero_stage": zero_stage,
        "tp": tp,
        "dp": dp,
        "model_prefix": model_prefix,
        "optimizer_prefix": optimizer_prefix,
        "names": names,
        "model_buffers": model_buffers,
        "split_experts": split_experts,
        "merge_experts": merge_experts or None,  # absent: the splits recorded
        "allow_large_world": allow_large_world,
    }
    try:
        route = route_of(
            src,
            to=to,
            source=source,
            output_format=output_format,
            renamed=bool(prefixes),
            overwrite=force,
            options=options,
        )
    except OptionError as exc:
        raise typer.BadParameter(str(exc), param_hint=exc.option) from None
    _convert_by(route, ctx, src, dst, to=to, renames=prefixes, force=force, quiet=quiet)


def _convert_by(
    route: Route,
    ctx: typer.Context,
    src: str,
    dst: str,
    *,
    to: str | None,
    renames: dict[str, str],
    force: bool,
    quiet: bool,
) -> None:
    """Run the conversion ``route`` chose (a foreign format's writer, its reader, or muonckpt
    to muonckpt), then say what it did."""
    from .. import offline
    from ..interop import Reading

    output.also_quiet(ctx, quiet)
    if route.writes is not None:
        assert to is not None  # the route checked it is one of the format's targets
        # foreign files are local only: SRC by the route, DST refused here when a URL
        with output.progress_bar(ctx, "convert") as progress:
            report = route.writes.write(Path(src), local_path(dst), to, route.options, progress)
        output.say_conversion(ctx, route.writes.title, report)
        output.say(ctx, output.wrote_foreign(report, route.writes.title))
    elif route.reads is not None and route.source is not None:
        with output.progress_bar(ctx, "convert") as progress:
            reading = Reading(route.source, route.to, overwrite=force, progress=progress)
            report = route.reads.read(Path(src), local_path(dst), reading, route.options)
        if route.inferred:  # (after the read: a refusal stays one line)
            output.say(
                ctx, f"--from {route.source}: inferred ({route.reads.title} files record it)"
            )
        output.say_conversion(ctx, route.reads.title, report)
        _say_written(ctx, report.path)
    else:
        settings = {"to": to, "rename": renames or None}
        _rewrite(ctx, quiet, offline.convert, src, dst, force, False, **settings)


def _renames(items: list[str] | None) -> dict[str, str]:
    """``--rename OLD=NEW`` options as a mapping, each OLD once."""
    prefixes: dict[str, str] = {}
    for item in items or []:
        old, sep, new = item.partition("=")
        if not sep or old in prefixes:
            raise typer.BadParameter(f"{item!r} is not OLD=NEW, OLD once", param_hint="--rename")
        prefixes[old] = new
    return prefixes


def _rewrite(
    ctx: typer.Context,
    quiet: bool,
    operation: Callable[..., object],
    src: str | Path,
    dst: str,
    force: bool,
    shared: bool,
    **settings: Any,
) -> None:
    """Run an offline rewrite with the options its commands share: --quiet, --force
    (overwrite), the progress bar and, where it takes them (``shared``), torchrun's ranks;
    then say what was written."""
    output.also_quiet(ctx, quiet)
    ranks = _ranks(ctx) if shared else nullcontext(False)
    with ranks as collective, output.progress_bar(ctx, operation.__name__) as progress:
        if shared:
            settings.update(collective=collective)
        operation(src, dst, overwrite=force, progress=progress, **settings)
    _say_written(ctx, dst)


def _say_written(ctx: typer.Context, path: str | Path) -> None:
    """The ``wrote ...`` line of a muonckpt output, unless --quiet (its summary, which reads the
    output's manifest and imports what reads it, only then)."""
    if output.is_quiet(ctx):
        return
    from .. import offline

    output.say(ctx, output.written(path, offline.summarize(path)))


@app.command()
def inspect(
    src: Source,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    wide: Annotated[
        bool,
        typer.Option(
            "--wide", help="One line per param however wide, instead of wrapping at the terminal."
        ),
    ] = False,
) -> None:
    """Show a checkpoint's topology, step, params, dtypes, state keys, values and sizes.

    Names are shown whole, wrapped at the terminal's width (--wide: never wrapped).

    Example: muonckpt inspect ckpt/step-1000 --json
    """
    from .. import offline

    try:
        info = offline.summarize(src)
    except CheckpointError:
        _refuse_foreign(src)
        raise
    if as_json:
        typer.echo(json.dumps(info.to_json(), indent=2))
        return
    output.print_summary(info, wide)


@app.command()
def doctor(
    src: Source,
    against: Annotated[
        str | None,
        typer.Option(
            "--against",
            metavar="OTHER",
            help="Another checkpoint of the same run: a momentum norm that jumped between "
            "them (a resume that lost state) is a problem.",
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="FILE",
            help="A model file (model.safetensors, a model.safetensors.index.json of shards, "
            "or a directory holding either): each param that differs from its tensor of the "
            "same name, or is missing on either side, is a problem.",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print every tensor's health and the findings as JSON.")
    ] = False,
) -> None:
    """Read a checkpoint's values for what a resume would silently get wrong.

    NaN/Inf per tensor (and the ranks holding them), momentum that is all zero, normalized
    in place or in another form than recorded, step counts that disagree, state that does not
    cover its tensors, params that differ from a model file. Reads rank by rank, a piece at a
    time. Exit 0 when healthy, 1 listing each problem.

    Example: muonckpt doctor ckpt/step-1000 --against ckpt/step-900 --model hf/model.safetensors
    """
    from .. import doctor as diagnose

    found = diagnose(src, against=against, model=model)
    if as_json:
        typer.echo(json.dumps(found.to_json(), indent=2))
    else:
        output.print_diagnosis(found)
    if not found.healthy:
        raise typer.Exit(PROBLEM)


@app.command()
def verify(src: Source) -> None:
    """Check a checkpoint: manifest, coverage, file sizes, headers and every checksum.

    Exit 0 when sound, 1 listing each problem. Example: muonckpt verify ckpt/step-1000

    Of a checkpoint in S3 (s3://bucket/prefix) every object its manifest names is checked;
    objects it does not name (a save that never committed) are left for clean. A store that
    cannot be used (no credentials, access denied, unreachable) exits 2 with one error line.
    """
    if not src.startswith(S3_SCHEME) and not Path(src).is_dir():
        raise CheckpointError("no checkpoint directory", path=src)
    from .. import verify as verify_checkpoint

    problems = verify_checkpoint(src)
    if problems:
        _refuse_foreign(src)
    console = output.stdout()
    if not problems:
        console.print(f"ok: {src} is sound", markup=False, soft_wrap=True)
        return
    for problem in problems:
        console.print(f"problem: {output.printable(str(problem))}", markup=False, soft_wrap=True)
    console.print(f"{len(problems)} problem(s) in {src}", markup=False, soft_wrap=True)
    raise typer.Exit(PROBLEM)


def _refuse_foreign(src: str) -> None:
    """A foreign checkpoint SRC is refused naming its format and the convert that reads it."""
    from .routes import reading_hint

    hint = reading_hint(src)
    if hint is not None:
        raise CheckpointError(hint) from None


@app.command()
def clean(
    root: Root,
    older_than: Annotated[
        float,
        typer.Option(
            "--older-than",
            metavar="SECONDS",
            help="Only what has not changed for this long (a running save is never removed).",
        ),
    ] = 3600.0,
) -> None:
    """Remove what interrupted saves left directly under ROOT.

    muonckpt's own staging directories (.NAME.staging-*, .NAME.old-PID) and earlier
    versions' background-save mailboxes (.NAME.steps-*), known by the lease file muonckpt
    writes into each (never by name alone), that no save uses (a running save holds its
    lease, whatever --older-than says) and unchanged for --older-than seconds: only their
    checkpoint files, messages and lease (of a killed conversion to DCP, DeepSpeed or
    Megatron, that format's files), never anything else and nothing through a symlink.
    Prints each directory removed, and each one named like these that was kept, with why.
    Under an s3:// ROOT: the save prefixes (CHECKPOINT/s-<16 hex>/) no committed manifest
    names, whose lease is gone or stale, and their unfinished multipart uploads. Exit 1 when
    ROOT does not exist (as latest).

    Example: muonckpt clean ckpt --older-than 7200
    """
    if not root.startswith(S3_SCHEME) and not Path(root).is_dir():
        output.stderr_line(f"no directory {root}: nothing to clean")
        raise typer.Exit(PROBLEM)
    from .. import clean as clean_root

    cleaned = clean_root(root, older_than)
    for path in cleaned.removed:
        typer.echo(f"removed {output.printable(str(path))}")
    for path, why in cleaned.skipped:
        typer.echo(f"skipped {output.printable(str(path))}: {why}")


@app.command()
def latest(root: Root) -> None:
    """Print the newest complete checkpoint directly under ROOT, to resume from.

    Newest by the step its manifest records, then by commit time; staging directories,
    unfinished, damaged and foreign entries and symlinks are skipped (a cheap check: the
    manifest and file sizes, no checksums). Exit 1 when there is none (also when ROOT does
    not exist).

    Example: muonckpt latest ckpt

    In a job script: if ckpt=$(muonckpt latest ckpt); then resume="--resume $ckpt"; fi
    """
    from .. import latest as find_latest

    found = find_latest(root)
    if found is None:
        output.stderr_line(f"no complete checkpoint in {root}")
        raise typer.Exit(PROBLEM)
    typer.echo(str(found))


@app.command()
def diff(
    a: Annotated[
        str,
        typer.Argument(
            metavar="A", parser=checkpoint_source, help="First checkpoint.", show_default=False
        ),
    ],
    b: Annotated[
        str,
        typer.Argument(
            metavar="B", parser=checkpoint_source, help="Second checkpoint.", show_default=False
        ),
    ],
    atol: Annotated[float, typer.Option(min=0.0, help="Absolute tolerance.")] = 0.0,
    rtol: Annotated[float, typer.Option(min=0.0, help="Relative tolerance (of B).")] = 0.0,
    differences: Annotated[
        bool,
        typer.Option(
            "--differences", "-d", help="Print only the rows that differ, then the summary line."
        ),
    ] = False,
) -> None:
    """Compare two checkpoints of any kinds, topologies and Muon implementations, row by row.

    A row per tensor (momentum of another form is converted as load converts it, and the row
    says so), per group's settings, per model-file tensor and job-state tree, and the step.
    Exit 1 when any row differs beyond the tolerances. Example: muonckpt diff ckpt/a ckpt/b

    Only the differences: muonckpt diff ckpt/a ckpt/b --differences
    """
    from .. import offline

    rows = offline.iter_diff(a, b, atol=atol, rtol=rtol)
    if output.print_diff(rows, only_differences=differences):
        raise typer.Exit(PROBLEM)


@app.command()
def demo(
    ctx: typer.Context,
    dp: Annotated[int, typer.Option(min=1, help="DP size of the training run.")] = 2,
    tp: Annotated[int, typer.Option(min=1, help="TP size of the training run.")] = 2,
    to_dp: Annotated[int, typer.Option(min=1, help="DP size to reshard to and resume at.")] = 4,
    to_tp: Annotated[int, typer.Option(min=1, help="TP size to reshard to and resume at.")] = 2,
    steps: Annotated[int, typer.Option(min=1, help="Steps before and after the reshard.")] = 4,
    workdir: Annotated[
        Path | None,
        typer.Option(
            "--dir",
            help="Where the checkpoints go, and stay (default: a temporary directory, removed "
            "at the end).",
        ),
    ] = None,
) -> None:
    """Train a tiny model at dp x tp, save, reshard offline, resume elsewhere, compare bitwise.

    Exit 0 only when every param matches an uninterrupted single-process run bit for bit.
    Example: muonckpt demo --dp 2 --tp 2 --to-dp 4 --to-tp 2 --steps 4
    """
    from ..demo import run_demo

    result = run_demo(
        dp=dp,
        tp=tp,
        to_dp=to_dp,
        to_tp=to_tp,
        steps=steps,
        workdir=workdir,
        log=lambda msg: output.say(ctx, msg),
    )
    title = (
        f"dp={dp} x tp={tp} -> dp={to_dp} x tp={to_tp}, {steps}+{steps} steps, resumed from "
        f"the checkpoint alone, vs. {2 * steps} uninterrupted"
    )
    output.print_demo(result, title)
    if not result.ok:
        raise typer.Exit(PROBLEM)


def main() -> None:
    """Console-script entry point: SIGINT, SIGTERM and SIGHUP interrupt the command as Ctrl-C
    does (see :class:`.exits.Group`)."""
    catch_stop_signals()
    app()
