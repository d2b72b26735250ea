"""A real S3-compatible server for the tests: moto's server mode, started as a process of its
own on 127.0.0.1 at a free port once per test session and killed at its end. It is
``moto_server`` with its conditional writes made atomic, as S3's are (:mod:`tests.moto_serve`
says why).

The client is the real one (boto3), pointed at the server through the standard AWS
environment: dummy credentials, a region and ``AWS_ENDPOINT_URL``, set for the session (so a
muonckpt call and a subprocess of a test find the server the way a user's job finds S3).
A test asks for the fixture ``s3_server`` (``tests/conftest.py`` imports it) and is marked
``dist`` (starting the server starts a process). Without ``boto3`` and ``moto[server]`` (the
``s3`` and ``test`` extras), those tests are skipped.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "muonckpt-test",
    "AWS_SECRET_ACCESS_KEY": "muonckpt-test",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # No ~/.aws of the machine's user is read.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass(frozen=True)
class S3Server:
    """The running server: its endpoint URL and process."""

    endpoint: str
    process: subprocess.Popen[bytes]

    def client(self, **config: Any) -> Any:
        """A new boto3 client for the server (``config``: botocore ``Config`` keywords)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, config=Config(**config))

    def bucket(self) -> str:
        """A new empty bucket of its own for one test."""
        name = f"t-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _serving(endpoint: str, process: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1),
        ):
            return True
        time.sleep(0.1)
    return False


def _start(tries: int = 3) -> S3Server:
    for _ in range(tries):
        port = _free_port()  # another process may take it meanwhile: then try another
        endpoint = f"http://127.0.0.1:{port}"
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.moto_serve", "127.0.0.1", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **ENVIRONMENT},
            cwd=REPO,
        )
        if _serving(endpoint, process, timeout=30.0):
            return S3Server(endpoint, process)
        _stop(process)
    raise RuntimeError(f"moto_server did not start on 127.0.0.1 in {tries} tries")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session's S3 server, with the AWS environment pointing at it while it runs."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    server = _start()
    saved = {k: os.environ.get(k) for k in [*ENVIRONMENT, "AWS_ENDPOINT_URL"]}
    os.environ.update(ENVIRONMENT, AWS_ENDPOINT_URL=server.endpoint)
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _stop(server.process)
