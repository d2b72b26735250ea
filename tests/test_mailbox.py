"""The background save's agreement through the process group's store
(:mod:`muonckpt.distributed.mailbox`), its ranks played by threads over one real c10d store
(in memory, ``HashStore``; or a ``TCPStore`` served from this process): the same outcome on
every rank, bounded waits, every key deleted, and keys of other saves never read."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from muonckpt.distributed.mailbox import PREFIX, Mailbox, MailboxSteps
from muonckpt.errors import CheckpointError


def _save(
    store: dist.Store,
    work: dict[int, Callable[[], Any]],
    ranks: tuple[int, ...] = (0, 1, 2),
    timeout: float = 5.0,
    steps: tuple[str, ...] = ("write",),
    name: str | None = None,
) -> dict[int, Any]:
    """A background save's steps over ``ranks`` (root: the first), each rank a thread that
    runs ``work[rank]`` in each step (a rank not in ``work`` never comes: a dead process);
    each rank's value of the last step, or the error it raised (its message). In mailbox
    ``name``, or one made here."""
    name = Mailbox.create(store).name if name is None else name
    results: dict[int, Any] = {}

    def rank(me: int) -> None:
        protocol = MailboxSteps(
            "async_save", Mailbox(name, store), ranks, ranks[0], me, timeout, CheckpointError
        )
        protocol.connect()
        try:
            for step in steps:
                results[me] = protocol.each_then_root(step, work[me], lambda values: values)
        except CheckpointError as exc:
            results[me] = str(exc)
        finally:
            protocol.leave()

    threads = [threading.Thread(target=rank, args=(r,)) for r in ranks if r in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def _ours(store: dist.Store) -> list[str]:
    return [key for key in store.list_keys() if PREFIX in key]


def test_every_rank_ends_each_step_with_the_roots_value_and_no_key_is_left():
    store = dist.HashStore()
    for _ in range(20):  # successive saves: nothing grows
        results = _save(store, {r: (lambda r=r: r * 10) for r in (0, 1, 2)}, steps=("a", "b"))
        assert results == {r: [0, 10, 20] for r in (0, 1, 2)}
    assert _ours(store) == []


def test_a_failure_on_one_rank_is_raised_on_every_rank():
    def no_space() -> None:
        raise OSError(28, "No space left on device")

    store = dist.HashStore()
    results = _save(store, {0: lambda: 0, 1: no_space, 2: lambda: 2})
    assert len(set(results.values())) == 1, results
    assert results[0].startswith("async_save (write): rank 1: OSError: [Errno 28] No space left")
    assert _ours(store) == []


def test_a_rank_that_never_reports_fails_the_step_on_the_others_after_the_timeout():
    store = dist.HashStore()
    started = time.monotonic()
    results = _save(store, {0: lambda: 0, 2: lambda: 2}, timeout=0.3)
    assert time.monotonic() - started < 5
    said = "async_save (write): rank(s) [1] did not finish within 0.3 s"
    assert results == {0: said, 2: said}
    assert _ours(store) == []  # the root deleted every key, the dead rank's none


def test_a_root_that_never_decides_fails_the_step_on_the_others():
    """Rank 0 dies: the others give up after twice the timeout, one of them decides for
    all (the claim), and both say the same."""
    store = dist.HashStore()
    results = _save(store, {1: lambda: 1, 2: lambda: 2}, timeout=0.2)
    assert results[1] == results[2], results
    assert results[1] in {
        f"async_save (write): rank {r}: rank 0 gave no outcome within 0.4 s" for r in (1, 2)
    }


def test_a_rank_the_root_gave_up_on_learns_it_when_it_comes():
    """Rank 1 comes after the root gave up on it and removed the mailbox: it says so at once
    (as the directory mailbox did), and leaves no key behind."""
    store = dist.HashStore()
    late = threading.Event()

    def slow() -> int:
        late.wait(timeout=30)
        return 1

    def root() -> int:
        return 0

    name = Mailbox.create(store).name
    said: dict[int, str] = {}

    def rank(me: int, work: Callable[[], int]) -> None:
        protocol = MailboxSteps(
            "async_save", Mailbox(name, store), (0, 1), 0, me, 0.2, CheckpointError
        )
        protocol.connect()
        try:
            protocol.each_then_root("write", work, lambda values: values)
        except CheckpointError as exc:
            said[me] = str(exc)
        protocol.leave()

    slow_rank = threading.Thread(target=rank, args=(1, slow))
    slow_rank.start()
    rank(0, root)  # gives up on rank 1, waits 0.2 s more for its done, removes the mailbox
    late.set()
    slow_rank.join(timeout=30)
    assert said[0] == "async_save (write): rank(s) [1] did not finish within 0.2 s"
    assert said[1] in {
        said[0],
        "async_save (write): rank 1: rank 0 gave up waiting for this rank (its mailbox is gone)",
    }
    assert _ours(store) == []


def test_keys_a_killed_save_left_in_the_store_are_never_read():
    """A save killed midway (torchrun's agent keeps its store across restarts) leaves its
    keys: the next save has a prefix of its own, and agrees on its own values."""
    store = dist.HashStore()
    killed = Mailbox.create(store)
    killed.post("write-1", {"error": "rank 1: from the killed job"})
    killed.post("write-outcome", {"error": "from the killed job"})
    assert killed.claim("write-decision", {"error": "from the killed job"})
    results = _save(store, {0: lambda: 0, 1: lambda: 1}, ranks=(0, 1))
    assert results == {0: [0, 1], 1: [0, 1]}
    assert len(_ours(store)) == 4  # the killed save's, untouched; the new one's gone


def test_a_blocking_wait_of_the_jobs_own_does_not_hold_up_the_messages():
    """The job waits on its store (a rendezvous, NCCL's initialisation) from another thread:
    the store's ``wait`` holds its connection meanwhile, so the mailbox has one of its own."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    job = dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=30))
    name = Mailbox.create(job).name  # (in the job's thread, before its wait)
    timed_out = []

    def wait() -> None:
        try:
            job.wait(["never"], timedelta(seconds=2))
        except dist.DistStoreError:
            timed_out.append(True)

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(0.2)
    started = time.monotonic()
    results = _save(job, {0: lambda: 0, 1: lambda: 1}, ranks=(0, 1), name=name)
    took = time.monotonic() - started
    waiting.join()
    assert timed_out == [True]  # the job's wait held its connection all along
    assert results == {0: [0, 1], 1: [0, 1]}
    assert took < 1.0, took
    assert _ours(server) == []


def test_a_store_that_is_gone_fails_the_step_with_where_it_was():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=1))
    mailbox = Mailbox.create(client)
    protocol = MailboxSteps("async_save", mailbox, (0, 1), 0, 0, 5.0, CheckpointError)
    protocol.connect()
    del server  # its host killed
    with pytest.raises(CheckpointError) as raised:
        protocol.each_then_root("write", lambda: 0, lambda values: values)
    said = str(raised.value)
    assert said.startswith("async_save (write): looking for messages in the process"), said
    assert f"the process group's store at 127.0.0.1:{client.port} is gone" in said, said
    protocol.leave()  # says nothing more


@pytest.mark.parametrize("kind", ["hash", "tcp"])
def test_a_message_removed_after_it_was_seen_is_gone_at_once(kind: str) -> None:
    """A rank that saw a message and then reads it after the root removed the mailbox (the
    root gave up waiting for it) learns at once that it is gone, where the store's ``get``
    would wait for the store's whole timeout; reading creates nothing."""
    store: dist.Store
    if kind == "hash":
        store = dist.HashStore()
    else:
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=600))
    store.set_timeout(timedelta(seconds=600))  # a get of the removed key would wait this long
    root = Mailbox.create(store)
    root.post("write-outcome", {"ok": True})
    late = Mailbox(root.name, store)
    assert late.wait(["write-outcome"], 1.0) == ({"write-outcome": {"ok": True}}, [])
    root.remove()
    with pytest.raises(CheckpointError, match="'write-outcome' is gone: the mailbox was removed"):
        late.read("write-outcome")
    assert late.wait(["write-outcome"], 0.0) == ({}, ["write-outcome"])
    assert _ours(store) == []
