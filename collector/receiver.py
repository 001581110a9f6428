"""The OTLP receiver behind ``kvscope serve``: one process that owns a store file.

Engines, the proxy and samplers export OTLP here (DuckDB allows one writer per file): OTLP/HTTP
on one port and, when asked (``kvscope serve`` always asks, 4317 by default), OTLP/gRPC on
another (:mod:`kvscope.collector.otlp_grpc`, the same checks with gRPC status codes). Both hand
their bodies to one :class:`~kvscope.collector.otlp_intake.Intake`, the one store path.
``POST /v1/traces`` and ``POST /v1/metrics`` follow the OTLP/HTTP specification: protobuf or
JSON bodies, gzip or identity encoding, responses in the request's encoding with
``partial_success`` when something was rejected, and a ``google.rpc.Status`` body on errors:

    400  malformed, truncated or wrongly typed payload (the message names the field)
    408  the body did not arrive within ``BODY_READ_TIMEOUT_S``
    413  body larger than ``max_request_bytes`` (after decompression too: gzip bombs stop there)
    415  content type other than application/x-protobuf / application/json, or an unsupported
         content encoding
    503  the request's bytes do not fit ``max_inflight_bytes`` within ``ADMISSION_WAIT_S``, or
         the store could not commit its rows (``Retry-After`` says when to try again)

Both ports are bound before the store is opened (:mod:`kvscope.serving`), so a start that
cannot listen on either leaves the file untouched. A request's bytes are admitted against
``max_inflight_bytes`` as its body arrives (:mod:`kvscope.collector.otlp_admission`), so
memory is bounded by bytes whatever the requests hold, and a slow upload holds only what it
sent. A request is decoded completely before
anything is queued, so a bad request never touches rows already stored. Rows are acknowledged
once committed (group commit across concurrent requests), so a SIGKILL loses nothing
acknowledged; a request of any number of rows is taken. A clean stop (SIGINT/SIGTERM for
:func:`run_receiver`, through :func:`kvscope.serving.stop_signals`; :meth:`Receiver.stop`)
stops both listeners accepting, lets their in-flight requests finish, and only then writes
everything acknowledged and closes the store.
``GET /health`` reports the counters of both transports. ``GET /metrics`` answers when the
receiver is given a metrics source (``kvscope serve``: the live ledger's series,
:mod:`kvscope.analysis.live_metrics`, beside the receiver's own counters), and
``GET /v1/analyze/{name}`` when given a query source (``kvscope serve``: registered analyses on a
snapshot of the store it writes, :mod:`kvscope.analysis.live_queries`); the CLI composes both.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc import code_pb2, status_pb2
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvscope import settings
from kvscope.collector.otlp_admission import (
    ADMISSION_WAIT_S,
    UNRECEIVED_ALLOWANCE_BYTES,
    Reservation,
)
from kvscope.collector.otlp_decode import Encoding
from kvscope.collector.otlp_grpc import GrpcListener, grpc_target
from kvscope.collector.otlp_intake import (
    RETRY_AFTER_S,
    Ack,
    Intake,
    ReceiverStats,
    Refused,
    Signal,
    busy,
    too_large,
)
from kvscope.errors import KvscopeError
from kvscope.exposition import (
    RECEIVER_POINTS_REJECTED,
    RECEIVER_REQUESTS_REFUSED,
    RECEIVER_ROWS_DROPPED,
    RECEIVER_ROWS_FAILED,
    RECEIVER_SPANS_ACCEPTED,
    RECEIVER_SPANS_REJECTED,
    RECEIVER_VALUES_TRUNCATED,
)
from kvscope.serving import (
    BODY_READ_TIMEOUT_S,
    bind,
    bound_port,
    close_all,
    one_line_malformed_requests,
    stop_signals,
)
from kvscope.store.database import begin_run, end_run, open_store
from kvscope.store.writer import StoreWriter

_CONTENT_TYPES: dict[str, Encoding] = {
    "application/x-protobuf": "protobuf",
    "application/json": "json",
}
_MEDIA_TYPES: dict[Encoding, str] = {v: k for k, v in _CONTENT_TYPES.items()}
_READ_CHUNK = 256 * 1024
# ``GET /metrics``: given the scraper's Accept header, the exposition body and its Content-Type.
MetricsRenderer = Callable[[str | None], tuple[bytes, str]]
# Builds the renderer once the store is open, from the receiver's store connection and a
# collector of the receiver's own counters (:class:`ReceiverCollector`) to expose beside it.
MetricsSource = Callable[[Any, Collector], MetricsRenderer]

# ``GET /v1/analyze/{name}``: given the analysis name and the query string (name → values), a
# JSON body; a KvscopeError is a bad request (400). Built like the metrics renderer, from the
# receiver's store connection (``kvscope serve``: :mod:`kvscope.analysis.live_queries`).
QueryAnswer = Callable[[str, Mapping[str, Sequence[str]]], bytes]
QuerySource = Callable[[Any], QueryAnswer]
# How long a stop waits for requests in flight on each listener.
_GRACE_S = 30.0


def _encode(message: Message, encoding: Encoding) -> bytes:
    if encoding == "json":
        return json.dumps(json_format.MessageToDict(message), separators=(",", ":")).encode()
    return message.SerializeToString()


def _status_response(refused: Refused, encoding: Encoding) -> web.Response:
    status = status_pb2.Status(code=refused.code, message=refused.message)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if refused.status == 503 else None
    return web.Response(
        status=refused.status,
        body=_encode(status, encoding),
        content_type=_MEDIA_TYPES[encoding],
        headers=headers,
    )


class ReceiverCollector(Collector):
    """The receiver's counters as Prometheus series: spans and points it rejected, requests it
    refused (by reason: the HTTP status's kind), rows its store writer dropped or failed."""

    def __init__(self, server: _OtlpServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        stats, writer = self._server.stats, self._server.writer.stats
        yield CounterMetricFamily(RECEIVER_SPANS_ACCEPTED, "Spans taken into the store queue",
                                  value=stats.spans_accepted)
        yield CounterMetricFamily(RECEIVER_SPANS_REJECTED, "Spans of accepted requests "
                                  "rejected (OTLP partial_success)", value=stats.spans_rejected)
        yield CounterMetricFamily(RECEIVER_VALUES_TRUNCATED, "Attribute values longer than "
                                  "the stored maximum, stored cut and marked (OTLP "
                                  "partial_success says so)", value=stats.values_truncated)
        yield CounterMetricFamily(RECEIVER_POINTS_REJECTED, "Metric points of accepted "
                                  "requests rejected (OTLP partial_success)",
                                  value=stats.points_rejected)
        refused = CounterMetricFamily(RECEIVER_REQUESTS_REFUSED, "Requests refused whole, by "
                                      "reason (busy: 503, the sender retries)", labels=["reason"])
        for reason, value in (("bad_request", stats.bad_requests), ("too_large", stats.too_large),
                              ("unsupported", stats.unsupported), ("busy", stats.busy)):
            refused.add_metric([reason], value)
        yield refused
        yield CounterMetricFamily(RECEIVER_ROWS_DROPPED, "Rows the store writer's queue refused",
                                  value=writer.dropped_rows)
        yield CounterMetricFamily(RECEIVER_ROWS_FAILED, "Rows the store writer failed to write",
                                  value=writer.failed_rows)


class _OtlpServer:
    """Both listeners (HTTP, and gRPC when asked) over one intake; runs on whichever loop
    starts it."""

    def __init__(self, writer: StoreWriter, *, max_request_bytes: int, max_queue_rows: int,
                 max_inflight_bytes: int | None = None, run_id: str | None = None,
                 ack: Ack = "durable", metrics: MetricsRenderer | None = None):
        self.intake = Intake(writer, max_request_bytes=max_request_bytes,
                             max_queue_rows=max_queue_rows,
                             max_inflight_bytes=max_inflight_bytes, run_id=run_id, ack=ack)
        self.writer = writer
        self.run_id = run_id
        self.metrics = metrics
        self.queries: QueryAnswer | None = None
        self.stats = self.intake.stats
        self.max_request_bytes = max_request_bytes
        self.stopping = False
        self._runner: web.AppRunner | None = None
        self._grpc: GrpcListener | None = None
        self.port = 0
        self.grpc_port: int | None = None

    def application(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_post("/v1/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        if self.metrics is not None:
            app.router.add_get("/metrics", self._metrics_page)
        if self.queries is not None:
            app.router.add_get("/v1/analyze/{name}", self._analyze)
        return app

    async def start(self, sockets: list[socket.socket], grpc: GrpcListener | None = None
                    ) -> None:
        """Start accepting OTLP/HTTP on sockets bound by :func:`kvscope.serving.bind` and, when
        given, OTLP/gRPC on a bound :class:`GrpcListener` (both taken over)."""
        # The receiver inflates bodies itself, with a size limit (aiohttp's would not stop a
        # gzip bomb before it is in memory).
        one_line_malformed_requests()
        runner = web.AppRunner(
            self.application(), auto_decompress=False, access_log=None, shutdown_timeout=_GRACE_S
        )
        try:
            await runner.setup()
            try:
                for sock in sockets:
                    await web.SockSite(runner, sock).start()
                if grpc is not None:
                    await grpc.start(self.intake)
            except BaseException:
                await runner.cleanup()
                raise
        except BaseException:
            close_all(sockets)
            if grpc is not None:
                await grpc.stop(None)
            raise
        self._runner = runner
        self.port = bound_port(sockets)
        if grpc is not None:
            self._grpc = grpc
            self.grpc_port = grpc.port

    async def stop(self) -> None:
        """Stop accepting on both listeners, let in-flight requests finish on each, then write
        and close the store."""
        self.stopping = True
        # Both listeners stop taking requests at once and drain side by side; the store is
        # closed only after both have answered everything they accepted.
        listeners = []
        if self._runner is not None:
            listeners.append(self._runner.cleanup())
            self._runner = None
        if self._grpc is not None:
            listeners.append(self._grpc.stop(_GRACE_S))
            self._grpc = None
        await asyncio.gather(*listeners)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.intake.shutdown)
        # A metrics renderer refreshing in a thread of its own ends that before the store closes.
        close_metrics = getattr(self.metrics, "close", None)
        if close_metrics is not None:
            await loop.run_in_executor(None, close_metrics)
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

    async def _metrics_page(self, request: web.Request) -> web.Response:
        assert self.metrics is not None
        # The renderer reads the store: off the event loop, which keeps receiving.
        body, content_type = await asyncio.get_running_loop().run_in_executor(
            None, self.metrics, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _analyze(self, request: web.Request) -> web.Response:
        assert self.queries is not None
        query = {key: request.query.getall(key) for key in request.query}
        try:
            # Reads the store: off the event loop, which keeps receiving.
            body = await asyncio.get_running_loop().run_in_executor(
                None, self.queries, request.match_info["name"], query)
        except KvscopeError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.Response(body=body, content_type="application/json")

    async def _traces(self, request: web.Request) -> web.Response:
        return await self._export(request, "traces")

    async def _metrics(self, request: web.Request) -> web.Response:
        return await self._export(request, "metrics")

    async def _export(self, request: web.Request, signal_kind: Signal) -> web.Response:
        self.stats.requests += 1
        encoding = _CONTENT_TYPES.get(request.content_type)
        try:
            if encoding is None:
                raise Refused(
                    415,
                    f"unsupported Content-Type {request.content_type!r}; "
                    "use application/x-protobuf or application/json",
                )
            content_encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
            if content_encoding not in ("gzip", "identity", ""):
                raise Refused(415, f"unsupported Content-Encoding {content_encoding!r}")
            limit = self.max_request_bytes
            length = request.content_length
            if length is not None and length > limit:
                raise too_large(f"body exceeds max_request_bytes ({limit} bytes)")
            # Admitted by bytes as the body arrives: at most UNRECEIVED_ALLOWANCE_BYTES ahead
            # of what was received, so a slow or chunked upload holds what it sent.
            expected = limit if length is None else length
            async with self.intake.admitted(min(expected, UNRECEIVED_ALLOWANCE_BYTES),
                                            ADMISSION_WAIT_S) as reservation:
                body = await self._read_body(request, reservation, expected)
                reservation.shrink_to(len(body))
                response = await self.intake.export(
                    signal_kind, body, encoding, gzipped=content_encoding == "gzip",
                    reservation=reservation,
                )
        except Refused as refused:
            self.intake.count_refusal(refused)
            return _status_response(refused, encoding or "json")
        return web.Response(body=_encode(response, encoding), content_type=_MEDIA_TYPES[encoding])

    async def _read_body(self, request: web.Request, reservation: Reservation,
                         expected: int) -> bytes:
        """The body, read in steps that each hold their bytes in the budget first."""
        limit = self.max_request_bytes
        refusal = too_large(f"body exceeds max_request_bytes ({limit} bytes)")
        chunks: list[bytes] = []
        total = 0
        try:
            # A client holding a partial body must not hold a connection (and its buffer) for
            # ever: 300 such connections once stayed open indefinitely.
            async with asyncio.timeout(BODY_READ_TIMEOUT_S):
                async for chunk in request.content.iter_chunked(_READ_CHUNK):
                    total += len(chunk)
                    if total > limit:
                        raise refusal
                    chunks.append(chunk)
                    wanted = min(max(expected, total), total + UNRECEIVED_ALLOWANCE_BYTES)
                    if not await reservation.grow(wanted, ADMISSION_WAIT_S):
                        raise busy(
                            "the receiver holds its limit of request bytes in flight "
                            f"(max_inflight_bytes {self.intake.max_inflight_bytes}); "
                            "retry later")
                    self.intake.count_bytes()
        except TimeoutError:
            raise Refused(408, f"request body not received within {BODY_READ_TIMEOUT_S:g} s",
                          code_pb2.DEADLINE_EXCEEDED) from None
        except ConnectionError:
            # The client went away mid-body: nobody reads the answer; one count, no traceback.
            raise Refused(400, "the client closed the connection before its body was complete"
                          ) from None
        return b"".join(chunks)


def _open_writer(db_path: str | Path, max_queue_rows: int) -> StoreWriter:
    # Held to store_memory_limit as readers are: DuckDB keeps the blocks its queries read (the
    # live metrics' read backs), up to 80 % of RAM without a limit (docs/benchmarks.md, the
    # 1M-turn soak: RSS flat under 1 GB).
    memory_limit = settings.resolve("store_memory_limit") or None
    return StoreWriter(open_store(db_path, memory_limit=memory_limit),
                       max_queue_rows=max_queue_rows)


def _begin_run(writer: StoreWriter, host: str, port: int, grpc_port: int | None) -> str:
    """Record the run this receiver collects (label from the ``run_label`` setting)."""
    label = settings.resolve("run_label") or (
        f"kvscope serve {datetime.now(UTC).strftime('%Y-%m-%d %H:%M:%S')} UTC")
    cursor = writer.connection.cursor()
    try:
        return begin_run(cursor, label, {"source": "kvscope serve", "host": host, "port": port,
                                         "grpc_port": grpc_port})
    finally:
        cursor.close()


async def _bind_then_open(
    db_path: str | Path, host: str, port: int, grpc_port: int | None, max_request_bytes: int,
    max_queue_rows: int, record_run: bool, max_inflight_bytes: int | None = None,
) -> tuple[list[socket.socket], GrpcListener | None, StoreWriter, str | None]:
    """Bind both addresses (OTLP/HTTP, then OTLP/gRPC unless ``grpc_port`` is None), then open
    the store (and record the run when asked).

    The addresses come first so that a start that cannot listen on either leaves the store
    untouched (no new file, no run row that never ends); nothing is accepted until the store is
    open, so a locked, foreign or newer file is still refused before any request is answered.
    Runs on the receiver's event loop (grpc binds its port on the loop that will serve it).
    """
    sockets = bind(host, port)
    grpc: GrpcListener | None = None
    try:
        if grpc_port is not None:
            grpc = GrpcListener(max_request_bytes, max_inflight_bytes)
            await grpc.bind(host, grpc_port)
        writer = _open_writer(db_path, max_queue_rows)
    except BaseException:
        close_all(sockets)
        if grpc is not None:
            await grpc.stop(None)
        raise
    try:
        run_id = (_begin_run(writer, host, bound_port(sockets),
                             None if grpc is None else grpc.port)
                  if record_run else None)
    except BaseException:
        writer.close()
        close_all(sockets)
        if grpc is not None:
            await grpc.stop(None)
        raise
    return sockets, grpc, writer, run_id


class Receiver:
    """A receiver on a background thread with its own event loop (tests, embedding).

    ``Receiver(path).start()`` binds ``host:port`` (0 picks a free port) and, when ``grpc_port``
    is given, OTLP/gRPC on it (0 picks one too); a port in use raises
    :class:`~kvscope.errors.KvscopeError` before the store is touched. It then opens the store
    (raising :class:`~kvscope.errors.StoreError` subclasses such as ``StoreLockedError`` before
    accepting) and returns once requests are accepted on both; ``.url`` is then the HTTP base
    URL and ``.grpc_url`` the gRPC endpoint. ``.writer`` is the store writer, which a dashboard
    may share (``.writer.connection.cursor()`` for reads).
    """

    def __init__(
        self,
        db_path: str | Path,
        host: str | None = None,
        port: int = 0,
        *,
        grpc_port: int | None = None,
        max_request_bytes: int | None = None,
        max_queue_rows: int | None = None,
        max_inflight_bytes: int | None = None,
        record_run: bool = False,
        ack: Ack = "durable",
        metrics: MetricsSource | None = None,
        queries: QuerySource | None = None,
    ) -> None:
        self.db_path = db_path
        self._metrics_source = metrics
        self._queries_source = queries
        # Record a run in kvscope_runs and stamp it on spans that name none (kvscope serve).
        self.record_run = record_run
        self.host = settings.resolve("host", host)
        self._requested_port = port
        self._requested_grpc_port = (
            None if grpc_port is None else settings.resolve("grpc_port", grpc_port)
        )
        self.max_request_bytes = settings.resolve("max_request_bytes", max_request_bytes)
        self.max_queue_rows = settings.resolve("export_queue_size", max_queue_rows)
        self.max_inflight_bytes = settings.resolve("max_inflight_bytes", max_inflight_bytes)
        # "queued" answers once rows are queued (the earlier way; benchmarks compare the two).
        self.ack: Ack = ack
        self._server: _OtlpServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound OTLP/HTTP port (after :meth:`start`)."""
        return self._require().port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:43817`` (after :meth:`start`)."""
        return f"http://{self.host}:{self.port}"

    @property
    def grpc_port(self) -> int | None:
        """The bound OTLP/gRPC port, or None when this receiver has no gRPC listener."""
        return self._require().grpc_port

    @property
    def grpc_url(self) -> str:
        """The OTLP/gRPC endpoint as exporters take it, e.g. ``http://127.0.0.1:43817``."""
        port = self.grpc_port
        if port is None:
            raise RuntimeError("receiver started without an OTLP/gRPC listener")
        return f"http://{grpc_target(self.host, port)}"

    @property
    def writer(self) -> StoreWriter:
        """The store writer this receiver owns."""
        return self._require().writer

    @property
    def stats(self) -> ReceiverStats:
        """Request counters (both transports)."""
        return self._require().stats

    def _require(self) -> _OtlpServer:
        if self._server is None:
            raise RuntimeError("receiver not started")
        return self._server

    def start(self) -> Receiver:
        """Bind both addresses, open the store, start accepting, and return self."""
        if self._server is not None:
            return self
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        started: list[_OtlpServer] = []
        failure: list[BaseException] = []

        async def launch() -> _OtlpServer:
            sockets, grpc, writer, run_id = await _bind_then_open(
                self.db_path, self.host, self._requested_port, self._requested_grpc_port,
                self.max_request_bytes, self.max_queue_rows, self.record_run,
                self.max_inflight_bytes)
            server = _OtlpServer(
                writer, max_request_bytes=self.max_request_bytes,
                max_queue_rows=self.max_queue_rows, max_inflight_bytes=self.max_inflight_bytes,
                run_id=run_id, ack=self.ack,
            )
            if self._metrics_source is not None:
                server.metrics = self._metrics_source(writer.connection,
                                                      ReceiverCollector(server))
            if self._queries_source is not None:
                server.queries = self._queries_source(writer.connection)
            try:
                await server.start(sockets, grpc)
            except BaseException:
                if run_id is not None:
                    server._end_run()
                writer.close()
                raise
            return server

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                server = loop.run_until_complete(launch())
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            started.append(server)
            ready.set()
            loop.run_forever()
            loop.run_until_complete(server.stop())
            loop.close()

        thread = threading.Thread(target=run, name="kvscope-receiver", daemon=True)
        thread.start()
        ready.wait()
        if failure:
            thread.join()
            raise failure[0]
        self._server, self._loop, self._thread = started[0], loop, thread
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


@dataclass(frozen=True)
class Listening:
    """Where a started receiver listens: the OTLP/HTTP base URL and the OTLP/gRPC endpoint."""

    http_url: str
    grpc_url: str | None


def run_receiver(
    db_path: str | Path,
    host: str = "127.0.0.1",
    port: int = 4318,
    *,
    grpc_port: int | None = None,
    max_request_bytes: int | None = None,
    max_queue_rows: int | None = None,
    max_inflight_bytes: int | None = None,
    on_ready: Callable[[Listening], None] | None = None,
    ack: Ack = "durable",
    metrics: MetricsSource | None = None,
    queries: QuerySource | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, then stop cleanly (blocking, on the main thread; the CLI).

    OTLP/gRPC listens on ``grpc_port`` unless it is None; both ports are bound before the store
    is opened. ``on_ready(listening)`` is called once both listeners accept requests. The stop is
    the one every serving process takes (:func:`kvscope.serving.stop_signals`): both listeners
    stop accepting and finish their in-flight requests, then everything acknowledged is written,
    the run ended and the store closed.
    """
    with stop_signals() as wait_for_stop:
        receiver = Receiver(db_path, host, port, grpc_port=grpc_port,
                            max_request_bytes=max_request_bytes, max_queue_rows=max_queue_rows,
                            max_inflight_bytes=max_inflight_bytes, record_run=True,
                            ack=ack, metrics=metrics, queries=queries).start()
        try:
            if on_ready is not None:
                on_ready(Listening(
                    receiver.url, None if receiver.grpc_port is None else receiver.grpc_url))
            wait_for_stop()
        finally:
            receiver.stop(timeout=None)


__all__ = ["Listening", "MetricsRenderer", "MetricsSource", "QueryAnswer", "QuerySource",
    "Receiver", "ReceiverCollector", "run_receiver"]
