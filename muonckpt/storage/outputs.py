"""The files each foreign format's writer puts into its staging directory, by the format its
lease records (:func:`.lease.recorded_output`), and their removal: what a failed conversion's
discard and ``clean`` of a killed one delete, and never anything else (a foreign format's
files have foreign names, which no checkpoint rule covers)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

from . import deepspeed_files, lease, megatron_files
from .dcp_metadata import DATA_SUFFIX, METADATA_NAME


def _dcp(name: str) -> bool:
    """DCP's ``.metadata`` (and its temporary) and ``*.distcp`` data files."""
    return name.startswith(METADATA_NAME) or name.endswith(DATA_SUFFIX)


def _deepspeed(name: str) -> bool:
    """``latest``, the tag directory (``NAME/``) and its ``.pt`` files."""
    head, _, rest = name.partition("/")
    return name == deepspeed_files.LATEST or (
        bool(head) and "/" not in rest and (not rest or rest.endswith(".pt")) and "/" in name
    )


def _megatron(name: str) -> bool:
    """``latest_checkpointed_iteration.txt`` (and its temporary), ``iter_NNNNNNN/`` and its
    files."""
    latest = megatron_files.LATEST
    head, slash, rest = name.partition("/")
    if not slash:
        return name == latest or name.startswith(f".{latest}.tmp-")
    return bool(megatron_files.ITERATION_DIR.fullmatch(head)) and "/" not in rest


WRITTEN: dict[str, Callable[[str], bool]] = {
    "dcp": _dcp,
    "deepspeed": _deepspeed,
    "megatron": _megatron,
}
"""Foreign format -> whether a path in its staging directory is one its writer writes (a
subdirectory's files by their paths in it, ``"global_step3/x.pt"``; a subdirectory as
``"NAME/"``)."""


def remove_written(directory: Path, output: str) -> list[str]:
    """Delete from ``directory`` what the writer of ``output`` writes (:data:`WRITTEN`), then,
    last, the lease and the directory if that emptied it. Nothing else is deleted, nothing
    through a symlink. Returns what is kept, as ``"NAME (why)"``."""
    ours, kept = WRITTEN[output], []

    def remove(folder: Path, prefix: str) -> None:
        try:
            names = sorted(os.listdir(folder), key=lease.deletion_order)
        except OSError as exc:
            kept.append(f"{prefix or folder} ({exc.strerror})")
            return
        for entry in names:
            path, name = folder / entry, prefix + entry
            if path.is_dir() and not path.is_symlink():
                if not ours(name + "/"):
                    kept.append(f"{name} (not written by the conversion: kept)")
                    continue
                remove(path, name + "/")
                with contextlib.suppress(OSError):
                    path.rmdir()
            elif ours(name) or (not prefix and lease.LEASE_FILE.match(entry)):
                try:
                    path.unlink()
                except OSError as exc:
                    kept.append(f"{name} ({exc.strerror})")
            else:
                kept.append(f"{name} (not written by the conversion: kept)")

    remove(directory, "")
    if not kept:
        try:
            directory.rmdir()
        except OSError as exc:
            kept.append(f"the directory itself ({exc.strerror})")
    return kept
