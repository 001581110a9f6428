"""The OTLP/HTTP receiver behind ``kvscope serve``: one process that owns a store file.

Engines, the proxy and samplers export OTLP/HTTP here (DuckDB allows one writer per file).
``POST /v1/traces`` and ``POST /v1/metrics`` follow the OTLP/HTTP specification: protobuf or
JSON bodies, gzip or identity encoding, responses in the request's encoding with
``partial_success`` when something was rejected, and a ``google.rpc.Status`` body on errors:

    400  malformed, truncated or wrongly typed payload (the message names the field)
    413  body larger than ``max_request_bytes`` (after decompression too: gzip bombs stop there),
         or one request holding more rows than the writer's whole queue
    415  content type other than application/x-protobuf / application/json, or an unsupported
         content encoding
    503  the store writer's queue is full (``Retry-After`` says when to try again)

A request is decoded completely before anything is queued, so a bad request never touches rows
already stored. Rows are acknowledged once queued; a clean stop (SIGINT/SIGTERM for
:func:`run_receiver`, :meth:`Receiver.stop`) stops accepting, lets in-flight requests finish,
writes everything acknowledged and closes the store. ``GET /health`` reports the counters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc import code_pb2, status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)

from kvscope import settings
from kvscope.collector.otlp_decode import (
    Encoding,
    decode_metrics_request,
    decode_trace_request,
)
from kvscope.errors import PayloadError
from kvscope.serving import bind, bound_port, close_all, stop_signals
from kvscope.store.database import begin_run, end_run, open_store
from kvscope.store.writer import StoreWriter

logger = logging.getLogger(__name__)

_CONTENT_TYPES: dict[str, Encoding] = {
    "application/x-protobuf": "protobuf",
    "application/json": "json",
}
_MEDIA_TYPES: dict[Encoding, str] = {v: k for k, v in _CONTENT_TYPES.items()}
_RETRY_AFTER_S = 1
_READ_CHUNK = 256 * 1024
# Decoding is CPU work under the GIL: one thread keeps the event loop answering (health, new
# requests) while a second would only contend with it; DuckDB's insert runs in parallel on the
# writer thread with the GIL released.
_DECODE_THREADS = 1


@dataclass
class ReceiverStats:
    """Counters of one receiver; ``GET /health`` reports them with the writer's."""

    requests: int = 0
    spans_accepted: int = 0
    spans_rejected: int = 0
    points_accepted: int = 0
    points_rejected: int = 0
    bad_requests: int = 0
    too_large: int = 0
    unsupported: int = 0
    busy: int = 0


class _Refused(Exception):
    """A request refused with an HTTP status and a reason for the client."""

    def __init__(self, status: int, message: str, code: int = code_pb2.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def _encode(message: Message, encoding: Encoding) -> bytes:
    if encoding == "json":
        return json.dumps(json_format.MessageToDict(message), separators=(",", ":")).encode()
    return message.SerializeToString()


def _status_response(refused: _Refused, encoding: Encoding) -> web.Response:
    status = status_pb2.Status(code=refused.code, message=refused.message)
    headers = {"Retry-After": str(_RETRY_AFTER_S)} if refused.status == 503 else None
    return web.Response(
        status=refused.status,
        body=_encode(status, encoding),
        content_type=_MEDIA_TYPES[encoding],
        headers=headers,
    )


def _gunzip_limited(body: bytes, limit: int) -> bytes:
    """Decompress a gzip body (one or more members), refusing output past ``limit`` bytes."""
    out: list[bytes] = []
    total = 0
    data = body
    while data:
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            # Asking for one byte more than allowed tells "exactly at the limit" from "over it"
            # without ever inflating more than limit + 1 bytes.
            chunk = inflater.decompress(data, limit + 1 - total)
        except zlib.error as exc:
            raise _Refused(400, f"body is not valid gzip: {exc}") from None
        total += len(chunk)
        if total > limit:
            raise _Refused(
                413,
                f"decompressed body exceeds max_request_bytes ({limit} bytes)",
                code_pb2.RESOURCE_EXHAUSTED,
            )
        if not inflater.eof:
            raise _Refused(400, "gzip body is truncated")
        out.append(chunk)
        data = inflater.unused_data
    return b"".join(out)


class _OtlpServer:
    """The aiohttp application and its lifecycle; runs on whichever loop starts it."""

    def __init__(self, writer: StoreWriter, *, max_request_bytes: int, max_queue_rows: int,
                 run_id: str | None = None):
        self.writer = writer
        # Spans whose resource names no run are stamped with this receiver's run.
        self.run_id = run_id
        self.stats = ReceiverStats()
        self.max_request_bytes = max_request_bytes
        self.max_queue_rows = max_queue_rows
        self.stopping = False
        self._executor = ThreadPoolExecutor(_DECODE_THREADS, "kvscope-receiver-decode")
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._warned = False

    def application(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_post("/v1/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        return app

    async def start(self, sockets: list[socket.socket]) -> None:
        """Start accepting on sockets bound by :func:`kvscope.serving.bind` (taken over)."""
        # The receiver inflates bodies itself, with a size limit (aiohttp's would not stop a
        # gzip bomb before it is in memory).
        runner = web.AppRunner(
            self.application(), auto_decompress=False, access_log=None, shutdown_timeout=30.0
        )
        await runner.setup()
        try:
            for sock in sockets:
                await web.SockSite(runner, sock).start()
        except BaseException:
            await runner.cleanup()
            close_all(sockets)
            raise
        self._runner = runner
        self.port = bound_port(sockets)

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish, then write and close the store."""
        self.stopping = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._executor.shutdown)
        if self.run_id is not None:
            await loop.run_in_executor(None, self._end_run)
        await loop.run_in_executor(None, self.writer.close)

    def _end_run(self) -> None:
        cursor = self.writer.connection.cursor()
        try:
            end_run(cursor, str(self.run_id))
        finally:
            cursor.close()

    # --- handlers ------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        writer = self.writer.stats
        body = {
            "status": "stopping" if self.stopping else "ok",
            "rows_written": writer.written_rows,
            "dropped": writer.dropped_rows,
            "failed": writer.failed_rows,
            **asdict(self.stats),
        }
        return web.json_response(body)

    async def _traces(self, request: web.Request) -> web.Response:
        return await self._export(request, "traces")

    async def _metrics(self, request: web.Request) -> web.Response:
        return await self._export(request, "metrics")

    async def _export(self, request: web.Request, signal_kind: str) -> web.Response:
        self.stats.requests += 1
        encoding = _CONTENT_TYPES.get(request.content_type)
        try:
            if encoding is None:
                raise _Refused(
                    415,
                    f"unsupported Content-Type {request.content_type!r}; "
                    "use application/x-protobuf or application/json",
                )
            content_encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
            if content_encoding not in ("gzip", "identity", ""):
                raise _Refused(415, f"unsupported Content-Encoding {content_encoding!r}")
            body = await self._read_body(request)
            loop = asyncio.get_running_loop()
            work = self._decode_traces if signal_kind == "traces" else self._decode_metrics
            table, accepted, rejected, error_message = await loop.run_in_executor(
                self._executor, work, body, content_encoding == "gzip", encoding
            )
            if table.num_rows > self.max_queue_rows:
                raise _Refused(
                    413,
                    f"{table.num_rows} rows in one request exceed the receiver's queue of "
                    f"{self.max_queue_rows}; send smaller batches",
                    code_pb2.RESOURCE_EXHAUSTED,
                )
            submit = self.writer.submit_traces if signal_kind == "traces" else (
                self.writer.submit_gauge
            )
            # Requests still in flight during a stop are accepted: the writer closes after them.
            if not submit(table):
                raise _Refused(
                    503, "the store writer is busy; retry later", code_pb2.UNAVAILABLE
                )
        except _Refused as refused:
            self._count_refusal(refused)
            return _status_response(refused, encoding or "json")
        if signal_kind == "traces":
            self.stats.spans_accepted += accepted
            self.stats.spans_rejected += rejected
            response: Message = ExportTraceServiceResponse(
                partial_success=ExportTracePartialSuccess(
                    rejected_spans=rejected, error_message=error_message
                )
                if rejected
                else None
            )
        else:
            self.stats.points_accepted += accepted
            self.stats.points_rejected += rejected
            response = ExportMetricsServiceResponse(
                partial_success=ExportMetricsPartialSuccess(
                    rejected_data_points=rejected, error_message=error_message
                )
                if rejected
                else None
            )
        return web.Response(body=_encode(response, encoding), content_type=_MEDIA_TYPES[encoding])

    def _count_refusal(self, refused: _Refused) -> None:
        if refused.status == 413:
            self.stats.too_large += 1
        elif refused.status == 415:
            self.stats.unsupported += 1
        elif refused.status == 503:
            self.stats.busy += 1
        else:
            self.stats.bad_requests += 1
        if not self._warned and refused.status != 503:
            self._warned = True
            logger.warning(
                "kvscope receiver refused a request (%d: %s); further refusals are counted in "
                "/health, not logged",
                refused.status,
                refused.message,
            )

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.max_request_bytes
        too_large = _Refused(
            413, f"body exceeds max_request_bytes ({limit} bytes)", code_pb2.RESOURCE_EXHAUSTED
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        chunks: list[bytes] = []
        total = 0
        async for chunk in request.content.iter_chunked(_READ_CHUNK):
            total += len(chunk)
            if total > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    # --- decoding (on the executor) -------------------------------------------------------------

    def _inflate(self, body: bytes, gzipped: bool) -> bytes:
        return _gunzip_limited(body, self.max_request_bytes) if gzipped else body

    def _decode_traces(
        self, body: bytes, gzipped: bool, encoding: Encoding
    ) -> tuple[pa.Table, int, int, str]:
        try:
            batch = decode_trace_request(self._inflate(body, gzipped), encoding, self.run_id)
            table = batch.to_arrow()
        except PayloadError as exc:
            raise _Refused(400, str(exc)) from None
        return table, table.num_rows, batch.rejected_spans, batch.error_message

    def _decode_metrics(
        self, body: bytes, gzipped: bool, encoding: Encoding
    ) -> tuple[pa.Table, int, int, str]:
        try:
            batch = decode_metrics_request(self._inflate(body, gzipped), encoding, self.run_id)
            table = batch.to_arrow()
        except PayloadError as exc:
            raise _Refused(400, str(exc)) from None
        return table, table.num_rows, batch.rejected_points, batch.error_message


def _open_writer(db_path: str | Path, max_queue_rows: int) -> StoreWriter:
    return StoreWriter(open_store(db_path), max_queue_rows=max_queue_rows)


def _begin_run(writer: StoreWriter, host: str, port: int) -> str:
    """Record the run this receiver collects (label from the ``run_label`` setting)."""
    label = settings.resolve("run_label") or (
        f"kvscope serve {datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%S')} UTC")
    cursor = writer.connection.cursor()
    try:
        return begin_run(cursor, label, {"source": "kvscope serve", "host": host, "port": port})
    finally:
        cursor.close()


def _bind_then_open(
    db_path: str | Path, host: str, port: int, max_queue_rows: int, record_run: bool
) -> tuple[list[socket.socket], StoreWriter, str | None]:
    """Bind the address, then open the store (and record the run when asked).

    The address comes first so that a start that cannot listen leaves the store untouched (no
    new file, no run row that never ends); nothing is accepted until the store is open, so a
    locked, foreign or newer file is still refused before any request is answered.
    """
    sockets = bind(host, port)
    try:
        writer = _open_writer(db_path, max_queue_rows)
    except BaseException:
        close_all(sockets)
        raise
    try:
        run_id = _begin_run(writer, host, bound_port(sockets)) if record_run else None
    except BaseException:
        writer.close()
        close_all(sockets)
        raise
    return sockets, writer, run_id


class Receiver:
    """A receiver on a background thread with its own event loop (tests, embedding).

    ``Receiver(path).start()`` binds ``host:port`` (0 picks a free port; a port in use raises
    :class:`~kvscope.errors.KvscopeError` before the store is touched), opens the store
    (raising :class:`~kvscope.errors.StoreError` subclasses such as ``StoreLockedError`` before
    accepting) and returns once requests are accepted; ``.url`` is then its base URL.
    ``.writer`` is the store writer, which a dashboard may share (``.writer.connection.cursor()``
    for reads).
    """

    def __init__(
        self,
        db_path: str | Path,
        host: str | None = None,
        port: int = 0,
        *,
        max_request_bytes: int | None = None,
        max_queue_rows: int | None = None,
        record_run: bool = False,
    ) -> None:
        self.db_path = db_path
        # Record a run in kvscope_runs and stamp it on spans that name none (kvscope serve).
        self.record_run = record_run
        self.host = settings.resolve("host", host)
        self._requested_port = port
        self.max_request_bytes = settings.resolve("max_request_bytes", max_request_bytes)
        self.max_queue_rows = settings.resolve("export_queue_size", max_queue_rows)
        self._server: _OtlpServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        return self._require().port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:43817`` (after :meth:`start`)."""
        return f"http://{self.host}:{self.port}"

    @property
    def writer(self) -> StoreWriter:
        """The store writer this receiver owns."""
        return self._require().writer

    @property
    def stats(self) -> ReceiverStats:
        """Request counters."""
        return self._require().stats

    def _require(self) -> _OtlpServer:
        if self._server is None:
            raise RuntimeError("receiver not started")
        return self._server

    def start(self) -> Receiver:
        """Bind the address, open the store, start accepting, and return self."""
        if self._server is not None:
            return self
        sockets, writer, run_id = _bind_then_open(
            self.db_path, self.host, self._requested_port, self.max_queue_rows, self.record_run)
        server = _OtlpServer(
            writer, max_request_bytes=self.max_request_bytes, max_queue_rows=self.max_queue_rows,
            run_id=run_id,
        )
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(server.start(sockets))
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(server.stop())
            loop.close()

        thread = threading.Thread(target=run, name="kvscope-receiver", daemon=True)
        thread.start()
        ready.wait()
        if failure:
            thread.join()
            if run_id is not None:
                server._end_run()
            writer.close()
            raise failure[0]
        self._server, self._loop, self._thread = server, loop, thread
        return self

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop accepting, finish in-flight requests, write everything queued, close the store."""
        if self._loop is None or self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._loop = None
        self._thread = None

    def __enter__(self) -> Receiver:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_receiver(
    db_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 4318,
    *,
    max_request_bytes: int | None = None,
    max_queue_rows: int | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, then stop cleanly (blocking, on the main thread; the CLI).

    ``on_ready(url)`` is called once the receiver listens. The stop is the one every serving
    process takes (:func:`kvscope.serving.stop_signals`): stop accepting, finish in-flight
    requests, write everything acknowledged, end the run, close the store.
    """
    with stop_signals() as wait_for_stop:
        receiver = Receiver(db_path, host, port, max_request_bytes=max_request_bytes,
                            max_queue_rows=max_queue_rows, record_run=True).start()
        try:
            if on_ready is not None:
                on_ready(receiver.url)
            wait_for_stop()
        finally:
            receiver.stop(timeout=None)


def main_serve(db: str, host: str | None, port: int | None) -> int:
    """``kvscope serve --db FILE [--host] [--port]``: receive OTLP into ``db`` until stopped.

    Store errors (locked, foreign or newer file) and a port in use propagate as
    :class:`~kvscope.errors.KvscopeError` for the CLI to print as one line.
    """
    host = settings.resolve("host", host)
    port = settings.resolve("port", port)

    def ready(url: str) -> None:
        print(f"kvscope serve: receiving OTLP/HTTP on {url}, writing {db}", file=sys.stderr,
              flush=True)

    run_receiver(db, host, port, on_ready=ready)
    print("kvscope serve: stopped; everything acknowledged is written", file=sys.stderr,
          flush=True)
    return 0


__all__ = ["Receiver", "ReceiverStats", "main_serve", "run_receiver"]
