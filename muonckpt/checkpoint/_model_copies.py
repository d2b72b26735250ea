"""(internal) A model whose weights are separate copies of the optimizer's params, for
:func:`muonckpt.checkpoint.loading.load`'s ``model=``.

Megatron-style training keeps a bf16 model and fp32 master params in the optimizer; after a
load the model's weights must be given the loaded params (Megatron-LM #6920: the sync did not
run, and the job trained on from another model with no error). ``load`` pairs each param this
rank holds with the model's weight of the same name, refusing (before anything changes) a param
the model lacks or holds in another shape (a transposed weight of as many elements is not a
copy); after the apply it writes the loaded
params into the weights, cast to their dtype (:meth:`ModelCopies.params_to_model`), and the
load's check compares every weight with its param as cast (:meth:`ModelCopies.problems`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import CheckpointError

Model = torch.nn.Module | Mapping[str, torch.Tensor]
"""A module (its ``named_parameters()``) or its weights by name."""


@dataclass(frozen=True)
class ModelCopies:
    """Each param this rank holds, by name, beside the model's weight of that name."""

    pairs: Sequence[tuple[str, torch.Tensor, torch.Tensor]]
    """(name, the optimizer's param, the model's weight)."""

    @classmethod
    def pair(cls, model: Model, params: Sequence[tuple[str, torch.Tensor]]) -> ModelCopies:
        """The model's weights paired with ``params`` (name, param) by name; a
        :class:`CheckpointError` names every param the model lacks or holds in another shape
        (a rank holding a shard of a weight: give such a model as the optimizer's
        :class:`~muonckpt.optim.sharding.ShardedParams` instead)."""
        weights = dict(model.named_parameters()) if isinstance(model, torch.nn.Module) else model
        missing = [name for name, _ in params if name not in weights]
        other = [
            f"{name!r} {tuple(p.shape)} vs the model's {tuple(weights[name].shape)}"
            for name, p in params
            if name in weights and weights[name].shape != p.shape
        ]
        if missing or other:
            problems = ([f"the model has no weight named {missing[:8]}"] if missing else []) + (
                [f"shapes differ: {'; '.join(other[:8])}"] if other else []
            )
            raise CheckpointError(
                "load(model=...): the model's weights must be copies of the optimizer's params, "
                f"by name: {'; '.join(problems)}",
                param=(missing or [name for name, _ in params if name in weights])[0],
            )
        return cls([(name, p, weights[name]) for name, p in params])

    def params_to_model(self) -> None:
        """Each loaded param into the model's weight of its name, cast to the weight's dtype."""
        with torch.no_grad():
            for _, p, weight in self.pairs:
                weight.copy_(p.detach())

    def problems(self) -> list[tuple[str, str, str]]:
        """(param, ``"model"``, what) of every weight that is not its param cast to its dtype."""
        return [
            (name, "model", f"the model's weight is not the loaded param (as {weight.dtype})")
            for name, p, weight in self.pairs
            if not torch.equal(weight.detach(), p.detach().to(weight.dtype))
        ]
