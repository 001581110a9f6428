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
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvscope import semconv

logger = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(slots=True)
class ReuseDecisionRecord:
    """Prefill decided local hit / remote pull / recompute for one request."""

    request_id: str
    time_ns: int
    local_hit_tokens: int
    remote_offered_tokens: int | None
    to_pull_tokens: int
    threshold_tokens: int
    decision: str
    bidirectional: bool
    prompt_tokens: int | None = None
    remote_engine_id: str | None = None
    traceparent: str | None = None


@dataclass(slots=True)
class KvTransferRecord:
    """One NIXL READ (or its refusal) as seen by the worker that reads."""

    request_id: str
    start_ns: int
    end_ns: int
    direction: str
    status: str
    size_bytes: int
    blocks: int
    remote_engine_id: str | None = None
    request_outcome: str | None = None
    traceparent: str | None = None


@dataclass(slots=True)
class KvRetentionRecord:
    """Decode pinned a finished request's blocks; ``end_ns`` None while still held."""

    request_id: str
    start_ns: int
    end_ns: int | None
    blocks: int
    size_bytes: int
    ttl_s: float
    release_reason: str
    remote_num_tokens: int | None = None
    traceparent: str | None = None


EngineRecord = ReuseDecisionRecord | KvTransferRecord | KvRetentionRecord


@dataclass
class EngineTelemetryStats:
    """Counters of one :class:`EngineTelemetry`."""

    recorded: int = 0
    dropped: int = 0
    emitted: int = 0
    failed: int = 0


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
    ) -> None:
        self._tracer = tracer
        self.engine_id = engine_id
        self.role = role
        self._max_queue = max_queue
        self._queue: deque[EngineRecord] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self.stats = EngineTelemetryStats()
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
            was_empty = not queue
            queue.append(record)  # deque.append is atomic under the GIL
            self.stats.recorded += 1
            if was_empty and self._thread is not None:
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
            self.stats.emitted += 1
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

    @staticmethod
    def _parent(traceparent: str | None) -> Context | None:
        if not traceparent:
            return None
        return _PROPAGATOR.extract({"traceparent": traceparent})

    def _emit_decision(self, r: ReuseDecisionRecord) -> None:
        attrs = self._common(r.request_id)
        attrs[semconv.LOCAL_HIT_TOKENS] = r.local_hit_tokens
        attrs[semconv.TOKENS_TO_PULL] = r.to_pull_tokens
        attrs[semconv.THRESHOLD_TOKENS] = r.threshold_tokens
        attrs[semconv.DECISION] = r.decision
        attrs[semconv.BIDIR_ENABLED] = r.bidirectional
        if r.remote_offered_tokens is not None:
            attrs[semconv.REMOTE_OFFERED_TOKENS] = r.remote_offered_tokens
        if r.prompt_tokens is not None:
            attrs[semconv.PROMPT_TOKENS] = r.prompt_tokens
        if r.remote_engine_id:
            attrs[semconv.REMOTE_ENGINE_ID] = r.remote_engine_id
        span = self._tracer.start_span(
            semconv.SPAN_REUSE_DECISION, context=self._parent(r.traceparent),
            attributes=attrs, start_time=r.time_ns,
        )
        span.end(end_time=r.time_ns)

    def _emit_transfer(self, r: KvTransferRecord) -> None:
        attrs = self._common(r.request_id)
        attrs[semconv.TRANSFER_DIRECTION] = r.direction
        attrs[semconv.TRANSFER_STATUS] = r.status
        attrs[semconv.TRANSFER_BYTES] = r.size_bytes
        attrs[semconv.TRANSFER_BLOCKS] = r.blocks
        if r.remote_engine_id:
            attrs[semconv.REMOTE_ENGINE_ID] = r.remote_engine_id
        if r.request_outcome:
            attrs[semconv.REQUEST_OUTCOME] = r.request_outcome
        span = self._tracer.start_span(
            semconv.SPAN_KV_TRANSFER, context=self._parent(r.traceparent),
            attributes=attrs, start_time=r.start_ns,
        )
        if r.status != semconv.TRANSFER_OK:
            span.set_status(Status(StatusCode.ERROR, r.status))
        span.end(end_time=max(r.end_ns, r.start_ns))

    def _emit_retention(self, r: KvRetentionRecord) -> None:
        attrs = self._common(r.request_id)
        attrs[semconv.RETENTION_BLOCKS] = r.blocks
        attrs[semconv.RETENTION_BYTES] = r.size_bytes
        attrs[semconv.RETENTION_TTL_S] = r.ttl_s
        attrs[semconv.RETENTION_RELEASE_REASON] = r.release_reason
        if r.remote_num_tokens is not None:
            attrs[semconv.REMOTE_NUM_TOKENS] = r.remote_num_tokens
        span = self._tracer.start_span(
            semconv.SPAN_KV_RETENTION, context=self._parent(r.traceparent),
            attributes=attrs, start_time=r.start_ns,
        )
        span.end(end_time=r.end_ns if r.end_ns is not None else r.start_ns)

    # --- background thread ----------------------------------------------------------------
    def _run(self) -> None:
        queue = self._queue
        while True:
            with self._cond:
                # A notify can slip in between the check and the wait: the timeout bounds that.
                if not queue and not self._closed:
                    self._cond.wait(0.05)
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
