"""Benchmark per-rank save and load with reshard: muonckpt against the alternatives.

The synthetic state (``synthetic.py``) is sharded at dp x tp (default 2 x 2) in gloo
processes. Every rank saves its share with each tool below, all but the overwrite into a fresh
directory per round (the previous round's output is deleted outside the timing), after one
warm-up round and interleaved round by round, because on a VM the first writes into fresh
page cache run several times slower than later ones and runs vary. Before every timed run the
ranks ``os.sync()`` (untimed), so no variant pays for another's deleted output. DCP, whose save
holds about twice a rank's share in extra memory, runs in warm-up-plus-rounds of its own after
the others (with its DTensor input allocated only then):

``safetensors save_file + fsync`` (the baseline)
    ``safetensors.torch.save_file`` of the rank's local state tensors, then fsync.
``torch.save + fsync (naive)``
    ``torch.save`` of the same tensors plus their regions and full shapes, then fsync.
``DCP dcp.save (HF safetensors, fsyncs)``
    ``torch.distributed.checkpoint.save`` with ``HuggingFaceStorageWriter(save_distributed=
    True)``; it fsyncs every file itself. Its input is DTensor blocks of the same tensors
    (``synthetic.dtensor_state``: DCP cannot express ZeRO-1's flat slices).
``muonckpt.save, new directory`` / ``..., no checksums``
    ``muonckpt.save(opt, new_dir)``; the second with checksumming stubbed out, which shows
    what checksums cost.
``safetensors save_file + fsync, over its previous file``
    the baseline for the overwrite case: the same file name every round, so opening it
    truncates (frees) the previous round's data, as replacing a checkpoint must.
``muonckpt.save, overwrite``
    ``muonckpt.save(opt, same_dir, overwrite=True)`` over the previous checkpoint, which it
    deletes after the atomic swap.

Every muonckpt row saves and loads the optimizer state only (``params=False``), the same
tensors as the baselines; with the default ``params=True`` a save also writes each rank's
param shard (one more tensor of the state's size per Muon param, two thirds of it for AdamW).

A save's job time is its slowest rank's time. Then the checkpoint is loaded into another
topology (default 4 x 1), again warm-up plus interleaved rounds, each into an empty share
(the previous round's result is dropped outside the timing):

``muonckpt.load``
    each rank reads only the pieces overlapping its share, verifying checksums, and proves
    what it restored (the post-load check: two XXH3 passes over its share).
``muonckpt.load, check=False``
    the same without the post-load check, which shows what the check costs.
``naive torch.load + slice``
    each rank ``torch.load``s every old rank's ``torch.save`` file, one at a time, and copies
    what overlaps its share (checked equal to ``muonckpt.load``'s result).
``read the share's bytes from page cache`` (the load's floor and baseline)
    each rank reads as many bytes as its share holds from the checkpoint's data files, in
    one contiguous run of their concatenation (rank r the r-th share), with ``readinto`` into a
    tensor it allocates for them, as a load allocates its state; the files are in page cache
    (the warm-up load read them).

Rows show median and min job seconds over ``--repeats`` rounds, GB/s of the median (whole
state / job time), the max over ranks and rounds (warm-up included) of a rank's peak RSS during
the operation (VmHWM, reset just before; the rank also holds the state, and for DCP a DTensor
copy of it) and of its growth over its RSS before, and the ratio to save_file.

    python benchmarks/bench_checkpoint.py --size 1GB --dp 2 --tp 2 --to-dp 4 --to-tp 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import (
    MiB,
    checkpoint_notes,
    fsync_path,
    make_workdir,
    parse_size,
    print_table,
    reset_peak_rss,
    status_bytes,
    summary_row,
)
from synthetic import (
    build_optimizer,
    dtensor_state,
    fill_state,
    largest_tensor_bytes,
    local_regions,
    model_shapes,
    naive_payload,
    naive_share,
    param_of,
    state_bytes,
)
from torch.distributed.checkpoint import HuggingFaceStorageWriter

import muonckpt
from muonckpt import storage
from muonckpt.distributed import run_distributed

SAVES = {
    "save_file": "safetensors save_file + fsync",
    "torch_save": "torch.save + fsync (naive)",
    "dcp": "DCP dcp.save (HF safetensors, fsyncs)",
    "muonckpt": "muonckpt.save, new directory",
    "save_file_overwrite": "safetensors save_file + fsync, over its previous file",
    "muonckpt_overwrite": "muonckpt.save, overwrite",
    "muonckpt_no_checksums": "muonckpt.save, new directory, no checksums",
}
LOADS = {  # naive last: its result, checked after the rounds, is the last one held
    "floor": "read the share's bytes from page cache",
    "muonckpt": "muonckpt.load",
    "muonckpt_unchecked": "muonckpt.load, check=False",
    "naive": "naive torch.load + slice",
}


def _rounds(variants: dict[str, Callable[[int], object]], repeats: int, reset=None) -> dict:
    """Warm-up plus ``repeats`` interleaved rounds of every variant on every rank.

    ``variants[key](round)`` runs one operation; ``reset(key, round)`` runs before it, outside
    the timing. Returns this rank's seconds per measured round and its RSS peaks and growths.
    """
    out: dict = {"seconds": {}, "peak_rss": {}, "rss_growth": {}}
    for round_ in range(repeats + 1):
        for key, run in variants.items():
            if reset:
                reset(key, round_)
            # Deletions (of outputs, or of the checkpoint an overwrite replaced) on a filesystem
            # mounted with `discard` queue work that the next fsync waits for: settle it here,
            # untimed, so no variant pays for another's.
            dist.barrier()
            os.sync()
            dist.barrier()
            before = reset_peak_rss()
            start = time.perf_counter()
            run(round_)
            elapsed = time.perf_counter() - start
            peak = status_bytes("VmHWM")
            if round_:
                out["seconds"].setdefault(key, []).append(elapsed)
            out["peak_rss"][key] = max(out["peak_rss"].get(key, 0), peak)
            out["rss_growth"][key] = max(out["rss_growth"].get(key, 0), peak - before)
    return out


def save_worker(shapes, dp: int, tp: int, workdir: str, repeats: int) -> dict:
    """One rank of the save benchmark; leaves the last round's muonckpt and torch.save output."""
    opt = build_optimizer(shapes, dp, tp)
    local = fill_state(opt)
    naive = naive_payload(opt, local, shapes, tp)
    rank = dist.get_rank()
    root = Path(workdir)

    def out(key: str, round_: int) -> Path:
        return root / key / f"round-{round_}"

    def save_file_at(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file(local, str(path))
        fsync_path(path)

    def save_file(round_: int) -> None:
        save_file_at(out("save_file", round_) / f"rank-{rank:05d}.safetensors")

    def torch_save(round_: int) -> None:
        path = out("torch_save", round_) / f"rank-{rank:05d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(naive, path)
        fsync_path(path)

    def no_checksums(round_: int) -> None:
        writer = storage.safetensors_writer  # where the writers look chunk_digests up
        real = writer.chunk_digests

        def zero_digests(data, chunk_bytes=storage.CHUNK_BYTES) -> bytes:
            # as many 8-byte digests as real ones, all zero, so the manifest keeps its shape
            return bytes(8 * -(-memoryview(data).nbytes // chunk_bytes))

        writer.chunk_digests = zero_digests
        try:
            muonckpt.save(opt, out("muonckpt_no_checksums", round_), params=False)
        finally:
            writer.chunk_digests = real

    def drop_previous(key: str, round_: int) -> None:
        if rank == 0 and round_:
            shutil.rmtree(out(key, round_ - 1), ignore_errors=True)

    variants = {
        "save_file": save_file,
        "torch_save": torch_save,
        "muonckpt": lambda r: muonckpt.save(opt, out("muonckpt", r), params=False),
        "save_file_overwrite": lambda r: save_file_at(root / "overwrite-file" / f"{rank}.st"),
        "muonckpt_overwrite": lambda r: muonckpt.save(
            opt, root / "overwrite", overwrite=True, params=False
        ),
        "muonckpt_no_checksums": no_checksums,
    }
    result = _rounds(variants, repeats, reset=drop_previous)
    # DCP runs in rounds of its own, after the others: its save holds about twice the rank's
    # share in extra memory, and whichever variant ran right after it was measured up to 2x
    # slower (4 GB state), so interleaving it would tax its neighbour, not itself.
    dtensors = dtensor_state(shapes, dp, tp)

    def dcp_save(round_: int) -> None:
        writer = HuggingFaceStorageWriter(str(out("dcp", round_)), save_distributed=True)
        dcp.save(dtensors, storage_writer=writer)

    for field, values in _rounds({"dcp": dcp_save}, repeats, reset=drop_previous).items():
        result[field].update(values)
    assert set(result["seconds"]) == set(SAVES)
    start = time.perf_counter()
    for tensor in local.values():
        storage.checksum_chunks(storage.byte_view(tensor.reshape(-1)))
    result["checksum_alone_s"] = time.perf_counter() - start
    result["bytes"] = sum(t.numel() * t.element_size() for t in local.values())
    dist.barrier()
    if rank == 0:  # keep only what the load benchmark reads
        for path in root.iterdir():
            if path.name not in ("muonckpt", "torch_save"):
                shutil.rmtree(path, ignore_errors=True)
    return result


def load_worker(shapes, dp: int, tp: int, ckpt: str, naive_dir: str, repeats: int) -> dict:
    """One rank of the load benchmark (into dp x tp); the naive result is checked at the end."""
    opt = build_optimizer(shapes, dp, tp)
    regions = local_regions(opt)
    files = sorted(Path(naive_dir).glob("rank-*.pt"))
    held: dict = {}

    def drop(key: str, round_: int) -> None:
        opt.state.clear()
        held.clear()

    share = _share_bytes(opt, ckpt)
    variants = {
        "floor": lambda r: _read_run(sorted(Path(ckpt).glob("*.safetensors")), share),
        "muonckpt": lambda r: muonckpt.load(opt, ckpt, params=False),
        "muonckpt_unchecked": lambda r: muonckpt.load(opt, ckpt, params=False, check=False),
        "naive": lambda r: held.update(naive_share(files, regions)),
    }
    assert list(variants) == list(LOADS)
    result = _rounds(variants, repeats, reset=drop)
    result["share_bytes"] = sum(t.numel() * t.element_size() for t in held.values())
    assert result["share_bytes"] == share, (result["share_bytes"], share)
    muonckpt.load(opt, ckpt, params=False)
    named = [zip(g["param_names"], g["params"], strict=True) for g in opt.param_groups]
    params = {n: p for pairs in named for n, p in pairs}
    for tkey, naive in held.items():
        value = opt.state[params[param_of(tkey)]][tkey.rsplit(".", 1)[1]]
        assert torch.equal(naive, value.reshape(-1)), f"naive load differs at {tkey}"
    tensors = [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]
    ours = sum(t.numel() * t.element_size() for t in tensors)
    assert ours == result["share_bytes"], "naive load missed part of the share"
    return result


def _share_bytes(opt: torch.optim.Optimizer, ckpt: str) -> int:
    """The bytes of this rank's share of the state, from a load of ``ckpt`` (dropped after)."""
    muonckpt.load(opt, ckpt, params=False)
    tensors = [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]
    opt.state.clear()
    return sum(t.numel() * t.element_size() for t in tensors)


def _read_run(files: list[Path], nbytes: int) -> torch.Tensor:
    """``nbytes`` read into a new tensor from this rank's run of ``files`` concatenated (rank r
    starts at r * nbytes, wrapping around)."""
    sizes = [f.stat().st_size for f in files]
    start = dist.get_rank() * nbytes % sum(sizes)
    out = torch.empty(nbytes, dtype=torch.uint8)
    view, done = memoryview(out.numpy()), 0
    while done < nbytes:
        for path, size in zip(files, sizes, strict=True):
            if start >= size:
                start -= size
                continue
            with open(path, "rb", buffering=0) as f:
                f.seek(start)
                want = min(size - start, nbytes - done)
                got = f.readinto(view[done : done + want])
                assert got == want, (path, got, want)
                done += want
            start = 0
            if done == nbytes:
                break
    return out


def _rows(operation: str, labels: dict, ranks: list[dict], total: int, baseline: str | None):
    """Summary rows: job time per round is the slowest rank's; RSS is the worst rank's."""
    jobs = {
        k: [max(t) for t in zip(*(r["seconds"][k] for r in ranks), strict=True)] for k in labels
    }
    base = statistics.median(jobs[baseline]) if baseline else None
    return [
        summary_row(
            operation,
            label,
            jobs[key],
            total,
            baseline_s=base,
            peak_rss=max(r["peak_rss"][key] for r in ranks),
            rss_growth=max(r["rss_growth"][key] for r in ranks),
        )
        for key, label in labels.items()
    ]


def run(size: str, dp: int, tp: int, to_dp: int, to_tp: int, repeats: int, where: Path) -> dict:
    """Both benchmarks at one size, in a temp dir under ``where``; the JSON-ready result."""
    shapes = model_shapes(parse_size(size))
    total = state_bytes(shapes)
    workdir = Path(tempfile.mkdtemp(prefix=f"muonckpt-bench-{size}-", dir=where))
    try:
        saves = run_distributed(
            save_worker, dp * tp, shapes, dp, tp, str(workdir), repeats, timeout=7200
        )
        ckpt = workdir / "muonckpt" / f"round-{repeats}"
        naive = workdir / "torch_save" / f"round-{repeats}"
        loads = run_distributed(
            load_worker,
            to_dp * to_tp,
            shapes,
            to_dp,
            to_tp,
            str(ckpt),
            str(naive),
            repeats,
            timeout=7200,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    move = f"load with reshard {dp}x{tp} -> {to_dp}x{to_tp}"
    rows = _rows("save", SAVES, saves, total, "save_file")
    rows += _rows(move, LOADS, loads, total, "floor")
    by_tool = {r["tool"]: r["median_s"] for r in rows}
    bound = largest_tensor_bytes(shapes) + 200 * MiB
    return {
        "size": size,
        "state_bytes": total,
        "from": f"{dp}x{tp}",
        "to": f"{to_dp}x{to_tp}",
        "rows": rows,
        "checksums_add": by_tool[SAVES["muonckpt"]] / by_tool[SAVES["muonckpt_no_checksums"]] - 1,
        "overwrite_ratio": by_tool[SAVES["muonckpt_overwrite"]]
        / by_tool[SAVES["save_file_overwrite"]],
        "load_bound_ok": all(
            r["rss_growth"]["muonckpt"] <= r["share_bytes"] + bound for r in loads
        ),
        "saves": saves,
        "loads": loads,
    }


def print_result(res: dict) -> None:
    print(
        f"\n### {res['size']}: {res['state_bytes'] / MiB:.0f} MiB fp32 state, saved at "
        f"{res['from']}, loaded into {res['to']}\n"
    )
    print_table(res["rows"])
    print("\n" + checkpoint_notes(res))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GB", help="total optimizer state, e.g. 256MB, 1GB")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--to-dp", type=int, default=4, help="load target dp")
    parser.add_argument("--to-tp", type=int, default=1, help="load target tp")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds after warm-up")
    parser.add_argument(
        "--workdir", type=make_workdir, default=None, help="where to write (default: system temp)"
    )
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.gettempdir())
    res = run(args.size, args.dp, args.tp, args.to_dp, args.to_tp, args.repeats, workdir)
    print_result(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
