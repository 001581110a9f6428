"""Big-body load on ``kvscope serve``: many concurrent one-span requests of many MiB each.

Shared by ``test_receiver_memory.py`` and ``tests/benchmarks/bench_receiver_memory.py``. The
receiver runs as the real CLI in its own process on 127.0.0.1 with the limits given through its
environment (``KVSCOPE_MAX_REQUEST_BYTES``, ``KVSCOPE_MAX_INFLIGHT_BYTES``); the senders retry a
503 as the OTLP exporters do, and the process's peak resident memory (``VmHWM``) is read from
``/proc`` before it is stopped. Linux only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from served import Served

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def one_span_request(k: int, big_bytes: int, *, stored: bool = True) -> bytes:
    """A valid OTLP request of one span and ``big_bytes`` more bytes.

    ``stored``: the bytes are the value of one attribute (the receiver stores them: the shape
    of the issue's 60 MiB requests). Otherwise they are a field of the request that the OTLP
    schema does not define (protobuf readers skip such fields, as the receiver does), so the
    request weighs the same on the wire and in the receiver while it is handled but stores a
    few bytes: what the receiver holds for requests is then measured apart from what DuckDB
    holds for the rows stored.
    """
    attributes = ([KeyValue(key="blob", value=AnyValue(
        string_value=chr(ord("a") + k % 26) * big_bytes))] if stored else [])
    span = Span(trace_id=(k + 1).to_bytes(16, "big"), span_id=(k + 1).to_bytes(8, "big"),
                name="big", start_time_unix_nano=1_700_000_000_000_000_000,
                end_time_unix_nano=1_700_000_000_000_001_000, attributes=attributes)
    body = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        scope_spans=[ScopeSpans(spans=[span])])]).SerializeToString()
    if stored:
        return body
    # Field 15, length-delimited: undefined in ExportTraceServiceRequest.
    return body + b"\x7a" + _varint(big_bytes) + bytes([ord("a") + k % 26]) * big_bytes


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


@dataclass
class Load:
    """What one big-body load did."""

    baseline_rss_mib: float
    peak_rss_mib: float
    answered_200: int
    retried_503: int
    stored_spans: int
    peak_inflight_bytes: int
    seconds: float
    # Every final answer that was not 200: "status: first bytes of the body", counted.
    other_answers: dict[str, int]
    # Resident memory ``idle_s`` after the load ended.
    idle_rss_mib: float = 0.0


def _grpc_sender(target: str, max_bytes: int) -> Callable[[bytes], tuple[int, bytes]]:
    """A function sending one body over OTLP/gRPC: (HTTP-like status, details) of the answer
    (503 for a refusal the exporters retry: UNAVAILABLE or RESOURCE_EXHAUSTED)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub

    channel = grpc.insecure_channel(target, options=[
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes)])
    stub = TraceServiceStub(channel)

    def send(body: bytes) -> tuple[int, bytes]:
        try:
            stub.Export(ExportTraceServiceRequest.FromString(body), timeout=120)
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                return 503, b""
            return 500, f"{code}: {exc.details()}".encode()
        return 200, b""
    return send


def big_body_load(db: Path, *, requests: int, big_bytes: int, max_request_bytes: int,
                  max_inflight_bytes: int, stored: bool = True,
                  transport: str = "http", idle_s: float = 0.0) -> Load:
    """Send ``requests`` one-span requests at once to a fresh ``kvscope serve`` over
    ``transport`` (``http`` or ``grpc``); measure it. ``idle_s``: wait this long after the
    load and read the resident memory then too (``idle_rss_mib``)."""
    served = Served(db, env={"KVSCOPE_MAX_REQUEST_BYTES": str(max_request_bytes),
                             "KVSCOPE_MAX_INFLIGHT_BYTES": str(max_inflight_bytes)})
    process, url = served.process, served.url
    try:
        # Warm up (imports, the decoder, the first insert) before the baseline is read.
        assert httpx.post(f"{url}/v1/traces", content=one_span_request(10**6, 1000),
                          headers=PROTOBUF).status_code == 200
        baseline = _status_kib(process.pid, "VmRSS")
        bodies = [one_span_request(k, big_bytes, stored=stored) for k in range(requests)]
        answered: list[int] = []
        others: dict[str, int] = {}
        retried = [0]
        lock = threading.Lock()
        go = threading.Barrier(requests)

        grpc_send = (_grpc_sender(served.grpc_target, max_request_bytes + (1 << 20))
                     if transport == "grpc" else None)

        def send(body: bytes) -> None:
            go.wait()
            with httpx.Client(timeout=120) as client:
                while True:
                    if grpc_send is not None:
                        status, content = grpc_send(body)
                    else:
                        response = client.post(f"{url}/v1/traces", content=body,
                                               headers=PROTOBUF)
                        status, content = response.status_code, response.content
                    if status != 503:
                        break
                    with lock:
                        retried[0] += 1
                    time.sleep(0.2)  # Retry-After says 1 s; shorter keeps the run short
                with lock:
                    answered.append(status)
                    if status != 200:
                        key = f"{status}: {content[:120]!r}"
                        others[key] = others.get(key, 0) + 1

        start = time.perf_counter()
        threads = [threading.Thread(target=send, args=(body,)) for body in bodies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        seconds = time.perf_counter() - start
        del bodies
        peak = _status_kib(process.pid, "VmHWM")
        time.sleep(idle_s)
        idle = _status_kib(process.pid, "VmRSS")
        health = httpx.get(f"{url}/health").json()
        served.stop()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        stored = con.execute("SELECT count(*) FROM otel_traces WHERE SpanName = 'big'"
                             ).fetchone()
    finally:
        con.close()
    return Load(baseline / 1024, peak / 1024, answered.count(200), retried[0],
                int(stored[0]) if stored else 0, int(health["peak_inflight_bytes"]), seconds,
                others, idle / 1024)
