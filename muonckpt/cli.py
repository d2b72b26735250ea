"""The ``muonckpt`` command line: a thin typer layer over :mod:`muonckpt.offline`.

Exit codes: 0 ok; 1 a problem was found (``verify``, ``diff``, ``demo``) or nothing was
(``latest``); 2 bad usage or an unreadable input; 3 committed: the output is a whole new
checkpoint, but the command was interrupted while cleaning up after the commit (what is left
of a replaced checkpoint, ``muonckpt clean`` removes); 128 + the signal number when
interrupted before the commit (130 SIGINT, 143 SIGTERM, 129 SIGHUP). Every
:class:`~muonckpt.errors.MuonCkptError` becomes one ``error: ...`` line on stderr (after its
traceback with ``--debug``, which never changes the exit code), in :class:`_Group.invoke` alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from .errors import CheckpointError, CheckpointWarning, MuonCkptError, committed_path

if TYPE_CHECKING:
    from .offline import Progress

# The library is imported by the commands that use it, so that --help and usage errors answer
# at once; torch (~2.7 s to import on the benchmark machine) only by those that need it:
# consolidate and reshard in one process, inspect and verify run without it.

OK, PROBLEM, USAGE, COMMITTED = 0, 1, 2, 3

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


TABLE_ROWS = 2000
"""``inspect`` draws a table up to this many params, plain tab-separated lines beyond."""


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``"1024"`` -> 1024."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
    if not match or (match.group(2) or "").upper() not in _UNITS:
        raise typer.BadParameter(f"{text!r} is not a size like 5GB, 500MB, 64MiB or 1048576")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if size <= 0:
        raise typer.BadParameter(f"{text!r} is not a positive size")
    return size


class _Group(TyperGroup):
    """The one place where library errors become ``error: ...`` and exit code 2.

    Also: an interruption (Ctrl-C, or SIGTERM / SIGHUP under :func:`main`) becomes ``error:
    interrupted`` and exit code 128 + the signal's number (130, 143, 129), after the command's
    own cleanup has run (its staging directory removed, its worker processes killed); after
    the commit, ``committed: ...`` and exit code 3 (the output is whole); a
    :class:`~muonckpt.errors.CheckpointWarning` becomes one ``warning: ...`` line. ``--debug``
    shows the tracebacks as well.
    """

    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]  # click passes typer's
        def debug() -> bool:  # ctx.obj is set by the global callback, inside super().invoke
            return bool((ctx.obj or {}).get("debug"))

        try:
            with _warnings_as_lines():
                return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            if debug():
                traceback.print_exc()
            committed = committed_path(exc)
            if committed is not None:
                _stderr_line(
                    f"committed: {committed} is complete; interrupted while cleaning up "
                    "(muonckpt clean removes what is left of a replaced checkpoint)"
                )
                ctx.exit(COMMITTED)
            _stderr_line("error: interrupted")
            ctx.exit(128 + getattr(exc, "signum", signal.SIGINT))
        except (MuonCkptError, OSError) as exc:
            if debug():  # the traceback too; the exit code stays the same
                traceback.print_exc()
            # a worker's failure carries its traceback after a one-line summary
            text = getattr(exc, "summary", None) or str(exc)
            message = " ".join(text.split()) or type(exc).__name__
            _stderr_line(f"error: {message}")
            ctx.exit(USAGE)


def _printable(text: str) -> str:
    """``text`` with its control characters (terminal escape codes among them) written as
    escapes, so that a name read from a checkpoint cannot drive the terminal; newlines kept."""
    return "".join(
        c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode() for c in text
    )


def _cell(text: str) -> str:
    """``text`` for a rich table cell: printable, and shown as it is, never as markup."""
    return escape(_printable(text))


def _stderr_line(text: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(_printable(text), markup=False)


@contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """CheckpointWarnings as ``warning: ...`` lines on stderr while the block runs."""
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if issubclass(category, CheckpointWarning):
                _stderr_line(f"warning: {' '.join(str(message).split())}")
            else:
                shown(message, category, *args, **kwargs)

        warnings.simplefilter("always", CheckpointWarning)
        warnings.showwarning = show
        yield


class _Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so that every cleanup on the way out runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None))


def _stop(signum: int, frame: Any) -> None:
    """The first stop signal interrupts the command; later ones are ignored, so that they
    cannot cut short the cleanup the first one started."""
    for other in _STOP_SIGNALS:
        if other is not None:
            signal.signal(other, signal.SIG_IGN)
    raise _Interrupted(signum)


app = typer.Typer(
    cls=_Group,
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


def _quiet(ctx: typer.Context) -> bool:
    return bool((ctx.obj or {}).get("quiet"))


def _also_quiet(ctx: typer.Context, quiet: bool) -> None:
    """A command's own --quiet, the same as the global one."""
    if quiet:
        ctx.obj = {**(ctx.obj or {}), "quiet": True}


def _out() -> Console:
    return Console(highlight=False, soft_wrap=False)


def _say(ctx: typer.Context, message: str) -> None:
    if not _quiet(ctx):
        Console(stderr=True, highlight=False).print(message, markup=False)


@contextmanager
def _progress(ctx: typer.Context, what: str) -> Iterator[Progress | None]:
    """A rich bar (bytes, tensors, rate, ETA) on stderr when it is a terminal and not --quiet."""
    if _quiet(ctx) or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[tensors]}"),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=None, tensors="")

        def update(done: int, total: int, written: int, tensors: int) -> None:
            bar.update(task, completed=done, total=total, tensors=f"{written}/{tensors} tensors")

        yield update


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


Src = Annotated[
    Path, typer.Argument(metavar="SRC", help="Checkpoint directory to read.", show_default=False)
]
Dst = Annotated[
    Path, typer.Option("--output", "-o", help="Checkpoint directory to write.", show_default=False)
]
Force = Annotated[bool, typer.Option("--force", "-f", help="Replace an existing output.")]
Quiet = Annotated[
    bool,
    typer.Option("--quiet", "-q", help="No progress bar and no summary line (as muonckpt -q)."),
]
Workers = Annotated[
    int,
    typer.Option(
        "--workers",
        "-w",
        min=1,
        help="Processes on this machine that share the writing (a local gloo group); the output "
        "is the same for any number. Under torchrun leave it out: the ranks share the work.",
    ),
]


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun (and any env:// launcher) sets for each process."""


@contextmanager
def _ranks(ctx: typer.Context, workers: int) -> Iterator[bool]:
    """Under torchrun: join its gloo group (unless joined), quiet every rank but 0, yield True.

    Otherwise yield False. ``--workers`` with torchrun is a usage error.
    """
    if not all(name in os.environ for name in TORCHRUN_ENV):
        yield False
        return
    from . import offline
    from .collectives import default_group_from_env, global_rank

    if workers != 1:
        raise typer.BadParameter(
            "not with torchrun, whose ranks already share the work", param_hint="--workers"
        )
    with default_group_from_env(timedelta(seconds=offline.WORKER_TIMEOUT)):
        if global_rank() != 0:
            ctx.obj = {**(ctx.obj or {}), "quiet": True}
        yield True


@app.command()
def consolidate(
    ctx: typer.Context,
    src: Src,
    dst: Dst,
    max_shard_size: Annotated[
        int | None,
        typer.Option(
            "--max-shard-size",
            parser=parse_size,
            metavar="SIZE",
            help="Split into HF-style optimizer-0000i-of-0000N files past this size (5GB, 500MB).",
        ),
    ] = None,
    force: Force = False,
    workers: Workers = 1,
    quiet: Quiet = False,
) -> None:
    """Rewrite any checkpoint as full-shape tensors: optimizer.safetensors and model.safetensors.

    The state as state.<param>.<key>, the params by name (where the checkpoint holds them).

    Example: muonckpt consolidate ckpt/step-1000 -o ckpt/full --max-shard-size 5GB

    Four processes: muonckpt consolidate ckpt/step-1000 -o ckpt/full --workers 4

    Under torchrun: torchrun --nproc-per-node 4 -m muonckpt.cli consolidate ckpt/step-1000
    -o ckpt/full
    """
    from . import offline

    shards = {"max_shard_size": max_shard_size}
    _rewrite(ctx, quiet, offline.consolidate, src, dst, force, workers, **shards)


@app.command()
def reshard(
    ctx: typer.Context,
    src: Src,
    dp: Annotated[int, typer.Option("--dp", min=1, help="Data-parallel size of the new job.")],
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel size of the new job.")],
    dst: Dst,
    bucket_numel: Annotated[
        int | None,
        typer.Option(
            "--bucket-numel",
            metavar="N",
            help="Close a ZeRO-1 bucket once it holds at least N elements "
            "(default: one bucket per buffer).",
            show_default=False,
        ),
    ] = None,
    param_alignment: Annotated[
        int,
        typer.Option(
            "--param-alignment",
            metavar="N",
            help="Start each param at a multiple of N elements from its bucket's start.",
        ),
    ] = 1,
    bucket_alignment: Annotated[
        int,
        typer.Option(
            "--bucket-alignment",
            metavar="N",
            help="Pad each bucket to a multiple of lcm(dp, N) elements.",
        ),
    ] = 1,
    buffers_by: Annotated[
        str,
        typer.Option(
            "--buffers-by",
            metavar="none|group",
            help="ZeRO-1 buffers: none (every param in one buffer) or group (one buffer per "
            "optimizer param group, as the manifest records them).",
        ),
    ] = "none",
    tp_split: Annotated[
        list[str] | None,
        typer.Option(
            "--tp-split",
            metavar="NAME=DIM",
            help="Split dimension of a param, overriding the manifest (repeatable; a "
            "single-process checkpoint records every param as unsplit).",
        ),
    ] = None,
    force: Force = False,
    workers: Workers = 1,
    quiet: Quiet = False,
) -> None:
    """Rewrite any checkpoint as one file per rank of a dp x tp job.

    Example: muonckpt reshard ckpt/step-1000 --dp 4 --tp 2 -o ckpt/step-1000-dp4-tp2

    Four processes: muonckpt reshard ckpt/step-1000 --dp 4 --tp 2 -o ckpt/4x2 --workers 4

    Under torchrun: torchrun --nproc-per-node 4 -m muonckpt.cli reshard ckpt/step-1000
    --dp 4 --tp 2 -o ckpt/4x2

    Bucketed: muonckpt reshard ckpt/step-1000 --dp 4 --tp 2 --bucket-numel 40000000 -o out

    The layout options are those of muonckpt.layout.LayoutOptions; any choice loads correctly.
    """
    from .layout import LayoutOptions

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
    from . import offline

    settings = {"dp": dp, "tp": tp, "options": options, "tp_split_dims": splits}
    _rewrite(ctx, quiet, offline.reshard, src, dst, force, workers, **settings)


@app.command()
def convert(
    ctx: typer.Context,
    src: Src,
    dst: Dst,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            metavar="IMPLEMENTATION",
            help="packaged (muonckpt.optim.Muon), torch (torch.optim.Muon + AdamW) or "
            "keller-jordan (muon.MuonWithAuxAdam); with --format dcp also torchtitan, dion or "
            "muon-fsdp2. Left out (muonckpt to muonckpt), each group keeps its implementation.",
            show_default=False,
        ),
    ] = None,
    rename: Annotated[
        list[str] | None,
        typer.Option(
            "--rename",
            metavar="OLD=NEW",
            help="Replace the prefix OLD of param names by NEW (repeatable; the longest "
            "matching OLD applies): module.= strips DDP's prefix, =model. adds one.",
        ),
    ] = None,
    source: Annotated[
        str | None,
        typer.Option(
            "--from",
            metavar="IMPLEMENTATION",
            help="The implementation that wrote a DCP checkpoint SRC (required for one: DCP "
            "does not record it): torch, torchtitan, dion, muon-fsdp2, keller-jordan, packaged.",
            show_default=False,
        ),
    ] = None,
    output_format: Annotated[
        str,
        typer.Option(
            "--format", metavar="FORMAT", help="muonckpt, or dcp (PyTorch Distributed Checkpoint)."
        ),
    ] = "muonckpt",
    layout: Annotated[
        str,
        typer.Option(
            "--layout",
            help="With --format dcp: torchtitan (model fqns at the top level) or recipe "
            "(model.<fqn>, DCP's get_state_dict recipe).",
        ),
    ] = "torchtitan",
    model_prefix: Annotated[
        str | None,
        typer.Option(
            "--model-prefix",
            help="Reading DCP: the prefix of the model's fqns (default: detected, 'model.' or "
            "none).",
            show_default=False,
        ),
    ] = None,
    optimizer_prefix: Annotated[
        str,
        typer.Option("--optimizer-prefix", help="Reading DCP: the optimizer state's prefix."),
    ] = "optimizer.",
    force: Force = False,
    quiet: Quiet = False,
) -> None:
    """Rewrite a checkpoint for another Muon implementation, renamed, or from/to PyTorch DCP.

    The packaged Muon keeps sum-form momentum, torch.optim.Muon and KellerJordan's Muon EMA
    form: the buffers are scaled by 1 - mu (or its inverse) and AdamW step counts move to where
    the target keeps them, exactly as muonckpt.load converts in memory. A DCP checkpoint SRC
    (a directory with .metadata) becomes a consolidated muonckpt checkpoint (--from names its
    writer); --format dcp writes DCP that torch.distributed.checkpoint.load reads at any
    world size.

    Example: muonckpt convert ckpt/step-1000 -o ckpt/step-1000-torch --to torch

    Example: muonckpt convert titan/step-300 -o ckpt/step-300 --from torchtitan --to packaged

    Example: muonckpt convert ckpt/step-300 -o titan/step-300-back --to torchtitan --format dcp

    Names: muonckpt convert ckpt/step-1000 -o ckpt/plain --rename module.= --rename _orig_mod.=
    """
    from . import offline
    from .kinds import DCP_FAMILIES, FAMILIES

    prefixes = {}
    for item in rename or []:
        old, sep, new = item.partition("=")
        if not sep or old in prefixes:
            raise typer.BadParameter(f"{item!r} is not OLD=NEW, OLD once", param_hint="--rename")
        prefixes[old] = new
    if prefixes and (output_format == "dcp" or offline.is_dcp(src)):
        raise typer.BadParameter("names are mapped between muonckpt checkpoints only")
    if output_format not in ("muonckpt", "dcp"):
        raise typer.BadParameter("choose muonckpt or dcp", param_hint="--format")
    if output_format == "dcp":
        if to not in DCP_FAMILIES:
            raise typer.BadParameter(f"choose one of {', '.join(DCP_FAMILIES)}", param_hint="--to")
        if layout not in offline.LAYOUTS:
            raise typer.BadParameter(
                f"choose one of {', '.join(offline.LAYOUTS)}", param_hint="--layout"
            )
        if offline.is_dcp(src):
            raise typer.BadParameter("SRC is a DCP checkpoint already", param_hint="--format")
        if force:
            raise typer.BadParameter("DCP output is never written over an existing directory")
        _also_quiet(ctx, quiet)
        _report(ctx, offline.to_dcp(src, dst, to=to, layout=layout))
        return
    if to is not None and to not in FAMILIES:
        raise typer.BadParameter(f"choose one of {', '.join(FAMILIES)}", param_hint="--to")
    if not offline.is_dcp(src):
        if source is not None:
            raise typer.BadParameter(
                "is for DCP checkpoints; a muonckpt checkpoint records what saved it",
                param_hint="--from",
            )
        if to is None and not prefixes:
            raise typer.BadParameter("give --to, --rename or both", param_hint="--to")
        settings = {"to": to, "rename": prefixes or None}
        _rewrite(ctx, quiet, offline.convert, src, dst, force, None, **settings)
        return
    if to is None:
        raise typer.BadParameter(
            f"converting DCP needs a target: one of {', '.join(FAMILIES)}", param_hint="--to"
        )
    if source is None:
        raise typer.BadParameter(
            "a DCP checkpoint does not record which optimizer wrote it, and muonckpt never "
            f"guesses its momentum form: pass --from, one of {', '.join(DCP_FAMILIES)}",
            param_hint="--from",
        )
    if source not in DCP_FAMILIES:
        raise typer.BadParameter(f"choose one of {', '.join(DCP_FAMILIES)}", param_hint="--from")
    _also_quiet(ctx, quiet)
    with _progress(ctx, "convert") as progress:
        report = offline.from_dcp(
            src,
            dst,
            source=source,
            to=to,
            model_prefix=model_prefix,
            optimizer_prefix=optimizer_prefix,
            overwrite=force,
            progress=progress,
        )
    _report(ctx, report)
    _say(ctx, _written(report.path))


def _report(ctx: typer.Context, report: Any) -> None:
    """What a DCP conversion read or wrote, converted and left out."""
    _say(ctx, f"{report.path}: DCP layout {report.layout}")
    for line in report.converted:
        _say(ctx, f"converted {_printable(line)}")
    for line in report.left_out:
        _say(ctx, f"left out {_printable(line)}")


def _rewrite(
    ctx: typer.Context,
    quiet: bool,
    operation: Callable[..., Path],
    src: Path,
    dst: Path,
    force: bool,
    workers: int | None,
    **settings: Any,
) -> None:
    """Run an offline rewrite with the options its commands share: --quiet, --force
    (overwrite), the progress bar and, where it takes them (``workers`` not None), --workers or
    torchrun; then say what was written."""
    _also_quiet(ctx, quiet)
    ranks = nullcontext(False) if workers is None else _ranks(ctx, workers)
    with ranks as collective, _progress(ctx, operation.__name__) as progress:
        if workers is not None:
            settings.update(workers=workers, collective=collective)
        out = operation(src, dst, overwrite=force, progress=progress, **settings)
    _say(ctx, _written(out))


def _written(path: Path) -> str:
    from . import offline

    info = offline.summarize(path)
    totals, topo = info["totals"], info["topology"]
    return (
        f"wrote {path}: {info['kind']}, dp={topo.get('dp')} x tp={topo.get('tp')}, "
        f"{totals['files']} file(s), {_human(totals['file_bytes'])}"
    )


@app.command()
def inspect(
    src: Src,
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
    from . import offline

    info = offline.summarize(src)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    console = _out()
    topo = info["topology"]
    console.print(
        f"{info['path']}: {info['kind']} checkpoint (format {info['format_version']}), "
        f"topology dp={topo.get('dp')} x tp={topo.get('tp')}, step {info['step']}",
        markup=False,
    )
    extra = info["extra"]
    if extra is not None and extra["values"] is not None:
        console.print(f"extra: {json.dumps(extra['values'])}", markup=False)
    if extra is not None and extra["ranks"]:
        shown = json.dumps(extra["rank_0_values"])
        console.print(f"rank_extra: {extra['ranks']} ranks, rank 0: {shown}", markup=False)
    for g, group in enumerate(info["groups"]):
        hyper = ", ".join(f"{k}={v}" for k, v in group["hyperparams"].items())
        console.print(f"group {g}: {hyper}", markup=False)
    columns = ("param", "shape", "dtype", "tp split", "group", "state keys", "values", "bytes")
    rows = [
        (
            _printable(p["name"]),
            "x".join(map(str, p["shape"])) or "scalar",
            ", ".join(sorted({d for k, d in p["dtypes"].items() if k != "param"})) or "-",
            str(p["tp_split_dim"]) if p["tp_split_dim"] >= 0 else "-",
            str(p["group"]),
            _printable(", ".join(p["state_keys"])) or "(none)",
            p["value_dtype"] or "-",
            _human(p["bytes"]),
        )
        for p in info["params"]
    ]
    if len(rows) <= TABLE_ROWS:
        table = Table(show_edge=False)
        for column in columns:  # folded, never cut: a name is shown whole
            table.add_column(
                column, justify="right" if column == "bytes" else "left", overflow="fold"
            )
        for row in rows:
            table.add_row(*map(escape, row))
        if wide:
            console = Console(highlight=False, soft_wrap=False, width=_widest(console, table))
        console.print(table)
    else:  # a rich table costs ~0.5 ms a row: plain tab-separated lines past a few thousand
        typer.echo("\n".join("\t".join(row) for row in [columns, *rows]))
    model = info["model"]
    if model is not None:
        tied = ", ".join(f"{a} = {n}" for a, n in model["aliases"].items()) or "none"
        others = ", ".join(model["tensors"]) or "none"
        console.print(
            _printable(f"model file also holds: {others}; tied names: {tied}"), markup=False
        )
    t = info["totals"]
    console.print(
        f"total: {t['params']} params ({t['values']} with saved values), {t['tensors']} state "
        f"tensors, {_human(t['bytes'])} of data in {t['files']} file(s) "
        f"({_human(t['file_bytes'])}, {t['pieces']} pieces)",
        markup=False,
    )


def _widest(console: Console, table: Table) -> int:
    """The width at which ``table`` needs no wrapping."""
    return max(
        console.width, console.measure(table, options=console.options.update(width=1 << 20)).maximum
    )


@app.command()
def verify(src: Src) -> None:
    """Check a checkpoint: manifest, coverage, file sizes, headers and every checksum.

    Exit 0 when sound, 1 listing each problem. Example: muonckpt verify ckpt/step-1000
    """
    if not src.is_dir():
        raise CheckpointError("no checkpoint directory", path=src)
    from . import verify as verify_checkpoint

    problems = verify_checkpoint(src)
    console = _out()
    if not problems:
        console.print(f"ok: {src} is sound", markup=False)
        return
    for problem in problems:
        console.print(f"problem: {_printable(str(problem))}", markup=False)
    console.print(f"{len(problems)} problem(s) in {src}", markup=False)
    raise typer.Exit(PROBLEM)


@app.command()
def clean(
    root: Annotated[
        Path,
        typer.Argument(
            metavar="ROOT", help="Directory holding the checkpoints.", show_default=False
        ),
    ],
    older_than: Annotated[
        float,
        typer.Option(
            "--older-than",
            metavar="SECONDS",
            help="Only what has not changed for this long (a running save changes its own).",
        ),
    ] = 3600.0,
) -> None:
    """Remove what interrupted saves left directly under ROOT.

    muonckpt's own staging directories (.NAME.staging-*, .NAME.old-PID) and background-save
    mailboxes (.NAME.steps-*) unchanged for --older-than seconds: only their checkpoint files
    and messages, never anything else and nothing through a symlink. Prints each directory
    removed.

    Example: muonckpt clean ckpt --older-than 7200
    """
    from . import clean as clean_root

    for path in clean_root(root, older_than):
        typer.echo(f"removed {path}")


@app.command()
def latest(
    root: Annotated[
        Path,
        typer.Argument(
            metavar="ROOT", help="Directory holding the checkpoints.", show_default=False
        ),
    ],
) -> None:
    """Print the newest complete checkpoint directly under ROOT, to resume from.

    Newest by the step its manifest records, then by commit time; staging directories,
    unfinished, damaged and foreign entries and symlinks are skipped (a cheap check: the
    manifest and file sizes, no checksums). Exit 1 when there is none (also when ROOT does
    not exist).

    Example: muonckpt latest ckpt

    In a job script: if ckpt=$(muonckpt latest ckpt); then resume="--resume $ckpt"; fi
    """
    from . import latest as find_latest

    found = find_latest(root)
    if found is None:
        _stderr_line(f"no complete checkpoint in {root}")
        raise typer.Exit(PROBLEM)
    typer.echo(str(found))


DIFF_COLUMNS = ("param", "state key", "max abs", "max rel", "equal")


def _diff_cells(r: dict[str, Any]) -> tuple[str, ...]:
    """One diff row as printable text cells."""
    verdict = "bitwise" if r.get("bitwise") else "yes" if r["equal"] else "NO"
    if r["note"]:
        verdict = f"{verdict}: {r['note']}" if r["max_abs"] is not None or r["equal"] else r["note"]
    return (
        _printable(r["param"]),
        _printable(r["key"] or "-"),
        "-" if r["max_abs"] is None else f"{r['max_abs']:.3g}",
        "-" if r["max_rel"] is None else f"{r['max_rel']:.3g}",
        _printable(verdict),
    )


@app.command()
def diff(
    ctx: typer.Context,
    a: Annotated[Path, typer.Argument(metavar="A", help="First checkpoint.", show_default=False)],
    b: Annotated[Path, typer.Argument(metavar="B", help="Second checkpoint.", show_default=False)],
    atol: Annotated[float, typer.Option(min=0.0, help="Absolute tolerance.")] = 0.0,
    rtol: Annotated[float, typer.Option(min=0.0, help="Relative tolerance (of B).")] = 0.0,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet", "-q", help="Print only the rows that differ, then the summary line."
        ),
    ] = False,
) -> None:
    """Compare two checkpoints of any kinds, topologies and Muon implementations, row by row.

    A row per tensor (momentum of another form is converted as load converts it, and the row
    says so), per group's settings, per model-file tensor and job-state tree, and the step.
    Exit 1 when any row differs beyond the tolerances. Example: muonckpt diff ckpt/a ckpt/b

    Only the differences: muonckpt diff ckpt/a ckpt/b --quiet
    """
    from . import offline

    only_differences = quiet or _quiet(ctx)
    console = _out()
    kept: list[tuple[str, ...]] = []
    total = differ = 0
    streaming = False  # past TABLE_ROWS rows: plain tab-separated lines, as they come
    for r in offline.iter_diff(a, b, atol=atol, rtol=rtol):
        total += 1
        differ += not r["equal"]
        if only_differences and r["equal"]:
            continue
        cells = _diff_cells(r)
        if streaming:
            typer.echo("\t".join(cells))
            continue
        kept.append(cells)
        if len(kept) > TABLE_ROWS:
            typer.echo("\n".join("\t".join(row) for row in [DIFF_COLUMNS, *kept]))
            kept, streaming = [], True
    if kept:
        table = Table(show_edge=False)
        for column in DIFF_COLUMNS:
            table.add_column(column, justify="right" if column.startswith("max") else "left")
        for cells in kept:
            table.add_row(*map(escape, cells))
        console.print(table)
    if differ:
        console.print(f"{differ} of {total} row(s) differ", markup=False)
        raise typer.Exit(PROBLEM)
    console.print(f"all {total} row(s) equal", markup=False)


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
            "--workdir",
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
    from .demo import run_demo

    result = run_demo(
        dp=dp,
        tp=tp,
        to_dp=to_dp,
        to_tp=to_tp,
        steps=steps,
        workdir=workdir,
        log=lambda msg: _say(ctx, msg),
    )
    table = Table(
        title=f"dp={dp} x tp={tp} -> dp={to_dp} x tp={to_tp}, {steps}+{steps} steps, resumed "
        f"from the checkpoint alone, vs. {2 * steps} uninterrupted",
        show_edge=False,
    )
    table.add_column("param")
    table.add_column("shape")
    table.add_column("max abs diff", justify="right")
    table.add_column("bitwise equal")
    for row in result.rows:
        table.add_row(
            row.name,
            "x".join(map(str, row.shape)),
            f"{row.max_abs_diff:.3g}",
            "yes" if row.bitwise_equal else "NO",
        )
    console = _out()
    console.print(table)
    if result.kept:
        console.print(f"checkpoints in {result.checkpoint.parent}", markup=False)
    else:
        console.print("checkpoints removed (--dir DIR keeps them)", markup=False)
    if not result.ok:
        raise typer.Exit(PROBLEM)


def main() -> None:
    """Console-script entry point: SIGINT, SIGTERM and SIGHUP (unless ignored, as under
    ``nohup``) interrupt the command as Ctrl-C does; see :class:`_Group`."""
    for signum in _STOP_SIGNALS:
        if signum is not None and signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _stop)
    app()


if __name__ == "__main__":
    main()
