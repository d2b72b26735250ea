"""Only ``muonckpt/storage/`` opens files (docs/design.md's rule, tested): every other module
gets bytes, file objects and listings through storage's functions, so a format folder parses
what the storage seam hands it and an object store can stand behind every reader and writer.

The test reads every module outside ``storage/`` with :mod:`ast` and names each direct file
access as ``muonckpt/FILE:LINE: CALL``: builtins ``open``, ``io.open``, ``os``'s file and
directory calls (stat-only ones included: a store has no ``stat``), ``shutil``, ``tempfile``,
``pathlib.Path``'s file methods, ``torch.load`` / ``torch.save`` and numpy's file readers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "muonckpt"

OS_CALLS = frozenset(
    ["open", "listdir", "scandir", "makedirs", "mkdir", "remove", "unlink", "rename", "replace", "rmdir", "walk", "stat", "lstat", "fsync", "truncate", "link", "symlink", "chmod", "utime"]
)
OS_PATH_CALLS = frozenset(["exists", "isdir", "isfile", "lexists", "islink", "getsize", "getmtime"])
PATH_METHODS = frozenset(
    ["open", "read_text", "read_bytes", "write_text", "write_bytes", "mkdir", "unlink", "rmdir", "iterdir", "glob", "rglob", "rename", "replace", "touch", "exists", "is_dir", "is_file", "stat", "lstat", "is_symlink"]
)
MODULE_CALLS = {"shutil": None, "tempfile": None, "io": {"open"}, "torch": {"load", "save"}}
NUMPY_CALLS = frozenset({"fromfile", "memmap", "load", "save", "tofile"})

ALLOWED: dict[str, set[str]] = {
    # files/ is the write engine's (issue 51's engine step): its direct file access moves
    # behind storage/ there; the lead empties this list after merging. Each entry is a module
    # and the calls it still makes itself.
}
"""Modules outside ``storage/`` allowed, for now, to make the calls named (``file: {call}``)."""


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of an attribute chain of names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _access(call: ast.Call, imported: dict[str, str]) -> str | None:
    """The file access ``call`` makes, spelt with its module's full name, or None."""
    func = call.func
    if isinstance(func, ast.Name):
        full = imported.get(func.id, func.id)
    else:
        dotted = _dotted(func)
        if dotted is None:
            hit = isinstance(func, ast.Attribute) and func.attr in PATH_METHODS
            return f"Path.{func.attr}" if hit else None
        head, _, rest = dotted.partition(".")
        full = f"{imported.get(head, head)}.{rest}" if rest else imported.get(head, head)
    module, _, name = full.rpartition(".")
    if full in {"open", "builtins.open"}:
        return "open"
    if (module == "os" and name in OS_CALLS) or (module in {"os.path", "posixpath"} and name in (
        OS_PATH_CALLS
    )):
        return full
    if module in MODULE_CALLS and (MODULE_CALLS[module] is None or name in MODULE_CALLS[module]):
        return full
    if module in {"numpy", "np"} and name in NUMPY_CALLS:
        return f"numpy.{name}"
    if isinstance(func, ast.Attribute) and func.attr in PATH_METHODS and module not in {
        "os",
        "os.path",
    }:
        return f"Path.{func.attr}"
    return None


def _imports(tree: ast.Module) -> dict[str, str]:
    """Every name a module binds by an import, to the full name it stands for."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.partition(".")[0]] = (
                    alias.name if alias.asname else alias.name.partition(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def file_accesses(root: Path = ROOT) -> list[str]:
    """Each direct file access of a module outside ``storage/``, as ``FILE:LINE: CALL``,
    less those :data:`ALLOWED`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root.parent).as_posix()
        if relative.startswith("muonckpt/storage/"):
            continue
        tree = ast.parse(path.read_text(), relative)
        imported = _imports(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (access := _access(node, imported)) is not None:
                if access not in ALLOWED.get(relative, set()):
                    found.append(f"{relative}:{node.lineno}: {access}")
    return found


def test_only_storage_opens_files():
    found = file_accesses()
    assert not found, "direct file access outside muonckpt/storage/:\n" + "\n".join(found)


def test_every_form_of_file_access_is_named(tmp_path):
    package = tmp_path / "muonckpt"
    (package / "storage").mkdir(parents=True)
    (package / "storage" / "ok.py").write_text("open('x')\n")
    (package / "bad.py").write_text(
        "import os, shutil, tempfile, torch\n"
        "import numpy as np\n"
        "from os.path import exists\n"
        "from pathlib import Path\n"
        "open('a')\n"
        "os.makedirs('d')\n"
        "exists('e')\n"
        "Path('p').read_text()\n"
        "shutil.rmtree('t')\n"
        "tempfile.mkdtemp()\n"
        "torch.load('f')\n"
        "np.fromfile('g')\n"
        "os.path.join('a', 'b')\n"
    )
    assert file_accesses(package) == [
        "muonckpt/bad.py:5: open",
        "muonckpt/bad.py:6: os.makedirs",
        "muonckpt/bad.py:7: os.path.exists",
        "muonckpt/bad.py:8: Path.read_text",
        "muonckpt/bad.py:9: shutil.rmtree",
        "muonckpt/bad.py:10: tempfile.mkdtemp",
        "muonckpt/bad.py:11: torch.load",
        "muonckpt/bad.py:12: numpy.fromfile",
    ]
