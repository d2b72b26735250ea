"""The on-disk format, pure (no torch, no files): the manifest's dataclasses and JSON text,
strict JSON, the write plan, the optimizer families a checkpoint records and the rules that
convert state between them.

A change to what a checkpoint records goes here. Modules: :mod:`.manifest` (the versioned
dataclasses, their JSON text, coverage), :mod:`.names` (file names and tensor keys),
:mod:`.renames` (params renamed on load, wrapper prefixes told apart), :mod:`.manifest_size`
(the manifest's size bounded before a write), :mod:`.manifest_json` (reading it back
with schema checks), :mod:`.strict_json`, :mod:`.writeplan` (which tensor goes to which file),
:mod:`.kinds` (what each optimizer group computes), :mod:`.conversion` (state mapped between
implementations).
"""

from __future__ import annotations

from .kinds import DCP_FAMILIES, FAMILIES

__all__ = [
    "DCP_FAMILIES",
    "FAMILIES",
]
