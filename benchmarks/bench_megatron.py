"""Benchmark Megatron-Core conversion (issue 33) beside Megatron's own load of the same checkpoint.

A Megatron-Core 0.19.2 job with its layer-wise Muon (``LayerWiseDistributedOptimizer`` over
emerging-optimizers' ``TensorParallelMuon`` and AdamW, bf16, CPU through the shim of
``tests/fixtures/megatron/shim.py``) at TP 2, DP 1 on gloo trains one step of a GPT (4 layers,
ffn twice the hidden size, vocab 1024; the hidden size chosen so that the checkpoint holds
about ``--size`` bytes) and saves it as ``--ckpt-format torch_dist`` (untimed; the fixtures'
``make_fixtures.py`` code). Then every row runs in a fresh process (peak RSS its own), the
rows interleaved, round by round, ``--repeats`` times:

``Megatron load (TP 2, DP 1)``
    what Megatron itself does to resume: ``dist_checkpointing.load`` of the model's and the
    optimizer's sharded state dicts then ``load_state_dict`` (``tests/fixtures/megatron/
    mc_load.py``'s ``load``), in a job of the saving layout (built untimed first); the time is
    the slowest rank's, the growth the largest rank's.
``muonckpt from_megatron``
    ``muonckpt.interop.from_megatron(src, dst)``: the DCP files read per layer into a
    consolidated muonckpt checkpoint, checksummed, fsynced; one process.
``muonckpt to_megatron (TP 1, DP 2)``
    ``muonckpt.interop.to_megatron(that, dst, tp=1, dp=2)``: a torch_dist checkpoint for
    another layout; one process.

"op" is the operation's wall time alone, measured in the child; "growth" its peak RSS (VmHWM
after, reset just before) minus its RSS before. Megatron runs in its own Python 3.12 venv
(``--mc-python``; made as ``make_fixtures.py`` says), muonckpt in this one::

    python benchmarks/bench_megatron.py --size 1GB --repeats 3 --mc-python VENV/bin/python
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MiB, parse_size, reset_peak_rss, status_bytes

FIXTURE_SCRIPTS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "megatron"

ROWS_IN_ORDER = ("megatron load", "muonckpt from_megatron", "muonckpt to_megatron")
LAYERS, VOCAB, HEAD_DIM, TP = 4, 1024, 128, 2


def hidden_size(size: int) -> int:
    """The hidden size (a multiple of :data:`HEAD_DIM`, so that TP 2 splits its heads of 64)
    for a checkpoint of about ``size`` bytes: per layer 8 h^2 Muon elements at 10 bytes (the
    bf16 weight, the fp32 master and momentum), the embedding and output layer 2 * vocab * h
    AdamW ones at 14."""
    a, b = 80 * LAYERS, 28 * VOCAB
    h = (-b + math.sqrt(b * b + 4 * a * size)) / (2 * a)
    return max(HEAD_DIM, round(h / HEAD_DIM) * HEAD_DIM)


def _rank(rank: int, what: str, hidden: int, root: str, out: str, port: int) -> None:
    """(Megatron venv, one rank) Train one step and save, or time Megatron's load."""
    sys.path.insert(0, str(FIXTURE_SCRIPTS))
    import make_fixtures
    import mc_load
    import torch.distributed as dist

    make_fixtures.start(rank, TP, port)
    gpt, ddp, opt = make_fixtures.build(TP, hidden, LAYERS, hidden // 64, VOCAB)  # heads of 64
    if what == "make":
        make_fixtures.train(ddp, opt, range(1), VOCAB)
        make_fixtures.save(gpt, ddp, opt, root, "dp_reshardable")
    else:
        before = reset_peak_rss()
        start = time.perf_counter()
        mc_load.load(gpt, opt, root)
        seconds = time.perf_counter() - start
        growth = (status_bytes("VmHWM") - before) / MiB
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"op_s": seconds, "growth_mib": growth})
        )
    dist.barrier()
    dist.destroy_process_group()


def megatron_child(what: str, hidden: int, root: str, out: str, port: int) -> dict:
    """(Megatron venv) Save the checkpoint, or time Megatron's load of it."""
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(what, hidden, root, out, port), nprocs=2, start_method="spawn")
    if what == "make":
        return {}
    ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    return {
        "op_s": max(r["op_s"] for r in ranks),
        "growth_mib": max(r["growth_mib"] for r in ranks),
    }


def muonckpt_child(what: str, src: str, mid: str, dst: str) -> dict:
    """(this venv) One muonckpt row."""
    import warnings

    warnings.simplefilter("ignore")
    import torch  # noqa: F401  (imported outside the measured region)

    from muonckpt import interop

    before = reset_peak_rss()
    start = time.perf_counter()
    if what == "muonckpt from_megatron":
        interop.from_megatron(src, dst)
    else:
        interop.to_megatron(mid, dst, tp=1, dp=2)
    return {
        "op_s": time.perf_counter() - start,
        "growth_mib": (status_bytes("VmHWM") - before) / MiB,
    }


def _run(command: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _table(args: argparse.Namespace, hidden: int, total: int, rows: dict[str, list[dict]]) -> None:
    labels = {
        "megatron load": f"Megatron load (TP {TP}, DP 1)",
        "muonckpt from_megatron": "muonckpt from_megatron",
        "muonckpt to_megatron": "muonckpt to_megatron (TP 1, DP 2)",
    }
    summary = {
        labels[name]: {
            "op_s_median": statistics.median(r["op_s"] for r in runs),
            "op_s_all": [round(r["op_s"], 3) for r in runs],
            "growth_mib_max": max(r["growth_mib"] for r in runs),
        }
        for name, runs in rows.items()
    }
    print(
        f"## {args.size}: Megatron torch_dist checkpoint of {total / MiB:.0f} MiB at TP {TP} "
        f"DP 1, GPT of {LAYERS} layers, hidden {hidden}, vocab {VOCAB}"
    )
    print("| row | op s (median) | runs | peak RSS growth MiB |")
    print("|---|---|---|---|")
    for name, row in summary.items():
        print(
            f"| {name} | {row['op_s_median']:.2f} | {row['op_s_all']} | "
            f"{row['growth_mib_max']:.0f} |"
        )
    if args.json:
        result = {"bytes": total, "hidden": hidden, "rows": summary}
        Path(args.json).write_text(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1GB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--mc-python",
        default=os.path.join(
            os.environ.get("MUONCKPT_MEGATRON_VENV", "~/.cache/muonckpt/megatron-core-0.19.2"),
            "bin/python",
        ),
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--megatron-child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--muonckpt-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.megatron_child:
        what, hidden, root, out = args.megatron_child
        print(json.dumps(megatron_child(what, int(hidden), root, out, _free_port())))
        return
    if args.muonckpt_child:
        print(json.dumps(muonckpt_child(*args.muonckpt_child)))
        return

    mc_python = str(Path(args.mc_python).expanduser())
    hidden = hidden_size(parse_size(args.size))
    root = Path(tempfile.mkdtemp(prefix="bench-mc-", dir=os.environ.get("BENCH_DIR")))
    src, mid, dst, scratch = root / "src", root / "mid", root / "dst", root / "scratch"
    scratch.mkdir()

    def megatron(what: str) -> list[str]:
        return [mc_python, __file__, "--megatron-child", what, str(hidden), str(src), str(scratch)]

    def muonckpt(what: str) -> list[str]:
        return [sys.executable, __file__, "--muonckpt-child", what, str(src), str(mid), str(dst)]

    _run(megatron("make"))
    _run(muonckpt("muonckpt from_megatron"))
    shutil.move(dst, mid)
    total = _tree_bytes(src)
    rows: dict[str, list[dict]] = {name: [] for name in ROWS_IN_ORDER}
    for _ in range(args.repeats):
        for name in ROWS_IN_ORDER:
            shutil.rmtree(dst, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
            command = megatron("load") if name == "megatron load" else muonckpt(name)
            rows[name].append(_run(command))
    shutil.rmtree(root, ignore_errors=True)
    _table(args, hidden, total, rows)


if __name__ == "__main__":
    main()
