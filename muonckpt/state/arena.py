"""Bytes read for a load, held compactly until every rank has read its share.

A load reads its whole share before anything in the optimizer changes (any rank's failure is
every rank's), so it holds every tensor it read at once. A tensor object costs about a
kilobyte beside its data (torch's tensor and storage, numpy's array): 300k state tensors of a
few elements each, held as tensors, cost dozens of times their bytes, more than the state
itself. A :class:`ReadArena` packs the bytes of small reads into shared blocks and gives each
read an integer slot; tensors are made from a slot only when they are used.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 16
"""Every slot starts at a multiple of this within its block: aligned for any dtype."""


class ReadArena:
    """Slots of bytes: reads under ``small`` bytes packed into blocks of ``block`` bytes,
    larger ones in arrays of their own (which then cost no more than they hold).

    A tensor from :meth:`tensor` shares the slot's memory: a state tensor made from it keeps
    its block alive, and nothing is copied twice.
    """

    def __init__(self, *, small: int = 1 << 16, block: int = 1 << 22) -> None:
        self._small, self._block = small, block
        self._arrays: list[torch.Tensor] = []  # 1-D uint8: blocks and single reads
        self._slots = array("q")  # per slot: array index, byte offset, byte length
        self._filling = -1  # index of the block being filled (none yet)
        self._used = 0  # bytes used of it

    def __len__(self) -> int:
        return len(self._slots) // 3

    @property
    def nbytes(self) -> int:
        """The bytes of every slot."""
        return sum(self._slots[2::3])

    def reserve(self, nbytes: int) -> tuple[int, np.ndarray]:
        """A new slot of ``nbytes`` and the 1-D uint8 array to fill it through."""
        if nbytes >= self._small:
            self._arrays.append(torch.empty(nbytes, dtype=torch.uint8))
            where, offset = len(self._arrays) - 1, 0
        else:
            offset = -(-self._used // _ALIGN) * _ALIGN
            if self._filling < 0 or offset + nbytes > self._block:
                # Zeroed: a view's whole block is what torch.save writes, never stale memory.
                self._arrays.append(torch.zeros(self._block, dtype=torch.uint8))
                self._filling, offset = len(self._arrays) - 1, 0
            where, self._used = self._filling, offset + nbytes
        self._slots.extend((where, offset, nbytes))
        return len(self) - 1, self._arrays[where].numpy()[offset : offset + nbytes]

    def trim(self) -> None:
        """Give back the unused rest of the block being filled (a tensor viewing a block keeps
        it whole, and ``torch.save`` writes a view's whole storage); the next small read
        starts a new block."""
        if self._filling >= 0 and self._used < self._block:
            self._arrays[self._filling] = self._arrays[self._filling][: self._used].clone()
        self._filling = -1

    def versions(self) -> list[int]:
        """Each block's torch version counter, which every in-place torch op on a tensor
        viewing it advances (what a slot's tensors went through since, :meth:`touched`)."""
        return [block._version for block in self._arrays]

    def touched(self, slot: int, versions: Sequence[int]) -> bool:
        """Whether a torch op wrote in place into the block of ``slot`` since ``versions``."""
        where = self._slots[3 * slot]
        return bool(self._arrays[where]._version != versions[where])

    def raw(self, slot: int) -> torch.Tensor:
        """The slot's bytes, a 1-D uint8 tensor sharing them."""
        where, offset, nbytes = self._slots[3 * slot : 3 * slot + 3]
        return self._arrays[where][offset : offset + nbytes]

    def tensor(self, slot: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The slot's bytes as a tensor of ``dtype`` and ``shape``, sharing them."""
        where, offset, nbytes = self._slots[3 * slot : 3 * slot + 3]
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        return self._arrays[where][offset : offset + nbytes].view(dtype).view(tuple(shape))
