"""A manifest's ``data_prefix`` (issue 52: a checkpoint committed to S3 keeps its files under
its save's prefix ``s-<16 hex>/``): only that shape is accepted, so a hostile manifest cannot
name a file outside its checkpoint; a local checkpoint's manifest has none and its bytes are
unchanged."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import pytest

import muonckpt
from muonckpt.errors import CheckpointError
from muonckpt.format.manifest import PREFIXED_VERSION
from muonckpt.format.manifest_json import parse_manifest

HOSTILE = [
    "../",
    "../../etc/",
    "/tmp/",
    "s-0123/",
    "s-0123456789abcdef",
    "s-0123456789ABCDEF/",
    "s-0123456789abcdef/../",
    "a/b/",
    7,
    None,
    "",
]


def _with_prefix(text: str, prefix: object, version: int = PREFIXED_VERSION) -> str:
    """The manifest ``text`` with ``data_prefix`` first and its format version ``version``."""
    new = f'"format_version": {version},'
    body = re.sub(r'"format_version": \d+,', new, text.lstrip()[1:], count=1)
    assert new in body
    return '{"data_prefix": ' + json.dumps(prefix) + "," + body


def test_a_local_save_writes_no_data_prefix(single_ckpt) -> None:
    ckpt = single_ckpt(1)
    assert "data_prefix" not in (ckpt / "manifest.json").read_text()
    assert muonckpt.read_manifest(ckpt).data_prefix == ""


@pytest.mark.parametrize("prefix", HOSTILE)
def test_only_a_save_prefix_is_accepted(single_ckpt, tmp_path, prefix) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(single_ckpt(1), ckpt)
    manifest = ckpt / "manifest.json"
    manifest.write_text(_with_prefix(manifest.read_text(), prefix))
    if prefix == "":
        assert muonckpt.read_manifest(ckpt).data_prefix == ""
        return
    with pytest.raises(CheckpointError, match="data_prefix"):
        muonckpt.read_manifest(ckpt)


def test_a_data_prefix_is_version_5(single_ckpt, tmp_path) -> None:
    """A reader that knows no ``data_prefix`` (version 4 and older) refuses the version rather
    than reading files beside the manifest; a version 4 manifest naming one is refused."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(single_ckpt(1), ckpt)
    manifest = ckpt / "manifest.json"
    plain = manifest.read_text()
    manifest.write_text(_with_prefix(plain, "s-0123456789abcdef/", version=4))
    with pytest.raises(CheckpointError, match="version 4 manifest has no data_prefix"):
        muonckpt.read_manifest(ckpt)
    prefixed = replace(parse_manifest(plain, ckpt), data_prefix="s-0123456789abcdef/")
    written = "".join(prefixed.json_chunks())
    assert f'"format_version": {PREFIXED_VERSION},' in written
    assert parse_manifest(written, ckpt).data_prefix == "s-0123456789abcdef/"


def test_a_save_prefix_is_where_the_files_are(single_ckpt, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(single_ckpt(1), ckpt)
    manifest = ckpt / "manifest.json"
    manifest.write_text(_with_prefix(manifest.read_text(), "s-0123456789abcdef/"))
    problems = muonckpt.verify(ckpt)
    assert problems and all("s-0123456789abcdef" in str(p) for p in problems[:1])
    data = ckpt / "s-0123456789abcdef"
    data.mkdir()
    for p in ckpt.iterdir():
        if p.is_file() and p.name != "manifest.json":
            p.rename(data / p.name)
    assert muonckpt.verify(ckpt) == []
    assert muonckpt.read_manifest(ckpt).data_prefix == "s-0123456789abcdef/"
