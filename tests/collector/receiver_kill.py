"""Kill trials: ``kvscope serve`` SIGKILLed mid-stream, then every acknowledged span looked up.

Shared by ``test_receiver_kill.py`` and ``tests/benchmarks/bench_receiver_kill.py``. Each round
starts the receiver on the same store file (a real process on 127.0.0.1), sends spans with
unique ids from several senders at once as fast as it answers: raw OTLP/HTTP protobuf requests,
raw OTLP/gRPC calls and the official ``OTLPSpanExporter``; then, a seeded random time after the
first answer, SIGKILLs it. A span counts as acknowledged when its request was answered success
without a partial rejection. After the last round the store is opened (DuckDB replays its
write-ahead log) and every acknowledged id is looked up.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from served import Served

from kvscope import semconv
from kvscope.store.database import open_store

PROTOBUF = {"Content-Type": "application/x-protobuf"}
# A receiver with a chosen acknowledgement ("durable" or "queued"), printing what ``kvscope serve``
# prints; without one the trial runs the real CLI, `kvscope serve`.
@dataclass
class Round:
    """One start-send-kill round: spans acknowledged per sender kind."""

    acknowledged: dict[str, set[str]] = field(default_factory=dict)

    def add(self, kind: str, ids: list[str]) -> None:
        self.acknowledged.setdefault(kind, set()).update(ids)

    def all(self) -> set[str]:
        return set().union(*self.acknowledged.values()) if self.acknowledged else set()


class _Ids:
    """Unique span ids across senders, rounds and trials (a random 32-bit prefix each)."""

    def __init__(self, seed: int) -> None:
        self._prefix = random.Random(seed).getrandbits(24) << 40
        self._next = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> int:
        with self._lock:
            first = self._next
            self._next += n
            return self._prefix | first


def _raw_request(ids: _Ids, n: int) -> tuple[bytes, list[str]]:
    first = ids.take(n)
    span_ids = [first + i for i in range(n)]
    spans = [Span(trace_id=(span_id | 1 << 100).to_bytes(16, "big"),
                  span_id=span_id.to_bytes(8, "big"), name=semconv.SPAN_TURN,
                  kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=1_700_000_000_000_000_000,
                  end_time_unix_nano=1_700_000_000_000_001_000)
             for span_id in span_ids]
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        scope_spans=[ScopeSpans(spans=spans)])])
    return request.SerializeToString(), [format(i, "016x") for i in span_ids]


def _sdk_spans(n: int) -> list[ReadableSpan]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "kill-trial"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(semconv.SCOPE_NAME)
    for i in range(n):
        with tracer.start_as_current_span(semconv.SPAN_TURN, attributes={"i": i}):
            pass
    provider.shutdown()
    return list(memory.get_finished_spans())


def run_round(db: Path, *, ack: str | None, seed: int, http_senders: int = 3,
              grpc_senders: int = 1, exporter_senders: int = 1, spans_per_request: int = 512,
              kill_after_s: tuple[float, float] = (0.5, 2.0)) -> Round:
    """Start the receiver on ``db``, send until a random moment, SIGKILL it; what was acked."""
    rng = random.Random(seed)
    ids = _Ids(seed)
    result = Round()
    lock = threading.Lock()
    first_answer = threading.Event()
    killed = threading.Event()
    # The official exporter's spans are made before the receiver starts (the SDK is slow).
    exporter_batches = [_sdk_spans(spans_per_request) for _ in range(40 * exporter_senders)]
    serve = Served(db, ack)

    def acked(kind: str, span_ids: list[str]) -> None:
        with lock:
            result.add(kind, span_ids)
        first_answer.set()

    def http_sender() -> None:
        with httpx.Client(timeout=30) as client:
            while not killed.is_set():
                body, span_ids = _raw_request(ids, spans_per_request)
                try:
                    response = client.post(f"{serve.url}/v1/traces", content=body,
                                           headers=PROTOBUF)
                except httpx.HTTPError:
                    return
                if response.status_code == 200 and not response.content:
                    acked("http", span_ids)
                elif response.status_code == 200:
                    raise AssertionError(f"partial success: {response.content!r}")
                elif response.status_code != 503:
                    raise AssertionError(f"{response.status_code}: {response.content!r}")

    def grpc_sender() -> None:
        with grpc.insecure_channel(serve.grpc_target) as channel:
            stub = TraceServiceStub(channel)
            while not killed.is_set():
                body, span_ids = _raw_request(ids, spans_per_request)
                try:
                    response = stub.Export(ExportTraceServiceRequest.FromString(body),
                                           timeout=30)
                except grpc.RpcError:
                    return
                assert not response.partial_success.rejected_spans
                acked("grpc", span_ids)

    def exporter_sender(batches: list[list[ReadableSpan]]) -> None:
        exporter = OTLPSpanExporter(endpoint=f"{serve.url}/v1/traces", timeout=5)
        for batch in batches:
            if killed.is_set():
                break
            if exporter.export(batch) is not SpanExportResult.SUCCESS:
                break
            acked("exporter", [format(span.context.span_id, "016x") for span in batch])
        exporter.shutdown()

    errors: list[BaseException] = []

    def guarded(target: Callable[..., None], *args: object) -> threading.Thread:
        def run() -> None:
            try:
                target(*args)
            except BaseException as exc:
                errors.append(exc)
        return threading.Thread(target=run)

    threads = [guarded(http_sender) for _ in range(http_senders)]
    threads += [guarded(grpc_sender) for _ in range(grpc_senders)]
    threads += [guarded(exporter_sender, exporter_batches[k::exporter_senders])
                for k in range(exporter_senders)]
    for thread in threads:
        thread.start()
    try:
        if not first_answer.wait(60):
            raise RuntimeError("no request was answered within 60 s")
        time.sleep(rng.uniform(*kill_after_s))
    finally:
        killed.set()
        serve.stop(signal.SIGKILL, 30)
        for thread in threads:
            thread.join(60)
    if errors:
        raise errors[0]
    return result


def stored_ids(db: Path) -> set[str]:
    """Every span id in the store (opened for writing: DuckDB replays its write-ahead log)."""
    con = open_store(db)
    try:
        return {row[0] for row in con.execute("SELECT SpanId FROM otel_traces").fetchall()}
    finally:
        con.close()


def kill_trials(db: Path, rounds: int, *, ack: str | None = None, seed: int = 22,
                **kwargs: object) -> list[tuple[int, int]]:
    """``rounds`` kill rounds on one store: (acknowledged, of them stored) per round."""
    trials = [run_round(db, ack=ack, seed=seed * 1000 + k, **kwargs)  # type: ignore[arg-type]
              for k in range(rounds)]
    stored = stored_ids(db)
    return [(len(trial.all()), len(trial.all() & stored)) for trial in trials]
