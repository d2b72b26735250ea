"""Only ``muonckpt/storage/`` opens files (docs/design.md's rule, tested): every other module
gets bytes, file objects and listings through storage's functions, so that a format folder
parses what the storage seam hands it and an object store can stand behind every reader and
writer.

Every module outside ``storage/`` is read with :mod:`ast`; each direct file access is named as
``muonckpt/FILE:LINE: CALL``: builtins ``open``, ``io.open``, ``os``'s file and directory calls
(the stat-only ones too: an object store answers them as it answers a read), ``os.path``'s
tests of a path, ``shutil``, ``tempfile``, ``pathlib.Path``'s file methods, ``torch.load`` /
``torch.save`` of anything but an in-memory or already opened stream, numpy's file readers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "muonckpt"

OS_CALLS = frozenset(
    {
        *("open", "listdir", "scandir", "makedirs", "mkdir", "remove", "unlink", "rename"),
        *("replace", "rmdir", "walk", "stat", "lstat", "truncate", "link", "symlink"),
    }
)
OS_PATH_CALLS = frozenset({"exists", "lexists", "isdir", "isfile", "islink", "getsize", "getmtime"})
PATH_METHODS = frozenset(
    {
        *("open", "read_text", "read_bytes", "write_text", "write_bytes", "mkdir", "unlink"),
        *("rmdir", "iterdir", "glob", "rglob", "touch", "exists", "is_dir", "is_file"),
        *("is_symlink", "stat", "lstat", "rename", "replace"),
    }
)
"""``Path``'s methods that touch the file system (``rename`` and ``replace`` only with one
argument: ``str.replace`` takes two)."""
MODULE_CALLS: dict[str, frozenset[str] | None] = {
    "shutil": None,
    "tempfile": None,
    "io": frozenset({"open"}),
    "numpy": frozenset({"fromfile", "memmap", "load", "save"}),
}
"""Modules whose calls (None: every one) open files."""
TORCH_FILE_CALLS = frozenset({"torch.load", "torch.save"})

ALLOWED: dict[str, frozenset[str]] = {
    # The command line's check that verify's SRC is a directory, which it refuses with exit
    # code 2 (verify itself reports a missing directory as a problem, exit 1): the CLI may
    # call only public names, and none says whether a path is a directory.
    "muonckpt/cli/__init__.py": frozenset({"Path.is_dir"}),
}
"""Modules outside ``storage/`` allowed, for now, to make the calls named."""


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of an attribute chain of names, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


class _Module(ast.NodeVisitor):
    """One module's direct file accesses, as (line, call)."""

    def __init__(self) -> None:
        self.imported: dict[str, str] = {}
        self.streams: set[str] = set()
        self.found: list[tuple[int, str]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            name = alias.asname or alias.name.partition(".")[0]
            self.imported[name] = alias.name if alias.asname else name

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            full = f"{node.module}.{alias.name}" if node.module and not node.level else alias.name
            self.imported[alias.asname or alias.name] = full

    def visit_Assign(self, node: ast.Assign) -> None:
        """``stream = io.BytesIO(...)``: an in-memory stream torch may load and save."""
        call = node.value
        if isinstance(call, ast.Call) and (self._full(call.func) or "").startswith("io."):
            self.streams.update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.generic_visit(node)

    def visit_withitem(self, node: ast.withitem) -> None:
        """``with storage_call(...) as f``: a stream opened by storage (an ``open`` there is
        named as the call it is)."""
        if isinstance(node.optional_vars, ast.Name):
            self.streams.add(node.optional_vars.id)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        access = self._access(node)
        if access is not None:
            self.found.append((node.lineno, access))
        self.generic_visit(node)

    def _full(self, func: ast.expr) -> str | None:
        dotted = _dotted(func)
        if dotted is None:
            return None
        head, dot, rest = dotted.partition(".")
        return self.imported.get(head, head) + dot + rest

    def _access(self, call: ast.Call) -> str | None:
        full = self._full(call.func)
        if full is not None:
            module, _, name = full.rpartition(".")
            if full in {"open", "builtins.open"}:
                return "open"
            if (module == "os" and name in OS_CALLS) or (
                module in {"os.path", "posixpath"} and name in OS_PATH_CALLS
            ):
                return full
            names = MODULE_CALLS.get(module, frozenset())
            if names is None or name in names:
                return full
            if full in TORCH_FILE_CALLS:  # torch.load(f, ...), torch.save(obj, f, ...)
                return None if self._is_stream(call.args[full == "torch.save"]) else full
            if full.partition(".")[0] in self.imported:  # a module's function, not a method
                return None
        func = call.func
        if not isinstance(func, ast.Attribute) or func.attr not in PATH_METHODS:
            return None
        if func.attr in {"rename", "replace"} and (len(call.args) != 1 or call.keywords):
            return None
        return f"Path.{func.attr}"

    def _is_stream(self, arg: ast.expr) -> bool:
        if isinstance(arg, ast.Name):
            return arg.id in self.streams
        return isinstance(arg, ast.Call) and (self._full(arg.func) or "").startswith("io.")


def file_accesses(root: Path = ROOT) -> list[str]:
    """Each direct file access of a module outside ``storage/``, as ``FILE:LINE: CALL``,
    less those :data:`ALLOWED`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root.parent).as_posix()
        if relative.startswith("muonckpt/storage/"):
            continue
        module = _Module()
        module.visit(ast.parse(path.read_text(), relative))
        allowed = ALLOWED.get(relative, frozenset())
        found += [f"{relative}:{n}: {call}" for n, call in module.found if call not in allowed]
    return found


def test_only_storage_opens_files():
    found = file_accesses()
    assert not found, "direct file access outside muonckpt/storage/:\n" + "\n".join(found)


def test_every_allowed_access_is_still_made():
    """An allowance no longer needed is removed, so that the list only shrinks."""
    saved = dict(ALLOWED)
    try:
        ALLOWED.clear()
        made = {tuple(line.split(": ", 1)) for line in file_accesses()}
    finally:
        ALLOWED.update(saved)
    calls = {(file.rpartition(":")[0], call) for file, call in made}
    stale = [(f, c) for f, allowed in saved.items() for c in allowed if (f, c) not in calls]
    assert not stale, stale


def test_every_form_of_file_access_is_named(tmp_path):
    package = tmp_path / "muonckpt"
    (package / "storage").mkdir(parents=True)
    (package / "storage" / "ok.py").write_text("open('x')\n")
    (package / "bad.py").write_text(
        "import dataclasses, io, os, shutil, tempfile, torch\n"
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
        "Path('a').replace('b')\n"
        "os.path.join('a', 'b')\n"
        "'a_b'.replace('_', ' ')\n"
        "dataclasses.replace(x, a=1)\n"
        "torch.load(io.BytesIO(b''))\n"
        "buffer = io.BytesIO()\n"
        "torch.save(1, buffer)\n"
        "with opened() as f:\n"
        "    torch.save(1, f)\n"
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
        "muonckpt/bad.py:13: Path.replace",
    ]
