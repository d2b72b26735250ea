"""No pickle in the package: no pickle import, no torch.load without weights_only=True."""

import ast
from pathlib import Path

import muonckpt

PACKAGE = Path(muonckpt.__file__).parent


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_package_never_imports_pickle():
    offenders = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            offenders += [
                f"{path.name}: {n}"
                for n in names
                if n.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle")
            ]
    assert offenders == []


def test_every_torch_load_is_weights_only():
    calls = 0
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
                and getattr(node.func.value, "id", "") == "torch"
            ):
                calls += 1
                flags = {k.arg: k.value for k in node.keywords}
                assert "weights_only" in flags, f"{path.name}:{node.lineno}"
                assert getattr(flags["weights_only"], "value", None) is True
    assert calls >= 1  # the launcher returns results through torch.load(weights_only=True)
