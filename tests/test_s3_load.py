"""Reading muonckpt checkpoints from S3, against the real server: ``load``, ``read_manifest``,
``verify``, ``latest``, the CLI's read commands and an offline tool's source, through the read
seam (:class:`muonckpt.storage.CheckpointFiles`): the manifest by one GET, never a LIST, each
rank's own byte ranges by ranged GETs, checksums verified, a checkpoint replaced meanwhile
reported, never mixed; hostile manifests and missing objects, buckets and credentials refused
in one line naming the URL."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import muonckpt
from muonckpt.cli import app
from muonckpt.distributed.launch import run_distributed
from muonckpt.errors import CheckpointError, StoreUnreachable
from muonckpt.files.pieces import PieceReader, open_checkpoint
from muonckpt.layout.topology import whole_region
from muonckpt.storage import byte_source, checkpoint_files
from muonckpt.storage.s3 import S3Client, S3Url
from muonckpt.storage.s3store import S3Store

from .fixture_model import build, initial_params
from .s3_cases import AGENT, LOOKING, save_copy_load_phase, state_of, upload
from .s3_proxy import FaultProxy
from .s3_server import ENVIRONMENT, S3Server

pytestmark = pytest.mark.dist


def _publish(local: Path, target: str) -> str:
    """``local`` committed at ``target`` by the S3 store (under a save prefix of its own)."""
    store = S3Store(S3Client())
    staging = store.create_staging(target, False)
    for path in local.iterdir():
        shutil.copyfile(path, staging / path.name)
    store.publish(staging, target)
    return target


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        other = b[name]
        assert value.dtype == other.dtype and value.shape == other.shape, name
        assert torch.equal(value.view(-1).view(torch.uint8), other.view(-1).view(torch.uint8))


def _loaded(ckpt: str | Path) -> dict[str, torch.Tensor]:
    zeros = {name: torch.zeros_like(value) for name, value in initial_params().items()}
    opt, _, _, _ = build(1, 1, zeros)
    muonckpt.load(opt, ckpt)
    return state_of(opt)


def test_a_2x2_save_copied_to_s3_loads_at_4x1_bitwise(
    tmp_path: Path, s3_server: S3Server, s3_proxy: FaultProxy
) -> None:
    """The issue's case: saved at 2 x 2 to S3, and to a directory copied object by object to
    S3, each loaded at 4 x 1 under gloo from s3:// bitwise as from the directory. The newest
    is found by ``latest(collective=True)``: one LIST, by rank 0. Each rank reads the
    manifest by one GET, never lists, and reads only what its share needs (its piece
    indexes)."""
    bucket = s3_server.bucket()
    prefix = "run/step-3"
    local = tmp_path / "step-3"
    environment = {k: os.environ[k] for k in [*ENVIRONMENT, "AWS_ENDPOINT_URL"]}
    results = run_distributed(
        save_copy_load_phase,
        4,
        *(str(local), bucket, prefix, s3_server.endpoint, environment, 3),
        timeout=180,
    )
    for state in results:
        mine = {k.removeprefix("local/"): v for k, v in state.items() if k.startswith("local/")}
        for tag in ("s3/", "saved/"):  # copied to S3, saved to S3
            _bitwise({k.removeprefix(tag): v for k, v in state.items() if k.startswith(tag)}, mine)
        assert any(v.abs().sum() > 0 for v in mine.values())
    log = s3_proxy.log
    looked = [r for r in log if LOOKING.format(rank="") in r.agent]
    assert all(LOOKING.format(rank=0) in r.agent for r in looked)  # rank 0 alone looked
    assert sum("list-type" in r.target or "delimiter" in r.target for r in looked) == 1
    log = [r for r in log if r not in looked]
    assert all("list-type" not in r.target and "delimiter" not in r.target for r in log)
    manifest = json.loads((local / "manifest.json").read_text())
    indexes = {i["name"] for i in manifest["indexes"]}
    for rank in range(4):
        mine = [r for r in log if AGENT.format(rank=rank) in r.agent]
        names = Counter(r.target.split("?")[0].rpartition("/")[2] for r in mine)
        assert names["manifest.json"] == 2, names  # once per load from S3
        assert set(names) - {"manifest.json"} <= indexes | {f["name"] for f in manifest["files"]}
        assert all(names[i] <= 2 for i in indexes), names  # each index read once at most
    assert {r.method for r in log} == {"GET"}  # no HEAD either: sizes come with the GETs


def test_read_verify_load_latest_and_the_cli_in_one_process(
    tmp_path: Path, s3_server: S3Server, single_ckpt, s3_proxy: FaultProxy
) -> None:
    """A checkpoint committed to S3 by the store (under a save prefix) and one copied there
    object by object: read_manifest, verify, load (bitwise as from the directory, no LIST),
    latest (one LIST), and the CLI's inspect, verify, diff and consolidate to a directory."""
    bucket = s3_server.bucket()
    two = _publish(single_ckpt(2), f"s3://{bucket}/run/step-2")
    upload(single_ckpt(3), bucket, "run/step-3", s3_server.endpoint)
    three = f"s3://{bucket}/run/step-3"
    for local, url in ((single_ckpt(2), two), (single_ckpt(3), three)):
        on_s3, on_disk = muonckpt.read_manifest(url), muonckpt.read_manifest(local)
        assert (on_s3.params, on_s3.files, on_s3.step) == (
            on_disk.params,
            on_disk.files,
            on_disk.step,
        )
        assert muonckpt.verify(url) == []  # its objects looked up one by one
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(checkpoint_files, "LISTED_FROM", 1)
            before = len(s3_proxy.log)
            assert muonckpt.verify(url) == []  # by one LIST (reads pinned to its etags)
            assert not any(r.method == "HEAD" for r in s3_proxy.log[before:])
        before = len(s3_proxy.log)
        _bitwise(_loaded(url), _loaded(local))
        assert not any("list-type" in r.target for r in s3_proxy.log[before:])
    assert muonckpt.read_manifest(two).data_prefix.startswith("s-")
    # A save that never committed left objects under the checkpoint: garbage, not damage.
    client = S3Client()
    client.put(S3Url.parse(two) / "s-0123456789abcdef/rank-00000-of-00001.safetensors", b"x")
    assert muonckpt.verify(two) == []
    before = len(s3_proxy.log)
    assert str(muonckpt.latest(f"s3://{bucket}/run")) == three
    assert sum("list-type" in r.target for r in s3_proxy.log[before:]) == 1
    assert muonckpt.latest(f"s3://{bucket}/nothing-yet") is None
    with pytest.raises(CheckpointError, match="is a checkpoint itself"):
        muonckpt.latest(two)

    runner = CliRunner()
    result = runner.invoke(app, ["inspect", two, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["path"] == two
    result = runner.invoke(app, ["latest", f"s3://{bucket}/run"])
    assert result.exit_code == 0 and result.stdout.strip() == three, result.output
    result = runner.invoke(app, ["verify", three])
    assert result.exit_code == 0 and f"ok: {three} is sound" in result.stdout, result.output
    result = runner.invoke(app, ["diff", two, str(single_ckpt(2))])
    assert result.exit_code == 0 and "bitwise" in result.stdout, result.output
    result = runner.invoke(app, ["diff", three, two])
    assert result.exit_code == 1, result.output
    result = runner.invoke(app, ["convert", two, "-o", str(tmp_path / "torch"), "--to", "torch"])
    assert result.exit_code == 0, result.output
    assert muonckpt.verify(tmp_path / "torch") == []
    result = runner.invoke(app, ["convert", two, "-o", str(tmp_path / "dcp"), "--format", "dcp"])
    assert result.exit_code == 2 and "foreign formats are converted" in result.output
    out = tmp_path / "full"
    result = runner.invoke(app, ["consolidate", two, "-o", str(out)])
    assert result.exit_code == 0, result.output
    expected = muonckpt.offline.consolidate(single_ckpt(2), tmp_path / "expected")
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in expected.iterdir())
    for path in out.iterdir():
        assert path.read_bytes() == (expected / path.name).read_bytes(), path.name


def test_refused_in_one_line_naming_the_url(
    tmp_path: Path, s3_server: S3Server, single_ckpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest naming objects outside its checkpoint's prefix, a missing object, an object
    deleted or a checkpoint replaced while it is read, a missing bucket, missing credentials:
    each one CheckpointError of one line that names the s3:// URL."""
    bucket = s3_server.bucket()
    client = S3Client()
    local = single_ckpt(2)
    url = _publish(local, f"s3://{bucket}/run/step-2")
    ckpt = S3Url.parse(url)
    text = json.loads(client.get(ckpt / "manifest.json") or b"")
    prefix = text["data_prefix"]

    def hostile(**fields: object) -> str:
        target = S3Url.parse(f"s3://{bucket}/hostile")
        client.put(target / "manifest.json", json.dumps({**text, **fields}).encode())
        return str(target)

    for fields in (
        {"data_prefix": "../run/step-2/" + prefix},
        {"data_prefix": "s-0123456789abcdef/../../"},
        {"files": [{**text["files"][0], "name": f"../run/step-2/{prefix}x.safetensors"}]},
    ):
        with pytest.raises(CheckpointError) as refused:
            muonckpt.read_manifest(hostile(**fields))
        assert f"s3://{bucket}/hostile/manifest.json" in str(refused.value)
        assert "\n" not in str(refused.value)

    data = ckpt / (prefix + text["files"][0]["name"])
    monkeypatch.setattr(byte_source, "HEAD_PREFETCH", 64)  # the tensors: read when needed
    files, manifest = open_checkpoint(url)
    entry = manifest.params[0]
    pieces = [p for p in manifest.pieces if p.param == entry.name and p.key == "param"]
    with PieceReader(files, manifest) as reader:
        reader.reader(pieces[0].file)  # opened: its HEAD and first bytes read
        client.delete(data)
        with pytest.raises(CheckpointError, match=re.escape(str(data))):
            reader.gather(pieces, entry, "param", whole_region(entry.numel))
    with pytest.raises(CheckpointError, match=f"missing data file.*{re.escape(str(data))}"):
        open_checkpoint(url)

    replaced = _publish(local, f"s3://{bucket}/run/step-9")
    files, manifest = open_checkpoint(replaced)
    store = S3Store(client)
    staging = store.create_staging(replaced, True)
    for path in single_ckpt(3).iterdir():
        shutil.copyfile(path, staging / path.name)
    store.publish(staging, replaced)  # the old objects deleted after the commit
    with (
        PieceReader(files, manifest) as reader,
        pytest.raises(CheckpointError, match="changed while reading"),
    ):
        reader.gather(pieces, entry, "param", whole_region(entry.numel))

    archived = S3Url.parse(_publish(local, f"s3://{bucket}/run/step-5"))
    key = next(k for k in client.listing(archived)[0] if k.endswith(".safetensors"))
    raw = s3_server.client()
    body = client.get(archived / key)
    raw.put_object(Bucket=bucket, Key=(archived / key).key, Body=body, StorageClass="GLACIER")
    problems = muonckpt.verify(str(archived))  # (403 InvalidObjectState: the object's state)
    assert len(problems) == 1 and "InvalidObjectState" in str(problems[0]), problems
    with pytest.raises(StoreUnreachable, match=r"s3://no-such-bucket-here/x.*NoSuchBucket"):
        muonckpt.read_manifest("s3://no-such-bucket-here/x")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(CheckpointError, match=f"{re.escape(url)}.*no AWS credentials") as refused:
        muonckpt.load(build(1, 1, initial_params())[0], url)
    assert "\n" not in str(refused.value)
    with pytest.raises(StoreUnreachable, match="no AWS credentials"):  # not the checkpoint's
        muonckpt.verify(url)
    verified = CliRunner().invoke(app, ["verify", url])
    assert verified.exit_code == 2 and "problem" not in verified.output, verified.output
    assert "no AWS credentials" in verified.output
