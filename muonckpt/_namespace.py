"""Namespaces whose names import their modules on first use.

``import muonckpt`` and the command line's ``--help`` then import no torch, and a torch-free
module (``muonckpt.format``, ``muonckpt.layout``) can sit in a package whose other names need
it. Each public package lists its names once, in a table of name -> defining module, from which
its ``__all__``, ``__getattr__`` and ``__dir__`` come.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any


def lazy_names(
    package: str, names: Mapping[str, str], namespaces: Collection[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: each of ``names`` read from its module
    (relative to ``package``) and kept, each of ``namespaces`` imported as a sub-package."""

    def getattr_(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name], package), name)
        elif name in namespaces:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        vars(sys.modules[package])[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names) | set(namespaces))

    return getattr_, dir_
