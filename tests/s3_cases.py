"""The phase of tests/test_s3_load.py that runs in gloo children: save at 2 x 2 to a local
directory and to S3, copy the directory to S3 object by object (as ``aws s3 cp --recursive``
does), then load each at 4 x 1."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

import muonckpt

from .fixture_model import build, initial_params, train

AGENT = "muonckpt-test-rank-{rank}"
LOOKING = "muonckpt-test-latest-{rank}"
"""The user agent of rank ``rank``'s requests in a load (:data:`AGENT`) and in a ``latest``
(:data:`LOOKING`)."""
"""Each rank's S3 client adds this to its User-Agent (``AWS_SDK_UA_APP_ID``), so that the
proxy's log tells whose request each was."""


def upload(directory: Path, bucket: str, prefix: str, endpoint: str) -> None:
    """Every file under ``directory`` put as an object under ``prefix``: a plain copy."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            key = f"{prefix}/{path.relative_to(directory).as_posix()}"
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())


def state_of(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's params and optimizer state, by place."""
    out = {}
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            out[f"{g}.{i}.param"] = p.detach().clone()
            for key, value in opt.state[p].items():
                out[f"{g}.{i}.{key}"] = (
                    value.clone() if torch.is_tensor(value) else torch.tensor(value)
                )
    return out


def save_copy_load_phase(
    local: str, bucket: str, prefix: str, upstream: str, environment: dict[str, str], steps: int
) -> dict[str, torch.Tensor]:
    """Train ``steps`` at 2 x 2 and save to ``local`` and to S3 (``<prefix>-saved``); rank 0
    copies the local one to S3 (both straight to ``upstream``, not through the endpoint the
    loads use); then load at 4 x 1 from all three, each into an optimizer built from zeros,
    with the AWS ``environment`` given (the children of a forkserver started earlier in the
    session have the environment it had then). Returns the loads' state, ``local/``, ``s3/``
    and ``saved/`` before each name."""
    os.environ.update(environment)
    rank = dist.get_rank()
    opt, sharded, dp_rank, tp_rank = build(2, 2, initial_params())
    train(opt, sharded, dp_rank, tp_rank, 0, steps)
    muonckpt.save(opt, local)
    # and saved to S3 by every rank (straight to ``upstream`` too: the proxy logs loads only)
    os.environ["AWS_ENDPOINT_URL"] = upstream
    muonckpt.save(opt, f"s3://{bucket}/{prefix}-saved")
    os.environ.update(environment)
    if rank == 0:
        upload(Path(local), bucket, prefix, upstream)
    dist.barrier()
    os.environ["AWS_SDK_UA_APP_ID"] = LOOKING.format(rank=rank)
    found = muonckpt.latest(f"s3://{bucket}/{prefix.rpartition('/')[0]}", collective=True)
    assert str(found) in (f"s3://{bucket}/{prefix}", f"s3://{bucket}/{prefix}-saved"), found
    answers: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(answers, found)
    assert len(set(map(str, answers))) == 1, answers  # every rank was told the same
    out = {}
    zeros = {name: torch.zeros_like(value) for name, value in initial_params().items()}
    copies = (("s3", f"s3://{bucket}/{prefix}"), ("saved", f"s3://{bucket}/{prefix}-saved"))
    for tag, ckpt in (("local", local), *copies):
        os.environ["AWS_SDK_UA_APP_ID"] = AGENT.format(rank=rank)
        loaded, _, _, _ = build(4, 1, zeros)
        muonckpt.load(loaded, ckpt)
        out |= {f"{tag}/{name}": value for name, value in state_of(loaded).items()}
    return out
