"""consolidate / reshard shared by several processes (``collective=True``: the ranks of a
default process group, as torchrun starts them), each writing its share of the files written
together.

Real multi-process runs against the single-process output of the same command: every file,
the manifest included, must be byte for byte the same.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import muonckpt
from muonckpt.distributed.launch import run_distributed
from muonckpt.errors import DistributedRunError
from muonckpt.format.names import CONSOLIDATED_FILE, MODEL_FILE, rank_file
from muonckpt.offline import tools as offline
from muonckpt.storage import SafetensorsReader, SafetensorsWriter, SharedSafetensorsFile

from .fixture_model import BUCKET_NUMEL, TP_SPLIT_DIMS, build, initial_params

SPLIT, DIM = next(iter(TP_SPLIT_DIMS.items()))  # one param split, the others replicated
# Every layout option away from its default, so that ranks given other options would differ.
RESHARD = {
    "dp": 2,
    "tp": 2,
    "tp_split_dims": {SPLIT: DIM},
    "options": muonckpt.layout.topology.LayoutOptions(
        bucket_numel=BUCKET_NUMEL, param_alignment=4, bucket_alignment=8, buffers_by="group"
    ),
}
RESHARD_ARGS = [
    *("--dp", "2", "--tp", "2", "--tp-split", f"{SPLIT}={DIM}"),
    *("--bucket-numel", str(BUCKET_NUMEL)),
    *("--param-alignment", "4", "--bucket-alignment", "8", "--buffers-by", "group"),
]


@pytest.fixture(autouse=True)
def _bounded(monkeypatch):
    monkeypatch.setattr(offline, "WORKER_TIMEOUT", 60.0)


@pytest.fixture(scope="module")
def single(tmp_path_factory, single_ckpt):
    """A single-process checkpoint of the fixture model, and the serial outputs to compare with."""
    tmp = tmp_path_factory.mktemp("shared")
    src = single_ckpt(2)
    return {
        "src": src,
        "consolidated": offline.consolidate(src, tmp / "c"),
        "sharded": offline.consolidate(src, tmp / "s", max_shard_size=800),
        "resharded": offline.reshard(src, tmp / "r", **RESHARD),
    }


def assert_same_files(expected, actual):
    names = sorted(p.name for p in expected.iterdir())
    assert sorted(p.name for p in actual.iterdir()) == names
    for name in names:
        assert (actual / name).read_bytes() == (expected / name).read_bytes(), name


def assert_nothing_left(parent, name):
    assert not (parent / name).exists()
    assert [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")] == []


def test_shared_file_written_out_of_order_equals_the_streamed_one(tmp_path):
    tensors = {"b": torch.arange(6.0).view(2, 3), "a": torch.arange(4), "z": torch.empty(0)}
    specs = {
        k: (("F32", "I64", "F32")[i], tuple(v.shape)) for i, (k, v) in enumerate(tensors.items())
    }
    with SafetensorsWriter(tmp_path / "s.safetensors", specs, {"k": "v"}) as out:
        for key in out.pending:
            out.write(key, tensors[key])
        streamed = out.commit()
    first = SharedSafetensorsFile(tmp_path / "p.safetensors", specs, {"k": "v"})
    second = SharedSafetensorsFile(tmp_path / "p.safetensors", specs, {"k": "v"})
    first.create()
    records = {"b": first.write("b", tensors["b"]), "z": first.write("z", tensors["z"])}
    records["a"] = second.write("a", tensors["a"].view(2, 2))
    with pytest.raises(muonckpt.CheckpointError, match="declared I64"):
        second.write("a", torch.zeros(4))
    first.close()
    second.close()
    assert not (tmp_path / "p.safetensors").exists()
    first.commit()
    assert records == streamed
    assert (tmp_path / "p.safetensors").read_bytes() == (tmp_path / "s.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors", "s.safetensors"]


def _shared(operation: str, src: str, dst: str, options: dict) -> list:
    """(each rank) ``operation`` shared among the ranks (``collective``): the output's path
    and the progress this rank reported."""
    calls: list = []
    out = getattr(offline, operation)(
        src, dst, collective=True, progress=lambda *update: calls.append(update), **options
    )
    return [str(out), calls]


def _run(operation, ranks, src, dst, **options):
    return run_distributed(_shared, ranks, operation, str(src), str(dst), options, timeout=120)


@pytest.mark.dist
@pytest.mark.parametrize("ranks", [2, 3])
def test_consolidate_shared_among_ranks_is_byte_identical(single, tmp_path, ranks):
    (out, calls), *others = _run("consolidate", ranks, single["src"], tmp_path / "c")
    out = Path(out)
    assert_same_files(single["consolidated"], out)
    assert muonckpt.verify(out) == []
    assert all(shown == [] for _, shown in others)  # rank 0's progress stands for the job
    total = count = 0
    for file in (CONSOLIDATED_FILE, MODEL_FILE):
        with SafetensorsReader(out / file) as reader:
            keys = reader.keys()
            total += sum(reader.record(k).nbytes for k in keys)
            count += len(keys)
    assert calls[0] == (0, total, 0, count) and calls[-1] == (total, total, count, count)
    sharded = _run("consolidate", ranks, single["src"], tmp_path / "s", max_shard_size=800)[0][0]
    assert len(muonckpt.read_manifest(sharded).files) > 1
    assert_same_files(single["sharded"], Path(sharded))


@pytest.mark.dist
@pytest.mark.parametrize("ranks", [2, 3])
def test_reshard_shared_among_ranks_is_byte_identical_and_loads(single, tmp_path, ranks):
    out = Path(_run("reshard", ranks, single["src"], tmp_path / "r", **RESHARD)[0][0])
    assert_same_files(single["resharded"], out)
    assert muonckpt.verify(out) == []
    assert muonckpt.read_manifest(out).topology == {"dp": 2, "tp": 2}
    opt, *_ = build(1, 1, initial_params())
    muonckpt.load(opt, out)
    reference, *_ = build(1, 1, initial_params())
    muonckpt.load(reference, single["src"])
    for p, q in zip(opt.param_groups[0]["params"], reference.param_groups[0]["params"]):
        for key, value in reference.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.dist
def test_an_error_on_one_rank_fails_the_whole_run(single, tmp_path):
    damaged = shutil.copytree(single["src"], tmp_path / "damaged")
    data = damaged / rank_file(0, 1)
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF  # in one tensor's data, which only one of the ranks reads
    data.write_bytes(bytes(raw))
    with pytest.raises(DistributedRunError, match="checksum mismatch") as caught:
        _run("consolidate", 2, damaged, tmp_path / "c")
    assert rank_file(0, 1) in str(caught.value)
    assert_nothing_left(tmp_path, "c")
    with pytest.raises(DistributedRunError, match="checksum mismatch"):
        _run("reshard", 3, damaged, tmp_path / "r", **RESHARD)
    assert_nothing_left(tmp_path, "r")
    with pytest.raises(DistributedRunError, match="already exists"):
        _run("consolidate", 2, single["src"], single["consolidated"])
    with pytest.raises(muonckpt.CheckpointError, match="process group"):
        offline.reshard(single["src"], tmp_path / "x", collective=True, **RESHARD)
    assert_nothing_left(tmp_path, "x")


@pytest.mark.dist
def test_torchrun_ranks_share_the_work(single, tmp_path):
    out = tmp_path / "r"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "muonckpt.cli",
            "reshard",
            str(single["src"]),
            *RESHARD_ARGS,
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("wrote ") == 1, done.stderr
    assert_same_files(single["resharded"], out)
