"""(internal) :class:`DirectorySteps`: the step protocol whose messages are files of a
:class:`~muonckpt.storage.Mailbox`, for the ranks of a background save
(:func:`muonckpt.async_save`), which must not use the job's process groups."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import cast

from .. import storage
from ..distributed.steps import Outcome, StepProtocol
from ..errors import CheckpointError, MuonCkptError


class DirectorySteps(StepProtocol):
    """:class:`~muonckpt.files.writing.Steps` whose messages are files of a
    :class:`~muonckpt.storage.Mailbox`, for the ranks of a background save (which must not use
    the job's process groups).

    Every rank leaves its outcome of a step (``<step>-<rank>``); the root waits up to
    ``timeout`` seconds for all of them and leaves the step's outcome (``<step>-outcome``),
    which the others wait for up to twice that (the root itself may wait ``timeout`` for the
    slowest rank). Waits are bounded, so a rank that never reports fails the step on the
    others instead of hanging them.

    Every rank ends a step with the same outcome, also when ranks give up on each other: the
    step is decided once, by whoever first claims ``<step>-decision``
    (:meth:`~muonckpt.storage.Mailbox.claim`). The root claims it before it acts (its
    ``then`` may commit a checkpoint, which cannot be taken back), or with the failure it
    found; a rank that gives up waiting for the root claims it with its error, and a root that
    finds the claim taken acts on nothing and passes that error on. Only a root that claimed
    and then gives no outcome for another ``timeout`` leaves the others unsure (they say so).
    With one rank there is nobody to tell, and no mailbox.
    """

    def __init__(
        self,
        operation: str,
        mailbox: storage.Mailbox,
        ranks: Sequence[int],
        root: int,
        rank: int,
        timeout: float,
        error: type[MuonCkptError],
    ) -> None:
        super().__init__(operation, ranks, root, error, rank)
        self.mailbox, self.timeout = mailbox, timeout

    def _exchange(
        self, step: str, mine: Outcome, decide: Callable[[list[Outcome]], Outcome]
    ) -> Outcome:
        if len(self.ranks) == 1:
            return decide([mine])  # nobody to tell: no mailbox
        tag = step.replace(" ", "-")
        if self.is_root:
            outcome = self._decide(tag, mine, decide)
            with contextlib.suppress(CheckpointError):  # the others then time out and say so
                self.mailbox.post(f"{tag}-outcome", outcome)
            return outcome
        return self._await_outcome(tag, mine)

    def _decide(
        self, tag: str, mine: Outcome, decide: Callable[[list[Outcome]], Outcome]
    ) -> Outcome:
        """(the root) Every rank's outcome (its own as it is), then the step's: acted on only
        once claimed."""
        names = {rank: f"{tag}-{rank}" for rank in self.ranks if rank != self.root}
        found, missing = self.mailbox.wait(list(names.values()), self.timeout)
        outcomes = [mine if rank == self.root else found.get(names[rank]) for rank in self.ranks]
        if missing:
            late = [rank for rank, name in names.items() if name in missing]
            failed: Outcome | None = {
                "error": f"rank(s) {late} did not finish within {self.timeout:g} s"
            }
        else:
            failed = next((o for o in outcomes if o is not None and "error" in o), None)
        decision = failed if failed is not None else {"acting": self.root}
        if not self.mailbox.claim(f"{tag}-decision", decision):
            return cast(Outcome, self.mailbox.read(f"{tag}-decision"))  # a rank gave up first
        return failed if failed is not None else decide(cast(list[Outcome], outcomes))

    def _await_outcome(self, tag: str, mine: Outcome) -> Outcome:
        """(every other rank) Report ``mine``, then the root's outcome of the step; if it
        does not come in time, this rank's own failure, unless the root already took the
        decision."""
        with contextlib.suppress(CheckpointError):  # a mailbox gone is reported below
            self.mailbox.post(f"{tag}-{self.rank}", mine)
        found, missing = self.mailbox.wait([f"{tag}-outcome"], 2 * self.timeout)
        if not missing:
            return cast(Outcome, found[f"{tag}-outcome"])
        if not self.mailbox.present():
            why = f"rank {self.root} gave up waiting for this rank (its mailbox is gone)"
            return {"error": f"rank {self.rank}: {why}"}
        abort = {
            "error": f"rank {self.rank}: rank {self.root} gave no outcome within "
            f"{2 * self.timeout:g} s"
        }
        if self.mailbox.claim(f"{tag}-decision", abort):
            return abort
        decision = cast(Outcome, self.mailbox.read(f"{tag}-decision"))
        if "error" in decision:
            return decision
        found, missing = self.mailbox.wait([f"{tag}-outcome"], self.timeout)
        if not missing:
            return cast(Outcome, found[f"{tag}-outcome"])
        return {
            "error": f"rank {self.rank}: rank {self.root} went on with the step but gave no "
            f"outcome within {3 * self.timeout:g} s: whether it took effect is unknown"
        }

    def leave(self) -> None:
        """(every rank, once done with the protocol) Say so; the root then waits up to
        ``timeout`` for the others and removes the mailbox."""
        if len(self.ranks) == 1:
            return
        with contextlib.suppress(CheckpointError):  # the root gave up on this rank already
            self.mailbox.post(f"done-{self.rank}", None)
        if self.is_root:
            self.mailbox.wait([f"done-{rank}" for rank in self.ranks], self.timeout)
            self.mailbox.remove()
