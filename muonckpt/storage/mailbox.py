"""The mailbox directories that background saves of earlier versions left beside a target,
which ``clean`` still removes.

A background save (:func:`muonckpt.async_save`) of earlier versions had its ranks agree through
small JSON files in a directory ``.NAME.steps-XXXXXXXX`` beside the target (named after the
save's staging directory, holding muonckpt's lease, :mod:`.lease`); one whose process was
killed is left there. Saves now agree through the process group's store
(:mod:`muonckpt.distributed.mailbox`) and make no such directory.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from . import lease
from .durable import remove_quietly

MAILBOX_TAG = "steps"
_MESSAGE = re.compile(r"^[a-z-]+-(\d+|outcome|decision)\.json$")
"""Names of the messages: ``<step>-<rank>.json``, ``<step>-outcome.json``,
``<step>-decision.json``."""
_TEMPORARY = re.compile(r"^\.[a-z-]+-(\d+|outcome|decision)\.json\.tmp-\d+-\d+$")


def is_mailbox(name: str) -> bool:
    """Whether ``name`` is a mailbox's (``.NAME.steps-XXXXXXXX``)."""
    return re.fullmatch(rf"\..+\.{MAILBOX_TAG}-[0-9a-f]{{8}}", name, re.DOTALL) is not None


def remove_mailbox(directory: str | os.PathLike[str]) -> list[str]:
    """Delete a mailbox directory's messages, its lease (last) and the directory; nothing else
    is ever deleted (a file of another name keeps the directory, and is left alone), nothing
    through a symlink. Returns the names kept."""
    directory = Path(directory)
    if directory.is_symlink():
        return ["the symlink itself"]
    try:
        names = sorted(os.listdir(directory), key=lease.deletion_order)
    except OSError:
        names = []
    for name in names:
        path = directory / name
        ours = _MESSAGE.match(name) or _TEMPORARY.match(name) or lease.LEASE_FILE.match(name)
        if ours and not path.is_symlink():
            remove_quietly(path)
    lease.release(directory)
    with contextlib.suppress(OSError):
        directory.rmdir()
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []
