"""The files each foreign format's writer puts into its staging directory, by the format its
lease records (:func:`.lease.recorded_output`), and their removal: what a failed conversion's
discard and ``clean`` of a killed one delete, and never anything else (a foreign format's
files have foreign names, which no checkpoint rule covers)."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import lease


@dataclass(frozen=True)
class Output:
    """What a foreign format's writer puts into its staging directory: regular expressions
    (``writes``) of its paths there (a subdirectory's files by their paths in it,
    ``"global_step3/x.pt"``; a subdirectory as ``"NAME/"``), each matched whole."""

    name: str
    writes: tuple[str, ...]

    def wrote(self, name: str) -> bool:
        """Whether ``name`` (``"NAME"``, ``"DIR/"`` or ``"DIR/NAME"``) is one it writes."""
        return name.count("/") <= 1 and any(re.fullmatch(w, name) for w in self.writes)


OUTPUTS = {
    output.name: output
    for output in (
        # .metadata (and torch's temporary of it) and the *.distcp data files
        Output("dcp", (r"\.metadata[^/]*", r"[^/]*\.distcp")),
        # latest, the tag directory and its .pt files
        Output("deepspeed", ("latest", "[^/]+/", r"[^/]+/[^/]*\.pt")),
        # model.safetensors (and its temporary), optimizer.bin, optimizer_N.bin
        Output(
            "accelerate",
            (r"\.?model\.safetensors(?:\.tmp-\d+)?", r"optimizer(?:_\d+)?\.bin"),
        ),
        # the one .ckpt file
        Output("lightning", (r"[^/]+\.ckpt",)),
        # the iteration pointer (and its temporary), iter_NNNNNNN/ and its files
        Output(
            "megatron",
            (
                r"latest_checkpointed_iteration\.txt",
                r"\.latest_checkpointed_iteration\.txt\.tmp-[^/]*",
                r"iter_\d{7}/[^/]*",
            ),
        ),
    )
}
"""The foreign formats whose output a lease may record, by the name it records: fixed here, in
the package, so that what a discard or ``clean`` deletes never comes from a file on disk (a
lease naming anything else is a muonckpt staging directory's, whose own rules apply)."""


def remove_written(directory: Path, output: Output) -> list[str]:
    """Delete from ``directory`` what the writer of ``output`` writes
    (:meth:`Output.wrote`), then, last, the lease and the directory if that emptied it.
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
