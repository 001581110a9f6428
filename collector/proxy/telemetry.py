"""Turn telemetry for the proxy: per-turn records, their OTel spans, and Prometheus metrics.

The request path only fills a plain :class:`TurnRecord` (ids, wall-clock nanoseconds, counts).
When the turn ends, :meth:`ProxyTelemetry.finish_turn` turns the record into finished SDK
``ReadableSpan`` objects and hands them to the process's :class:`QueueSpanProcessor`, which only
appends to a bounded deque; conversion to rows and the DuckDB or OTLP write happen on the
exporter's thread. Building ``ReadableSpan`` directly (instead of ``tracer.start_span``) costs a
tenth as much and lets the proxy choose span ids *before* the legs are sent, so the
``traceparent`` each leg carries names the span that will be stored for it. The spans are real
OTel spans (trace id, span id, parent, kind, events, status) and go through the same exporters.

Spans per turn: ``kvscope.turn`` (SERVER; child of the agent's span when a ``traceparent``
arrived) with children ``kvscope.input_processing`` and ``kvscope.generation`` (CLIENT) and,
from the second turn of a conversation, ``kvscope.tool_wait`` (INTERNAL, previous turn's last
byte → this arrival).
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from kvscope import __version__, semconv
from kvscope.boundary_key import BoundaryKey
from kvscope.collector.otel import Telemetry
from kvscope.collector.proxy.conversation import ConversationId
from kvscope.collector.proxy.metrics import ProxyMetrics
from kvscope.reuse.boundaries import (
    BOUNDARY_HASH_HEX,
    BOUNDARY_HASHES_KEPT,
    chain_boundary,
    message_boundaries,
    reply_text,
)

if TYPE_CHECKING:
    from kvscope.collector.proxy.export_process import TurnExportProcess

logger = logging.getLogger(__name__)

# Conversations whose previous-turn end time and turn index are remembered (least recent evicted).
MAX_TRACKED_CONVERSATIONS = 100_000
# Characters of that many comma-separated hashes.
_KEPT_HASH_CHARS = BOUNDARY_HASHES_KEPT * (BOUNDARY_HASH_HEX + 1) - 1

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_UNSET_STATUS = Status(StatusCode.UNSET)  # immutable: one for every span without a status
# A span event as spans_for shapes it: (timestamp ns, name, attributes).
SpanEvent = tuple[int, str, dict[str, Any]]
# A producer's last step: a finished span's pieces (name, trace id, span id, parent span id,
# parent is remote, kind, start, end, attributes, events, status) to where spans go. The SDK sink
# (:func:`sdk_spans`) returns a ReadableSpan; the row sink appends a store row and returns None.
SpanBuilder = Callable[..., Any]
# Makes a sink's builder for one producer's resource and instrumentation scope.
SpanSink = Callable[[Resource, InstrumentationScope], SpanBuilder]


# --- message boundaries (kvscope.reuse.boundaries) on a turn's record -------------------------
def set_boundaries(record: TurnRecord, body: Mapping[str, Any], key: BoundaryKey) -> None:
    """Give ``record`` the message count of ``body``, the hashes (keyed with ``key``, whose id
    it keeps) and roles of its last :data:`BOUNDARY_HASHES_KEPT` messages (what its turn span
    stores)."""
    record.message_count, record.boundary_hashes, record.boundary_roles = message_boundaries(
        body, key, BOUNDARY_HASHES_KEPT)
    record.boundary_key_id = key.key_id


def set_reply_boundary(record: TurnRecord, key: BoundaryKey) -> None:
    """Give ``record`` its reply's boundary hash (the prompt's chain, then decode's reply as an
    assistant message) from its ``reply_source``, and drop the source.

    A client that sends the reply back unchanged sends this hash in its next turn; one that
    edits it (compaction, stripped reasoning, another answer) does not, although every earlier
    hash and the next role match: without it an edited reply reads as a continuation while
    decode holds the KV of the reply it generated.
    """
    source, record.reply_source = record.reply_source, None
    if source is None or record.reply_hash is not None:
        return
    last = record.history_last or record.boundary_hashes.rpartition(",")[2]
    text = reply_text(source, bool(record.retention_returned))
    if not last or text is None:
        return
    record.reply_hash = chain_boundary(bytes.fromhex(last), "assistant", text, key).hex()


# --- W3C trace context ----------------------------------------------------------------------------
def parse_traceparent(header: str | None) -> tuple[int, int] | None:
    """(trace id, parent span id) from a W3C ``traceparent``; None when absent or invalid."""
    if not header:
        return None
    match = _TRACEPARENT.match(header.strip().lower())
    if match is None or match.group(1) == "ff":
        return None
    trace_id, span_id = int(match.group(2), 16), int(match.group(3), 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id


def format_traceparent(trace_id: int, span_id: int) -> str:
    """A W3C ``traceparent`` naming ``span_id`` as the parent, sampled."""
    return f"00-{trace_id:032x}-{span_id:016x}-01"


# --- per-turn record ------------------------------------------------------------------------------
@dataclass(slots=True)
class TurnRecord:
    """Everything the proxy learns about one turn; plain data, filled on the request path.

    A record built from a proxy's log (:mod:`kvscope.collector.ingest.proxy_log`) leaves what
    the log does not say as None: not measured, so its span leaves the attribute out.
    """

    x_request_id: str
    route: str | None
    arrival_ns: int
    trace_id: int
    turn_span_id: int
    prefill_span_id: int
    decode_span_id: int
    remote_parent_span_id: int | None = None
    tracestate: str | None = None
    conversation: ConversationId | None = None
    turn_index: int | None = 1
    previous_end_ns: int | None = None
    model: str | None = None
    stream: bool | None = False
    # The last BOUNDARY_HASHES_KEPT message-boundary hashes (comma separated), their roles'
    # initials, and how many messages the prompt has.
    boundary_hashes: str = ""
    boundary_roles: str = ""
    message_count: int = 0
    # The id of the key those hashes were made with (kvscope.boundary_key).
    boundary_key_id: str | None = None
    lookup: str | None = None
    lookup_age_s: float | None = None
    offered_request_id: str | None = None
    offered_tokens: int | None = None
    d_metadata_attached: bool = False
    # --reuse-guard's verdict on the router entry (None: guard off or nothing looked up) and
    # this turn's last boundary hash, kept with decode's params for the next turn's check.
    reuse_guard: str | None = None
    history_last: str | None = None
    prefill_instance: str | None = None
    decode_instance: str | None = None
    prefill_start_ns: int | None = None
    prefill_end_ns: int | None = None
    prefill_request_id: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    decode_cached_tokens: int | None = None
    decode_start_ns: int | None = None
    first_token_ns: int | None = None
    decode_end_ns: int | None = None
    decode_request_id: str | None = None
    output_tokens: int | None = None
    chunks: int | None = 0
    finish_reasons: list[str] = field(default_factory=list)
    retention_returned: bool | None = False
    remote_num_tokens: int | None = None
    retention_blocks: int | None = None
    status_code: int | None = 200
    error_kind: str | None = None
    error_leg: str | None = None
    error_message: str = ""
    client_disconnected: bool = False
    end_ns: int = 0
    # False when decode was called non-streaming (vLLM < 0.33 streams no kv_transfer_params).
    decode_streamed: bool | None = True
    # The boundary hash of the prompt's messages then decode's reply as one assistant message
    # (semconv.REPLY_BOUNDARY_HASH), and what it is still to be hashed from: the reply's text,
    # or decode's SSE payloads (parsed off the serving path; see reply_text). Never stored.
    reply_hash: str | None = None
    reply_source: str | tuple[bytes, ...] | None = field(default=None, repr=False)
    # The request body whose message boundaries are still to be hashed (by the export
    # process, off the proxy's process: its messages go there, never further, never stored).
    boundary_source: Mapping[str, Any] | None = field(default=None, repr=False)

    def prefill_traceparent(self) -> str:
        return format_traceparent(self.trace_id, self.prefill_span_id)

    def decode_traceparent(self) -> str:
        return format_traceparent(self.trace_id, self.decode_span_id)

    def fail(self, leg: str | None, kind: str, status_code: int, message: str) -> None:
        """Mark the turn failed (the first failure wins: it is the cause)."""
        if self.error_kind is None:
            self.error_leg, self.error_kind, self.error_message = leg, kind, message
        self.status_code = status_code


class _ConversationClock:
    """Bounded map: conversation id → (turn index so far, end of its last turn or None)."""

    def __init__(self, max_entries: int) -> None:
        self._max = max_entries
        self._state: OrderedDict[str, list[Any]] = OrderedDict()

    def begin(self, conversation_id: str) -> tuple[int, int | None]:
        state = self._state.get(conversation_id)
        if state is None:
            state = self._state[conversation_id] = [0, None]
            if len(self._state) > self._max:
                self._state.popitem(last=False)
        else:
            self._state.move_to_end(conversation_id)
        state[0] += 1
        # A turn already in flight for this conversation leaves no gap to call a tool wait.
        previous_end, state[1] = state[1], None
        return state[0], previous_end

    def end(self, conversation_id: str, end_ns: int) -> None:
        state = self._state.get(conversation_id)
        if state is not None:
            state[1] = end_ns


def _add_known(attrs: dict[str, Any], values: Mapping[str, Any]) -> None:
    """Add the ``values`` that are known: an attribute not measured is left out, never null."""
    attrs.update({key: value for key, value in values.items() if value is not None})


# --- a turn record's attributes, per span kind ------------------------------------------------
# One shape per span kind, shared by every producer of turn spans: the proxy (live, in its
# process or its export process), the simulator (through ProxyTelemetry) and the ingest of a
# proxy's log (kvscope.collector.ingest.proxy_log, whose records leave what a log line cannot
# say as None). An attribute not measured is left out, never stored as a default.


def turn_attributes(record: TurnRecord, router_ttl_s: float | None) -> dict[str, Any]:
    """The ``kvscope.turn`` span's attributes of ``record``."""
    attrs: dict[str, Any] = {semconv.X_REQUEST_ID: record.x_request_id}
    _add_known(attrs, {
        semconv.HTTP_ROUTE: record.route,
        semconv.HTTP_RESPONSE_STATUS_CODE: record.status_code,
        semconv.TURN_INDEX: record.turn_index,
        semconv.STREAM_REQUESTED: record.stream,
    })
    conversation = record.conversation
    if conversation is not None:
        _add_known(attrs, {
            semconv.GEN_AI_CONVERSATION_ID: conversation.value,
            semconv.CONVERSATION_ID_SOURCE: conversation.source,
            semconv.CONVERSATION_ID_REJECTED: conversation.rejected,
        })
    _add_known(attrs, {
        semconv.GEN_AI_REQUEST_MODEL: record.model,
        semconv.GEN_AI_USAGE_INPUT_TOKENS: record.prompt_tokens,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: record.output_tokens,
        semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: record.cached_tokens,
        semconv.DECODE_CACHED_TOKENS: record.decode_cached_tokens,
        semconv.ROUTER_LOOKUP: record.lookup,
        semconv.ROUTER_ENTRY_AGE_S: record.lookup_age_s,
        semconv.REUSE_GUARD: record.reuse_guard,
        semconv.REPLY_BOUNDARY_HASH: record.reply_hash,
        semconv.ROUTER_TTL_S: router_ttl_s,
        semconv.PREFILL_INSTANCE: record.prefill_instance,
        semconv.DECODE_INSTANCE: record.decode_instance,
    })
    if record.message_count:
        # The record holds the last hashes only; a longer list (a caller of its own) is cut.
        hashes = record.boundary_hashes
        if len(hashes) > _KEPT_HASH_CHARS:
            hashes = hashes[len(hashes) - _KEPT_HASH_CHARS:]
        attrs[semconv.MESSAGE_COUNT] = record.message_count
        attrs[semconv.MESSAGE_BOUNDARY_HASHES] = hashes
        if record.boundary_key_id is not None:
            attrs[semconv.MESSAGE_BOUNDARY_HASH_KEY_ID] = record.boundary_key_id
        roles = record.boundary_roles[-BOUNDARY_HASHES_KEPT:]
        if len(roles) == min(record.message_count, BOUNDARY_HASHES_KEPT):
            attrs[semconv.MESSAGE_ROLES] = roles
    if record.finish_reasons:
        attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = ",".join(record.finish_reasons)
    if record.first_token_ns is not None:
        attrs[semconv.TTFT_MS] = (record.first_token_ns - record.arrival_ns) / 1e6
    if record.client_disconnected:
        attrs[semconv.CLIENT_DISCONNECTED] = True
    if record.error_kind is not None:
        attrs[semconv.ERROR_KIND] = record.error_kind
    return attrs


def prefill_attributes(record: TurnRecord) -> dict[str, Any]:
    """The prefill leg's (``kvscope.input_processing``) attributes of ``record``."""
    attrs: dict[str, Any] = {semconv.X_REQUEST_ID: record.x_request_id,
                             semconv.D_METADATA_ATTACHED: record.d_metadata_attached}
    _add_known(attrs, {
        semconv.PREFILL_INSTANCE: record.prefill_instance,
        semconv.PROMPT_TOKENS: record.prompt_tokens,
        semconv.CACHED_TOKENS: record.cached_tokens,
        semconv.VLLM_REQUEST_ID: record.prefill_request_id,
        semconv.OFFERED_REQUEST_ID: record.offered_request_id,
        semconv.REMOTE_OFFERED_TOKENS: record.offered_tokens,
    })
    _leg_error(attrs, record, semconv.LEG_PREFILL)
    return attrs


def decode_attributes(record: TurnRecord) -> dict[str, Any]:
    """The decode leg's (``kvscope.generation``) attributes of ``record``."""
    attrs: dict[str, Any] = {semconv.X_REQUEST_ID: record.x_request_id}
    _add_known(attrs, {
        semconv.RETENTION_METADATA_RETURNED: record.retention_returned,
        semconv.STREAM_CHUNKS: record.chunks,
        semconv.DECODE_STREAMED: record.decode_streamed,
        semconv.DECODE_INSTANCE: record.decode_instance,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: record.output_tokens,
        semconv.VLLM_REQUEST_ID: record.decode_request_id,
        semconv.REMOTE_NUM_TOKENS: record.remote_num_tokens,
        semconv.RETENTION_BLOCKS: record.retention_blocks,
    })
    if record.client_disconnected:
        attrs[semconv.CLIENT_DISCONNECTED] = True
    _leg_error(attrs, record, semconv.LEG_DECODE)
    return attrs


def _leg_error(attrs: dict[str, Any], record: TurnRecord, leg: str) -> None:
    """The kind of the turn's failure, on the leg it happened in."""
    if record.error_leg == leg and record.error_kind is not None:
        attrs[semconv.ERROR_KIND] = record.error_kind


def sdk_spans(resource: Resource, scope: InstrumentationScope) -> SpanBuilder:
    """The SDK sink: a finished span's pieces as the ``ReadableSpan`` exporters take.

    Pieces: ids (every span of a turn is sampled and carries no trace state), events as
    (timestamp, name, attributes). The direct row path's sink
    (:func:`kvscope.collector.span_rows.proxy_rows`) takes the same pieces, so they are plain
    values, not SDK objects.
    """
    def span(name: str, trace_id: int, span_id: int, parent_span_id: int | None,
             parent_is_remote: bool, kind: SpanKind, start_ns: int, end_ns: int,
             attributes: dict[str, Any], events: tuple[SpanEvent, ...],
             status: Status) -> ReadableSpan:
        return ReadableSpan(
            name,
            context=SpanContext(trace_id, span_id, False, _SAMPLED),
            parent=(None if parent_span_id is None
                    else SpanContext(trace_id, parent_span_id, parent_is_remote, _SAMPLED)),
            resource=resource,
            attributes=attributes,
            events=[Event(event_name, event_attributes, timestamp=timestamp)
                    for timestamp, event_name, event_attributes in events],
            kind=kind,
            status=status,
            start_time=start_ns,
            end_time=max(end_ns, start_ns),
            instrumentation_scope=scope,
        )

    return span


class ProxyTelemetry:
    """Turn records → spans and metrics.

    Spans are built in this process from ``telemetry``'s providers, or, with ``export_process``,
    in a child process (what ``kvscope proxy`` uses: see
    :mod:`~kvscope.collector.proxy.export_process`). With neither, spans are disabled (metrics
    remain).
    """

    def __init__(
        self,
        telemetry: Telemetry | None,
        *,
        router_ttl_s: float | None = None,
        max_conversations: int = MAX_TRACKED_CONVERSATIONS,
        export_process: TurnExportProcess | None = None,
        service_name: str = semconv.SERVICE_PROXY,
        boundary_key: BoundaryKey | None = None,
        resource: Resource | None = None,
        span_sink: SpanSink | None = None,
        random_state: Any = None,
    ) -> None:
        if telemetry is not None and export_process is not None:
            raise ValueError("ProxyTelemetry takes telemetry or export_process, not both")
        self.telemetry = telemetry
        self.export_process = export_process
        self.enabled = telemetry is not None or export_process is not None
        self.metrics = ProxyMetrics()
        self.router_ttl_s = router_ttl_s
        # The key of the boundary hashes: the export process's (it hashes there), else one for
        # this process only unless given (``kvscope proxy`` gives the persisted one).
        self.boundary_key = boundary_key or (
            export_process.boundary_key if export_process is not None
            else BoundaryKey.ephemeral())
        self._clock = _ConversationClock(max_conversations)
        self._rand = random.Random()
        if random_state is not None:
            self._rand.setstate(random_state)
        self._scope = InstrumentationScope(semconv.SCOPE_NAME, __version__)
        self._span_failures = 0
        self._lock = threading.Lock()
        # Turns begun but not finished (the handler ends after the client has the last byte).
        self.open_turns = 0
        # ReadableSpan builds a default Resource (process detection) per span when given None.
        self.resource = resource or (
            telemetry.tracer_provider.resource
            if telemetry is not None
            else Resource.create({"service.name": service_name})
        )
        # Where finished spans go: SDK spans (exported) unless a sink is given (store rows).
        self._span = (span_sink or sdk_spans)(self.resource, self._scope)

    # -- request path ------------------------------------------------------------------------------
    def begin_turn(
        self,
        route: str,
        x_request_id: str,
        traceparent: str | None,
        tracestate: str | None,
    ) -> TurnRecord:
        """A record for a request that just arrived, with its trace and span ids chosen."""
        getrandbits = self._rand.getrandbits
        incoming = parse_traceparent(traceparent)
        self.open_turns += 1
        return TurnRecord(
            x_request_id=x_request_id,
            route=route,
            arrival_ns=time.time_ns(),
            trace_id=incoming[0] if incoming else getrandbits(128) or 1,
            turn_span_id=getrandbits(64) or 1,
            prefill_span_id=getrandbits(64) or 1,
            decode_span_id=getrandbits(64) or 1,
            remote_parent_span_id=incoming[1] if incoming else None,
            tracestate=tracestate if incoming else None,
        )

    def conversation_started(self, record: TurnRecord, conversation: ConversationId) -> None:
        """Assign the turn index and remember when the previous turn ended (for tool wait)."""
        record.conversation = conversation
        if conversation.value is not None:
            record.turn_index, record.previous_end_ns = self._clock.begin(conversation.value)

    def message_boundaries(self, record: TurnRecord, body: Mapping[str, Any]) -> None:
        """Give the turn its message-boundary hashes and roles (never the text).

        Hashing is proportional to the prompt (~0.9 ms for 500 KB of messages). With an export
        process it is left to that process: the record keeps a reference to ``body``, which the
        proxy does not change after forwarding it, until the finished turn is packed with its
        messages (copied by marshal, several times cheaper than hashing them; no Python loop
        per message in the proxy's process). In-process, they are computed now.
        """
        if self.export_process is not None:
            record.boundary_source = body
            return
        try:
            set_boundaries(record, body, self.boundary_key)
        except Exception:  # a body that does not hash (e.g. nested past the recursion limit)
            logger.debug("kvscope proxy telemetry: message boundaries failed", exc_info=True)
            record.message_count, record.boundary_hashes, record.boundary_roles = 0, "", ""

    def finish_turn(self, record: TurnRecord) -> None:
        """Record the ended turn: metrics now, spans onto the export queue. Never raises."""
        self.open_turns -= 1
        if not record.end_ns:
            record.end_ns = time.time_ns()
        if record.conversation is not None and record.conversation.value is not None:
            self._clock.end(record.conversation.value, record.end_ns)
        try:
            self._observe(record)
            if self.export_process is None:
                set_reply_boundary(record, self.boundary_key)
            if self.export_process is not None:
                self.export_process.submit(record)
            elif self.telemetry is not None:
                processor = self.telemetry.span_processor
                for span in self.spans_for(record):
                    processor.on_end(span)
        except Exception:  # telemetry must never break a turn the client already has
            with self._lock:
                self._span_failures += 1
                first = self._span_failures == 1
            if first:
                logger.exception("kvscope proxy telemetry failed (further failures are counted)")

    def _observe(self, record: TurnRecord) -> None:
        self.metrics.observe(record)

    # -- spans ---------------------------------------------------------------------------------
    def spans_for(self, record: TurnRecord) -> list[ReadableSpan]:
        """The finished OTel spans of one turn record."""
        trace_id, turn_span_id = record.trace_id, record.turn_span_id
        conversation = record.conversation
        conv_id = conversation.value if conversation is not None else None

        turn_attrs = turn_attributes(record, self.router_ttl_s)
        first_token_events: tuple[SpanEvent, ...] = ()
        if record.first_token_ns is not None:
            first_token_events = ((record.first_token_ns, semconv.EVENT_FIRST_TOKEN,
                                   {semconv.TTFT_MS: turn_attrs[semconv.TTFT_MS]}),)
        turn_status = (
            Status(StatusCode.ERROR, record.error_message or record.error_kind)
            if record.error_kind is not None
            else _UNSET_STATUS
        )
        spans = [
            self._span(
                semconv.SPAN_TURN, trace_id, turn_span_id, record.remote_parent_span_id, True,
                SpanKind.SERVER, record.arrival_ns, record.end_ns, turn_attrs,
                first_token_events, turn_status,
            )
        ]

        if record.prefill_start_ns is not None:
            attrs = prefill_attributes(record)
            spans.append(
                self._leg(record, semconv.SPAN_INPUT_PROCESSING, record.prefill_span_id,
                          record.prefill_start_ns, record.prefill_end_ns, attrs, (),
                          semconv.LEG_PREFILL)
            )
        if record.decode_start_ns is not None:
            attrs = decode_attributes(record)
            spans.append(
                self._leg(record, semconv.SPAN_GENERATION, record.decode_span_id,
                          record.decode_start_ns, record.decode_end_ns, attrs,
                          first_token_events, semconv.LEG_DECODE)
            )
        if (
            conv_id is not None
            and record.previous_end_ns is not None
            and record.previous_end_ns <= record.arrival_ns
        ):
            attrs = {
                semconv.GEN_AI_CONVERSATION_ID: conv_id,
                semconv.TURN_INDEX: record.turn_index,
                semconv.WAIT_SOURCE: semconv.WAIT_INFERRED,
            }
            spans.append(
                self._span(semconv.SPAN_TOOL_WAIT, trace_id, self._rand.getrandbits(64) or 1,
                           turn_span_id, False, SpanKind.INTERNAL, record.previous_end_ns,
                           record.arrival_ns, attrs, (), _UNSET_STATUS)
            )
        return spans

    def _leg(
        self,
        record: TurnRecord,
        name: str,
        span_id: int,
        start_ns: int,
        end_ns: int | None,
        attrs: dict[str, Any],
        events: tuple[SpanEvent, ...],
        leg: str,
    ) -> ReadableSpan:
        status = _UNSET_STATUS
        if record.error_leg == leg and record.error_kind is not None:
            status = Status(StatusCode.ERROR, record.error_message or record.error_kind)
        return self._span(name, record.trace_id, span_id, record.turn_span_id, False,
                          SpanKind.CLIENT, start_ns, end_ns or record.end_ns, attrs, events,
                          status)

    # -- drops and exposition ------------------------------------------------------------------
    def dropped_spans(self) -> int:
        """Spans lost so far: queue full, export failed, store insert failed, or build failed."""
        dropped = self._span_failures
        if self.export_process is not None:
            dropped += self.export_process.counts()["dropped_spans"]
        if self.telemetry is not None:
            stats = self.telemetry.span_processor.stats
            dropped += stats.dropped + stats.failed
            writer = self.telemetry.writer
            if writer is not None:
                dropped += writer.stats.failed_rows
        return dropped

    def telemetry_counts(self) -> dict[str, int | bool]:
        """Queue and drop counters, for ``/health``."""
        counts: dict[str, int | bool] = {"enabled": self.enabled}
        if self.export_process is not None:
            process = self.export_process.counts()
            counts.update(
                queued_spans=process["queued_spans"],
                exported_spans=process["exported_spans"],
                dropped_spans=self.dropped_spans(),
                pending_turns=process["pending_records"],
            )
        if self.telemetry is not None:
            stats = self.telemetry.span_processor.stats
            counts.update(
                queued_spans=stats.queued,
                exported_spans=stats.sent,
                dropped_spans=self.dropped_spans(),
            )
        return counts

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the spans of every turn finished so far are exported."""
        if self.export_process is not None:
            return self.export_process.flush(timeout_s)
        if self.telemetry is not None:
            return self.telemetry.flush(timeout_s)
        return True

    def stopping(self) -> None:
        """The proxy began its orderly stop: the turns in flight still end and are recorded
        (the export process, signalled with the proxy, waits for them; see export_process)."""
        if self.export_process is not None:
            self.export_process.stopping()

    def shutdown(self) -> None:
        """Export what is queued and close the destination (blocks; off the event loop)."""
        if self.export_process is not None:
            self.export_process.close()
        if self.telemetry is not None:
            self.telemetry.shutdown()

    def render_metrics(self, router_entries: Callable[[], float], accept: str | None = None
                       ) -> tuple[bytes, str]:
        """``GET /metrics``: the exposition in the format ``accept`` asks for, and its type."""
        scrape = self.metrics.scrape_time
        scrape.router_entries, scrape.dropped_spans = router_entries, self.dropped_spans
        return self.metrics.render(accept)


__all__ = ["MAX_TRACKED_CONVERSATIONS", "ProxyTelemetry", "SpanBuilder", "SpanEvent", "SpanSink",
    "TurnRecord", "decode_attributes", "format_traceparent", "parse_traceparent",
    "prefill_attributes", "sdk_spans", "set_boundaries", "set_reply_boundary", "turn_attributes"]
