"""The library's own error types: every failure a user can cause is one of these.

Each carries the facts its message names as fields, set when it is raised (``path``,
``param``, ``argument``, ``peers``, ``rank``, ``agreed_by``), so that a caller can act on them
without parsing the message; ``str()`` is the message alone. An error from a write
(``save``, ``consolidate``, ...) means nothing was committed: a failure after the commit is a
:class:`CheckpointWarning`, and an interruption after it an :class:`InterruptedAfterCommit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "ArgumentError",
    "CheckpointError",
    "CheckpointWarning",
    "CollectiveError",
    "ConversionWarning",
    "DistributedRunError",
    "EnvironmentWarning",
    "InterruptedAfterCommit",
    "LayoutError",
    "MuonCkptError",
    "OptionError",
    "PeerLostError",
    "PreconditionFailed",
    "RestoreError",
    "RestoreWarning",
    "StateDictError",
    "StoreUnreachable",
]


class MuonCkptError(Exception):
    """Base class of every error muonckpt raises on bad input or a damaged checkpoint.

    Where several ranks work together, two fields say which: :attr:`rank` and
    :attr:`agreed_by` (None for an error of this process alone).
    """

    rank: int | None
    """The rank whose failure this is: the one that failed an operation's step (the error is
    raised on every rank of the operation), or the child of a local launch that failed."""
    agreed_by: list[int] | None
    """The ranks this same error was raised on together, a failed step of an operation over
    several ranks (:class:`muonckpt.distributed.steps.StepProtocol`)."""

    def __init__(
        self, *args: object, rank: int | None = None, agreed_by: Sequence[int] | None = None
    ) -> None:
        super().__init__(*args)
        self.rank = rank
        self.agreed_by = None if agreed_by is None else list(agreed_by)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled and copied as its message and fields, not by calling ``__init__`` again
        (whose keyword-only fields the message no longer separates)."""
        return (_rebuilt, (type(self), self.args, self.__dict__))


def _rebuilt(kind: type[MuonCkptError], args: tuple[object, ...], fields: dict[str, Any]) -> Any:
    """An error of type ``kind`` with message ``args`` and ``fields`` (unpickling)."""
    error = kind.__new__(kind, *args)
    error.args = args
    error.__dict__.update(fields)
    return error


class LayoutError(MuonCkptError, ValueError):
    """A parameter, topology or buffer arrangement that cannot be laid out."""


class StateDictError(MuonCkptError, ValueError):
    """A state dict that does not fit the optimizer it is loaded into."""


class CheckpointError(MuonCkptError):
    """A checkpoint on disk that is missing, incomplete, corrupt or from an unknown format, or
    one that cannot be written where or as asked.

    :attr:`path` and :attr:`param` are also named at the end of the message."""

    path: object
    """The file or directory at fault (as given: a str or a Path), or None."""
    param: str | None
    """The param (optimizer or model tensor name) at fault, or None."""

    def __init__(
        self,
        message: str,
        *,
        path: object = None,
        param: str | None = None,
        rank: int | None = None,
        agreed_by: Sequence[int] | None = None,
    ) -> None:
        where = []
        if path is not None:
            where.append(f"file {path}")
        if param is not None:
            where.append(f"param {param!r}")
        text = f"{message} ({', '.join(where)})" if where else message
        super().__init__(text, rank=rank, agreed_by=agreed_by)
        self.path = path
        self.param = param


class ArgumentError(CheckpointError, ValueError):
    """An argument muonckpt cannot take: a wrong type, a value out of range, or options that
    exclude each other (``keep_last=0``, ``max_shard_size="5XB"``, ``demo --dp 1000``, a URL for
    a path), refused before anything is read or written; the message names it, as does
    :attr:`argument`.

    A :class:`ValueError`, as Python's own refusals of a value are, and a
    :class:`CheckpointError`, as these refusals were before it existed (``except
    CheckpointError`` still catches them); the command line exits with code 2, as for bad usage.
    """

    argument: str
    """The argument (or setting) refused, as the message names it: ``"keep_last"``,
    ``"max_shard_size"``, ``"extra"``..."""

    def __init__(
        self,
        message: str,
        *,
        argument: str,
        path: object = None,
        param: str | None = None,
        rank: int | None = None,
        agreed_by: Sequence[int] | None = None,
    ) -> None:
        super().__init__(message, path=path, param=param, rank=rank, agreed_by=agreed_by)
        self.argument = argument


class PreconditionFailed(CheckpointError):
    """A conditional write to object storage was refused (HTTP 412): the object exists
    (``If-None-Match: *``) or is no longer the one whose etag was given (``If-Match``). How a
    commit on S3 learns that another writer committed first."""


class StoreUnreachable(CheckpointError):
    """Object storage could not be used, for a reason of the place and not of a checkpoint:
    no credentials, access denied, no such bucket, or the server unreachable or failing after
    every retry. :func:`muonckpt.verify` raises it rather than report it as a problem of the
    checkpoint (the command line's ``verify`` exits 2, as for bad usage)."""


class CollectiveError(MuonCkptError, RuntimeError):
    """Ranks disagree about what they are about to exchange (detected before any data moves)."""


class PeerLostError(CollectiveError):
    """The rank(s) at the other end of a transfer went away (died, or their connection broke),
    named in the message and in :attr:`peers`; torch's own error is its ``__cause__``. Inside
    an operation's steps it becomes the operation's own error, as the loss of the process
    group's store does."""

    peers: list[int]
    """The global ranks at the other end: the one sent to or received from, or every rank of
    the group of a collective (which of them went away, torch does not say)."""

    def __init__(self, message: str, *, peers: Sequence[int]) -> None:
        super().__init__(message)
        self.peers = list(peers)


class DistributedRunError(MuonCkptError, RuntimeError):
    """A child process of a local launch (:func:`muonckpt.distributed.run_distributed`) raised,
    crashed or timed out; :attr:`rank` is the child's rank, where one is to blame.

    ``str()`` is the one-line :attr:`summary` followed by the failing rank's traceback
    (:attr:`details`); the command line shows the summary alone (``--debug``: everything).
    """

    summary: str
    """One line: which rank failed, and how."""
    details: str
    """The failing rank's traceback, or ``""``."""

    def __init__(self, summary: str, details: str = "", *, rank: int | None = None) -> None:
        super().__init__(f"{summary}\n{details}" if details else summary, rank=rank)
        self.summary = summary
        self.details = details


class InterruptedAfterCommit(KeyboardInterrupt):
    """An interruption (Ctrl-C; SIGTERM or SIGHUP in the command line) that came after the
    checkpoint at :attr:`path` was committed: that checkpoint is whole, only the cleanup after
    it (deleting the checkpoint it replaced, older ones past ``keep_last``) was cut short;
    ``muonckpt clean`` removes what is left. The interruption itself is its ``__cause__``.

    A :class:`KeyboardInterrupt`, so that it stops a script as the interruption would have;
    the command line reports it as ``committed: ...`` with exit code 3.
    """

    path: str
    """The checkpoint committed."""

    def __init__(self, path: object) -> None:
        super().__init__(f"interrupted after {path} was committed (the checkpoint is whole)")
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path,))


class OptionError(ArgumentError):
    """A request whose options do not go together, or an option's value outside its choices
    (``muonckpt convert --format dcp --rename ...``), refused before anything is read or
    written. ``option`` names the option at fault as the command line spells it (``--to``),
    None when the fault is the combination (then :attr:`argument` is ``"options"``)."""

    option: str | None

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message, argument=option or "options")
        self.option = option


class ConversionWarning(UserWarning):
    """A load across Muon implementations whose target settings cannot continue the saved
    trajectory exactly (the message says which setting would)."""


class CheckpointWarning(UserWarning):
    """Something went wrong after a checkpoint was committed (the old one could not be deleted
    entirely, say): the new checkpoint is in place, and the warning names what is left."""


class EnvironmentWarning(UserWarning):
    """A load in another environment than the save's, where a resumed run is not bitwise the
    uninterrupted one (another torch, intra-op thread count, ``OMP_NUM_THREADS``, device type
    or deterministic setting); the message names what differs, saved -> now."""


class RestoreError(CheckpointError):
    """A load whose check after ``load_state_dict`` found the optimizer (or the model) not
    holding what the checkpoint gave it: a value that differs, state it dropped, a model not
    synced to the params. :attr:`param` and :attr:`key` name the first one; the message names
    up to eight."""

    key: str | None
    """The state key (``param`` for the param's own values, ``model`` for the model's weight)
    at fault, or None."""

    def __init__(self, message: str, *, param: str | None = None, key: str | None = None) -> None:
        super().__init__(message, param=param)
        self.key = key


class RestoreWarning(UserWarning):
    """A load whose optimizer cast state to another dtype by its own documented rule (torch
    casts floating state to its param's dtype): not a failure, but not the saved values bit for
    bit; the message names the params and both dtypes."""
