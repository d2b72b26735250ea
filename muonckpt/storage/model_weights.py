"""A model's weights as users keep them, read tensor by tensor: one safetensors file, or a
Hugging Face sharded checkpoint (``model.safetensors.index.json``, whose ``weight_map`` names
each tensor's shard file beside it). Each shard is opened once, when first read; reads are
element ranges (:meth:`SafetensorsReader.read`), so memory is what the caller asks for."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from .durable import read_text
from .safetensors_format import TensorRecord
from .safetensors_reader import SafetensorsReader

if TYPE_CHECKING:
    import torch

INDEX_SUFFIX = ".safetensors.index.json"
SINGLE = "model.safetensors"
SHARDED = "model" + INDEX_SUFFIX


class ModelWeights:
    """The tensors of a model file (a ``.safetensors`` file, a ``*.safetensors.index.json``,
    or a directory holding ``model.safetensors.index.json`` or ``model.safetensors``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        place = Path(path)
        if place.is_dir():
            found = [place / n for n in (SHARDED, SINGLE) if (place / n).is_file()]
            if not found:
                raise CheckpointError(f"holds neither {SHARDED} nor {SINGLE}", path=place)
            place = found[0]
        self.path = place
        self._readers: dict[Path, SafetensorsReader] = {}
        if place.name.endswith(INDEX_SUFFIX):
            self._files = self._index(place)
        else:
            self._files = dict.fromkeys(self._reader(place).keys(), place)

    @staticmethod
    def _index(index: Path) -> dict[str, Path]:
        """Each tensor's shard file, from a Hugging Face index's ``weight_map``."""
        try:
            weight_map = json.loads(read_text(index))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"not a safetensors index ({exc})", path=index) from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and "/" not in v and v not in ("", ".", "..")
            for k, v in weight_map.items()
        ):
            raise CheckpointError("its weight_map must map names to file names", path=index)
        return {name: index.parent / file for name, file in weight_map.items()}

    def _reader(self, file: Path) -> SafetensorsReader:
        reader = self._readers.get(file)
        if reader is None:
            reader = self._readers[file] = SafetensorsReader(file)
        return reader

    def names(self) -> list[str]:
        """Every tensor's name, sorted."""
        return sorted(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def record(self, name: str) -> TensorRecord:
        """Its dtype and shape (as its file records it)."""
        return self._reader(self._files[name]).record(name)

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Flat elements ``[start, stop)`` of tensor ``name``, in its dtype."""
        return self._reader(self._files[name]).read(name, start, stop)

    def close(self) -> None:
        """Every shard opened closed."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> ModelWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
