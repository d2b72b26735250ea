"""Run an offline rewrite (``consolidate``, ``reshard``) in N local processes: the parent's
side (the target checked, the processes started, rank 0's progress relayed, the staging
directory removed when the run fails or is interrupted, a commit reported however the run
ends) and each worker's (its part of the collective rewrite, rank 0 staging where the parent
expects it and never committing once the parent is gone).

The processes themselves come from :mod:`muonckpt.distributed.launch`; the rewrite, from
:mod:`muonckpt.offline.tools`, which imports this module only when it runs in several processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import traceback
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import storage
from ..distributed import collectives, launch
from ..errors import CheckpointError, CheckpointWarning, MuonCkptError
from ..files import writing
from ..files.writing import Progress


def scaled_progress(progress: Progress, total: int, tensors: int) -> Progress:
    """Rank 0's progress through its own share, shown as a fraction of the whole job."""

    def scaled(done: int, share: int, written: int, share_tensors: int) -> None:
        fraction = done / share if share else written / share_tensors if share_tensors else 1.0
        progress(round(fraction * total), total, round(fraction * tensors), tensors)

    return scaled


def run_in_workers(
    operation: Callable[..., Path],
    workers: int,
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    options: dict[str, Any],
    progress: Progress | None,
    wait_timeout: float,
) -> Path:
    """Run ``operation(src, dst, **options, collective=True)`` in ``workers`` gloo processes;
    rank 0's progress comes back through a queue; a worker waits at most ``wait_timeout``
    seconds for the others at one step.

    The target is checked here first, so a refused output starts no process. Rank 0 stages
    at a path chosen here, so that when the run fails or this process is interrupted
    (KeyboardInterrupt, SIGTERM in the CLI) the staging directory is removed here once the
    workers are gone, whatever state they were killed in. Warnings of the workers
    (:class:`~muonckpt.errors.CheckpointWarning`) are issued again here.
    """
    with storage.failing_as("look up", dst):
        storage.check_target(dst, options["overwrite"], source=src)
    token = uuid.uuid4().hex[:8]
    committed = mp.get_context("forkserver").Value("b", 0)  # rank 0 sets it at the swap
    queue = mp.get_context("forkserver").Queue() if progress is not None else None
    relay = threading.Thread(target=_relay, args=(queue, progress), daemon=True)
    if queue is not None:
        relay.start()
    try:
        results = launch.run_distributed(
            _worker,
            workers,
            operation,
            str(src),
            str(dst),
            options,
            queue,
            token,
            committed,
            timeout=None,
            wait_timeout=wait_timeout,
        )
    except BaseException as exc:
        storage.store.discard(storage.staging_path(dst, token))  # after the swap: the replaced one
        if not committed.value:
            raise
        return writing.after_commit(exc, Path(dst))  # a worker died, or we were interrupted
    finally:
        if queue is not None:
            queue.put(None)
            relay.join(timeout=10)
    for result in results:
        for message in result.get("warnings", []):
            warnings.warn(message, CheckpointWarning, stacklevel=3)
    failed = [r for r in results if "error" in r]
    if failed:
        error = CheckpointError(failed[0]["error"])
        if hasattr(error, "add_note"):  # Python 3.11+: shown with the traceback (--debug)
            error.add_note(f"the worker's traceback:\n{failed[0].get('traceback', '')}")
        if not committed.value:
            raise error
        return writing.after_commit(error, Path(dst))
    return Path(dst)


def _relay(queue: Any, progress: Progress) -> None:
    while (update := queue.get()) is not None:
        progress(*update)


def _worker(
    operation: Callable[..., Path],
    src: str,
    dst: str,
    options: dict[str, Any],
    queue: Any,
    token: str,
    committed: Any,
) -> dict[str, Any]:
    """(one of the ``workers`` processes) Its part of the collective operation.

    Rank 0 stages at the path ``token`` names, sets ``committed`` (a shared flag) the moment
    it commits (so that the parent reports a commit even if rank 0 is killed right after), and
    if the parent dies (the lifeline of :mod:`muonckpt.distributed.launch`) it first makes sure it
    never commits, then removes that staging directory, then dies.
    """
    if collectives.global_rank() == 0:
        staging = storage.preset_staging(dst, token)

        def abandon() -> None:
            storage.abandon_commits()
            storage.store.discard(staging)

        launch.on_orphaned(abandon)

        def mark() -> None:
            committed.value = 1

        storage.watch_commit(dst, mark, staging=staging)
    progress = None if queue is None else lambda *update: queue.put(update)
    outcome: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CheckpointWarning)
        try:
            operation(src, dst, **options, progress=progress, collective=True)
        except MuonCkptError as exc:
            outcome["error"] = str(exc)
            outcome["traceback"] = traceback.format_exc()
    shown = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    if shown:
        outcome["warnings"] = shown
    return outcome
