"""Saving to S3 through the write engine, against the real server: ``muonckpt.save`` to an
``s3://`` URL in one process and across gloo ranks that share no directory (each rank its own
temporary directory, uploading its own files), ``keep_last`` and ``clean`` on S3, the offline
tools writing to S3, a writer killed mid-save, and racing writers.

What a save committed is checked by downloading its objects (a plain object copy) into a
local directory, which ``verify`` and the local reader take (``data_prefix``), and by
comparing its files with those of the same save to a local directory."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import muonckpt
from muonckpt import offline
from muonckpt.cli import app
from muonckpt.distributed.launch import run_distributed
from muonckpt.errors import CheckpointError, CheckpointWarning
from muonckpt.format.manifest import PREFIXED_VERSION
from muonckpt.storage.s3 import S3Client, S3Url
from muonckpt.storage.s3store import data_prefix_of

from .fixture_model import single_process_optimizer
from .kill_helpers import REPO, readline
from .s3_cases import upload
from .s3_proxy import FaultProxy
from .s3_save_cases import save_one_rank_cannot_reach, save_to_both
from .s3_server import S3Server

pytestmark = pytest.mark.dist


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's temporary directory, where S3 saves stage: empty again after each."""
    mine = tmp_path / "tmp"
    mine.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(mine))
    return mine


def _staged_in(directory: Path) -> list[str]:
    """What S3 saves left in a temporary directory."""
    return [p.name for p in directory.iterdir() if p.name.startswith("muonckpt-s3-")]


def _keys(url: str) -> list[str]:
    return S3Client().listing(S3Url.parse(url))[0]


def _download(url: str, into: Path) -> Path:
    """The checkpoint at ``url`` into directory ``into``: its manifest and every object
    under the save prefix it names (``aws s3 cp --recursive`` with an include filter)."""
    client, base = S3Client(), S3Url.parse(url)
    manifest = client.get(base.child("manifest.json"))
    assert manifest is not None
    prefix = data_prefix_of(manifest.decode())
    assert prefix
    for key in client.listing(base)[0]:
        if key == "manifest.json" or key.startswith(prefix):
            path = into / key
            path.parent.mkdir(parents=True, exist_ok=True)
            data = client.get(base.child(key))
            assert data is not None
            path.write_bytes(data)
    return into


def _same_checkpoint(local: Path, copied: Path) -> None:
    """``copied`` (an S3 checkpoint copied down) holds ``local``'s files byte for byte under
    its save prefix, its manifest is ``local``'s with ``data_prefix`` (format version 5),
    and it verifies."""
    manifest = json.loads((copied / "manifest.json").read_text())
    prefix = manifest.pop("data_prefix")
    assert manifest == {
        **json.loads((local / "manifest.json").read_text()),
        "format_version": PREFIXED_VERSION,
    }
    names = sorted(p.name for p in local.iterdir() if p.name != "manifest.json")
    assert sorted(p.name for p in (copied / prefix).iterdir()) == names
    for name in names:
        assert (copied / prefix / name).read_bytes() == (local / name).read_bytes(), name
    assert muonckpt.verify(copied) == []


def test_a_save_in_one_process_with_keep_last(
    s3_server: S3Server, tmp_path: Path, scratch: Path
) -> None:
    """Three saves of a run with keep_last=2: each the same files as a local save, the oldest
    deleted entirely, nothing left in the temporary directory; over a checkpoint without
    overwrite, refused naming it; an overwrite deletes the replaced save's objects."""
    root = f"s3://{s3_server.bucket()}/run"
    for step in (1, 2, 3):
        opt = single_process_optimizer(step)
        local = muonckpt.save(opt, tmp_path / f"step-{step}")
        out = muonckpt.save(opt, f"{root}/step-{step}", keep_last=2)
        assert str(out) == f"{root}/step-{step}" and isinstance(out, S3Url)
        assert _staged_in(scratch) == []
        _same_checkpoint(local, _download(str(out), tmp_path / f"copy-{step}"))
    assert S3Client().listing(S3Url.parse(root), delimiter=True)[1] == ["step-2", "step-3"]
    with pytest.raises(CheckpointError, match=f"{root}/step-3 already holds a checkpoint"):
        muonckpt.save(opt, f"{root}/step-3")
    before = data_prefix_of((tmp_path / "copy-3" / "manifest.json").read_text())
    muonckpt.save(opt, f"{root}/step-3", overwrite=True)
    keys = _keys(f"{root}/step-3")
    assert before is not None and not any(k.startswith(before) for k in keys)
    assert len({k.split("/")[0] for k in keys if "/" in k}) == 1  # the new save's prefix alone


def test_keep_last_deletes_nothing_where_the_server_ignores_conditional_deletes(
    s3_server: S3Server, s3_proxy: FaultProxy
) -> None:
    """Pruning deletes a checkpoint's manifest only if it is still the one read (If-Match on
    DELETE); a server that ignores that condition could delete a checkpoint saved at the same
    place meanwhile, so there ``keep_last`` deletes nothing and warns, naming the URL and why
    (the server probed once per bucket). The real server honours the condition."""
    root = f"s3://{s3_server.bucket()}/run"
    muonckpt.save(single_process_optimizer(1), f"{root}/step-1", keep_last=1)
    s3_proxy.ignore_if_match_on_delete = True
    with pytest.warns(CheckpointWarning, match=f"{root}/step-1 not deleted: .*ignores If-Match"):
        muonckpt.save(single_process_optimizer(2), f"{root}/step-2", keep_last=1)
    assert S3Client().listing(S3Url.parse(root), delimiter=True)[1] == ["step-1", "step-2"]
    assert muonckpt.verify(f"{root}/step-1") == []
    assert S3Client().listing(S3Url.parse(root), delimiter=True)[0] == []
    keys = S3Client().listing(S3Url.parse(f"{root}/step-1"))[0]
    assert not any(k.endswith(".lease") for k in keys), keys  # no probe left behind
    s3_proxy.ignore_if_match_on_delete = False
    probe = S3Url.parse(root).child("s-0123456789abcdef/.lease")
    assert S3Client().honours_conditional_delete(probe, b"{}")  # (a new client probes)


def test_an_overwrite_of_a_copied_up_checkpoint_deletes_every_file_it_named(
    s3_server: S3Server, tmp_path: Path, scratch: Path
) -> None:
    """A local checkpoint copied up as it is (``data_prefix: ""``, its job state in a file of
    its own) and saved over: every file its manifest named is deleted after the commit."""
    local = muonckpt.save(
        single_process_optimizer(1), tmp_path / "local", extra={"t": torch.ones(3)}
    )
    assert (local / "extra.safetensors").is_file()
    url = f"s3://{s3_server.bucket()}/step-1"
    for path in local.iterdir():
        S3Client().put(S3Url.parse(url).child(path.name), path.read_bytes())
    muonckpt.save(single_process_optimizer(2), url, overwrite=True)
    keys = _keys(url)
    assert "manifest.json" in keys and all("/" in k for k in keys if k != "manifest.json")


def test_one_client_per_process_and_a_renewed_lease(
    s3_server: S3Server, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every store of the process sends through one client (made once: ~0.3 s); a save's
    root renews its lease while the save runs, and stops when it ends."""
    from muonckpt import storage
    from muonckpt.storage import s3store

    one, two = storage.store_for("s3://b/x"), storage.store_for("s3://b/y")
    assert isinstance(one, s3store.S3Store) and isinstance(two, s3store.S3Store)
    assert one.client is two.client
    monkeypatch.setattr(s3store, "LEASE_BEAT_S", 0.05)
    url = f"s3://{s3_server.bucket()}/step-1"
    staging = one.create_staging(url, False)
    time.sleep(2.5)
    (lease,) = [o for o in one.client.tree(S3Url.parse(url)) if o.key.endswith("/.lease")]
    assert time.time() - lease.modified < 1.5  # renewed meanwhile
    one.discard(staging)
    assert _keys(url) == [] and _staged_in(scratch) == []


@pytest.mark.parametrize(
    "dp, tp",
    [
        (2, 2),
        pytest.param(2, 1, marks=pytest.mark.slow),
        pytest.param(3, 1, marks=pytest.mark.slow),
    ],
)
def test_ranks_sharing_no_directory_save_to_s3(
    s3_server: S3Server, tmp_path: Path, dp: int, tp: int
) -> None:
    """A dp x tp save (per-rank, then consolidated, then per-rank by ``async_save``) by ranks
    each with a temporary directory of its own: the same files as the same save to a local
    directory, and every rank's scratch directory gone."""
    url = f"s3://{s3_server.bucket()}/run"
    world = dp * tp
    scratch = [str(tmp_path / f"host-{r}") for r in range(world)]
    for path in scratch:
        os.mkdir(path)
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    local = tmp_path / "local"
    out = run_distributed(save_to_both, world, dp, tp, env, scratch, str(local), url, timeout=180)
    saved = [f"{url}/per-rank", f"{url}/consolidated", f"{url}/async"]
    assert out == [saved] * world  # and nothing left in any rank's tmp
    for kind in ("per-rank", "consolidated"):
        _same_checkpoint(local / kind, _download(f"{url}/{kind}", tmp_path / kind))
    _same_checkpoint(local / "per-rank", _download(f"{url}/async", tmp_path / "async"))


@pytest.mark.slow
def test_a_rank_whose_uploads_fail_fails_the_save_on_every_rank(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Rank 1 of 2 gets 503 SlowDown for every request (through the fault proxy) until its
    retries are spent: every rank raises the save's error naming the object, nothing is
    committed, the root removes its save prefix, and no rank leaves scratch files."""
    proxy = FaultProxy(s3_server.endpoint)
    proxy.inject(slow_downs=10**6)
    url = f"s3://{s3_server.bucket()}/step-1"
    scratch = [str(tmp_path / f"host-{r}") for r in range(2)]
    for path in scratch:
        os.mkdir(path)
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    try:
        out = run_distributed(
            save_one_rank_cannot_reach, 2, 2, 1, env, scratch, url, proxy.endpoint, timeout=300
        )
    finally:
        proxy.close()
    assert [len(o) for o in out] == [1, 1], out  # an error each, nothing left in tmp
    assert all("SlowDown" in o[0] and url in o[0] for o in out), out
    assert _keys(url) == []


def test_clean_removes_only_what_no_manifest_names_and_no_save_is_writing(
    s3_server: S3Server, tmp_path: Path, scratch: Path
) -> None:
    """Under a run on S3: a committed checkpoint, a dead save's prefix over it (no lease) with
    an upload left in progress, a running save's prefix (its lease fresh), and objects that are
    not muonckpt's. ``clean`` removes the dead save's objects and aborts its upload, and an
    upload left open under the committed save's prefix; nothing else is touched."""
    root = f"s3://{s3_server.bucket()}/run"
    muonckpt.save(single_process_optimizer(1), f"{root}/step-1")
    client, base = S3Client(), S3Url.parse(root)
    named = _keys(f"{root}/step-1")
    dead, running = "s-00000000000000aa", "s-00000000000000bb"
    client.put(base.child(f"step-1/{dead}/rank-00000-of-00001.safetensors"), b"left")
    client.put(base.child(f"step-2/{running}/.lease"), b"{}")
    client.put(base.child("step-2/notes.txt"), b"mine")
    client.put(base.child("step-1/s-0123/x"), b"not our shape")
    client._client.create_multipart_upload(  # (a rank killed mid-upload)
        Bucket=base.bucket, Key=f"run/step-1/{dead}/rank-00000-of-00002.safetensors"
    )
    committed = next(k for k in named if k.startswith("s-")).split("/")[0]
    client._client.create_multipart_upload(  # (a start whose answer was lost, then retried)
        Bucket=base.bucket, Key=f"run/step-1/{committed}/rank-00000-of-00001.safetensors"
    )
    assert len(client.uploads(base)) == 2
    cleaned = muonckpt.clean(root, 0)
    assert cleaned.removed == [base.child(f"step-1/{dead}")]
    assert cleaned.skipped == [(base.child(f"step-2/{running}"), cleaned.skipped[0][1])]
    assert "running" in cleaned.skipped[0][1]
    assert _keys(f"{root}/step-1") == sorted([*named, "s-0123/x"])
    assert _keys(f"{root}/step-2") == ["notes.txt", f"{running}/.lease"]
    assert client.uploads(base) == []
    assert muonckpt.clean(root, 3600).removed == []  # younger than that: kept


def test_the_offline_tools_write_to_s3(
    s3_server: S3Server, tmp_path: Path, scratch: Path, single_ckpt
) -> None:
    """consolidate, reshard and convert --to torch from a local checkpoint to S3: the same
    files as to a local directory. A foreign format's output on S3, and a collective rewrite
    to S3, are refused in one line."""
    src = single_ckpt(2)
    url = f"s3://{s3_server.bucket()}/out"
    rewrites = {
        "consolidated": lambda dst: offline.consolidate(src, dst),
        "resharded": lambda dst: offline.reshard(src, dst, dp=2, tp=1),
        "converted": lambda dst: offline.convert(src, dst, to="torch"),
    }
    for name, rewrite in rewrites.items():
        rewrite(tmp_path / name)
        assert str(rewrite(f"{url}/{name}")) == f"{url}/{name}"
        _same_checkpoint(tmp_path / name, _download(f"{url}/{name}", tmp_path / f"{name}-copy"))
    assert _staged_in(scratch) == []
    with pytest.raises(CheckpointError, match="stage the files locally") as err:
        muonckpt.interop.to_dcp(src, f"{url}/dcp", to="torch")
    assert "\n" not in str(err.value)
    assert [k for k in _keys(url) if k.startswith("dcp")] == []


def _killed_writer(url: str, where: str) -> None:
    """A process saving over ``url``, SIGKILLed where ``where`` says (s3_save_cases)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.s3_save_cases", url, where],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert readline(proc, timeout=120) == "paused", proc.stderr.read() if proc.stderr else ""
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def _killed_trial(s3_server: S3Server, tmp_path: Path, where: str) -> None:
    """The previous checkpoint is untouched and whole after the kill (its manifest's etag,
    its files), and ``clean`` keeps the dead save's prefix while its lease is fresh."""
    url = f"s3://{s3_server.bucket()}/run/step-1"
    local = muonckpt.save(single_process_optimizer(1), tmp_path / "local")
    muonckpt.save(single_process_optimizer(1), url)
    manifest = S3Url.parse(url).child("manifest.json")
    etag = S3Client().head(manifest)
    _killed_writer(url, where)
    assert S3Client().head(manifest) == etag
    _same_checkpoint(local, _download(url, tmp_path / f"copy-{where}"))
    left = muonckpt.clean(str(S3Url.parse(url).parent), 0)
    assert left.removed == [] and "running" in left.skipped[0][1]


def test_a_writer_killed_mid_upload_leaves_the_old_checkpoint(
    s3_server: S3Server, tmp_path: Path
) -> None:
    _killed_trial(s3_server, tmp_path, "upload:1")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_a_writer_killed_at_seeded_points_leaves_the_old_checkpoint(
    s3_server: S3Server, tmp_path: Path, seed: int
) -> None:
    where = random.Random(seed).choice(["upload:1", "upload:2", "commit"])  # data, index
    _killed_trial(s3_server, tmp_path, where)


def _race(url: str) -> str:
    """Two saves of different states to ``url`` at once: exactly one commits, the other
    fails naming the target, and what is there is the winner's, whole. Returns the loser's
    error."""
    outcomes: list[object] = [None, None]
    optimizers = [single_process_optimizer(1), single_process_optimizer(2)]
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = muonckpt.save(optimizers[i], url)
        except CheckpointError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lost = [o for o in outcomes if isinstance(o, CheckpointError)]
    assert len(lost) == 1 and url in str(lost[0]), outcomes
    keys = _keys(url)
    assert len({k.split("/")[0] for k in keys if "/" in k}) == 1, keys  # the winner's alone
    return str(lost[0])


def test_two_writers_racing_one_target_one_commits(s3_server: S3Server, scratch: Path) -> None:
    bucket = s3_server.bucket()
    for trial in range(3):
        _race(f"s3://{bucket}/race-{trial}")
    assert _staged_in(scratch) == []


@pytest.mark.slow
def test_two_writers_racing_one_target_20_trials(s3_server: S3Server, scratch: Path) -> None:
    bucket = s3_server.bucket()
    lost = [_race(f"s3://{bucket}/race-{trial}") for trial in range(20)]
    assert any("first" in e for e in lost)  # (20 of 20 lost at the conditional commit, here)


def test_the_cli_rewrites_s3_to_s3_and_local_to_s3(
    s3_server: S3Server, tmp_path: Path, scratch: Path, single_ckpt
) -> None:
    """``muonckpt consolidate / reshard / convert --to torch`` with an ``s3://`` SRC (a plain
    object copy of a local checkpoint) and ``-o s3://``, and from a directory to S3: the same
    files as the same command between directories, each output verified where it is. A
    foreign format from or to S3 is refused, exit 2, nothing written."""
    bucket = s3_server.bucket()
    local_src = single_ckpt(2)
    upload(local_src, bucket, "src", s3_server.endpoint)
    commands = {
        "consolidated": ["consolidate"],
        "resharded": ["reshard", "--dp", "2", "--tp", "1"],
        "converted": ["convert", "--to", "torch"],
    }
    runner = CliRunner()
    for name, (command, *options) in commands.items():
        for src, dst in (
            (str(local_src), str(tmp_path / name)),
            (f"s3://{bucket}/src", f"s3://{bucket}/{name}"),
            (str(local_src), f"s3://{bucket}/{name}-up"),
        ):
            result = runner.invoke(app, [command, src, *options, "-o", dst])
            assert result.exit_code == 0, result.output
            assert f"wrote {dst}:" in " ".join(result.output.split())  # (wrapped at 80)
            assert muonckpt.verify(dst) == []
        for copy in (name, f"{name}-up"):
            down = _download(f"s3://{bucket}/{copy}", tmp_path / f"{copy}-copy")
            _same_checkpoint(tmp_path / name, down)
    result = runner.invoke(
        app, ["convert", f"s3://{bucket}/src", "--format", "dcp", "-o", f"s3://{bucket}/dcp"]
    )
    said = " ".join(result.output.split())
    assert (
        result.exit_code == 2 and "local directories" in said and "src to a directory first" in said
    ), said
    assert [k for k in _keys(f"s3://{bucket}") if k.startswith("dcp")] == []
    result = runner.invoke(
        app, ["convert", str(local_src), "--format", "dcp", "--to", "torchtitan", "-o", "s3://x/y"]
    )
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "takes a local directory only" in said, said
    assert _staged_in(scratch) == []


AT_EXIT = """
import sys
import muonckpt
from tests.fixture_model import single_process_optimizer
muonckpt.async_save(single_process_optimizer(3), sys.argv[1])
print("returned", flush=True)
"""


def test_an_async_save_to_s3_in_flight_at_the_end_of_a_script_is_finished(
    s3_server: S3Server,
) -> None:
    """A script that ends right after ``async_save`` to S3 returns at once and exits 0 once
    the save is committed, as for a directory."""
    url = f"s3://{s3_server.bucket()}/run/step-3"
    done = subprocess.run(
        [sys.executable, "-c", AT_EXIT, url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout == "returned\n", done.stderr[-2000:]
    assert muonckpt.verify(url) == [] and muonckpt.read_manifest(url).step == 3


def test_overwrite_replaces_only_a_muonckpt_manifest(s3_server: S3Server, scratch: Path) -> None:
    """``overwrite=True`` over an ``s3://`` prefix whose ``manifest.json`` another tool wrote
    (a JSON object that is no muonckpt manifest) is refused naming it; the object stays, and
    nothing of the save is left."""
    bucket = s3_server.bucket()
    url = f"s3://{bucket}/dataset"
    theirs = b'{"dataset": "shards", "files": 12}'
    S3Client().put(S3Url.parse(url).child("manifest.json"), theirs)
    with pytest.raises(CheckpointError, match="not a muonckpt manifest") as refused:
        muonckpt.save(single_process_optimizer(1), url, overwrite=True)
    assert url in str(refused.value) and "\n" not in str(refused.value)
    assert S3Client().get(S3Url.parse(url).child("manifest.json")) == theirs
    assert _keys(url) == ["manifest.json"] and _staged_in(scratch) == []
