"""Read deadlines for the dashboard's WSGI server: no client holds a connection for ever.

Werkzeug's threaded server gives every connection a thread that waits on the socket without a
limit, so clients holding partial requests (or idle keep-alive connections) each kept a thread
and a buffer indefinitely. :class:`DeadlineRequestHandler` puts a timeout on every read of the
socket (an idle or stalled connection is closed after :data:`BODY_READ_TIMEOUT_S`), and
:class:`BodyDeadline` reads a request's body before the application sees it, within the same
time in all (a client trickling one byte at a time cannot stretch it) and within
:data:`MAX_BODY_BYTES`, answering 408 or 413 instead.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from typing import Any

from werkzeug.serving import WSGIRequestHandler

from kvscope.serving import BODY_READ_TIMEOUT_S

# The dashboard's requests are callback payloads of a few KiB; nothing it serves needs more.
MAX_BODY_BYTES = 4 * 1024 * 1024
_CHUNK = 64 * 1024

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class DeadlineRequestHandler(WSGIRequestHandler):
    """Werkzeug's request handler with a timeout on every socket read."""

    # socketserver.StreamRequestHandler applies it to the connection in setup().
    timeout = BODY_READ_TIMEOUT_S


def _answer(start_response: StartResponse, status: str, text: str) -> list[bytes]:
    body = f"{text}\n".encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                            ("Content-Length", str(len(body))), ("Connection", "close")])
    return [body]


class BodyDeadline:
    """WSGI middleware: the body is read within the deadline and the size limit, or refused."""

    def __init__(self, app: WsgiApp) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: StartResponse
                 ) -> Iterable[bytes]:
        raw = environ.get("CONTENT_LENGTH") or ""
        length = int(raw) if raw.isdigit() else 0
        if length > MAX_BODY_BYTES:
            return _answer(start_response, "413 Content Too Large",
                           f"request body over {MAX_BODY_BYTES} bytes")
        if length:
            stream = environ["wsgi.input"]
            # read1: one socket read at a time (read(n) would wait for all n bytes, however
            # slowly they came, and never look at the deadline).
            read = getattr(stream, "read1", stream.read)
            deadline = time.monotonic() + BODY_READ_TIMEOUT_S
            chunks: list[bytes] = []
            got = 0
            try:
                while got < length:
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    chunk = read(min(_CHUNK, length - got))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    got += len(chunk)
            except OSError:  # TimeoutError included: the handler's socket timeout
                return _answer(start_response, "408 Request Timeout",
                               f"request body not received within {BODY_READ_TIMEOUT_S:g} s")
            environ["wsgi.input"] = io.BytesIO(b"".join(chunks))
        return self.app(environ, start_response)


__all__ = ["BODY_READ_TIMEOUT_S", "MAX_BODY_BYTES", "BodyDeadline", "DeadlineRequestHandler"]
