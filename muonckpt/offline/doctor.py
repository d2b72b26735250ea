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
* a Muon group whose recorded momentum form is not the one its recorded optimizer keeps (the
  records disagree: a load would convert its momentum by the wrong factor);
* step counts that disagree between the manifest, the groups and the params' own;
* state that does not cover its tensors (held by fewer ranks than the layout says);
* against another checkpoint of the run (``against``): momentum whose norm jumped by more than
  :data:`JUMP` (a resume that lost state), the params that did not move, and (a heuristic,
  :func:`_forms_in_values`) a Muon group whose momentum norms changed by about ``1 / (1 - mu)``
  more or less than the two checkpoints' recorded forms explain: values in the other form than
  the one recorded (momentum copied between implementations without conversion).

With ``model``, a model file (one safetensors file or a Hugging Face sharded checkpoint), each
param the checkpoint holds is compared with the model file's tensor of its name, element range
by element range (:func:`_model_compared`): the params that differ (how many elements, the
largest difference, dtype and shape) and those missing on either side are problems.

A single checkpoint's values cannot tell the momentum's form: sum and EMA form differ by the
factor ``1 / (1 - mu)``, and nothing stored gives the scale of the gradients it applies to.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import storage
from ..errors import CheckpointError
from ..events import logged
from ..files.pieces import PieceReader, open_checkpoint
from ..format import kinds
from ..format.manifest import PER_RANK, GroupEntry, Manifest
from ..format.names import MANIFEST_NAME, PARAM_KEY
from ..format.renames import prefix_fix, renamer
from .inspection import Compared, Diagnosis, Finding, ModelCompared, TensorHealth

CHUNK = 1 << 20
"""Elements turned into float64 at a time."""
UNIT_NORM = 0.01
"""How far from 1 a normalized momentum's norm may be (torch's bf16 case: 0.9997)."""
JUMP = 10.0
"""The factor between two checkpoints' momentum norms that is a jump, not training."""
MOMENTUM_KEYS = frozenset(kinds.MUON_STATE_KEYS)
ADAMW_FIRST_MOMENT = "exp_avg"
FORM_MU = 0.8
"""The least momentum whose form the values decide (``1 / (1 - mu)`` at least 5): below it the
two forms differ by less than training moves a norm between two checkpoints."""
FORM_EXPONENT = 0.75
"""A group's norm ratio, beyond what its recorded forms and the gradients' drift explain, is a
form mismatch at ``(1 / (1 - mu)) ** FORM_EXPONENT`` or more (or its inverse or less): nearer
the other form's factor than its own (``x9.5`` for mu 0.95, ``x5.6`` for 0.9)."""
WARMED = 0.05
"""The earlier checkpoint's momentum is past its warm-up where ``mu ** step`` is at most this:
before it, a buffer started at zero grows towards ``1 / (1 - mu)`` times a step's gradient in
either form, which the values cannot tell from a form mismatch."""

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
    path: str | os.PathLike[str],
    *,
    against: str | os.PathLike[str] | None = None,
    model: str | os.PathLike[str] | None = None,
) -> Diagnosis:
    """Read every value of the checkpoint at ``path`` and report what a resume from it would
    silently get wrong (this module's list); with ``against``, another checkpoint of the same
    run, also the momentum that jumped between them and the params that did not move; with
    ``model``, a model file (``model.safetensors``, a ``*.safetensors.index.json`` of shards,
    or a directory holding either), the params that differ from its tensors of the same name
    and those missing on either side. ``Diagnosis.findings`` is empty for a healthy
    checkpoint."""
    files, manifest = open_checkpoint(path)
    tensors = _tensors(files, manifest)
    findings = [
        Finding("coverage", None, None, problem) for problem in manifest.coverage_problems()
    ]
    findings += _value_findings(tensors)
    findings += _normalized(manifest, tensors)
    findings += _forms_recorded(manifest)
    findings += _steps(manifest)
    by_model: tuple[ModelCompared, ...] = ()
    if model is not None:
        by_model, missing = _model_compared(files, manifest, model)
        findings += _model_findings(by_model, missing)
    compared: list[Compared] = []
    if against is not None:
        other, earlier = open_checkpoint(against)
        compared = _compared(tensors, _tensors(other, earlier))
        explained = _explained(manifest, earlier, compared)
        forms, formed = _forms_in_values(manifest, earlier, explained)
        unexplained = {name: r for name, r in explained.items() if name not in formed}
        findings += _jumps(manifest, earlier, compared, unexplained) + forms
    return Diagnosis(
        str(path),
        tuple(tensors),
        tuple(findings),
        None if against is None else str(against),
        tuple(compared),
        None if model is None else str(model),
        by_model,
    )


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


def _muon_kind(group: GroupEntry) -> kinds.GroupKind | None:
    """The kind a group records, where it is a Muon group's; None otherwise."""
    kind = kinds.GroupKind.from_json(group.optimizer) if group.optimizer else None
    return kind if kind is not None and kind.role == "muon" else None


def _normalized(manifest: Manifest, tensors: list[TensorHealth]) -> list[Finding]:
    """Muon groups whose every momentum buffer has a norm of about 1."""
    by_param = {t.param: t for t in tensors if t.key in MOMENTUM_KEYS and t.numel > 1}
    found = []
    for number, group in enumerate(manifest.groups):
        kind = _muon_kind(group)
        if kind is None:
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


def _forms_recorded(manifest: Manifest) -> list[Finding]:
    """Muon groups whose recorded momentum form is not the one their recorded optimizer keeps
    (:func:`muonckpt.format.kinds.kept_form`): a load would convert them by the wrong factor."""
    found = []
    for number, group in enumerate(manifest.groups):
        kind = _muon_kind(group)
        kept = None if kind is None else kinds.kept_form(kind.optimizer)
        if kind is None or kept is None or kind.momentum_form == kept:
            continue
        origin = f" (converted from {kind.converted_from})" if kind.converted_from else ""
        recorded = f"its momentum as {kind.momentum_form}-form" if kind.momentum_form else "no form"
        found.append(
            Finding(
                "momentum-form",
                None,
                "momentum_buffer",
                f"group {number} is recorded as {kind.optimizer}{origin}, which keeps "
                f"{kept}-form momentum, yet records {recorded}: the records disagree, and a "
                "load would convert it by the wrong factor",
            )
        )
    return found


def _explained(now: Manifest, before: Manifest, compared: list[Compared]) -> dict[str, float]:
    """Each Muon momentum's norm ratio between two checkpoints of one run (now / before)
    beyond what explains it: the factor between the two recorded momentum forms (a
    conversion's ``1 - mu``) and the gradients' drift (:func:`_drift`)."""
    drift = _drift(compared)
    explained = {}
    for c in compared:
        if c.key not in MOMENTUM_KEYS or c.norm_before <= 0 or not math.isfinite(c.ratio):
            continue
        kind = _muon_kind(now.groups[now.param(c.param).group])
        earlier = _muon_kind(before.groups[before.param(c.param).group])
        factor = 1.0
        if (
            kind
            and earlier
            and kind.momentum is not None
            and {kind.momentum_form, earlier.momentum_form} <= set(kinds.FORMS)
        ):
            factor = kinds.form_factor(earlier.momentum_form, kind.momentum_form, kind.momentum)
        explained[c.param] = c.ratio / factor / drift
    return explained


def _forms_in_values(
    now: Manifest, before: Manifest, explained: dict[str, float]
) -> tuple[list[Finding], set[str]]:
    """(A heuristic.) Muon groups whose momentum is in the other form than recorded, from two
    checkpoints of one run: the median of the group's :func:`_explained` norm ratios is about
    ``1 / (1 - mu)`` or ``1 - mu`` (:data:`FORM_EXPONENT`). Decided only for ``mu`` of at least
    :data:`FORM_MU`, with the earlier checkpoint's step past the momentum's warm-up
    (:data:`WARMED`) or both at one step; a checkpoint against the one it was converted from
    (the same step, no drift) decides it best. With the params of the groups found (their
    jump is this)."""
    step, then = _job_step(now), _job_step(before)
    found: list[Finding] = []
    formed: set[str] = set()
    for number, group in enumerate(now.groups):
        kind = _muon_kind(group)
        mu = None if kind is None else kind.momentum
        if kind is None or mu is None or mu < FORM_MU or then is None:
            continue
        if step != then and mu**then > WARMED:  # (at one step, no warm-up between them)
            continue
        ratios = [explained[name] for name in group.params if name in explained]
        if not ratios:
            continue
        beyond, other = statistics.median(ratios), 1 / (1 - mu)
        if other**-FORM_EXPONENT < beyond < other**FORM_EXPONENT:
            continue
        formed.update(group.params)
        found.append(
            Finding(
                "momentum-form",
                None,
                "momentum_buffer",
                f"group {number} ({kind.optimizer}, recorded {kind.momentum_form}-form): its "
                f"momentum norms are x{beyond:.3g} what the two checkpoints' recorded forms "
                f"and the gradients' drift explain, about x{other:.3g} or x{1 / other:.3g} "
                f"(1 / (1 - mu), mu={mu}): its values are in the other form (momentum copied "
                "between implementations without conversion?). A heuristic: a momentum's "
                "form is read from two checkpoints of one run",
            )
        )
    return found, formed


def _job_step(manifest: Manifest) -> float | None:
    """The step a checkpoint was taken at: the manifest's, else its groups' or params' most."""
    jobs, params = _step_counts(manifest)
    return max(jobs.values(), default=max(params.values(), default=None))


def _step_counts(manifest: Manifest) -> tuple[dict[str, float], dict[str, float]]:
    """The job's step counts (the manifest's, each group's) and each param's own, by where."""
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
    return jobs, params


def _steps(manifest: Manifest) -> list[Finding]:
    """Step counts that disagree: the job's own (the manifest's and each group's) with each
    other, and a param's own count above them. A param's count below the job's is no problem:
    torch's optimizers count a param's steps only when it had a gradient."""
    jobs, params = _step_counts(manifest)
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


def _drift(compared: list[Compared]) -> float:
    """How much the gradients' scale moved between two checkpoints, as the AdamW params' first
    moments show it (the median of their norm ratios); 1 where they hold none. Gradients
    shrink as a run learns (a tenth in a few hundred steps of a small model), and a Muon
    param's momentum with them."""
    drifts = [
        c.ratio
        for c in compared
        if c.key == ADAMW_FIRST_MOMENT and c.norm_before > 0 and 0 < c.norm < math.inf
    ]
    return statistics.median(drifts) if drifts else 1.0


def _jumps(
    now: Manifest, before: Manifest, compared: list[Compared], explained: dict[str, float]
) -> list[Finding]:
    """Momentum whose norm jumped between two checkpoints beyond what explains it
    (:func:`_explained`); params none of which moved (their norms all equal) between two
    checkpoints of different steps."""
    found = [
        Finding(
            "momentum-jump",
            c.param,
            c.key,
            f"momentum norm {c.norm_before:.4g} -> {c.norm:.4g} (x{c.ratio:.3g}; "
            f"x{explained[c.param]:.3g} beyond the recorded forms and the gradients' drift): "
            "a resume that lost state?",
        )
        for c in compared
        if c.param in explained
        and c.key in MOMENTUM_KEYS
        and not 1 / JUMP <= explained[c.param] <= JUMP
    ]
    params = [c for c in compared if c.key == PARAM_KEY]
    steps = _job_step(now), _job_step(before)
    moved_on = None in steps or steps[0] != steps[1]
    if params and moved_on and all(c.norm == c.norm_before for c in params):
        found.append(Finding("params-unmoved", None, PARAM_KEY, "no param moved between them"))
    return found


def _model_compared(
    files: storage.CheckpointFiles, manifest: Manifest, model: str | os.PathLike[str]
) -> tuple[tuple[ModelCompared, ...], tuple[list[str], list[str]]]:
    """Each param the checkpoint holds beside the model file's tensor of its name (the names
    as the checkpoint records them, or mapped by the one prefix that makes them the model
    file's: :func:`muonckpt.format.renames.prefix_fix`), read piece by piece and, within a
    piece, :data:`CHUNK` elements at a time; with the names only the checkpoint holds and
    those only the model file holds."""
    if not manifest.has_values:
        raise CheckpointError(
            "the checkpoint holds no param values (saved with params=False): nothing to "
            "compare with a model file",
            path=files.at(MANIFEST_NAME),
        )
    with storage.ModelWeights(model) as weights:
        held = [e.name for e in manifest.params]
        theirs = weights.names()
        fix = None if set(held) <= set(theirs) else prefix_fix(held, theirs)
        name_of = renamer(fix or {})
        records = {p: weights.record(name_of(p)) for p in held if name_of(p) in weights}
        tallies = {
            p: _ModelTally(manifest.param(p).dtype_of(PARAM_KEY), storage.torch_dtype(r.dtype))
            for p, r in records.items()
            if tuple(r.shape) == tuple(manifest.param(p).shape)
        }
        with PieceReader(files, manifest, reuse_outputs=1) as reader:
            for piece in manifest.pieces:
                tally = tallies.get(piece.param) if piece.key == PARAM_KEY else None
                if tally is None:
                    continue
                entry = manifest.param(piece.param)
                data = reader.gather([piece], entry, PARAM_KEY, piece.region)
                mine = storage.tensor_of_bytes(data, tally.dtype).reshape(-1)
                at = 0
                for lo, hi in piece.region.intervals():
                    for start in range(lo, hi, CHUNK):
                        stop = min(hi, start + CHUNK)
                        ours = mine[at + start - lo : at + stop - lo].to(tally.model_dtype)
                        tally.add(ours, weights.read(name_of(piece.param), start, stop))
                    at += hi - lo
        compared = tuple(
            ModelCompared(
                p,
                r.key,
                manifest.param(p).dtype_of(PARAM_KEY),
                r.dtype,
                tuple(manifest.param(p).shape),
                tuple(r.shape),
                tallies[p].differing if p in tallies else 0,
                tallies[p].max_abs if p in tallies else 0.0,
            )
            for p, r in records.items()
        )
        named = {name_of(p) for p in held}
        missing = [p for p in held if p not in records], [t for t in theirs if t not in named]
    return compared, missing


@dataclass
class _ModelTally:
    """What one param's pieces showed against the model file's tensor so far."""

    dtype: str
    """The checkpoint's (safetensors) dtype of its values."""
    model_dtype: torch.dtype
    differing: int = 0
    max_abs: float = 0.0

    def add(self, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        """One range of elements: ours (cast to the model file's dtype) against theirs."""
        import torch

        a, b = ours.double(), theirs.double()
        differ = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
        count = int(differ.sum())
        if count:
            self.differing += count
            self.max_abs = max(self.max_abs, float((a[differ] - b[differ]).abs().max()))


def _model_findings(
    compared: tuple[ModelCompared, ...], missing: tuple[list[str], list[str]]
) -> list[Finding]:
    """The params that differ from the model file, and the names missing on either side."""
    found = []
    for c in compared:
        if c.shape != c.model_shape:
            what = f"shape {c.shape}, the model file's {c.tensor!r} {c.model_shape}"
        elif c.differing:
            cast = "" if c.dtype == c.model_dtype else f" (as {c.model_dtype}, held as {c.dtype})"
            what = (
                f"{c.differing} elements differ from the model file's {c.tensor!r}{cast}, by up "
                f"to {c.max_abs:.4g}"
            )
        else:
            continue
        found.append(Finding("model", c.param, PARAM_KEY, what))
    only_ours, only_theirs = missing
    for names, where in (
        (only_ours, "the model file lacks"),
        (only_theirs, "the checkpoint lacks"),
    ):
        if names:
            listed = ", ".join(map(repr, names[:8])) + (
                f" and {len(names) - 8} more" if len(names) > 8 else ""
            )
            found.append(Finding("model", None, None, f"{where} {len(names)} params: {listed}"))
    return found
