"""The options several commands share, and sizes as they are written (``5GB``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import ArgumentError
from ..settings import MAX_LARGE_WORLD, MAX_WORLD, local_path, parse_size


def size_parameter(text: str) -> int:
    """A size option's value (``5GB``, ``500MiB``, ``1048576``), read as the library reads
    ``max_shard_size`` (:func:`muonckpt.settings.parse_size`)."""
    try:
        return parse_size(text)
    except ArgumentError as exc:  # a usage error (exit code 2), shown as typer shows one
        raise typer.BadParameter(str(exc)) from None


S3_SCHEME = "s3://"
"""The one URL scheme a checkpoint may have (the library parses the rest)."""


def checkpoint_source(text: str) -> str:
    """A checkpoint (or a directory of them) as typed: an ``s3://bucket/prefix`` URL (parsed,
    and refused in one line when malformed, by the library), else a local directory
    (:func:`muonckpt.settings.local_path`: every other URL refused, in one ``error:`` line as
    every library error, as ``s3://b/x`` would become ``s3:/b/x`` as a Path)."""
    return text if text.startswith(S3_SCHEME) else str(local_path(text))


Source = Annotated[
    str,
    typer.Argument(
        metavar="SRC",
        parser=checkpoint_source,
        help="Checkpoint to read: a directory or an s3://bucket/prefix URL.",
        show_default=False,
    ),
]
Dst = Annotated[
    str,
    typer.Option(
        "--output",
        "-o",
        parser=checkpoint_source,
        help="Checkpoint to write: a directory or an s3://bucket/prefix URL (a foreign "
        "format's files: a directory).",
        show_default=False,
    ),
]
Root = Annotated[
    str,
    typer.Argument(
        metavar="ROOT",
        parser=checkpoint_source,
        help="Directory holding the checkpoints, or an s3://bucket/prefix URL.",
        show_default=False,
    ),
]
Force = Annotated[bool, typer.Option("--force", "-f", help="Replace an existing output.")]
Quiet = Annotated[
    bool,
    typer.Option("--quiet", "-q", help="No progress bar and no summary line (as muonckpt -q)."),
]
BucketNumel = Annotated[
    int | None,
    typer.Option(
        "--bucket-numel",
        metavar="N",
        help="Close a ZeRO-1 bucket once it holds at least N elements "
        "(default: one bucket per buffer).",
        show_default=False,
    ),
]
ParamAlignment = Annotated[
    int,
    typer.Option(
        "--param-alignment",
        metavar="N",
        help="Start each param at a multiple of N elements from its bucket's start.",
    ),
]
BucketAlignment = Annotated[
    int,
    typer.Option(
        "--bucket-alignment",
        metavar="N",
        help="Pad each bucket to a multiple of lcm(dp, N) elements.",
    ),
]
BuffersBy = Annotated[
    str,
    typer.Option(
        "--buffers-by",
        metavar="none|group",
        help="ZeRO-1 buffers: none (every param in one buffer) or group (one buffer per "
        "optimizer param group, as the manifest records them).",
    ),
]
TpSplit = Annotated[
    list[str] | None,
    typer.Option(
        "--tp-split",
        metavar="NAME=DIM",
        help="Split dimension of a param, overriding the manifest (repeatable; a "
        "single-process checkpoint records every param as unsplit).",
    ),
]
"""``reshard``'s layout options."""

ConvertTo = Annotated[
    str | None,
    typer.Option(
        "--to",
        metavar="IMPLEMENTATION",
        help="packaged (muonckpt.optim.muon.Muon), torch (torch.optim.Muon + AdamW) or "
        "keller-jordan (muon.MuonWithAuxAdam); with --format dcp also torchtitan, dion, "
        "muon-fsdp2 or dion-normuon (dion's NorMuon, kept as it is); deepspeed writes "
        "DeepSpeed ZeRO-1/2/3 files (with --world), megatron a Megatron-Core torch_dist "
        "checkpoint (with --tp and --dp), accelerate a save_state directory, lightning a "
        "directory holding last.ckpt. Left out: reading DCP, "
        "--from's family where it is one of muonckpt's (--from torch: torch), else each group "
        "keeps its implementation (muonckpt to muonckpt, or from DeepSpeed or Megatron).",
        show_default=False,
    ),
]
Renames = Annotated[
    list[str] | None,
    typer.Option(
        "--rename",
        metavar="OLD=NEW",
        help="Replace the prefix OLD of param names by NEW (repeatable; the longest "
        "matching OLD applies): module.= strips DDP's prefix, =model. adds one.",
    ),
]
ConvertFrom = Annotated[
    str | None,
    typer.Option(
        "--from",
        metavar="IMPLEMENTATION",
        help="The implementation that wrote a DCP checkpoint SRC (required for one: DCP "
        "does not record it, and a guessed momentum form would resume wrongly): torch, "
        "torchtitan, dion, muon-fsdp2, keller-jordan, packaged, dion-normuon (dion's NorMuon, "
        "kept as it is); deepspeed for a DeepSpeed "
        "ZeRO-1/2 checkpoint, megatron for a Megatron-Core torch_dist one, accelerate for a "
        "save_state directory, lightning for a .ckpt (optional for these: their files say so, "
        "and a line says what was inferred).",
        show_default=False,
    ),
]
OutputFormat = Annotated[
    str,
    typer.Option(
        "--format",
        metavar="FORMAT",
        help="muonckpt, dcp (PyTorch Distributed Checkpoint) or deepspeed (as --to deepspeed).",
    ),
]
Layout = Annotated[
    str | None,
    typer.Option(
        "--layout",
        help="With --format dcp: torchtitan (model fqns at the top level) or recipe "
        "(model.<fqn>, DCP's get_state_dict recipe). Default: the layout SRC was read as, "
        "when it was converted from DCP (a round trip keeps it), else torchtitan.",
        show_default=False,
    ),
]
MegatronTp = Annotated[
    int | None,
    typer.Option(
        "--tp",
        min=1,
        help="With --to megatron: the tensor-parallel size Megatron loads the output at.",
        show_default=False,
    ),
]
MegatronDp = Annotated[
    int | None,
    typer.Option(
        "--dp",
        min=1,
        help="With --to megatron: the data-parallel size Megatron loads the output at.",
        show_default=False,
    ),
]
World = Annotated[
    int | None,
    typer.Option(
        "--world",
        min=1,
        help="With --to deepspeed: the number of ranks DeepSpeed loads the output at; with "
        "--to accelerate: the number of processes the job resumes at (its RNG states are "
        "written back at the number they were saved at only).",
        show_default=False,
    ),
]
ModelPrefix = Annotated[
    str | None,
    typer.Option(
        "--model-prefix",
        help="Reading DCP: the prefix of the model's fqns (default: detected, 'model.' or none).",
        show_default=False,
    ),
]
Names = Annotated[
    Path | None,
    typer.Option(
        "--names",
        metavar="FILE",
        help="Reading accelerate or Lightning: a JSON file of each optimizer's param names, "
        "one list per optimizer in the order its param groups list them (needed where the "
        "files do not say which index is which param: see docs/format.md).",
        show_default=False,
    ),
]
ModelBuffers = Annotated[
    bool,
    typer.Option(
        "--model-buffers",
        help="Reading torchtitan: carry the model's buffers (left out and named without it).",
    ),
]
ZeroStage = Annotated[
    int | None,
    typer.Option(
        "--zero-stage",
        min=1,
        max=3,
        help="With --to deepspeed: the ZeRO stage the job runs at (default: the stage the "
        "checkpoint was read from DeepSpeed at, else 2).",
        show_default=False,
    ),
]
SplitExperts = Annotated[
    bool,
    typer.Option(
        "--split-experts",
        help="Reading DCP or torchtitan: write each stacked expert param (E, m, n) of a Muon "
        "group as E params NAME.0 ... NAME.<E-1> of shape (m, n), as torch.optim.Muon and the "
        "packaged Muon hold them.",
    ),
]
MergeExperts = Annotated[
    bool,
    typer.Option(
        "--merge-experts",
        help="Writing torchtitan or DCP: the params --split-experts made (NAME.0 ... NAME.<E-1>) "
        "are stacked again by default, as the manifest records them; this also merges 2-D Muon "
        "params named so where no split is recorded (and says so), and refuses a checkpoint with "
        "none.",
    ),
]
AllowLargeWorld = Annotated[
    bool,
    typer.Option(
        "--allow-large-world",
        help=f"Write for more than {MAX_WORLD} ranks (reshard, --to deepspeed, --to megatron; "
        f"at most {MAX_LARGE_WORLD}): one file or more per rank.",
    ),
]
OptimizerPrefix = Annotated[
    str,
    typer.Option("--optimizer-prefix", help="Reading DCP: the optimizer state's prefix."),
]
"""``convert``'s options: the implementations, names, formats, and the formats' own."""
