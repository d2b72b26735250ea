"""A training script whose last act is an ``async_save`` of ``MB`` of optimizer state, still in
flight when the script ends, the way ``KIND`` says:

- ``end``: the script runs off its end;
- ``sys.exit``: ``sys.exit(3)``;
- ``exception``: an exception escapes the training loop;
- ``KeyboardInterrupt``: SIGINT (Ctrl-C) arrives;
- ``refused``: as ``end``, but the files may not grow past 1 MiB (``RLIMIT_FSIZE``, a quota),
  so the save cannot be finished.

``python -m tests.exit_script CKPT KIND``, or under torchrun (then a DDP replica on each rank,
every rank writing its share).
"""

from __future__ import annotations

import os
import resource
import signal
import sys

import torch
import torch.distributed as dist

import muonckpt

MB = 128
"""Optimizer state per rank (AdamW's two moments), in MB; the param adds half as much."""


def main(ckpt: str, kind: str) -> None:
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    torch.manual_seed(0)  # every rank the same replica
    param = torch.nn.Parameter(torch.randn(MB * 2**20 // 8))
    opt = torch.optim.AdamW([param])
    param.grad = torch.ones_like(param)
    opt.step()
    if kind == "refused":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (2**20, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )
    muonckpt.async_save(opt, ckpt)
    if kind == "sys.exit":
        sys.exit(3)
    if kind == "exception":
        raise RuntimeError("the training loop failed")
    if kind == "KeyboardInterrupt":
        signal.raise_signal(signal.SIGINT)


if __name__ == "__main__":
    main(*sys.argv[1:])
