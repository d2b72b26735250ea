"""A directory through which the ranks of one background save exchange small JSON messages.

A background save (:func:`muonckpt.async_save`) must not use the job's process groups: a
collective from its thread could deadlock with, or be reordered against, the job's own. Its
ranks already share the checkpoint's filesystem (they write into one staging directory), so
they talk through it: ``.NAME.steps-XXXXXXXX`` beside the target, named after the save's
staging directory ``.NAME.staging-XXXXXXXX`` and, like it, muonckpt's own by the lease file the
root writes into it first and holds while the save runs (:mod:`.lease`). Each message is one
file, written to a temporary name and renamed (or hard-linked, for a message only one rank may
leave: :meth:`Mailbox.claim`), so a reader sees it whole or not at all; a message is never
rewritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from . import lease
from .durable import read_text, remove_quietly

MAILBOX_TAG = "steps"
_MESSAGE = re.compile(r"^[a-z-]+-(\d+|outcome|decision)\.json$")
"""Names of the messages: ``<step>-<rank>.json``, ``<step>-outcome.json``,
``<step>-decision.json``."""
_TEMPORARY = re.compile(r"^\.[a-z-]+-(\d+|outcome|decision)\.json\.tmp-\d+-\d+$")
_FIRST_POLL_S = 0.001
_LONGEST_POLL_S = 0.1
_POLL_GROWTH = 1.25
"""Each pause this much longer than the one before: a message is seen at most a quarter of
the wait so far after it arrived (doubling let a background save's step overshoot by up to
64 ms, 1.3x a synchronous save at 1 GB), at about 11 listings more per wait than doubling
(21 polls to reach the longest pause, 0.43 s into the wait)."""


def is_mailbox(name: str) -> bool:
    """Whether ``name`` is a mailbox's (``.NAME.steps-XXXXXXXX``)."""
    return re.fullmatch(rf"\..+\.{MAILBOX_TAG}-[0-9a-f]{{8}}", name, re.DOTALL) is not None


def mailbox_path(staging: str | os.PathLike[str]) -> Path:
    """The mailbox of the save staged in ``staging`` (``.NAME.staging-X`` ->
    ``.NAME.steps-X``)."""
    staging = Path(staging)
    stem, _, token = staging.name.rpartition("-")
    return staging.with_name(f"{stem.rpartition('.')[0]}.{MAILBOX_TAG}-{token}")


class Mailbox:
    """The messages of one background save, in ``directory``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def create(self) -> None:
        """(one rank, before any message) Make the directory, holding only its lease, which
        this process holds until :meth:`remove`."""
        try:
            self.directory.mkdir()
        except OSError as exc:
            raise CheckpointError(
                f"cannot create the save's mailbox: {exc}", path=self.directory
            ) from None
        try:
            lease.take(self.directory, "mailbox")
        except BaseException:
            with contextlib.suppress(OSError):
                self.directory.rmdir()
            raise

    def _path(self, name: str) -> Path:
        if not _MESSAGE.match(f"{name}.json"):
            raise ValueError(f"not a mailbox message name: {name!r}")
        return self.directory / f"{name}.json"

    def post(self, name: str, payload: Any) -> None:
        """Leave message ``name``; readers see all of it or none."""
        self._leave(name, payload, exclusive=False)

    def claim(self, name: str, payload: Any) -> bool:
        """Leave message ``name`` unless one is there already: of several ranks that claim
        one name, exactly one succeeds (a hard link, atomic on every POSIX filesystem, NFS
        included). Whether this rank did."""
        return self._leave(name, payload, exclusive=True)

    def read(self, name: str) -> Any:
        """Message ``name``, which must be there."""
        return json.loads(read_text(self._path(name)))

    def _leave(self, name: str, payload: Any, exclusive: bool) -> bool:
        path = self._path(name)
        tmp = self.directory / f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(payload, f)
            if not exclusive:
                os.replace(tmp, path)
                return True
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                remove_quietly(tmp)
            return True
        except OSError as exc:
            remove_quietly(tmp)
            raise CheckpointError(f"cannot leave message {name!r}: {exc}", path=path) from None

    def present(self) -> bool:
        return self.directory.is_dir()

    def wait(self, names: Sequence[str], timeout: float) -> tuple[dict[str, Any], list[str]]:
        """The messages ``names`` that arrive within ``timeout`` seconds, and those that did
        not (in the order of ``names``); early when the mailbox itself is gone. One listing
        of the directory per poll, polls ever further apart (:data:`_POLL_GROWTH`) up to
        0.1 s (light on a shared filesystem's metadata server)."""
        deadline = time.monotonic() + timeout
        found: dict[str, Any] = {}
        pause = _FIRST_POLL_S
        while True:
            try:
                present = set(os.listdir(self.directory))
            except OSError:
                present = set()
            for name in names:
                if name not in found and f"{name}.json" in present:
                    found[name] = self.read(name)
            missing = [n for n in names if n not in found]
            if not missing or time.monotonic() >= deadline or not self.present():
                return found, missing
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * _POLL_GROWTH, _LONGEST_POLL_S)

    def remove(self) -> list[str]:
        """Delete the messages, the lease (last) and the directory, and stop holding the
        lease; nothing else is ever deleted (a file of another name keeps the directory, and
        is left alone), nothing through a symlink. Returns the names kept."""
        if self.directory.is_symlink():
            return ["the symlink itself"]
        try:
            names = sorted(os.listdir(self.directory), key=lease.deletion_order)
        except OSError:
            names = []
        for name in names:
            path = self.directory / name
            ours = _MESSAGE.match(name) or _TEMPORARY.match(name) or lease.LEASE_FILE.match(name)
            if ours and not path.is_symlink():
                remove_quietly(path)
        lease.release(self.directory)
        with contextlib.suppress(OSError):
            self.directory.rmdir()
        try:
            return sorted(os.listdir(self.directory))
        except OSError:
            return []
