"""Engine records become the DESIGN §3 spans, with their own timestamps, off the hot path."""

from __future__ import annotations

import time
from typing import Any

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    DEFAULT_OFF,
    DEFAULT_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import StatusCode, Tracer

from kvscope import semconv
from kvscope.collector.engine_telemetry import (
    EngineRecord,
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
    spans: dict[str, Any] = {s.name: s for s in memory.get_finished_spans()}
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
    assert telemetry.stats.sent == 3 and telemetry.stats.dropped == 0


def test_a_full_queue_drops_and_counts_and_never_raises() -> None:
    telemetry, memory = _telemetry(max_queue=2, background=False)
    record = KvRetentionRecord(request_id="r", start_ns=0, end_ns=1, blocks=1, size_bytes=1,
                               ttl_s=1.0, release_reason=semconv.RELEASE_EXPIRED)
    for _ in range(5):
        telemetry.record(record)
    assert (telemetry.stats.queued, telemetry.stats.dropped) == (2, 3)
    assert memory.get_finished_spans() == ()


def test_records_are_polled_not_signalled_until_the_queue_is_half_full() -> None:
    # A poll interval far beyond the test: only flush or a half-full queue can wake the thread.
    telemetry, memory = _telemetry(max_queue=8, poll_interval_s=3600.0)
    record = KvRetentionRecord(request_id="r", start_ns=0, end_ns=1, blocks=1, size_bytes=1,
                               ttl_s=1.0, release_reason=semconv.RELEASE_EXPIRED)
    try:
        for _ in range(3):
            telemetry.record(record)
        time.sleep(0.2)
        assert memory.get_finished_spans() == ()  # no wake-up per record
        telemetry.record(record)  # the 4th of 8: half full, the thread is woken
        deadline = time.monotonic() + 10
        while len(memory.get_finished_spans()) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(memory.get_finished_spans()) == 4
        telemetry.record(record)
        assert telemetry.flush(10)  # flush wakes it too
        assert len(memory.get_finished_spans()) == 5
    finally:
        telemetry.close()


def test_a_broken_tracer_is_counted_not_raised() -> None:
    class Broken:
        def start_span(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("boom")

    broken: Any = Broken()
    telemetry = EngineTelemetry(broken, engine_id="d", role=semconv.ROLE_DECODE,
                                background=False)
    telemetry.emit(KvRetentionRecord(request_id="r", start_ns=0, end_ns=1, blocks=1,
                                     size_bytes=1, ttl_s=1.0, release_reason="read"))
    assert telemetry.stats.failed == 1


# --- direct spans (no start_span) against the tracer's own ----------------------------------------
class CountingIds(IdGenerator):
    """Deterministic ids, so the direct and the start_span path can be compared span by span."""

    def __init__(self, random_trace_id: bool) -> None:
        self._next = 0x1000
        self._random = random_trace_id

    def generate_span_id(self) -> int:
        self._next += 1
        return self._next

    def generate_trace_id(self) -> int:
        self._next += 1
        return self._next << 64

    def is_trace_id_random(self) -> bool:
        return self._random


class ViaStartSpan:
    """Not an SDK tracer: EngineTelemetry must take the start_span path with it."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def start_span(self, *args: Any, **kwargs: Any) -> Any:
        return self._tracer.start_span(*args, **kwargs)


def _records() -> list[EngineRecord]:
    unsampled = TRACEPARENT[:-2] + "00"
    with_state = "00-0af7651916cd43dd8448eb211c80319d-b7ad6b7169203332-03"
    out: list[EngineRecord] = []
    for parent in (None, TRACEPARENT, unsampled, with_state, "00-garbage", TRACEPARENT):
        out += [
            ReuseDecisionRecord(
                request_id="chatcmpl-a-1", time_ns=1_000, local_hit_tokens=16,
                remote_offered_tokens=None, to_pull_tokens=0, threshold_tokens=64,
                decision=semconv.DECISION_LOCAL_COVERS, bidirectional=False,
                traceparent=parent),
            KvTransferRecord(
                request_id="chatcmpl-a-1", start_ns=2_000, end_ns=1_500,
                direction=semconv.DIRECTION_D_TO_P, status=semconv.TRANSFER_FAILED,
                size_bytes=0, blocks=3, remote_engine_id="d0", traceparent=parent),
            KvTransferRecord(
                request_id="chatcmpl-a-2", start_ns=2_000, end_ns=9_000,
                direction=semconv.DIRECTION_P_TO_D, status=semconv.TRANSFER_OK,
                size_bytes=4096, blocks=3, traceparent=parent),
            KvRetentionRecord(
                request_id="chatcmpl-b-0", start_ns=10, end_ns=None, blocks=11,
                size_bytes=4096, ttl_s=480.0, release_reason=semconv.RELEASE_OPEN,
                traceparent=parent),
        ]
    return out


def _spans(direct: bool, sampler: Sampler, random_ids: bool) -> tuple[list[Any], EngineTelemetry]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(
        sampler=sampler, id_generator=CountingIds(random_ids),
        resource=Resource.create({"service.name": semconv.SERVICE_DECODE, semconv.RUN_ID: "r1"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    sdk_tracer = provider.get_tracer(semconv.SCOPE_NAME, "9.9", schema_url="https://x/1.0")
    tracer: Any = sdk_tracer if direct else ViaStartSpan(sdk_tracer)
    telemetry = EngineTelemetry(tracer, engine_id="d0", role=semconv.ROLE_DECODE,
                                background=False)
    for record in _records():
        telemetry.emit(record)
    return list(memory.get_finished_spans()), telemetry


def _shape(span: Any) -> tuple[Any, ...]:
    ctx, parent = span.context, span.parent
    return (
        span.name, span.kind, dict(span.attributes), span.start_time, span.end_time,
        span.status.status_code, span.status.description,
        (ctx.trace_id, ctx.span_id, ctx.is_remote, int(ctx.trace_flags),
         ctx.trace_state.to_header()),
        None if parent is None else (parent.trace_id, parent.span_id, parent.is_remote,
                                     int(parent.trace_flags), parent.trace_state.to_header()),
        span.resource, span.instrumentation_scope, span._instrumentation_info,
        tuple(span.events), tuple(span.links), span.dropped_attributes,
    )


@pytest.mark.parametrize("random_ids", [False, True])
@pytest.mark.parametrize("sampler_name", ["parent_based_on", "always_on", "parent_based_off"])
def test_direct_spans_equal_the_tracers_spans(sampler_name: str, random_ids: bool) -> None:
    sampler = {"parent_based_on": DEFAULT_ON, "always_on": ALWAYS_ON,
               "parent_based_off": DEFAULT_OFF}[sampler_name]
    direct, telemetry = _spans(True, sampler, random_ids)
    assert telemetry._direct is not None  # the SDK tracer is used without start_span
    via_tracer, fallback = _spans(False, sampler, random_ids)
    assert fallback._direct is None
    assert [_shape(s) for s in direct] == [_shape(s) for s in via_tracer]
    # The unsampled traceparent drops its spans either way; DEFAULT_OFF keeps only children of
    # a sampled parent.
    expected = {"parent_based_on": 20, "always_on": 24, "parent_based_off": 12}[sampler_name]
    assert len(direct) == expected
    assert telemetry.stats.sent == len(_records()) and telemetry.stats.failed == 0
    errors = [s for s in direct if s.status.status_code is StatusCode.ERROR]
    assert errors and all(s.status.description == semconv.TRANSFER_FAILED for s in errors)


@pytest.mark.parametrize("sampler", [ParentBased(TraceIdRatioBased(0.5)), TraceIdRatioBased(0.5)])
def test_samplers_that_decide_per_span_go_through_the_tracer(sampler: Sampler) -> None:
    """Ratio sampling is the sampler's call: those spans (roots here) take start_span."""
    direct, _ = _spans(True, sampler, False)
    via_tracer, _ = _spans(False, sampler, False)
    assert [_shape(s) for s in direct] == [_shape(s) for s in via_tracer]
    assert 0 < len(direct) < len(_records())
