"""Benchmark muonckpt.save / muonckpt.load against safetensors on a synthetic Muon state.

Per-rank save at dp x tp versus ``safetensors.torch.save_file`` of the same local tensors on
the same rank, and load with reshard into another dp x tp with each rank's peak RSS. The state
is transformer-shaped fp32 (qkv/proj/up/down matrices in Muon groups, norms and embeddings in
AdamW groups) and filled with random values instead of training (bf16 Newton-Schulz is slow on
CPUs), which changes nothing for I/O.

    python benchmarks/bench_checkpoint.py --size 1GB --dp 2 --tp 2 --to-dp 4 --to-tp 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
from procstat import reset_peak_rss, status_bytes

import muonckpt
from muonckpt import storage
from muonckpt.collectives import grid_groups
from muonckpt.launch import run_distributed
from muonckpt.layout import Topology
from muonckpt.storage import checksum_chunks


def parse_size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    for suffix, scale in units.items():
        if text.upper().endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


def model_shapes(state_bytes: int, hidden: int = 1024) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (shape, tp_split_dim) for enough layers to make ``state_bytes`` of fp32 state."""
    layer = {
        "attn.qkv.weight": ((3 * hidden, hidden), 0),
        "attn.proj.weight": ((hidden, hidden), 1),
        "mlp.up.weight": ((4 * hidden, hidden), 0),
        "mlp.down.weight": ((hidden, 4 * hidden), 1),
        "norm1.weight": ((hidden,), -1),
        "norm2.weight": ((hidden,), -1),
    }
    per_layer = sum(_numel(s) * (1 if s.__len__() == 2 else 2) for s, _ in layer.values()) * 4
    layers = max(1, state_bytes // per_layer)
    shapes = {"embed.weight": ((8 * hidden, hidden), 0)}
    for i in range(layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _groups(shapes):
    """Param values do not matter for I/O: untouched ``empty`` pages cost no memory."""
    muon, adamw = [], []
    for name, (shape, _) in shapes.items():
        target = muon if len(shape) == 2 and not name.startswith("embed") else adamw
        target.append((name, torch.empty(shape)))
    return [{"params": muon, "use_muon": True}, {"params": adamw}]


def _build(shapes, dp: int, tp: int):
    dp_group, tp_group = grid_groups(dp, tp)
    split = {n: d for n, (_, d) in shapes.items() if d >= 0}
    sharded = muonckpt.shard_param_groups(
        _groups(shapes),
        Topology(dp, tp),
        dist.get_rank(dp_group),
        dist.get_rank(tp_group),
        tp_split_dims=split,
        bucket_numel=40_000_000,
    )
    opt = muonckpt.Muon(sharded.param_groups)
    opt.enable_distributed_mode(sharded.global_buffer_sizes, dp_group, tp_group, sharded.dist_metas)
    return opt


def _fill_state(opt) -> dict[str, torch.Tensor]:
    """Random state, as after some steps; returns the tensors a rank writes, by file key."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    local = {}
    for group in opt.param_groups:
        group["step"] = 10
        keys = ("momentum_buffer",) if group.get("use_muon") else ("exp_avg", "exp_avg_sq")
        for name, p in zip(group["param_names"], group["params"], strict=True):
            for key in keys:
                value = torch.empty_like(p).uniform_(-1, 1, generator=gen)
                opt.state[p][key] = value
                local[f"state.{name}.{key}"] = value
    return local


def save_worker(shapes, dp: int, tp: int, workdir: str, repeats: int) -> dict[str, float]:
    """Fastest of ``repeats`` rounds, after one warm-up round, of three saves each.

    On the VM these numbers come from, the first writes into fresh page cache run several times
    slower than later ones, so every variant is warmed up and measured in turn: a plain
    ``save_file`` + fsync, ``muonckpt.save`` with checksums stubbed out, and ``muonckpt.save``.
    The real ``muonckpt.save`` runs last, so the load benchmark reads a real checkpoint.
    """
    opt = _build(shapes, dp, tp)
    local = _fill_state(opt)
    rank = dist.get_rank()
    nbytes = sum(t.numel() * t.element_size() for t in local.values())
    plain = Path(workdir) / f"plain-{rank}.safetensors"

    def save_file() -> None:
        safetensors.torch.save_file(local, str(plain))
        fd = os.open(plain, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def save_bare() -> None:
        real = storage.checksum_chunks
        storage.checksum_chunks = lambda data, chunk_bytes=storage.CHUNK_BYTES: ()
        try:
            muonckpt.save(opt, Path(workdir) / "ckpt", overwrite=True)
        finally:
            storage.checksum_chunks = real

    def save_ours() -> None:
        muonckpt.save(opt, Path(workdir) / "ckpt", overwrite=True)

    variants = {
        "safetensors_s": save_file,
        "muonckpt_no_checksum_s": save_bare,
        "muonckpt_s": save_ours,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeats + 1):
        for name, save in variants.items():
            dist.barrier()
            start = time.perf_counter()
            save()
            if round_:
                times[name].append(time.perf_counter() - start)
    plain.unlink()
    start = time.perf_counter()
    for tensor in local.values():
        checksum_chunks(tensor.reshape(-1).view(torch.uint8))
    crc = time.perf_counter() - start
    return {"bytes": nbytes, "checksum_s": crc, **{k: min(v) for k, v in times.items()}}


def load_worker(shapes, dp: int, tp: int, workdir: str) -> dict[str, float]:
    opt = _build(shapes, dp, tp)
    share = sum(
        p.numel() * p.element_size() * (1 if g.get("use_muon") else 2)
        for g in opt.param_groups
        for p in g["params"]
    )
    largest = max(_numel(s) * 4 for s, _ in shapes.values())
    before = reset_peak_rss()
    dist.barrier()
    start = time.perf_counter()
    muonckpt.load(opt, Path(workdir) / "ckpt")
    elapsed = time.perf_counter() - start
    peak = status_bytes("VmHWM")
    return {
        "load_s": elapsed,
        "share_bytes": share,
        "largest_bytes": largest,
        "rss_before": before,
        "peak_rss": peak,
        "peak_growth": peak - before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GB", help="total optimizer state, e.g. 256MB, 1GB")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--to-dp", type=int, default=4)
    parser.add_argument("--to-tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args()
    shapes = model_shapes(parse_size(args.size))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="muonckpt-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        saves = run_distributed(
            save_worker,
            args.dp * args.tp,
            shapes,
            args.dp,
            args.tp,
            str(workdir),
            args.repeats,
            timeout=1800,
        )
        loads = run_distributed(
            load_worker,
            args.to_dp * args.to_tp,
            shapes,
            args.to_dp,
            args.to_tp,
            str(workdir),
            timeout=1800,
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    total = sum(s["bytes"] for s in saves)
    ratio = max(s["muonckpt_s"] / s["safetensors_s"] for s in saves)
    slowest = max(s["safetensors_s"] for s in saves)
    job = max(s["muonckpt_s"] for s in saves)
    result = {
        "state_bytes": total,
        "from": f"{args.dp}x{args.tp}",
        "to": f"{args.to_dp}x{args.to_tp}",
        "save_ratio_worst_rank": ratio,
        "save_ratio_job": job / slowest,
        "saves": saves,
        "loads": loads,
        "load_bound_ok": all(
            r["peak_growth"] <= r["share_bytes"] + r["largest_bytes"] + 200 * 2**20 for r in loads
        ),
    }
    print(
        f"state {total / 2**30:.2f} GiB, save {args.dp}x{args.tp}, load into "
        f"{args.to_dp}x{args.to_tp}"
    )
    print("| rank | bytes | save_file s | muonckpt.save s | ratio | crc32 alone s |")
    print("|---|---|---|---|---|---|")
    for rank, s in enumerate(saves):
        print(
            f"| {rank} | {s['bytes'] / 2**20:.0f} MiB | {s['safetensors_s']:.2f} | "
            f"{s['muonckpt_s']:.2f} | {s['muonckpt_s'] / s['safetensors_s']:.2f} | "
            f"{s['checksum_s']:.2f} |"
        )
    print(
        f"job: slowest save_file {slowest:.2f} s, muonckpt.save {job:.2f} s, "
        f"ratio {job / slowest:.2f}; worst single-rank ratio {ratio:.2f}"
    )
    bare = max(s["muonckpt_no_checksum_s"] for s in saves)
    print(f"muonckpt.save without checksums {bare:.2f} s: checksums add {job / bare - 1:.0%}")
    print("\n| rank | load s | share MiB | largest MiB | RSS growth MiB | bound MiB |")
    print("|---|---|---|---|---|---|")
    for rank, r in enumerate(loads):
        bound = (r["share_bytes"] + r["largest_bytes"]) / 2**20 + 200
        print(
            f"| {rank} | {r['load_s']:.2f} | {r['share_bytes'] / 2**20:.0f} | "
            f"{r['largest_bytes'] / 2**20:.0f} | {r['peak_growth'] / 2**20:.0f} | {bound:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
