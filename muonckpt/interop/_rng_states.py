"""RNG states as trainers pickle them (Python's ``random.getstate()``, numpy's
``np.random.get_state()``, a torch generator's state), turned into trees of JSON values and
tensors that ``extra`` stores (:mod:`._trainer_state`), and back. Read by the restricted
unpickler with :data:`NUMPY_STAND_INS` (numpy's array arrives as a
:class:`~muonckpt.storage.torch_pickles.Opaque`: its bytes, dtype and shape, nothing of numpy
run); a state not of this form raises :class:`NotAsSaved`, which a reader turns into a line
of what it left out."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..storage import torch_pickles
from ._trainer_state import is_plain

__all__ = [
    "NUMPY_STAND_INS",
    "NotAsSaved",
    "generator",
    "numpy_state",
    "numpy_tree",
    "python_state",
    "python_tree",
]

NUMPY_STAND_INS: dict[str, type] = dict.fromkeys(
    (
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
    ),
    torch_pickles.Opaque,
)
"""The globals numpy's RNG state is pickled with -> what they become here."""


class NotAsSaved(Exception):
    """A value that is not as the trainer saves it: left out, named, never guessed."""


def python_tree(value: Any, what: str) -> dict[str, Any]:
    """``random.getstate()``'s ``(version, words, gauss)`` as a tree."""
    version, words, gauss = _tuple(value, 3, what)
    if not isinstance(words, tuple) or not all(type(w) is int for w in words):
        raise NotAsSaved(f"{what}'s words are not ints")
    return {"version": version, "words": list(words), "gauss": gauss}


def python_state(tree: Mapping[str, Any]) -> tuple[Any, ...]:
    """The tuple ``random.setstate`` takes, from its tree."""
    return (tree["version"], tuple(tree["words"]), tree["gauss"])


def numpy_tree(value: Any, what: str) -> dict[str, Any]:
    """``np.random.get_state()``'s ``(name, key, pos, has_gauss, cached_gaussian)`` as a tree,
    the key array as its bytes (a uint8 tensor), dtype and shape."""
    name, key, pos, has_gauss, cached = _tuple(value, 5, what)
    raw, dtype, shape = _array(key, what)
    return {
        "name": name,
        "key": raw,
        "dtype": dtype,
        "shape": shape,
        "pos": pos,
        "has_gauss": has_gauss,
        "cached_gaussian": cached,
    }


def numpy_state(tree: Mapping[str, Any]) -> tuple[Any, ...]:
    """The tuple ``np.random.set_state`` takes (its key a numpy array), from its tree."""
    import numpy as np

    raw = bytes(tree["key"].contiguous().numpy().tobytes())
    key = np.frombuffer(raw, dtype=np.dtype(tree["dtype"])).reshape(tree["shape"]).copy()
    return (tree["name"], key, tree["pos"], tree["has_gauss"], tree["cached_gaussian"])


def generator(value: Any, what: str) -> torch.Tensor:
    """A torch generator's state (a 1-D uint8 tensor), as it is."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise NotAsSaved(f"{what} is not a generator state (1-D uint8)")
    return value


def _tuple(value: Any, size: int, what: str) -> tuple[Any, ...]:
    if not isinstance(value, tuple) or len(value) != size or not all(map(_plain_or_tuple, value)):
        raise NotAsSaved(f"{what} is not a tuple of {size} plain values")
    return value


def _plain_or_tuple(value: Any) -> bool:
    return is_plain(value) or isinstance(value, (tuple, torch_pickles.Opaque))


def _array(value: Any, what: str) -> tuple[torch.Tensor, str, list[int]]:
    """numpy's key array, pickled as ``_reconstruct(ndarray, (0,), b'b')`` with the state
    ``(1, shape, dtype, fortran, bytes)`` and read as a stand-in: its bytes, dtype and shape."""
    state = getattr(value, "state", None)
    if not isinstance(value, torch_pickles.Opaque) or not isinstance(state, tuple):
        raise NotAsSaved(f"{what}'s key is not a numpy array")
    if len(state) != 5 or not isinstance(state[1], tuple) or not isinstance(state[4], bytes):
        raise NotAsSaved(f"{what}'s key is not a numpy array")
    dtype = state[2]
    code = dtype.args[0] if isinstance(dtype, torch_pickles.Opaque) and dtype.args else None
    order = dtype.state[1] if isinstance(getattr(dtype, "state", None), tuple) else None
    if code not in ("u4", "u8") or order not in ("<", ">", "=", "|") or state[3]:
        raise NotAsSaved(f"{what}'s key is of dtype {code!r}, not u4")
    shape = list(state[1])
    if not all(type(n) is int for n in shape) or math.prod(shape) * int(code[1]) != len(state[4]):
        raise NotAsSaved(f"{what}'s key's bytes are not its shape's")
    raw = torch.frombuffer(bytearray(state[4]), dtype=torch.uint8)
    return raw, order + code, shape
