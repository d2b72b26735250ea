"""``doctor``: the silent failures a checkpoint's values show, found by reading them.

Checksums prove the bytes are the ones saved, not that the state saved was right. The doctor
reads every stored tensor of a checkpoint, file by file (rank by rank), one piece at a time in
chunks of :data:`CHUNK` elements (memory: one piece and one chunk's float64 copy), and reports
(:class:`~muonckpt.offline.inspection.Diagnosis`):

* NaN and Inf counts per tensor, naming the ranks whose pieces hold them (a checkpoint rebuilt
  from a bad replica: Megatron-LM #5281);
* momentum buffers that are all zero (a restart in disguise: KellerJordan/Muon #46, where
  ``state_dict()`` on one rank misses the momentum it does not own);
* a Muon group whose momentum buffers all have a norm of about 1 (normalized in place:
  torch.optim.Muon with bf16 params and ``nesterov=False``);
* step counts that disagree between the manifest, the groups and the params' own;
* state that does not cover its tensors (held by fewer ranks than the layout says);
* against another checkpoint of the run (``against``): momentum whose norm jumped by more than
  :data:`JUMP` (a resume that lost state), and the params that did not move.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import storage
from ..events import logged
from ..files.pieces import PieceReader, open_checkpoint
from ..format import kinds
from ..format.manifest import PER_RANK, Manifest
from ..format.names import PARAM_KEY
from .inspection import Compared, Diagnosis, Finding, TensorHealth

CHUNK = 1 << 20
"""Elements turned into float64 at a time."""
UNIT_NORM = 0.01
"""How far from 1 a normalized momentum's norm may be (torch's bf16 case: 0.9997)."""
JUMP = 10.0
"""The factor between two checkpoints' momentum norms that is a jump, not training."""
MOMENTUM_KEYS = frozenset(kinds.MUON_STATE_KEYS)

if TYPE_CHECKING:
    import torch


@dataclass
class _Tally:
    """What one stored tensor's pieces showed so far."""

    dtype: str
    numel: int = 0
    nan: int = 0
    inf: int = 0
    squares: float = 0.0
    nonzero: bool = False
    ranks: list[int] = field(default_factory=list)
    bad_ranks: list[int] = field(default_factory=list)

    def health(self, param: str, key: str) -> TensorHealth:
        return TensorHealth(
            param,
            key,
            self.dtype,
            self.numel,
            self.nan,
            self.inf,
            math.sqrt(self.squares),
            not self.nonzero,
            tuple(self.ranks),
            tuple(self.bad_ranks),
        )


@logged("doctor")
def doctor(
    path: str | os.PathLike[str], *, against: str | os.PathLike[str] | None = None
) -> Diagnosis:
    """Read every value of the checkpoint at ``path`` and report what a resume from it would
    silently get wrong (this module's list); with ``against``, another checkpoint of the same
    run, also the momentum that jumped between them and the params that did not move.
    ``Diagnosis.findings`` is empty for a healthy checkpoint."""
    files, manifest = open_checkpoint(path)
    tensors = _tensors(files, manifest)
    findings = [
        Finding("coverage", None, None, problem) for problem in manifest.coverage_problems()
    ]
    findings += _value_findings(tensors)
    findings += _normalized(manifest, tensors)
    findings += _steps(manifest)
    if against is not None:
        compared = _compared(tensors, _tensors(*open_checkpoint(against)))
        findings += _jumps(compared)
        return Diagnosis(str(path), tuple(tensors), tuple(findings), str(against), tuple(compared))
    return Diagnosis(str(path), tuple(tensors), tuple(findings))


def _tensors(files: storage.CheckpointFiles, manifest: Manifest) -> list[TensorHealth]:
    """Every stored tensor's health, its pieces read file by file."""
    import torch

    ranks = {f.name: r for r, f in enumerate(manifest.files)} if manifest.kind == PER_RANK else {}
    tallies: dict[tuple[str, str], _Tally] = {}
    with PieceReader(files, manifest, reuse_outputs=1) as reader:
        for piece in manifest.pieces:  # file by file: each index lists one file's pieces
            entry = manifest.param(piece.param)
            dtype = entry.dtype_of(piece.key)
            tally = tallies.setdefault((piece.param, piece.key), _Tally(dtype))
            data = reader.gather([piece], entry, piece.key, piece.region)
            values = storage.tensor_of_bytes(data, dtype)
            before = tally.nan + tally.inf
            for chunk in _chunks(values):
                wide = chunk.double()
                finite = torch.isfinite(wide)
                tally.nan += int(torch.isnan(wide).sum())
                tally.inf += int((~finite & ~torch.isnan(wide)).sum())
                kept = wide[finite]
                tally.squares += float((kept * kept).sum())
                tally.nonzero = tally.nonzero or bool((kept != 0).any())
            tally.numel += values.numel()
            rank = ranks.get(piece.file, 0)
            if rank not in tally.ranks:
                tally.ranks.append(rank)
            if tally.nan + tally.inf > before and rank not in tally.bad_ranks:
                tally.bad_ranks.append(rank)
    return [tally.health(param, key) for (param, key), tally in tallies.items()]


def _chunks(values: torch.Tensor) -> Iterator[torch.Tensor]:
    """``values``, flat, :data:`CHUNK` elements at a time."""
    flat = values.reshape(-1)
    for start in range(0, flat.numel(), CHUNK):
        yield flat[start : start + CHUNK]


def _value_findings(tensors: list[TensorHealth]) -> list[Finding]:
    """NaN / Inf counts, and momentum that is all zero."""
    found = []
    for t in tensors:
        if t.nan or t.inf:
            ranks = ", ".join(map(str, t.bad_ranks))
            found.append(
                Finding(
                    "nan-inf",
                    t.param,
                    t.key,
                    f"{t.nan} NaN and {t.inf} Inf of {t.numel} elements (rank {ranks})",
                )
            )
        if t.key in MOMENTUM_KEYS and t.all_zero and t.numel:
            found.append(
                Finding(
                    "zero-momentum",
                    t.param,
                    t.key,
                    "momentum is all zero: a resume that restarted it (state a rank's "
                    "state_dict() did not hold?)",
                )
            )
    return found


def _normalized(manifest: Manifest, tensors: list[TensorHealth]) -> list[Finding]:
    """Muon groups whose every momentum buffer has a norm of about 1."""
    by_param = {t.param: t for t in tensors if t.key in MOMENTUM_KEYS and t.numel > 1}
    found = []
    for number, group in enumerate(manifest.groups):
        kind = kinds.GroupKind.from_json(group.optimizer) if group.optimizer else None
        if kind is None or kind.role != "muon":
            continue
        held = [
            by_param[e.name] for e in manifest.params if e.group == number and e.name in by_param
        ]
        if held and all(abs(t.norm - 1.0) <= UNIT_NORM for t in held):
            norms = ", ".join(f"{t.param!r} {t.norm:.4f}" for t in held[:4])
            found.append(
                Finding(
                    "normalized-momentum",
                    held[0].param,
                    held[0].key,
                    f"every momentum buffer of group {number} ({kind.optimizer}) has a norm of "
                    f"about 1 ({norms}): normalized in place, not accumulated (torch.optim.Muon "
                    "with bf16 params and nesterov=False does this)",
                )
            )
    return found


def _steps(manifest: Manifest) -> list[Finding]:
    """Step counts that disagree: the job's own (the manifest's and each group's) with each
    other, and a param's own count above them. A param's count below the job's is no problem:
    torch's optimizers count a param's steps only when it had a gradient."""
    jobs: dict[str, float] = {}
    if manifest.recorded_step is not None:
        jobs["the manifest"] = manifest.recorded_step
    for number, group in enumerate(manifest.groups):
        step = group.hyperparams.get("step")
        if isinstance(step, int | float):
            jobs[f"group {number}"] = step
    params: dict[str, float] = {}
    for entry in manifest.params:
        if "step" in entry.scalars:
            value = entry.scalars["step"].value
            if isinstance(value, int | float):
                params[f"param {entry.name!r}"] = value
    ceiling = max(jobs.values(), default=max(params.values(), default=0))
    ahead = {where: value for where, value in params.items() if value > ceiling}
    if len(set(jobs.values())) <= 1 and not ahead:
        return []
    counts = {**jobs, **ahead}
    shown = "; ".join(f"{where} {value:g}" for where, value in list(counts.items())[:8])
    return [Finding("steps", None, None, f"step counts disagree: {shown}")]


def _compared(now: list[TensorHealth], before: list[TensorHealth]) -> list[Compared]:
    """Each tensor both checkpoints hold, its norm in each."""
    earlier = {(t.param, t.key): t for t in before}
    return [
        Compared(t.param, t.key, earlier[t.param, t.key].norm, t.norm)
        for t in now
        if (t.param, t.key) in earlier
    ]


def _jumps(compared: list[Compared]) -> list[Finding]:
    """Momentum whose norm jumped between two checkpoints; params none of which moved (their
    norms all equal)."""
    found = [
        Finding(
            "momentum-jump",
            c.param,
            c.key,
            f"momentum norm {c.norm_before:.4g} -> {c.norm:.4g} (x{c.ratio:.3g}): a resume that "
            "lost state?",
        )
        for c in compared
        if c.key in MOMENTUM_KEYS and c.norm_before > 0 and (c.ratio > JUMP or c.ratio < 1 / JUMP)
    ]
    params = [c for c in compared if c.key == PARAM_KEY]
    if params and all(c.norm == c.norm_before for c in params):
        found.append(Finding("params-unmoved", None, PARAM_KEY, "no param moved between them"))
    return found
