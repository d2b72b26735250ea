"""Reading a checkpoint to show it: ``summarize`` (what ``muonckpt inspect`` prints) and
``diff`` / ``iter_diff`` (what ``muonckpt diff`` prints), returning the typed results of
:mod:`muonckpt.offline.inspection`.

Both read through :func:`muonckpt.files.pieces.open_checkpoint` and :class:`PieceReader`
(checksums verified on every read); ``diff`` streams its rows, one tensor pair in reused buffers at
a time, and converts momentum across implementations by the map ``load`` uses. Re-exported by
:mod:`muonckpt.offline.tools`, the offline tools' namespace.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import settings, storage
from ..errors import CheckpointError, MuonCkptError
from ..events import Event, logged
from ..files.pieces import PieceReader, open_checkpoint
from ..format import kinds
from ..format.manifest import ExtraValues, Manifest, ParamEntry, Piece, PieceIndex
from ..format.names import PARAM_KEY
from ..layout.topology import whole_region
from .inspection import (
    DiffRow,
    ExtraSummary,
    GroupSummary,
    ModelSummary,
    ParamSummary,
    Summary,
    Totals,
)

__all__ = ["DIFF_CHUNK", "diff", "iter_diff", "summarize"]


@logged("inspect")
def summarize(src: str | os.PathLike[str]) -> Summary:
    """What ``muonckpt inspect`` shows: kind, topology, step, groups, params, the model file's
    other tensors and tied names (``save(..., model=)``; None without), and totals.

    Reads only the manifest (and checks that its pieces cover every state tensor once).
    """
    checkpoint, manifest = open_checkpoint(src)
    params = tuple(
        ParamSummary(
            name=e.name,
            shape=tuple(e.shape),
            dtypes=dict(e.dtypes),
            value_dtype=e.value_dtype,
            scalars={k: v.value for k, v in e.scalars.items()},
            tp_split_dim=e.tp_split_dim,
            group=e.group,
            state_keys=tuple(e.state_keys),
            bytes=sum(
                math.prod(e.shape_of(k)) * storage.itemsize(e.dtype_of(k)) for k in e.tensor_keys
            ),
            state_shapes={k: (v.rule, v.shape) for k, v in e.state_shapes.items()},
        )
        for e in manifest.params
    )
    return Summary(
        path=str(checkpoint.location),
        kind=manifest.kind,
        format_version=manifest.format_version,
        topology=dict(manifest.topology),
        step=manifest.step,
        extra=_extra_summary(manifest),
        groups=tuple(GroupSummary(dict(g.hyperparams), tuple(g.params)) for g in manifest.groups),
        params=params,
        model=None
        if manifest.model is None
        else ModelSummary(
            tensors={e.name: tuple(e.shape) for e in manifest.model.tensors},
            aliases=dict(manifest.model.aliases),
        ),
        totals=Totals(
            params=len(params),
            tensors=sum(len(e.state_keys) for e in manifest.params),
            values=sum(e.value_dtype is not None for e in manifest.params),
            bytes=sum(p.bytes for p in params),
            file_bytes=sum(f.bytes for f in manifest.files),
            files=len(manifest.files),
            pieces=len(manifest.pieces),
        ),
    )


def _extra_summary(manifest: Manifest) -> ExtraSummary | None:
    """The job's own state for ``inspect``: ``extra``'s values, each tensor as ``"<tensor
    DTYPE [shape]>"``, and how many ranks saved ``rank_extra`` with rank 0's values so shown."""
    extra = manifest.extra
    if extra is None:
        return None

    def shown(tree: ExtraValues) -> Any:
        values = json.loads(json.dumps(tree.values))
        for t in tree.tensors:
            holder = values
            for step in t.path[:-1]:
                holder = holder[step]
            holder[t.path[-1]] = f"<tensor {t.dtype} {list(t.shape)}>"
        return values

    return ExtraSummary(
        values=None if extra.shared is None else shown(extra.shared),
        ranks=len(extra.ranks),
        rank_0_values=shown(extra.ranks[0]) if extra.ranks else None,
    )


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> list[DiffRow]:
    """Compare two checkpoints (any kinds, any topologies, any Muon implementations) as logical
    tensors: the rows of :func:`iter_diff`, as a list."""
    return list(iter_diff(a, b, atol=atol, rtol=rtol))


DIFF_CHUNK = 1 << 20
"""Elements compared at a time where two tensors are not bitwise equal (float64 temporaries
of this size, not of the whole tensor)."""


def iter_diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> Iterator[DiffRow]:
    """Compare two checkpoints (any kinds, any topologies) as logical tensors, one row at a
    time.

    One row per (param, stored key): ``max_abs`` and ``max_rel`` differences and ``equal``
    (every element within ``atol + rtol * |b|``; NaNs equal NaNs) and ``bitwise``; a row per
    scalar state value (equal or not, exactly; a step count compared wherever each side keeps
    it), and one per param group whose settings differ. A param or key on only one side, or of
    different shape or dtype, is a row with ``equal`` False and a ``note``.

    Checkpoints of different momentum forms (the packaged Muon's sum form against torch's or
    KellerJordan's EMA form) are compared as :func:`muonckpt.load` and
    :func:`muonckpt.offline.tools.convert` would resume them: B's momentum is converted into A's
    form by the same map
    (:func:`muonckpt.format.kinds.state_mapping`), and the row's ``note`` says so; groups that
    cannot be converted (different roles) are a row with ``equal`` False, never compared raw.

    Memory: one full tensor from each side at a time, in reused buffers, and temporaries of
    :data:`DIFF_CHUNK` elements; rows are yielded as they are made.
    """
    with Event("diff", f"{a} -> {b}"):
        yield from _rows(a, b, atol, rtol)


def _rows(
    a: str | os.PathLike[str], b: str | os.PathLike[str], atol: float, rtol: float
) -> Iterator[DiffRow]:
    """The rows of :func:`iter_diff`."""
    settings.tolerance(atol, "atol")
    settings.tolerance(rtol, "rtol")
    files_a, man_a = open_checkpoint(a)
    files_b, man_b = open_checkpoint(b)

    def entry(manifest: Manifest, name: str) -> ParamEntry | None:
        try:  # the manifest's own index of its params: no second dict of 100k names
            return manifest.param(name)
        except CheckpointError:
            return None

    names = itertools.chain(
        (e.name for e in man_a.params),
        (e.name for e in man_b.params if entry(man_a, e.name) is None),
    )
    pieces_a, pieces_b = man_a.pieces_of(), man_b.pieces_of()
    scales = _momentum_scales(man_a, man_b)

    def row(param: str, key: str | None, note: str | None = None, **values: Any) -> DiffRow:
        return DiffRow(param, key, note=note, **values)

    with (
        PieceReader(files_a, man_a, reuse_outputs=1) as read_a,
        PieceReader(files_b, man_b, reuse_outputs=1) as read_b,
    ):
        for name in names:
            ea, eb = entry(man_a, name), entry(man_b, name)
            if ea is None or eb is None:
                yield row(name, None, f"param only in {'A' if eb is None else 'B'}")
                continue
            if ea.shape != eb.shape:
                yield row(name, None, f"A has shape {list(ea.shape)}, B {list(eb.shape)}")
                continue
            scale = scales.get((ea.group, eb.group))
            sides = (pieces_a, pieces_b, read_a, read_b)
            yield from _tensor_rows(ea, eb, sides, scale, row, atol, rtol)
            yield from _scalar_rows(man_a, man_b, ea, eb, row)
        yield from _model_rows(man_a, man_b, read_a, read_b, row, atol, rtol)
        yield from _extra_rows(man_a, man_b, read_a, read_b, row)
    yield from _checkpoint_rows(man_a, man_b, row)


def _tensor_rows(
    ea: ParamEntry,
    eb: ParamEntry,
    sides: tuple[PieceIndex, PieceIndex, PieceReader, PieceReader],
    momentum_scale: tuple[float | str, str | None] | None,
    row: Callable[..., DiffRow],
    atol: float,
    rtol: float,
) -> Iterator[DiffRow]:
    """A param's rows of its stored tensors, one per key of either side (``sides``: each
    side's pieces and reader); B's momentum converted by ``momentum_scale``
    (:func:`_momentum_scales`'s; None: compared as stored)."""
    name, (pieces_a, pieces_b, read_a, read_b) = ea.name, sides
    keys = list(ea.tensor_keys) + [k for k in eb.tensor_keys if k not in ea.tensor_keys]
    for key in keys:
        if key not in ea.tensor_keys or key not in eb.tensor_keys:
            yield row(name, key, f"stored only in {'A' if key in ea.tensor_keys else 'B'}")
            continue
        dtype_a, dtype_b = ea.dtype_of(key), eb.dtype_of(key)
        if dtype_a != dtype_b:
            yield row(name, key, f"A is {dtype_a}, B {dtype_b}")
            continue
        if ea.shape_of(key) != eb.shape_of(key):
            yield row(
                name, key, f"A has shape {list(ea.shape_of(key))}, B {list(eb.shape_of(key))}"
            )
            continue
        scale: float | str = 1.0
        note: str | None = None
        if key == "momentum_buffer":
            scale, note = momentum_scale or (1.0, None)
        if isinstance(scale, str):  # the forms cannot be converted: never compared raw
            yield row(name, key, scale)
            continue
        whole = whole_region(math.prod(ea.shape_of(key)))
        x = read_a.gather(pieces_a[name, key], ea, key, whole)
        y = read_b.gather(pieces_b[name, key], eb, key, whole)
        yield row(name, key, note, **_compare(x, y, dtype_a, scale, atol, rtol))
        del x, y


def _checkpoint_rows(
    man_a: Manifest, man_b: Manifest, row: Callable[..., DiffRow]
) -> Iterator[DiffRow]:
    """The rows of the checkpoints as a whole: the step, and each param group's settings."""
    same_step = man_a.step == man_b.step
    note = None if same_step else f"A at step {man_a.step}, B at step {man_b.step}"
    yield row("checkpoint", "step", note, equal=same_step, bitwise=same_step)
    for g, (ga, gb) in enumerate(zip(man_a.groups, man_b.groups, strict=False)):
        if ga.hyperparams != gb.hyperparams:
            changed = sorted(
                k
                for k in set(ga.hyperparams) | set(gb.hyperparams)
                if ga.hyperparams.get(k) != gb.hyperparams.get(k)
            )
            yield row(f"group {g}", "hyperparams", f"settings differ: {changed}")
    if len(man_a.groups) != len(man_b.groups):
        yield row("groups", None, f"A has {len(man_a.groups)} param groups, B {len(man_b.groups)}")


def _model_rows(
    man_a: Manifest,
    man_b: Manifest,
    read_a: PieceReader,
    read_b: PieceReader,
    row: Callable[..., DiffRow],
    atol: float,
    rtol: float,
) -> Iterator[DiffRow]:
    """Rows of a model file's other tensors (``save(..., model=)``: buffers) and its aliases."""
    model_a, model_b = man_a.model, man_b.model
    tensors_a = {t.name: t for t in model_a.tensors} if model_a is not None else {}
    tensors_b = {t.name: t for t in model_b.tensors} if model_b is not None else {}
    for name in [*tensors_a, *(n for n in tensors_b if n not in tensors_a)]:
        ta, tb = tensors_a.get(name), tensors_b.get(name)
        if ta is None or tb is None:
            yield row(name, PARAM_KEY, f"model tensor only in {'A' if tb is None else 'B'}")
            continue
        if ta.shape != tb.shape or ta.dtype_of(PARAM_KEY) != tb.dtype_of(PARAM_KEY):
            yield row(name, PARAM_KEY, "model tensors of different shapes or dtypes")
            continue
        whole = whole_region(ta.numel)
        x = read_a.gather(_model_pieces(man_a, name), ta, PARAM_KEY, whole)
        y = read_b.gather(_model_pieces(man_b, name), tb, PARAM_KEY, whole)
        yield row(
            name,
            PARAM_KEY,
            "model tensor",
            **_compare(x, y, ta.dtype_of(PARAM_KEY), 1.0, atol, rtol),
        )
    aliases_a = model_a.aliases if model_a is not None else {}
    aliases_b = model_b.aliases if model_b is not None else {}
    if aliases_a or aliases_b:
        same = dict(aliases_a) == dict(aliases_b)
        note = None if same else f"A ties {dict(aliases_a)}, B {dict(aliases_b)}"
        yield row("model", "aliases", note, equal=same, bitwise=same)


def _model_pieces(manifest: Manifest, name: str) -> list[Piece]:
    pieces = manifest.model.pieces if manifest.model is not None else ()
    return [p for p in pieces if p.param == name]


def _extra_rows(
    man_a: Manifest,
    man_b: Manifest,
    read_a: PieceReader,
    read_b: PieceReader,
    row: Callable[..., DiffRow],
) -> Iterator[DiffRow]:
    """Rows of the job's own state (``extra``, each rank's ``rank_extra``): its JSON values
    per tree, its tensors by their bytes."""
    trees_a = dict(man_a.extra.trees()) if man_a.extra is not None else {}
    trees_b = dict(man_b.extra.trees()) if man_b.extra is not None else {}
    for what in [*trees_a, *(n for n in trees_b if n not in trees_a)]:
        ta, tb = trees_a.get(what), trees_b.get(what)
        if ta is None or tb is None:
            yield row(what, None, f"saved only in {'A' if tb is None else 'B'}")
            continue
        same = ta.values == tb.values
        note = None if same else "the values differ"
        yield row(what, "values", note, equal=same, bitwise=same)
        tensors_b = {t.path: t for t in tb.tensors}
        for tensor in ta.tensors:
            other = tensors_b.get(tensor.path)
            at = f"{what}{''.join(f'[{step!r}]' for step in tensor.path)}"
            if other is None or (other.dtype, other.shape) != (tensor.dtype, tensor.shape):
                yield row(at, None, "a tensor in A, not of this dtype and shape in B")
                continue
            same = bool(
                np.array_equal(read_a.read_extra(tensor, what), read_b.read_extra(other, what))
            )
            yield row(at, None, None if same else "the bytes differ", equal=same, bitwise=same)


def _momentum_scales(
    man_a: Manifest, man_b: Manifest
) -> dict[tuple[int, int], tuple[float | str, str | None]]:
    """(A's group, B's group) -> (factor, note) turning B's Muon momentum into A's form, by
    the map :func:`muonckpt.load` uses; the factor is the reason as a string where the groups
    cannot be compared (their roles differ). Pairs whose forms agree, or where a side does not
    record its form (format 1), are left out (compared as stored)."""
    groups_b = {e.name: e.group for e in man_b.params}
    pairs = {(e.group, groups_b[e.name]) for e in man_a.params if e.name in groups_b}
    out: dict[tuple[int, int], tuple[float | str, str | None]] = {}
    for ga, gb in pairs:
        raw_a, raw_b = man_a.groups[ga].optimizer, man_b.groups[gb].optimizer
        if not raw_a or not raw_b:
            continue
        kind_a, kind_b = kinds.GroupKind.from_json(raw_a), kinds.GroupKind.from_json(raw_b)
        if kind_a.momentum_form == kind_b.momentum_form or None in (kind_a.role, kind_b.role):
            continue
        try:
            mapping = kinds.state_mapping(kind_b, kind_a, f"of group {gb}", None)
        except MuonCkptError as exc:
            out[ga, gb] = (f"not comparable: {exc}", None)
            continue
        factor = mapping.keys.get("momentum_buffer", ("", 1.0))[1]
        out[ga, gb] = (factor, f"B converted {mapping.note}" if mapping.note else None)
    return out


def _scalar_rows(
    man_a: Manifest,
    man_b: Manifest,
    ea: ParamEntry,
    eb: ParamEntry,
    row: Callable[..., DiffRow],
) -> Iterator[DiffRow]:
    """A param's scalar rows; its step count compared as a number wherever each side keeps it
    (torch: a 0-d tensor per param, KellerJordan: an int per param, packaged: in the group)."""
    keys = set(ea.scalars) | set(eb.scalars)
    if "step" in keys and ea.state_keys and eb.state_keys:
        keys.discard("step")
        step_a, step_b = man_a.step_of(ea), man_b.step_of(eb)
        if step_a == step_b:
            yield row(ea.name, "step", None, equal=True, bitwise=True)
        else:
            yield row(ea.name, "step", f"A is {step_a!r}, B {step_b!r}")
    for key in sorted(keys):
        sa, sb = ea.scalars.get(key), eb.scalars.get(key)
        if sa is None or sb is None:
            yield row(ea.name, key, f"stored only in {'A' if sb is None else 'B'}")
        elif sa == sb:
            yield row(ea.name, key, None, equal=True, bitwise=True)
        else:
            yield row(ea.name, key, f"A is {sa.value!r}, B {sb.value!r}")


def _compare(
    x: np.ndarray, y: np.ndarray, dtype: str, scale: float, atol: float, rtol: float
) -> dict[str, Any]:
    """Raw bytes ``x`` and ``y`` (of ``dtype``; ``y`` times ``scale`` first) compared: bitwise
    by their bytes, else element by element in :data:`DIFF_CHUNK` pieces as float64."""
    if scale == 1.0 and np.array_equal(x, y):
        return {"max_abs": 0.0, "max_rel": 0.0, "equal": True, "bitwise": True}
    import torch

    tx, ty = storage.tensor_of_bytes(x, dtype), storage.tensor_of_bytes(y, dtype)
    if scale != 1.0:
        ty = ty.mul_(scale)  # in B's reused buffer, as convert scales it
    bitwise, max_abs, max_rel, close = True, 0.0, 0.0, True
    for lo in range(0, tx.numel(), DIFF_CHUNK):
        cx, cy = tx[lo : lo + DIFF_CHUNK], ty[lo : lo + DIFF_CHUNK]
        same = torch.equal(cx.view(torch.uint8), cy.view(torch.uint8))
        bitwise = bitwise and same
        if same:
            continue
        x64, y64 = cx.to(torch.float64), cy.to(torch.float64)
        delta = (x64 - y64).abs().masked_fill_(torch.isnan(x64) & torch.isnan(y64), 0.0)
        rel = delta / y64.abs().clamp_min(torch.finfo(torch.float64).tiny)
        chunk_abs, chunk_rel = float(delta.max()), float(rel.max())
        if math.isnan(chunk_abs) or math.isnan(chunk_rel):
            chunk_abs = chunk_rel = math.inf
        max_abs, max_rel = max(max_abs, chunk_abs), max(max_rel, chunk_rel)
        close = close and bool(torch.isclose(x64, y64, rtol=rtol, atol=atol, equal_nan=True).all())
    return {"max_abs": max_abs, "max_rel": max_rel, "equal": close, "bitwise": bitwise}
