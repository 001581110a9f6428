"""Engine records become the DESIGN §3 spans, with their own timestamps, off the hot path."""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvscope import semconv
from kvscope.collector.engine_telemetry import (
    EngineTelemetry,
    KvRetentionRecord,
    KvTransferRecord,
    ReuseDecisionRecord,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _telemetry(**kwargs: object) -> tuple[EngineTelemetry, InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": semconv.SERVICE_PREFILL}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(semconv.SCOPE_NAME)
    return EngineTelemetry(tracer, engine_id="p0", role=semconv.ROLE_PREFILL, **kwargs), memory


def test_records_become_spans_with_their_own_times_and_parent() -> None:
    telemetry, memory = _telemetry()
    telemetry.record(ReuseDecisionRecord(
        request_id="chatcmpl-abc-1", time_ns=1_000, local_hit_tokens=16,
        remote_offered_tokens=160, to_pull_tokens=144, threshold_tokens=64,
        decision=semconv.DECISION_PULL, bidirectional=True, prompt_tokens=170,
        remote_engine_id="d0", traceparent=TRACEPARENT))
    telemetry.record(KvTransferRecord(
        request_id="chatcmpl-abc-1", start_ns=2_000, end_ns=5_000,
        direction=semconv.DIRECTION_D_TO_P, status=semconv.TRANSFER_DECLINED_EXPIRED,
        size_bytes=0, blocks=9, remote_engine_id="d0", request_outcome="error"))
    telemetry.record(KvRetentionRecord(
        request_id="chatcmpl-xyz-0", start_ns=10, end_ns=99, blocks=11, size_bytes=4096,
        ttl_s=480.0, release_reason=semconv.RELEASE_READ, remote_num_tokens=175))
    assert telemetry.flush(10)
    telemetry.close()
    spans = {s.name: s for s in memory.get_finished_spans()}
    decision = spans[semconv.SPAN_REUSE_DECISION]
    assert (decision.start_time, decision.end_time) == (1_000, 1_000)
    assert decision.attributes[semconv.TOKENS_TO_PULL] == 144
    assert decision.attributes[semconv.DECISION] == semconv.DECISION_PULL
    assert decision.attributes[semconv.VLLM_REQUEST_ID] == "chatcmpl-abc-1"
    assert format(decision.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    assert format(decision.parent.span_id, "016x") == TRACEPARENT.split("-")[2]
    transfer = spans[semconv.SPAN_KV_TRANSFER]
    assert (transfer.start_time, transfer.end_time) == (2_000, 5_000)
    assert transfer.status.status_code is StatusCode.ERROR
    assert transfer.attributes[semconv.REQUEST_OUTCOME] == "error"
    retention = spans[semconv.SPAN_KV_RETENTION]
    assert retention.attributes[semconv.RETENTION_BYTES] == 4096
    assert retention.attributes[semconv.ENGINE_ROLE] == semconv.ROLE_PREFILL
    assert telemetry.stats.emitted == 3 and telemetry.stats.dropped == 0


def test_a_full_queue_drops_and_counts_and_never_raises() -> None:
    telemetry, memory = _telemetry(max_queue=2, background=False)
    record = KvRetentionRecord(request_id="r", start_ns=0, end_ns=1, blocks=1, size_bytes=1,
                               ttl_s=1.0, release_reason=semconv.RELEASE_EXPIRED)
    for _ in range(5):
        telemetry.record(record)
    assert (telemetry.stats.recorded, telemetry.stats.dropped) == (2, 3)
    assert memory.get_finished_spans() == ()


def test_a_broken_tracer_is_counted_not_raised() -> None:
    class Broken:
        def start_span(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("boom")

    telemetry = EngineTelemetry(Broken(), engine_id="d", role=semconv.ROLE_DECODE,  # type: ignore[arg-type]
                                background=False)
    telemetry.emit(KvRetentionRecord(request_id="r", start_ns=0, end_ns=1, blocks=1,
                                     size_bytes=1, ttl_s=1.0, release_reason="read"))
    assert telemetry.stats.failed == 1
