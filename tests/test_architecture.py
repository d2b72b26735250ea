"""The direction of imports inside muonckpt, read from the source with ``ast`` (nothing here
imports the package).

The rules are the tables :data:`RULES` (what modules may not import) and :data:`OWNERS` (who
alone imports a module of another package) below: to add one, add a row. Every violation is reported
as ``muonckpt/FILE:LINE: MODULE imports TARGET: rule 'RULE'``. Separately, no module reaches a
higher layer through others (the imports' transitive closure, the names a lazy namespace loads
included), no import cycle may run through the package's modules (function-level imports
count; ``if TYPE_CHECKING:`` blocks do not, since they never run), and docs/design.md's module
map names each folder's modules and what each folder imports.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
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


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``'s layer (None: the package itself)."""
    return next((i for i, layer in enumerate(LAYERS) if _within(module, layer)), None)


@dataclass(frozen=True)
class Rule:
    """What the modules ``modules`` may not import."""

    name: str
    modules: tuple[str, ...]
    no_external: tuple[str, ...] = ()
    """Modules outside the package they may not import (any form: ``import X``, ``from X
    import Y``, ``from X.Y import Z``, ``importlib.import_module("X")``, ``torch.distributed``
    reached as an attribute)."""
    no_internal: tuple[str, ...] = ()
    """Package modules they may not import (a name of a lazy namespace counts as the module
    it loads)."""
    only_internal: tuple[str, ...] | None = None
    """The only package modules they may import (None: any)."""
    public_api: tuple[str, ...] | None = None
    """The only package modules they may import besides ``modules`` themselves, and from each
    only the names in its ``__all__`` (None: no such limit)."""


@dataclass(frozen=True)
class Owner:
    """Only the folders (or modules) ``folders`` import ``external``, a module outside the
    package, in any of :attr:`Rule.no_external`'s forms."""

    name: str
    external: str
    folders: tuple[str, ...]


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
        "interop/dcp/ takes from torch.distributed only DCP's file format, never a collective",
        modules=("interop.dcp",),
        no_external=(
            "torch.distributed.distributed_c10d",
            "torch.distributed.fsdp",
            "torch.distributed.tensor",
            "torch.distributed.init_process_group",
        ),
    ),
    Rule(
        "files/ and interop/ run without a process group: of distributed/ they import only "
        "the pure step protocol (steps)",
        modules=("files", "interop"),
        no_internal=(
            "distributed.collectives",
            "distributed.group_steps",
            "distributed.groups",
            "distributed.launch",
        ),
    ),
    Rule(
        "the command line imports only public names of muonckpt and of its namespaces "
        f"{', '.join(NAMESPACES)} (and its own modules)",
        modules=("cli",),
        public_api=("", *NAMESPACES),
    ),
)
OWNERS = (
    Owner(
        "only distributed/ and interop/dcp/ (DCP's file format: its metadata classes and "
        "torch's own writer) import torch.distributed",
        external="torch.distributed",
        folders=("distributed", "interop.dcp"),
    ),
)
"""Who alone imports a module of another package. (That only storage/ opens files is
tests/test_file_access.py's to check.)"""

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
    loads: tuple[str, ...] = ()
    """From a lazy namespace (:func:`lazy_tables`): the package modules its names load when
    used, relative to the package (the whole namespace imported: every module it may load)."""

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
    """Each module's imports, anywhere in it (function bodies too), each name of a lazy
    namespace with the modules it loads."""
    modules = set(sources)
    packages = {m.rpartition(".")[0] for m in modules if m}
    tables = lazy_tables(sources)
    found = {}
    for module, (_, text) in sources.items():
        finder = _Finder(module, module in packages or module == "", modules)
        finder.visit(ast.parse(text))
        found[module] = [_with_loads(imp, tables) for imp in finder.found]
    return found


def _with_loads(imp: Import, tables: Mapping[str, Mapping[str, str]]) -> Import:
    table = tables.get(imp.internal) if imp.internal is not None else None
    if table is None:
        return imp
    if imp.name is None:
        return replace(imp, loads=tuple(sorted(set(table.values()))))
    return replace(imp, loads=(table[imp.name],)) if imp.name in table else imp


def _literals(text: str) -> dict[str, ast.expr]:
    """A module's top-level assignments: name -> the expression assigned."""
    literals: dict[str, ast.expr] = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            literals.update({t.id: node.value for t in targets if isinstance(t, ast.Name)})
    return literals


def lazy_tables(sources: Mapping[str, tuple[str, str]]) -> dict[str, dict[str, str]]:
    """Each package whose names load their modules on first use (``lazy_names(__name__,
    TABLE[, NAMESPACES])`` of muonckpt/_namespace.py, TABLE a literal dict of name -> module
    relative to the package, NAMESPACES a literal tuple of its sub-packages): package -> {name:
    the module it loads, relative to muonckpt}."""
    tables = {}
    for package, (_, text) in sources.items():
        literals = _literals(text)
        for node in ast.walk(ast.parse(text)):
            if not (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "lazy_names"
                and all(isinstance(arg, ast.Name) for arg in node.args[1:])
            ):
                continue
            table: dict[str, str] = {}
            for name, where in ast.literal_eval(literals[node.args[1].id]).items():
                table[name] = _resolved(package, where)
            for arg in node.args[2:]:
                table |= {
                    n: _resolved(package, "." + n) for n in ast.literal_eval(literals[arg.id])
                }
            tables[package] = table
    return tables


def _resolved(package: str, relative: str) -> str:
    """A module named relative to ``package`` (``..errors``), relative to muonckpt."""
    level = len(relative) - len(relative.lstrip("."))
    base = package.split(".") if package else []
    return ".".join([*base[: len(base) - level + 1], relative[level:]])


def public_names(text: str) -> set[str] | None:
    """A module's ``__all__``: a literal list or tuple of strings, or ``list(TABLE)`` of a
    literal dict ``TABLE`` of the module (its keys); None without one."""
    literals = _literals(text)
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
    reached = [internal, *imp.loads] if internal else list(imp.loads)
    wrong = [m for m in reached if rule.no_internal and _within(m, rule.no_internal)]
    if rule.only_internal is not None:
        wrong += [m for m in reached if not _within(m, rule.only_internal)]
    if wrong:
        return shown if wrong[0] == internal else f"{shown} (which loads {_full(wrong[0])})"
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
    sources: Mapping[str, tuple[str, str]],
    rules: tuple[Rule, ...] = RULES,
    owners: tuple[Owner, ...] = OWNERS,
) -> list[str]:
    """Every import that breaks a rule, as ``FILE:LINE: MODULE imports TARGET: rule 'NAME'``."""
    found = []
    for module, imports in imports_of(sources).items():
        where, shown = sources[module][0], module or PACKAGE
        for rule in rules:
            if not _within(module, rule.modules):
                continue
            for imp in imports:
                what = _breaks(rule, imp, sources)
                if what is not None:
                    found.append(f"{where}:{imp.line}: {shown} imports {what}: rule '{rule.name}'")
        for owner in owners:
            if _within(module, owner.folders):
                continue
            for imp in imports:
                if imp.internal is None and _within(imp.target, (owner.external,)):
                    found.append(
                        f"{where}:{imp.line}: {shown} imports {imp.target}: rule '{owner.name}'"
                    )
    return found


def import_graph(
    sources: Mapping[str, tuple[str, str]], *, lazy: bool = False
) -> dict[str, dict[str, int]]:
    """module -> {imported package module: line of the first such import}, without the
    imports of ``if TYPE_CHECKING:`` blocks; with ``lazy``, also the modules that the names of
    a lazy namespace load."""
    graph: dict[str, dict[str, int]] = {module: {} for module in sources}
    for module, imports in imports_of(sources).items():
        for imp in imports:
            if imp.internal is None or imp.type_checking:
                continue
            for target in (imp.internal, *(imp.loads if lazy else ())):
                if target in sources:
                    graph[module].setdefault(target, imp.line)
    return graph


def upward_reaches(sources: Mapping[str, tuple[str, str]]) -> list[str]:
    """Each module of a layer that reaches a module of a higher layer through others (an
    import of an import..., function-level ones and the names of lazy namespaces included), as
    ``FILE:LINE: MODULE reaches TARGET through A -> ... -> TARGET``, LINE its import of A.
    (A direct import of a higher layer is the layer rules' to report.)"""
    graph = import_graph(sources, lazy=True)
    found = []
    for module in sorted(graph):
        layer = layer_of(module)
        if layer is None:
            continue
        previous: dict[str, str] = {}
        frontier = [module]
        while frontier:
            following = []
            for node in frontier:
                for child in sorted(graph[node]):
                    if child == module or child in previous:
                        continue
                    previous[child] = node
                    higher = layer_of(child)
                    if higher is None or higher <= layer:  # (None: the package, its names')
                        following.append(child)
                        continue
                    path = [child]
                    while path[-1] != module:
                        path.append(previous[path[-1]])
                    *through, _ = reversed(path)  # module, A, ..., child
                    if len(path) > 2:
                        steps = " -> ".join(m or PACKAGE for m in [*through[1:], child])
                        line = graph[module][through[1]]
                        found.append(
                            f"{sources[module][0]}:{line}: {module} reaches {child} through {steps}"
                        )
            frontier = following
    return found


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
            rule.no_internal,
            rule.only_internal or (),
            rule.public_api or (),
        )
        for name in names
    } | {folder for owner in OWNERS for folder in owner.folders}
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


def test_no_module_reaches_a_higher_layer_through_others():
    found = upward_reaches(package_sources())
    assert not found, "modules that reach a higher layer:\n" + "\n".join(found)


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
            "": (
                "from ._namespace import lazy_names\n_PUBLIC = {'save': '.checkpoint.api'}\n"
                "__all__ = list(_PUBLIC)\n__getattr__, __dir__ = lazy_names(__name__, _PUBLIC)\n"
            ),
            "_namespace": "def lazy_names(package, names, namespaces=()): ...\n",
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
            "distributed": (
                "from .._namespace import lazy_names\n_NAMES = {'rank': '.collectives'}\n"
                "__getattr__, __dir__ = lazy_names(__name__, _NAMES)\n"
            ),
            "distributed.steps": "",
            "distributed.launch": (
                "import importlib\nimportlib.import_module('torch.distributed')\n"
            ),
            "distributed.collectives": "import torch.distributed\n",
            "storage": "from . import durable\n",
            "storage.durable": "from ..distributed import collectives\nfrom ..offline import x\n",
            "offline": "__all__ = ['consolidate']\n",
            "files": "",
            "files.writing": (
                "from ..distributed import steps, collectives\nfrom ..distributed import rank\n"
                "def f():\n    from .. import save\n"
            ),
            "interop": "",
            "interop.dcp": "",
            "interop.dcp.files": (
                "import torch.distributed.checkpoint as dcp\n"
                "from torch.distributed import init_process_group\n"
            ),
            "cli": (
                "from . import offline, save\n"
                "from .offline import consolidate, _Job\n"
                "from .errors import CheckpointError\n"
                "def f():\n    from .checkpoint.pieces import verify\n    from . import load\n"
            ),
        }
    )
    found = violations(sources)
    durable, writing = "muonckpt/storage/durable.py", "muonckpt/files/writing.py"
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
        (f"{writing}:1: files.writing imports muonckpt.distributed.collectives", "files/"),
        (
            f"{writing}:2: files.writing imports rank from muonckpt.distributed "
            "(which loads muonckpt.distributed.collectives)",
            "files/",
        ),
        (
            f"{writing}:4: files.writing imports save from muonckpt "
            "(which loads muonckpt.checkpoint.api)",
            "files import only",
        ),
        (
            "muonckpt/interop/dcp/files.py:2: interop.dcp.files imports "
            "torch.distributed.init_process_group",
            "interop/dcp/",
        ),
        ("muonckpt/cli.py:2: cli imports _Job from muonckpt.offline (not in its __all__)", "the"),
        ("muonckpt/cli.py:5: cli imports verify from muonckpt.checkpoint.pieces", "the command"),
        ("muonckpt/cli.py:6: cli imports load from muonckpt (not in its __all__)", "the command"),
    ]
    for where, rule in expected:
        hits = [line for line in found if line.startswith(where + ": rule '" + rule)]
        assert hits, f"not reported: {where} (rule {rule!r}); reported:\n" + "\n".join(found)
    assert len(found) == len(expected), "\n".join(found)


def test_an_indirect_upward_import_is_reported_with_its_path():
    sources = _fake(
        {
            "": (
                "from ._namespace import lazy_names\n_PUBLIC = {'save': '.checkpoint.api'}\n"
                "NAMESPACES = ('offline',)\n"
                "__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, NAMESPACES)\n"
            ),
            "_namespace": "",
            "checkpoint": "",
            "checkpoint.api": "",
            "offline": "",
            "offline.tools": "",
            "state": "",
            "state.x": "from ..files import a\n",
            "storage": "",
            "storage.b": "def f():\n    from .. import save\n",
            "storage.g": "from .. import offline\n",
            "files": "",
            "files.a": "import os\nfrom ..storage import b\n",
            "files.c": "from ..storage import g\n",
            "files.d": "from ..distributed import run\n",
            "files.e": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
            "distributed": (
                "from .._namespace import lazy_names\n_NAMES = {'run': '.launch'}\n"
                "__getattr__, __dir__ = lazy_names(__name__, _NAMES)\n"
            ),
            "distributed.launch": "from ..offline import tools\n",
        }
    )
    assert upward_reaches(sources) == [
        "muonckpt/files/a.py:2: files.a reaches checkpoint.api through storage.b -> checkpoint.api",
        "muonckpt/files/c.py:1: files.c reaches offline through storage.g -> offline",
        "muonckpt/files/d.py:1: files.d reaches offline.tools through "
        "distributed.launch -> offline.tools",
        "muonckpt/state/x.py:1: state.x reaches checkpoint.api through "
        "files.a -> storage.b -> checkpoint.api",
    ]


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


_MODULE_NAME = re.compile(r"`([a-z_][a-z0-9_]*(?:/[a-z0-9_]*)*)`")
"""A module as a folder's row names it: ``topology``, ``deepspeed/`` (a sub-folder),
``deepspeed/reader``; a dotted name (``retention.latest``) is a name inside a module."""


def _documented_modules(text: str) -> dict[str, set[str]]:
    """Each folder of the module map -> the modules its row's "what changes here" names."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    named = {}
    for row in section.splitlines():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if row.startswith("| ") and len(cells) == 4 and cells[1].endswith("/`"):
            named[cells[1].strip("`/")] = set(_MODULE_NAME.findall(cells[2]))
    return named


def folder_modules(sources: Mapping[str, tuple[str, str]], folder: str) -> set[str]:
    """The modules of ``folder`` as its row names them, sub-folders as ``sub/``."""
    found = set()
    for module, (file, _) in sources.items():
        if module.startswith(folder + "."):
            name = module[len(folder) + 1 :].replace(".", "/")
            found.add(name + "/" if file.endswith("/__init__.py") else name)
    return found


def test_each_folders_row_of_the_module_map_names_exactly_its_modules():
    """A module's responsibility is its folder's, as docs/design.md's table states it: a new
    module is named in its folder's row, and a row never names a module that is not there."""
    sources = package_sources()
    documented = _documented_modules((ROOT.parent / "docs" / "design.md").read_text())
    folders = {m.split(".")[0] for m in sources if "." in m}
    assert set(documented) == folders
    problems = []
    for folder in sorted(folders):
        actual = folder_modules(sources, folder)
        if missing := sorted(actual - documented[folder]):
            problems.append(f"{folder}/: its row does not name {missing}")
        if extra := sorted(documented[folder] - actual):
            problems.append(f"{folder}/: its row names {extra}, which {folder}/ does not have")
    assert not problems, "\n".join(problems)
    fake = _fake({"a": "", "a.b": "", "a.c": "", "a.c.d": ""})
    assert folder_modules(fake, "a") == {"b", "c/", "c/d"}
    row = "| 1 | `a/` | the b (`b`, `b.f`), the `c/` of `c/d`, the `e` | x |"
    assert _documented_modules(f"## Module map\n\n{row}\n") == {"a": {"b", "c/", "c/d", "e"}}
