"""OTLP/gRPC into ``kvscope serve``: the official gRPC exporters and raw gRPC calls on 127.0.0.1,
real store files, and the same refusals as OTLP/HTTP with gRPC status codes."""

from __future__ import annotations

import gzip
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
    OTLPMetricExporter as GrpcMetricExporter,
)
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from opentelemetry.sdk.metrics.export import MetricExportResult
from opentelemetry.sdk.trace.export import SpanExportResult

from kvscope import semconv
from kvscope.collector.receiver import Receiver
from kvscope.errors import KvscopeError, StoreError
from tests.stores import query

sys.path.insert(0, str(Path(__file__).parent))
from test_receiver import (  # noqa: E402
    _busy_port,
    _in_process,
    _live_traces,
    _metrics_in_process,
    _metrics_received,
    _reap,
    _runs_recorded,
    _sample_metrics,
    _spans,
    _stop_in_order,
)

ROOT = Path(__file__).resolve().parents[2]
TRACE_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
LIMIT = 256 * 1024
# The OTLP exporters' default timeout (OTEL_EXPORTER_OTLP_TIMEOUT), seconds.
EXPORT_TIMEOUT_S = 10


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "received.duckdb", grpc_port=0, max_request_bytes=LIMIT) as rx:
        yield rx


def _raw_export(rx: Receiver, body: bytes, compression: grpc.Compression | None = None
                ) -> ExportTraceServiceResponse:
    """One TraceService/Export call carrying ``body`` as it is (a gRPC client sending bytes)."""
    with grpc.insecure_channel(f"127.0.0.1:{rx.grpc_port}") as channel:
        call = channel.unary_unary(
            TRACE_EXPORT, request_serializer=None,
            response_deserializer=ExportTraceServiceResponse.FromString,
        )
        response: ExportTraceServiceResponse = call(body, timeout=10, compression=compression)
        return response


def _assert_stored_as_in_process(
    receiver: Receiver, tmp_path: Path, exporter: GrpcSpanExporter | GrpcMetricExporter,
    data: Any, success: SpanExportResult | MetricExportResult,
    received: Callable[[Receiver], list[tuple[Any, ...]]],
    in_process: Callable[[Path, Any], list[tuple[Any, ...]]], *, rows: int,
) -> None:
    """Export ``data`` with ``exporter`` (answered ``success``) and shut it down; ``receiver``
    then holds ``rows`` rows, those the in-process exporter stores for the same data."""
    assert exporter.export(data) is success
    exporter.shutdown()

    stored = received(receiver)
    assert len(stored) == rows
    assert stored == in_process(tmp_path, data)


# --- the official exporters --------------------------------------------------------------------


@pytest.mark.parametrize("compression", [grpc.Compression.NoCompression, grpc.Compression.Gzip])
def test_official_grpc_span_exporter_rows_equal_the_in_process_rows(
    receiver: Receiver, tmp_path: Path, compression: grpc.Compression
) -> None:
    # The endpoint as vLLM's --otlp-traces-endpoint passes it: http:// means no TLS.
    exporter = GrpcSpanExporter(endpoint=receiver.grpc_url, compression=compression)
    _assert_stored_as_in_process(
        receiver, tmp_path, exporter, _spans(4), SpanExportResult.SUCCESS,
        _live_traces, _in_process, rows=8)
    assert receiver.stats.spans_accepted == 8


def test_official_grpc_metric_exporter_rows_equal_the_in_process_rows(
    receiver: Receiver, tmp_path: Path
) -> None:
    exporter = GrpcMetricExporter(endpoint=receiver.grpc_url, compression=grpc.Compression.Gzip)
    _assert_stored_as_in_process(
        receiver, tmp_path, exporter, _sample_metrics(retained=False), MetricExportResult.SUCCESS,
        _metrics_received, _metrics_in_process, rows=1)
    assert receiver.stats.points_rejected == 1


def test_http_and_grpc_land_in_one_store(receiver: Receiver) -> None:
    assert HttpSpanExporter(endpoint=f"{receiver.url}/v1/traces").export(
        _spans(1, "over-http")) is SpanExportResult.SUCCESS
    # The exporter exactly as vLLM 0.33.0 builds it for --otlp-traces-endpoint with its default
    # protocol (vllm/tracing/otel.py:95-97: OTLPGrpcExporter(endpoint=endpoint, insecure=True)).
    vllm_like = GrpcSpanExporter(endpoint=f"127.0.0.1:{receiver.grpc_port}", insecure=True)
    assert vllm_like.export(_spans(2, "over-grpc")) is SpanExportResult.SUCCESS
    vllm_like.shutdown()

    rows = receiver.writer.flush(10) and receiver.writer.connection.cursor().execute(
        "SELECT SpanAttributes[?], count(*) FROM otel_traces GROUP BY 1 ORDER BY 1 NULLS FIRST",
        [semconv.GEN_AI_CONVERSATION_ID]).fetchall()
    assert rows == [(None, 3), ("over-grpc", 2), ("over-http", 1)]


# --- partial success and refusals --------------------------------------------------------------


def test_bad_ids_get_partial_success(receiver: Receiver) -> None:
    good = Span(trace_id=bytes(range(1, 17)), span_id=bytes(range(1, 9)), name="good")
    bad = Span(trace_id=b"short", span_id=bytes(range(1, 9)), name="bad")
    request = ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[good, bad])])]
    )
    with grpc.insecure_channel(f"127.0.0.1:{receiver.grpc_port}") as channel:
        response = TraceServiceStub(channel).Export(request, timeout=10)

    assert response.partial_success.rejected_spans == 1
    assert "traceId is 5 bytes, expected 16" in response.partial_success.error_message
    assert [row[5] for row in _live_traces(receiver)] == ["good"]


def _refusal(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


def test_refused_calls_get_grpc_status_codes_and_keep_stored_rows(receiver: Receiver) -> None:
    good = encode_spans(_spans(2)).SerializeToString()
    _raw_export(receiver, good)
    cases: list[tuple[str, bytes, grpc.Compression | None, grpc.StatusCode, str]] = [
        ("garbage", b"\xff\xff\xff", None, grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
        ("truncated", good[: len(good) // 2], None, grpc.StatusCode.INVALID_ARGUMENT,
         "truncated"),
        # grpc enforces max_request_bytes itself, on the wire and after inflating.
        ("oversized", b"\x00" * (LIMIT + 1), None, grpc.StatusCode.RESOURCE_EXHAUSTED,
         f"larger than max ({LIMIT + 1} vs. {LIMIT})"),
        ("gzip bomb", b"\x00" * (64 * LIMIT), grpc.Compression.Gzip,
         grpc.StatusCode.RESOURCE_EXHAUSTED, "Decompressed message larger than max"),
    ]
    for name, body, compression, code, reason in cases:
        error = _refusal(lambda b=body, c=compression: _raw_export(receiver, b, c))  # type: ignore[misc]
        assert error.code() is code, (name, error.code(), error.details())
        assert reason in (error.details() or ""), (name, error.details())

    assert len(_live_traces(receiver)) == 4
    health = httpx.get(f"{receiver.url}/health").json()
    assert health["status"] == "ok"
    assert health["rows_written"] == 4
    # The size refusals of grpc's own limit are answered before the receiver sees the call.
    assert health["bad_requests"] == 2


def test_a_gzip_body_is_inflated_by_grpc(receiver: Receiver) -> None:
    body = encode_spans(_spans(3)).SerializeToString()
    assert len(gzip.compress(body)) < len(body)

    _raw_export(receiver, body, grpc.Compression.Gzip)

    assert len(_live_traces(receiver)) == 6


def test_a_request_larger_than_the_whole_queue_is_stored(tmp_path: Path) -> None:
    # It was refused RESOURCE_EXHAUSTED: the exporters' batch was lost.
    with Receiver(tmp_path / "small.duckdb", grpc_port=0, max_queue_rows=3) as rx:
        _raw_export(rx, encode_spans(_spans(2)).SerializeToString())
        assert len(_live_traces(rx)) == 4
        assert rx.stats.too_large == 0


def test_bytes_in_flight_on_http_make_grpc_unavailable_with_retry_info(tmp_path: Path) -> None:
    # Both transports admit from one budget: an HTTP body being received holds 1 MiB of it.
    with Receiver(tmp_path / "budget.duckdb", grpc_port=0,
                  max_inflight_bytes=1 << 20) as rx, socket.create_connection(
            ("127.0.0.1", rx.port)) as held:
        held.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/x-protobuf\r\n"
                     b"Content-Length: 1048576\r\n\r\nab")
        deadline = time.monotonic() + 10
        while httpx.get(f"{rx.url}/health").json()["inflight_bytes"] != 1 << 20:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        body = encode_spans(_spans(1)).SerializeToString()

        error = _refusal(lambda: _raw_export(rx, body))

        assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert "max_inflight_bytes" in (error.details() or "")
        trailers = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
        assert RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"]).retry_delay.seconds == 1
        assert rx.stats.busy == 1
        held.close()
        # Once the held body is gone its bytes are free again.
        deadline = time.monotonic() + 40
        while httpx.get(f"{rx.url}/health").json()["inflight_bytes"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _raw_export(rx, body)
        assert len(_live_traces(rx)) == 2


def test_a_busy_writer_is_unavailable_with_retry_info(receiver: Receiver) -> None:
    receiver.writer.close()  # a closed writer refuses like a full one: submit() is False

    error = _refusal(lambda: _raw_export(receiver, encode_spans(_spans(1)).SerializeToString()))

    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert "busy" in (error.details() or "")
    trailers = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
    retry = RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"])
    assert retry.retry_delay.seconds == 1
    assert receiver.stats.busy == 1


def test_grpc_port_in_use_is_a_one_line_error(receiver: Receiver, tmp_path: Path) -> None:
    with pytest.raises(KvscopeError, match=f"cannot listen for OTLP/gRPC on 127.0.0.1:"
                                           f"{receiver.grpc_port}"):
        Receiver(tmp_path / "other.duckdb", grpc_port=receiver.grpc_port).start()
    # The HTTP listener that the failed start had opened is closed again, and the file free.
    with Receiver(tmp_path / "other.duckdb", grpc_port=0) as again:
        assert again.grpc_port


def _serve(path: Path, grpc_port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "serve", "--db", str(path), "--port", "0",
         "--grpc-port", str(grpc_port), *extra],
        capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_a_start_on_a_busy_grpc_port_creates_no_file(tmp_path: Path) -> None:
    # Both ports are bound before the store is opened: a gRPC port in use stops the start
    # before the file exists, for Receiver, plain serve and serve --dashboard alike.
    path = tmp_path / "never.duckdb"
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        refusal = f"cannot listen for OTLP/gRPC on 127.0.0.1:{port}"
        with pytest.raises(KvscopeError, match=refusal):
            Receiver(path, grpc_port=port, record_run=True).start()
        for extra in ([], ["--dashboard", "--dashboard-port", "0"]):
            result = _serve(path, port, *extra)
            assert result.returncode == 2, result.stderr
            assert refusal in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_start_on_a_busy_grpc_port_adds_no_run_to_an_existing_store(tmp_path: Path) -> None:
    path = tmp_path / "existing.duckdb"
    with Receiver(path, grpc_port=0, record_run=True):
        pass
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        with pytest.raises(KvscopeError, match="cannot listen for OTLP/gRPC"):
            Receiver(path, grpc_port=port, record_run=True).start()
        assert _serve(path, port).returncode == 2
    assert _runs_recorded(path) == (1, 1)  # one run, ended: the failed start wrote nothing


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_store_refused_after_both_ports_are_bound_releases_both(tmp_path: Path) -> None:
    path = tmp_path / "foreign.duckdb"
    path.write_bytes(b"not a store")
    http_port, grpc_port = _free_port(), _free_port()
    with pytest.raises(StoreError):
        Receiver(path, port=http_port, grpc_port=grpc_port, record_run=True).start()
    assert path.read_bytes() == b"not a store"
    # Neither listener outlives the failed start: a new receiver takes both ports at once.
    with Receiver(tmp_path / "ok.duckdb", port=http_port, grpc_port=grpc_port) as again:
        assert (again.port, again.grpc_port) == (http_port, grpc_port)


# --- a served process --------------------------------------------------------------------------

_LAUNCHER = (
    "import sys\n"
    "from kvscope.cli.serve import serve\n"
    "sys.exit(serve(sys.argv[1], '127.0.0.1', 0, 0))\n"
)


def _serve_in_a_process(path: Path) -> subprocess.Popen[str]:
    """``kvscope serve`` on ``path`` in a child process, both transports on free ports."""
    return subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(path)], stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _urls(process: subprocess.Popen[str]) -> tuple[str, str]:
    """The OTLP/HTTP and OTLP/gRPC addresses a served process says it receives on."""
    assert process.stderr is not None
    line = process.stderr.readline()
    assert "receiving OTLP/HTTP on http://127.0.0.1:" in line, line
    return (line.split("OTLP/HTTP on ", 1)[1].split(",", 1)[0],
            line.split("OTLP/gRPC on ", 1)[1].split(",", 1)[0])


def _refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_sigterm_stops_both_listeners_and_writes_what_both_acknowledged(tmp_path: Path) -> None:
    path = tmp_path / "served.duckdb"
    process = _serve_in_a_process(path)
    try:
        http_url, grpc_url = _urls(process)
        http = HttpSpanExporter(endpoint=f"{http_url}/v1/traces")
        over_grpc = GrpcSpanExporter(endpoint=grpc_url, compression=grpc.Compression.Gzip)
        for i in range(10):
            assert http.export(_spans(5, f"http-{i}")) is SpanExportResult.SUCCESS
            assert over_grpc.export(_spans(5, f"grpc-{i}")) is SpanExportResult.SUCCESS
        over_grpc.shutdown()
        _stop_in_order(process)
    finally:
        _reap(process)

    assert _refuses_connections(int(http_url.rsplit(":", 1)[1]))
    assert _refuses_connections(int(grpc_url.rsplit(":", 1)[1]))
    assert query(path, "SELECT count(*), count(DISTINCT SpanId) FROM otel_traces") == [(200, 200)]
    assert query(path, "SELECT count(*) FROM kvscope_runs WHERE ended_at IS NOT NULL") == [(1,)]


def test_sigterm_while_both_transports_export_keeps_every_acknowledged_span(
    tmp_path: Path,
) -> None:
    path = tmp_path / "busy.duckdb"
    process = _serve_in_a_process(path)
    acknowledged: list[str] = []
    stop = threading.Event()

    def send(name: str, exporter: Any) -> None:
        for i in range(10_000):
            conversation = f"{name}-{i}"
            if stop.is_set() or exporter.export(_spans(2, conversation)) is not \
                    SpanExportResult.SUCCESS:
                return
            acknowledged.append(conversation)

    # The exporters' own timeout, not a short one: each answer waits for a commit, and on a
    # loaded machine (load ~40 on 2 cores) the first ones took over 2 s, so senders with a 2 s
    # timeout gave up before the stop and the test failed with nothing acknowledged. After the
    # stop, shutdown() ends their retries against the stopped server.
    exporters: list[Any] = []
    senders: list[threading.Thread] = []
    try:
        http_url, grpc_url = _urls(process)
        exporters += [GrpcSpanExporter(endpoint=grpc_url, timeout=EXPORT_TIMEOUT_S,
                                       compression=grpc.Compression.Gzip) for _ in range(2)]
        exporters.append(HttpSpanExporter(endpoint=f"{http_url}/v1/traces",
                                          timeout=EXPORT_TIMEOUT_S))
        senders += [threading.Thread(target=send, args=(name, exporter))
                    for name, exporter in zip(["grpc0", "grpc1", "http"], exporters,
                                              strict=True)]
        for thread in senders:
            thread.start()
        while len(acknowledged) < 30 and all(t.is_alive() for t in senders):
            time.sleep(0.05)
        # Stopped while all three are sending: what each was told is stored must be stored.
        assert all(t.is_alive() for t in senders), "a sender gave up before the stop"
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        stop.set()
        for exporter in exporters:
            exporter.shutdown()
        for thread in senders:
            thread.join(30)
        if process.poll() is None:
            process.kill()
            process.wait()

    stored = dict(query(path, "SELECT SpanAttributes[?], count(*) FROM otel_traces GROUP BY 1",
                        [semconv.GEN_AI_CONVERSATION_ID]))
    assert len(acknowledged) >= 30
    assert {name.split("-")[0] for name in acknowledged} >= {"grpc0", "grpc1", "http"}
    # OTLP delivery is at least once (an exporter retries a call whose answer it lost), so
    # an acknowledged conversation has at least its two turn spans.
    missing = [c for c in acknowledged if stored.get(c, 0) < 2]
    assert missing == []


def test_grpc_serves_as_many_rpcs_at_once_as_the_budget_holds_whole() -> None:
    """grpc reads a message whole before admission sees it: 16 RPCs of 64 MiB once held 1 GiB
    beyond a 128 MiB budget (7.9 GB peak under 24 concurrent 60 MiB requests)."""
    from kvscope.collector.otlp_grpc import GrpcListener

    mib = 1 << 20
    assert GrpcListener(64 * mib, 128 * mib).max_concurrent_rpcs == 2  # the defaults
    assert GrpcListener(64 * mib, 32 * mib).max_concurrent_rpcs == 2  # one alone, one waiting
    assert GrpcListener(1 * mib, 128 * mib).max_concurrent_rpcs == 16  # small requests


def _hpack(headers: list[tuple[str, str]]) -> bytes:
    """Headers as HPACK literals without indexing, no Huffman (lengths below 127)."""
    block = bytearray()
    for name, value in headers:
        block += b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()
    return bytes(block)


def _stalled_calls(port: int, calls: int) -> socket.socket:
    """An HTTP/2 connection opening ``calls`` TraceService/Export calls whose message never
    comes (headers only): what a sender too slow to finish its upload looks like to grpc."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    sock.settimeout(10)
    while True:  # the server's SETTINGS, then acknowledged
        head = sock.recv(9, socket.MSG_WAITALL)
        length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
        if length:
            sock.recv(length, socket.MSG_WAITALL)
        if kind == 0x4 and not flags & 0x1:
            break
    sock.sendall(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00")
    block = _hpack([(":method", "POST"), (":scheme", "http"), (":path", TRACE_EXPORT),
                    (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
                    ("te", "trailers")])
    for stream in range(1, 2 * calls, 2):  # END_HEADERS, no END_STREAM: the message is owed
        sock.sendall(len(block).to_bytes(3, "big") + b"\x01\x04" + stream.to_bytes(4, "big")
                     + block)
    return sock


def test_concurrent_exports_wait_for_a_slot_instead_of_being_refused(tmp_path: Path) -> None:
    """16 exporters at once against a budget that holds two requests: grpc reads two messages
    at a time and the other calls wait for a slot. Before, grpc refused 14 of the 16 with
    RESOURCE_EXHAUSTED (its own limit, with no RetryInfo: the Go exporters drop such a batch)."""
    body = encode_spans(_spans(400)).SerializeToString()
    with Receiver(tmp_path / "wait.duckdb", grpc_port=0, max_request_bytes=4 * len(body),
                  max_inflight_bytes=8 * len(body)) as rx:
        refused: list[Any] = []

        def export() -> None:
            try:
                _raw_export(rx, body)
            except grpc.RpcError as error:
                refused.append(error.code())

        threads = [threading.Thread(target=export) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert refused == []
        assert rx._server._grpc.slots.slots == 2  # type: ignore[union-attr]
        assert len(_live_traces(rx)) == 16 * 2 * 400


def test_a_sender_too_slow_loses_its_slot(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A call holds its slot from its headers on: three calls whose message never comes (two
    hold the slots, one waits) lose them after the body timeout, as OTLP/HTTP answers 408, and
    the export waiting behind them is served; every slot comes back."""
    from kvscope.collector import otlp_grpc

    monkeypatch.setattr(otlp_grpc, "BODY_READ_TIMEOUT_S", 1.0)
    with Receiver(tmp_path / "slots.duckdb", grpc_port=0, max_request_bytes=LIMIT,
                  max_inflight_bytes=2 * LIMIT) as rx:
        assert rx.grpc_port is not None
        slots = rx._server._grpc.slots  # type: ignore[union-attr]
        with _stalled_calls(rx.grpc_port, 3):
            deadline = time.monotonic() + 10
            while slots.waiting < 1:  # two stalled calls hold the slots, the third waits
                assert time.monotonic() < deadline
                time.sleep(0.01)
            body = encode_spans(_spans(3)).SerializeToString()
            started = time.monotonic()
            _raw_export(rx, body)  # waits for a slot the stalled calls lose, then is served
            waited = time.monotonic() - started
        assert slots.read_timeouts >= 2
        assert 0.5 < waited < 9
        one = len(_live_traces(rx))
        assert one > 0
        # Every slot came back: as many exports at once as there are slots are served at once.
        done = [threading.Thread(target=_raw_export, args=(rx, body)) for _ in range(4)]
        for thread in done:
            thread.start()
        for thread in done:
            thread.join(20)
        assert len(_live_traces(rx)) == 5 * one
        assert slots.waiting == 0
