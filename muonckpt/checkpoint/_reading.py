"""(internal) Reading a load's share: this rank's share of the checkpoint's state, in the
target's keys and forms, and of its params' values, read and checked into one arena
(:func:`read_share`), nothing applied; for :func:`muonckpt.checkpoint.loading.load`."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping

import torch

from .. import storage
from ..errors import CheckpointError, StateDictError
from ..files.pieces import PieceReader
from ..format import conversion
from ..format.manifest import Manifest, ParamEntry, Piece, Scalar
from ..format.names import MANIFEST_NAME, PARAM_KEY
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
    done: Done | None = None,
) -> Share:
    """This rank's share of the state (in the target's keys) and of its params' values; each
    slot told to ``done`` once it holds what the load applies."""
    grouped = manifest.pieces_of()
    share = Share(ReadArena(), [], array("q"))
    done = done or _nothing

    def read(entry: ParamEntry, key: str, region: Region, arena: ReadArena = share.arena) -> int:
        slot, out = arena.reserve(region.numel * storage.itemsize(entry.dtype_of(key)))
        pieces = grouped[entry.name, key]
        reader.gather(pieces, entry, key, region, out)
        whole = len(pieces) == 1 and pieces[0].region == region
        done(arena, slot, pieces[0] if whole else None)
        return slot

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
            else:
                tensors, first, scalars = _mapped(
                    plan, param, entry, manifest, read, share.arena, done
                )
            if tensors not in layouts:  # a dtype this torch lacks fails before any change
                layouts[tensors] = tensors
                for _, dtype in tensors:
                    storage.torch_dtype(dtype)
            for scalar in scalars.values():
                if scalar not in checked:
                    scalar_value(scalar)
                    checked.add(scalar)
            share.state.append(Staged(param.local_index, layouts[tensors], first, scalars))
        if params:
            held = param.held or whole_region(entry.numel)
            _check_value(entry, held, p, directory)
            share.values.extend(
                (param.local_index, read(entry, PARAM_KEY, held, share.value_bytes))
            )
    share.arena.trim()
    return share


def _mapped(
    plan: Target,
    param: ParamSharding,
    entry: ParamEntry,
    manifest: Manifest,
    read: Callable[[ParamEntry, str, Region], int],
    arena: ReadArena,
    done: Done,
) -> tuple[tuple[tuple[str, str], ...], int, Mapping[str, Scalar]]:
    """A param's state in the target's keys and forms: (key, dtype) per tensor read, the first
    tensor's slot (each told to ``done`` again once converted), and the step scalar."""
    assert plan.maps is not None  # (a load across implementations)
    key_map = plan.maps[param.name]
    tensors, first = [], len(arena)
    for key, (source_key, factor) in key_map.keys.items():
        if source_key in entry.state_keys:
            dtype = entry.dtype_of(source_key)
            slot = read(entry, source_key, param.region_here)
            if factor != 1.0:
                numel = (param.region_here.numel,)
                arena.tensor(slot, storage.torch_dtype(dtype), numel).mul_(factor)
                done(arena, slot, None)
            tensors.append((key, dtype))
    step = conversion.step_scalar(plan.steps_in[param.group], manifest.step_of(entry), entry.name)
    scalars = {"step": step} if key_map.step and tensors and step is not None else {}
    return tuple(tensors), first, scalars


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
