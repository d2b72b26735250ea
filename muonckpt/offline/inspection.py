"""What the offline inspectors return: a checkpoint's :class:`Summary` (``offline.summarize``,
``muonckpt inspect``), the rows of a comparison, :class:`DiffRow` (``offline.diff``,
``muonckpt diff``), and what ``doctor`` found, :class:`Diagnosis`.

Pure, frozen values read from manifests; :meth:`Summary.to_json` is what ``inspect --json``
prints, with the keys it always had.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParamSummary:
    """One param: its shape, stored dtypes (per key), state keys and bytes of data."""

    name: str
    shape: tuple[int, ...]
    dtypes: Mapping[str, str]
    """Stored dtype per tensor key (``param`` among them where the params are saved)."""
    value_dtype: str | None
    """The dtype of the param's saved value; None where it was not saved."""
    scalars: Mapping[str, Any]
    """Scalar state values (a step count), by key."""
    tp_split_dim: int
    """The dimension TP splits; -1 for an unsplit param."""
    group: int
    state_keys: tuple[str, ...]
    bytes: int
    """Bytes of its tensors (state and saved value)."""
    state_shapes: Mapping[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    """(version 5) Each state tensor not shaped like the param: its rule and full shape."""


@dataclass(frozen=True)
class GroupSummary:
    """One param group: its settings and its params' names."""

    hyperparams: Mapping[str, Any]
    params: tuple[str, ...]


@dataclass(frozen=True)
class ExtraSummary:
    """The training job's own state: ``extra``'s values (each tensor written ``"<tensor DTYPE
    [shape]>"``), and how many ranks saved ``rank_extra``, with rank 0's values."""

    values: Any
    ranks: int
    rank_0_values: Any


@dataclass(frozen=True)
class ModelSummary:
    """What the model file holds besides the optimizer's params (``save(..., model=)``)."""

    tensors: Mapping[str, tuple[int, ...]]
    """Other tensors (buffers) by name, with their shapes."""
    aliases: Mapping[str, str]
    """Tied names: alias -> the name stored."""


@dataclass(frozen=True)
class Totals:
    params: int
    tensors: int
    """State tensors."""
    values: int
    """Params with a saved value."""
    bytes: int
    """Bytes of tensor data."""
    file_bytes: int
    files: int
    pieces: int


@dataclass(frozen=True)
class Summary:
    """A checkpoint as ``muonckpt inspect`` shows it, read from its manifest alone."""

    path: str
    kind: str
    """``per-rank`` or ``consolidated``."""
    format_version: int
    topology: Mapping[str, int]
    """The topology it was saved at: ``{"dp": .., "tp": ..}``."""
    step: int | None
    extra: ExtraSummary | None
    groups: tuple[GroupSummary, ...]
    params: tuple[ParamSummary, ...]
    model: ModelSummary | None
    totals: Totals

    def to_json(self) -> dict[str, Any]:
        """As JSON values (what ``inspect --json`` prints)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DiffRow:
    """One comparison of two checkpoints: a tensor (param and key), a scalar, a group's
    settings, a model-file tensor, a tree of the job's state, or the step."""

    param: str
    key: str | None
    max_abs: float | None = None
    """The largest absolute difference (B converted where the row's ``note`` says so)."""
    max_rel: float | None = None
    """The largest difference relative to B."""
    equal: bool = False
    """Within the tolerances (``atol + rtol * |b|``; NaNs equal NaNs)."""
    bitwise: bool = False
    note: str | None = None
    """Why the row differs or was not compared, or what was converted; None: nothing to say."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TensorHealth:
    """What ``doctor`` read of one stored tensor (a param's state key, or ``param``)."""

    param: str
    key: str
    dtype: str
    numel: int
    nan: int
    inf: int
    norm: float
    """The Frobenius norm of its finite elements."""
    all_zero: bool
    ranks: tuple[int, ...]
    """The ranks whose files hold its pieces (0 in a consolidated checkpoint)."""
    bad_ranks: tuple[int, ...]
    """Those whose pieces hold a NaN or an Inf."""


@dataclass(frozen=True)
class Finding:
    """One thing ``doctor`` found wrong: which check, where (None: the whole checkpoint)."""

    check: str
    """``nan-inf``, ``zero-momentum``, ``normalized-momentum``, ``momentum-form``, ``steps``,
    ``coverage``, ``momentum-jump``, ``params-unmoved`` or ``model``."""
    param: str | None
    key: str | None
    message: str


@dataclass(frozen=True)
class Compared:
    """One tensor in two checkpoints of a run (``doctor --against``): its norm in each."""

    param: str
    key: str
    norm_before: float
    """In the other checkpoint (``against``)."""
    norm: float

    @property
    def ratio(self) -> float:
        """``norm / norm_before`` (inf from a zero norm to another)."""
        if self.norm_before == 0:
            return 1.0 if self.norm == 0 else float("inf")
        return self.norm / self.norm_before


@dataclass(frozen=True)
class ModelCompared:
    """One param the checkpoint holds beside the model file's tensor of its name
    (``doctor --model``); a shape that differs is not compared element by element."""

    param: str
    tensor: str
    """Its name in the model file."""
    dtype: str
    model_dtype: str
    shape: tuple[int, ...]
    model_shape: tuple[int, ...]
    differing: int
    """Elements that differ, the checkpoint's cast to the model file's dtype (NaN equal NaN)."""
    max_abs: float
    """The largest absolute difference of those (inf where one side is not finite)."""

    @property
    def equal(self) -> bool:
        return self.shape == self.model_shape and not self.differing


@dataclass(frozen=True)
class Diagnosis:
    """What ``doctor`` found of a checkpoint: every tensor's health and the findings (none:
    healthy); with ``against``, every tensor's norm in both."""

    path: str
    tensors: tuple[TensorHealth, ...]
    findings: tuple[Finding, ...]
    against: str | None = None
    compared: tuple[Compared, ...] = ()
    model: str | None = None
    """The model file compared (``doctor --model``)."""
    model_compared: tuple[ModelCompared, ...] = ()

    @property
    def healthy(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        """As JSON values (what ``doctor --json`` prints)."""
        return {**dataclasses.asdict(self), "healthy": self.healthy}
