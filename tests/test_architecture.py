"""The direction of imports inside muonckpt, read from the source with ``ast`` (nothing here
imports the package).

The rules are the table :data:`RULES` below: to add one, add a row. Every violation is reported
as ``muonckpt/FILE:LINE: MODULE imports TARGET: rule 'RULE'``. Separately, no import cycle may
run through the package's modules (function-level imports count; ``if TYPE_CHECKING:`` blocks
do not, since they never run).
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "muonckpt"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# ---- The rules ------------------------------------------------------------------------------
# Package modules are named relative to the package: "storage" is the sub-package and every
# module in it, "*" every module, "" the package itself (muonckpt/__init__.py). Other modules
# are named in full: "torch" also covers torch.nn, torch.distributed, ...

LAYERS = (
    ("errors", "settings", "_namespace"),
    ("layout",),
    ("format",),
    ("storage",),
    ("distributed",),
    ("files",),
    ("interop",),
    ("offline",),
    ("state",),
    ("optim",),
    ("checkpoint",),
    ("cli", "demo"),
)
"""The layers, bottom first: one folder each (the base is three top-level modules, the top the
command line and the demo). A module imports only from its own layer and the ones below."""
PURE = (
    "errors",
    "settings",
    "layout",
    "format",
    "distributed.steps",
    "offline.inspection",
    "interop.deepspeed.partitions",
    "interop.megatron.tp_chunks",
)
"""Plain data and arithmetic: no tensors, no files, no process groups."""
NOT_YET: set[str] = set()
"""Modules the rules name before they land; any other name in the rules must exist."""
READERS_AND_WRITERS = ("storage", "files", "interop")
"""Bytes to and from files: the offline tools' path, which runs without a process group (and
imports torch only inside functions, where a tensor crosses: tests/test_cli.py checks
that at run time)."""
DCP_FILES = ("interop.dcp.metadata", "interop.dcp.files", "interop.dcp._writer")
"""DCP's file format: its metadata classes (through a restricted unpickler) and torch's writer
(``_dcp_writer``: torch's planner and writer subclassed, imported by ``dcp_files`` only inside
the function that writes)."""
COLLECTIVE_CALLERS = (
    "distributed.collectives",
    "distributed.group_steps",
    "distributed.groups",
    "distributed.launch",
)
"""The modules that call torch.distributed (``distributed.steps`` is the pure protocol)."""
NAMESPACES = (
    "offline",
    "errors",
    "distributed",
    "demo",
    "format",
    "layout",
    "settings",
    "interop",
)
"""The public namespaces the command line may use besides the package's top level."""


def _above(layer: tuple[str, ...]) -> tuple[str, ...]:
    index = LAYERS.index(layer)
    return tuple(module for higher in LAYERS[index + 1 :] for module in higher)


@dataclass(frozen=True)
class Rule:
    """What the modules ``modules`` (but not ``exempt``) may not import."""

    name: str
    modules: tuple[str, ...]
    exempt: tuple[str, ...] = ()
    no_external: tuple[str, ...] = ()
    """Modules outside the package they may not import (any form: ``import X``, ``from X
    import Y``, ``from X.Y import Z``, ``importlib.import_module("X")``, ``torch.distributed``
    reached as an attribute)."""
    no_internal: tuple[str, ...] = ()
    """Package modules they may not import."""
    only_internal: tuple[str, ...] | None = None
    """The only package modules they may import (None: any)."""
    public_api: tuple[str, ...] | None = None
    """The only package modules they may import besides ``modules`` themselves, and from each
    only the names in its ``__all__`` (None: no such limit)."""


RULES = (
    *(
        Rule(
            f"{' and '.join(layer)} import only from their layer and the ones below",
            modules=layer,
            no_internal=_above(layer),
        )
        for layer in LAYERS[:-1]
    ),
    Rule(
        "pure modules import neither torch nor numpy, and from the package only each other",
        modules=PURE,
        no_external=("torch", "numpy"),
        only_internal=(*PURE, "_namespace"),
    ),
    Rule(
        "only distributed imports torch.distributed (and storage.dcp_metadata, dcp_files and "
        "_dcp_writer, DCP's file format: its metadata classes and torch's own writer)",
        modules=("*",),
        exempt=(*COLLECTIVE_CALLERS, *DCP_FILES),
        no_external=("torch.distributed",),
    ),
    Rule(
        "storage.dcp_metadata, dcp_files and _dcp_writer take from torch.distributed only DCP's "
        "file format, never a collective",
        modules=DCP_FILES,
        no_external=(
            "torch.distributed.distributed_c10d",
            "torch.distributed.fsdp",
            "torch.distributed.tensor",
            "torch.distributed.init_process_group",
        ),
    ),
    Rule(
        "reading and writing files never imports the collectives or a live optimizer's state",
        modules=READERS_AND_WRITERS,
        no_internal=(*COLLECTIVE_CALLERS, "state", "optim"),
    ),
    Rule(
        "the command line imports only public names of muonckpt and of its namespaces "
        f"{', '.join(NAMESPACES)} (and its own modules)",
        modules=("cli",),
        public_api=("", *NAMESPACES),
    ),
)

# ---- Reading the imports --------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module, relative to the package."""
    line: int
    target: str
    """What is imported, in full: a module (``muonckpt.storage.durable``), or for other
    packages a module or name (``torch.distributed.ProcessGroup``)."""
    name: str | None
    """From a package module: the name taken from it (None: the module itself)."""
    type_checking: bool
    """Inside an ``if TYPE_CHECKING:`` block (never runs)."""

    @property
    def internal(self) -> str | None:
        """The imported package module, relative to the package; None for other packages."""
        if self.target == PACKAGE:
            return ""
        if self.target.startswith(PACKAGE + "."):
            return self.target[len(PACKAGE) + 1 :]
        return None


def package_sources(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """Every module of the package: relative name -> (file shown in messages, source)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        file = f"{PACKAGE}/{path.relative_to(root).as_posix()}"
        found[".".join(parts)] = (file, path.read_text(encoding="utf-8"))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _full(module: str) -> str:
    return f"{PACKAGE}.{module}" if module else PACKAGE


class _Finder(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: set[str]) -> None:
        self.module, self.modules = module, modules
        self.package = module if is_package else module.rpartition(".")[0]
        self.type_checking = False
        self.found: list[Import] = []

    def _add(self, node: ast.AST, target: str, name: str | None = None) -> None:
        self.found.append(Import(self.module, node.lineno, target, name, self.type_checking))

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        outer, self.type_checking = self.type_checking, True
        for child in node.body:
            self.visit(child)
        self.type_checking = outer
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".") if self.package else []
            base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
            relative = ".".join([*base, *([node.module] if node.module else [])])
            source = _full(relative)
        else:
            source, relative = node.module or "", None
            if source == PACKAGE or source.startswith(PACKAGE + "."):
                relative = source[len(PACKAGE) + 1 :] if source != PACKAGE else ""
        for alias in node.names:
            if relative is None:  # another package: the name may be a module or an attribute
                self._add(node, source if alias.name == "*" else f"{source}.{alias.name}")
            elif (sub := f"{relative}.{alias.name}".lstrip(".")) in self.modules:
                self._add(node, _full(sub))
            else:
                self._add(node, source, alias.name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and (node.value.id, node.attr) == (
            "torch",
            "distributed",
        ):
            self._add(node, "torch.distributed")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if (
            called in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            self._add(node, node.args[0].value)
        self.generic_visit(node)


def imports_of(sources: Mapping[str, tuple[str, str]]) -> dict[str, list[Import]]:
    """Each module's imports, anywhere in it (function bodies too)."""
    modules = set(sources)
    packages = {m.rpartition(".")[0] for m in modules if m}
    found = {}
    for module, (_, text) in sources.items():
        finder = _Finder(module, module in packages or module == "", modules)
        finder.visit(ast.parse(text))
        found[module] = finder.found
    return found


def public_names(text: str) -> set[str] | None:
    """A module's ``__all__``: a literal list or tuple of strings, or ``list(TABLE)`` of a
    literal dict ``TABLE`` of the module (its keys); None without one."""
    literals: dict[str, ast.expr] = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            literals.update({t.id: node.value for t in targets if isinstance(t, ast.Name)})
    value = literals.get("__all__")
    if value is None:
        return None
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "list":
        (table,) = value.args
        assert isinstance(table, ast.Name), "__all__ = list(NAME) of a literal dict NAME"
        return set(ast.literal_eval(literals[table.id]))
    return set(ast.literal_eval(value))


# ---- Checking -------------------------------------------------------------------------------


def _within(module: str, patterns: tuple[str, ...]) -> bool:
    return any(p == "*" or module == p or module.startswith(p + ".") for p in patterns)


def _breaks(rule: Rule, imp: Import, sources: Mapping[str, tuple[str, str]]) -> str | None:
    """Why ``imp`` breaks ``rule`` (what it imports, as the message says it), or None."""
    internal = imp.internal
    shown = imp.target if imp.name is None else f"{imp.name} from {imp.target}"
    if internal is None:
        return shown if _within(imp.target, rule.no_external) else None
    if rule.no_internal and internal and _within(internal, rule.no_internal):
        return shown
    if rule.only_internal is not None and not _within(internal, rule.only_internal):
        return shown
    if rule.public_api is not None and not _within(internal, rule.modules):
        if internal not in rule.public_api:
            return shown
        if imp.name is not None:
            text = sources[internal][1] if internal in sources else ""
            listed = public_names(text)
            public = listed if listed is not None else set()
            if listed is None:  # no __all__: its names that do not start with "_"
                public = {n for n in _top_level_names(text) if not n.startswith("_")}
            if imp.name not in public:
                return f"{shown} (not in its __all__)"
    return None


def _top_level_names(text: str) -> set[str]:
    names = set()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def violations(
    sources: Mapping[str, tuple[str, str]], rules: tuple[Rule, ...] = RULES
) -> list[str]:
    """Every import that breaks a rule, as ``FILE:LINE: MODULE imports TARGET: rule 'NAME'``."""
    found = []
    for module, imports in imports_of(sources).items():
        for rule in rules:
            if not _within(module, rule.modules) or _within(module, rule.exempt):
                continue
            for imp in imports:
                what = _breaks(rule, imp, sources)
                if what is not None:
                    file = sources[module][0]
                    shown = module or PACKAGE
                    found.append(f"{file}:{imp.line}: {shown} imports {what}: rule '{rule.name}'")
    return found


def import_graph(sources: Mapping[str, tuple[str, str]]) -> dict[str, dict[str, int]]:
    """module -> {imported package module: line of the first such import}, without the
    imports of ``if TYPE_CHECKING:`` blocks."""
    graph: dict[str, dict[str, int]] = {module: {} for module in sources}
    for module, imports in imports_of(sources).items():
        for imp in imports:
            if imp.internal is not None and not imp.type_checking and imp.internal in sources:
                graph[module].setdefault(imp.internal, imp.line)
    return graph


def cycles(sources: Mapping[str, tuple[str, str]]) -> list[str]:
    """One import cycle per strongly connected group of modules, as
    ``a (a.py:3) -> b (b.py:7) -> a``: each module with the line that imports the next."""
    graph = import_graph(sources)
    found = []
    for group in _strongly_connected(graph):
        start = min(group)
        if len(group) == 1 and start not in graph[start]:
            continue
        path = _path_back(graph, group, start)
        steps = [
            f"{m or PACKAGE} ({sources[m][0]}:{graph[m][n]})" for m, n in itertools.pairwise(path)
        ]
        found.append(" -> ".join([*steps, start or PACKAGE]))
    return found


def _strongly_connected(graph: Mapping[str, Mapping[str, int]]) -> Iterator[set[str]]:
    """Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                yield group


def _path_back(graph: Mapping[str, Mapping[str, int]], group: set[str], start: str) -> list[str]:
    """A shortest path ``start -> ... -> start`` inside ``group`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in group:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a cycle but no path leads back to it")


# ---- The package ----------------------------------------------------------------------------


def test_the_rules_name_modules_that_exist():
    modules = set(package_sources())
    named = {
        name
        for rule in RULES
        for names in (
            rule.modules,
            rule.exempt,
            rule.no_internal,
            rule.only_internal or (),
            rule.public_api or (),
        )
        for name in names
    }
    missing = sorted(named - NOT_YET - modules - {"*"})
    assert not missing, f"the rules name modules muonckpt does not have: {missing}"


def test_imports_follow_the_rules():
    found = violations(package_sources())
    assert not found, "imports that break the rules:\n" + "\n".join(found)


def private_imports(sources: Mapping[str, tuple[str, str]]) -> list[str]:
    """Imports of a private module (a name beginning with ``_``: ``checkpoint._attempt``) from
    outside its folder, as ``FILE:LINE: MODULE imports TARGET``."""
    found = []
    for module, imports in imports_of(sources).items():
        for imp in imports:
            target = imp.internal
            if not target or not target.rpartition(".")[2].startswith("_"):
                continue
            folder = target.rpartition(".")[0]
            if folder and module != folder and not module.startswith(folder + "."):
                found.append(f"{sources[module][0]}:{imp.line}: {module} imports {imp.target}")
    return found


def test_private_modules_are_imported_only_inside_their_folder():
    found = private_imports(package_sources())
    assert not found, "private modules imported from outside their folder:\n" + "\n".join(found)
    fake = _fake({"a": "", "a._b": "", "a.c": "from . import _b\n", "d": "from .a import _b\n"})
    assert private_imports(fake) == ["muonckpt/d.py:1: d imports muonckpt.a._b"]


def test_no_import_cycle():
    found = cycles(package_sources())
    assert not found, "import cycles:\n" + "\n".join(found)


MAX_FUNCTION_LINES = 80
"""The most lines a function or method may span, its ``def`` line to its last."""
MAX_MODULE_LINES = 600


def oversized(sources: Mapping[str, tuple[str, str]]) -> list[str]:
    """Each module over :data:`MAX_MODULE_LINES` lines and each function (nested ones and
    methods included) over :data:`MAX_FUNCTION_LINES`, as ``FILE:LINE: NAME is N lines``."""
    found = []
    for file, source in sources.values():
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{file}:1: the module is {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(source, file)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = (node.end_lineno or node.lineno) - node.lineno + 1
                if span > MAX_FUNCTION_LINES:
                    found.append(
                        f"{file}:{node.lineno}: {node.name} is {span} lines "
                        f"(at most {MAX_FUNCTION_LINES})"
                    )
    return found


def test_no_function_over_80_lines_and_no_module_over_600():
    found = oversized(package_sources())
    assert not found, "too long:\n" + "\n".join(found)
    body = [f"x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES)]  # one line too many
    fake = _fake(
        {
            "a": "def fits():\n" + "".join("    " + line for line in body[1:]),
            "b": "class C:\n    async def f(self):\n" + "".join("        " + x for x in body),
            "c": "y = 1\n" * (MAX_MODULE_LINES + 1),
        }
    )
    assert oversized(fake) == [
        f"muonckpt/b.py:2: f is {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})",
        f"muonckpt/c.py:1: the module is {MAX_MODULE_LINES + 1} lines (at most {MAX_MODULE_LINES})",
    ]


# ---- The checks themselves: each form of import is caught -----------------------------------


def _fake(modules: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """A made-up package: relative module name -> source."""
    packages = {m.rpartition(".")[0] for m in modules}

    def file(module: str) -> str:
        parts = [*module.split("."), "__init__"] if module in packages else module.split(".")
        return f"{PACKAGE}/{'/'.join(p for p in parts if p)}.py"

    return {m: (file(m), text) for m, text in modules.items()}


def test_every_form_of_a_forbidden_import_is_reported():
    sources = _fake(
        {
            "": "__all__ = ['save']\n",
            "errors": "class CheckpointError(Exception): ...\n",
            "layout": "",
            "layout.topology": "import numpy as np\nfrom .. import errors\n",
            "layout.grid": "def f():\n    import torch\n",
            "format": "",
            "format.kinds": "from ..checkpoint.api import save\n",
            "format.manifest": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
            ),
            "checkpoint": "",
            "checkpoint.api": "from torch import distributed\n",
            "checkpoint.pieces": "",
            "state": "",
            "state.hooks": "from torch.distributed import ProcessGroup\n",
            "optim": "",
            "optim.muon": "import torch.distributed as dist\n",
            "demo": "import torch\n\n\ndef f():\n    torch.distributed.barrier()\n",
            "distributed": "",
            "distributed.launch": (
                "import importlib\nimportlib.import_module('torch.distributed')\n"
            ),
            "distributed.collectives": "import torch.distributed\n",
            "storage": "from . import durable\n",
            "storage.durable": "from ..distributed import collectives\nfrom ..offline import x\n",
            "offline": "__all__ = ['consolidate']\n",
            "cli": (
                "from . import offline, save\n"
                "from .offline import consolidate, _Job\n"
                "from .errors import CheckpointError\n"
                "def f():\n    from .checkpoint.pieces import verify\n    from . import load\n"
            ),
        }
    )
    found = violations(sources)
    durable = "muonckpt/storage/durable.py"
    expected = [
        ("muonckpt/layout/topology.py:1: layout.topology imports numpy", "pure"),
        ("muonckpt/layout/grid.py:2: layout.grid imports torch", "pure"),
        (
            "muonckpt/format/kinds.py:1: format.kinds imports save from muonckpt.checkpoint.api",
            "format",
        ),
        (
            "muonckpt/format/kinds.py:1: format.kinds imports save from muonckpt.checkpoint.api",
            "pure",
        ),
        ("muonckpt/format/manifest.py:3: format.manifest imports torch", "pure"),
        ("muonckpt/checkpoint/api.py:1: checkpoint.api imports torch.distributed", "only"),
        ("muonckpt/state/hooks.py:1: state.hooks imports torch.distributed.ProcessGroup", "only"),
        ("muonckpt/optim/muon.py:1: optim.muon imports torch.distributed", "only"),
        ("muonckpt/demo.py:5: demo imports torch.distributed", "only"),
        (f"{durable}:1: storage.durable imports muonckpt.distributed.collectives", "storage"),
        (f"{durable}:2: storage.durable imports x from muonckpt.offline", "storage"),
        (f"{durable}:1: storage.durable imports muonckpt.distributed.collectives", "reading"),
        ("muonckpt/cli.py:2: cli imports _Job from muonckpt.offline (not in its __all__)", "the"),
        ("muonckpt/cli.py:5: cli imports verify from muonckpt.checkpoint.pieces", "the command"),
        ("muonckpt/cli.py:6: cli imports load from muonckpt (not in its __all__)", "the command"),
    ]
    for where, rule in expected:
        hits = [line for line in found if line.startswith(where + ": rule '" + rule)]
        assert hits, f"not reported: {where} (rule {rule!r}); reported:\n" + "\n".join(found)
    assert len(found) == len(expected), "\n".join(found)


def test_an_import_cycle_is_reported_with_its_lines():
    sources = _fake(
        {
            "a": "import os\nfrom . import b\n",
            "b": "def f():\n    from .c import g\n",
            "c": "from .a import h\n",
            "d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
            "e": "from . import d\n",
        }
    )
    assert cycles(sources) == [
        "a (muonckpt/a.py:2) -> b (muonckpt/b.py:2) -> c (muonckpt/c.py:1) -> a"
    ]
    sources["a"] = ("muonckpt/a.py", "from typing import TYPE_CHECKING\nimport os\n")
    assert cycles(sources) == []


# ---- docs/design.md's module map is the code's ------------------------------------------------


def _documented_map(text: str) -> dict[str, set[str]]:
    """The module map of docs/design.md: module -> the package modules its row says it imports
    (any module name in the last column, the package itself written ``muonckpt``)."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    documented = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        module = cells[1].strip("`").removesuffix(".py").removesuffix("/")
        words = set(re.findall(r"[a-z_]+(?:\.[a-z_]+)?", cells[-1]))
        documented[module] = words
    return documented


def test_the_design_docs_module_map_lists_every_module_and_what_it_imports():
    sources = package_sources()
    graph = import_graph(sources)
    documented = _documented_map((ROOT.parent / "docs" / "design.md").read_text())
    tops = {m.split(".")[0] for m in sources if m}
    assert set(documented) == tops, "modules missing from or extra in the map"
    problems = []
    for module in sorted(tops):
        actual = {
            (target.split(".")[0] or PACKAGE)
            for source, targets in graph.items()
            if source.split(".")[0] == module
            for target in targets
        } - {module}
        said = {w.removeprefix(PACKAGE + ".") for w in documented[module]}
        said = {w for w in said if w in tops or w == PACKAGE}
        if actual != said:
            problems.append(f"{module}: imports {sorted(actual)}, the map says {sorted(said)}")
    assert not problems, "\n".join(problems)
