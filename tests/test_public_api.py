"""The public surface: the top level holds what a training script calls, the rest are the
namespaces of ``muonckpt.NAMESPACES``, each with its ``__all__``; the docs name exactly those
namespaces, and every ``muonckpt.`` path in the docs and docstrings resolves."""

from __future__ import annotations

import builtins
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import muonckpt

REPO = Path(__file__).parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

TOP_LEVEL = {
    "save",
    "async_save",
    "load",
    "LoadReport",
    "LocalTier",
    "recover",
    "Recovery",
    "latest",
    "clean",
    "verify",
    "doctor",
    "read_manifest",
    "install_hooks",
    "gather_state_dict",
    "REPLICATED",
    "RNGState",
    "ProgressLines",
    "MuonCkptError",
    "CheckpointError",
    "ArgumentError",
    "StateDictError",
    "LayoutError",
    "CollectiveError",
    "CheckpointWarning",
    "ConversionWarning",
}


def test_the_top_level_is_exactly_what_a_training_script_calls():
    assert set(muonckpt.__all__) == TOP_LEVEL
    assert len(muonckpt.__all__) == len(TOP_LEVEL)
    for name in muonckpt.__all__:
        assert getattr(muonckpt, name) is not None
    assert set(muonckpt.__all__) | set(muonckpt.NAMESPACES) <= set(dir(muonckpt))


@pytest.mark.parametrize("namespace", muonckpt.NAMESPACES)
def test_every_namespace_lists_its_names_and_each_resolves(namespace):
    module = getattr(muonckpt, namespace)
    assert module is importlib.import_module(f"muonckpt.{namespace}")
    names = module.__all__
    assert names and len(set(names)) == len(names)
    for name in names:
        assert getattr(module, name) is not None, name
    assert set(names) <= set(dir(module))


def test_the_package_docstring_names_the_namespaces_in_order():
    named = re.findall(r":mod:`muonckpt\.(\w+)`", muonckpt.__doc__ or "")
    assert named == list(muonckpt.NAMESPACES)


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md"])
def test_the_docs_list_exactly_the_namespaces(doc):
    """The paragraph after ``<!-- namespaces -->`` names each namespace once, in the order of
    ``muonckpt.NAMESPACES`` (the one list)."""
    text = (REPO / doc).read_text()
    match = re.search(r"<!-- namespaces -->\n(.*?)\n\n", text, re.S)
    assert match, f"no <!-- namespaces --> paragraph in {doc}"
    named = re.findall(r"`muonckpt\.(\w+)`", match.group(1))
    assert named == list(muonckpt.NAMESPACES), named


def public_paths() -> dict[int, tuple[object, list[str]]]:
    """Every public path (``muonckpt.NAME`` of the top level's ``__all__``, ``muonckpt.NS.NAME``
    of each namespace's), grouped by the object it names: its ``id`` -> (it, its paths)."""
    paths: dict[int, tuple[object, list[str]]] = {}
    for prefix, module in [("muonckpt", muonckpt)] + [
        (f"muonckpt.{ns}", getattr(muonckpt, ns)) for ns in muonckpt.NAMESPACES
    ]:
        for name in module.__all__:
            obj = getattr(module, name)
            paths.setdefault(id(obj), (obj, []))[1].append(f"{prefix}.{name}")
    return paths


def test_every_public_object_has_one_public_path():
    """One name for one thing: no namespace re-exports another's names (``offline`` once
    re-exported 18 of ``interop``'s). An error type may stand in ``muonckpt.errors`` and beside
    the calls that raise it (the top level, ``muonckpt.distributed.DistributedRunError``)."""
    twice = [
        paths
        for obj, paths in public_paths().values()
        if len(paths) > 1 and not (isinstance(obj, type) and issubclass(obj, BaseException))
    ]
    assert not twice, "objects with several public paths:\n" + "\n".join(map(str, twice))


@pytest.mark.dist
def test_the_namespaces_load_on_first_use():
    probe = "import muonckpt, sys; print(muonckpt.layout.Topology(1, 1), 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "False"  # the torch-free namespace imports no torch


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="not_a_name"):
        muonckpt.not_a_name  # noqa: B018


_ROLE = re.compile(r":(func|class|meth|data|attr|exc|mod):`~?([A-Za-z_][\w.]*)`")


def _module_files() -> list[tuple[str, Path]]:
    root = Path(muonckpt.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] != "__main__":
            found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return found


def _unresolved(target: str) -> str | None:
    """Why the ``muonckpt.`` path ``target`` names nothing (None: it resolves)."""
    parts = target.split(".")
    obj: object = muonckpt
    for depth, part in enumerate(parts[1:], start=2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, type) and part in getattr(obj, "__annotations__", {}):
            return None  # a dataclass field without a default
        else:
            try:
                obj = importlib.import_module(".".join(parts[:depth]))
            except ImportError:
                return f"no {part!r}"
    return None


def test_the_docstrings_name_the_current_paths():
    """Every cross-reference in the package's docstrings resolves: a ``muonckpt.`` path, a bare
    function, class or constant in its own module (names that moved in the issue 22 split were
    left pointing at their old places)."""
    wrong = []
    for module_name, path in _module_files():
        module = importlib.import_module(module_name)
        text = path.read_text()
        for match in _ROLE.finditer(text):
            role, target = match.groups()
            where = f"{path.name}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)}"
            if target.startswith("muonckpt."):
                why = _unresolved(target)
            elif "." in target or role not in ("func", "class", "data", "exc"):
                why = None  # a member of a class: not checked
            elif hasattr(module, target) or hasattr(builtins, target):
                why = None
            else:
                why = f"not in {module_name}"
            if why is not None:
                wrong.append(f"{where} ({why})")
    assert not wrong, "\n".join(wrong)


_DOC_PATH = re.compile(r"`(muonckpt(?:\.\w+)+)")
"""A ``muonckpt.`` path at the start of a code span: ``muonckpt.offline.reshard(...)``."""


def test_every_path_the_docs_name_resolves():
    """README.md and docs/*.md name public names by their namespace and internals by their
    module, never by a path that no longer exists (``muonckpt.collectives.X`` after the move
    into layer folders)."""
    wrong = []
    for doc in DOCS:
        text = doc.read_text()
        for match in _DOC_PATH.finditer(text):
            target = match.group(1)
            why = _unresolved(target)
            if why is not None:
                line = text.count("\n", 0, match.start()) + 1
                wrong.append(f"{doc.relative_to(REPO)}:{line}: {target} ({why})")
    assert not wrong, "\n".join(wrong)


def _modules_by_name() -> dict[str, str]:
    """Each module or package of muonckpt by its last name, where that name is unique."""
    by_name: dict[str, list[str]] = {}
    for module_name, _ in _module_files():
        by_name.setdefault(module_name.rsplit(".", 1)[-1], []).append(module_name)
    return {name: found[0] for name, found in by_name.items() if len(found) == 1}


_SHORT_PATH = re.compile(r"`([a-z_]+)\.([A-Za-z_]\w*)")
"""A module-relative name at the start of a code span: ``storage.check_target``."""
_NOT_OURS = {"muon", "dcp", "deepspeed", "state", "muonckpt", "megatron", "torchtitan", "optim"}
"""Names the docs also use for others' modules and keys: upstream ``muon.MuonWithAuxAdam``,
``dcp.save`` (``torch.distributed.checkpoint``), ``deepspeed.utils`` (DeepSpeed's own
modules, and the optimizer name ``deepspeed.MuonWithAuxAdam``), ``state.w_in`` (a tensor
key), ``megatron.training`` (Megatron-LM's package), ``torchtitan.DistMuon`` (the optimizer
name torchtitan's groups are recorded under), ``optim.state`` (``get_state_dict``'s keys)."""
_FILE_SUFFIXES = {"py", "json", "md", "safetensors"}


def test_every_module_name_the_docs_use_resolves():
    """A name the docs give by its module (``kinds.state_mapping``, ``storage.check_target``)
    is in that module (``storage.open_regular`` was not)."""
    modules = _modules_by_name()
    wrong = []
    for doc in DOCS:
        text = doc.read_text()
        for match in _SHORT_PATH.finditer(text):
            module, name = match.groups()
            if module not in modules or module in _NOT_OURS or name in _FILE_SUFFIXES:
                continue  # ("muonckpt" is in _NOT_OURS: whole paths are the test above's)
            why = _unresolved(f"{modules[module]}.{name}")
            if why is not None:
                line = text.count("\n", 0, match.start()) + 1
                wrong.append(f"{doc.relative_to(REPO)}:{line}: {module}.{name} ({why})")
    assert not wrong, "\n".join(wrong)


def test_every_source_file_the_docs_name_exists():
    wrong = [
        f"{doc.relative_to(REPO)}: {path}"
        for doc in DOCS
        for path in re.findall(r"`(muonckpt/[\w/]*(?:\.py)?)`", doc.read_text())
        if not (REPO / path).exists()
    ]
    assert not wrong, "\n".join(wrong)
