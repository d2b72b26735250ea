"""The public surface: the top level holds what a training script calls, the rest are
namespaces, and the names the top level held before keep working for one release, warning."""

from __future__ import annotations

import builtins
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import muonckpt

TOP_LEVEL = {
    "save",
    "async_save",
    "load",
    "LoadReport",
    "latest",
    "clean",
    "verify",
    "read_manifest",
    "install_hooks",
    "gather_state_dict",
    "REPLICATED",
    "RNGState",
    "MuonCkptError",
    "CheckpointError",
    "StateDictError",
    "LayoutError",
    "CollectiveError",
    "CheckpointWarning",
    "ConversionWarning",
}

MOVED = {
    "Muon": "optim",
    "MuonDistMeta": "optim",
    "adjusted_lr": "optim",
    "newton_schulz": "optim",
    "normalize_range": "optim",
    "ShardedParams": "sharding",
    "shard_for_groups": "sharding",
    "shard_param_groups": "sharding",
    "LayoutOptions": "layout",
    "ParamSpec": "layout",
    "Topology": "layout",
    "arrange": "layout",
    "default_group_from_env": "collectives",
    "global_rank": "collectives",
    "grid_groups": "collectives",
    "rendezvous_timeout": "collectives",
    "set_rendezvous_timeout": "collectives",
    "run_demo": "demo",
    "FAMILIES": "kinds",
    "DCP_FAMILIES": "kinds",
}
"""Every name the top level exported before its tiers (0.1.0's ``__all__``, less TOP_LEVEL)."""


def test_the_top_level_is_exactly_what_a_training_script_calls():
    assert set(muonckpt.__all__) == TOP_LEVEL
    assert len(muonckpt.__all__) == len(TOP_LEVEL)
    for name in muonckpt.__all__:
        assert getattr(muonckpt, name) is not None
    assert set(muonckpt.__all__) <= set(dir(muonckpt))
    assert not set(MOVED) & set(dir(muonckpt))


@pytest.mark.parametrize("name", sorted(MOVED))
def test_an_old_top_level_name_still_works_and_warns(name):
    assert MOVED[name] in muonckpt._NAMESPACES  # the new path works after a bare import
    namespace = importlib.import_module(f"muonckpt.{MOVED[name]}")
    with pytest.warns(DeprecationWarning, match=rf"muonckpt\.{name} moved to muonckpt\."):
        value = getattr(muonckpt, name)
    assert value is getattr(namespace, name)


def test_from_import_of_an_old_name_warns_at_the_import():
    with pytest.warns(DeprecationWarning, match="muonckpt.Muon moved to muonckpt.optim.muon.Muon"):
        from muonckpt import Muon
    from muonckpt.optim.muon import Muon as current

    assert Muon is current


def test_the_namespaces_load_on_first_use():
    probe = "import muonckpt, sys; print(muonckpt.layout.topology.Topology(1, 1), 'torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
    )
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
    if parts[1] in muonckpt._MOVED:
        return "a deprecated top-level name"
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
    """Every cross-reference in the package's docstrings resolves: a ``muonckpt.`` path through
    no deprecated top-level name, a bare function, class or constant in its own module (names
    that moved in the issue 22 split were left pointing at their old places)."""
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
