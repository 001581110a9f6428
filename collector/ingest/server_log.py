"""A vLLM server's log (prefill or decode) → the NIXL connector's per-request evidence and totals.

vLLM 0.33.0 formats every line as ``vllm/logger.py:28-33`` says: ``{VLLM_LOGGING_PREFIX}
(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d]
%(message)s`` with ``datefmt="%m-%d %H:%M:%S"`` (no year, whole seconds, the server's local
time; the year is taken from the file's modification time). ``fileinfo`` is the file's name, or
its shortened path at DEBUG (``vllm/logging_utils/formatter.py``); a multi-line message repeats
the header on each line (same file).

Per request id (vLLM's internal id, which the ledger reduces to the proxy's X-Request-Id):

* ``Skipping remote pull for %s: %d remote tokens < threshold %d`` (DEBUG,
  ``nixl/pull_scheduler.py:96-101``) → a ``below_threshold`` reuse decision;
* ``Declining expired remote read for %s from engine %s.`` (``nixl/pull_worker.py:161-165``): a
  turn-2 read of decode's blocks (always D→P) past their expiry → a ``pull`` decision and a
  ``declined_expired`` D→P transfer;
* ``NIXL transfer failure: %s | Context: %s`` (``nixl/base_worker.py:1377-1382``, the context
  dict of ``_log_failure`` at 1344-1375 names ``request_id``): ``handshake_failed`` /
  ``handshake_setup_failed`` → a ``handshake_failed`` read, ``transfer_failed`` /
  ``transfer_exception`` / ``transfer_setup_failed`` → a ``failed`` read (and a ``pull``
  decision); the direction is the role's (prefill reads D→P, decode P→D), so these need the
  role: a ``vllm-server-log`` of no named role counts them only;
* ``Failing %d request(s) due to KV load failure (failure_policy=fail, %d tokens affected).
  Request IDs: %s`` (``v1/core/sched/scheduler.py:3765-3770``) → each request's read errored
  the request (role needed, as above).

Counted and summed into the run's settings: the periodic ``KV Transfer metrics: k=v, ...``
line (``kv_connector/v1/metrics.py:108``; its keys from ``NixlKVConnectorStats.reduce``,
``nixl/stats.py:100-160``), ``Recovered from KV load failure`` (scheduler.py:3774-3778),
``Releasing expired KV blocks`` (``nixl/base_worker.py:3370-3375``), ``Potentially invalid KV
blocks`` (``nixl/pull_worker.py:675-680``: a read of blocks decode had already released — a
correctness alarm, listed by request id), ``Got invalid KVTransferParams``
(``nixl/pull_scheduler.py:180-184``) and ``request_finished(...) waiting for N seconds``
(DEBUG, ``nixl/pull_scheduler.py:258-263``). Every other line is counted as unknown.

The log has no duration for any of these: spans from it carry ``kvscope.duration_measured`` =
false, and their counts of tokens or bytes are left out where the line does not give them.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kvscope import semconv
from kvscope.collector.ingest.spans import (
    KIND_INTERNAL,
    LineCounts,
    add_span,
    count_value,
    ingest_id,
    matching_lines,
    measure_value,
    read_source,
    resource,
)
from kvscope.errors import IngestError
from kvscope.store.rows import TraceRows

KIND = "vllm-server-log"
KIND_PREFILL = "vllm-prefill-log"
KIND_DECODE = "vllm-decode-log"

# vllm/logger.py:28-33 (the prefix, VLLM_LOGGING_PREFIX, is any text before the process name).
_LINE = re.compile(
    r"^(?:\x1b\[[0-9;]*m)?.*?\((?P<process>[^()]+?) pid=(?P<pid>\d+)\) "
    r"(?:\x1b\[[0-9;]*m)?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)(?:\x1b\[[0-9;]*m)? "
    r"(?P<time>\d\d-\d\d \d\d:\d\d:\d\d) \[(?P<file>[^\]:]+):(?P<lineno>\d+)\] "
    r"(?P<message>.*)$"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# kv_connector/v1/metrics.py:108; keys and values from nixl/stats.py:119-160.
_METRICS = re.compile(r"^KV Transfer metrics: (?P<pairs>.*)$")
_PAIR = re.compile(r"(?P<key>[^=,]+?)=(?P<value>-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?:, |$)")
# nixl/pull_scheduler.py:96-101
_SKIP = re.compile(r"^Skipping remote pull for (?P<rid>\S+): (?P<count>\d+) remote tokens < "
                   r"threshold (?P<threshold>\d+)$")
# nixl/pull_worker.py:161-165
_DECLINED = re.compile(r"^Declining expired remote read for (?P<rid>\S+) from engine "
                       r"(?P<engine>\S+)\.$")
# nixl/base_worker.py:1377-1382 ("%s. %s" when a message is added, base_worker.py:1373-1374)
_FAILURE = re.compile(r"^NIXL transfer failure: (?P<type>[a-z_]+)(?:\. .*?)? \| Context: "
                      r"(?P<context>\{.*\})$")
_CONTEXT_ID = re.compile(r"'request_id': '(?P<rid>[^']*)'")
_CONTEXT_REMOTE = re.compile(r"'remote_engine_id': '(?P<engine>[^']*)'")
# v1/core/sched/scheduler.py:3765-3770
_FAILING = re.compile(r"^Failing (?P<n>\d+) request\(s\) due to KV load failure "
                      r"\(failure_policy=fail, (?P<tokens>\d+) tokens affected\)\. "
                      r"Request IDs: (?P<ids>.*)$")
# v1/core/sched/scheduler.py:3774-3778
_RECOVERED = re.compile(r"^Recovered from KV load failure: (?P<n>\d+) request\(s\) rescheduled "
                        r"\((?P<tokens>\d+) tokens affected\)\.$")
# nixl/base_worker.py:3370-3375
_RELEASED_EXPIRED = re.compile(r"^Releasing expired KV blocks for request (?P<rid>\S+) which "
                               r"were retrieved by (?P<count>\d+) remote worker\(s\) before "
                               r"lease expired\.$")
# nixl/pull_worker.py:675-680
_INVALID_BLOCKS = re.compile(r"^Potentially invalid KV blocks for unrecognized request "
                             r"(?P<rid>\S+) were retrieved by a decode worker\. They may have "
                             r"expired\.$")
# nixl/pull_scheduler.py:180-184
_INVALID_PARAMS = re.compile(r"^Got invalid KVTransferParams: .* This request will not utilize "
                             r"KVTransfer$")
# nixl/pull_scheduler.py:258-263
_WAITING = re.compile(r"^NIXLConnector request_finished\((?P<rid>\S+)\) waiting for "
                      r"(?P<ttl>\d+) seconds before releasing blocks$")



def _failure_status(failure_type: str) -> str | None:
    """A read's status from ``_log_failure``'s failure type (``handshake_failed``,
    ``handshake_setup_failed``: base_worker.py:1435, 1471; ``transfer_failed``,
    ``transfer_exception``: 3429, 3439; ``transfer_setup_failed``: pull_worker.py:570); None for
    a failure that is not a read's (``notification_failed``, ``transfer_release_failed``)."""
    if failure_type.startswith("handshake_"):
        return semconv.TRANSFER_HANDSHAKE_FAILED
    if failure_type.startswith("transfer_") and not failure_type.endswith("release_failed"):
        return semconv.TRANSFER_FAILED
    return None


# Totals summed over the metrics lines (NixlKVConnectorStats.reduce's keys).
_SUMMED = ("Num successful transfers", "Num failed transfers", "Num KV expired reqs",
           "Num notifs after expiry")
_NS_PER_S = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Event:
    """One per-request line: what it says happened to which vLLM request, when (Unix ns)."""

    line: int
    time_ns: int
    request_id: str
    what: str  # "below_threshold", "declined_expired", a semconv.TRANSFER_* status, "errored"
    remote_engine_id: str | None = None
    count_tokens: int | None = None
    threshold_tokens: int | None = None


@dataclass
class ServerLog:
    """One parsed vLLM server log."""

    path: Path
    sha256: str
    role: str | None  # semconv.ROLE_PREFILL / ROLE_DECODE, or None when not named
    events: list[Event]
    lines: int
    unknown_lines: int
    counts: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    invalid_block_reads: list[str] = field(default_factory=list)

    @property
    def records(self) -> int:
        return len(self.events)

    def run_settings(self) -> dict[str, Any]:
        """The log's totals and counted lines, recorded with the run."""
        return {"role": self.role, "clock": "the server's local time, whole seconds, year "
                "from the file's mtime", "lines": self.lines, "unknown_lines": self.unknown_lines,
                "counts": self.counts, "kv_transfer_metrics": self.metrics,
                "potentially_invalid_kv_block_reads": self.invalid_block_reads}


def looks_like(head: str) -> bool:
    """Whether the start of a file holds a vLLM log line (kind detection)."""
    return any(_LINE.match(line) for line in head.splitlines()[:200])


def _clock(path: Path, mtime_ns: int) -> Any:
    anchor = datetime.fromtimestamp(mtime_ns / _NS_PER_S)

    seconds: dict[str, int] = {}

    def to_ns(number: int, stamp: str) -> int:
        # A log has many lines per second: parse each second once.
        found = seconds.get(stamp)
        if found is None:
            found = seconds[stamp] = parse(number, stamp)
        return found

    def parse(number: int, stamp: str) -> int:
        try:
            moment = datetime.strptime(f"{anchor.year}-{stamp}", "%Y-%m-%d %H:%M:%S")
        except ValueError:
            raise IngestError(f"{path}:{number}: time {stamp!r} is not a date and time "
                              "(vLLM's %m-%d %H:%M:%S)") from None
        if moment > anchor.replace(microsecond=0):
            # A line after the file was last written: it was logged the year before.
            moment = moment.replace(year=anchor.year - 1)
        return int(moment.timestamp()) * _NS_PER_S

    return to_ns


def _request_ids(text: str) -> list[str]:
    """The request ids of a ``set`` repr as scheduler.py logs it (``{'a', 'b'}``)."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return []
    if not isinstance(value, set | list | tuple | frozenset):
        return []
    return sorted(str(v) for v in value)


def read_role(path: Path, role: str | None) -> ServerLog:
    """Parse one vLLM server log of ``role``; IngestError names the file and line of a problem."""
    source = read_source(path)
    text, mtime_ns = source.text, source.mtime_ns
    to_ns = _clock(path, mtime_ns)
    events: list[Event] = []
    counts: dict[str, int] = {}
    metrics: dict[str, float] = {}
    invalid: list[str] = []
    read = LineCounts()
    vllm_lines = 0

    def count(name: str) -> None:
        counts[name] = counts.get(name, 0) + 1

    for number, match in matching_lines(text, _LINE, read):
        vllm_lines += 1
        message = _ANSI.sub("", match["message"])
        now = to_ns(number, match["time"])
        if found := _METRICS.match(message):
            pairs = {m["key"].strip(): measure_value(path, number, m["value"])
                     for m in _PAIR.finditer(found["pairs"])}
            if "Num successful transfers" not in pairs:
                read.unknown += 1
                continue
            count("kv_transfer_metrics")
            for key in _SUMMED:
                metrics[key] = metrics.get(key, 0) + pairs.get(key, 0)
            # Megabytes moved: the interval's average per transfer times its transfers.
            metrics["MB transferred"] = metrics.get("MB transferred", 0) + pairs.get(
                "Avg MB per transfer", 0) * pairs["Num successful transfers"]
        elif found := _SKIP.match(message):
            events.append(Event(number, now, found["rid"], semconv.DECISION_BELOW_THRESHOLD,
                                count_tokens=count_value(path, number, found["count"]),
                                threshold_tokens=count_value(path, number,
                                                                   found["threshold"])))
        elif found := _DECLINED.match(message):
            events.append(Event(number, now, found["rid"], semconv.TRANSFER_DECLINED_EXPIRED,
                                remote_engine_id=found["engine"]))
        elif found := _FAILURE.match(message):
            status = _failure_status(found["type"])
            rid = _CONTEXT_ID.search(found["context"])
            count(f"nixl_failure_{found['type']}")
            if status is not None and rid is not None and rid["rid"] != "None":
                remote = _CONTEXT_REMOTE.search(found["context"])
                events.append(Event(number, now, rid["rid"], status,
                                    remote_engine_id=remote["engine"] if remote else None))
        elif found := _FAILING.match(message):
            count("failing_requests_lines")
            for rid_text in _request_ids(found["ids"]):
                events.append(Event(number, now, rid_text, semconv.OUTCOME_ERROR))
        elif _RECOVERED.match(message):
            count("recovered_from_load_failure")
        elif found := _RELEASED_EXPIRED.match(message):
            count("released_expired_unread" if found["count"] == "0" else "released_expired")
        elif found := _INVALID_BLOCKS.match(message):
            count("potentially_invalid_kv_blocks")
            invalid.append(found["rid"])
        elif _INVALID_PARAMS.match(message):
            count("invalid_kv_transfer_params")
        elif _WAITING.match(message):
            count("blocks_held_after_finish")
        else:
            read.unknown += 1
    if vllm_lines == 0:
        raise IngestError(f"{path}:1: no line in vLLM's log format ((process pid=N) LEVEL "
                          f"MM-DD HH:MM:SS [file:line] message) in {read.lines} lines")
    return ServerLog(path, source.sha256, role, events, read.lines, read.unknown,
                     counts, metrics, invalid)


def read(path: Path) -> ServerLog:
    """A server log whose role was not named."""
    return read_role(path, None)


def read_prefill(path: Path) -> ServerLog:
    """A prefill server's log."""
    return read_role(path, semconv.ROLE_PREFILL)


def read_decode(path: Path) -> ServerLog:
    """A decode server's log."""
    return read_role(path, semconv.ROLE_DECODE)


# --- spans -------------------------------------------------------------------------------------

_DIRECTION = {semconv.ROLE_PREFILL: semconv.DIRECTION_D_TO_P,
              semconv.ROLE_DECODE: semconv.DIRECTION_P_TO_D}
_SERVICE = {semconv.ROLE_PREFILL: semconv.SERVICE_PREFILL,
            semconv.ROLE_DECODE: semconv.SERVICE_DECODE}


def add_spans(log: ServerLog, run_id: str, rows: TraceRows) -> int:
    """Append the reuse decisions and reads the log's lines show; return how many spans."""
    service = _SERVICE.get(log.role or "", semconv.SERVICE_VLLM_SERVER)
    kind = {semconv.ROLE_PREFILL: KIND_PREFILL, semconv.ROLE_DECODE: KIND_DECODE}.get(
        log.role or "", KIND)
    resource_attrs = resource(service, run_id, kind, log.path.name)
    added = 0

    def span(event: Event, name: str, suffix: str, values: dict[str, Any]) -> None:
        nonlocal added
        add_span(rows, resource_attrs=resource_attrs, service=service, name=name,
                 trace_id=ingest_id(log.sha256, event.line, event.request_id, "trace", size=16),
                 span_id=ingest_id(log.sha256, event.line, event.request_id, suffix, size=8),
                 parent="", kind=KIND_INTERNAL, start_ns=event.time_ns, end_ns=event.time_ns,
                 values={semconv.VLLM_REQUEST_ID: event.request_id,
                         semconv.ENGINE_ROLE: log.role, semconv.INGEST_LINE: event.line,
                         semconv.DURATION_MEASURED: False, **values})
        added += 1

    pulled: set[str] = set()
    for event in log.events:
        if event.what == semconv.DECISION_BELOW_THRESHOLD:
            span(event, semconv.SPAN_REUSE_DECISION, "decision", {
                semconv.DECISION: semconv.DECISION_BELOW_THRESHOLD,
                semconv.REMOTE_COUNT_TOKENS: event.count_tokens,
                semconv.THRESHOLD_TOKENS: event.threshold_tokens,
                semconv.TOKENS_TO_PULL: 0})
            continue
        # A turn-2 read is always decode's blocks read by prefill (pull_worker.py:160).
        direction = (semconv.DIRECTION_D_TO_P if event.what == semconv.TRANSFER_DECLINED_EXPIRED
                     else _DIRECTION.get(log.role or ""))
        if direction is None:
            continue  # the direction of this read depends on the role, not named
        if direction == semconv.DIRECTION_D_TO_P and event.request_id not in pulled:
            # Prefill read (or tried to read) decode's blocks: it had decided to pull.
            pulled.add(event.request_id)
            span(event, semconv.SPAN_REUSE_DECISION, "decision",
                 {semconv.DECISION: semconv.DECISION_PULL})
        errored = event.what == semconv.OUTCOME_ERROR
        span(event, semconv.SPAN_KV_TRANSFER, "transfer", {
            semconv.TRANSFER_DIRECTION: direction,
            semconv.TRANSFER_STATUS: semconv.TRANSFER_FAILED if errored else event.what,
            semconv.REQUEST_OUTCOME: semconv.OUTCOME_ERROR if errored else None,
            semconv.REMOTE_ENGINE_ID: event.remote_engine_id})
    return added


__all__ = ["KIND", "KIND_DECODE", "KIND_PREFILL", "Event", "ServerLog", "add_spans",
           "looks_like", "read", "read_decode", "read_prefill", "read_role"]
