"""ClickHouse's HTTP interface in front of chdb, so clickhouse-connect runs against the real engine.

No ClickHouse server runs here, and chdb (ClickHouse's engine as a library) has no HTTP listener.
This is the thinnest adapter that keeps the client honest: clickhouse-connect's own code builds
each request (query text with ``FORMAT``, ``param_*`` values for server-side binding, the
``database`` and settings as URL parameters, Arrow bodies for inserts) and parses each answer
(TabSeparated, Native, Arrow) exactly as from a server; the adapter hands the SQL to chdb and
returns chdb's bytes in the format the query names. Not exercised through it: a real server's
authentication (not checked here), HTTP compression (answers go back uncompressed, which the
client accepts), the HTTP handler's own settings (``wait_end_of_query``, …: ignored), sessions.
The engine's settings (``max_execution_time``) are applied in chdb.
"""

from __future__ import annotations

import re
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

# URL parameters clickhouse-connect sends that are not engine settings: the request's own, and
# the HTTP handler's (a server applies those to the HTTP exchange; the adapter has none to tune).
_NOT_SETTINGS = {"query_id", "database", "query", "session_id", "session_timeout",
                 "default_format", "user", "password", "wait_end_of_query", "buffer_size",
                 "compress", "decompress", "enable_http_compression",
                 "send_progress_in_http_headers", "http_headers_progress_interval_ms",
                 "cancel_http_readonly_queries_on_client_close"}
_FORMAT = re.compile(r"\s+FORMAT\s+(\w+)\s*;?\s*$", re.I)
_INSERT = re.compile(r"^\s*INSERT\s+INTO\s+(.+?)\s+FORMAT\s+(\w+)\s*$", re.I | re.S)


class ChdbHttp:
    """Serve ClickHouse's HTTP interface on 127.0.0.1 for the chdb data folder ``folder``."""

    def __init__(self, folder: str | Path) -> None:
        from chdb import session

        self._session = session.Session(str(folder))
        self._lock = threading.Lock()
        adapter = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                params = dict(parse_qsl(urlsplit(self.path).query, keep_blank_values=True))
                status, payload = adapter.answer(params, body)
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.send_header("X-ClickHouse-Timezone", "UTC")
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST

            def log_message(self, *args: Any) -> None:
                return None

        self._server = HTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def start(self) -> ChdbHttp:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._session.close()

    def answer(self, params: dict[str, str], body: bytes) -> tuple[int, bytes]:
        """Run one request's SQL in chdb; (HTTP status, response body)."""
        sql = params.get("query", "")
        data = b""
        if sql:
            data = body  # an INSERT's rows follow in the body
        else:
            sql = body.decode()
        bound = {k[len("param_"):]: v for k, v in params.items() if k.startswith("param_")}
        settings = {k: v for k, v in params.items()
                    if k not in _NOT_SETTINGS and not k.startswith("param_")}
        try:
            with self._lock:
                if "database" in params:
                    self._session.query(f"USE `{params['database']}`")
                for name, value in settings.items():
                    if re.fullmatch(r"\w+", name) and re.fullmatch(r"[\w.]+", value):
                        self._session.query(f"SET {name} = '{value}'")
                insert = _INSERT.match(sql)
                if insert:
                    return 200, self._insert(insert.group(1), insert.group(2), data)
                found = _FORMAT.search(sql)
                fmt = found.group(1) if found else params.get("default_format", "TabSeparated")
                text = _FORMAT.sub("", sql)
                result = self._session.query(text, fmt, params=bound)
                return 200, result.bytes()
        except Exception as exc:  # the server's way: status 500 and the exception's text
            return 500, str(exc).encode()

    def _insert(self, target: str, fmt: str, data: bytes) -> bytes:
        with tempfile.TemporaryDirectory(prefix="chdb-http-") as folder:
            path = Path(folder) / "rows"
            path.write_bytes(data)
            self._session.query(f"INSERT INTO {target} SELECT * FROM file('{path}', {fmt})")
        return b""
