"""Refusals that say the true cause (issue 30, items 11 and 12): a tensor of a kind no
checkpoint holds is named as such wherever it is given (state, params, ``extra``,
``rank_extra``, the model's buffers), and a manifest too large for the readers is refused
before any data is written, naming what makes it large."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import muonckpt

KINDS: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "nested": (
        lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
        "a nested tensor",
    ),
    "sparse": (lambda: torch.zeros(4).to_sparse(), "a sparse tensor (torch.sparse_coo)"),
    "sparse_csr": (lambda: torch.zeros(2, 2).to_sparse_csr(), "a sparse tensor (torch.sparse_csr)"),
    "meta": (lambda: torch.empty(4, device="meta"), "a meta tensor (it has no data)"),
    "quantized": (
        lambda: torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.quint8),
        "a quantized tensor (torch.quint8)",
    ),
}


def _made(kind: str) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested and sparse CSR tensors are "prototype"
        return KINDS[kind][0]()


def _save(where: str, kind: str, path: Path) -> None:
    """A save of one AdamW param (``w``, 4 elements, one step) with a ``kind`` tensor
    ``where``."""
    weight = torch.nn.Parameter(torch.arange(4.0))
    if where == "param":
        weight = torch.nn.Parameter(_made(kind), requires_grad=False)
    opt = torch.optim.AdamW([{"params": [weight], "param_names": ["w"]}])
    options: dict[str, object] = {}
    if where in ("extra", "rank_extra"):
        options[where] = {"step": 1, "data": {"x": _made(kind)}}
    elif where == "state":
        opt.state[weight].update(step=torch.tensor(1.0), exp_avg=_made(kind))
    elif where == "buffer":
        model = torch.nn.Module()
        model.w = weight
        model.register_buffer("table", _made(kind))
        options.update(model=model, consolidated=True)
    muonckpt.save(opt, path, **options)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("where", ["extra", "rank_extra", "state", "param", "buffer"])
def test_an_unsupported_tensor_kind_is_named_as_such(tmp_path, where, kind):
    """A nested tensor in extra got "a torch.strided tensor cannot be stored"; in the state,
    a param or a buffer, tracebacks from deep inside."""
    with pytest.raises(muonckpt.MuonCkptError) as err:
        _save(where, kind, tmp_path / "ckpt")
    message = str(err.value)
    assert KINDS[kind][1] in message, message
    named = {
        "extra": "extra['data']['x']",
        "rank_extra": "rank_extra['data']['x']",
        "state": "param 'w': state 'exp_avg'",
        "param": "param 'w'",
        "buffer": "model state 'table'",
    }[where]
    assert named in message, message
    assert "\n" not in message
    assert list(tmp_path.iterdir()) == []
