"""Engine-side telemetry shared by the vLLM hooks and the emulator: records in, spans out.

The engines' hot paths (vLLM's scheduler, the emulated nodes) only build a small record (plain
slotted dataclasses, not frozen: a frozen init costs several times more; treat them as
immutable) and hand it to :meth:`EngineTelemetry.record`, which appends it to a bounded deque and
returns — no I/O, no lock unless the emitting thread must be woken, never an exception. A
background thread turns records into the spans of DESIGN §3 (``kvscope.reuse_decision``,
``kvscope.kv_transfer``, ``kvscope.kv_retention``) with the record's own timestamps, so the
same code also serves the virtual-time simulator through :meth:`EngineTelemetry.emit`
(synchronous, no thread).

This is the one place these spans are built: the vLLM instrumentation and the emulator both call
it, so the ledger reads identical shapes from either.

With an SDK tracer (``opentelemetry.sdk.trace.Tracer``) the spans are built as finished
``ReadableSpan`` objects and handed straight to the provider's span processor, as the proxy does
(:meth:`ProxyTelemetry.spans_for`): about a tenth of ``tracer.start_span`` + ``end``, with the
same name, attributes, kind, status, timestamps, parent, ids (the tracer's id generator), trace
flags, resource and instrumentation scope. Processors see ``on_end`` only (kvscope's and the
SDK's exporting processors do nothing in ``on_start``). Anything else (a NoOp or proxy tracer, a
test double, a sampler other than always-on / parent-based always-on, span limits that could
trim an attribute, a disabled tracer config) goes through ``start_span``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.sampling import Decision as SamplingDecision
from opentelemetry.sdk.trace.sampling import ParentBased, StaticSampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    get_current_span,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvscope import semconv
from kvscope.collector.queue_counts import QueueCounts

logger = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_UNSET = Status(StatusCode.UNSET)
# Attributes per engine span stay far below any sane limit; below this, direct spans are exact.
_MAX_ENGINE_SPAN_ATTRIBUTES = 16


# Engine records: one encoding per engine event. Named tuples, so a record IS its field values
# in order: the simulator ships them to its span process as plain tuples (``tuple(record)``,
# rebuilt with ``_make``) and the vLLM hooks build them positionally (~0.3 µs).


class ReuseDecisionRecord(NamedTuple):
    """Prefill decided local hit / remote pull / recompute for one request.

    The hooks and the emulator know every field; a record ``kvscope ingest`` reads from a
    server's log line may not (None: not measured, and the span carries no such attribute).
    """

    request_id: str
    time_ns: int
    local_hit_tokens: int | None
    remote_offered_tokens: int | None
    to_pull_tokens: int | None
    threshold_tokens: int | None
    decision: str
    bidirectional: bool | None
    prompt_tokens: int | None = None
    remote_engine_id: str | None = None
    traceparent: str | None = None
    block_size: int | None = None
    # Keyed hash of the prompt's first min(offered, prompt) token ids, and the key's id.
    tokens_hash: str | None = None
    tokens_hash_key_id: str | None = None


class KvTransferRecord(NamedTuple):
    """One NIXL READ (or its refusal) as seen by the worker that reads (sizes None: not in the
    log line a record was ingested from)."""

    request_id: str
    start_ns: int
    end_ns: int
    direction: str
    status: str
    size_bytes: int | None
    blocks: int | None
    remote_engine_id: str | None = None
    request_outcome: str | None = None
    traceparent: str | None = None


class KvRetentionRecord(NamedTuple):
    """Decode pinned a finished request's blocks; ``end_ns`` None while still held (sizes and
    TTL None: not in the log line a record was ingested from)."""

    request_id: str
    start_ns: int
    end_ns: int | None
    blocks: int | None
    size_bytes: int | None
    ttl_s: float | None
    release_reason: str
    remote_num_tokens: int | None = None
    traceparent: str | None = None
    # Keyed hash of the token ids decode holds KV for, and the key's id.
    tokens_hash: str | None = None
    tokens_hash_key_id: str | None = None


EngineRecord = ReuseDecisionRecord | KvTransferRecord | KvRetentionRecord
# The record types, in the order a shipped record's code names them.
ENGINE_RECORDS: tuple[type[Any], ...] = (ReuseDecisionRecord, KvTransferRecord, KvRetentionRecord)


def _static_decision(sampler: object) -> bool | None:
    """True / False when ``sampler`` always records / always drops; None when it depends."""
    if isinstance(sampler, StaticSampler):
        decision = getattr(sampler, "_decision", None)
        if decision is SamplingDecision.RECORD_AND_SAMPLE:
            return True
        if decision is SamplingDecision.DROP:
            return False
    return None


class DirectSpans:
    """What an SDK tracer would put into a span, so a record can become a ``ReadableSpan``."""

    def __init__(self, tracer: SdkTracer, scope: InstrumentationScope,
                 decisions: tuple[bool | None, bool | None, bool | None]) -> None:
        self.tracer = tracer
        self.resource = tracer.resource
        self.processor = tracer.span_processor
        self.id_generator = tracer.id_generator
        self.instrumentation_info = tracer.instrumentation_info
        self.scope = scope
        # The sampler's fixed answer for a root, a sampled and an unsampled remote parent.
        self.root, self.sampled_parent, self.unsampled_parent = decisions
        self.root_flags = TraceFlags(
            TraceFlags.SAMPLED
            | (TraceFlags.RANDOM_TRACE_ID if self.id_generator.is_trace_id_random() else 0)
        )

    @classmethod
    def of(cls, tracer: object) -> DirectSpans | None:
        """The direct builder for ``tracer``, or None when only ``start_span`` is exact."""
        if not isinstance(tracer, SdkTracer):
            return None
        scope = getattr(tracer, "_instrumentation_scope", None)
        limits = getattr(tracer, "_span_limits", None)
        if not isinstance(scope, InstrumentationScope) or limits is None:
            return None
        max_attributes = limits.max_span_attributes
        if limits.max_span_attribute_length is not None or (
            max_attributes is not None and max_attributes < _MAX_ENGINE_SPAN_ATTRIBUTES
        ):
            return None
        if not callable(getattr(tracer, "_is_enabled", None)):
            return None
        sampler = tracer.sampler
        static = _static_decision(sampler)
        decisions: tuple[bool | None, bool | None, bool | None]
        if static is not None:
            decisions = (static, static, static)
        elif isinstance(sampler, ParentBased):
            decisions = (
                _static_decision(getattr(sampler, "_root", None)),
                _static_decision(getattr(sampler, "_remote_parent_sampled", None)),
                _static_decision(getattr(sampler, "_remote_parent_not_sampled", None)),
            )
        else:
            return None
        return cls(tracer, scope, decisions)

    def decision(self, parent: SpanContext | None) -> bool | None:
        """Whether a span under ``parent`` is recorded (None: ask the sampler via start_span)."""
        if parent is None:
            return self.root
        return self.sampled_parent if parent.trace_flags.sampled else self.unsampled_parent

    def dropped(self, parent: SpanContext | None) -> None:
        """A span the sampler drops: nothing to export, but its ids are drawn as start_span does.

        Keeps the id generator's sequence identical to the tracer's (deterministic generators).
        """
        if parent is None:
            self.id_generator.generate_trace_id()
        self.id_generator.generate_span_id()

    def finish(self, name: str, parent: SpanContext | None, attributes: dict[str, Any],
               start_ns: int, end_ns: int, status: Status) -> None:
        """Build the finished span start_span + end would give and hand it to the processor."""
        if parent is None:
            trace_id = self.id_generator.generate_trace_id()
            flags = self.root_flags
            trace_state = None
        else:
            trace_id = parent.trace_id
            flags = TraceFlags(
                TraceFlags.SAMPLED
                | (TraceFlags.RANDOM_TRACE_ID if parent.trace_flags.random_trace_id else 0)
            )
            trace_state = parent.trace_state
        context = SpanContext(trace_id, self.id_generator.generate_span_id(), False, flags,
                              trace_state)
        self.processor.on_end(ReadableSpan(
            name,
            context=context,
            parent=parent,
            resource=self.resource,
            attributes=attributes,
            kind=SpanKind.INTERNAL,
            instrumentation_info=self.instrumentation_info,
            status=status,
            start_time=start_ns,
            end_time=end_ns,
            instrumentation_scope=self.scope,
        ))


class EngineTelemetry:
    """Turns engine records into spans for one engine (prefill or decode)."""

    def __init__(
        self,
        tracer: Tracer,
        *,
        engine_id: str,
        role: str,
        max_queue: int = 65536,
        background: bool = True,
        poll_interval_s: float = 0.05,
        direct: Callable[[object], DirectSpans | None] | None = None,
    ) -> None:
        self._tracer = tracer
        # Where spans go when built directly (exact for this tracer): SDK spans to the tracer's
        # processor, unless ``direct`` gives another sink (store rows: span_rows.EngineRows).
        self._direct = (direct or DirectSpans.of)(tracer)
        # The last traceparent and its parent context (a turn's records share one).
        self._last_traceparent: str | None = None
        self._last_parent: SpanContext | None = None
        self.engine_id = engine_id
        self.role = role
        self._max_queue = max_queue
        self._wake_at = max(max_queue // 2, 1)
        self._poll_interval_s = poll_interval_s
        self._queue: deque[EngineRecord] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self.stats = QueueCounts()
        self._warned = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, name=f"kvscope-engine-{role}", daemon=True
            )
            self._thread.start()

    # --- hot path -------------------------------------------------------------------------
    def record(self, record: EngineRecord) -> None:
        """Queue a record for emission; drop and count it when the queue is full. Never raises."""
        try:
            queue = self._queue
            if self._closed or len(queue) >= self._max_queue:
                self.stats.dropped += 1
                return
            queue.append(record)  # deque.append is atomic under the GIL
            self.stats.queued += 1
            # No lock and no wake-up per record: the thread polls every poll_interval_s and is
            # woken early only when the queue is half full (so a burst is not dropped).
            if len(queue) == self._wake_at and self._thread is not None:
                with self._cond:
                    self._cond.notify()
        except Exception:  # pragma: no cover - a deque append does not fail in practice
            self.stats.dropped += 1

    # --- emission -------------------------------------------------------------------------
    def emit(self, record: EngineRecord) -> None:
        """Build the span for one record now (virtual-time callers use this directly)."""
        try:
            if isinstance(record, ReuseDecisionRecord):
                self._emit_decision(record)
            elif isinstance(record, KvTransferRecord):
                self._emit_transfer(record)
            else:
                self._emit_retention(record)
            self.stats.sent += 1
        except Exception:
            self.stats.failed += 1
            if not self._warned:
                self._warned = True
                logger.exception("kvscope engine telemetry failed (further failures counted)")

    def _common(self, request_id: str) -> dict[str, Any]:
        return {
            semconv.VLLM_REQUEST_ID: request_id,
            semconv.ENGINE_ID: self.engine_id,
            semconv.ENGINE_ROLE: self.role,
        }

    @property
    def builds_directly(self) -> bool:
        """Whether spans skip ``start_span`` (exact for this tracer), in the sink given."""
        return self._direct is not None

    def _parent(self, traceparent: str | None) -> SpanContext | None:
        """The remote parent named by ``traceparent``; None when absent or invalid."""
        if not traceparent:
            return None
        if traceparent != self._last_traceparent:
            context = get_current_span(_PROPAGATOR.extract({"traceparent": traceparent}))
            parent = context.get_span_context()
            self._last_parent = parent if parent.is_valid else None
            self._last_traceparent = traceparent
        return self._last_parent

    def _span(self, name: str, traceparent: str | None, attributes: dict[str, Any],
              start_ns: int, end_ns: int, status: Status = _UNSET) -> None:
        """Emit one finished INTERNAL span: directly when exact, else through the tracer."""
        parent = self._parent(traceparent)
        direct = self._direct
        if direct is not None:
            recorded = direct.decision(parent)
            if recorded is not None and direct.tracer._is_enabled():
                if recorded:
                    direct.finish(name, parent, attributes, start_ns, end_ns, status)
                else:
                    direct.dropped(parent)
                return
        context = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
        span = self._tracer.start_span(name, context=context, attributes=attributes,
                                       start_time=start_ns)
        if status is not _UNSET:
            span.set_status(status)
        span.end(end_time=end_ns)

    def _emit_decision(self, r: ReuseDecisionRecord) -> None:
        attrs = self._common(r.request_id)
        attrs.update(decision_attributes(r))
        self._span(semconv.SPAN_REUSE_DECISION, r.traceparent, attrs, r.time_ns, r.time_ns)

    def _emit_transfer(self, r: KvTransferRecord) -> None:
        attrs = self._common(r.request_id)
        attrs.update(transfer_attributes(r))
        status = _UNSET if r.status == semconv.TRANSFER_OK else Status(StatusCode.ERROR, r.status)
        self._span(semconv.SPAN_KV_TRANSFER, r.traceparent, attrs, r.start_ns,
                   max(r.end_ns, r.start_ns), status)

    def _emit_retention(self, r: KvRetentionRecord) -> None:
        attrs = self._common(r.request_id)
        attrs.update(retention_attributes(r))
        self._span(semconv.SPAN_KV_RETENTION, r.traceparent, attrs, r.start_ns,
                   r.end_ns if r.end_ns is not None else r.start_ns)

    # --- background thread ----------------------------------------------------------------
    def _run(self) -> None:
        queue = self._queue
        while True:
            with self._cond:
                # Poll: records are not signalled one by one (see record); flush and close notify.
                if not self._closed:
                    self._cond.wait(self._poll_interval_s)
                self._busy = True
                closed = self._closed
            batch = []
            while queue:
                batch.append(queue.popleft())
            for record in batch:
                self.emit(record)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            if closed and not queue:
                return

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued record has been emitted as a span."""
        if self._thread is None:
            return True
        with self._cond:
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._queue and not self._busy,
                                       timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Emit what is queued and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)


# --- one span shape per record: the attributes each record's span carries ----------------------
# (besides the engine's request id, engine id and role). The engines' spans and the spans
# ``kvscope ingest`` reads from their logs are both shaped here; None is "not measured": no
# attribute.


def _set(attrs: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        attrs[key] = value


def decision_attributes(r: ReuseDecisionRecord) -> dict[str, Any]:
    """The attributes of a ``kvscope.reuse_decision`` span."""
    attrs: dict[str, Any] = {}
    _set(attrs, semconv.LOCAL_HIT_TOKENS, r.local_hit_tokens)
    _set(attrs, semconv.TOKENS_TO_PULL, r.to_pull_tokens)
    _set(attrs, semconv.THRESHOLD_TOKENS, r.threshold_tokens)
    attrs[semconv.DECISION] = r.decision
    _set(attrs, semconv.BIDIR_ENABLED, r.bidirectional)
    _set(attrs, semconv.REMOTE_OFFERED_TOKENS, r.remote_offered_tokens)
    _set(attrs, semconv.PROMPT_TOKENS, r.prompt_tokens)
    _set(attrs, semconv.REMOTE_ENGINE_ID, r.remote_engine_id or None)
    _set(attrs, semconv.KV_BLOCK_SIZE, r.block_size or None)
    _set(attrs, semconv.KV_TOKENS_HASH, r.tokens_hash)
    _set(attrs, semconv.KV_TOKENS_HASH_KEY_ID, r.tokens_hash_key_id)
    return attrs


def transfer_attributes(r: KvTransferRecord) -> dict[str, Any]:
    """The attributes of a ``kvscope.kv_transfer`` span."""
    attrs: dict[str, Any] = {semconv.TRANSFER_DIRECTION: r.direction,
                             semconv.TRANSFER_STATUS: r.status}
    _set(attrs, semconv.TRANSFER_BYTES, r.size_bytes)
    _set(attrs, semconv.TRANSFER_BLOCKS, r.blocks)
    _set(attrs, semconv.REMOTE_ENGINE_ID, r.remote_engine_id or None)
    _set(attrs, semconv.REQUEST_OUTCOME, r.request_outcome or None)
    return attrs


def retention_attributes(r: KvRetentionRecord) -> dict[str, Any]:
    """The attributes of a ``kvscope.kv_retention`` span."""
    attrs: dict[str, Any] = {}
    _set(attrs, semconv.RETENTION_BLOCKS, r.blocks)
    _set(attrs, semconv.RETENTION_BYTES, r.size_bytes)
    _set(attrs, semconv.RETENTION_TTL_S, r.ttl_s)
    attrs[semconv.RETENTION_RELEASE_REASON] = r.release_reason
    _set(attrs, semconv.REMOTE_NUM_TOKENS, r.remote_num_tokens)
    _set(attrs, semconv.KV_TOKENS_HASH, r.tokens_hash)
    _set(attrs, semconv.KV_TOKENS_HASH_KEY_ID, r.tokens_hash_key_id)
    return attrs


__all__ = ["DirectSpans", "ENGINE_RECORDS", "EngineRecord", "EngineTelemetry", "KvRetentionRecord",
    "KvTransferRecord", "ReuseDecisionRecord", "decision_attributes", "retention_attributes",
    "transfer_attributes"]
