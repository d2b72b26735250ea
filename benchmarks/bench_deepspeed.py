"""Benchmark DeepSpeed conversion (issue 32) beside DeepSpeed's own load of the same checkpoint.

A DeepSpeed 0.19.8 ZeRO job with its Muon (``"optimizer": {"type": "Muon"}``, torch AdamW as
the aux Adam, fp32) of ``--world`` ranks on gloo trains one step of a synthetic model and saves
(untimed): tall-skinny Muon matrices (``layers.<i>.weight``, 256 x 16384, so that DeepSpeed's
Newton-Schulz step stays short on CPU) and an embedding (Adam), sized so that the checkpoint's
files hold about ``--size`` bytes. Then every row runs in a fresh process (peak RSS its own),
the rows interleaved, round by round, ``--repeats`` times:

``DeepSpeed load (world W)``
    what DeepSpeed itself offers: ``engine.load_checkpoint`` in a job of the saving world size
    (built untimed first); the time is the slowest rank's, the growth the largest rank's.
``muonckpt from_deepspeed``
    ``muonckpt.interop.from_deepspeed(src, dst)``: the rank files checked and joined into a
    consolidated muonckpt checkpoint, checksummed, fsynced; one process.
``muonckpt to_deepspeed (world W+1)``
    ``muonckpt.interop.to_deepspeed(that, dst, world=W + 1)``: DeepSpeed's files for another
    world size, which DeepSpeed itself cannot write; one process.

"op" is the operation's wall time alone, measured in the child; "growth" its peak RSS (VmHWM
after, reset just before) minus its RSS before. DeepSpeed runs in its own virtual environment
(``--ds-python``; tests/fixtures/deepspeed/setup_venv.sh makes one), muonckpt in this one::

    python benchmarks/bench_deepspeed.py --size 1GB --repeats 3 --ds-python VENV/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MiB, parse_size, reset_peak_rss, status_bytes

FIXTURE_SCRIPTS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "deepspeed"

ROWS_IN_ORDER = ("deepspeed load", "muonckpt from_deepspeed", "muonckpt to_deepspeed")
MATRIX = (256, 16384)
EMBED = (4096, 256)
TAG = "global_step1"


def layer_count(size: int) -> int:
    """Muon matrices for a checkpoint of about ``size`` bytes: per matrix element the module's
    fp32 weight, the fp32 master and the momentum (whole on each rank its slice overlaps)."""
    per_matrix = MATRIX[0] * MATRIX[1] * 4 * 3
    return max(1, round(size / per_matrix))


def _model(layers: int) -> Any:
    """(DeepSpeed venv) The synthetic model: its loss is linear in every param, so a step's
    gradients are fixed random tensors and the forward costs nothing."""
    import torch
    import torch.nn as nn

    class Synthetic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(*EMBED)
            self.layers = nn.ModuleList(nn.Linear(*MATRIX[::-1], bias=False) for _ in range(layers))

        def forward(self, seed: torch.Tensor) -> torch.Tensor:
            gen = torch.Generator().manual_seed(int(seed))
            loss = (self.embed.weight * torch.randn(EMBED, generator=gen)).sum()
            for layer in self.layers:
                loss = loss + (layer.weight * torch.randn(MATRIX, generator=gen)).sum()
            return loss

    torch.manual_seed(0)
    return Synthetic()


def _engine(layers: int) -> Any:
    """(DeepSpeed venv, one rank) The model in a DeepSpeed ZeRO-1 Muon engine on gloo."""
    import ds_common

    deepspeed = ds_common.init(1800.0)
    model = _model(layers)
    config = ds_common.ds_config(1, "torch_adam", "fp32")
    config["train_micro_batch_size_per_gpu"] = 1
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def _make_rank(rank: int, world: int, layers: int, root: str) -> None:
    import torch

    engine = _engine(layers)
    loss = engine(torch.tensor(rank))
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(root, tag=TAG)


def _load_rank(rank: int, world: int, layers: int, root: str, out: str) -> None:
    engine = _engine(layers)
    before = reset_peak_rss()
    start = time.perf_counter()
    load_path, _ = engine.load_checkpoint(root, tag=TAG)
    seconds = time.perf_counter() - start
    assert load_path is not None, f"DeepSpeed loaded nothing from {root}"
    growth = (status_bytes("VmHWM") - before) / MiB
    Path(out, f"rank{rank}.json").write_text(json.dumps({"op_s": seconds, "growth_mib": growth}))


def deepspeed_child(what: str, world: int, layers: int, root: str, out: str) -> dict:
    """(DeepSpeed venv) Save the checkpoint, or time DeepSpeed's load of it."""
    sys.path.insert(0, str(FIXTURE_SCRIPTS))
    import ds_common

    if what == "make":
        ds_common.launch(_make_rank, world, (layers, root), 3600.0)
        return {}
    ds_common.launch(_load_rank, world, (layers, root, out), 3600.0)
    ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return {
        "op_s": max(r["op_s"] for r in ranks),
        "growth_mib": max(r["growth_mib"] for r in ranks),
    }


def muonckpt_child(what: str, src: str, mid: str, dst: str, world: int) -> dict:
    """(this venv) One muonckpt row."""
    import warnings

    warnings.simplefilter("ignore")
    import torch  # noqa: F401  (imported outside the measured region)

    from muonckpt import interop

    before = reset_peak_rss()
    start = time.perf_counter()
    if what == "muonckpt from_deepspeed":
        interop.from_deepspeed(src, dst)
    else:
        interop.to_deepspeed(mid, dst, world=world + 1)
    return {
        "op_s": time.perf_counter() - start,
        "growth_mib": (status_bytes("VmHWM") - before) / MiB,
    }


def _run(command: list[str]) -> dict:
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1GB")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ds-python",
        default=os.path.join(
            os.environ.get("MUONCKPT_DS_VENV", "~/.cache/muonckpt/deepspeed-0.19.8"), "bin/python"
        ),
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--deepspeed-child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--muonckpt-child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.deepspeed_child:
        what, world, layers, root, out = args.deepspeed_child
        print(json.dumps(deepspeed_child(what, int(world), int(layers), root, out)))
        return
    if args.muonckpt_child:
        what, src, mid, dst, world = args.muonckpt_child
        print(json.dumps(muonckpt_child(what, src, mid, dst, int(world))))
        return

    ds_python = str(Path(args.ds_python).expanduser())
    world, layers = args.world, layer_count(parse_size(args.size))
    root = Path(tempfile.mkdtemp(prefix="bench-ds-", dir=os.environ.get("BENCH_DIR")))
    src, mid, dst, scratch = root / "src", root / "mid", root / "dst", root / "scratch"

    def deepspeed(what: str) -> list[str]:
        child = [ds_python, __file__, "--deepspeed-child", what, str(world), str(layers)]
        return [*child, str(src), str(scratch)]

    def muonckpt(what: str) -> list[str]:
        child = [sys.executable, __file__, "--muonckpt-child", what, str(src), str(mid)]
        return [*child, str(dst), str(world)]

    _run(deepspeed("make"))
    _run(muonckpt("muonckpt from_deepspeed"))
    shutil.move(dst, mid)
    total = _tree_bytes(src / TAG)
    rows: dict[str, list[dict]] = {name: [] for name in ROWS_IN_ORDER}
    for _ in range(args.repeats):
        for name in ROWS_IN_ORDER:
            shutil.rmtree(dst, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
            command = deepspeed("load") if name == "deepspeed load" else muonckpt(name)
            rows[name].append(_run(command))
    shutil.rmtree(root, ignore_errors=True)
    labels = {
        "deepspeed load": f"DeepSpeed load (world {world})",
        "muonckpt from_deepspeed": "muonckpt from_deepspeed",
        "muonckpt to_deepspeed": f"muonckpt to_deepspeed (world {world + 1})",
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
        f"## {args.size}: DeepSpeed checkpoint of {total / MiB:.0f} MiB at world {world}, "
        f"{layers} Muon matrices {MATRIX[0]}x{MATRIX[1]} and an embedding {EMBED[0]}x{EMBED[1]}"
    )
    print("| row | op s (median) | runs | peak RSS growth MiB |")
    print("|---|---|---|---|")
    for name, row in summary.items():
        print(
            f"| {name} | {row['op_s_median']:.2f} | {row['op_s_all']} | "
            f"{row['growth_mib_max']:.0f} |"
        )
    if args.json:
        result = {"bytes": total, "world": world, "layers": layers, "rows": summary}
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
