"""The model's items of a DCP checkpoint that :func:`muonckpt.interop.dcp.reader.from_dcp` reads:
which items are the model's, and its tensors no optimizer holds (buffers, frozen params) told
from its tied names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...format.manifest import ParamEntry, model_tensor
from . import files as dcp_files
from . import metadata as dcp_metadata


@dataclass(frozen=True)
class ModelItems:
    """Which DCP items are the model's: those under its prefix, or, at the top level, those
    neither the optimizer's nor one of ``job_states`` (None: not told apart)."""

    prefix: str
    optimizer_prefix: str
    job_states: tuple[str, ...] | None

    def holds(self, fqn: str) -> bool:
        if fqn.startswith(self.optimizer_prefix) or not fqn.startswith(self.prefix):
            return False
        if self.prefix:
            return True
        return self.job_states is not None and fqn.split(".", 1)[0] not in self.job_states


def model_others_of(
    index: dcp_metadata.DcpIndex, settings: Mapping[str, Any], model: ModelItems
) -> tuple[list[ParamEntry], dict[str, str]]:
    """The model's tensors no optimizer holds (buffers, frozen params) and its tied names
    (alias -> param: a tensor bitwise equal to a param of its shape and dtype, as
    ``get_state_dict`` saves a tied weight under each of its names). Only where the model's
    items are told from the job's (:class:`ModelItems`)."""
    others, aliases = [], {}
    params = {name: index.tensors[model.prefix + name] for name in settings}
    for fqn, tensor in index.tensors.items():
        name = fqn[len(model.prefix) :]
        if not model.holds(fqn) or name in params:
            continue
        value = dcp_files.read_tensor(index, tensor)
        tied = next(
            (
                p
                for p, held in params.items()
                if (held.shape, held.dtype) == (tensor.shape, tensor.dtype)
                and dcp_files.read_tensor(index, held).equal(value)
            ),
            None,
        )
        if tied is not None:
            aliases[name] = tied
        else:
            others.append(model_tensor(name, tensor.shape, tensor.dtype))
    return others, aliases
