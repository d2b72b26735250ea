"""A background save's agreement between ranks: :class:`Mailbox`, small JSON messages as keys
of the default process group's store, and :class:`MailboxSteps`, the step protocol through it.

A background save (:func:`muonckpt.async_save`) must not use the job's process groups: a
collective from its thread could deadlock with, or be reordered against, the job's own. Its
ranks agree instead through the store every rank of the job met at (torchrun's agent's, or
the one ``init_process_group`` made), which needs no filesystem shared by the ranks: ranks on
hosts without one save to one bucket. Each save's messages are keys under a prefix of their
own, ``muonckpt/async_save/<32 hex digits>/``, new for every save (a uuid), so that saves in
flight together, successive ones, and whatever an earlier job killed in the middle of a save
left in the same store (torchrun's agent keeps its store across restarts of the workers)
never read each other's messages. The root deletes them at the end of the save.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store

from ..errors import CheckpointError, MuonCkptError
from .collectives import one_line
from .group_steps import default_store, store_gone
from .steps import Outcome, StepProtocol

T = TypeVar("T")

PREFIX = "muonckpt/async_save"
"""Every mailbox's keys are under ``PREFIX/<its name>/``."""
_OPEN = "open"
"""The key the root sets first and deletes last: the mailbox is there while it is."""
_NONE = "\x00none"
"""What no message is (each is JSON): the expected value of a read that must not wait."""
CONNECT_S = 5.0
"""How long a connection of the mailbox's own may take to be made (ms, when the store is
there)."""
_FIRST_POLL_S = 0.001
_LONGEST_POLL_S = 0.1
_POLL_GROWTH = 1.25
"""Each pause this much longer than the one before: a message is seen at most a quarter of
the wait so far after it arrived (doubling let a background save's step overshoot by up to
64 ms, 1.3x a synchronous save at 1 GB), at about 11 polls more per wait than doubling (21
polls to reach the longest pause, 0.43 s into the wait). A poll is two requests to the
store (are the messages there; is the mailbox), whatever the number of messages."""


class Mailbox:
    """The messages of one background save, ``name``: keys of ``store`` (the job's) under
    ``muonckpt/async_save/<name>/``.

    A message is set once and never rewritten (:meth:`post`), or set by exactly one of the
    ranks that :meth:`claim` it (the store's ``compare_set``). Waits poll (:meth:`wait`)
    rather than block in the store's own ``wait``, which holds its connection for as long as
    it waits; and the messages go through a connection of their own (``store.clone()``,
    :meth:`connect`, as the background thread starts: not in the call, whose stall it would
    add to, nor later, when the store's host may be gone and a new connection would retry
    for as long as the store's timeout), so that a wait of the job's on the store (a
    rendezvous, NCCL's initialisation) holds up neither the messages nor the job. A store
    that cannot be reached is a :class:`CheckpointError` saying where it was.
    """

    def __init__(self, name: str, store: Store) -> None:
        self.name = name
        self._job = PrefixStore(f"{PREFIX}/{name}", store)
        self._own: Store | None = None
        self._token = uuid.uuid4().hex
        """Tells this rank's claims from the others' (:meth:`claim`)."""
        self._names: set[str] = set()
        """Every message this rank has left, claimed or asked for: what :meth:`remove`
        deletes (the root asks for every other rank's)."""

    @classmethod
    def create(cls, store: Store | None = None) -> Mailbox:
        """(the root, before any message, in the caller's thread) A new mailbox in ``store``
        (default: the default process group's)."""
        mailbox = cls(uuid.uuid4().hex, default_store() if store is None else store)
        mailbox._do("making the mailbox", lambda keys: keys.set(_OPEN, ""))
        return mailbox

    def connect(self) -> None:
        """(in the background thread, first) A connection of this mailbox's own to the store,
        or the job's for a store that cannot make one (a store of the job's own making, or
        one gone already: the first message then says so)."""
        made: list[Store] = []

        def clone() -> None:
            with contextlib.suppress(RuntimeError):
                made.append(self._job.clone())  # type: ignore[attr-defined]  # (not in stubs)

        # A clone of a store whose host is dying connects again and again for the store's
        # whole timeout (30 min): after CONNECT_S, the job's connection, whose first request
        # then fails at once.
        maker = threading.Thread(target=clone, name="muonckpt store connection", daemon=True)
        maker.start()
        maker.join(CONNECT_S)
        self._own = made[0] if made else self._job

    def _keys(self) -> Store:
        """This mailbox's keys, through its own connection once made (:meth:`connect`)."""
        return self._job if self._own is None else self._own

    def _do(self, what: str, request: Callable[[Store], T]) -> T:
        """``request`` of this mailbox's keys; a store that fails it a :class:`CheckpointError`."""
        try:
            return request(self._keys())
        except RuntimeError as exc:  # (torch.distributed's errors: DistError and its kinds)
            why = one_line(exc)
            if isinstance(exc, dist.DistNetworkError):
                why = f"{store_gone(self._job)} ({why})"
            raise CheckpointError(f"{what} in the process group's store failed: {why}") from exc

    def post(self, name: str, payload: Any) -> None:
        """Leave message ``name``; a mailbox the root has removed already is a
        :class:`CheckpointError` (and nothing is left in it)."""
        if not self.present():
            raise CheckpointError(f"cannot leave message {name!r}: the mailbox is gone")
        self._names.add(name)
        self._do(f"leaving message {name}", lambda keys: keys.set(name, self._wrapped(payload)))

    def claim(self, name: str, payload: Any) -> bool:
        """Leave message ``name`` unless one is there already: of several ranks that claim
        one name, exactly one succeeds (the store's ``compare_set``). Whether this rank did."""
        self._names.add(name)
        mine = self._wrapped(payload)
        there = self._do(f"claiming message {name}", lambda keys: keys.compare_set(name, "", mine))
        return bool(json.loads(there)[0] == self._token)

    def read(self, name: str) -> Any:
        """Message ``name``, which must be there (a :class:`CheckpointError` when it is not:
        the root removed the mailbox meanwhile)."""
        self._names.add(name)
        data = self._peek(name)
        if data is None:
            raise CheckpointError(f"message {name!r} is gone: the mailbox was removed")
        return self._unwrapped(data)

    def _peek(self, name: str) -> bytes | None:
        """Message ``name`` as stored, or None when it is not there, without waiting: the
        store's ``get`` of a key deleted since it was seen waits for the store's whole
        timeout (30 min under torchrun), where ``compare_set`` with an expected value no
        message has answers at once (the value there, or that expected value itself)."""
        data: bytes = self._do(
            f"reading message {name}", lambda keys: keys.compare_set(name, _NONE, _NONE)
        )
        return None if data == _NONE.encode() else data

    def _wrapped(self, payload: Any) -> str:
        return json.dumps([self._token, payload])

    @staticmethod
    def _unwrapped(data: bytes) -> Any:
        return json.loads(data.decode())[1]

    def present(self) -> bool:
        """Whether the mailbox is there: made, and not yet removed."""
        return bool(self._do("looking for the mailbox", lambda keys: keys.check([_OPEN])))

    def wait(self, names: Sequence[str], timeout: float) -> tuple[dict[str, Any], list[str]]:
        """The messages ``names`` that arrive within ``timeout`` seconds, and those that did
        not (in the order of ``names``); early when the mailbox itself is gone. Polls ever
        further apart (:data:`_POLL_GROWTH`) up to 0.1 s."""
        self._names.update(names)
        deadline = time.monotonic() + timeout
        pause = _FIRST_POLL_S
        while True:
            if self._do("looking for messages", lambda keys: keys.check(list(names))):
                return self._some(names)  # (all, unless the root removed them meanwhile)
            if time.monotonic() >= deadline or not self.present():
                return self._some(names)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * _POLL_GROWTH, _LONGEST_POLL_S)

    def _some(self, names: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
        """The messages ``names`` there now, and those not (once a wait has ended)."""
        stored = {name: self._peek(name) for name in names}
        found = {name: self._unwrapped(data) for name, data in stored.items() if data is not None}
        return found, [name for name in names if name not in found]

    def remove(self) -> None:
        """Delete every message this rank has left, claimed or asked for (the root: all of
        them), the mailbox's mark last."""
        for name in [*sorted(self._names), _OPEN]:
            self._delete(name)

    def _delete(self, name: str) -> None:
        self._do(f"deleting message {name}", lambda keys: keys.delete_key(name))


class MailboxSteps(StepProtocol):
    """:class:`~muonckpt.files.writing.Steps` whose messages go through a :class:`Mailbox`,
    for the ranks of a background save (which must not use the job's process groups).

    Every rank leaves its outcome of a step (``<step>-<rank>``); the root waits up to
    ``timeout`` seconds for all of them and leaves the step's outcome (``<step>-outcome``),
    which the others wait for up to twice that (the root itself may wait ``timeout`` for the
    slowest rank). Waits are bounded, so a rank that never reports fails the step on the
    others instead of hanging them.

    Every rank ends a step with the same outcome, also when ranks give up on each other: the
    step is decided once, by whoever first claims ``<step>-decision``
    (:meth:`Mailbox.claim`). The root claims it before it acts (its ``then`` may commit a
    checkpoint, which cannot be taken back), or with the failure it found; a rank that gives
    up waiting for the root claims it with its error, and a root that finds the claim taken
    acts on nothing and passes that error on. Only a root that claimed and then gives no
    outcome for another ``timeout`` leaves the others unsure (they say so). A store that
    cannot be reached (its host killed) fails the step on the rank that finds it so. With one
    rank there is nobody to tell, and no mailbox (``mailbox`` None).
    """

    def __init__(
        self,
        operation: str,
        mailbox: Mailbox | None,
        ranks: Sequence[int],
        root: int,
        rank: int,
        timeout: float,
        error: type[MuonCkptError],
    ) -> None:
        super().__init__(operation, ranks, root, error, rank)
        self.mailbox, self.timeout = mailbox, timeout

    def connect(self) -> None:
        """(in the background thread, before the first step) The mailbox's own connection
        (:meth:`Mailbox.connect`)."""
        if self.mailbox is not None:
            self.mailbox.connect()

    def _exchange(
        self, step: str, mine: Outcome, decide: Callable[[list[Outcome]], Outcome]
    ) -> Outcome:
        if self.mailbox is None:
            return decide([mine])  # nobody to tell: no mailbox
        tag = step.replace(" ", "-")
        try:
            if self.is_root:
                outcome = self._decide(self.mailbox, tag, mine, decide)
                with contextlib.suppress(CheckpointError):  # the others then time out
                    self.mailbox.post(f"{tag}-outcome", outcome)
                return outcome
            return self._await_outcome(self.mailbox, tag, mine)
        except CheckpointError as exc:  # the store failed (a failure of the step is data)
            if exc.agreed_by == self.ranks:
                raise
            raise self.error(f"{self.operation} ({step}): {exc}") from exc

    def _decide(
        self,
        mailbox: Mailbox,
        tag: str,
        mine: Outcome,
        decide: Callable[[list[Outcome]], Outcome],
    ) -> Outcome:
        """(the root) Every rank's outcome (its own as it is), then the step's: acted on only
        once claimed."""
        names = {rank: f"{tag}-{rank}" for rank in self.ranks if rank != self.root}
        found, missing = mailbox.wait(list(names.values()), self.timeout)
        outcomes = [mine if rank == self.root else found.get(names[rank]) for rank in self.ranks]
        if missing:
            late = [rank for rank, name in names.items() if name in missing]
            failed: Outcome | None = {
                "error": f"rank(s) {late} did not finish within {self.timeout:g} s"
            }
        else:
            failed = next((o for o in outcomes if o is not None and "error" in o), None)
        decision = failed if failed is not None else {"acting": self.root}
        if not mailbox.claim(f"{tag}-decision", decision):
            return cast(Outcome, mailbox.read(f"{tag}-decision"))  # a rank gave up first
        return failed if failed is not None else decide(cast(list[Outcome], outcomes))

    def _await_outcome(self, mailbox: Mailbox, tag: str, mine: Outcome) -> Outcome:
        """(every other rank) Report ``mine``, then the root's outcome of the step; if it
        does not come in time, this rank's own failure, unless the root already took the
        decision."""
        with contextlib.suppress(CheckpointError):  # a mailbox gone is reported below
            mailbox.post(f"{tag}-{self.rank}", mine)
        found, missing = mailbox.wait([f"{tag}-outcome"], 2 * self.timeout)
        if not missing:
            return cast(Outcome, found[f"{tag}-outcome"])
        if not mailbox.present():
            why = f"rank {self.root} gave up waiting for this rank (its mailbox is gone)"
            return {"error": f"rank {self.rank}: {why}"}
        abort = {
            "error": f"rank {self.rank}: rank {self.root} gave no outcome within "
            f"{2 * self.timeout:g} s"
        }
        if mailbox.claim(f"{tag}-decision", abort):
            return abort
        decision = cast(Outcome, mailbox.read(f"{tag}-decision"))
        if "error" in decision:
            return decision
        found, missing = mailbox.wait([f"{tag}-outcome"], self.timeout)
        if not missing:
            return cast(Outcome, found[f"{tag}-outcome"])
        return {
            "error": f"rank {self.rank}: rank {self.root} went on with the step but gave no "
            f"outcome within {3 * self.timeout:g} s: whether it took effect is unknown"
        }

    def leave(self) -> None:
        """(every rank, once done with the protocol) Say so; the root then waits up to
        ``timeout`` for the others and removes the mailbox (its keys)."""
        if self.mailbox is None:
            return
        with contextlib.suppress(CheckpointError):  # the root gave up on this rank already
            self.mailbox.post(f"done-{self.rank}", None)
        if self.is_root:
            with contextlib.suppress(CheckpointError):  # the store is gone: nothing to delete
                self.mailbox.wait([f"done-{rank}" for rank in self.ranks], self.timeout)
                self.mailbox.remove()
