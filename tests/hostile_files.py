"""Hostile variants of the trainers' own checkpoint files (tests/fixtures): each fixture
copied and one field of it rewritten the way its trainer stores it (``torch.save``, DCP by
torch's writer), for the tests that a foreign reader refuses it in one line."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from typer.testing import CliRunner

from muonckpt.cli import app
from muonckpt.interop.dcp import files as dcp_files
from muonckpt.interop.dcp import metadata as dcp_metadata
from muonckpt.interop.deepspeed import files as deepspeed_files
from muonckpt.interop.megatron import files as megatron_files
from muonckpt.interop.megatron import reader as megatron

FIXTURES = Path(__file__).parent / "fixtures"
DEEPSPEED = FIXTURES / "deepspeed" / "w2_z1_torchadam_fp32" / "ckpt"
MCORE = FIXTURES / "megatron" / "tp2_dp1" / "checkpoint"
MCORE_TORCH = FIXTURES / "megatron" / "tp1_dp2_torch" / "checkpoint"
TITAN = FIXTURES / "torchtitan" / "checkpoint" / "step-3"
ACCELERATE = FIXTURES / "accelerate" / "named" / "state"
LIGHTNING = FIXTURES / "lightning" / "named" / "checkpoints"


def copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def resave(path: Path, change: Callable[[Any], None]) -> Path:
    """``path`` (a ``torch.save`` file of a trainer) loaded, changed and saved again as
    ``torch.save`` does. DeepSpeed's and Megatron's classes read as stand-ins are left out (a
    stand-in is not DeepSpeed's class: saved, it would name muonckpt's); the reader needs
    none of them."""
    if path.name.endswith("optim_states.pt") or path.name == deepspeed_files.MODEL_STATES:
        value = deepspeed_files.load(path)
        optim = value.get("optimizer_state_dict")
        if isinstance(optim, dict):
            optim.pop("loss_scaler", None)
            optim.pop("param_slice_mappings", None)
            optim["zero_stage"] = int(optim["zero_stage"])
    elif path.parent.name.startswith("mp_rank_"):
        value = megatron_files.load(path)
        if isinstance(value, dict):
            value.pop("args", None)
            value.pop("rng_state", None)
    else:
        value = torch.load(path, weights_only=True)
    change(value)
    path.unlink()
    torch.save(value, path)
    return path


def rewrite_dcp(
    src: Path,
    dst: Path,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    edit: Callable[[dict[str, Any]], None] = lambda values: None,
    data: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """The DCP checkpoint ``src`` written again by torch's writer at ``dst``, each item of
    ``shapes`` declared at its new shape (zeros), each of ``data`` holding that tensor's
    values instead, the plain values changed by ``edit``."""
    shapes, data = shapes or {}, data or {}
    index = dcp_metadata.read_index(src)
    values = {f: dcp_files.read_value(index, v, megatron.ADMITTED) for f, v in index.values.items()}
    edit(values)
    tensors = {f: (shapes.get(f, tuple(t.shape)), t.dtype) for f, t in index.tensors.items()}

    def fetch(fqn: str, region: Any) -> torch.Tensor:
        if fqn in data:
            return data[fqn]
        tensor = dcp_files.read_tensor(index, index.tensors[fqn])
        return torch.zeros(region[1], dtype=tensor.dtype) if fqn in shapes else tensor

    dst.mkdir(parents=True)
    dcp_files.write_dcp(dst, tensors, values, fetch)
    return dst


def megatron_root(dst: Path, edit: Callable[[dict[str, Any]], None] = lambda common: None) -> Path:
    """The torch_dist fixture at ``dst``, its common state changed by ``edit`` (the training
    args left out: their stand-in is not for saving)."""

    def common(values: dict[str, Any]) -> None:
        state = values["common_state/shard_0_1"][0]
        state.pop("args")
        edit(state)

    iteration = rewrite_dcp(MCORE / "iter_0000003", dst / "iter_0000003", edit=common)
    shutil.copy(MCORE / "iter_0000003" / "metadata.json", iteration)
    shutil.copy(MCORE / "latest_checkpointed_iteration.txt", dst)
    return dst


def nested(depth: int) -> Any:
    """A list ``depth`` lists deep."""
    value: Any = 0.9
    for _ in range(depth):
        value = [value]
    return value


def refused(args: list[str], dst: Path, *named: str) -> str:
    """``muonckpt convert ARGS -o DST``: exit 2, one line naming each of ``named``, no
    traceback, nothing written, within seconds; the line."""
    began = time.monotonic()
    result = CliRunner().invoke(app, ["convert", *args, "-o", str(dst)])
    message = result.output.strip()
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (
        f"{result.exception!r}: {result.output}"
    )
    assert "\n" not in message and "Traceback" not in message, message
    assert all(n in message for n in named), (named, message)
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}*"))
    assert time.monotonic() - began < 10, message
    return message


PEAK_RSS = '''
def peak_rss():
    """This process's own peak resident memory in bytes: VmHWM, which starts afresh at exec
    (ru_maxrss does not: it keeps the peak of the process that forked it, here pytest's)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no VmHWM in /proc/self/status")
'''
"""Source of ``peak_rss()`` for the probe scripts that measure a child process's memory."""
