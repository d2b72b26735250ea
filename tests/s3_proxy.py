"""A small HTTP proxy in front of the tests' S3 server that injects faults: the next N
requests answered ``503 SlowDown`` (as S3 throttles), connections dropped before an answer (a
reset mid-request), or a request matching a pattern forwarded and then its answer lost (the
server did it; the client never hears). moto keeps its objects in memory, so faults are made
here rather than by restarting the server.

It runs as a thread of the test process (no process of its own): each client connection is
read request by request (a request head, ``Expect: 100-continue`` answered, the body by its
``Content-Length``), each forwarded over a fresh ``http.client`` connection to the server and
its answer sent back."""

from __future__ import annotations

import http.client
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from .s3_server import S3Server

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_DROP_HEADERS = {"connection", "transfer-encoding", "keep-alive", "expect"}


@dataclass(frozen=True)
class Served:
    """A request the proxy forwarded: its method, target (path and query), ``Range`` header,
    ``User-Agent`` and the bytes of its answer's body."""

    method: str
    target: str
    range: str | None
    agent: str
    bytes: int


class FaultProxy:
    """Listens on 127.0.0.1 at a free port (:attr:`endpoint`), forwarding to ``upstream``
    (``http://host:port``)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.lock = threading.Lock()
        self.slow_downs = 0
        self.drops = 0
        self.requests = 0
        self.injected = 0
        self.down_until = 0.0
        """Until this time.monotonic(), every request's connection is closed unanswered once
        its request line is read (the server gone; not a refused connection)."""
        self.lose_answer_to: str | None = None
        """A request line containing this text is forwarded once, its answer never sent."""
        self.away_after_loss = 0.0
        """Seconds the server is away (:attr:`down_until`) once that answer was lost."""
        self.ignore_if_match_on_delete = False
        """Drop ``If-Match`` from every DELETE: a server that ignores conditional deletes."""
        self.log: list[Served] = []
        """Every request forwarded and answered, in order."""
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.rfile, self.connection)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def inject(self, *, slow_downs: int = 0, drops: int = 0) -> None:
        """The next ``slow_downs`` requests answered 503 SlowDown, then the next ``drops``
        dropped (the connection closed once the request was read)."""
        with self.lock:
            self.slow_downs, self.drops = slow_downs, drops

    def _fault(self) -> str | None:
        with self.lock:
            self.requests += 1
            if self.slow_downs:
                self.slow_downs -= 1
                self.injected += 1
                return "slow down"
            if self.drops:
                self.drops -= 1
                self.injected += 1
                return "drop"
        return None

    def _serve(self, rfile: Any, connection: socket.socket) -> None:
        while True:
            line = rfile.readline(65537)
            if not line.strip():
                return
            if time.monotonic() < self.down_until:  # (a kept-alive connection too)
                with self.lock:
                    self.injected += 1
                return  # closed unanswered
            method, target, _ = line.decode("latin-1").split(" ", 2)
            headers: list[tuple[str, str]] = []
            while (raw := rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
                name, _, value = raw.decode("latin-1").partition(":")
                headers.append((name.strip(), value.strip()))
            if method == "DELETE" and self.ignore_if_match_on_delete:
                headers = [(k, v) for k, v in headers if k.lower() != "if-match"]
            lower = {k.lower(): v for k, v in headers}
            if lower.get("expect", "").lower() == "100-continue":
                connection.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = rfile.read(int(lower.get("content-length", "0") or 0))
            fault = self._fault()
            lose = self.lose_answer_to
            if lose is not None and lose in line.decode("latin-1"):
                self.lose_answer_to = None
                self._forward(method, target, headers, body)
                self.down_until = time.monotonic() + self.away_after_loss
                connection.close()
                return
            if fault == "drop":
                connection.close()
                return
            if fault == "slow down":
                self._answer(connection, 503, [("Content-Type", "application/xml")], SLOW_DOWN)
                continue
            status, answer, data = self._forward(method, target, headers, body)
            served = Served(
                method, target, lower.get("range"), lower.get("user-agent", ""), len(data)
            )
            with self.lock:
                self.log.append(served)
            if method == "HEAD":
                connection.sendall(_head(status, answer))
            else:
                self._answer(connection, status, answer, data)

    def _forward(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        upstream = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            upstream.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() not in _DROP_HEADERS:
                    upstream.putheader(name, value)
            upstream.endheaders(body if body else None)
            response = upstream.getresponse()
            data = response.read()
            kept = [(k, v) for k, v in response.getheaders() if k.lower() not in _DROP_HEADERS]
            return response.status, kept, data
        finally:
            upstream.close()

    def _answer(
        self,
        connection: socket.socket,
        status: int,
        headers: list[tuple[str, str]],
        data: bytes,
    ) -> None:
        kept = [(k, v) for k, v in headers if k.lower() != "content-length"]
        connection.sendall(_head(status, [*kept, ("Content-Length", str(len(data)))]) + data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _head(status: int, headers: list[tuple[str, str]]) -> bytes:
    reason = http.client.responses.get(status, "Unknown")
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers), "", ""]
    return "\r\n".join(lines).encode("latin-1")


@pytest.fixture
def s3_proxy(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A fault proxy in front of the session's server, which logs every request; every
    request of the test (and of its children) goes through it (``AWS_ENDPOINT_URL``)."""
    through = FaultProxy(s3_server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", through.endpoint)
    try:
        yield through
    finally:
        through.close()
