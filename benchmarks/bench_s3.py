"""Benchmark save and load through S3 (issue 52): muonckpt against the client's own transfer
and DCP's fsspec path, all to one S3-compatible server on 127.0.0.1.

The server is moto's server mode (``tests/moto_serve.py``, conditional writes made atomic),
started here as a process of its own, unless ``--endpoint`` names another (MinIO, a real
bucket: then ``AWS_*`` credentials come from the environment as usual). The synthetic state
(``synthetic.py``) is sharded at dp x tp (default 2 x 2) in gloo processes, every rank of a
row working at once, warm-up plus ``--repeats`` interleaved rounds, each into a fresh prefix:

``boto3 managed upload (floor)`` / ``boto3 managed download (floor)``
    each rank uploads the bytes of its share of the state (its tensors as one safetensors
    blob, made outside the timing) with boto3's ``upload_fileobj`` (s3transfer's managed,
    multipart, multi-threaded transfer, default settings); the load row: each rank of the
    load topology downloads an object of its share's size with ``download_fileobj`` into
    memory. The floor: the client library moving the same bytes with nothing else to do.
``muonckpt.save`` / ``muonckpt.load``
    ``muonckpt.save(opt, "s3://...", params=False)``; the load, into ``--to-dp`` x ``--to-tp``
    (default 4 x 1): each rank's ranged reads of exactly its pieces, checksums verified.
``DCP fsspec save (s3fs)`` / ``DCP fsspec load (s3fs)``
    ``torch.distributed.checkpoint.save`` / ``load`` of the same state as DTensor blocks
    (``synthetic.dtensor_state``: DCP cannot express ZeRO-1's slices) through DCP's
    ``FsspecWriter`` / ``FsspecReader`` on ``s3fs``; skipped (said so) without s3fs.

Rows: median and min job seconds (a job's time is its slowest rank's), MB/s of the median,
the ratio to the floor of the same operation, and the CPU seconds the server started here
spent on the row's requests (median), with the cores that makes over the row's time. A
pure-Python server on a few cores may itself be the ceiling of every row: moto's requests
hold Python's GIL, so a row whose server is busy about one core is waiting on the server.

    python benchmarks/bench_s3.py --size 1GB --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import MiB, parse_size  # noqa: E402

REPO = HERE.parent
ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "muonckpt-bench",
    "AWS_SECRET_ACCESS_KEY": "muonckpt-bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
SAVES = {
    "floor": "boto3 managed upload (floor)",
    "muonckpt": "muonckpt.save",
    "dcp": "DCP fsspec save (s3fs)",
}
LOADS = {
    "floor": "boto3 managed download (floor)",
    "muonckpt": "muonckpt.load",
    "dcp": "DCP fsspec load (s3fs)",
}


def _has_s3fs() -> bool:
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


def _rounds(
    variants: dict[str, Callable[[int], object]],
    repeats: int,
    reset: Callable[[str, int], object] | None = None,
) -> dict[str, list[float]]:
    """Warm-up plus ``repeats`` interleaved rounds of every variant on every rank, each
    after ``reset(key, round)`` (untimed); this rank's seconds per measured round, and on
    rank 0 under ``server:KEY`` the CPU seconds the server process spent meanwhile (between
    the barriers: the whole job's requests)."""
    import torch.distributed as dist

    seconds: dict[str, list[float]] = {}
    watched = dist.get_rank() == 0
    for round_ in range(repeats + 1):
        for key, run in variants.items():
            if reset is not None:
                reset(key, round_)
            dist.barrier()
            server = _server_cpu() if watched else None
            start = time.perf_counter()
            run(round_)
            elapsed = time.perf_counter() - start
            dist.barrier()
            if round_:
                seconds.setdefault(key, []).append(elapsed)
                if server is not None and (now := _server_cpu()) is not None:
                    seconds.setdefault(f"server:{key}", []).append(now - server)
    return seconds


def _server_cpu() -> float | None:
    """CPU seconds (user + system) of the server this script started (its pid in
    ``MUONCKPT_BENCH_SERVER_PID``), or None (another server, or no /proc)."""
    pid = os.environ.get("MUONCKPT_BENCH_SERVER_PID")
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client():
    import boto3

    return boto3.client("s3")


def _fsspec_options() -> dict:
    return {"client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}}


def _drop_previous(bucket: str, run_id: str) -> Callable[[str, int], None]:
    """A ``reset`` that deletes a row's previous round (rank 0), so that the server holds
    one round of each row at a time; the last round stays for the loads."""
    import torch.distributed as dist

    client = _client()

    def reset(key: str, round_: int) -> None:
        if round_ == 0 or dist.get_rank() != 0:
            return
        prefix = f"{run_id}/{key}/round-{round_ - 1}/"
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})

    return reset


def save_worker(shapes, dp: int, tp: int, bucket: str, run_id: str, repeats: int, dcp_too: bool):
    """One rank of the save rows; returns its seconds per row and its share's bytes."""
    import safetensors.torch
    import torch.distributed as dist
    from synthetic import build_optimizer, dtensor_state, fill_state

    import muonckpt

    opt = build_optimizer(shapes, dp, tp)
    local = fill_state(opt)
    blob = safetensors.torch.save(local)
    rank, client = dist.get_rank(), _client()

    def floor(round_: int) -> None:
        key = f"{run_id}/floor/round-{round_}/rank-{rank}"
        client.upload_fileobj(io.BytesIO(blob), bucket, key)

    variants: dict[str, Callable[[int], object]] = {
        "floor": floor,
        "muonckpt": lambda r: muonckpt.save(
            opt, f"s3://{bucket}/{run_id}/muonckpt/round-{r}", params=False
        ),
    }
    drop = _drop_previous(bucket, run_id)
    seconds = _rounds(variants, repeats, drop)
    if dcp_too:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dtensors = dtensor_state(shapes, dp, tp)

        def dcp_save(round_: int) -> None:
            url = f"s3://{bucket}/{run_id}/dcp/round-{round_}"
            dcp.save(dtensors, storage_writer=FsspecWriter(url, **_fsspec_options()))

        seconds.update(_rounds({"dcp": dcp_save}, repeats, drop))
    return {"seconds": seconds, "bytes": len(blob)}


def load_worker(shapes, dp: int, tp: int, bucket: str, run_id: str, repeats: int, dcp_too: bool):
    """One rank of the load rows (into dp x tp): its seconds per row."""
    import torch.distributed as dist
    from synthetic import build_optimizer, dtensor_state

    import muonckpt

    opt = build_optimizer(shapes, dp, tp)
    rank, client = dist.get_rank(), _client()
    ckpt = f"s3://{bucket}/{run_id}/muonckpt/round-{repeats}"
    saved_ranks = sorted(
        item["Key"]
        for item in client.list_objects_v2(
            Bucket=bucket, Prefix=f"{run_id}/floor/round-{repeats}/"
        )["Contents"]
    )

    def floor(round_: int) -> None:
        sink = io.BytesIO()
        client.download_fileobj(bucket, saved_ranks[rank % len(saved_ranks)], sink)

    def load(round_: int) -> None:
        opt.state.clear()
        muonckpt.load(opt, ckpt, params=False)

    seconds = _rounds({"floor": floor, "muonckpt": load}, repeats)
    if dcp_too:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dtensors = dtensor_state(shapes, dp, tp)
        url = f"s3://{bucket}/{run_id}/dcp/round-{repeats}"
        seconds.update(
            _rounds(
                {
                    "dcp": lambda r: dcp.load(
                        dtensors, storage_reader=FsspecReader(url, **_fsspec_options())
                    )
                },
                repeats,
            )
        )
    return {"seconds": seconds}


def _rows(operation: str, labels: dict, ranks: list[dict], total: int) -> list[dict]:
    """One row per variant measured: the job's time is its slowest rank's, per round."""
    rows = []
    for key, label in labels.items():
        if key not in ranks[0]["seconds"]:
            continue
        jobs = [
            max(r["seconds"][key][i] for r in ranks) for i in range(len(ranks[0]["seconds"][key]))
        ]
        server = ranks[0]["seconds"].get(f"server:{key}")
        rows.append(
            {
                "operation": operation,
                "tool": label,
                "median_s": statistics.median(jobs),
                "min_s": min(jobs),
                "mb_per_s": total / MiB / statistics.median(jobs),
                "server_cpu_s": statistics.median(server) if server else None,
            }
        )
    floor = rows[0]["median_s"]
    for row in rows:
        row["ratio"] = row["median_s"] / floor
    return rows


def _serve() -> tuple[str, subprocess.Popen[bytes]]:
    """moto's server (``tests.moto_serve``) on a free port of 127.0.0.1: its endpoint."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.moto_serve", "127.0.0.1", str(port)],
        cwd=REPO,
        env={**os.environ, **ENVIRONMENT},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return endpoint, process
        except OSError:
            time.sleep(0.2)
    process.kill()
    sys.exit("bench_s3: the moto server did not start")


def run(size: str, dp: int, tp: int, to_dp: int, to_tp: int, repeats: int) -> dict:
    """Every row at one size, against the server ``AWS_ENDPOINT_URL`` names."""
    from synthetic import model_shapes, state_bytes

    from muonckpt.distributed import run_distributed

    shapes = model_shapes(parse_size(size))
    total = state_bytes(shapes)
    bucket, run_id = os.environ.get("MUONCKPT_BENCH_BUCKET", "muonckpt-bench"), uuid.uuid4().hex
    client = _client()
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    dcp_too = _has_s3fs()
    if not dcp_too:
        print("bench_s3: s3fs is not installed: no DCP fsspec rows", file=sys.stderr)
    args = (bucket, run_id, repeats, dcp_too)
    saves = run_distributed(save_worker, dp * tp, shapes, dp, tp, *args, timeout=7200)
    loads = run_distributed(load_worker, to_dp * to_tp, shapes, to_dp, to_tp, *args, timeout=7200)
    rows = _rows(f"save at {dp}x{tp}", SAVES, saves, total)
    rows += _rows(f"load {dp}x{tp} -> {to_dp}x{to_tp}", LOADS, loads, total)
    return {"size": size, "state_bytes": total, "rows": rows, "saves": saves, "loads": loads}


def print_rows(res: dict) -> None:
    print(f"\n### {res['size']}: {res['state_bytes'] / MiB:.0f} MiB fp32 state through S3\n")
    print("| operation | tool | median s | min s | MB/s | x floor | server CPU s (cores) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        cpu = r["server_cpu_s"]
        busy = "-" if cpu is None else f"{cpu:.2f} ({cpu / r['median_s']:.2f})"
        print(
            f"| {r['operation']} | {r['tool']} | {r['median_s']:.2f} | {r['min_s']:.2f} | "
            f"{r['mb_per_s']:.0f} | {r['ratio']:.2f} | {busy} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GB", help="total optimizer state, e.g. 256MB, 1GB")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--to-dp", type=int, default=4, help="load target dp")
    parser.add_argument("--to-tp", type=int, default=1, help="load target tp")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds after warm-up")
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint (default: start moto)")
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args()
    server = None
    if args.endpoint:
        os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    else:
        endpoint, server = _serve()
        os.environ.update(ENVIRONMENT, AWS_ENDPOINT_URL=endpoint)
        os.environ["MUONCKPT_BENCH_SERVER_PID"] = str(server.pid)
    try:
        res = run(args.size, args.dp, args.tp, args.to_dp, args.to_tp, args.repeats)
    finally:
        if server is not None:
            server.kill()
            server.wait()
    print_rows(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
