"""The OTLP/HTTP receiver against real exporters and clients on 127.0.0.1, with real store files."""

from __future__ import annotations

import base64
import gzip
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from kvscope import semconv
from kvscope.collector.exporters import DuckDBMetricExporter, DuckDBSpanExporter
from kvscope.collector.receiver import Receiver
from kvscope.errors import KvscopeError, StoreLockedError
from kvscope.store.query import Query
from kvscope.store.writer import StoreWriter
from tests.collector.test_otlp_decode import SPEC_ATTRIBUTES, SPEC_EXAMPLE
from tests.raw_http import partial_body_answer, post_head
from tests.stores import query

PROTOBUF = {"Content-Type": "application/x-protobuf"}
JSON = {"Content-Type": "application/json"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "received.duckdb", max_request_bytes=256 * 1024) as rx:
        yield rx


def _spans(n: int = 3, conversation: str = "conv") -> list[ReadableSpan]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": semconv.SERVICE_PROXY}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(semconv.SCOPE_NAME, "0.1")
    for i in range(n):
        with tracer.start_as_current_span(
            semconv.SPAN_TURN,
            kind=SpanKind.SERVER,
            attributes={
                semconv.GEN_AI_CONVERSATION_ID: conversation,
                semconv.TURN_INDEX: i + 1,
                semconv.TTFT_MS: 12.5 + i,
                semconv.D_METADATA_ATTACHED: i % 2 == 0,
                semconv.MESSAGE_BOUNDARY_HASHES: ["a1", "b2"],
            },
        ) as turn:
            turn.add_event(semconv.EVENT_FIRST_TOKEN, {"chunk": 1})
            with tracer.start_as_current_span(
                semconv.SPAN_GENERATION, links=[Link(turn.get_span_context())]
            ) as leg:
                leg.set_status(Status(StatusCode.ERROR, "boom"))
    provider.shutdown()
    return list(memory.get_finished_spans())


def _traces(con: duckdb.DuckDBPyConnection) -> list[tuple[Any, ...]]:
    return con.execute("SELECT * FROM otel_traces ORDER BY SpanId").fetchall()


def _live_traces(rx: Receiver) -> list[tuple[Any, ...]]:
    assert rx.writer.flush(10)
    return _traces(rx.writer.connection.cursor())


def _count(rx: Receiver) -> int:
    return len(_live_traces(rx))


def _in_process(tmp_path: Path, spans: list[ReadableSpan]) -> list[tuple[Any, ...]]:
    writer = StoreWriter.open(tmp_path / "in_process.duckdb")
    assert DuckDBSpanExporter(writer).export(spans) is SpanExportResult.SUCCESS
    writer.flush(10)
    try:
        return _traces(writer.connection.cursor())
    finally:
        writer.close()


_GAUGES = "SELECT * FROM otel_metrics_gauge ORDER BY MetricName"


def _sample_metrics(*, retained: bool) -> Any:
    """A GPU memory gauge (and the retained-bytes gauge when ``retained``) as the SDK exports
    them, plus a counter the store does not keep (one rejected point)."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(
        metric_readers=[reader],
        resource=Resource.create({"service.name": semconv.SERVICE_GPU_SAMPLER}),
    )
    meter = provider.get_meter(semconv.SCOPE_NAME)
    meter.create_gauge(semconv.METRIC_GPU_MEMORY_USED, unit="By").set(
        123.0, {semconv.GPU_INDEX: 0})
    if retained:
        meter.create_up_down_counter(semconv.METRIC_KV_RETAINED, unit="By").add(
            4096, {semconv.ENGINE_ID: "d0"})
    meter.create_counter("not_stored").add(1)
    data = reader.get_metrics_data()
    provider.shutdown()
    assert data is not None
    return data


def _metrics_in_process(tmp_path: Path, data: Any) -> list[tuple[Any, ...]]:
    """The gauge rows kvscope's in-process metric exporter stores for ``data``."""
    writer = StoreWriter.open(tmp_path / "in_process.duckdb")
    assert DuckDBMetricExporter(writer).export(data) is MetricExportResult.SUCCESS
    writer.flush(10)
    try:
        return writer.connection.cursor().execute(_GAUGES).fetchall()
    finally:
        writer.close()


def _metrics_received(receiver: Receiver) -> list[tuple[Any, ...]]:
    """The gauge rows a receiver has stored so far."""
    receiver.writer.flush(10)
    return receiver.writer.connection.cursor().execute(_GAUGES).fetchall()


def _stop_in_order(process: subprocess.Popen[str]) -> None:
    """SIGTERM: the served process stops in order (exit 0, its last line says so)."""
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    assert "stopped" in (process.stderr.read() if process.stderr else "")


def _runs_recorded(path: Path) -> tuple[int, int]:
    """(runs, runs ended) recorded in the store at ``path``."""
    [(runs, ended)] = query(path, "SELECT count(*), count(ended_at) FROM kvscope_runs")
    return int(runs), int(ended)


def _reap(process: subprocess.Popen[str]) -> None:
    """Kill a served process a failed test left running."""
    if process.poll() is None:
        process.kill()
        process.wait()


def _status(response: httpx.Response) -> str:
    if response.headers["content-type"].startswith("application/json"):
        return str(response.json()["message"])
    return status_pb2.Status.FromString(response.content).message


# --- the official exporters --------------------------------------------------------------------


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_official_span_exporter_rows_equal_the_in_process_rows(
    receiver: Receiver, tmp_path: Path, compression: Compression
) -> None:
    spans = _spans(4)
    exporter = OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces", compression=compression)

    assert exporter.export(spans) is SpanExportResult.SUCCESS

    received = _live_traces(receiver)
    assert len(received) == 8
    assert received == _in_process(tmp_path, spans)


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_official_metric_exporter_rows_equal_the_in_process_rows(
    receiver: Receiver, tmp_path: Path, compression: Compression
) -> None:
    data = _sample_metrics(retained=True)
    exporter = OTLPMetricExporter(endpoint=f"{receiver.url}/v1/metrics", compression=compression)

    assert exporter.export(data) is MetricExportResult.SUCCESS

    received = _metrics_received(receiver)
    assert len(received) == 2
    assert received == _metrics_in_process(tmp_path, data)
    assert receiver.stats.points_rejected == 1


# --- OTLP/JSON ---------------------------------------------------------------------------------


def _otlp_json(spans: list[ReadableSpan]) -> dict[str, Any]:
    data = json_format.MessageToDict(encode_spans(spans))
    for rs in data["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
                for link in span.get("links", []):
                    for key in ("traceId", "spanId"):
                        link[key] = base64.b64decode(link[key]).hex()
    return data


def test_otlp_json_lands_like_the_in_process_path(receiver: Receiver, tmp_path: Path) -> None:
    spans = _spans(2)

    response = httpx.post(f"{receiver.url}/v1/traces", json=_otlp_json(spans))

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.json() == {}
    assert _live_traces(receiver) == _in_process(tmp_path, spans)


def test_hand_written_spec_example_is_stored(receiver: Receiver) -> None:
    response = httpx.post(
        f"{receiver.url}/v1/traces", content=json.dumps(SPEC_EXAMPLE), headers=JSON
    )

    assert response.status_code == 200
    assert receiver.writer.flush(10)
    row = receiver.writer.connection.cursor().execute(
        "SELECT TraceId, SpanId, ParentSpanId, SpanName, SpanKind, ServiceName, Duration, "
        "SpanAttributes FROM otel_traces"
    ).fetchall()
    assert row == [
        (
            "5b8efff798038103d269b633813fc60c",
            "eee19b7ec3c1b174",
            "eee19b7ec3c1b173",
            "I'm a server span",
            "SPAN_KIND_SERVER",
            "my.service",
            1_000_000_000,
            SPEC_ATTRIBUTES,
        )
    ]


# --- partial success ---------------------------------------------------------------------------


def _request_with_bad_ids() -> ExportTraceServiceRequest:
    good = Span(trace_id=bytes(range(1, 17)), span_id=bytes(range(1, 9)), name="good")
    bad = Span(trace_id=b"short", span_id=bytes(range(1, 9)), name="bad")
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[good, bad])])]
    )


def test_bad_ids_get_partial_success_in_protobuf(receiver: Receiver) -> None:
    response = httpx.post(
        f"{receiver.url}/v1/traces",
        content=_request_with_bad_ids().SerializeToString(),
        headers=PROTOBUF,
    )

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-protobuf"
    partial = ExportTraceServiceResponse.FromString(response.content).partial_success
    assert partial.rejected_spans == 1
    assert "traceId is 5 bytes, expected 16" in partial.error_message
    assert [row[5] for row in _live_traces(receiver)] == ["good"]


def test_bad_ids_get_partial_success_in_json(receiver: Receiver) -> None:
    body = json_format.MessageToDict(_request_with_bad_ids())
    for span in body["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for key in ("traceId", "spanId"):
            span[key] = base64.b64decode(span[key]).hex()

    response = httpx.post(f"{receiver.url}/v1/traces", json=body)

    assert response.status_code == 200
    partial = response.json()["partialSuccess"]
    assert int(partial["rejectedSpans"]) == 1
    assert "expected 16" in partial["errorMessage"]


# --- refusals never lose stored rows -----------------------------------------------------------


def _chunks(size: int) -> Iterator[bytes]:
    sent = 0
    while sent < size:
        yield b"\x00" * min(8192, size - sent)
        sent += 8192


def test_refused_requests_say_why_and_keep_stored_rows(receiver: Receiver) -> None:
    url = f"{receiver.url}/v1/traces"
    good = encode_spans(_spans(2)).SerializeToString()
    assert httpx.post(url, content=good, headers=PROTOBUF).status_code == 200
    limit = receiver.max_request_bytes
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        ("garbage", {"content": b"\xff\xff\xff", "headers": PROTOBUF}, 400, "malformed"),
        ("truncated", {"content": good[: len(good) // 2], "headers": PROTOBUF}, 400,
         "truncated"),
        ("bad json", {"content": b"{oops", "headers": JSON}, 400, "line 1 column 2"),
        ("wrong json type", {"json": {"resourceSpans": [{"scopeSpans": [{"spans": [
            {"name": ["x"]}]}]}]}}, 400, "spans.name"),
        ("oversized", {"content": b"\x00" * (limit + 1), "headers": PROTOBUF}, 413,
         "max_request_bytes"),
        ("oversized chunked", {"content": _chunks(limit + 10), "headers": PROTOBUF}, 413,
         "max_request_bytes"),
        ("gzip bomb", {"content": gzip.compress(b"\x00" * (64 * limit)),
                       "headers": {**PROTOBUF, "Content-Encoding": "gzip"}}, 413,
         "decompressed body exceeds"),
        ("not gzip", {"content": b"plain", "headers": {**PROTOBUF, "Content-Encoding": "gzip"}},
         400, "not valid gzip"),
        ("truncated gzip", {"content": gzip.compress(good)[:-12],
                            "headers": {**PROTOBUF, "Content-Encoding": "gzip"}}, 400,
         "truncated"),
        ("content type", {"content": b"{}", "headers": {"Content-Type": "text/plain"}}, 415,
         "unsupported Content-Type 'text/plain'"),
        ("encoding", {"content": good, "headers": {**PROTOBUF, "Content-Encoding": "br"}}, 415,
         "unsupported Content-Encoding 'br'"),
    ]
    for name, request, status, reason in cases:
        response = httpx.post(url, **request)
        assert response.status_code == status, name
        assert reason in _status(response), (name, _status(response))

    assert _count(receiver) == 4
    health = httpx.get(f"{receiver.url}/health").json()
    assert health["status"] == "ok"
    assert health["rows_written"] == 4
    assert (health["bad_requests"], health["too_large"], health["unsupported"]) == (6, 3, 2)


def _big_request(n: int, tag: str) -> bytes:
    """One valid OTLP protobuf request with ``n`` spans (built as messages: the SDK is slow)."""
    spans = [
        Span(trace_id=(i + 1).to_bytes(16, "big"), span_id=(i + 1).to_bytes(8, "big"),
             name=semconv.SPAN_TURN, kind=Span.SPAN_KIND_SERVER,
             start_time_unix_nano=1_700_000_000_000_000_000 + i,
             end_time_unix_nano=1_700_000_000_000_000_000 + i + 1000)
        for i in range(n)
    ]
    resource = ResourceSpans().resource
    resource.attributes.add(key="service.name").value.string_value = tag
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=resource, scope_spans=[ScopeSpans(spans=spans)])])
    return request.SerializeToString()


def test_a_request_larger_than_the_whole_queue_is_stored(tmp_path: Path) -> None:
    # It was answered 413, which the official exporters do not retry: the batch was lost.
    with Receiver(tmp_path / "small.duckdb", max_queue_rows=3) as rx:
        exporter = OTLPSpanExporter(endpoint=f"{rx.url}/v1/traces")
        assert exporter.export(_spans(4)) is SpanExportResult.SUCCESS
        assert _count(rx) == 8


def test_a_request_over_the_default_queue_is_stored_in_parts_of_one_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvscope.store import writer as writer_module

    # Parts of 10,000 rows, so that 70,000 spans (over the 65,536-span queue) take 7 inserts.
    monkeypatch.setattr(writer_module, "ROW_GROUP_ROWS", 10_000)
    body = _big_request(70_000, "big")
    with Receiver(tmp_path / "big.duckdb") as rx:
        assert rx.max_queue_rows == 65_536
        response = httpx.post(f"{rx.url}/v1/traces", content=body, headers=PROTOBUF,
                              timeout=120)
        assert response.status_code == 200, _status(response)
        cursor = rx.writer.connection.cursor()
        try:
            assert cursor.execute("SELECT count(*), count(DISTINCT SpanId) FROM otel_traces"
                                  ).fetchone() == (70_000, 70_000)
        finally:
            cursor.close()


def test_a_writer_that_refuses_rows_gives_503_with_retry_after(receiver: Receiver) -> None:
    receiver.writer.close()  # a closed writer refuses like a full one: submit() is False

    response = httpx.post(
        f"{receiver.url}/v1/traces",
        content=encode_spans(_spans(1)).SerializeToString(),
        headers=PROTOBUF,
    )

    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    assert "busy" in _status(response)
    assert httpx.get(f"{receiver.url}/health").json()["busy"] == 1


# --- concurrency, restarts, processes ----------------------------------------------------------


def test_concurrent_senders_all_land_without_duplicates(receiver: Receiver) -> None:
    bodies = [
        [encode_spans(_spans(5, f"c{t}-{i}")).SerializeToString() for i in range(8)]
        for t in range(4)
    ]
    statuses: list[int] = []

    def send(mine: list[bytes]) -> None:
        with httpx.Client() as client:
            for body in mine:
                statuses.append(
                    client.post(f"{receiver.url}/v1/traces", content=body, headers=PROTOBUF)
                    .status_code
                )

    threads = [threading.Thread(target=send, args=(b,)) for b in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert statuses == [200] * 32
    rows = _live_traces(receiver)
    assert len(rows) == 32 * 10
    assert len({row[2] for row in rows}) == 320


def test_rows_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "restart.duckdb"
    with Receiver(path) as first:
        OTLPSpanExporter(endpoint=f"{first.url}/v1/traces").export(_spans(2, "before"))
    with Receiver(path) as second:
        assert _count(second) == 4
        OTLPSpanExporter(endpoint=f"{second.url}/v1/traces").export(_spans(3, "after"))
        assert _count(second) == 10


def test_port_in_use_is_a_one_line_error(receiver: Receiver, tmp_path: Path) -> None:
    with pytest.raises(KvscopeError, match=f"cannot listen on 127.0.0.1:{receiver.port}"):
        Receiver(tmp_path / "other.duckdb", port=receiver.port).start()


_LAUNCHER = (
    "import sys\n"
    "from kvscope.cli.serve import serve\n"
    "sys.exit(serve(sys.argv[1], '127.0.0.1', 0, 0))\n"
)


def test_sigterm_flushes_everything_acknowledged_and_the_file_is_locked_meanwhile(
    tmp_path: Path,
) -> None:
    path = tmp_path / "served.duckdb"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(path)],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert "receiving OTLP/HTTP on http://127.0.0.1:" in line, line
        url = line.split(" on ", 1)[1].split(",", 1)[0]

        with pytest.raises(StoreLockedError, match="another process holds this store"):
            Receiver(path).start()

        with httpx.Client() as client:
            for i in range(20):
                body = encode_spans(_spans(5, f"sig-{i}")).SerializeToString()
                response = client.post(f"{url}/v1/traces", content=body, headers=PROTOBUF)
                assert response.status_code == 200
        _stop_in_order(process)
    finally:
        _reap(process)

    assert query(path, "SELECT count(*), count(DISTINCT SpanId) FROM otel_traces") == [(200, 200)]


def test_a_recording_receiver_names_its_run_on_spans_that_name_none(tmp_path: Path) -> None:
    from kvscope import semconv
    from kvscope.collector.receiver import Receiver
    from kvscope.store.source import open_reader

    db = tmp_path / "runs.duckdb"
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("anonymous"):
        pass
    named = TracerProvider(resource=Resource.create({"service.name": "sim",
                                                     semconv.RUN_ID: "their-run"}))
    named.add_span_processor(SimpleSpanProcessor(memory))
    with named.get_tracer("t").start_as_current_span("named"):
        pass
    with Receiver(db, record_run=True) as receiver:
        exporter = OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces")
        assert exporter.export(memory.get_finished_spans()) is SpanExportResult.SUCCESS
        receiver.writer.flush(10)
    reader = open_reader(db)
    _, runs = reader.rows(Query("SELECT run_id, label, ended_at IS NOT NULL FROM kvscope_runs"))
    _, spans = reader.rows(Query("SELECT SpanName, ResourceAttributes[?] FROM otel_traces "
                                 "ORDER BY 1",
                                 positional=(semconv.RUN_ID,)))
    reader.close()
    assert len(runs) == 1 and runs[0][1].startswith("kvscope serve") and runs[0][2]
    assert spans == [("anonymous", runs[0][0]), ("named", "their-run")]


# --- a failed start leaves the store untouched (issue 22, defect 5) ----------------------------


def _busy_port() -> socket.socket:
    """A listening socket on an ephemeral loopback port (the port a second server cannot take)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_start_on_a_busy_port_creates_no_file(tmp_path: Path) -> None:
    path = tmp_path / "never.duckdb"
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        with pytest.raises(KvscopeError, match=f"cannot listen on 127.0.0.1:{port}"):
            Receiver(path, port=port, record_run=True).start()
        result = subprocess.run(
            [sys.executable, "-m", "kvscope.cli", "serve", "--db", str(path), "--port",
             str(port), "--grpc-port", "0"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_serve_dashboard_on_a_busy_dashboard_port_creates_no_file(tmp_path: Path) -> None:
    path = tmp_path / "never.duckdb"
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvscope.cli", "serve", "--db", str(path), "--port", "0",
             "--grpc-port", "0", "--dashboard", "--dashboard-port", str(port)],
            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_start_on_a_busy_port_adds_no_run_to_an_existing_store(tmp_path: Path) -> None:
    path = tmp_path / "existing.duckdb"
    with Receiver(path, record_run=True):
        pass
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        with pytest.raises(KvscopeError, match="cannot listen"):
            Receiver(path, port=port, record_run=True).start()
        result = subprocess.run(
            [sys.executable, "-m", "kvscope.cli", "serve", "--db", str(path), "--port",
             str(port), "--grpc-port", "0"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert result.returncode == 2, result.stderr
    assert _runs_recorded(path) == (1, 1)  # one run, ended: the failed start wrote nothing


# --- SIGTERM stops serve and serve --dashboard the same orderly way (issue 22, defect 1) -------


def _span_request(n: int, tag: str) -> bytes:
    """One OTLP protobuf request with ``n`` spans (enough to go through a Parquet batch)."""
    return encode_spans(_spans(n, tag)).SerializeToString()


@pytest.mark.parametrize("dashboard", [False, True], ids=["serve", "serve-dashboard"])
def test_sigterm_writes_every_acknowledged_span_and_ends_the_run(
    tmp_path: Path, dashboard: bool
) -> None:
    path = tmp_path / "served.duckdb"
    spill = tmp_path / "system-tmp"
    spill.mkdir()
    argv = [sys.executable, "-m", "kvscope.cli", "serve", "--db", str(path), "--port", "0",
            "--grpc-port", "0", "--run-label", "sigterm run"]
    if dashboard:
        argv += ["--dashboard", "--dashboard-port", "0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(spill)}
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    acknowledged = 0
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert "receiving OTLP/HTTP on http://127.0.0.1:" in line, line
        url = line.split(" on ", 1)[1].split(",", 1)[0]
        # Each request carries 300 turns (600 spans): inserted through a Parquet batch file.
        bodies = [_span_request(300, f"sigterm-{i}") for i in range(4)]
        lock = threading.Lock()

        def send(bodies: list[bytes]) -> None:
            nonlocal acknowledged
            with httpx.Client(timeout=30) as client:
                for _ in range(10):
                    for body in bodies:
                        response = client.post(f"{url}/v1/traces", content=body,
                                               headers=PROTOBUF)
                        assert response.status_code == 200
                        with lock:
                            acknowledged += 600

        senders = [threading.Thread(target=send, args=(bodies,)) for _ in range(2)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        # Both ways of serving answer Prometheus from the live ledger on the OTLP/HTTP port.
        scrape = httpx.get(f"{url}/metrics", timeout=60)
        assert scrape.status_code == 200
        assert scrape.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "kvscope_live_refreshes_total 1.0" in scrape.text
        # Stopped right after the last answer: rows acknowledged but maybe not yet written.
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        assert "stopped; everything acknowledged is written" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()

    assert acknowledged == 2 * 10 * 4 * 600
    assert not Path(f"{path}.wal").exists()
    assert query(path, "SELECT count(*) FROM otel_traces") == [(acknowledged,)]
    assert query(path, "SELECT count(*), count(ended_at), any_value(label) FROM kvscope_runs"
                 ) == [(1, 1, "sigterm run")]
    assert list(spill.iterdir()) == []  # nothing in the system temp dir (where they once went)
    assert list(tmp_path.rglob("kvscope-batch-*")) == []  # nor beside the store


def test_a_client_holding_a_partial_body_gets_408(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from kvscope.collector import receiver as receiver_module

    monkeypatch.setattr(receiver_module, "BODY_READ_TIMEOUT_S", 0.3)
    with Receiver(tmp_path / "slow.duckdb") as rx:
        answer = partial_body_answer("127.0.0.1", rx.port, "/v1/traces", "application/x-protobuf")
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]


# --- admission by bytes (issue 22: memory bounded by bytes, not rows) -------------------------


def _hold_partial_body(rx: Receiver, length: int) -> socket.socket:
    """A connection whose request announced ``length`` body bytes and sent two."""
    held = socket.create_connection(("127.0.0.1", rx.port))
    held.sendall(post_head("/v1/traces", length, "application/x-protobuf") + b"ab")
    deadline = time.monotonic() + 10
    while httpx.get(f"{rx.url}/health").json()["inflight_bytes"] != length:
        assert time.monotonic() < deadline, "the held body was never admitted"
        time.sleep(0.02)
    return held


def test_a_request_past_the_bytes_in_flight_waits_then_gets_503_with_retry_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvscope.collector import receiver as receiver_module

    monkeypatch.setattr(receiver_module, "ADMISSION_WAIT_S", 0.5)
    body = encode_spans(_spans(1)).SerializeToString()
    with Receiver(tmp_path / "budget.duckdb", max_inflight_bytes=1 << 20) as rx:
        with _hold_partial_body(rx, 1 << 20):
            response = httpx.post(f"{rx.url}/v1/traces", content=body, headers=PROTOBUF)
            assert response.status_code == 503
            assert response.headers["Retry-After"] == "1"
            assert "max_inflight_bytes" in _status(response)

            # A request that arrives while the bytes are held waits, and is taken when they
            # are given back (the held client goes away).
            answers: list[int] = []
            waiting = threading.Thread(target=lambda: answers.append(httpx.post(
                f"{rx.url}/v1/traces", content=body, headers=PROTOBUF).status_code))
            monkeypatch.setattr(receiver_module, "ADMISSION_WAIT_S", 30.0)
            waiting.start()
            time.sleep(0.3)
            assert not answers
        waiting.join(30)
        assert answers == [200]
        assert _count(rx) == 2
        health = httpx.get(f"{rx.url}/health").json()
        assert health["busy"] == 1
        assert health["inflight_bytes"] == 0
        assert health["peak_inflight_bytes"] == 1 << 20


def test_a_gzip_body_is_admitted_by_its_inflated_size(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from receiver_memory import one_span_request

    # 2 MiB inflated, a few KiB on the wire: valid OTLP with a field the schema does not define.
    body = gzip.compress(one_span_request(1, 2 << 20, stored=False))
    assert len(body) < 64 * 1024
    headers = {**PROTOBUF, "Content-Encoding": "gzip"}
    with Receiver(tmp_path / "gzip.duckdb", max_inflight_bytes=1 << 20,
                  max_request_bytes=4 << 20) as rx:
        with _hold_partial_body(rx, 512 * 1024):
            response = httpx.post(f"{rx.url}/v1/traces", content=body, headers=headers)
            assert response.status_code == 503
            assert "inflated body does not fit" in _status(response)
        deadline = time.monotonic() + 40
        while httpx.get(f"{rx.url}/health").json()["inflight_bytes"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Alone, it is taken even though it inflates past the budget.
        response = httpx.post(f"{rx.url}/v1/traces", content=body, headers=headers)
        assert response.status_code == 200, _status(response)
        assert _count(rx) == 1


def _slow_sender(rx: Receiver, length: int | None) -> socket.socket:
    """A connection sending a ``length``-byte body (chunked when None) two bytes at a time:
    it has sent two bytes when this returns, and sends no more until closed."""
    held = socket.create_connection(("127.0.0.1", rx.port))
    if length is None:
        held.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/x-protobuf\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n")
    else:
        held.sendall(post_head("/v1/traces", length, "application/x-protobuf") + b"ab")
    return held


def test_two_slow_uploads_hold_only_what_they_sent_and_other_exporters_are_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvscope.collector import receiver as receiver_module
    from kvscope.collector.otlp_admission import UNRECEIVED_ALLOWANCE_BYTES

    # Each slow sender once held its whole announced body (or max_request_bytes when chunked):
    # two of them took the budget (16 MiB), and every other exporter waited, then got 503.
    monkeypatch.setattr(receiver_module, "ADMISSION_WAIT_S", 1.0)
    spans = _spans(2)
    body = encode_spans(spans).SerializeToString()
    with Receiver(tmp_path / "slow.duckdb", max_request_bytes=8 << 20,
                  max_inflight_bytes=16 << 20) as rx:
        with _slow_sender(rx, 8 << 20), _slow_sender(rx, None):
            deadline = time.monotonic() + 10
            while httpx.get(f"{rx.url}/health").json()["inflight_bytes"] == 0:
                assert time.monotonic() < deadline, "the slow uploads were never admitted"
                time.sleep(0.02)
            held = httpx.get(f"{rx.url}/health").json()["inflight_bytes"]
            assert held == 2 * (UNRECEIVED_ALLOWANCE_BYTES + 2)  # sent, and one step ahead
            answers = [httpx.post(f"{rx.url}/v1/traces", content=body, headers=PROTOBUF,
                                  timeout=10).status_code for _ in range(5)]
            assert answers == [200] * 5
        assert _count(rx) == 5 * len(spans)
        assert httpx.get(f"{rx.url}/health").json()["busy"] == 0


def test_large_requests_each_holding_part_of_their_body_do_not_wait_for_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four 6 MiB bodies against a 2 MiB budget: each is admitted on its first step, then the
    budget is full of partial bodies. The oldest grows at once, so they finish one by one
    instead of all waiting for room until answered 503."""
    sys.path.insert(0, str(Path(__file__).parent))
    from receiver_memory import one_span_request

    from kvscope.collector import receiver as receiver_module

    monkeypatch.setattr(receiver_module, "ADMISSION_WAIT_S", 30.0)
    bodies = [one_span_request(k, 6 << 20, stored=False) for k in range(4)]
    answers: list[int] = []
    with Receiver(tmp_path / "parts.duckdb", max_request_bytes=8 << 20,
                  max_inflight_bytes=2 << 20) as rx:
        senders = [threading.Thread(target=lambda b=b: answers.append(httpx.post(
            f"{rx.url}/v1/traces", content=b, headers=PROTOBUF, timeout=60).status_code))
            for b in bodies]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(90)
        assert sorted(answers) == [200] * 4
        assert _count(rx) == 4
        assert httpx.get(f"{rx.url}/health").json()["inflight_bytes"] == 0


def test_a_malformed_request_is_one_warning_line_not_a_traceback(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    bad = (b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
           b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    with caplog.at_level(logging.WARNING, logger="aiohttp.server"):
        for request in bad:
            with socket.create_connection(("127.0.0.1", receiver.port)) as sock:
                sock.sendall(request)
                sock.settimeout(10)
                assert sock.recv(4096).startswith(b"HTTP/1.0 400")
        deadline = time.monotonic() + 5
        while len(caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert [r.levelname for r in records] == ["WARNING", "WARNING"]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in records)
    assert "malformed HTTP request (400, message: Invalid character in Content-Length:)" \
        in records[0].getMessage()


# --- attribute values past the stored maximum ---------------------------------------------------


def test_values_past_the_maximum_are_stored_cut_marked_and_counted(tmp_path: Path) -> None:
    """1 MiB attribute values (span, event, link and resource) are stored cut to
    MAX_VALUE_CHARS with the mark, the answer's partial_success says how many (nothing
    rejected), and the receiver counts them: what a sender's values may add to the store is bounded
    (DuckDB keeps the memory of what it stored; no memory_limit bounds it)."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ProtoResource

    from kvscope.collector.otlp_decode import MAX_VALUE_CHARS, TRUNCATED_MARK

    def big(key: str, fill: str) -> KeyValue:
        return KeyValue(key=key, value=AnyValue(string_value=fill * (1 << 20)))

    spans = [Span(trace_id=bytes(range(1, 17)), span_id=bytes([9, 9, 9, 9, 9, 9, 9, i]),
                  name=f"span-{i}", start_time_unix_nano=1, end_time_unix_nano=2,
                  attributes=[big("payload", "xyzw"[i % 4]),
                              KeyValue(key="small", value=AnyValue(string_value="kept"))],
                  events=[Span.Event(time_unix_nano=1, name="e", attributes=[big("ev", "e")])],
                  links=[Span.Link(trace_id=bytes(range(1, 17)), span_id=bytes(range(1, 9)),
                                   attributes=[big("ln", "l")])])
             for i in range(8)]
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=ProtoResource(attributes=[big("res", "r")]),
        scope_spans=[ScopeSpans(spans=spans)])])
    with Receiver(tmp_path / "big.duckdb", max_request_bytes=64 << 20) as rx:
        response = httpx.post(f"{rx.url}/v1/traces", content=request.SerializeToString(),
                              headers=PROTOBUF, timeout=60)
        assert response.status_code == 200
        partial = ExportTraceServiceResponse.FromString(response.content).partial_success
        # Distinct values: 4 span payloads, 1 event, 1 resource, 8 links (one per span).
        assert partial.rejected_spans == 0
        assert partial.error_message == (f"14 attribute values longer than {MAX_VALUE_CHARS} "
                                         "characters stored truncated"), partial.error_message
        assert rx.writer.flush(10)
        con = rx.writer.connection.cursor()
        rows = con.execute(
            "SELECT SpanAttributes['payload'], SpanAttributes['small'], "
            "ResourceAttributes['res'], Events[1].Attributes['ev'], Links[1].Attributes['ln'], "
            "length(SpanAttributes::VARCHAR) + length(ResourceAttributes::VARCHAR) "
            "+ length(Events::VARCHAR) + length(Links::VARCHAR) FROM otel_traces").fetchall()
        counted = rx.stats.values_truncated  # serve's /metrics: ..._values_truncated_total
    assert len(rows) == 8
    for payload, small, res, ev, ln, stored in rows:
        assert small == "kept"
        for value in (payload, res, ev, ln):
            assert len(value) == MAX_VALUE_CHARS + len(TRUNCATED_MARK)
            assert value.endswith(TRUNCATED_MARK)
        assert stored < 5 * (MAX_VALUE_CHARS + 1024)  # 4 cut values, not 4 MiB
    assert counted == 14


def test_the_receivers_store_is_held_to_store_memory_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvscope serve`'s store keeps DuckDB to store_memory_limit, as readers do (without a
    limit DuckDB keeps up to 80 % of RAM of the blocks its queries read)."""
    def limit_of(rx: Receiver) -> str:
        cursor = rx.writer.connection.cursor()
        try:
            row = cursor.execute("SELECT current_setting('memory_limit')").fetchone()
        finally:
            cursor.close()
        assert row is not None
        return str(row[0])

    expected = duckdb.connect()
    try:
        limits = {}
        for amount in ("1GB", "4GB"):
            expected.execute(f"SET memory_limit = '{amount}'")
            row = expected.execute("SELECT current_setting('memory_limit')").fetchone()
            assert row is not None
            limits[amount] = str(row[0])
    finally:
        expected.close()
    monkeypatch.setenv("KVSCOPE_STORE_MEMORY_LIMIT", "1GB")
    with Receiver(tmp_path / "limited.duckdb") as rx:
        assert limit_of(rx) == limits["1GB"]
    monkeypatch.delenv("KVSCOPE_STORE_MEMORY_LIMIT")
    with Receiver(tmp_path / "default.duckdb") as rx:
        assert limit_of(rx) == limits["4GB"]  # the setting's default
