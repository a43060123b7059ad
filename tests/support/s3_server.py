"""moto's S3 server with atomic conditional puts: `python -m tests.support.s3_server HOST PORT`.

moto checks a PUT's If-None-Match / If-Match and then writes, without a lock, on a threaded
server: two concurrent Delta commits of one version could both succeed (a loaded CI run
lost a commit that way), which S3 itself never allows. Conditional PUTs run one at a time
here; every other request as moto serves it.
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


class AtomicConditionalPuts:
    def __init__(self, app: Callable[..., Iterable[bytes]]):
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        conditional = environ.get("REQUEST_METHOD") == "PUT" and (
            "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ)
        if not conditional:
            return self.app(environ, start_response)
        with self.lock:  # the body is produced inside it: check and write are one step
            return list(self.app(environ, start_response))


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    run_simple(host, port, AtomicConditionalPuts(DomainDispatcherApplication(create_backend_app)),
               threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
