"""A P/D proxy's log → the router's lookup, the prefill leg and decode's params, per request.

Two writers log the same per-turn lines, and both are read:

* vLLM 0.33.0's ``examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py``
  (cited ``dpm.py:LINE``), through ``logging.basicConfig(format="%(asctime)s [%(levelname)s]
  %(name)s: %(message)s", datefmt="%Y-%m-%d %H:%M:%S")`` (dpm.py:90-94), logger
  ``disagg_proxy`` (dpm.py:95): times to the second, in the proxy host's local time;
* ``kvscope proxy`` (``kvscope.collector.proxy.app``, cited ``app.py:LINE``), logger
  ``kvscope.collector.proxy.turns`` in vLLM's words, formatted by the kvscope CLI
  (``%(asctime)s %(levelname)s %(name)s: %(message)s``), or vLLM's format with the default
  datefmt when an embedding process configures logging so: times to the millisecond.

Per request id (the X-Request-Id sent to both P and D) the log says: its conversation id or
that it had none; the router's lookup (``cache HIT`` then ``sending D's cached blocks``, a
``stale cache entry`` then ``cache MISS``, or ``cache MISS``) with the entry's age and decode's
request id it offers; with kvscope proxy's ``--reuse-guard``, that the guard withheld decode's
params from an edited history (a HIT, the guard's line naming the request, then ``cache
MISS``); ``Prefill done in N ms``; and, logged by conversation only, ``cached D blocks`` when
decode's final chunk returned its params. The HIT, stale and cached lines name
no request id (vLLM logs them from ``ConversationKVCache``, dpm.py:131-156): a HIT or stale line
is logged in the same synchronous step as the request's next line, which names it; a cached line
belongs to the conversation's latest request (a client sends turn k+1 only after turn k's
response, which ends after that line). A request's turn index is its place among its
conversation's requests in the log.

What the log cannot tell is left out, never guessed: the turn's end (vLLM's proxy logs none),
the decode leg's time, the engine's reuse decision and transfers. A request with a conversation
id whose prefill finished and for which no ``cached D blocks`` line followed had no params from
decode (vLLM logs the line whenever decode returned params for a conversation, dpm.py:288-292,
dpm.py:340-344); without a conversation id that is not logged either way (not measured).

Failures: vLLM's proxy lets an upstream error propagate, so uvicorn logs the 5xx it answered
(its access line) and the traceback, whose exception line is the cause (an
``httpx.HTTPStatusError`` names the upstream's status). Neither names the request: a failure is
placed on the only request in its prefill leg at that point (no ``Prefill done`` yet), and
counted as not placed (``errors_not_placed``) when several or none were; a failure after the
prefill leg (in decode's stream) is not placed. A request that follows a failed one of the
same conversation repeats its turn (a client sends the next turn only after a response): it
takes the failed one's turn index and ``kvscope.turn.attempts``, and the failed one becomes a
``kvscope.turn_attempt`` span (its cause and status kept, no extra turn). A failed request no
request repeated is an errored turn with its cause as the span's status message.

Lines of other loggers (uvicorn's access log, tracebacks) and proxy lines of no known pattern
are counted (``unknown_lines``), not errors. A file that is not UTF-8, a proxy line whose time
does not parse, or a file named a proxy log with no proxy line at all is an IngestError naming
the file and line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kvscope import semconv
from kvscope.collector.ingest.spans import (
    KIND_CLIENT,
    KIND_SERVER,
    STATUS_ERROR,
    STATUS_UNSET,
    LineCounts,
    add_span,
    count_value,
    ingest_id,
    measure_value,
    read_source,
    resource,
)
from kvscope.collector.proxy.conversation import ConversationId
from kvscope.collector.proxy.telemetry import (
    TurnRecord,
    decode_attributes,
    prefill_attributes,
    turn_attributes,
)
from kvscope.errors import IngestError
from kvscope.reuse.router import GUARD_EDITED
from kvscope.store.rows import TraceRows

KIND = "vllm-proxy-log"

VLLM_LOGGER = "disagg_proxy"  # dpm.py:95
KVSCOPE_LOGGER = "kvscope.collector.proxy.turns"  # app.py:61

# "%(asctime)s [%(levelname)s] %(name)s: %(message)s" with datefmt "%Y-%m-%d %H:%M:%S"
# (dpm.py:91-92); kvscope's CLI: "%(asctime)s %(levelname)s %(name)s: %(message)s" (cli.py,
# logging's default datefmt adds ",mmm").
_LINE = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:,(?P<ms>\d{3}))? "
    r"(?:\[(?P<level>[A-Z]+)\]|(?P<bare_level>[A-Z]+)) "
    rf"(?P<logger>{re.escape(VLLM_LOGGER)}|{re.escape(KVSCOPE_LOGGER)}): (?P<message>.*)$"
)
# The messages (vLLM's format strings; kvscope's proxy logs the same, app.py:117-135, 532, 605).
# "conv=%s: cache HIT (age=%.1fs)" (dpm.py:139; app.py:121)
_HIT = re.compile(r"^conv=(?P<conv>.*): cache HIT \(age=(?P<age>\d+\.\d)s\)$")
# "conv=%s: stale cache entry (age=%.1fs > ttl=%.1fs), discarding" (dpm.py:132; app.py:123)
_STALE = re.compile(
    r"^conv=(?P<conv>.*): stale cache entry \(age=(?P<age>\d+\.\d)s > ttl=\d+\.\ds\), "
    r"discarding$")
# "conv=%s: cached D blocks (remote_request_id=%s, blocks=%d)" (dpm.py:151; app.py:605)
_CACHED = re.compile(
    r"^conv=(?P<conv>.*): cached D blocks \(remote_request_id=(?P<decode_id>.*), "
    r"blocks=(?P<blocks>\d+)\)$")
# "[%s] No conversation_id provided — KV cache reuse disabled ..." (dpm.py:397-405; app.py:117)
_NO_CONVERSATION = re.compile(r"^\[(?P<rid>[^\]]+)\] No conversation_id provided\b")
# "[%s] conv=%s: sending D's cached blocks to P (remote_request_id=%s)" (dpm.py:415; app.py:132)
_SENDING = re.compile(
    r"^\[(?P<rid>[^\]]+)\] conv=(?P<conv>.*): sending D's cached blocks to P "
    r"\(remote_request_id=(?P<offered>.*)\)$")
# "[%s] conv=%s: cache MISS" (dpm.py:430; app.py:135)
_MISS = re.compile(r"^\[(?P<rid>[^\]]+)\] conv=(?P<conv>.*): cache MISS$")
# "[%s] Prefill done in %.0fms" (dpm.py:442; app.py:532)
_PREFILL = re.compile(r"^\[(?P<rid>[^\]]+)\] Prefill done in (?P<ms>\d+)ms$")
# kvscope proxy --reuse-guard: "[%s] reuse guard: conversation history edited since the turn of
# decode's params; sending MISS params" (app.py _guard), logged after the conversation's "cache
# HIT" line and before the request's "cache MISS" line: the router hit, the guard withheld
# decode's params.
_GUARD_EDITED = re.compile(r"^\[(?P<rid>[^\]]+)\] reuse guard: conversation history edited "
                           r"since the turn of decode's params; sending MISS params$")
# "Ready: %d prefill, %d decode instances" (dpm.py:369): known, carries nothing per turn.
_READY = re.compile(r"^Ready: \d+ prefill, \d+ decode instances$")

# Failures. vLLM's proxy lets an upstream error propagate (dpm.py _send_to_prefill and
# _stream_from_decode call raise_for_status): uvicorn, run with its default log config
# (dpm.py __main__), logs the access line with the status its error handler sent
# (uvicorn/logging.py AccessFormatter: '%(levelprefix)s %(client_addr)s - "%(request_line)s"
# %(status_code)s') and "Exception in ASGI application" with the traceback, whose last
# unindented line is the exception (the cause).
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ACCESS = re.compile(r'^(?:INFO|WARNING|ERROR):\s+\S+ - "(?P<method>[A-Z]+) \S+ HTTP/[\d.]+" '
                     r"(?P<status>\d{3})\b")
_TRACEBACK = re.compile(r"^(?:\+ Exception Group )?Traceback \(most recent call last\):$")
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Timeout|Failure))"
                        r"(?::\s*(?P<message>.*))?$")

_NS_PER_S = 1_000_000_000
_NS_PER_MS = 1_000_000


@dataclass(slots=True)
class ProxyRequest:
    """One request the proxy handled, as its log lines say (times in Unix ns)."""

    line: int
    x_request_id: str
    conversation_id: str | None
    turn_index: int | None  # place among its conversation's requests in this log
    time_ns: int  # of its first line
    resolution_ns: int  # of the log's clock: 1 s for vLLM's proxy, 1 ms for kvscope's
    lookup: str  # semconv.ROUTER_*
    entry_age_s: float | None = None
    offered_request_id: str | None = None
    prefill_ms: float | None = None
    prefill_end_ns: int | None = None
    # kvscope proxy's --reuse-guard verdict, where its log line names the request.
    reuse_guard: str | None = None
    decode_request_id: str | None = None
    retention_blocks: int | None = None
    cached_ns: int | None = None
    # A failure the log placed on this request: its cause (the exception line) and HTTP status.
    error_cause: str | None = None
    error_status: int | None = None
    # The request that repeated this failed one (a client's retry of the same turn), and how
    # many requests this turn took up to this one.
    retried_by: str | None = None
    attempts: int = 1
    # (trace id, span id) of the client's record of the same turn, when one took this request's
    # evidence (kvscope ingest's join): the legs hang under it.
    joined_to: tuple[str, str] | None = None
    # The log it came from (span ids and resource).
    file_sha256: str = ""
    file_name: str = ""

    @property
    def errored(self) -> bool:
        return self.error_cause is not None or self.error_status is not None

    @property
    def params_returned(self) -> bool | None:
        """Whether decode returned its params; None where the log cannot say."""
        if self.decode_request_id is not None:
            return True
        if self.conversation_id is None or self.prefill_ms is None:
            return None  # no conversation: never logged; no prefill: decode never reached
        return False


@dataclass
class ProxyLog:
    """One parsed proxy log."""

    path: Path
    sha256: str
    requests: list[ProxyRequest]
    lines: int
    unknown_lines: int
    writers: list[str] = field(default_factory=list)
    # Failures the log shows that no single request could take (several were in their
    # prefill leg, or none was).
    errors_not_placed: int = 0

    @property
    def records(self) -> int:
        return len(self.requests)

    def run_settings(self) -> dict[str, Any]:
        """What the run records about this log."""
        return {"clock": "the proxy host's local time, as logged", "writers": self.writers,
                "lines": self.lines, "unknown_lines": self.unknown_lines,
                "errors_not_placed": self.errors_not_placed}


def looks_like(head: str) -> bool:
    """Whether the start of a file holds a proxy line (kind detection)."""
    return any(_LINE.match(line) for line in head.splitlines()[:200])


def _time_ns(path: Path, number: int, stamp: str, ms: str | None) -> int:
    try:
        moment = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S")  # local time, as logged
    except ValueError:
        raise IngestError(f"{path}:{number}: time {stamp!r} is not a date and time") from None
    return int(moment.timestamp()) * _NS_PER_S + int(ms or 0) * _NS_PER_MS


@dataclass
class _Failures:
    """Places the failures a log shows (an access line of status >= 500, a traceback) on the
    request that failed: the only one in its prefill leg (no ``Prefill done`` yet) when the
    failure is logged. A traceback and a 5xx access line with no proxy line between them are
    one failure (uvicorn logs both, in either order)."""

    in_prefill: dict[str, ProxyRequest] = field(default_factory=dict)
    last: ProxyRequest | None = None
    not_placed: int = 0
    in_traceback: bool = False
    cause: str | None = None

    def proxy_line(self) -> None:
        """A proxy line ends a traceback, and what follows is a new failure."""
        self.end_traceback()
        self.last = None

    def end_traceback(self) -> None:
        if self.in_traceback:
            self.in_traceback = False
            if self.cause is not None:
                self.failed(self.cause, None)

    def failed(self, cause: str | None, status: int | None) -> None:
        last = self.last
        if last is not None and (cause is None or last.error_cause is None) and (
                status is None or last.error_status is None):
            # The other half of the failure just logged (placed or not).
            last.error_cause = last.error_cause or cause
            last.error_status = last.error_status or status
            return
        if len(self.in_prefill) != 1:
            self.not_placed += 1
            # Holds the halves seen, so the other half is not counted again.
            self.last = ProxyRequest(0, "", None, None, 0, 0, "", error_cause=cause,
                                     error_status=status)
            return
        (request,) = self.in_prefill.values()
        self.in_prefill.clear()
        request.error_cause, request.error_status = cause, status
        self.last = request

    def other_line(self, raw: str) -> None:
        """A line of another logger: uvicorn's access line, a traceback, or neither."""
        line = _ANSI.sub("", raw)
        if _TRACEBACK.match(line):
            self.end_traceback()
            self.in_traceback, self.cause = True, None
            return
        if self.in_traceback:
            if found := _EXCEPTION.match(line):
                self.cause = line  # a chained exception's line replaces the one before
                return
            if line[:1] in (" ", "\t", "|", "+", "^", "~") or not line.strip() or (
                    line.startswith(("During handling", "The above exception"))):
                return
        self.end_traceback()
        if (found := _ACCESS.match(line)) and int(found["status"]) >= 500:
            self.failed(None, int(found["status"]))


def read(path: Path) -> ProxyLog:
    """Parse one proxy log; IngestError names the file and line of a problem."""
    source = read_source(path)
    text = source.text
    sha256 = source.sha256
    requests: dict[str, ProxyRequest] = {}
    # Per conversation: the router's last lookup line not yet claimed, and the requests in order.
    pending: dict[str, tuple[str, float]] = {}
    # Requests the reuse guard sent MISS params although the router hit (its line comes first).
    guarded: set[str] = set()
    by_conversation: dict[str, list[ProxyRequest]] = {}
    writers: set[str] = set()
    seconds: dict[str, int] = {}
    counts = LineCounts()
    failures = _Failures()
    proxy_lines = 0

    def opened(rid: str, conv: str | None, number: int, now: int, resolution: int,
               lookup: str) -> ProxyRequest:
        request = requests.get(rid)
        if request is None:
            turns = by_conversation.setdefault(conv, []) if conv is not None else None
            previous = turns[-1] if turns else None
            request = ProxyRequest(number, rid, conv, None, now, resolution, lookup)
            if previous is not None and previous.errored and previous.retried_by is None:
                # The conversation's last request failed: this one repeats its turn (a client
                # sends the next turn only after a response).
                previous.retried_by = rid
                request.turn_index = previous.turn_index
                request.attempts = previous.attempts + 1
            elif turns is not None:
                request.turn_index = (previous.turn_index or 0) + 1 if previous else 1
            requests[rid] = request
            failures.in_prefill[rid] = request
            if turns is not None:
                turns.append(request)
        return request

    for number, raw in enumerate(text.splitlines(), start=1):
        counts.lines += 1
        match = _LINE.match(raw)
        if match is None:
            counts.unknown += 1
            failures.other_line(raw)
            continue
        failures.proxy_line()
        proxy_lines += 1
        stamp = match["time"]
        second = seconds.get(stamp)
        if second is None:  # a log has many lines per second: parse each second once
            second = seconds[stamp] = _time_ns(path, number, stamp, None)
        now = second + int(match["ms"] or 0) * _NS_PER_MS
        resolution = _NS_PER_MS if match["ms"] is not None else _NS_PER_S
        writers.add(match["logger"])
        message = match["message"]
        if found := _HIT.match(message):
            pending[found["conv"]] = (semconv.ROUTER_HIT,
                                      measure_value(path, number, found["age"]))
        elif found := _STALE.match(message):
            pending[found["conv"]] = (semconv.ROUTER_STALE,
                                      measure_value(path, number, found["age"]))
        elif found := _SENDING.match(message):
            conv = found["conv"]
            _, age = pending.pop(conv, (semconv.ROUTER_HIT, None))
            request = opened(found["rid"], conv, number, now, resolution, semconv.ROUTER_HIT)
            request.entry_age_s, request.offered_request_id = age, found["offered"]
        elif found := _GUARD_EDITED.match(message):
            guarded.add(found["rid"])
        elif found := _MISS.match(message):
            conv = found["conv"]
            lookup, age = pending.pop(conv, (semconv.ROUTER_MISS, None))
            edited = found["rid"] in guarded and lookup == semconv.ROUTER_HIT
            if lookup != semconv.ROUTER_STALE and not edited:
                lookup, age = semconv.ROUTER_MISS, None
            request = opened(found["rid"], conv, number, now, resolution, lookup)
            request.entry_age_s = age
            if edited:
                request.reuse_guard = GUARD_EDITED
        elif found := _NO_CONVERSATION.match(message):
            opened(found["rid"], None, number, now, resolution, semconv.ROUTER_NO_CONVERSATION_ID)
        elif found := _PREFILL.match(message):
            done = requests.get(found["rid"])
            if done is None:
                counts.unknown += 1  # its lookup line is not in this file (a log cut at its start)
                continue
            done.prefill_ms = measure_value(path, number, found["ms"])
            done.prefill_end_ns = now
            failures.in_prefill.pop(done.x_request_id, None)
        elif found := _CACHED.match(message):
            # Decode's final chunk of the conversation's request in flight: its latest (a
            # client sends turn k+1 after turn k's response, which ends after this line).
            turns = by_conversation.get(found["conv"], [])
            latest = turns[-1] if turns else None
            if latest is None or latest.prefill_ms is None or latest.decode_request_id:
                counts.unknown += 1
                continue
            latest.decode_request_id = found["decode_id"]
            latest.retention_blocks = count_value(path, number, found["blocks"])
            latest.cached_ns = now
        elif not _READY.match(message):
            counts.unknown += 1
    failures.end_traceback()
    for request in requests.values():
        request.file_sha256, request.file_name = sha256, path.name
    if proxy_lines == 0:
        raise IngestError(f"{path}:1: no line of vLLM's or kvscope's proxy log (loggers "
                          f"{VLLM_LOGGER!r}, {KVSCOPE_LOGGER!r}) in {counts.lines} lines")
    return ProxyLog(path, sha256, list(requests.values()), counts.lines,
                    counts.unknown, sorted(writers), failures.not_placed)


# --- spans -------------------------------------------------------------------------------------


# What a span read from a proxy's log carries that the live proxy's span does not, per span
# kind: the line it came from, that it has no duration, who observed the turn, and the attempts a
# retried turn took (a failed attempt is its own ``kvscope.turn_attempt`` span, which only a log
# gives). Everything else is the proxy's shape: ingest builds the proxy's own TurnRecord and
# shapes it with the same functions (:func:`~kvscope.collector.proxy.telemetry.turn_attributes`
# and the legs'); a test checks both sets against a live run.
LOG_ONLY: dict[str, frozenset[str]] = {
    semconv.SPAN_TURN: frozenset({semconv.INGEST_LINE, semconv.DURATION_MEASURED,
                                  semconv.TURN_OBSERVER, semconv.TURN_ATTEMPTS}),
    semconv.SPAN_INPUT_PROCESSING: frozenset({semconv.INGEST_LINE}),
    semconv.SPAN_GENERATION: frozenset({semconv.DURATION_MEASURED}),
}
# What no line of a proxy's log gives, per span kind (the live proxy's span has it): the ledger
# reads these as not measured. The router's TTL is in a stale line only, and not read; a refused
# conversation id is logged as none; a failure is placed on the turn, not on a leg.
NOT_IN_THE_LOG: dict[str, frozenset[str]] = {
    semconv.SPAN_TURN: frozenset({
        semconv.HTTP_ROUTE, semconv.STREAM_REQUESTED, semconv.CONVERSATION_ID_SOURCE,
        semconv.GEN_AI_REQUEST_MODEL, semconv.GEN_AI_USAGE_INPUT_TOKENS,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS, semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
        semconv.DECODE_CACHED_TOKENS, semconv.ROUTER_TTL_S, semconv.PREFILL_INSTANCE,
        semconv.DECODE_INSTANCE, semconv.MESSAGE_COUNT, semconv.MESSAGE_BOUNDARY_HASHES,
        semconv.MESSAGE_BOUNDARY_HASH_KEY_ID, semconv.MESSAGE_ROLES,
        semconv.REPLY_BOUNDARY_HASH, semconv.GEN_AI_RESPONSE_FINISH_REASONS, semconv.TTFT_MS,
        semconv.CONVERSATION_ID_REJECTED, semconv.CLIENT_DISCONNECTED}),
    semconv.SPAN_INPUT_PROCESSING: frozenset({
        semconv.PREFILL_INSTANCE, semconv.PROMPT_TOKENS, semconv.CACHED_TOKENS,
        semconv.VLLM_REQUEST_ID, semconv.REMOTE_OFFERED_TOKENS, semconv.ERROR_KIND}),
    semconv.SPAN_GENERATION: frozenset({
        semconv.STREAM_CHUNKS, semconv.DECODE_STREAMED, semconv.DECODE_INSTANCE,
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS, semconv.REMOTE_NUM_TOKENS,
        semconv.CLIENT_DISCONNECTED, semconv.ERROR_KIND}),
}

# What the log gives of some turns only (the turn span's): the status and kind of a failure (its
# access line and traceback; a successful answer's status is not placed on a request), the
# reuse guard's verdict on an edited history (its line; a passed check logs none), and the turn
# index of a request in a conversation (the live proxy counts one without a conversation turn 1).
PARTLY_LOGGED = frozenset({semconv.HTTP_RESPONSE_STATUS_CODE, semconv.ERROR_KIND,
                           semconv.REUSE_GUARD, semconv.TURN_INDEX})


def _error_kind(request: ProxyRequest) -> str | None:
    """The kind of the failure placed on ``request``, where its cause or status says."""
    cause = (request.error_cause or "").split(":")[0]
    if "Timeout" in cause:
        return semconv.ERROR_TIMEOUT
    if "Connect" in cause:
        return semconv.ERROR_CONNECT
    if request.error_status is not None or "HTTPStatusError" in (request.error_cause or ""):
        return semconv.ERROR_UPSTREAM_STATUS
    return None


def turn_record(request: ProxyRequest) -> TurnRecord:
    """The proxy's own record of the request, as far as its log says: what no line gives is
    None (not measured). Span ids are ingest's own (deterministic per file), not the record's."""
    prefill_end = request.prefill_end_ns if request.prefill_ms is not None else None
    return TurnRecord(
        x_request_id=request.x_request_id, route=None, arrival_ns=request.time_ns,
        trace_id=0, turn_span_id=0, prefill_span_id=0, decode_span_id=0,
        conversation=ConversationId(request.conversation_id, None),
        turn_index=request.turn_index, stream=None,
        lookup=request.lookup, lookup_age_s=request.entry_age_s,
        offered_request_id=request.offered_request_id,
        d_metadata_attached=request.lookup == semconv.ROUTER_HIT and request.reuse_guard is None,
        reuse_guard=request.reuse_guard,
        prefill_start_ns=(None if prefill_end is None or request.prefill_ms is None
                          else prefill_end - round(request.prefill_ms * _NS_PER_MS)),
        prefill_end_ns=prefill_end,
        decode_request_id=request.decode_request_id,
        retention_returned=request.params_returned, retention_blocks=request.retention_blocks,
        chunks=None, decode_streamed=None,
        # The HTTP status the proxy answered (its access line; the upstream's is in the cause).
        status_code=request.error_status, error_kind=_error_kind(request),
        error_message=request.error_cause or "", end_ns=request.time_ns)


# The proxy's evidence a client's record of the same turn takes (kvscope ingest's join).
JOINED = (semconv.X_REQUEST_ID, semconv.ROUTER_LOOKUP, semconv.ROUTER_ENTRY_AGE_S,
          semconv.REUSE_GUARD)


def turn_values(request: ProxyRequest) -> dict[str, Any]:
    """What the proxy's log measured of the turn that a client's record of it takes: the
    :data:`JOINED` attributes of the turn span, and the attempts a retried turn took."""
    shaped = turn_attributes(turn_record(request), None)
    return {**{key: shaped.get(key) for key in JOINED},
            semconv.TURN_ATTEMPTS: request.attempts if request.attempts > 1 else None}


def add_legs(request: ProxyRequest, run_id: str, rows: TraceRows, trace_id: str,
             parent: str) -> int:
    """Append the prefill leg (its logged time) and the decode leg (whether params came back)
    of ``request`` under the turn span ``parent``; return how many spans."""
    resource_attrs = resource(semconv.SERVICE_PROXY_LOG, run_id, KIND, request.file_name)
    sha = request.file_sha256
    record = turn_record(request)
    added = 0
    common = {"resource_attrs": resource_attrs, "service": semconv.SERVICE_PROXY_LOG,
              "trace_id": trace_id, "parent": parent, "kind": KIND_CLIENT}
    if record.prefill_start_ns is not None and record.prefill_end_ns is not None:
        add_span(rows, name=semconv.SPAN_INPUT_PROCESSING,
                 span_id=ingest_id(sha, request.x_request_id, "prefill", size=8),
                 start_ns=record.prefill_start_ns, end_ns=record.prefill_end_ns,
                 values={**prefill_attributes(record), semconv.INGEST_LINE: request.line},
                 **common)
        added += 1
    if record.retention_returned is not None:
        start = request.prefill_end_ns or request.time_ns
        add_span(rows, name=semconv.SPAN_GENERATION,
                 span_id=ingest_id(sha, request.x_request_id, "decode", size=8),
                 start_ns=start, end_ns=start,
                 # The log has no end of the decode leg.
                 values={**decode_attributes(record), semconv.DURATION_MEASURED: False},
                 **common)
        added += 1
    return added


def add_spans(log: ProxyLog, run_id: str, rows: TraceRows) -> int:
    """Append each request's legs, under its own turn span or, when a client's record took the
    request (:mod:`.join`), under that turn's span; return how many spans."""
    resource_attrs = resource(semconv.SERVICE_PROXY_LOG, run_id, KIND, log.path.name)
    added = 0
    for request in log.requests:
        if request.joined_to is not None:
            added += add_legs(request, run_id, rows, *request.joined_to)
            continue
        trace_id = ingest_id(log.sha256, request.x_request_id, "trace", size=16)
        span_id = ingest_id(log.sha256, request.x_request_id, "turn", size=8)
        common = {"resource_attrs": resource_attrs, "service": semconv.SERVICE_PROXY_LOG,
                  "trace_id": trace_id, "span_id": span_id, "parent": "", "kind": KIND_SERVER,
                  "start_ns": request.time_ns, "end_ns": request.time_ns,
                  "status": STATUS_ERROR if request.errored else STATUS_UNSET,
                  "status_message": request.error_cause or ""}
        own = {semconv.INGEST_LINE: request.line, semconv.DURATION_MEASURED: False}
        if request.retried_by is not None:
            # A failed attempt the client repeated: evidence of the turn, not a turn.
            add_span(rows, name=semconv.SPAN_TURN_ATTEMPT, **common, values={
                semconv.X_REQUEST_ID: request.x_request_id,
                semconv.GEN_AI_CONVERSATION_ID: request.conversation_id,
                semconv.TURN_INDEX: request.turn_index, **own,
                semconv.HTTP_RESPONSE_STATUS_CODE: request.error_status,
                semconv.ERROR_KIND: _error_kind(request),
                semconv.RETRIED_BY_REQUEST_ID: request.retried_by})
            added += 1
            continue
        add_span(rows, name=semconv.SPAN_TURN, **common, values={
            **turn_attributes(turn_record(request), None), **own,
            semconv.TURN_ATTEMPTS: request.attempts if request.attempts > 1 else None,
            semconv.TURN_OBSERVER: semconv.OBSERVER_PROXY_LOG})
        added += 1 + add_legs(request, run_id, rows, trace_id, span_id)
    return added


__all__ = ["JOINED", "KIND", "KVSCOPE_LOGGER", "LOG_ONLY", "NOT_IN_THE_LOG", "PARTLY_LOGGED",
    "ProxyLog", "ProxyRequest", "VLLM_LOGGER", "add_legs", "add_spans", "looks_like", "read",
    "turn_record", "turn_values"]
