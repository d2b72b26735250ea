"""What the adversarial pass over the S3 paths of issue 52 found (its scripts and counts:
docs/reliability.md), each as a test against the real server:

* ``clean`` deleted a user's objects that merely looked like a save prefix
  (``<root>/<dir>/s-<16 hex>/...``) where ``<dir>`` held no muonckpt checkpoint and the
  prefix no lease of muonckpt's: a look-alike name alone must never be enough, as for
  local directories.
* the answer to a conditional create (``If-None-Match: *``) of a save's own object lost (the
  server did it; the connection dropped before the client heard): the retry got 412 and the
  save failed, though the object was its own.
* an AWS configuration boto3 cannot make a client of (a profile that does not exist, an
  endpoint that is no URL) escaped as botocore's own exception (``load``, ``verify``,
  ``latest``, ``clean``) or as a save's "rank 0: ValueError ... (at endpoint.py:410 ...)".
"""

from __future__ import annotations

import os

import pytest

import muonckpt
from muonckpt.errors import CheckpointError
from muonckpt.storage import s3store
from muonckpt.storage.s3 import S3Client, S3Url

from .fixture_model import single_process_optimizer
from .s3_proxy import FaultProxy
from .s3_server import S3Server

pytestmark = pytest.mark.dist


def test_clean_keeps_look_alike_prefixes_that_are_not_muonckpts(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a root: a user's directory with an ``s-<16 hex>/`` folder (no manifest, no lease)
    and one beside a JSON ``manifest.json`` that is not muonckpt's: kept. A dead save's
    prefix (its lease stale) where no checkpoint was ever committed: removed."""
    monkeypatch.setattr(s3store, "LEASE_STALE_S", 0.0)  # (as if 120 s had passed)
    root = f"s3://{s3_server.bucket()}/run"
    client, base = S3Client(), S3Url.parse(root)
    users = [
        "userdir/s-0123456789abcdef/data.bin",
        "userdir2/manifest.json",
        "userdir2/s-fedcba9876543210/data.bin",
    ]
    for key in users:
        client.put(base.child(key), b'{"user": true}')
    dead = "step-1/s-00000000000000aa"
    client.put(base.child(f"{dead}/{s3store.LEASE}"), b"{}")
    client.put(base.child(f"{dead}/rank-00000-of-00001.safetensors"), b"left")
    cleaned = muonckpt.clean(root, 0)
    assert cleaned.removed == [base.child(dead)]
    assert sorted(client.listing(base)[0]) == sorted(users)
    assert {str(where) for where, _ in cleaned.skipped} == {
        f"{root}/userdir/s-0123456789abcdef",
        f"{root}/userdir2/s-fedcba9876543210",
    }


@pytest.mark.parametrize("lost", ["/.lease", ".safetensors", ".pieces.json"])
def test_a_lost_answer_to_creating_a_saves_own_object(
    s3_server: S3Server, s3_proxy: FaultProxy, lost: str
) -> None:
    """The PUT of the lease, of a data file or of a piece index reaches the server and its
    answer is lost: the retry's 412 is the save's own object (the same bytes), so the save
    commits, and loads back bitwise."""
    target = f"s3://{s3_server.bucket()}/step-1"
    saved = single_process_optimizer(2)
    s3_proxy.lose_answer_to = lost
    muonckpt.save(saved, target)
    assert s3_proxy.lose_answer_to is None  # the answer was lost once
    assert muonckpt.verify(target) == []
    loaded = single_process_optimizer(1)
    muonckpt.load(loaded, target)
    for a, b in zip(saved.param_groups, loaded.param_groups, strict=True):
        for p, q in zip(a["params"], b["params"], strict=True):
            assert p.equal(q)
            assert all(v.equal(loaded.state[q][k]) for k, v in saved.state[p].items())
    assert os.environ["AWS_ENDPOINT_URL"] == s3_proxy.endpoint


@pytest.mark.parametrize(
    ("variable", "value"), [("AWS_PROFILE", "no-such-profile"), ("AWS_ENDPOINT_URL", "not a url")]
)
def test_an_aws_configuration_without_a_client_is_one_line(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """A library error in one line naming the setting's problem, for every entry point."""
    target = f"s3://{s3_server.bucket()}/run/step-1"
    muonckpt.save(single_process_optimizer(1), target)
    monkeypatch.setenv(variable, value)
    calls = {
        "save": lambda: muonckpt.save(single_process_optimizer(1), target + "-new"),
        "load": lambda: muonckpt.load(single_process_optimizer(1), target),
        "latest": lambda: muonckpt.latest(target.rpartition("/")[0]),
        "clean": lambda: muonckpt.clean(target.rpartition("/")[0], 0),
    }
    for call in calls.values():
        with pytest.raises(CheckpointError, match="AWS configuration") as err:
            call()
        assert "\n" not in str(err.value) and value in str(err.value)
    problems = muonckpt.verify(target)
    assert len(problems) == 1 and "AWS configuration" in str(problems[0])
