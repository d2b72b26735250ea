"""The options several commands share, and sizes as they are written (``5GB``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..settings import WORKERS_PER_CORE, local_path, parse_size


def size_parameter(text: str) -> int:
    """A size option's value (``5GB``, ``500MiB``, ``1048576``), read as the library reads
    ``max_shard_size`` (:func:`muonckpt.settings.parse_size`)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def local_directory(text: str) -> Path:
    """A directory argument as typed, refused when it is a URL (``s3://b/x`` would become
    ``s3:/b/x`` as a Path): :func:`muonckpt.settings.local_path`, its error one ``error:``
    line as every library error."""
    return local_path(text)


Src = Annotated[
    Path,
    typer.Argument(
        metavar="SRC",
        parser=local_directory,
        help="Checkpoint directory to read.",
        show_default=False,
    ),
]
Dst = Annotated[
    Path,
    typer.Option(
        "--output",
        "-o",
        parser=local_directory,
        help="Checkpoint directory to write.",
        show_default=False,
    ),
]
Root = Annotated[
    Path,
    typer.Argument(
        metavar="ROOT",
        parser=local_directory,
        help="Directory holding the checkpoints.",
        show_default=False,
    ),
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
        f"is the same for any number. At most {WORKERS_PER_CORE} per CPU core, and never more "
        "than the output has tensors. Under torchrun leave it out: the ranks share the work.",
    ),
]
