"""The commit protocol on S3 at the store (storage/s3store.py), against the real server:
staged files uploaded under a save prefix of their own, the manifest committed by one
conditional PutObject, exactly one of racing writers committing (the others' objects removed,
the winner's kept), an overwrite deleting the old objects only after its commit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from muonckpt.errors import CheckpointError
from muonckpt.storage.s3 import S3Client, S3Url
from muonckpt.storage.s3store import S3Store, _save_prefix_of, data_prefix_of, with_data_prefix

from .s3_server import S3Server

pytestmark = pytest.mark.dist

DATA = "rank-00000-of-00001.safetensors"


@pytest.fixture
def manifest(single_ckpt) -> str:
    """A real checkpoint's manifest (naming ``DATA``): what a save stages, and an overwrite
    replaces only when it is one."""
    return (single_ckpt(1) / "manifest.json").read_text()


def _stage(store: S3Store, target: str, overwrite: bool, payload: bytes, manifest: str) -> Path:
    staging = store.create_staging(target, overwrite)
    (staging / DATA).write_bytes(payload)
    store.put_text(staging / "manifest.json", manifest)
    return staging


def _objects(client: S3Client, target: str) -> list[str]:
    return client.listing(S3Url.parse(target))[0]


def _manifest(client: S3Client, target: str) -> str:
    raw = client.get(S3Url.parse(target).child("manifest.json"))
    assert raw is not None
    return raw.decode()


def test_publish_then_overwrite(s3_server: S3Server, manifest: str) -> None:
    client = S3Client()
    target = f"s3://{s3_server.bucket()}/runs/step-1"
    store = S3Store(client)
    staging = _stage(store, target, False, b"first", manifest)
    assert store.publish(staging, target, files={DATA: 5}) is None
    assert not staging.exists()
    first = data_prefix_of(_manifest(client, target))
    assert first is not None and first.startswith("s-")
    assert _objects(client, target) == sorted(["manifest.json", first + DATA])
    assert client.get(S3Url.parse(target).child(first + DATA)) == b"first"
    with pytest.raises(CheckpointError, match="overwrite=True"):
        store.create_staging(target, False)
    assert _objects(client, target) == sorted(["manifest.json", first + DATA])  # nothing made
    staging = _stage(store, target, True, b"second", manifest)
    store.publish(staging, target, files={DATA: 6})
    second = data_prefix_of(_manifest(client, target))
    assert second not in (None, first)
    assert _objects(client, target) == sorted(["manifest.json", f"{second}{DATA}"])
    assert store.directories(f"s3://{S3Url.parse(target).bucket}/runs") == ["step-1"]
    assert store.remove_checkpoint(target)
    assert _objects(client, target) == []


def test_a_discarded_save_leaves_nothing(s3_server: S3Server, manifest: str) -> None:
    client = S3Client()
    target = f"s3://{s3_server.bucket()}/step-1"
    store = S3Store(client)
    staging = _stage(store, target, False, b"x", manifest)
    assert len(_objects(client, target)) == 1  # its lease
    store.discard(staging)
    assert _objects(client, target) == [] and not staging.exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_racing_writers_one_commits(s3_server: S3Server, overwrite: bool, manifest: str) -> None:
    """8 writers stage the same target at once (each reads the same state: no checkpoint, or
    the same old one) and publish: exactly one commits; every other fails naming the target,
    and only the winner's objects (and nothing of the old checkpoint) remain."""
    client = S3Client()
    target = f"s3://{s3_server.bucket()}/step-7"
    if overwrite:
        store = S3Store(client)
        store.publish(_stage(store, target, False, b"old", manifest), target)
    writers = 8
    stores = [S3Store(S3Client()) for _ in range(writers)]
    stagings = [
        _stage(s, target, overwrite, f"writer {i}".encode(), manifest) for i, s in enumerate(stores)
    ]
    barrier = threading.Barrier(writers)
    outcomes: list[str] = [""] * writers

    def run(i: int) -> None:
        barrier.wait()
        try:
            stores[i].publish(stagings[i], target)
            outcomes[i] = "committed"
        except CheckpointError as exc:
            assert target in str(exc) and "first" in str(exc)
            outcomes[i] = "lost"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["committed"] + ["lost"] * (writers - 1)
    winner = outcomes.index("committed")
    prefix = data_prefix_of(_manifest(client, target))
    assert _objects(client, target) == sorted(["manifest.json", f"{prefix}{DATA}"])
    got = client.get(S3Url.parse(target).child(f"{prefix}{DATA}"))
    assert got == f"writer {winner}".encode()
    assert all(not s.exists() for s in stagings)


def test_a_saved_checkpoint_committed_to_s3_reads_back_bitwise(
    s3_server: S3Server, single_ckpt
) -> None:
    """What a real save wrote (muonckpt.save, locally: the entry points do not take URLs yet)
    staged into the S3 store and published: every object the manifest names is read back
    through the read seam (ranged GETs, pinned etags) bitwise as the local file."""
    from muonckpt.storage import SafetensorsReader
    from muonckpt.storage.byte_source import ObjectSource

    local = single_ckpt(2)
    client = S3Client()
    target = f"s3://{s3_server.bucket()}/run/step-2"
    store = S3Store(client)
    staging = store.create_staging(target, False)
    names = sorted(p.name for p in local.iterdir())
    for name in names:
        (staging / name).write_bytes((local / name).read_bytes())
    store.publish(staging, target)
    manifest = _manifest(client, target)
    prefix = data_prefix_of(manifest)
    assert prefix is not None
    assert json.loads(manifest)["files"]
    ckpt = S3Url.parse(target)
    assert _objects(client, target) == sorted(
        ["manifest.json"] + [prefix + n for n in names if n != "manifest.json"]
    )
    tensors = 0
    for name in (n for n in names if n.endswith(".safetensors")):
        url = ckpt.child(prefix + name)
        with (
            SafetensorsReader(local / name) as disk,
            SafetensorsReader(str(url), source=ObjectSource(client, url)) as obj,
        ):
            assert obj.keys() == disk.keys() and obj.metadata == disk.metadata
            for key in disk.keys():  # noqa: SIM118 (a reader, not a dict)
                a, b = obj.read_tensor(key), disk.read_tensor(key)
                assert a.dtype == b.dtype and torch.equal(
                    a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)
                )
                tensors += 1
    for name in (n for n in names if not n.endswith(".safetensors") and n != "manifest.json"):
        assert client.get(ckpt.child(prefix + name)) == (local / name).read_bytes()
    assert manifest == with_data_prefix((local / "manifest.json").read_text(), prefix)
    assert tensors > 0


def test_a_plain_object_copy_down_loads_and_verifies(
    s3_server: S3Server, single_ckpt, tmp_path: Path
) -> None:
    """A checkpoint committed to S3, copied down object by object (what ``aws s3 sync`` does:
    manifest.json and the save prefix's subdirectory), verifies and loads locally, bitwise as
    the checkpoint it came from; the save prefix is read from the manifest."""
    import muonckpt

    from .fixture_model import build, initial_params, single_process_optimizer

    local = single_ckpt(2)
    client = S3Client()
    bucket = s3_server.bucket()
    target = f"s3://{bucket}/run/step-2"
    store = S3Store(client)
    staging = store.create_staging(target, False)
    for p in local.iterdir():
        (staging / p.name).write_bytes(p.read_bytes())
    store.publish(staging, target)
    copy = tmp_path / "step-2"
    for key in _objects(client, target):
        (copy / key).parent.mkdir(parents=True, exist_ok=True)
        (copy / key).write_bytes(client.get(S3Url.parse(target).child(key)) or b"")
    assert muonckpt.verify(copy) == []
    opt = single_process_optimizer(2)
    fresh, _, _, _ = build(1, 1, initial_params())
    muonckpt.load(fresh, copy)
    flat = [p for g in opt.param_groups for p in g["params"]]
    for p, q in zip(flat, [p for g in fresh.param_groups for p in g["params"]]):
        assert opt.state[p].keys() == fresh.state[q].keys()
        assert all(torch.equal(opt.state[p][k], fresh.state[q][k]) for k in opt.state[p])
    (copy / "s-0000000000000000").mkdir()  # another save's leftovers: reported
    assert [str(e) for e in muonckpt.verify(copy)] == [
        f"unknown file in the checkpoint directory (file {copy / 's-0000000000000000'})"
    ]


def test_a_data_file_is_uploaded_while_it_is_written(s3_server: S3Server) -> None:
    """A file written into a rank's scratch directory is uploaded as its writer passes each
    part (:class:`~muonckpt.storage.streamed_upload.StreamedUpload`): parts go up before the
    writer has finished, the object holds the file's bytes, and ``send`` only waits for it. A
    writer that gives up leaves no object and no multipart upload (no billable parts)."""
    from muonckpt.storage import SafetensorsWriter
    from muonckpt.storage.s3 import TransferSettings

    client = S3Client(TransferSettings(part_size=5 << 20, concurrency=2))
    target = f"s3://{s3_server.bucket()}/runs/step-1"
    store = S3Store(client)
    root = store.create_staging(target, False)
    mine = store.join_staging(str(root), 1, target)
    saved = S3Url.parse(target).child(_save_prefix_of(root).rstrip("/"))
    tensors = {f"t{i}": torch.full((3 << 20,), float(i)) for i in range(3)}  # 12 MiB each
    specs = {key: ("F32", tuple(t.shape)) for key, t in tensors.items()}
    with SafetensorsWriter(mine / "kept.safetensors", specs, follow=store.follow) as out:
        out.write("t0", tensors["t0"])
        out.write("t1", tensors["t1"])
        deadline = time.monotonic() + 30
        while not client.uploads(saved) and time.monotonic() < deadline:
            time.sleep(0.05)  # the upload started before the last tensor was written
        assert client.uploads(saved)
        out.write("t2", tensors["t2"])
        out.commit()
    size = out.size
    with SafetensorsWriter(mine / "dropped.safetensors", specs, follow=store.follow) as out:
        out.write("t0", tensors["t0"])
        out.write("t1", tensors["t1"])  # then given up: the with block ends uncommitted
    store.send(mine, target)
    assert not mine.exists()
    kept = client.get(saved.child("kept.safetensors"))
    assert kept is not None and len(kept) == size
    assert torch.equal(safetensors.torch.load(kept)["t2"], tensors["t2"])
    assert client.head(saved.child("dropped.safetensors")) is None
    assert client.uploads(saved) == []
    store.discard(root)


def test_a_killed_ranks_scratch_directory_is_removed_by_the_next_save_on_its_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank killed mid-save leaves its scratch directory (``$TMPDIR/muonckpt-s3-*/rank-*``)
    with the files it wrote; the next save on the host removes it, for its lease is no longer
    held. A live rank's directory, a look-alike directory without a lease muonckpt wrote, and
    a directory with a stale lease that a symlink planted in $TMPDIR points to, are kept."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    target = "s3://bucket/runs/step-1"
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal; from muonckpt.storage.s3store import S3Store\n"
            f"d = S3Store().join_staging({str(tmp_path / ('muonckpt-s3-' + '1' * 16))!r}, 3, "
            f"{target!r})\n"
            "(d / 'rank-00003-of-00004.safetensors').write_bytes(b'x' * 100)\n"
            "os.kill(os.getpid(), signal.SIGKILL)",
        ],
        env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.getcwd()},
        timeout=60,
    )
    assert killed.returncode == -signal.SIGKILL
    dead = tmp_path / f"muonckpt-s3-{'1' * 16}" / "rank-00003"
    assert (dead / "rank-00003-of-00004.safetensors").exists()
    alike = tmp_path / f"muonckpt-s3-{'2' * 16}" / "rank-00000"
    alike.mkdir(parents=True)
    (alike / "notes.txt").write_text("mine")
    elsewhere = tmp_path / "elsewhere"  # a directory with a lease nobody holds, linked to
    elsewhere.mkdir()
    (elsewhere / "precious.bin").write_bytes(b"data")
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from muonckpt.storage import lease; lease.take({str(elsewhere)!r}, 'x')",
        ],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        check=True,
        timeout=60,
    )
    (alike.parent / "rank-00001").symlink_to(elsewhere)  # planted in a shared $TMPDIR
    joining = tmp_path / f"muonckpt-s3-{'6' * 16}" / "rank-00002"
    joining.mkdir(parents=True)  # a rank of a live save between its mkdir and its lease
    (tmp_path / f"muonckpt-s3-{'5' * 16}").symlink_to(elsewhere)
    store = S3Store()
    live = store.join_staging(str(tmp_path / f"muonckpt-s3-{'3' * 16}"), 0, target)
    other = S3Store().join_staging(str(tmp_path / f"muonckpt-s3-{'4' * 16}"), 1, target)
    assert not dead.parent.exists()
    assert (alike / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in elsewhere.iterdir()) == [".muonckpt-lease", "precious.bin"]
    assert joining.is_dir()  # (the smoke benchmark's 4 ranks on one host raced so)
    assert live.is_dir() and other.is_dir()  # the first's lease is held: not swept by the second


def test_a_rank_uploads_one_file_at_a_time(s3_server: S3Server) -> None:
    """A rank writing several files faster than the network takes them holds at most one
    upload's parts in flight (``concurrency``): memory part size x (concurrency + 1), not
    that per file written."""
    from muonckpt.storage import SafetensorsWriter
    from muonckpt.storage.s3 import TransferSettings

    client = S3Client(TransferSettings(part_size=5 << 20, concurrency=2))
    target = f"s3://{s3_server.bucket()}/runs/step-1"
    store = S3Store(client)
    root = store.create_staging(target, False)
    mine = store.join_staging(str(root), 0, target)
    lock, now, peak = threading.Lock(), [0], [0]
    send_part = client._client.upload_part  # the real request, counted around

    def counted(**request: object) -> object:
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.2)  # a network slower than the writer
        try:
            return send_part(**request)
        finally:
            with lock:
                now[0] -= 1

    client._client.upload_part = counted
    tensor = torch.randn(4 << 20)  # 16 MiB a file: 4 parts
    for i in range(3):
        spec = {"t": ("F32", (4 << 20,))}
        with SafetensorsWriter(mine / f"f{i}.safetensors", spec, follow=store.follow) as out:
            out.write("t", tensor)
            out.commit()
    store.send(mine, target)
    assert peak[0] == 2, peak  # the upload's own concurrency, never several uploads' at once
    saved = S3Url.parse(target).child(_save_prefix_of(mine).rstrip("/"))
    assert sorted(client.listing(saved)[0]) == [
        ".lease",
        "f0.safetensors",
        "f1.safetensors",
        "f2.safetensors",
    ]
    store.discard(root)
