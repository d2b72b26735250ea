"""(internal) Reading a load's share: this rank's share of the checkpoint's state, in the
target's keys and forms, and of its params' values, read and checked into one arena
(:func:`read_share`), nothing applied; for :func:`muonckpt.checkpoint.loading.load`."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import storage
from ..errors import CheckpointError, StateDictError
from ..files.pieces import PieceReader
from ..files.progress import Meter, Progress
from ..format import conversion
from ..format.manifest import Manifest, ParamEntry, Piece, Scalar
from ..format.names import MANIFEST_NAME, PARAM_KEY
from ..layout.state_shapes import local_shape, state_region
from ..layout.topology import Region, whole_region
from ..state.arena import ReadArena
from ..state.describers import flat_params
from ..state.sharding_model import ParamSharding
from ._taking import Share, Staged, Target, scalar_value

Done = Callable[[ReadArena, int, Piece | None], None]
"""``done(arena, slot, piece)``: the slot holds what the load applies (read, and converted):
the whole of stored ``piece`` as it was read (None: anything else)."""


def _nothing(arena: ReadArena, slot: int, piece: Piece | None) -> None:
    """No one to tell."""


def read_share(
    plan: Target,
    manifest: Manifest,
    reader: PieceReader,
    params: bool,
    directory: storage.Location,
    progress: Progress | None = None,
    done: Done | None = None,
) -> Share:
    """This rank's share of the state (in the target's keys) and of its params' values: every
    param checked and its slots reserved first, then the reads (reported to ``progress``),
    then the momentum scaled where the forms differ; each slot told to ``done`` once it holds
    what the load applies."""
    share = Share(ReadArena(), [], array("q"))
    reads = _Reads(share.arena, done or _nothing)

    def read(entry: ParamEntry, key: str, region: Region, arena: ReadArena | None = None) -> int:
        kept = region if key == PARAM_KEY else _state_share(entry, key, region, directory)
        return reads.reserve(entry, key, kept, arena)

    flat = flat_params(plan.optimizer)
    layouts: dict[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]] = {}  # one each
    checked: set[Scalar] = set()  # scalars that make the optimizer's value
    for param in plan.sharding.params:
        entry = manifest.param(param.name)
        _check_param(entry, param, directory)
        if param.local_index is None:
            continue
        p = flat[param.index_here]
        if param.local is not None and (entry.state_keys or entry.scalars):
            _check_share(param, param.local, p)
            if plan.maps is None:
                tensors = tuple((k, entry.dtype_of(k)) for k in entry.state_keys)
                first = len(share.arena)
                for key in entry.state_keys:
                    read(entry, key, param.local)
                scalars = entry.scalars
                sources = {k: k for k in entry.state_keys}
            else:
                tensors, first, scalars = _mapped(
                    plan, param, entry, manifest, read, len(share.arena), reads.scales
                )
                sources = {k: source for k, (source, _) in plan.maps[param.name].keys.items()}
            if tensors not in layouts:  # a dtype this torch lacks fails before any change
                layouts[tensors] = tensors
                for _, dtype in tensors:
                    storage.torch_dtype(dtype)
            for scalar in scalars.values():
                if scalar not in checked:
                    scalar_value(scalar)
                    checked.add(scalar)
            forms = _forms(entry, param.local, tuple(p.shape), tensors, sources)
            share.state.append(Staged(param.local_index, layouts[tensors], first, scalars, *forms))
        if params:
            held = param.held or whole_region(entry.numel)
            _check_value(entry, held, p, directory)
            share.values.extend(
                (param.local_index, read(entry, PARAM_KEY, held, share.value_bytes))
            )
    reads.run(manifest, reader, progress)
    share.arena.trim()
    return share


class _Reads:
    """A share's reads, each slot reserved as its param is checked (every refusal before any
    byte is read), then read together (:meth:`run`), reported to the caller's ``progress``,
    each slot told to ``done`` once it holds what the load applies."""

    def __init__(self, arena: ReadArena, done: Done) -> None:
        self.arena = arena
        self.done = done
        self.pending: list[tuple[ParamEntry, str, Region, ReadArena, int, Any]] = []
        self.scales: list[tuple[int, str, int, float]] = []
        """(slot, dtype, numel, factor): momentum to scale once read, where the forms differ."""

    def reserve(
        self, entry: ParamEntry, key: str, region: Region, arena: ReadArena | None = None
    ) -> int:
        """A slot (of ``arena``, the state's by default) for ``region`` of ``entry``'s ``key``."""
        arena = self.arena if arena is None else arena
        slot, out = arena.reserve(region.numel * storage.itemsize(entry.dtype_of(key)))
        self.pending.append((entry, key, region, arena, slot, out))
        return slot

    @property
    def total_bytes(self) -> int:
        return sum(len(out) for *_, out in self.pending)

    @property
    def count(self) -> int:
        return len(self.pending)

    def run(self, manifest: Manifest, reader: PieceReader, progress: Progress | None) -> None:
        """Every read, then every scale (each scaled slot told to ``done`` again)."""
        grouped = manifest.pieces_of()
        meter = Meter(self, progress)
        for entry, key, region, arena, slot, out in self.pending:
            pieces = grouped[entry.name, key]
            reader.gather(pieces, entry, key, region, out)
            whole = len(pieces) == 1 and pieces[0].region == region
            self.done(arena, slot, pieces[0] if whole else None)
            meter.tick(len(out))
        for slot, dtype, numel, factor in self.scales:
            self.arena.tensor(slot, storage.torch_dtype(dtype), (numel,)).mul_(factor)
            self.done(self.arena, slot, None)


def _forms(
    entry: ParamEntry,
    region: Region,
    held: tuple[int, ...],
    tensors: tuple[tuple[str, str], ...],
    sources: Mapping[str, str],
) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """Of the tensors a param's state is given back as (each target key read from
    ``sources[key]``), the shape here of each not shaped like the param's tensor (``held``),
    and the keys whose dtype was not the param's when saved (kept so on load)."""
    shapes = {
        key: local_shape(stored, entry.shape, region, held)
        for key, _ in tensors
        if (stored := entry.state_shapes.get(sources[key])) is not None
    }
    own = frozenset(key for key, dtype in tensors if entry.value_dtype not in (None, dtype))
    return shapes, own


def _mapped(
    plan: Target,
    param: ParamSharding,
    entry: ParamEntry,
    manifest: Manifest,
    read: Callable[[ParamEntry, str, Region], int],
    first: int,
    scales: list[tuple[int, str, int, float]],
) -> tuple[tuple[tuple[str, str], ...], int, Mapping[str, Scalar]]:
    """A param's state in the target's keys and forms: (key, dtype) per tensor read, the first
    tensor's slot (``first``, the arena's next), and the step scalar; each slot to scale once
    read, with its factor, added to ``scales``."""
    assert plan.maps is not None  # (a load across implementations)
    key_map = plan.maps[param.name]
    tensors: list[tuple[str, str]] = []
    for key, (source_key, factor) in key_map.keys.items():
        if source_key in entry.state_keys:
            dtype = entry.dtype_of(source_key)
            slot = read(entry, source_key, param.region_here)
            if factor != 1.0:
                numel = _state_share(entry, source_key, param.region_here, None).numel
                scales.append((slot, dtype, numel, factor))
            tensors.append((key, dtype))
    step = conversion.step_scalar(plan.steps_in[param.group], manifest.step_of(entry), entry.name)
    scalars = {"step": step} if key_map.step and tensors and step is not None else {}
    return tuple(tensors), first, scalars


def _state_share(
    entry: ParamEntry, key: str, region: Region, directory: storage.Location | None
) -> Region:
    """The elements of stored state ``key`` that the holder of ``region`` of the param keeps
    (:func:`muonckpt.layout.state_shapes.state_region`); refused where this layout would cut
    what the key's shape rule keeps whole."""
    stored = entry.state_shapes.get(key)
    kept = state_region(stored, entry.shape, region)
    if kept is None:
        assert stored is not None  # (state shaped like its param follows any region)
        raise CheckpointError(
            f"state {key!r} is {stored.rule} state of shape {stored.shape}, which this layout "
            f"would cut (this rank holds elements [{region.start}, {region.stop}) of column "
            f"block {region.block_start}+{region.block_width} of the param's {entry.shape})",
            path=directory / MANIFEST_NAME if directory is not None else None,
            param=entry.name,
        )
    return kept


def _check_value(
    entry: ParamEntry, held: Region, p: torch.Tensor, directory: storage.Location
) -> None:
    """The saved values fit the optimizer's param: its dtype, this rank's elements of it."""
    dtype = storage.torch_dtype(entry.dtype_of(PARAM_KEY))
    if dtype != p.dtype or held.numel != p.numel():
        raise CheckpointError(
            f"saved values are {dtype} x {held.numel} elements here, the optimizer's "
            f"param {p.dtype} x {p.numel()}",
            path=directory / MANIFEST_NAME,
            param=entry.name,
        )


def _check_share(param: ParamSharding, region: Region, p: torch.Tensor) -> None:
    """This rank's share of a param's state has the elements of its tensor here."""
    if region.numel != p.numel():
        raise StateDictError(
            f"param {param.name!r}: this rank's share of its state is {region.numel} "
            f"elements, its tensor here {p.numel()}"
        )


def _check_param(entry: ParamEntry, param: ParamSharding, directory: storage.Location) -> None:
    if param.full_shape is not None and tuple(entry.shape) != tuple(param.full_shape):
        raise CheckpointError(
            f"checkpoint shape {entry.shape} differs from the optimizer's full shape "
            f"{tuple(param.full_shape)}",
            path=directory / MANIFEST_NAME,
            param=param.name,
        )
    missing = [k for k in param.expected_keys if entry.state_keys and k not in entry.state_keys]
    if missing:
        raise CheckpointError(
            f"checkpoint lacks state key(s) {missing}",
            path=directory / MANIFEST_NAME,
            param=param.name,
        )
