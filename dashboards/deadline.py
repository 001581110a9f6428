"""Read deadlines for the dashboard's WSGI server: no client holds a connection for ever.

Werkzeug's threaded server gives every connection a thread that waits on the socket without a
limit, so clients holding partial requests (or idle keep-alive connections) each kept a thread
and a buffer indefinitely. :class:`DeadlineRequestHandler` puts a timeout on every read of the
socket (an idle or stalled connection is closed after :data:`BODY_READ_TIMEOUT_S`), and
:class:`BodyDeadline` reads a request's body before the application sees it, within the same
time in all (a client trickling one byte at a time cannot stretch it) and within
:data:`MAX_BODY_BYTES`, answering 408 or 413 instead; a chunked body too.
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
# A chunk's size line (hex size and extensions) and the trailers after the last chunk.
_CHUNK_HEADER_BYTES = 1024
_MAX_TRAILER_LINES = 64

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
        def too_large() -> list[bytes]:
            return _answer(start_response, "413 Content Too Large",
                           f"request body over {MAX_BODY_BYTES} bytes")

        raw = environ.get("CONTENT_LENGTH") or ""
        length = int(raw) if raw.isdigit() else 0
        # A chunked body announces no length (werkzeug dechunks it and marks the input
        # terminated): it is read to its end under the same deadline and limit. Once it was
        # passed on unread: a 400 MiB chunked POST took 800 MB, a chunked trickle held a
        # connection past 100 s.
        chunked = bool(environ.get("wsgi.input_terminated")) or "chunked" in str(
            environ.get("HTTP_TRANSFER_ENCODING", "")).lower()
        if length > MAX_BODY_BYTES:
            return too_large()
        if length or chunked:
            stream = environ["wsgi.input"]
            deadline = time.monotonic() + BODY_READ_TIMEOUT_S
            try:
                if chunked:
                    # werkzeug's dechunker fills its whole buffer before it returns, so a
                    # trickle of one-byte chunks never reached a deadline check: the chunks
                    # are read here from the connection, one socket read at a time.
                    body = _dechunked(getattr(stream, "_rfile", stream), deadline)
                else:
                    body = _read_until(stream, length, deadline)
            except OSError:  # TimeoutError included: the handler's socket timeout
                return _answer(start_response, "408 Request Timeout",
                               f"request body not received within {BODY_READ_TIMEOUT_S:g} s")
            except ValueError:
                return _answer(start_response, "400 Bad Request", "malformed chunked body")
            if body is None:
                return too_large()
            environ["wsgi.input"] = io.BytesIO(body)
            if chunked:
                environ["CONTENT_LENGTH"] = str(len(body))
        return self.app(environ, start_response)


def _read_until(stream: Any, length: int, deadline: float) -> bytes:
    """Up to ``length`` bytes of ``stream`` (fewer at its end), TimeoutError past ``deadline``."""
    # read1: one socket read at a time (read(n) would wait for all n bytes, however slowly
    # they came, and never look at the deadline).
    read = getattr(stream, "read1", stream.read)
    chunks: list[bytes] = []
    got = 0
    while got < length:
        if time.monotonic() > deadline:
            raise TimeoutError
        chunk = read(min(_CHUNK, length - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _dechunked(rfile: Any, deadline: float) -> bytes | None:
    """A chunked body read from the connection's ``rfile`` within ``deadline``; None past
    :data:`MAX_BODY_BYTES`; ValueError for a malformed chunk header."""
    parts: list[bytes] = []
    got = 0
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError
        header = rfile.readline(_CHUNK_HEADER_BYTES)
        if not header.endswith(b"\n"):
            raise ValueError("chunk header cut short or too long")
        size = int(header.split(b";", 1)[0].strip(), 16)
        if size < 0:
            raise ValueError("negative chunk size")
        if size == 0:
            for _ in range(_MAX_TRAILER_LINES):  # trailers, up to the empty line
                if time.monotonic() > deadline:
                    raise TimeoutError
                if rfile.readline(_CHUNK_HEADER_BYTES).strip() == b"":
                    return b"".join(parts)
            raise ValueError("too many trailer lines")
        if got + size > MAX_BODY_BYTES:
            return None
        data = _read_until(rfile, size, deadline)
        if len(data) < size:
            raise ValueError("chunk cut short")
        parts.append(data)
        got += size
        if _read_until(rfile, 2, deadline) != b"\r\n":
            raise ValueError("chunk not followed by CRLF")


__all__ = ["BodyDeadline", "DeadlineRequestHandler", "MAX_BODY_BYTES", "StartResponse", "WsgiApp"]
