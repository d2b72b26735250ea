"""Refusals that say the true cause (issue 30, items 11 and 12): a tensor of a kind no
checkpoint holds is named as such wherever it is given (state, params, ``extra``,
``rank_extra``, the model's buffers), and a manifest too large for the readers is refused
before any data is written, naming what makes it large."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import muonckpt
from muonckpt import offline
from muonckpt.format.manifest import CONSOLIDATED, DTYPE_BYTES, Manifest, Piece

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


# --- the manifest's size, before any data is written -----------------------------------------

MANY_PARAMS = """
import sys, time, torch, muonckpt, muonckpt.storage
count, path = int(sys.argv[1]), sys.argv[2]
muonckpt.storage.MAX_TEXT_BYTES = int(sys.argv[3])  # what a reader accepts, lowered
params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(count)]
names = [f"layers.{i:06d}.mlp.w_in.bias" for i in range(count)]  # 27 characters
assert {len(n) for n in names} == {27}
opt = torch.optim.AdamW([{"params": params, "param_names": names}])
for p in params:
    p.grad = torch.ones(1)
opt.step()
start = time.perf_counter()
try:
    muonckpt.save(opt, path, extra={"step": 1})
except muonckpt.CheckpointError as exc:
    print(f"refused after {time.perf_counter() - start:.1f} s: {exc}")
"""


@pytest.mark.dist
def test_a_save_whose_manifest_is_too_large_is_refused_before_writing(tmp_path):
    """100k AdamW params with 27-character names (300k pieces): every data file was written,
    then the commit refused, blaming extra / rank_extra (which held {"step": 1}). Now the
    stage step refuses, before the staging directory exists, naming the counts. Since format
    version 3 (piece indexes) 100k params fit, so the readers' limit is lowered to 1 MB for
    10k params: their one piece index (30k pieces, 2.7 MB) passes it. (A real script in a
    subprocess.)"""
    done = subprocess.run(
        [sys.executable, "-c", MANY_PARAMS, "10000", str(tmp_path / "ckpt"), "1000000"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert "save (stage): the piece index of rank-00000-of-00001.safetensors would be" in line
    assert "10000 params and 30000 pieces" in line, line
    assert "nothing was written" in line and "extra" not in line, line
    assert list(tmp_path.iterdir()) == []


def test_the_manifest_size_is_counted_exactly(tmp_path):
    """ManifestSize counts a real manifest's params, pieces and group lists to the byte:
    names that JSON escapes, two groups, scalars, several dtypes, a split checksum list."""
    from muonckpt.format.manifest_size import ManifestSize

    names = ['a"b', "w\u00e9ight", "c\\d", "plain.name"]
    params = [torch.nn.Parameter(torch.randn(3, 5)) for _ in names]
    params[3] = torch.nn.Parameter(torch.randn(1 << 21, dtype=torch.float64))  # 4 chunks
    opt = torch.optim.AdamW(
        [
            {"params": params[:2], "param_names": names[:2]},
            {"params": params[2:], "param_names": names[2:]},
        ]
    )
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.state[params[0]]["note"] = "text"
    manifest = muonckpt.read_manifest(muonckpt.save(opt, tmp_path / "c"))
    assert max(len(p.checksums) for p in manifest.pieces) == 4
    size = ManifestSize()
    for entry in manifest.params:
        size.add_param(entry)
    for p in manifest.pieces:
        size.add_piece(p.param, p.key, p.file, p.tensor, p.region, _nbytes(manifest, p), 4 << 20)
    counted = Manifest(CONSOLIDATED, {}, (), manifest.params, (), ())  # version 3: no pieces
    assert size.bytes == len(counted.to_json())
    ((file, index_bytes),) = size.index_bytes.items()  # and the one file's index, exactly
    (index,) = manifest.indexes
    assert index.file == file and index_bytes == index.bytes
    assert (size.params, size.pieces) == (4, 12)


def _nbytes(manifest: Manifest, piece: Piece) -> int:
    return piece.region.numel * DTYPE_BYTES[manifest.param(piece.param).dtype_of(piece.key)]


@pytest.mark.dist
@pytest.mark.parametrize("tool", ["consolidate", "reshard", "convert"])
def test_an_offline_rewrite_whose_manifest_is_too_large_starts_nothing(
    tmp_path, monkeypatch, single_ckpt, tool
):
    """The offline tools count their output's manifest from the plan before any process
    starts or any file is written (the limit lowered below the output's, as
    test_trainstate does to reach it)."""
    src = single_ckpt(1)
    monkeypatch.setattr(muonckpt.storage, "MAX_TEXT_BYTES", 700)
    out = tmp_path / "out"
    calls = {
        "consolidate": lambda: offline.consolidate(src, out),
        "reshard": lambda: offline.reshard(src, out, dp=2, tp=1),
        "convert": lambda: offline.convert(src, out, to="torch"),
    }
    with pytest.raises(muonckpt.CheckpointError, match="more than the 700 a reader") as err:
        calls[tool]()
    params = len(muonckpt.read_manifest(src).params)
    assert f"{params} params and " in str(err.value) and "nothing was written" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_params_alike_but_for_a_scalars_type_are_counted_apart():
    """1, 1.0 and True are equal (one key of a cache) but three JSON spellings."""
    from muonckpt.format.manifest import ParamEntry, Scalar
    from muonckpt.format.manifest_size import ManifestSize

    entries = tuple(
        ParamEntry(f"p{i}", (2,), -1, 0, {}, {"s": Scalar(value, None)})
        for i, value in enumerate([1, 1.0, True, 1.0, 1])
    )
    size = ManifestSize()
    for entry in entries:
        size.add_param(entry)
    assert size.bytes == len(Manifest(CONSOLIDATED, {}, (), entries, (), ()).to_json())
