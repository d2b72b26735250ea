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
from collections.abc import Callable

import torch
import torch.distributed as dist

import muonckpt
from muonckpt.files import writing

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
        threading.Thread.join = _announcing_the_exit_wait(threading.Thread.join)
        writing.write_files = _interrupt_and_hang
    muonckpt.async_save(opt, ckpt)
    if kind == "sys.exit":
        sys.exit(3)
    if kind == "exception":
        raise RuntimeError("the training loop failed")
    if kind == "KeyboardInterrupt":
        signal.raise_signal(signal.SIGINT)


EXIT_WAITS = threading.Event()
"""Set when muonckpt's exit hook starts waiting for the background save."""


def _announcing_the_exit_wait(join: Callable[..., None]) -> Callable[..., None]:
    """``Thread.join`` that sets :data:`EXIT_WAITS` when muonckpt's exit hook calls it, and
    then joins in turns of 0.1 s: Python runs a signal's handler between bytecodes, so a
    SIGINT that lands just before one long blocking wait starts would wait with it."""

    def announcing(self: threading.Thread, timeout: float | None = None) -> None:
        if sys._getframe(1).f_code.co_name != "_finish_saves_at_exit":
            join(self, timeout)
            return
        EXIT_WAITS.set()
        while self.is_alive():
            join(self, 0.1)

    return announcing


def _interrupt_and_hang(*args: object, **kwargs: object) -> None:
    """A write that never ends, and the user's Ctrl-C once the exit waits for it (a signal sent
    to the process: the main thread gets the KeyboardInterrupt there)."""
    if not EXIT_WAITS.wait(timeout=120):
        raise TimeoutError("the exit never waited for this save")
    os.kill(os.getpid(), signal.SIGINT)
    threading.Event().wait()


if __name__ == "__main__":
    main(*sys.argv[1:])
