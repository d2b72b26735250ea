"""torchtitan's checkpoints of its DistMuon in and out (torchtitan 0.3.0,
``torchtitan/distributed/flex_shard/dist_muon.py``).

torchtitan's ``CheckpointManager`` writes DCP to ``<folder>/step-N``: the model's fqns at the top
level (buffers too), ``optimizer.state.<fqn>.<key>`` (DistMuon's ``momentum_buffer``, 3-D for
expert params; AdamW's ``exp_avg``, ``exp_avg_sq`` and a 0-d float32 ``step``),
``optimizer.param_groups.<fqn>.<setting>`` (each setting a pickled value: read through
``torch.load(weights_only=True)``, which runs no code), and the job's other states,
``lr_scheduler.*``, ``dataloader.*``, ``train_state.*``. ``get_state_dict`` + ``dcp.save``
of ``{"model": ..., "optim": ...}`` writes ``model.<fqn>``, ``optim.state.<fqn>.<key>`` and
``optim.param_groups.<i>.<setting>`` instead. Both are read by :func:`from_torchtitan` through
:func:`muonckpt.interop.dcp.from_dcp`;
:func:`to_torchtitan` writes what ``CheckpointManager``
loads with DistMuon, at any world size, through :func:`muonckpt.interop.dcp.to_dcp`.

DistMuon keeps EMA-form momentum with Nesterov by default (``momentum_buffer.lerp_(grad,
1 - momentum)``, then ``lerp(grad, buffer, momentum)`` when ``nesterov``), as torch.optim.Muon
does, and torch's lr rules (``adjust_lr_fn``).
"""

from __future__ import annotations

import os
import re
from functools import partial
from pathlib import Path

from ...errors import CheckpointError
from ...files.progress import Progress
from ...storage import access
from .. import dcp
from ..dcp import metadata as dcp_metadata
from ..foreign import Conversion
from . import job_state

__all__ = [
    "JOB_STATES",
    "from_torchtitan",
    "is_torchtitan",
    "step_dir",
    "to_torchtitan",
]

SOURCE = "torchtitan"
JOB_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
"""The states ``CheckpointManager`` saves beside the model, by their first name component."""
_STEP = re.compile(r"step-(\d+)")
LAYOUTS = {"optimizer.": ("", "checkpoint manager"), "optim.": ("model.", "get_state_dict")}
"""The optimizer's prefix -> the model's, and the layout's name."""


def _steps(root: Path) -> list[tuple[int, Path]]:
    """``root``'s ``step-N`` DCP directories, by N."""
    if not access.is_dir(root):
        return []
    found = [(_STEP.fullmatch(n), root / n) for n in access.list_names(root)]
    return sorted((int(m.group(1)), p) for m, p in found if m and dcp_metadata.is_dcp(p))


def is_torchtitan(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a ``CheckpointManager`` folder: not DCP itself, holding ``step-N``
    DCP directories (files' presence only; a ``step-N`` directory is plain DCP: ``--from
    torchtitan`` reads it)."""
    root = Path(path)
    return not dcp_metadata.is_dcp(root) and bool(_steps(root))


def step_dir(path: str | os.PathLike[str]) -> Path:
    """The DCP directory ``path`` names: itself, or a ``CheckpointManager`` folder's newest
    ``step-N``."""
    root = Path(path)
    if dcp_metadata.is_dcp(root):
        return root
    steps = _steps(root)
    if not steps:
        raise CheckpointError(
            "neither a DCP checkpoint (.metadata) nor a torchtitan checkpoint folder of step-N "
            "directories",
            path=root,
        )
    return steps[-1][1]


def from_torchtitan(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    source: str = SOURCE,
    to: str | None = None,
    model_buffers: bool = False,
    split_experts: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> Conversion:
    """Write torchtitan's checkpoint ``src`` (a ``step-N`` directory, or the folder of them:
    its newest) as a consolidated muonckpt checkpoint at ``dst``.

    ``to``: the muonckpt family the state is converted for (``torch``, ``packaged``,
    ``keller-jordan``); None keeps DistMuon's groups (``torchtitan.DistMuon``, EMA form), which
    :func:`muonckpt.load` converts for any Muon. The layout (``CheckpointManager``'s or
    ``get_state_dict``'s) is told by the optimizer's prefix. ``model_buffers``: carry the
    model's tensors no optimizer holds (buffers) into the model file; without it they are left
    out, each named. ``split_experts``: each 3-D expert param becomes one 2-D param per
    expert, ``<fqn>.<e>`` (:func:`muonckpt.format.stacked.split_stacked`), as a model resumed
    in torch.optim.Muon or the packaged Muon holds them (each refuses a 3-D param). The job's
    other states (``lr_scheduler``, ``dataloader``, ``train_state``) are carried in the
    output's ``extra`` (:mod:`.job_state`), the step its ``step-N``.
    """
    if source != SOURCE:
        raise CheckpointError(f"torchtitan's reader reads {SOURCE} checkpoints, not {source!r}")
    directory = step_dir(src)
    index = dcp_metadata.read_index(directory)
    items = [*index.tensors, *index.values]
    prefix = next(
        (p for p in LAYOUTS if any(i.startswith(p + "param_groups.") for i in items)), None
    )
    if prefix is None:
        raise CheckpointError(
            "holds no optimizer.param_groups.* (CheckpointManager) nor optim.param_groups.* "
            "(get_state_dict) items: not a torchtitan checkpoint with its optimizer",
            path=directory / dcp_metadata.METADATA_NAME,
        )
    model_prefix, layout = LAYOUTS[prefix]
    report = dcp.from_dcp(
        directory,
        dst,
        source=SOURCE,
        to=to,
        model_prefix=model_prefix,
        optimizer_prefix=prefix,
        job_states=JOB_STATES if not model_prefix else None,
        model_others=model_buffers,
        split_experts=split_experts,
        overwrite=overwrite,
        progress=progress,
        job_state=partial(job_state.read, step=_step_of(directory)),
    )
    return Conversion(report.path, f"torchtitan {layout}", report.left_out, report.converted)


def _step_of(directory: Path) -> int | None:
    """The step of a ``step-N`` directory (None for a DCP directory of another name)."""
    match = _STEP.fullmatch(directory.name)
    return int(match[1]) if match else None


def to_torchtitan(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str = SOURCE,
    merge_experts: bool | None = None,
    progress: Progress | None = None,
) -> Conversion:
    """Write the muonckpt checkpoint ``src`` as a ``step-N`` directory ``dst`` that torchtitan's
    ``CheckpointManager`` loads with DistMuon and AdamW at any world size: the model (with the
    buffers the checkpoint carries), ``optimizer.state.*`` with DistMuon's EMA momentum and
    AdamW's 0-d float32 steps, and every setting of ``optimizer.param_groups.<fqn>.*`` that
    torchtitan's groups have, and the job's own state a conversion from torchtitan carried
    (``lr_scheduler``, ``train_state``, ``dataloader``: :mod:`.job_state`); without it, the
    loading job names them in ``CheckpointManager.Config.exclude_from_loading``. The experts a
    conversion with ``split_experts`` made one param each of (``<fqn>.0`` ... ``<fqn>.<E-1>``)
    are stacked again, ``<fqn>`` of shape (E, m, n), as DistMuon's job holds them;
    ``merge_experts`` as :func:`muonckpt.interop.to_dcp`'s (None: the splits the checkpoint
    records; True: else by name, a checkpoint with none refused; False: none).
    ``progress``: told the bytes and tensors written."""
    report = dcp.to_dcp(
        src,
        dst,
        to=to,
        layout="torchtitan",
        merge_experts=merge_experts,
        progress=progress,
        job_state=(job_state.NAME, job_state.values),
    )
    return Conversion(
        report.path, "torchtitan checkpoint manager", report.left_out, report.converted
    )
