"""The options several commands share, and sizes as they are written (``5GB``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

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


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``"1024"`` -> 1024."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
    if not match or (match.group(2) or "").upper() not in _UNITS:
        raise typer.BadParameter(f"{text!r} is not a size like 5GB, 500MB, 64MiB or 1048576")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if size <= 0:
        raise typer.BadParameter(f"{text!r} is not a positive size")
    return size


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
