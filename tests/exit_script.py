"""A training script whose last act is an ``async_save`` of ``MB`` of optimizer state, still in
flight when the script ends, the way ``KIND`` says:

- ``end``: the script runs off its end;
- ``sys.exit``: ``sys.exit(3)``;
- ``exception``: an exception escapes the training loop;
- ``KeyboardInterrupt``: SIGINT (Ctrl-C) arrives;
- ``refused``: as ``end``, but the files may not grow past 1 MiB (``RLIMIT_FSIZE``, a quota),
  so the save cannot be finished;
- ``Ctrl-C twice``: as ``end``, but the write never ends, and a Ctrl-C comes while the exit
  waits for it.

``python -m tests.exit_script CKPT KIND``, or under torchrun (then a DDP replica on each rank,
every rank writing its share).
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import muonckpt
from muonckpt.checkpoint import writing

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
    if kind == "Ctrl-C twice":
        writing.write_files = _interrupt_and_hang
    muonckpt.async_save(opt, ckpt)
    if kind == "sys.exit":
        sys.exit(3)
    if kind == "exception":
        raise RuntimeError("the training loop failed")
    if kind == "KeyboardInterrupt":
        signal.raise_signal(signal.SIGINT)


def _interrupt_and_hang(*args: object, **kwargs: object) -> None:
    """A write that never ends, and the user's Ctrl-C once the exit waits for it (a signal sent
    to the process: the main thread gets the KeyboardInterrupt there)."""
    main = threading.main_thread().ident
    while not _waiting_at_exit(main):  # nothing to wait on but the main thread's own frames
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)
    threading.Event().wait()


def _waiting_at_exit(thread: int | None) -> bool:
    """Whether ``thread`` waits in a join called by muonckpt's exit hook."""
    frame = sys._current_frames().get(thread or 0)
    if frame is None or ("join" not in frame.f_code.co_name and "lock" not in frame.f_code.co_name):
        return False
    while frame is not None and frame.f_code.co_name != "_finish_saves_at_exit":
        frame = frame.f_back
    return frame is not None


if __name__ == "__main__":
    main(*sys.argv[1:])
