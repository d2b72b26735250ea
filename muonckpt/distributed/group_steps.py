"""The step protocol (:class:`muonckpt.distributed.steps.StepProtocol`) carried over the job's
process group: :class:`CollectiveSteps` (JSON point-to-point), :class:`StoreSteps` (through
the group's store, with bounded waits), and the :func:`rendezvous` every collective operation
starts with, under :func:`rendezvous_timeout`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore
from torch.distributed.distributed_c10d import Store

from .. import settings
from ..errors import CollectiveError, MuonCkptError, PeerLostError
from .collectives import broadcast_json, gather_json, global_rank, is_distributed, one_line
from .steps import Outcome, StepProtocol, disagreement


class CollectiveSteps(StepProtocol):
    """The step protocol (:class:`muonckpt.distributed.steps.StepProtocol`) over the job's process
    group:
    each rank's outcome travels to the root, and the root's to every rank, as JSON
    point-to-point (so ``ranks`` need not form a process group). A transfer that fails itself
    (a peer process dying, the network) is not a step's failure: the process group's timeout
    ends it; but a root that finds a rank gone tells the others the step failed, so that a
    node lost mid-save is an error on every rank at once rather than at that timeout."""

    def __init__(
        self, operation: str, ranks: Sequence[int], root: int, error: type[MuonCkptError]
    ) -> None:
        super().__init__(operation, ranks, root, error, global_rank())

    def _exchange(
        self, step: str, mine: Outcome, decide: Callable[[list[Outcome]], Outcome]
    ) -> Outcome:
        try:
            outcomes = gather_json(mine, self.ranks, self.root)
            outcome = decide(outcomes) if outcomes is not None else None
            agreed: Outcome = broadcast_json(outcome, self.ranks, self.root)
            return agreed
        except PeerLostError as exc:
            if self.is_root:
                self._tell_failed(exc)
            raise self.error(f"{self.operation} ({step}): {exc}") from exc

    def _tell_failed(self, lost: PeerLostError) -> None:
        """(the root, which lost a rank in a step) The step's failure to every other rank not
        known lost, each in turn, as its outcome; a rank it cannot reach is passed by."""
        failed: Outcome = {"error": f"rank {self.rank}: {lost}", "rank": self.rank}
        for rank in self.ranks:
            if rank != self.rank and rank not in lost.peers:
                with contextlib.suppress(RuntimeError, CollectiveError):  # gone as well
                    broadcast_json(failed, [self.rank, rank], self.rank)


# --------------------------------------------------------------------------------------------
# The rendezvous every collective operation starts with: bounded, through the default group's
# store, so that a rank that never comes (``if rank == 0: save(...)``) is an error on the
# ranks that did within ``timeout``, instead of a hang until the process group's own timeout.
# --------------------------------------------------------------------------------------------

DEFAULT_RENDEZVOUS_TIMEOUT_S: float = 60.0
"""How long, by default, the ranks of a muonckpt collective (``save``, ``async_save``,
``load``, ``state_dict()``, the offline tools under torchrun) wait for each other at its start;
overridden by the ``MUONCKPT_RENDEZVOUS_TIMEOUT`` environment variable (seconds) or
:func:`set_rendezvous_timeout`."""

_timeout_s: float | None = None
"""What :func:`set_rendezvous_timeout` set; None: the environment or the default."""


def rendezvous_timeout() -> float:
    """The rendezvous timeout in seconds now in force."""
    if _timeout_s is not None:
        return _timeout_s
    text = os.environ.get("MUONCKPT_RENDEZVOUS_TIMEOUT")
    if text is None:
        return DEFAULT_RENDEZVOUS_TIMEOUT_S
    try:
        return _checked_timeout(float(text))
    except (ValueError, CollectiveError) as exc:
        raise CollectiveError(
            f"MUONCKPT_RENDEZVOUS_TIMEOUT={text!r}: must be a number of seconds more than 0 "
            f"and at most {settings.MAX_WAIT_S:g}"
        ) from exc


def set_rendezvous_timeout(seconds: float | None) -> float:
    """Set how long the ranks of every muonckpt collective wait for each other at its start
    (None: back to ``MUONCKPT_RENDEZVOUS_TIMEOUT`` or the default, 60 s); returns the timeout
    in force before. Ranks that call a collective further apart than this fail it. At most
    :data:`muonckpt.settings.MAX_WAIT_S` (a week)."""
    global _timeout_s
    previous = rendezvous_timeout()
    _timeout_s = None if seconds is None else _checked_timeout(seconds)
    return previous


def _checked_timeout(seconds: Any) -> float:
    return settings.seconds(seconds, "the rendezvous timeout", CollectiveError)


_SEQUENCE: dict[tuple[int, ...], int] = {}
"""Per set of ranks, the number of its store-carried operations this process has begun (every
rank of a set begins the collectives over it in one order, so the n-th of one rank meets the
n-th of the others)."""


class StoreSteps(StepProtocol):
    """The step protocol (:class:`muonckpt.distributed.steps.StepProtocol`) through the default
    process
    group's store, with bounded waits: no rank waits longer than ``timeout`` seconds (default
    :func:`rendezvous_timeout`) for another, so a rank that never comes (``if rank == 0:
    save(...)``) is an error on the ranks that did, never a hang until the process group's
    own timeout. For the small exchanges that start an operation (its rendezvous, learning a
    grid's ranks), before any collective on the process groups.

    Each rank leaves its outcome under a key of its own; the first of ``ranks`` (the root)
    decides and leaves the verdict. A rank whose wait ends first claims the verdict instead
    (an atomic ``compare_set``: whoever decides first, every rank ends knowing that one
    outcome), naming the ranks that did not arrive. A rank that arrives after the others gave
    up on an operation without it leaves that one to them and meets their next operation over
    the same ranks instead, so that one late or missing call does not put the ranks out of step
    for good. A step's keys are deleted at the next step over the same ranks
    (:data:`_PREVIOUS`): each rank's arrival by that rank, the verdict by the root once every
    rank has arrived there (so every rank has read it, a late rank too). Not at once: by then
    the ranks' work has begun (a save's copies), and a store request then waits for a core,
    several milliseconds on a busy machine, holding up the rank that makes it. The root's store
    operations do not grow with the ranks. A step that fails for a rank that did not come may
    leave its verdict, and the one before it, in the store (one key each, as before).
    """

    def __init__(
        self,
        operation: str,
        ranks: Sequence[int],
        error: type[MuonCkptError],
        timeout: float | None = None,
        hint: str = "",
    ) -> None:
        super().__init__(operation, ranks, ranks[0], error, global_rank())
        self.timeout = rendezvous_timeout() if timeout is None else _checked_timeout(timeout)
        self.sequence = _next_sequence(self.ranks)
        self.hint = hint
        """What else to say when ranks do not arrive (the caller's likely mistake), or empty."""

    def _exchange(
        self, step: str, mine: Outcome, decide: Callable[[list[Outcome]], Outcome]
    ) -> Outcome:
        store = default_store()
        try:
            return self._through(store, step, mine, decide)
        except dist.DistNetworkError as exc:  # the store's server is gone, not a late rank
            raise self.error(
                f"{self.operation} ({step}): {store_gone(store)} ({one_line(exc)})"
            ) from exc

    def _through(
        self,
        store: Store,
        step: str,
        mine: Outcome,
        decide: Callable[[list[Outcome]], Outcome],
    ) -> Outcome:
        """The step's exchange through ``store`` (see the class docstring)."""
        wait = timedelta(seconds=self.timeout)
        members = tuple(self.ranks)
        previous = _PREVIOUS.pop(members, None)
        if previous is not None:
            store.delete_key(previous[0])  # this rank's own arrival, read then
        while True:
            arrivals, verdict = store_keys(self.ranks, self.sequence, step)
            mine_key = arrivals[self.ranks.index(self.rank)]
            store.set(mine_key, json.dumps(mine))
            old_verdict = previous[1] if previous is not None and self.is_root else None
            outcome = self._verdict(store, wait, arrivals, verdict, decide, old_verdict)
            if self.rank not in outcome.get("absent", ()):
                break
            # The others gave up on this operation before this rank came (and raised): it
            # is theirs alone. This call meets their next one instead.
            store.delete_key(mine_key)
            self.sequence = _next_sequence(self.ranks)
        _PREVIOUS[members] = (mine_key, verdict)
        return outcome

    def _verdict(
        self,
        store: Store,
        wait: timedelta,
        arrivals: list[str],
        verdict: str,
        decide: Callable[[list[Outcome]], Outcome],
        old_verdict: str | None,
    ) -> Outcome:
        """The step's one outcome: decided by the root when every rank has arrived (deleting
        ``old_verdict``, the previous step's, which every rank has read then), or claimed by
        the first rank whose wait ends (naming the ranks ``absent``)."""

        def claim(outcome: Outcome) -> Outcome:
            """The verdict: ``outcome`` unless another rank decided first."""
            return _outcome(store.compare_set(verdict, "", json.dumps(outcome)))

        def timed_out() -> Outcome:
            present = [store.check([key]) for key in arrivals]
            absent = [r for r, came in zip(self.ranks, present, strict=True) if not came]
            came = [r for r in self.ranks if r not in absent]
            return {
                "error": f"rank(s) {absent} did not arrive within {self.timeout:g} s (ranks "
                f"{came} did): {self.operation} is a collective over ranks {self.ranks}, call "
                "it on every one of them (not under `if rank == 0:`), within the rendezvous "
                "timeout of each other (muonckpt.distributed.set_rendezvous_timeout, "
                f"MUONCKPT_RENDEZVOUS_TIMEOUT){'; ' + self.hint if self.hint else ''}",
                "absent": absent,
            }

        if self.is_root:
            if store.check([verdict]):  # decided already: the others gave up before this came
                return _outcome(store.get(verdict))
            try:
                store.wait(arrivals, wait)
            except dist.DistStoreError:
                return claim(timed_out())
            if old_verdict is not None:
                store.delete_key(old_verdict)
            return claim(decide([json.loads(v) for v in store.multi_get(arrivals)]))
        waited = _waited(store, verdict, wait)  # (at once where decided already)
        if waited is None and all(store.check([key]) for key in arrivals):
            waited = _waited(store, verdict, wait)  # all came: the root is deciding
        return waited if waited is not None else claim(timed_out())


_PREVIOUS: dict[tuple[int, ...], tuple[str, str]] = {}
"""Per set of ranks, this process's arrival key and the verdict key of its last
:class:`StoreSteps` step over them, deleted at its next one (see the class docstring)."""


def _next_sequence(ranks: Sequence[int]) -> int:
    """The number of this process's next :class:`StoreSteps` operation over ``ranks``."""
    members = tuple(ranks)
    sequence = _SEQUENCE.get(members, 0)
    _SEQUENCE[members] = sequence + 1
    return sequence


def store_keys(ranks: Sequence[int], sequence: int, step: str) -> tuple[list[str], str]:
    """The store keys of one step of the ``sequence``-th :class:`StoreSteps` operation over
    ``ranks``: each rank's arrival (in the order of ``ranks``) and the verdict."""
    digest = hashlib.blake2b(repr(tuple(ranks)).encode(), digest_size=6).hexdigest()
    prefix = f"muonckpt/steps/{digest}/{sequence}/{step}"
    return [f"{prefix}/arrived/{rank}" for rank in ranks], f"{prefix}/verdict"


def _waited(store: Store, key: str, wait: timedelta) -> Outcome | None:
    """The JSON value of ``key`` once it is set, or None when ``wait`` passes first."""
    try:
        store.wait([key], wait)
    except dist.DistStoreError:
        return None
    return _outcome(store.get(key))


def rendezvous(
    operation: str,
    ranks: Sequence[int],
    arguments: dict[str, Any],
    error: type[MuonCkptError],
    timeout: float | None = None,
    hint: str = "",
) -> None:
    """The start of every collective ``operation`` over ``ranks``: a ``rendezvous`` step
    (:class:`StoreSteps`, bounded by ``timeout``) where the ranks check that they were called
    alike: the same call and ``arguments`` (JSON-safe). Raises ``error`` on every rank that
    came, with one message, naming the ranks that did not come or the argument that differs,
    and then ``hint`` (what the caller may have meant), if any. Nothing in one process."""
    if not is_distributed() or len(ranks) <= 1:
        return

    def agreed(given: list[dict[str, Any]]) -> None:
        differ = disagreement(given, ranks)
        if differ is not None:
            said = f"; {hint}" if hint else ""
            raise error(f"the ranks disagree on {differ}; nothing was done{said}")

    called = {"call": operation, **arguments}
    StoreSteps(operation, ranks, error, timeout, hint).each_then_root(
        "rendezvous", lambda: called, agreed
    )


def _outcome(data: bytes) -> Outcome:
    """A step's outcome as the store holds it (UTF-8 JSON this module wrote)."""
    outcome: Outcome = json.loads(data.decode())
    return outcome


def default_store() -> Store:
    """The default process group's store (where its ranks met)."""
    return dist.distributed_c10d._get_default_store()


def store_gone(store: Store) -> str:
    """What to tell a rank that has lost its connection to ``store``: where it was and what
    went away with it. torchrun's agent (the launcher) hosts the store its workers meet at
    (``TORCHELASTIC_USE_AGENT_STORE``); a group joined by ``env://`` otherwise meets at a
    store that rank 0 hosts."""
    while not isinstance(store, TCPStore) and hasattr(store, "underlying_store"):
        store = store.underlying_store  # the PrefixStores the groups add
    where = f" at {store.host}:{store.port}" if isinstance(store, TCPStore) else ""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        host = "the launcher that hosts it (torchrun's agent)"
    else:
        host = "the process that hosts it (rank 0, for a group joined by env://)"
    return f"the process group's store{where} is gone: {host} has exited or was killed"
