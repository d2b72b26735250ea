"""moto's S3 server, as ``moto_server`` runs it (werkzeug, threaded), with one change: the
requests that carry a condition (``If-None-Match`` or ``If-Match`` on a PUT or POST: a
conditional PutObject or CompleteMultipartUpload) are handled one at a time.

moto checks a condition and then writes, with nothing held between: 16 threads racing
CompleteMultipartUpload with ``If-None-Match: *`` on one key saw 8 of them succeed
(moto 5.2.6). S3 itself makes the check and the write one atomic step, and that is what a
commit through S3 relies on; so the tests' server holds one lock across each conditional
write (``tests/test_s3_server.py`` shows the result atomic), while every other request,
uploads of parts included, stays concurrent.

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
from werkzeug.serving import run_simple

_CONDITIONAL = threading.Lock()


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
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, serialized(app), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
