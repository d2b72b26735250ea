"""No pickle in muonckpt's own format, and DCP's pickled metadata read only through the
restricted unpickler: no pickle import outside muonckpt/interop/dcp/metadata.py, where pickle
serves only as the base class of an Unpickler that defines find_class (no pickle.load, loads,
dump, dumps, plain Unpickler), and muonckpt/storage/torch_pickles.py, the one writer of the
trainers' own ``torch.save`` files (DeepSpeed's, accelerate's, Lightning's: pickles by their
format); no torch.load without weights_only=True; DCP written only by torch's writer
(muonckpt/interop/dcp/files.py)."""

import ast
from pathlib import Path

import muonckpt

PACKAGE = Path(muonckpt.__file__).parent


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


DCP_READER = PACKAGE / "interop" / "dcp" / "metadata.py"
"""The one module that may import pickle to read: the restricted reader of DCP metadata."""
TORCH_WRITER = PACKAGE / "storage" / "torch_pickles.py"
"""The one module that may import pickle to write: the trainers' own torch.save files."""
DCP_WRITER = PACKAGE / "interop" / "dcp" / "files.py"
"""The one module that writes DCP, through torch's writer."""


def test_package_never_imports_pickle():
    offenders = []
    for path in _modules():
        if path in (DCP_READER, TORCH_WRITER):
            continue
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


def test_the_dcp_reader_uses_pickle_only_through_its_restricted_unpickler():
    tree = ast.parse(DCP_READER.read_text())
    uses = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "pickle"
    ]
    assert [u.attr for u in uses] == ["Unpickler"]  # the base class, nothing else
    (unpickler,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(b in uses for b in node.bases)
    ]
    methods = {n.name for n in unpickler.body if isinstance(n, ast.FunctionDef)}
    assert {"find_class", "persistent_load"} <= methods
    bare = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "pickle"
    ]
    assert bare == []  # no "from pickle import load"


def test_dcp_is_written_only_by_torchs_writer():
    """The package never writes DCP bytes itself: one dcp.save call, with torch's FileSystemWriter
    (subclassed only to choose which tensors share a file and to write through the storage
    seam)."""
    saves = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "save"
                and getattr(node.func.value, "id", "") == "dcp"
            ):
                saves.append(path)
                writer = {k.arg: k.value for k in node.keywords}["storage_writer"]
                assert getattr(writer, "id", "") == "writer"
                # torch's writer, subclassed in the private module beside it
                assert "(dcp.FileSystemWriter)" in (path.parent / "_torch_writer.py").read_text()
    assert saves == [DCP_WRITER]
