"""moto's S3 server, as ``moto_server`` runs it (werkzeug, threaded), with two changes that
make it behave as S3 does where the tests and ``benchmarks/bench_s3.py`` measure muonckpt:

1. The requests that carry a condition (``If-None-Match`` or ``If-Match`` on a PUT or POST: a
   conditional PutObject or CompleteMultipartUpload) are handled one at a time.
2. A GET reads only the bytes it answers with.

moto checks a condition and then writes, with nothing held between: 16 threads racing
CompleteMultipartUpload with ``If-None-Match: *`` on one key saw 8 of them succeed
(moto 5.2.6). S3 itself makes the check and the write one atomic step, and that is what a
commit through S3 relies on; so the tests' server holds one lock across each conditional
write (``tests/test_s3_server.py`` shows the result atomic), while every other request,
uploads of parts included, stays concurrent.

moto answers every GET from the whole object, read from its buffer, then sliced to the
range asked for: a ranged GET of 1 MiB took 6 ms from a 1 MiB object, 42 ms from a 64 MiB one
and 146 ms from a 256 MiB one (moto 5.2.6, 2 cores), so a reader of ranges paid for every
byte of every object it touched, once per request. Here, while moto handles a GET, an
object's bytes are a :class:`Window` that reads a slice from the buffer alone; the answer to
a GET without a range is the whole object, as before.

Usage: ``python -m tests.moto_serve HOST PORT``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from moto.s3.models import FakeKey
from moto.s3.responses import S3Response
from werkzeug.serving import run_simple

_CONDITIONAL = threading.Lock()
_IN_GET = threading.local()


class Window:
    """An object's bytes as a GET's answer takes them: its length, and any slice of it read
    from the object's buffer alone."""

    def __init__(self, key: Any) -> None:
        self._key = key

    def __len__(self) -> int:
        return int(self._key.size)

    def __getitem__(self, span: slice) -> bytes:
        start, stop, _ = span.indices(len(self))
        with self._key.lock:
            self._key._value_buffer.seek(start)
            return bytes(self._key._value_buffer.read(max(stop - start, 0)))


_WHOLE_VALUE = FakeKey.value


def _value(key: Any) -> Any:
    return Window(key) if getattr(_IN_GET, "on", False) else _WHOLE_VALUE.fget(key)


_KEY_RESPONSE = S3Response.key_response


def _key_response(self: Any, request: Any, full_url: str, headers: Any) -> Any:
    _IN_GET.on = request.method == "GET"
    try:
        status, answer_headers, body = _KEY_RESPONSE(self, request, full_url, headers)
    finally:
        _IN_GET.on = False
    return status, answer_headers, body[:] if isinstance(body, Window) else body


def read_only_what_is_answered() -> None:
    """Change 2: an object's bytes read as a GET answers them (see the module)."""
    FakeKey.value = property(_value, _WHOLE_VALUE.fset)  # type: ignore[method-assign]
    S3Response.key_response = _key_response  # type: ignore[method-assign]


def serialized(app: Any) -> Callable[[dict[str, Any], Any], Iterable[bytes]]:
    def wsgi(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        conditional = environ.get("REQUEST_METHOD") in ("PUT", "POST") and (
            "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ
        )
        if not conditional:
            return app(environ, start_response)  # type: ignore[no-any-return]
        with _CONDITIONAL:
            return list(app(environ, start_response))

    return wsgi


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    read_only_what_is_answered()
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, serialized(app), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
