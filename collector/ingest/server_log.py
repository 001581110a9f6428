"""A vLLM server's log (prefill or decode) → the NIXL connector's per-request evidence and totals.

vLLM 0.33.0 writes a line in one of three formats, all read:

* plain (``vllm/logger.py:28-33``): ``{VLLM_LOGGING_PREFIX}(%(vllm_process_name)s
  pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s`` with
  ``datefmt="%m-%d %H:%M:%S"`` (no year, whole seconds, the server's local time; the year is
  taken from the file's modification time). ``fileinfo`` is the file's name, or its shortened
  path at DEBUG (``vllm/logging_utils/formatter.py``); a multi-line message repeats the header
  on each line (same file);
* coloured (``ColoredFormatter``, ``logging_utils/formatter.py:98-136``, on a terminal or with
  ``VLLM_LOGGING_COLOR=1``): the same with ANSI codes around the process, level, time and file;
* JSON (``--log-formatter json``, ``vllm/logger.py:241-248``): python-json-logger with the
  fields of ``formatter.py:7-9`` (asctime, levelname, name, processName, process, message) and
  logging's default date format (year and milliseconds, local time).

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
correctness alarm, listed by request id, and a ``kvscope.kv_retention`` span of that request,
released as expired, marked ``kvscope.retention.read_after_release``, so that the ledger calls
the turn offered those blocks ``reused_invalid`` after release), ``Got invalid KVTransferParams``
(``nixl/pull_scheduler.py:180-184``) and ``request_finished(...) waiting for N seconds``
(DEBUG, ``nixl/pull_scheduler.py:258-263``). Every other line is counted as unknown.

Pulls and their success, from the DEBUG lines (a real server's log at ``VLLM_LOGGING_LEVEL=DEBUG``
shows no other per-request line of a read that went well):

* ``NIXLConnector update_state_after_alloc: num_external_tokens=N, kv_transfer_params=...``
  (``nixl/pull_scheduler.py:112-117``) with N > 0 and remote blocks in the params is a read of N
  tokens (decode's offer, ``remote_num_tokens``, is in the params; prefill's own hit is the
  ``num_computed_tokens`` of the ``get_num_new_matched_tokens`` line before it,
  pull_scheduler.py:52-57). The line names no request: it is tied to the first request a later
  line names as read (``start_load_kv for request``, pull_worker.py:61-68, a failure, a decline,
  or the scheduler's ``Finished recving KV transfer for request``, scheduler.py:3570), its token
  counts kept only when no other waiting read had other counts;
* ``Finished recving`` is the read's success unless a line says it failed: vLLM lists failed
  reads among the finished ones too. ``Skipping KV post-processing for failed request``
  (``nixl/base_worker.py:3253-3256``) is a failed read, the only line of one to a peer whose
  metadata was invalidated (``Local NIXL metadata for remote engine … was invalidated``,
  base_worker.py:4011-4016: counted, the engines listed).

A failed handshake or transfer of a notify-only request (its context's ``num_local_blocks`` is
0: prefill's own cache covered decode's offer) is no read and no pull: vLLM drops it
(base_worker.py:3218-3224), and it is only counted. The start-up line (``nixl/base_scheduler.py
:187-194``) gives ``kv_recompute_threshold`` and ``decoder_kv_blocks_ttl``; the periodic stats
line (``v1/metrics/loggers.py:276-340``) its ``KV fetch: … in progress`` gauge (the highest
seen: a read stalled) and its ``Preemptions`` (per interval, summed).

What the logs cannot show: the ``KV Transfer metrics`` line is logged at DEBUG while the engine
is idle (``v1/metrics/loggers.py:278-280``), so at INFO the intervals of an idle engine
(expiries of decode's blocks while no request runs, for one) are missing from the sums; and
each line's counts are since the previous line (they reset,
``kv_connector/v1/metrics.py:93-111``), so a lost or cut line loses its interval. The sums are
lower bounds.

The log has no duration for any of these: spans from it carry ``kvscope.duration_measured`` =
false, and their counts of tokens or bytes are left out where the line does not give them.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kvscope import semconv
from kvscope.collector.engine_telemetry import (
    EngineRecord,
    KvRetentionRecord,
    KvTransferRecord,
    ReuseDecisionRecord,
    decision_attributes,
    retention_attributes,
    transfer_attributes,
)
from kvscope.collector.ingest import spans
from kvscope.errors import IngestError
from kvscope.store.rows import TraceRows

KIND = "vllm-server-log"
# An Event's ``what`` for decode's "Potentially invalid KV blocks for unrecognized request" line.
READ_AFTER_RELEASE = "read_after_release"
KIND_PREFILL = "vllm-prefill-log"
KIND_DECODE = "vllm-decode-log"

# vllm/logger.py:28-33 (the prefix, VLLM_LOGGING_PREFIX, is any text before the process name),
# matched once the colour codes of ColoredFormatter (logging_utils/formatter.py:98-136: around
# the process, the level, the time and the file) are taken out.
_LINE = re.compile(
    r"^.*?\((?P<process>[^()]+?) pid=(?P<pid>\d+)\) "
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"(?P<time>\d\d-\d\d \d\d:\d\d:\d\d) \[(?P<file>[^\]:]+):(?P<lineno>\d+)\] "
    r"(?P<message>.*)$"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# vllm/logger.py:241-248 (--log-formatter json): python-json-logger's JsonFormatter with
# logging_utils/formatter.py:7-9's fields, "%(asctime)s %(levelname)s %(name)s %(processName)s
# %(process)d %(message)s", and no datefmt: logging's default, "YYYY-MM-DD HH:MM:SS,mmm".
_JSON_TIME = re.compile(r"^(?P<second>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<ms>\d{3})$")
_LEVELS = frozenset(("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
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
# nixl/base_worker.py:3253-3256: every failed read the worker finishes (HMA or not), including
# those that fail with no per-request line (a peer whose metadata was invalidated).
_POST_PROCESS_SKIPPED = re.compile(r"^Skipping KV post-processing for failed request "
                                   r"(?P<rid>\S+)$")
# nixl/base_worker.py:4011-4016: later reads from that engine fail fast (base_worker's
# _read_blocks_for_req, pull_worker.py:141-145) until a new handshake.
_METADATA_INVALIDATED = re.compile(r"^Local NIXL metadata for remote engine (?P<engine>\S+) "
                                   r"was invalidated; re-handshaking after reads drain"
                                   r"(?: and a (?P<backoff>\d+)s backoff)?\.$")
# nixl/base_scheduler.py:187-194 (no space after "tokens.": vLLM's own text).
_STARTUP = re.compile(r"^Bidirectional KV transfer is enabled and the kv recompute threshold "
                      r"is set to (?P<threshold>\d+) tokens\.\s*KV blocks on D are released "
                      r"after a TTL of (?P<ttl>\d+) seconds\.$")
# v1/metrics/loggers.py:276-340, the periodic line ("Engine 000: " prefix, loggers.py:177-178);
# its optional parts: loggers.py:303-307 (gauges now) and 310-312 (since the last line).
_STATS = re.compile(r"^(?:Engine \d+: )?Avg prompt throughput: ")
_KV_FETCH = re.compile(r"KV fetch: (?P<waiting>\d+) waiting to start, (?P<progress>\d+) in "
                       r"progress, (?P<completed>\d+) completed waiting")
_PREEMPTIONS = re.compile(r"Preemptions: (?P<n>\d+)")
# nixl/pull_scheduler.py:52-57 (DEBUG): prefill's own hit as the connector sees it.
_MATCHED = re.compile(r"^NIXLConnector get_num_new_matched_tokens: num_computed_tokens="
                      r"(?P<computed>\d+), kv_transfer_params=(?P<params>.*)$")
# nixl/pull_scheduler.py:112-117 (DEBUG): the tokens the scheduler allocated to load from the
# remote engine; > 0 with remote blocks is a read (pull_scheduler.py:129-175). No request id.
_ALLOCATED = re.compile(r"^NIXLConnector update_state_after_alloc: num_external_tokens="
                        r"(?P<tokens>\d+), kv_transfer_params=(?P<params>.*)$")
# nixl/pull_worker.py:61-68 (DEBUG): the worker starts a request's read (or, with no local
# blocks, only notifies the remote: pull_worker.py:69-76).
_START_LOAD = re.compile(r"^start_load_kv for request (?P<rid>\S+) from remote engine "
                         r"(?P<engine>\S+)\. Num local_block_ids: (?P<local>\d+)\. "
                         r"Num remote_block_ids: (?P<remote>\d+)\.\s*$")
# v1/core/sched/scheduler.py:3570 (DEBUG): the workers finished the request's read, failed or
# not (a failed one is also in failed_recving); never logged for a notify-only request.
_FINISHED_RECVING = re.compile(r"^Finished recving KV transfer for request (?P<rid>\S+)$")
_CONTEXT_LOCAL_BLOCKS = re.compile(r"'num_local_blocks': (?P<n>\d+)")



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
    # semconv.DECISION_BELOW_THRESHOLD, DECISION_PULL or DECISION_REISSUED (the request's load
    # allocated again, no read queued), a semconv.TRANSFER_* status,
    # semconv.OUTCOME_ERROR (the scheduler failed the request for its read), or
    # READ_AFTER_RELEASE (decode: the request's released blocks were read)
    what: str
    remote_engine_id: str | None = None
    # Below threshold: the remote count compared; pull: the tokens allocated to load.
    count_tokens: int | None = None
    threshold_tokens: int | None = None
    local_hit_tokens: int | None = None
    # The read's direction where a line shows it; else the log's role decides.
    direction: str | None = None
    offered_request_id: str | None = None
    offered_tokens: int | None = None


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
    # The start-up line's kv_recompute_threshold and decoder_kv_blocks_ttl.
    engine: dict[str, Any] = field(default_factory=dict)
    invalidated_remote_engines: list[str] = field(default_factory=list)

    @property
    def records(self) -> int:
        return len(self.events)

    def run_settings(self) -> dict[str, Any]:
        """The log's totals and counted lines, recorded with the run."""
        return {"role": self.role, "clock": "the server's local time, whole seconds, year "
                "from the file's mtime", "lines": self.lines, "unknown_lines": self.unknown_lines,
                "counts": self.counts, "kv_transfer_metrics": self.metrics,
                "potentially_invalid_kv_block_reads": self.invalid_block_reads,
                "engine_settings": self.engine,
                "invalidated_remote_engines": self.invalidated_remote_engines}


def looks_like(head: str) -> bool:
    """Whether the start of a file holds a vLLM log line, in any format (kind detection)."""
    for line in head.splitlines()[:200]:
        if _LINE.match(_ANSI.sub("", line)):
            return True
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if (isinstance(value, dict) and value.get("levelname") in _LEVELS
                    and str(value.get("name", "")).startswith("vllm")
                    and isinstance(value.get("message"), str)):
                return True
    return False


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


@dataclass(frozen=True, slots=True)
class _Allocated:
    """An ``update_state_after_alloc`` line of a read, not yet tied to its request."""

    line: int
    time_ns: int
    tokens: int
    local_hit_tokens: int | None
    direction: str
    remote_engine_id: str | None
    remote_request_id: str | None
    offered_tokens: int | None  # remote_num_tokens: decode's offer


def _params(text: str) -> dict[str, Any]:
    """The kv_transfer_params dict as vLLM logs it (its repr); empty when it is not one."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _read_direction(params: dict[str, Any]) -> str | None:
    """The direction of the read an allocation's params ask for (pull_scheduler.py:129-175):
    decode's blocks read by prefill for ``do_remote_decode`` with remote blocks (D→P), prefill's
    read by decode for ``do_remote_prefill`` (P→D); None when the params ask for no read, or
    the request's one read was already set up (``_remote_blocks_processed``: a preempted
    request allocated again reads nothing, pull_scheduler.py:130-134, 188-189)."""
    if not params.get("remote_block_ids") or params.get("_remote_blocks_processed"):
        return None
    if params.get("do_remote_decode"):
        return semconv.DIRECTION_D_TO_P
    if params.get("do_remote_prefill"):
        return semconv.DIRECTION_P_TO_D
    return None


def _reissued(params: dict[str, Any]) -> bool:
    """An allocation to load decode's blocks for a request whose one read was set up already
    (``_remote_blocks_processed``, set by its first allocation: pull_scheduler.py:188-189): it
    was scheduled again (a recompute after its failed read, or a preemption), the connector
    offered the same blocks (pull_scheduler.py:67-103 does not look at the mark) and queued no
    read, so the request waits for one that never comes."""
    return bool(params.get("_remote_blocks_processed") and params.get("remote_block_ids")
                and params.get("do_remote_decode"))


def _reissue(events: list[Event], params: dict[str, Any], line: int, time_ns: int,
             local_hit_tokens: int | None) -> Event | None:
    """The re-issued load's decision, for the request whose read of the same offer the log
    placed last (the allocation line names no request; the offer's id does); None when no read
    of that offer was placed."""
    offer = params.get("remote_request_id")
    pull = next((e for e in reversed(events) if e.what == semconv.DECISION_PULL
                 and offer is not None and e.offered_request_id == str(offer)), None)
    if pull is None:
        return None
    # After the read's own decision, also within the second the plain format resolves.
    return Event(line, max(time_ns, pull.time_ns + 1), pull.request_id,
                 semconv.DECISION_REISSUED,
                 remote_engine_id=pull.remote_engine_id, count_tokens=0,
                 local_hit_tokens=local_hit_tokens, direction=pull.direction,
                 offered_request_id=pull.offered_request_id, offered_tokens=pull.offered_tokens)


@dataclass(frozen=True, slots=True)
class _Line:
    """One line of vLLM's logger in any of its formats: its time and message."""

    time_ns: int
    message: str


def _lines(path: Path, text: str, mtime_ns: int,
           read: spans.LineCounts) -> Iterator[tuple[int, _Line]]:
    """(line number, line) of each line vLLM's logger wrote, plain, coloured or JSON; the
    others counted unknown."""
    to_ns = _clock(path, mtime_ns)
    json_seconds: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        read.lines += 1
        if raw.startswith("{"):
            found = _json_line(path, number, raw, json_seconds)
            if found is not None:
                yield number, found
                continue
        match = _LINE.match(_ANSI.sub("", raw) if "\x1b" in raw else raw)
        if match is None:
            read.unknown += 1
            continue
        yield number, _Line(to_ns(number, match["time"]), match["message"])


def _json_line(path: Path, number: int, raw: str, seconds: dict[str, int]) -> _Line | None:
    """A line of vLLM's JSON format (vllm/logger.py:241-248); None when it is not one."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    message, stamp = value.get("message"), value.get("asctime")
    if (not isinstance(message, str) or not isinstance(stamp, str)
            or value.get("levelname") not in _LEVELS or "name" not in value):
        return None
    found = _JSON_TIME.match(stamp)
    if found is None:
        raise IngestError(f"{path}:{number}: time {stamp!r} is not a date and time "
                          "(vLLM's JSON format: YYYY-MM-DD HH:MM:SS,mmm)")
    second = seconds.get(found["second"])
    if second is None:
        try:
            moment = datetime.strptime(found["second"], "%Y-%m-%d %H:%M:%S")  # local time
        except ValueError:
            raise IngestError(f"{path}:{number}: time {stamp!r} is not a date and "
                              "time") from None
        second = seconds[found["second"]] = int(moment.timestamp()) * _NS_PER_S
    return _Line(second + int(found["ms"]) * 1_000_000, message)


def read_role(path: Path, role: str | None) -> ServerLog:
    """Parse one vLLM server log of ``role``; IngestError names the file and line of a problem."""
    source = spans.read_source(path)
    events: list[Event] = []
    counts: dict[str, int] = {}
    metrics: dict[str, float] = {}
    engine: dict[str, Any] = {}
    invalid: list[str] = []
    invalidated: list[str] = []
    read = spans.LineCounts()
    vllm_lines = 0
    # Reads the scheduler allocated, in order, until a line names their request (the
    # allocation line names none); prefill's own hit per params, from the line before.
    allocated: list[_Allocated] = []
    own_hit: dict[str, int] = {}
    sighted: set[str] = set()
    finished: dict[str, tuple[int, int]] = {}

    def count(name: str) -> None:
        counts[name] = counts.get(name, 0) + 1

    def sighting(rid: str) -> None:
        """The first line naming a read's request ties it to the oldest allocated read. The
        tokens are the request's only when no other read waited with other counts (reads
        finish out of order); otherwise the read is placed with its tokens not measured."""
        if rid in sighted:
            return
        sighted.add(rid)
        if not allocated:
            return
        first = allocated.pop(0)
        alike = all((a.tokens, a.local_hit_tokens) == (first.tokens, first.local_hit_tokens)
                    for a in allocated)
        if not alike:
            count("reads_of_ambiguous_tokens")
        events.append(Event(first.line, first.time_ns, rid, semconv.DECISION_PULL,
                            remote_engine_id=first.remote_engine_id,
                            count_tokens=first.tokens if alike else None,
                            local_hit_tokens=first.local_hit_tokens if alike else None,
                            direction=first.direction,
                            offered_request_id=first.remote_request_id,
                            offered_tokens=first.offered_tokens))

    for number, line in _lines(path, source.text, source.mtime_ns, read):
        vllm_lines += 1
        message, now = line.message, line.time_ns
        if found := _METRICS.match(message):
            pairs = {m["key"].strip(): spans.measure_value(path, number, m["value"])
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
                                count_tokens=spans.count_value(path, number, found["count"]),
                                threshold_tokens=spans.count_value(path, number,
                                                                   found["threshold"])))
        elif found := _DECLINED.match(message):
            sighting(found["rid"])
            events.append(Event(number, now, found["rid"], semconv.TRANSFER_DECLINED_EXPIRED,
                                remote_engine_id=found["engine"],
                                direction=semconv.DIRECTION_D_TO_P))
        elif found := _FAILURE.match(message):
            status = _failure_status(found["type"])
            rid = _CONTEXT_ID.search(found["context"])
            count(f"nixl_failure_{found['type']}")
            local = _CONTEXT_LOCAL_BLOCKS.search(found["context"])
            if status is not None and local is not None and local["n"] == "0":
                # A notify-only request (prefill's own cache covered the offer): vLLM drops
                # its failure (base_worker.py:3218-3224, it is not in _recving_metadata).
                count("notify_only_failures")
            elif status is not None and rid is not None and rid["rid"] != "None":
                sighting(rid["rid"])
                remote = _CONTEXT_REMOTE.search(found["context"])
                events.append(Event(number, now, rid["rid"], status,
                                    remote_engine_id=remote["engine"] if remote else None))
        elif found := _POST_PROCESS_SKIPPED.match(message):
            sighting(found["rid"])
            events.append(Event(number, now, found["rid"], semconv.TRANSFER_FAILED))
        elif found := _FAILING.match(message):
            count("failing_requests_lines")
            for rid_text in _request_ids(found["ids"]):
                sighting(rid_text)
                events.append(Event(number, now, rid_text, semconv.OUTCOME_ERROR))
        elif found := _MATCHED.match(message):
            own_hit[found["params"]] = int(found["computed"])
        elif found := _ALLOCATED.match(message):
            params = _params(found["params"])
            direction = _read_direction(params)
            if direction is not None and int(found["tokens"]) > 0:
                remote_id = params.get("remote_request_id")
                remote_engine = params.get("remote_engine_id")
                offered = params.get("remote_num_tokens")
                allocated.append(_Allocated(
                    number, now, int(found["tokens"]), own_hit.get(found["params"]), direction,
                    str(remote_engine) if remote_engine is not None else None,
                    str(remote_id) if remote_id is not None else None,
                    offered if isinstance(offered, int) else None))
            elif int(found["tokens"]) > 0 and _reissued(params):
                reissue = _reissue(events, params, number, now, own_hit.get(found["params"]))
                count("reissued_loads" if reissue is not None else "reissued_loads_unplaced")
                if reissue is not None:
                    events.append(reissue)
            else:
                count("allocations_without_read")
        elif found := _START_LOAD.match(message):
            if found["local"] != "0":  # no local blocks: a notification only
                sighting(found["rid"])
        elif found := _FINISHED_RECVING.match(message):
            sighting(found["rid"])
            finished.setdefault(found["rid"], (number, now))
        elif found := _METADATA_INVALIDATED.match(message):
            count("remote_metadata_invalidated")
            invalidated.append(found["engine"])
        elif found := _STARTUP.match(message):
            engine["kv_recompute_threshold"] = int(found["threshold"])
            engine["decoder_kv_blocks_ttl"] = int(found["ttl"])
        elif _STATS.match(message):
            count("stats_lines")
            if fetch := _KV_FETCH.search(message):
                count("stats_lines_with_kv_fetch")
                in_progress = int(fetch["progress"])
                metrics["Max KV fetch in progress"] = max(
                    metrics.get("Max KV fetch in progress", 0), in_progress)
                metrics["Max KV fetch waiting to start"] = max(
                    metrics.get("Max KV fetch waiting to start", 0), int(fetch["waiting"]))
            if preempted := _PREEMPTIONS.search(message):
                metrics["Preemptions"] = metrics.get("Preemptions", 0) + int(preempted["n"])
        elif _RECOVERED.match(message):
            count("recovered_from_load_failure")
        elif found := _RELEASED_EXPIRED.match(message):
            count("released_expired_unread" if found["count"] == "0" else "released_expired")
        elif found := _INVALID_BLOCKS.match(message):
            count("potentially_invalid_kv_blocks")
            invalid.append(found["rid"])
            events.append(Event(number, now, found["rid"], READ_AFTER_RELEASE))
        elif _INVALID_PARAMS.match(message):
            count("invalid_kv_transfer_params")
        elif _WAITING.match(message):
            count("blocks_held_after_finish")
        else:
            read.unknown += 1
    if vllm_lines == 0:
        raise IngestError(f"{path}:1: no line in vLLM's log format ((process pid=N) LEVEL "
                          f"MM-DD HH:MM:SS [file:line] message, or its JSON format) in "
                          f"{read.lines} lines")
    if allocated:
        counts["allocated_reads_never_named"] = len(allocated)
    # A finished read succeeded unless a line said it failed (vLLM lists a failed read among
    # the finished ones too, scheduler.py:3569-3570 with base_worker.py:3218-3225).
    failed = {e.request_id for e in events if e.what in _FAILED_READ}
    pulls = {e.request_id: e for e in events if e.what == semconv.DECISION_PULL}
    for request_id, (number, now) in finished.items():
        if request_id not in failed:
            pull = pulls.get(request_id)
            events.append(Event(number, now, request_id, semconv.TRANSFER_OK,
                                remote_engine_id=pull.remote_engine_id if pull else None,
                                direction=pull.direction if pull else None))
    events.sort(key=lambda e: e.line)
    return ServerLog(path, source.sha256, role, events, read.lines, read.unknown,
                     counts, metrics, invalid, engine, invalidated)


_FAILED_READ = frozenset((semconv.TRANSFER_FAILED, semconv.TRANSFER_HANDSHAKE_FAILED,
                          semconv.TRANSFER_DECLINED_EXPIRED, semconv.OUTCOME_ERROR))


def read(path: Path) -> ServerLog:
    """A server log whose role was not named."""
    return read_role(path, None)


# A file whose server's role was named (``vllm-prefill-...:FILE``, ``--kind``).
read_prefill = functools.partial(read_role, role=semconv.ROLE_PREFILL)
read_decode = functools.partial(read_role, role=semconv.ROLE_DECODE)


# --- spans -------------------------------------------------------------------------------------

_DIRECTION = {semconv.ROLE_PREFILL: semconv.DIRECTION_D_TO_P,
              semconv.ROLE_DECODE: semconv.DIRECTION_P_TO_D}
_SERVICE = {semconv.ROLE_PREFILL: semconv.SERVICE_PREFILL,
            semconv.ROLE_DECODE: semconv.SERVICE_DECODE}


# What a span read from a log carries that the engine's own span does not, per span kind: the
# line it came from, that it has no duration, and what the log says in its own terms (the remote
# count a skip line compared; a read of released blocks). Everything else is the engine's shape:
# ingest builds the engine's records (:mod:`kvscope.collector.engine_telemetry`) and shapes them
# with the same functions; the real-vLLM tier checks both sets against a live run.
LOG_ONLY: dict[str, frozenset[str]] = {
    semconv.SPAN_REUSE_DECISION: frozenset({
        semconv.INGEST_LINE, semconv.DURATION_MEASURED, semconv.REMOTE_COUNT_TOKENS}),
    semconv.SPAN_KV_TRANSFER: frozenset({semconv.INGEST_LINE, semconv.DURATION_MEASURED}),
    semconv.SPAN_KV_RETENTION: frozenset({
        semconv.INGEST_LINE, semconv.DURATION_MEASURED, semconv.RETENTION_READ_AFTER_RELEASE}),
}
# What no line of a vLLM 0.33 server's log gives, per span kind (the engine's span has it): the
# ledger reads these as not measured.
NOT_IN_THE_LOG: dict[str, frozenset[str]] = {
    semconv.SPAN_REUSE_DECISION: frozenset({
        semconv.ENGINE_ID, semconv.BIDIR_ENABLED, semconv.PROMPT_TOKENS, semconv.KV_BLOCK_SIZE}),
    semconv.SPAN_KV_TRANSFER: frozenset({
        semconv.ENGINE_ID, semconv.TRANSFER_BYTES, semconv.TRANSFER_BLOCKS}),
    semconv.SPAN_KV_RETENTION: frozenset({
        semconv.ENGINE_ID, semconv.RETENTION_BLOCKS, semconv.RETENTION_BYTES,
        semconv.RETENTION_TTL_S, semconv.REMOTE_NUM_TOKENS}),
}


def records(log: ServerLog) -> list[tuple[EngineRecord, int, dict[str, Any]]]:
    """The engine records the log's lines show, each with its line and what only the log says
    (:data:`LOG_ONLY`'s own values); unknown fields are None (not measured)."""
    found: list[tuple[EngineRecord, int, dict[str, Any]]] = []
    pulled: set[str] = set()
    for event in log.events:
        rid, t = event.request_id, event.time_ns
        if event.what == READ_AFTER_RELEASE:
            # Decode's blocks for this request, released by its reaper, were read: the turn
            # offered them loaded freed blocks (its ledger row says reused_invalid, after
            # release). Held how long and how many bytes: not in the line.
            found.append((KvRetentionRecord(rid, t, t, None, None, None, semconv.RELEASE_EXPIRED),
                          event.line, {semconv.RETENTION_READ_AFTER_RELEASE: True}))
            continue
        if event.what == semconv.DECISION_BELOW_THRESHOLD:
            found.append((ReuseDecisionRecord(rid, t, None, None, 0, event.threshold_tokens,
                                              semconv.DECISION_BELOW_THRESHOLD, None),
                          event.line, {semconv.REMOTE_COUNT_TOKENS: event.count_tokens}))
            continue
        # A turn-2 read is always decode's blocks read by prefill (pull_worker.py:160).
        direction = event.direction or _DIRECTION.get(log.role or "")
        if direction is None:
            continue  # the direction of this read depends on the role, not named
        if event.what in (semconv.DECISION_PULL, semconv.DECISION_REISSUED):
            if direction == semconv.DIRECTION_D_TO_P:
                pulled.add(rid)
                found.append((ReuseDecisionRecord(
                    rid, t, event.local_hit_tokens, event.offered_tokens, event.count_tokens,
                    None, event.what, None, remote_engine_id=event.remote_engine_id),
                    event.line, {}))
            continue
        if direction == semconv.DIRECTION_D_TO_P and rid not in pulled:
            # Prefill read (or tried to read) decode's blocks: it had decided to pull.
            pulled.add(rid)
            found.append((ReuseDecisionRecord(rid, t, None, None, None, None,
                                              semconv.DECISION_PULL, None), event.line, {}))
        errored = event.what == semconv.OUTCOME_ERROR
        found.append((KvTransferRecord(
            rid, t, t, direction, semconv.TRANSFER_FAILED if errored else event.what, None, None,
            remote_engine_id=event.remote_engine_id,
            request_outcome=semconv.OUTCOME_ERROR if errored else None), event.line, {}))
    return found


_SHAPES: dict[type[Any], tuple[str, str, Callable[[Any], dict[str, Any]]]] = {
    ReuseDecisionRecord: (semconv.SPAN_REUSE_DECISION, "decision", decision_attributes),
    KvTransferRecord: (semconv.SPAN_KV_TRANSFER, "transfer", transfer_attributes),
    KvRetentionRecord: (semconv.SPAN_KV_RETENTION, "retention", retention_attributes),
}


def add_spans(log: ServerLog, run_id: str, rows: TraceRows) -> int:
    """Append the spans of the engine records the log's lines show (:func:`records`), shaped
    as the engine shapes them; return how many."""
    service = _SERVICE.get(log.role or "", semconv.SERVICE_VLLM_SERVER)
    kind = {semconv.ROLE_PREFILL: KIND_PREFILL, semconv.ROLE_DECODE: KIND_DECODE}.get(
        log.role or "", KIND)
    resource_attrs = spans.resource(service, run_id, kind, log.path.name)
    found = records(log)
    for record, line, own in found:
        name, suffix, shape = _SHAPES[type(record)]
        start = record[1]  # time_ns / start_ns: a log line has one instant
        rid = record.request_id
        spans.add_span(rows, resource_attrs=resource_attrs, service=service, name=name,
                       trace_id=spans.ingest_id(log.sha256, line, rid, "trace", size=16),
                       span_id=spans.ingest_id(log.sha256, line, rid, suffix, size=8),
                       parent="", kind=spans.KIND_INTERNAL, start_ns=start, end_ns=start,
                       values={semconv.VLLM_REQUEST_ID: rid, semconv.ENGINE_ROLE: log.role,
                               **shape(record), semconv.INGEST_LINE: line,
                               semconv.DURATION_MEASURED: False, **own})
    return len(found)


__all__ = ["Event", "KIND", "KIND_DECODE", "KIND_PREFILL", "LOG_ONLY", "NOT_IN_THE_LOG",
    "READ_AFTER_RELEASE", "ServerLog", "add_spans", "looks_like", "read", "read_decode",
    "read_prefill", "read_role", "records"]
