"""Values of a manifest or a piece index that no writer makes (issue 50): a checksum chunk size
out of 1..MAX_CHUNK_BYTES (2**63 was an OverflowError traceback in ``verify``), a name or value
that is not valid Unicode (a lone surrogate, from a JSON ``\\ud800`` escape: a UnicodeEncodeError
traceback in ``consolidate``). Each is refused where it is read, as a CheckpointError naming the
file (and the offending text, escaped), by the API and by every command, in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import muonckpt
from muonckpt import CheckpointError, offline, storage
from muonckpt.cli import app
from muonckpt.format.manifest import MAX_CHUNK_BYTES
from muonckpt.format.names import MANIFEST_NAME
from muonckpt.storage import durable, safetensors_writer

from .fixture_model import single_process_optimizer

KINDS = ("per-rank", "consolidated")


@pytest.fixture(scope="module")
def saved(single_ckpt, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("values")
    ours = single_ckpt(2)
    return {"per-rank": ours, "consolidated": offline.consolidate(ours, root / "consolidated")}


@pytest.fixture(params=KINDS)
def ckpt(request, saved, tmp_path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(saved[request.param], copy)
    return copy


def _manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / MANIFEST_NAME).read_text())


def _write_manifest(ckpt: Path, body: dict) -> None:
    """The manifest as JSON writes it: a lone surrogate as its ``\\ud800`` escape."""
    (ckpt / MANIFEST_NAME).write_text(json.dumps(body, indent=1))


def _edit_index(ckpt: Path, edit) -> str:
    """Edit the rows of the checkpoint's first piece index and make the manifest's record of it
    agree (size, checksum): a lie its checksum cannot catch. Returns the index's name."""
    body = _manifest(ckpt)
    entry = body["indexes"][0]
    path = ckpt / entry["name"]
    rows = json.loads(path.read_text())
    edit(rows["pieces"])
    path.write_text(json.dumps(rows))
    entry.update(bytes=path.stat().st_size, checksum=storage.chunk_digest(path.read_bytes()))
    _write_manifest(ckpt, body)
    return entry["name"]


def _chunk_bytes(value: object, rows: slice = slice(0, 1)):
    def edit(pieces: list) -> None:
        for row in pieces[rows]:
            row[4] = value

    return edit


def _load(ckpt: Path) -> None:
    muonckpt.load(single_process_optimizer(0), ckpt)


def _cli(*argv: object):
    """The command, on a console wide enough that no line wraps."""
    return CliRunner().invoke(app, [str(a) for a in argv], env={"COLUMNS": "1000"})


def _assert_one_error(result, *named: str) -> None:
    """Exit code 2 and one ``error:`` line naming each of ``named``; no traceback."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for text in named:
        assert text in lines[0], (text, lines[0])


def _assert_one_problem(result, *named: str) -> None:
    """``verify``: exit code 1, one problem naming each of ``named``; no traceback."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    problems = [line for line in result.output.splitlines() if line.startswith("problem: ")]
    assert len(problems) == 1 and "1 problem(s)" in result.output, result.output
    for name in named:
        assert name in problems[0], (name, result.output)


ABSURD = [2**63, 2**64, MAX_CHUNK_BYTES + 1, 0, -1, 1.5, True, "4194304"]


@pytest.mark.parametrize("value", ABSURD, ids=repr)
def test_an_absurd_chunk_size_in_a_piece_index_is_refused(ckpt, value, tmp_path):
    index = _edit_index(ckpt, _chunk_bytes(value))
    problems = muonckpt.verify(ckpt)
    assert len(problems) == 1 and isinstance(problems[0], CheckpointError), problems
    assert index in str(problems[0]) and f"chunk_bytes {value!r}" in str(problems[0])
    with pytest.raises(CheckpointError, match="chunk_bytes") as caught:
        _load(ckpt)
    assert index in str(caught.value)
    _assert_one_problem(_cli("verify", ckpt), index, "chunk_bytes")
    _assert_one_error(_cli("consolidate", ckpt, "-o", tmp_path / "out"), index, "chunk_bytes")
    assert not (tmp_path / "out").exists()


def test_the_chunk_size_limit_and_one_past_it(ckpt):
    """Every piece's chunk at MAX_CHUNK_BYTES (each tensor one chunk, as before): sound, and
    loads; one byte more is refused."""
    _edit_index(ckpt, _chunk_bytes(MAX_CHUNK_BYTES, slice(None)))
    assert muonckpt.verify(ckpt) == []
    _load(ckpt)
    index = _edit_index(ckpt, _chunk_bytes(MAX_CHUNK_BYTES + 1, slice(None)))
    (problem,) = muonckpt.verify(ckpt)
    assert index in str(problem) and f"from 1 to {MAX_CHUNK_BYTES}" in str(problem)


def test_an_absurd_chunk_size_in_a_version_2_manifest_is_refused(saved, tmp_path):
    """Version 2 holds its pieces in the manifest: the same limit there."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["per-rank"], ckpt)
    manifest = muonckpt.read_manifest(ckpt)
    (ckpt / MANIFEST_NAME).write_text(dataclasses.replace(manifest, format_version=2).to_json())
    for index in manifest.indexes:
        (ckpt / index.name).unlink()
    body = _manifest(ckpt)
    body["pieces"][0]["chunk_bytes"] = 2**63
    _write_manifest(ckpt, body)
    (problem,) = muonckpt.verify(ckpt)
    assert MANIFEST_NAME in str(problem) and f"chunk_bytes {2**63}" in str(problem)
    _assert_one_problem(_cli("verify", ckpt), MANIFEST_NAME, "chunk_bytes")


def _surrogate_in_a_name(ckpt: Path) -> str:
    body = _manifest(ckpt)
    body["params"][0][1] += "\ud800"  # version 4: [shared, rest, kind]
    _write_manifest(ckpt, body)
    return MANIFEST_NAME


def _surrogate_in_a_setting(ckpt: Path) -> str:
    body = _manifest(ckpt)
    body["groups"][0]["hyperparams"]["note\ud800"] = "x"
    _write_manifest(ckpt, body)
    return MANIFEST_NAME


def _surrogate_in_a_tensor_key(ckpt: Path) -> str:
    def edit(pieces: list) -> None:
        pieces[0][2] = "state.x\ud800.exp_avg"

    return _edit_index(ckpt, edit)


SURROGATES = [_surrogate_in_a_name, _surrogate_in_a_setting, _surrogate_in_a_tensor_key]
TOOLS = {
    "consolidate": lambda src, out: ("consolidate", src, "-o", out),
    "reshard": lambda src, out: ("reshard", src, "-o", out, "--dp", 2, "--tp", 1),
    "convert": lambda src, out: ("convert", src, "-o", out, "--to", "torch"),
    "to-dcp": lambda src, out: ("convert", src, "-o", out, "--to", "torch", "--format", "dcp"),
    "inspect": lambda src, out: ("inspect", src),
    "diff": lambda src, out: ("diff", src, src),
}


@pytest.mark.parametrize("damage", SURROGATES, ids=lambda d: d.__name__[1:])
def test_a_lone_surrogate_is_refused_by_every_tool_naming_it(saved, tmp_path, damage):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["per-rank"], ckpt)
    file = damage(ckpt)
    escaped = "\\ud800"  # as the message shows it
    (problem,) = muonckpt.verify(ckpt)
    assert file in str(problem) and escaped in str(problem)
    with pytest.raises(CheckpointError, match=r"\\ud800"):
        _load(ckpt)
    _assert_one_problem(_cli("verify", ckpt), file, escaped)
    for name, argv in TOOLS.items():
        out = tmp_path / name
        _assert_one_error(_cli(*argv(ckpt, out)), file, escaped)
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_writer_refuses_text_utf8_cannot_hold(tmp_path):
    """What a foreign reader or a caller hands a writer (a name from a pickle, an ``extra``
    path decoded with ``surrogateescape``) is refused naming it, not a UnicodeEncodeError, and
    nothing is left behind."""
    import torch

    path = tmp_path / "a.safetensors"
    with pytest.raises(CheckpointError, match=r"tensor key 'w\\ud800' is not valid Unicode"):
        safetensors_writer.write_safetensors(path, {"w\ud800": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"\\udcff"):
        durable.write_text_atomic(tmp_path / "m.json", ['{"path": "/data/', '\udcff"}'])
    assert list(tmp_path.iterdir()) == []
