"""The library's own error types: every failure a user can cause is one of these."""

from __future__ import annotations


class MuonCkptError(Exception):
    """Base class of every error muonckpt raises on bad input or a damaged checkpoint."""


class LayoutError(MuonCkptError, ValueError):
    """A parameter, topology or buffer arrangement that cannot be laid out."""


class StateDictError(MuonCkptError, ValueError):
    """A state dict that does not fit the optimizer it is loaded into."""


class CheckpointError(MuonCkptError):
    """A checkpoint on disk that is missing, incomplete, corrupt or from an unknown format."""

    def __init__(self, message: str, *, path: object = None, param: str | None = None) -> None:
        where = []
        if path is not None:
            where.append(f"file {path}")
        if param is not None:
            where.append(f"param {param!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.path = path
        self.param = param


class CollectiveError(MuonCkptError, RuntimeError):
    """Ranks disagree about what they are about to exchange (detected before any data moves)."""


class PeerLostError(CollectiveError):
    """The rank(s) at the other end of a transfer went away (died, or their connection broke),
    named in the message; torch's own error is its ``__cause__``. Inside an operation's steps
    it becomes the operation's own error, as the loss of the process group's store does."""


class OptionError(MuonCkptError, ValueError):
    """A request whose options do not go together, or an option's value outside its choices
    (``muonckpt convert --format dcp --rename ...``), refused before anything is read or
    written. ``option`` names the option at fault as the command line spells it (``--to``),
    None when the fault is the combination."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class ConversionWarning(UserWarning):
    """A load across Muon implementations whose target settings cannot continue the saved
    trajectory exactly (the message says which setting would)."""


class CheckpointWarning(UserWarning):
    """Something went wrong after a checkpoint was committed (the old one could not be deleted
    entirely, say): the new checkpoint is in place, and the warning names what is left."""


def mark_committed(exc: BaseException, path: object) -> BaseException:
    """Tag an interruption that came after ``path`` was committed (so that it is reported as
    "committed; interrupted while cleaning up", never as an error over a whole new
    checkpoint); returns ``exc``."""
    exc.muonckpt_committed = str(path)  # type: ignore[attr-defined]
    return exc


def committed_path(exc: BaseException) -> str | None:
    """The checkpoint committed before ``exc`` interrupted the cleanup (:func:`mark_committed`),
    or None."""
    return getattr(exc, "muonckpt_committed", None)
