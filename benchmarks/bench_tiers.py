"""Benchmark the node-local tier (issue 56): save and recover from the local tier with one
replica, against the same from the durable tier, at 2 and 3 simulated nodes of 2 ranks.

Each simulated node is a ``torchrun --nnodes N --node-rank k`` launcher over a 127.0.0.1
rendezvous with a directory of its own (the node's local root); the durable tier is a
directory every node reaches. The synthetic state (``synthetic.py``) is ``--size`` per rank
(default 256MB, fp32, optimizer state and params), at dp = ranks x tp 1. After one
untimed round (the tier's gloo group is made in the first tiered save), every round, each
job times (its slowest rank; ``os.sync()`` and a barrier before each, untimed):

``save: local tier (R=1)``
    ``muonckpt.save(opt, path, tier=LocalTier(root, replicas=1))``: each rank's files to its
    node, copied to a rank on the next node, the step published on every node.
``save: durable``
    ``muonckpt.save(opt, durable/step)``: the ordinary checkpoint.
``recover: local tier, one node lost``
    the last node's directory deleted, then ``muonckpt.recover(opt, tier)``: every copy
    checked, the lost node's files fetched from the others, every rank's share loaded.
``recover: durable``
    ``muonckpt.load(opt, durable/step)``.

With ``--durable dir`` (the default) both tiers are directories of one disk here (and in the
page cache: no run drops it), so the ratio measures what the protocols cost, not a faster
medium; on a cluster the durable tier is a shared filesystem or an object store, the local
one a node's own disk or ``/dev/shm``. ``--durable s3`` puts the durable tier in an S3
bucket: moto's server on 127.0.0.1 (started as ``bench_s3.py`` starts it), or the endpoint
``--endpoint`` names (credentials from the environment). ``--local /dev/shm`` puts the
nodes' directories in memory, as a job whose local tier is ``/dev/shm`` has it.

    python benchmarks/bench_tiers.py --size 256MB --nodes 2 3
    /work/s3venv/bin/python benchmarks/bench_tiers.py --size 256MB --nodes 2 --durable s3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ROWS = {
    "save_local": "save: local tier (R=1)",
    "save_durable": "save: durable",
    "recover_local": "recover: local tier, one node lost",
    "recover_durable": "recover: durable",
}


def worker(workdir: Path, size: int, rounds: int, durable_root: str) -> None:
    """One rank of one simulated node: ``rounds`` rounds of the four timings; rank 0 prints
    the job's (slowest rank's) seconds as one JSON line."""
    import torch
    import torch.distributed as dist
    from synthetic import build_optimizer, fill_state, model_shapes

    import muonckpt
    from muonckpt.storage import store_for

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    opt = build_optimizer(model_shapes(size * world), world, 1)
    fill_state(opt)
    root = Path(os.environ["NODE_ROOT"])
    tier = muonckpt.LocalTier(root, replicas=1, keep_last=1)
    last_node = int(os.environ["GROUP_RANK"]) == int(os.environ["NODES"]) - 1
    seconds: dict[str, list[float]] = {key: [] for key in ROWS}

    def timed(key: str, round_: int, run, *args, **kwargs) -> None:
        os.sync()
        dist.barrier()
        start = time.perf_counter()
        run(*args, **kwargs)
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if round_:  # round 0 warms up: the tier's gloo group is made in its first save
            seconds[key].append(float(took))

    for round_ in range(rounds + 1):
        durable = f"{durable_root}/step-{round_}"
        timed("save_local", round_, muonckpt.save, opt, durable, tier=tier)
        timed("save_durable", round_, muonckpt.save, opt, durable)
        if last_node and int(os.environ["LOCAL_RANK"]) == 0:
            shutil.rmtree(root)  # the node lost, its disk with it
        dist.barrier()
        timed("recover_local", round_, muonckpt.recover, opt, tier)
        timed("recover_durable", round_, muonckpt.load, opt, durable)
        dist.barrier()
        if rank == 0:
            store_for(durable).remove_checkpoint(durable)
    if rank == 0:
        print(json.dumps({"ranks": world, "seconds": seconds}), flush=True)
    dist.destroy_process_group()


def run_job(
    workdir: Path, nodes: int, size: int, rounds: int, durable: str, local: Path | None
) -> dict:
    """The job of ``nodes`` simulated nodes x 2 ranks, its durable tier under ``durable``,
    its nodes' directories under ``local`` (default ``workdir``); rank 0's line."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    here = Path(__file__).resolve().parent
    procs = []
    for k in range(nodes):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes)]
        argv += ["--node-rank", str(k), "--nproc-per-node", "2"]
        argv += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
        argv += [str(here / "bench_tiers.py"), "--worker", str(workdir), str(size), str(rounds)]
        argv += [durable]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "NODE_ROOT": str((local or workdir) / f"node{k}"),
            "NODES": str(nodes),
            "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
        }
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    outputs = [proc.communicate()[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a node failed: {[proc.returncode for proc in procs]}")
    return json.loads(next(line for line in outputs[0].splitlines() if line.startswith("{")))


def main() -> None:
    from common import make_workdir, parse_size

    if sys.argv[1:2] == ["--worker"]:
        worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MB", help="state per rank")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--durable", choices=["dir", "s3"], default="dir", help="durable tier")
    parser.add_argument("--endpoint", default=None, help="with --durable s3 (default: moto)")
    parser.add_argument("--local", default=None, help="where the nodes' directories go")
    args = parser.parse_args()
    size = parse_size(args.size)
    print(f"load average before: {os.getloadavg()}", flush=True)
    base = Path(make_workdir(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="tiers-"))
    with _durable_tier(args.durable, args.endpoint) as durable:
        for nodes in args.nodes:
            workdir = base / f"tiers-{nodes}"
            where = str(workdir / "durable") if durable is None else f"{durable}/tiers-{nodes}"
            local = Path(tempfile.mkdtemp(prefix="tiers-", dir=args.local)) if args.local else None
            try:
                result = run_job(workdir, nodes, size, args.rounds, where, local)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
                if local is not None:
                    shutil.rmtree(local, ignore_errors=True)
            _print_result(nodes, args.size, args.rounds, result)
    print(f"\nload average after: {os.getloadavg()}", flush=True)


@contextlib.contextmanager
def _durable_tier(kind: str, endpoint: str | None) -> Iterator[str | None]:
    """The durable tier's root: None for a directory beside the nodes' (``dir``), else an
    ``s3://`` bucket on ``endpoint`` or on a moto server started (and killed) here."""
    if kind == "dir":
        yield None
        return
    from bench_s3 import ENVIRONMENT, _client, _serve

    server = None
    if endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    else:
        endpoint, server = _serve()
        os.environ.update(ENVIRONMENT, AWS_ENDPOINT_URL=endpoint)
    try:
        bucket = f"tiers-{uuid.uuid4().hex[:12]}"
        _client().create_bucket(Bucket=bucket)
        yield f"s3://{bucket}"
    finally:
        if server is not None:
            server.kill()
            server.wait()


def _print_result(nodes: int, size: str, rounds: int, result: dict) -> None:
    """One job's medians and the durable / local ratios."""
    print(f"\n{nodes} nodes x 2 ranks, {size} per rank ({rounds} rounds):")
    medians = {key: statistics.median(v) for key, v in result["seconds"].items()}
    for key, title in ROWS.items():
        each = ", ".join(f"{s:.2f}" for s in result["seconds"][key])
        print(f"  {title:42s} median {medians[key]:6.2f} s   ({each})")
    for what in ("save", "recover"):
        ratio = medians[f"{what}_durable"] / medians[f"{what}_local"]
        print(f"  {what}: durable / local = {ratio:.2f}x")


if __name__ == "__main__":
    main()
