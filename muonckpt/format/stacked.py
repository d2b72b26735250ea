"""Stacked matrices split into one param each, and merged back, pure.

torchtitan's DistMuon keeps a MoE layer's experts as one param of shape (E, m, n) and
orthogonalizes each expert's (m, n) matrix on its own. torch.optim.Muon, KellerJordan's Muon and
the packaged Muon take 2-D params only, so a model resumed in them holds one (m, n) param per
expert. :func:`split_stacked` rewrites a manifest that is about to be written (no pieces yet) so
that every Muon param of more than two dims becomes ``<name>.<i>``, one per matrix, ``i``
counting over its leading dims in row-major order; the data of ``<name>.<i>`` is the stacked
tensor's ``reshape(-1, m, n)[i]``, for the param and every state tensor alike.
:func:`merged_experts` finds such params in a checkpoint to write for a job that keeps them
stacked again (torchtitan's), each ``<name>.0`` ... ``<name>.<E-1>`` becoming ``<name>`` of shape
(E, m, n).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..errors import CheckpointError
from .kinds import GroupKind
from .manifest import Manifest
from .records import ParamEntry

__all__ = ["Part", "matrices", "merged_experts", "split_stacked"]


@dataclass(frozen=True, slots=True)
class Part:
    """Where a split param's data is: matrix ``index`` of the stacked param ``stacked``."""

    stacked: str
    index: int


def matrices(name: str, shape: tuple[int, ...], leading: int, path: object = None) -> int:
    """How many matrices (or layers) the stacked tensor ``name`` of ``shape`` splits into, one
    per index of its first ``leading`` dims; a tensor of no elements is refused, so that a
    declared shape such as (1000000, 0, 16) never becomes a million empty params.

    Raises:
        CheckpointError: naming the param (and ``path``) for an empty stacked tensor.
    """
    if 0 in shape:
        raise CheckpointError(
            f"stacked param of shape {list(shape)} holds no elements: nothing to split into "
            "one param per matrix",
            path=path,
            param=name,
        )
    return math.prod(shape[:leading])


def split_stacked(manifest: Manifest) -> tuple[Manifest, Mapping[str, Part]]:
    """``manifest`` with each Muon param of more than two dims replaced, where it stood, by one
    2-D param per matrix (same group, dtypes and scalars), and each new name's :class:`Part`.

    Raises:
        CheckpointError: for a manifest with pieces (its data would no longer match its
            names), a new name that is already taken, or a tied name of a split param.
    """
    if manifest.pieces:
        raise CheckpointError("split_stacked rewrites a manifest before its data is written")
    muon = {
        i for i, g in enumerate(manifest.groups) if GroupKind.from_json(g.optimizer).role == "muon"
    }
    parts: dict[str, Part] = {}
    entries: dict[str, tuple[ParamEntry, ...]] = {}
    split = set(manifest.split_experts)
    for entry in manifest.params:
        if entry.group in muon and len(entry.shape) > 2:
            split.add(entry.name)
            count = matrices(entry.name, entry.shape, len(entry.shape) - 2)
            names = [f"{entry.name}.{i}" for i in range(count)]
            parts.update({n: Part(entry.name, i) for i, n in enumerate(names)})
            entries[entry.name] = tuple(
                replace(entry, name=n, shape=entry.shape[-2:], tp_split_dim=-1) for n in names
            )
        else:
            entries[entry.name] = (entry,)
    model = manifest.model
    taken = {e.name for e in manifest.params}
    if model is not None:
        taken |= {t.name for t in model.tensors} | set(model.aliases)
        tied = [a for a, stored in model.aliases.items() if len(entries.get(stored, ())) > 1]
        if tied:
            raise CheckpointError(f"tied name {tied[0]!r} names a stacked param to split")
    if clash := sorted(taken & set(parts)):
        raise CheckpointError(
            f"splitting {parts[clash[0]].stacked!r} gives the name {clash[0]!r}, which the "
            "checkpoint already holds"
        )
    groups = tuple(
        replace(g, params=tuple(e.name for n in g.params for e in entries[n]))
        for g in manifest.groups
    )
    params = tuple(e for entry in manifest.params for e in entries[entry.name])
    recorded = tuple(sorted(split))
    return replace(manifest, params=params, groups=groups, split_experts=recorded), parts


def merged_experts(manifest: Manifest, by_name: bool = False) -> dict[str, tuple[str, ...]]:
    """The stacked params :func:`split_stacked` made one param per matrix of (the manifest's
    ``split_experts``; ``by_name``: any ``<name>`` whose params look so), by name: each
    ``<name>`` whose matrices ``<name>.0`` ... ``<name>.<E-1>`` (E of them, numbered from 0 with
    no gap) are 2-D Muon params of one group, shape, dtypes and scalars, ``<name>`` itself no
    param's or model tensor's name; each with its matrices' names in order.

    Raises:
        CheckpointError: naming the params, where matrices of one name are numbered with a
            gap or differ in group, shape, dtypes or scalars (merged, they would be wrong), or
            a recorded split whose matrices are not there.
    """
    muon = {
        i for i, g in enumerate(manifest.groups) if GroupKind.from_json(g.optimizer).role == "muon"
    }
    taken = {e.name for e in manifest.params}
    if manifest.model is not None:
        taken |= {t.name for t in manifest.model.tensors} | set(manifest.model.aliases)
    found: dict[str, dict[int, ParamEntry]] = {}
    for entry in manifest.params:
        stem, _, index = entry.name.rpartition(".")
        numbered = index.isdigit() and str(int(index)) == index  # (no "01": a name of its own)
        looked_for = (by_name or stem in manifest.split_experts) and stem not in taken | {""}
        if looked_for and entry.group in muon and len(entry.shape) == 2 and numbered:
            found.setdefault(stem, {})[int(index)] = entry
    if lost := [s for s in manifest.split_experts if s not in found]:
        raise CheckpointError(
            f"the checkpoint records {lost[0]!r} as split into one param per matrix, yet holds "
            f"no 2-D Muon params {lost[0]}.0 ... of it to stack again",
            param=lost[0],
        )
    merged = {}
    for stem, parts in found.items():
        entries = [parts.get(i) for i in range(len(parts))]
        first = entries[0]
        alike = first is not None and all(
            e is not None
            and (e.group, e.shape, dict(e.dtypes), dict(e.scalars))
            == (first.group, first.shape, dict(first.dtypes), dict(first.scalars))
            for e in entries
        )
        if not alike:
            raise CheckpointError(
                f"the matrices {sorted(p.name for p in parts.values())[:4]} of {stem!r} are not "
                "numbered from 0 without a gap, or differ in group, shape, dtype or step: "
                "they cannot be merged into one stacked param",
                param=stem,
            )
        merged[stem] = tuple(e.name for e in entries if e is not None)
    return merged
