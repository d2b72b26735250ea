"""What muonckpt may replace or delete beside a target: its own checkpoints and their files
only (:func:`ownership_problem`), a target checked before anything is written
(:func:`check_target`), and the names of its own directories (:func:`is_ours`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from ..errors import CheckpointError
from ..format.manifest import FORMAT_NAME
from ..format.names import MANIFEST_NAME
from ..settings import local_path
from . import lease
from .durable import read_text
from .mailbox import MAILBOX_TAG
from .s3 import is_s3_url

STAGING_TAG = "staging"
_STAGING_SUFFIX_BYTES = len(f"..{STAGING_TAG}-") + 8
"""What ``.NAME.staging-XXXXXXXX`` adds to NAME: a target name may have NAME_MAX minus this."""
_OURS_NAME = re.compile(
    rf"^\..+\.(({STAGING_TAG}|{MAILBOX_TAG})-[0-9a-f]{{8}}|old-\d+)$", re.DOTALL
)
"""The names of directories of ours beside a target: ``.NAME.staging-XXXXXXXX`` (a save in
progress, or the checkpoint an exchange replaced), ``.NAME.steps-XXXXXXXX`` (the mailbox of a
background save of an earlier version) or ``.NAME.old-PID`` (the rename fallback's replaced
one). A name is never proof: what muonckpt made holds its lease file (:mod:`.lease`)."""
_CHECKPOINT_FILE = re.compile(
    rf"^({re.escape(MANIFEST_NAME)}|[^.].*\.safetensors|[^.].*\.(index|pieces)\.json)$", re.DOTALL
)
"""Names of the files a checkpoint directory holds."""
_TEMPORARY_FILE = re.compile(r"^\.(?P<name>.+)\.(part|tmp-\d+)$", re.DOTALL)
"""Names of muonckpt's temporary files (``.FILE.part``, ``.FILE.tmp-PID``) of such files."""
_OUR_MANIFEST_HEAD = re.compile(rb'\s*\{\s*"format"\s*:\s*"%s"\s*,' % FORMAT_NAME.encode())
"""How every manifest muonckpt writes begins (``Manifest.to_json`` puts the format first)."""


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is a file muonckpt writes into a checkpoint (or a temporary of one) or
    into a directory it makes (the lease)."""
    if _CHECKPOINT_FILE.match(name) or lease.LEASE_FILE.match(name):
        return True
    temporary = _TEMPORARY_FILE.match(name)
    return temporary is not None and _CHECKPOINT_FILE.match(temporary["name"]) is not None


def shown(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def foreign_entries(directory: str | os.PathLike[str]) -> list[str]:
    """What in ``directory`` no checkpoint holds: descriptions such as ``"user file README.md"``
    or ``"directory data"``; empty when every entry is a regular file of a checkpoint's."""
    found = []
    with os.scandir(directory) as listing:
        for entry in sorted(listing, key=lambda e: e.name):
            if entry.is_symlink():
                found.append(f"symlink {entry.name}")
            elif entry.is_dir(follow_symlinks=False):
                found.append(f"directory {entry.name}")
            elif not entry.is_file(follow_symlinks=False):
                found.append(f"special file {entry.name}")
            elif not is_checkpoint_file(entry.name):
                found.append(f"user file {entry.name}")
    return found


def ownership_problem(directory: str | os.PathLike[str]) -> str | None:
    """Why ``directory`` is not a muonckpt checkpoint that may be replaced; None when it is.

    Replaceable: a directory (not a symlink) holding only regular files with the names a
    checkpoint has (``*.safetensors``, ``manifest.json``, ``*.index.json``, ``*.pieces.json``
    and muonckpt's temporaries of them), and either a ``manifest.json`` whose JSON says ``"format":
    "muonckpt"``, or no manifest but muonckpt's lease file (:mod:`.lease`: an interrupted
    save, or a replaced checkpoint; a name alone proves nothing). An empty directory is
    replaceable too: nothing in it can be lost.
    """
    directory = Path(directory)
    try:
        if directory.is_symlink():
            return "is a symlink"
        if not directory.is_dir():
            return "is not a directory"
        foreign = foreign_entries(directory)
    except OSError as exc:
        return f"cannot be listed: {exc.strerror}"
    if foreign:
        return f"is not a muonckpt checkpoint: holds {shown(foreign)}"
    manifest = directory / MANIFEST_NAME
    if not manifest.exists():
        if (directory / lease.LEASE_NAME).is_file() or not any(directory.iterdir()):
            return None
        return f"is not a muonckpt checkpoint: it has no {MANIFEST_NAME}"
    try:
        with open(manifest, "rb") as f:
            head = f.read(256)
    except OSError as exc:
        return f"cannot be read: {exc.strerror}"
    if _OUR_MANIFEST_HEAD.match(head):  # as muonckpt writes it: no need to parse megabytes
        return None
    try:
        body = json.loads(read_text(manifest))
    except (CheckpointError, ValueError, RecursionError):
        return f"is not a muonckpt checkpoint: its {MANIFEST_NAME} is not valid JSON"
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        return f'is not a muonckpt checkpoint: its {MANIFEST_NAME} has no "format": "{FORMAT_NAME}"'
    return None


def _name_max(directory: Path) -> int:
    """NAME_MAX of the filesystem holding ``directory`` (its nearest existing ancestor)."""
    for candidate in (directory, *directory.parents):
        try:
            return os.pathconf(candidate, "PC_NAME_MAX")
        except (OSError, ValueError):
            if candidate.exists():
                break
    return 255


def _overlap_problem(final: Path, source: str | os.PathLike[str]) -> str | None:
    """Why writing ``final`` would write into, over or around ``source``; None if it would not
    (also when the two are the same directory: an in-place rewrite, staged beside it, and
    when ``source`` is in S3, which no local directory overlaps)."""
    if is_s3_url(source):
        return None
    src = Path(os.path.realpath(source))
    where = Path(os.path.realpath(final.parent)) / final.name
    targets = {where, Path(os.path.realpath(final))}
    if src in targets:
        return None
    for target in targets:
        if target.is_relative_to(src):
            return f"is inside the source checkpoint {source}"
        if src.is_relative_to(target):
            return f"contains the source checkpoint {source}"
    return None


def check_target(
    final: str | os.PathLike[str],
    overwrite: bool,
    *,
    source: str | os.PathLike[str] | None = None,
    output: str | None = None,
) -> None:
    """Raise :class:`CheckpointError` unless a checkpoint (or the files of foreign format
    ``output``, which never replace anything) can be written at ``final``.

    Refused, before anything is written: a name that cannot work (empty, ``.`` or ``..``, one
    shaped like muonckpt's own staging names, or too long for ``.NAME.staging-XXXXXXXX``); an
    existing ``final`` without ``overwrite``; with it, anything but a muonckpt checkpoint (see
    :func:`ownership_problem`), or a symlink to one (then the link is replaced, its target
    left alone); a parent that is not a directory; and, with ``source``, a target inside the
    source checkpoint or containing it (the very same directory is allowed: rewritten in
    place); a URL (:func:`muonckpt.settings.local_path`).
    """
    final = local_path(final)
    _check_name(final)
    if source is not None and (problem := _overlap_problem(final, source)):
        raise CheckpointError(problem, path=final)
    for parent in (final.parent, *final.parent.parents):
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise CheckpointError("is not a directory", path=parent)
            break
    if os.path.lexists(final):
        _check_existing(final, overwrite, output)


def _check_name(final: Path) -> None:
    """Raise :class:`CheckpointError` unless ``final``'s last part can name a checkpoint
    (:func:`check_target`)."""
    name = final.name
    if name in ("", ".", ".."):
        raise CheckpointError("is not a name a checkpoint directory can have", path=final)
    if _OURS_NAME.match(name):
        raise CheckpointError(
            "is named like a muonckpt staging directory (.NAME.staging-XXXXXXXX or "
            ".NAME.old-PID), which readers refuse as unfinished; choose another name",
            path=final,
        )
    limit = _name_max(final.parent) - _STAGING_SUFFIX_BYTES
    if len(os.fsencode(name)) > limit:
        raise CheckpointError(
            f"the name is {len(os.fsencode(name))} bytes; at most {limit} fit in its staging "
            f"directory's name .NAME.{STAGING_TAG}-XXXXXXXX",
            path=final,
        )


def _check_existing(final: Path, overwrite: bool, output: str | None) -> None:
    """Raise :class:`CheckpointError` unless the existing ``final`` may be replaced
    (:func:`check_target`)."""
    if output is not None:  # its writers never replace: overwrite=True would be refused
        raise CheckpointError(
            f"already exists; {output} output is never written over an existing path: remove "
            "it or choose another",
            path=final,
        )
    if not overwrite:
        raise CheckpointError("already exists; pass overwrite=True to replace it", path=final)
    if final.is_symlink():
        if not final.exists():
            raise CheckpointError("is a dangling symlink; remove it or write elsewhere", path=final)
        problem = ownership_problem(final.resolve())
        if problem:
            raise CheckpointError(
                f"is a symlink to {os.readlink(final)}, which {problem}; refusing to replace it",
                path=final,
            )
        return
    if not final.is_dir():
        raise CheckpointError("exists and is not a checkpoint directory", path=final)
    problem = ownership_problem(final)
    if problem:
        raise CheckpointError(
            f"{problem}; refusing to replace it (overwrite=True replaces only muonckpt "
            "checkpoints)",
            path=final,
        )


def is_ours(name: str) -> bool:
    """Whether ``name`` is a directory muonckpt leaves beside a target: a staging directory
    (a save in progress or interrupted) or a replaced checkpoint not yet deleted."""
    return bool(_OURS_NAME.match(name))
