"""What the command line prints: progress, summary lines, and the tables of ``inspect``,
``diff`` and ``demo``. Every text read from a checkpoint is printed with its control
characters escaped (:func:`printable`), never as rich markup."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..settings import human_size

if TYPE_CHECKING:
    from ..demo import DemoResult
    from ..interop import Conversion
    from ..offline import Diagnosis, DiffRow, Progress, Summary

TABLE_ROWS = 2000
"""``inspect`` and ``diff`` draw a table up to this many rows, plain tab-separated lines
beyond."""

DIFF_COLUMNS = ("param", "state key", "max abs", "max rel", "equal")


def printable(text: str) -> str:
    """``text`` with its control characters (terminal escape codes among them) written as
    escapes, so that a name read from a checkpoint cannot drive the terminal; newlines kept."""
    return "".join(
        c if c.isprintable() or c == "\n" else c.encode("unicode_escape").decode() for c in text
    )


def stderr_line(text: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(printable(text), markup=False)


def stdout() -> Console:
    """Standard output: its tables fold at the terminal's width; each text line is printed with
    ``soft_wrap=True``, never wrapped, so that a path in it reaches a pipe or a log whole."""
    return Console(highlight=False, soft_wrap=False)


def is_quiet(ctx: typer.Context) -> bool:
    return bool((ctx.obj or {}).get("quiet"))


def also_quiet(ctx: typer.Context, quiet: bool) -> None:
    """A command's own --quiet, the same as the global one."""
    if quiet:
        ctx.obj = {**(ctx.obj or {}), "quiet": True}


def say(ctx: typer.Context, message: str) -> None:
    """A summary line on stderr, never wrapped (a log reads it whole); none under --quiet."""
    if not is_quiet(ctx):
        Console(stderr=True, highlight=False, soft_wrap=True).print(message, markup=False)


@contextmanager
def progress_bar(ctx: typer.Context, what: str) -> Iterator[Progress | None]:
    """Progress on stderr unless --quiet: a rich bar (bytes, tensors, rate, ETA) on a terminal,
    else lines a log reads well (:class:`muonckpt.ProgressLines`: every 10 s, and a last one
    with the total and the rate)."""
    if is_quiet(ctx):
        yield None
        return
    if not sys.stderr.isatty():
        from .. import ProgressLines

        yield ProgressLines(what)
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


def written(path: str | Path, info: Summary) -> str:
    """The line saying what a rewrite wrote at ``path``."""
    totals, topo = info.totals, info.topology
    return (
        f"wrote {path}: {info.kind}, dp={topo.get('dp')} x tp={topo.get('tp')}, "
        f"{totals.files} file(s), {human_size(totals.file_bytes)}"
    )


def wrote_foreign(report: Conversion, title: str) -> str:
    """The line saying what a conversion to the foreign format ``title`` wrote."""
    files, size = report.written or (0, 0)
    return f"wrote {report.path}: {title}, {files} file(s), {human_size(size)}"


def say_conversion(ctx: typer.Context, title: str, report: Conversion) -> None:
    """What a conversion from or to the foreign format ``title`` (``DCP``) read or wrote,
    converted and left out."""
    say(ctx, f"{report.path}: {title} layout {report.layout}")
    for line in report.converted:
        say(ctx, f"converted {printable(line)}")
    for line in report.left_out:
        say(ctx, f"left out {printable(line)}")


def print_summary(info: Summary, wide: bool) -> None:
    """``inspect``: the checkpoint's lines, then a table of its params (names folded at the
    terminal's width, never cut; ``wide``: one line each), then its totals. Its lines are never
    wrapped (the terminal folds them, a pipe reads them whole)."""
    console, lines = stdout(), Console(highlight=False, soft_wrap=True)
    topo = info.topology
    lines.print(
        f"{info.path}: {info.kind} checkpoint (format {info.format_version}), "
        f"topology dp={topo.get('dp')} x tp={topo.get('tp')}, step {info.step}",
        markup=False,
    )
    extra = info.extra
    if extra is not None and extra.values is not None:
        lines.print(f"extra: {json.dumps(extra.values)}", markup=False)
    if extra is not None and extra.ranks:
        shown = json.dumps(extra.rank_0_values)
        lines.print(f"rank_extra: {extra.ranks} ranks, rank 0: {shown}", markup=False)
    for g, group in enumerate(info.groups):
        hyper = ", ".join(f"{k}={v}" for k, v in group.hyperparams.items())
        lines.print(f"group {g}: {hyper}", markup=False)
    columns = ("param", "shape", "dtype", "tp split", "group", "state keys", "values", "bytes")
    rows = [
        (
            printable(p.name),
            "x".join(map(str, p.shape)) or "scalar",
            ", ".join(sorted({d for k, d in p.dtypes.items() if k != "param"})) or "-",
            str(p.tp_split_dim) if p.tp_split_dim >= 0 else "-",
            str(p.group),
            printable(", ".join(_state_key(p.state_shapes, k) for k in p.state_keys)) or "(none)",
            p.value_dtype or "-",
            human_size(p.bytes),
        )
        for p in info.params
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
    model = info.model
    if model is not None:
        tied = ", ".join(f"{a} = {n}" for a, n in model.aliases.items()) or "none"
        others = ", ".join(model.tensors) or "none"
        lines.print(printable(f"model file also holds: {others}; tied names: {tied}"), markup=False)
    t = info.totals
    lines.print(
        f"total: {t.params} params ({t.values} with saved values), {t.tensors} state "
        f"tensors, {human_size(t.bytes)} of data in {t.files} file(s) "
        f"({human_size(t.file_bytes)}, {t.pieces} pieces)",
        markup=False,
    )


def _widest(console: Console, table: Table) -> int:
    """The width at which ``table`` needs no wrapping."""
    return max(
        console.width, console.measure(table, options=console.options.update(width=1 << 20)).maximum
    )


def _diff_cells(r: DiffRow) -> tuple[str, ...]:
    """One diff row as printable text cells."""
    verdict = "bitwise" if r.bitwise else "yes" if r.equal else "NO"
    if r.note:
        verdict = f"{verdict}: {r.note}" if r.max_abs is not None or r.equal else r.note
    return (
        printable(r.param),
        printable(r.key or "-"),
        "-" if r.max_abs is None else f"{r.max_abs:.3g}",
        "-" if r.max_rel is None else f"{r.max_rel:.3g}",
        printable(verdict),
    )


def print_diff(rows: Iterable[DiffRow], only_differences: bool) -> int:
    """``diff``: its rows as they come (a table, plain tab-separated lines past
    :data:`TABLE_ROWS`), then the summary line; how many rows differ."""
    console = stdout()
    kept: list[tuple[str, ...]] = []
    total = differ = 0
    streaming = False  # past TABLE_ROWS rows: plain tab-separated lines, as they come
    for r in rows:
        total += 1
        differ += not r.equal
        if only_differences and r.equal:
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
        console.print(f"{differ} of {total} row(s) differ", markup=False, soft_wrap=True)
    else:
        console.print(f"all {total} row(s) equal", markup=False, soft_wrap=True)
    return differ


def print_demo(result: DemoResult, title: str) -> None:
    """``demo``: each param of the resumed run against the uninterrupted one."""
    table = Table(title=title, show_edge=False)
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
    console = stdout()
    console.print(table)
    if result.kept:
        console.print(f"checkpoints in {result.checkpoint.parent}", markup=False, soft_wrap=True)
    else:
        console.print("checkpoints removed (--dir DIR keeps them)", markup=False, soft_wrap=True)


def _state_key(shapes: Mapping[str, tuple[str, tuple[int, ...]]], key: str) -> str:
    """A state key as inspect lists it: with its rule and shape where it is not the param's
    (``second_momentum_buffer (row 16x1)``)."""
    if key not in shapes:
        return key
    rule, shape = shapes[key]
    return f"{key} ({rule} {'x'.join(map(str, shape))})"


def print_diagnosis(found: Diagnosis) -> None:
    """What ``doctor`` found: one ``problem:`` line each, then a count (or ``ok:``)."""
    console = stdout()
    if found.against is not None:
        momentum = [c.ratio for c in found.compared if c.key == "momentum_buffer"]
        params = [c for c in found.compared if c.key == "param"]
        moved = sum(c.norm != c.norm_before for c in params)
        ratios = f"x{min(momentum):.3g} to x{max(momentum):.3g}" if momentum else "none held"
        console.print(
            f"against {found.against}: momentum norm ratios {ratios}; "
            f"{moved} of {len(params)} params moved",
            markup=False,
            soft_wrap=True,
        )
    if found.model is not None:
        equal = sum(c.equal for c in found.model_compared)
        console.print(
            f"against model {found.model}: {equal} of {len(found.model_compared)} params equal",
            markup=False,
            soft_wrap=True,
        )
    if found.healthy:
        console.print(
            f"ok: {found.path}: {len(found.tensors)} tensors, no problem found",
            markup=False,
            soft_wrap=True,
        )
        return
    for finding in found.findings:
        where = " ".join(
            part
            for part in (
                f"param {finding.param!r}" if finding.param else "",
                f"key {finding.key!r}" if finding.key else "",
            )
            if part
        )
        text = f"{finding.check}: {where + ': ' if where else ''}{finding.message}"
        console.print(f"problem: {printable(text)}", markup=False, soft_wrap=True)
    console.print(f"{len(found.findings)} problem(s) in {found.path}", markup=False, soft_wrap=True)
