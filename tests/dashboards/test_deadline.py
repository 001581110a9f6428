"""The dashboard's server reads every request within a deadline (issue 22: body-read timeouts).

Werkzeug's threaded server once kept a thread per connection waiting for ever on a client that
sent part of a request. Real server on 127.0.0.1, raw sockets for the partial requests.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscope.dashboards import deadline
from kvscope.dashboards.app import DashboardServer, create_app
from kvscope.store.database import open_store
from tests.raw_http import partial_body_answer, post_head

_PAGE_CALLBACK = json.dumps({
    "output": "page.children", "outputs": {"id": "page", "property": "children"},
    "inputs": [{"id": "url", "property": "pathname", "value": "/"}],
    "state": [{"id": "url", "property": "search", "value": ""}],
    "changedPropIds": ["url.pathname"],
}).encode()


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DashboardServer]:
    monkeypatch.setattr(deadline, "BODY_READ_TIMEOUT_S", 0.6)
    monkeypatch.setattr(deadline.DeadlineRequestHandler, "timeout", 0.4)
    db = tmp_path / "empty.duckdb"
    open_store(db).close()
    with DashboardServer(create_app(db), "127.0.0.1", 0) as running:
        yield running


def _post_head(length: int) -> bytes:
    return post_head("/_dash-update-component", length)


def _answer(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_a_callback_body_sent_in_parts_still_arrives_whole(server: DashboardServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        half = len(_PAGE_CALLBACK) // 2
        sock.sendall(_post_head(len(_PAGE_CALLBACK)) + _PAGE_CALLBACK[:half])
        time.sleep(0.2)
        sock.sendall(_PAGE_CALLBACK[half:])
        assert _answer(sock).startswith(b"HTTP/1.1 200")


def test_a_client_holding_a_partial_body_gets_408(server: DashboardServer) -> None:
    answer = partial_body_answer("127.0.0.1", server.port, "/_dash-update-component")
    assert answer.startswith(b"HTTP/1.1 408")


def test_a_body_trickled_byte_by_byte_gets_408_at_the_deadline(
        server: DashboardServer) -> None:
    # Each byte arrives within the socket timeout; the whole body does not within the deadline.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_post_head(1000))
        start = time.monotonic()
        sock.settimeout(0.15)
        ended: bytes | None = None
        while time.monotonic() - start < 10:
            try:
                sock.sendall(b" ")
                ended = sock.recv(4096)
            except TimeoutError:
                continue
            except ConnectionError:  # bytes sent after the answer make the close a reset
                ended = b"reset"
            break
        elapsed = time.monotonic() - start
        assert ended is not None, "the server kept reading a trickled body for 10 s"
        assert ended in (b"", b"reset") or ended.startswith(b"HTTP/1.1 408"), ended[:80]
        assert elapsed < 5


def test_an_oversized_body_is_413_before_it_is_read(server: DashboardServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_post_head(deadline.MAX_BODY_BYTES + 1))
        assert _answer(sock).startswith(b"HTTP/1.1 413")


def test_a_partial_request_line_is_dropped(server: DashboardServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /_dash-lay")
        sock.settimeout(10)
        assert sock.recv(4096) == b""  # closed by the server after the socket timeout


def _chunked_head() -> bytes:
    return (b"POST /_dash-update-component HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_a_chunked_callback_body_arrives_whole(server: DashboardServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        half = len(_PAGE_CALLBACK) // 2
        sock.sendall(_chunked_head() + _chunk(_PAGE_CALLBACK[:half])
                     + _chunk(_PAGE_CALLBACK[half:]) + b"0\r\n\r\n")
        assert _answer(sock).startswith(b"HTTP/1.1 200")


def test_a_chunked_body_past_the_limit_is_413(server: DashboardServer) -> None:
    # Once passed on unread (the limit looked only at Content-Length): 400 MiB took 800 MB.
    piece = _chunk(b"x" * (1 << 20))
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_chunked_head())
        sent = 0
        try:
            while sent <= deadline.MAX_BODY_BYTES + (1 << 20):
                sock.sendall(piece)
                sent += 1 << 20
            sock.sendall(b"0\r\n\r\n")
        except ConnectionError:
            pass  # answered and closed while we still sent
        assert _answer(sock).startswith(b"HTTP/1.1 413")


def test_a_chunked_trickle_gets_408_at_the_deadline(server: DashboardServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_chunked_head())
        start = time.monotonic()
        sock.settimeout(0.15)
        ended: bytes | None = None
        while time.monotonic() - start < 10:
            try:
                sock.sendall(_chunk(b" "))
                ended = sock.recv(4096)
            except TimeoutError:
                continue
            except ConnectionError:
                ended = b"reset"
            break
        assert ended is not None, "the server kept reading a trickled chunked body for 10 s"
        assert ended in (b"", b"reset") or ended.startswith(b"HTTP/1.1 408"), ended[:80]
        assert time.monotonic() - start < 5
