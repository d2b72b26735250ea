"""The files each foreign format's writer puts into its staging directory, by the format its
lease records (:func:`.lease.recorded_output`), and their removal: what a failed conversion's
discard and ``clean`` of a killed one delete, and never anything else (a foreign format's
files have foreign names, which no checkpoint rule covers)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from . import lease


def remove_written(directory: Path, output: lease.Output) -> list[str]:
    """Delete from ``directory`` what the writer of ``output`` writes
    (:meth:`.lease.Output.wrote`), then, last, the lease and the directory if that emptied it.
    Nothing else is deleted, nothing through a symlink. Returns what is kept, as
    ``"NAME (why)"``."""
    ours, kept = output.wrote, []

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
