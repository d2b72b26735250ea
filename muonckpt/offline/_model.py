"""(internal) The model's other tensors in an offline rewrite.

A checkpoint may hold, beside the optimizer's params, the model's other ``state_dict()``
tensors (buffers, params no optimizer holds) and its tied names: the manifest's
:class:`~muonckpt.format.manifest.ModelFile`, written by a consolidated ``save(..., model=)``
or a foreign reader. Every rewrite (``consolidate``, ``reshard``, ``convert``) carries them
whole and bit for bit, as planned tensors of its own output (key
:data:`~muonckpt.format.names.PARAM_KEY`):

* a consolidated output stores each at its shape in the ``model`` files, as a consolidated
  save does, the tied names in those files' headers;
* a per-rank output stores each once, whole and flat (as a rank file stores every tensor), in
  rank 0's file;
* ``convert`` keeps each where the source has it.

Their pieces go into the output manifest's ``model`` section, not among the params' (nor
into a piece index): the write engine puts them there, by the names of :func:`draft`'s
tensors (:func:`muonckpt.files.writing.commit`). Pure: no torch, no files.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ..format.manifest import (
    Manifest,
    ModelFile,
    ParamEntry,
    PieceIndex,
)
from ..format.names import PARAM_KEY
from ..format.writeplan import Item, TensorWrite
from ..layout.topology import Region, whole_region


def tensors(manifest: Manifest) -> tuple[ParamEntry, ...]:
    """The model's other tensors ``manifest`` holds (none without a model section)."""
    return manifest.model.tensors if manifest.model is not None else ()


def tied_names(manifest: Manifest) -> dict[str, str] | None:
    """The model's tied names (alias -> stored name): what a rewrite carries, and a
    consolidated one records in its model files' headers (as a consolidated save does)."""
    if manifest.model is None or not manifest.model.aliases:
        return None
    return dict(manifest.model.aliases)


def draft(manifest: Manifest) -> ModelFile | None:
    """The model section of a rewrite's output before it is written: every tensor and tied
    name of ``manifest``'s, no pieces yet."""
    model = manifest.model
    if model is None or not (model.tensors or model.aliases):
        return None
    return ModelFile(model.tensors, (), dict(model.aliases))


def whole_items(manifest: Manifest) -> list[tuple[Item, tuple[int, ...]]]:
    """Each model tensor as :func:`~muonckpt.format.writeplan.consolidated_plan` takes it:
    ((name, param key, dtype), its shape)."""
    return [((t.name, PARAM_KEY, t.dtype_of(PARAM_KEY)), tuple(t.shape)) for t in tensors(manifest)]


def owned_whole(manifest: Manifest) -> Iterator[tuple[Item, Region]]:
    """Each model tensor as :func:`~muonckpt.format.writeplan.rank_plan` takes it: whole."""
    for t in tensors(manifest):
        yield (t.name, PARAM_KEY, t.dtype_of(PARAM_KEY)), whole_region(t.numel)


def kept_writes(manifest: Manifest, shaped: bool) -> tuple[TensorWrite, ...]:
    """Each piece of each model tensor written where ``manifest`` has it (``convert``): at
    the tensor's shape (``shaped``, a consolidated checkpoint) or flat."""
    by_name = {t.name: t for t in tensors(manifest)}
    pieces = manifest.model.pieces if manifest.model is not None else ()
    return tuple(
        TensorWrite(
            p.file,
            p.param,
            p.key,
            by_name[p.param].dtype_of(PARAM_KEY),
            p.region,
            tuple(by_name[p.param].shape) if shaped else (p.region.numel,),
        )
        for p in pieces
    )


def params_writes(manifest: Manifest, writes: Iterable[TensorWrite]) -> Iterable[TensorWrite]:
    """The ``writes`` of ``manifest``'s params: not those of its model's other tensors."""
    names = {t.name for t in tensors(manifest)}
    return (w for w in writes if w.param not in names) if names else writes


def source_pieces(manifest: Manifest) -> PieceIndex:
    """Where every stored tensor of ``manifest`` is, the model's other tensors included."""
    if manifest.model is None or not manifest.model.pieces:
        return manifest.pieces_of()
    return PieceIndex(manifest.pieces, manifest.model.pieces)


class Entries:
    """The entry of each stored tensor of a manifest by name: a param's, else a model
    tensor's."""

    __slots__ = ("_manifest", "_model")

    def __init__(self, manifest: Manifest) -> None:
        self._manifest = manifest
        self._model = {t.name: t for t in tensors(manifest)}

    def __call__(self, name: str) -> ParamEntry:
        return self._model.get(name) or self._manifest.param(name)
