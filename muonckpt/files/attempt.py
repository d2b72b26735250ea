"""(internal) One rank's own work, done before the protocol step that agrees on it: its value,
or what it raised, which that step raises on every rank as if the work had run inside it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar, cast

T = TypeVar("T", covariant=True)


@dataclass(frozen=True)
class Attempt(Generic[T]):
    """The value of a rank's work, or its ``failure``: what the next step of the protocol
    (:meth:`muonckpt.distributed.steps.StepProtocol.each_then_root`) asks each rank for, so
    that a refusal on any rank fails the step on every rank, and an interruption propagates
    from there as it would have from the work itself."""

    value: T | None = None
    failure: BaseException | None = None

    def result(self) -> T:
        """The value, or the failure raised again (its traceback kept)."""
        if self.failure is not None:
            raise self.failure
        return cast(T, self.value)
