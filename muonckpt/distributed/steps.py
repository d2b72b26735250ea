"""The step protocol: one operation over several ranks, run as named steps that every rank
ends knowing the same outcome of, whatever carries the messages.

Two transports carry it: :class:`muonckpt.distributed.group_steps.CollectiveSteps` (JSON
point-to-point over the job's process group, for work in the caller's thread) and
:class:`muonckpt.distributed.mailbox.MailboxSteps` (JSON messages in the process group's
store, for a background save, which must not touch the job's process groups). Pure: no
torch, no files.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from ..errors import ArgumentError, MuonCkptError

T = TypeVar("T")

Outcome = dict[str, Any]
"""``{"value": ...}`` or ``{"error": message, "rank": the rank that failed}`` (and
``"argument"``: the one an :class:`ArgumentError` refused): one rank's result of a step, as
JSON."""


class StepProtocol:
    """One operation run as named steps over ``ranks``, as DCP's ``_DistWrapper``.

    A step ends with every rank knowing its outcome: the value, or the failure of any rank,
    raised on every rank as the same ``error`` (a library error type the caller chooses; an
    :class:`ArgumentError` for a refused argument, where that is one),
    ``"<operation> (<step>): <message>"``, its ``rank`` the rank that failed and its
    ``agreed_by`` these ranks. A failure of a step nested inside another one's work over the
    same ranks (the state-dict gather inside a consolidated save's write) has been raised on
    every rank already and passes through the outer step unchanged. Any
    Exception counts, not only the library's own: a rank that let anything else escape would
    leave the others waiting at the next exchange. A library error's message is kept (naming
    the rank where several ranks work); any other names the rank, the exception type and where
    it was raised. KeyboardInterrupt and other BaseExceptions propagate.

    Subclasses say how outcomes travel (:meth:`_exchange`).
    """

    def __init__(
        self,
        operation: str,
        ranks: Sequence[int],
        root: int,
        error: type[MuonCkptError],
        rank: int,
    ) -> None:
        self.operation, self.ranks, self.root, self.error = operation, list(ranks), root, error
        self.rank = rank
        self.is_root = rank == root
        self._failure: Exception | None = None
        """This rank's own exception in the current step, chained to the error raised."""

    def each_then_root(
        self, step: str, each: Callable[[], Any], then: Callable[[list[Any]], T]
    ) -> T:
        """``each()`` on every rank, their values (in the order of ``ranks``) to
        ``then(values)`` on the root, its value on every rank.

        Any rank's failure in ``each`` fails the step on every rank, and ``then`` does not run.
        """

        def decide(outcomes: list[Outcome]) -> Outcome:
            failed = [o for o in outcomes if "error" in o]
            return failed[0] if failed else self._run(lambda: then([o["value"] for o in outcomes]))

        outcome = self._exchange(step, self._run(each, name_rank=True), decide)
        return cast(T, self._agreed(step, outcome))  # the value ``then`` returned, on the root

    def _exchange(
        self, step: str, mine: Outcome, decide: Callable[[list[Outcome]], Outcome]
    ) -> Outcome:
        """Bring every rank's ``mine`` to the root, which calls ``decide`` on them (in the
        order of ``ranks``); the root's outcome on every rank."""
        raise NotImplementedError

    def _run(self, work: Callable[[], Any], name_rank: bool = False) -> Outcome:
        """``{"value": work()}``, or its failure (:data:`Outcome`) when it raises an Exception
        (a library error's message names this rank with ``name_rank`` among several ranks)."""
        try:
            return {"value": work()}
        except MuonCkptError as exc:
            if exc.agreed_by == self.ranks:
                raise  # a nested step's failure, already raised on every rank of this protocol
            self._failure = exc
            named = name_rank and len(self.ranks) > 1
            outcome = {
                "error": f"rank {self.rank}: {exc}" if named else str(exc),
                "rank": self.rank,
            }
            if isinstance(exc, ArgumentError):
                outcome["argument"] = exc.argument
            return outcome
        except Exception as exc:
            self._failure = exc
            return {"error": failure_line(exc, self.rank), "rank": self.rank}

    def _agreed(self, step: str, outcome: Outcome) -> Any:
        failure, self._failure = self._failure, None
        if "error" in outcome:
            message = f"{self.operation} ({step}): {outcome['error']}"
            rank, argument = outcome.get("rank"), outcome.get("argument")
            if argument is not None and issubclass(ArgumentError, self.error):
                raise ArgumentError(
                    message, argument=argument, rank=rank, agreed_by=self.ranks
                ) from failure
            raise self.error(message, rank=rank, agreed_by=self.ranks) from failure
        return outcome["value"]


def failure_line(exc: BaseException, rank: int) -> str:
    """``rank R: Type: message (at file.py:line in function)``, on one line."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        where = f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    text = " ".join(str(exc).split())
    return f"rank {rank}: {type(exc).__name__}{': ' + text if text else ''}{where}"


def disagreement(arguments: Sequence[dict[str, Any]], ranks: Sequence[int]) -> str | None:
    """What the ranks' ``arguments`` of one call (in the order of ``ranks``) disagree on, as
    ``"params: rank 0 True, rank(s) [1, 2] False"`` (the first argument that differs); None
    when they all agree."""
    for key in arguments[0]:
        by_value: dict[str, list[int]] = {}
        for rank, given in zip(ranks, arguments, strict=True):
            by_value.setdefault(repr(given.get(key)), []).append(rank)
        if len(by_value) > 1:
            shown = [
                f"rank {r[0]} {v}" if len(r) == 1 else f"ranks {r} {v}" for v, r in by_value.items()
            ]
            return f"{key}: {', '.join(shown)}"
    return None
