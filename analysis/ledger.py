"""The per-turn reuse ledger: one typed row per (run, conversation, turn), rebuilt from raw spans.

Three steps, kept apart (STYLE §8): :data:`TURN_QUERY` runs *in the engine* holding the spans
(DuckDB, or ClickHouse with the OpenTelemetry Collector's tables: one definition, rendered per
dialect by :mod:`kvscope.store.query`) and returns one row per turn, sorted, with its legs,
its engine evidence, the previous turn and its history already joined and decided;
:func:`shape` decides token accounting, validity and outcome from those rows (row-wise polars,
a batch at a time as they stream back); :func:`persist` writes the
typed derived table ``kvscope_ledger`` (collectors never write it). :func:`build` runs the same
per-turn SQL over extraction frames held in memory (the live ledger's, tests' hand-built ones).

Joins (DESIGN §3): legs and tool waits hang off their ``kvscope.turn`` span (same trace, parent
span id); engine spans join on the vLLM request id reduced to the proxy's X-Request-Id (vLLM
prefixes ``chatcmpl-``/``cmpl-`` and appends ``-`` + 8 random characters unless
``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1``); turn k's previous turn is turn k-1 of the same
conversation in the same run, unless prefill was offered the KV another earlier turn's decode
left (overlapping turns under one id): then that turn, whose KV the read loads.

Definitions (DESIGN §5, with the refinements written in docs/architecture.md):

* ``reusable_tokens`` — tokens of turn k's prompt whose KV earlier turns computed. When the
  message-boundary hashes show turn k extends turn k-1 (continuation), it is
  ``min(prompt_{k-1} + output_{k-1} - 1, prompt_k)``: decode never computes its last output
  token, so that token's KV exists nowhere. Without hashes, D's offer (``remote_num_tokens``)
  stands in. When the hashes show edited history the count is not measurable without a
  tokenizer: null, and the outcome is ``prefix_diverged``.
* ``local_hit_tokens`` / ``remote_reused_tokens`` / ``recomputed_reusable_tokens`` from P's
  reuse decision and the D→P transfer (a read that moved bytes and finished ``ok``).
* ``outcome`` — one label from :data:`kvscope.reuse.outcomes.OUTCOMES`, decided by the one
  decision table :data:`kvscope.reuse.decisions.TABLE` over the turn's facts, with
  ``evidence`` saying what decided it and which evidence was missing when it is ``unknown``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard, TypeVar

import duckdb
import polars as pl

from kvscope import semconv, settings
from kvscope.errors import QueryOutOfMemory, StoreError
from kvscope.reuse import decisions, taint
from kvscope.reuse.validity import (
    INVALID_AFTER_RELEASE,
    INVALID_BEYOND_PREFIX,
    INVALID_EDITED,
    INVALID_MISALIGNED,
    INVALID_TAINTED,
    INVALID_TOKENS,
)
from kvscope.store import query
from kvscope.store.database import open_store
from kvscope.store.duckdb_reader import DuckDBReader
from kvscope.store.query import resource_attr, span_attr
from kvscope.store.reader import Reader
from kvscope.store.schema import TRACES_TABLE, quote

if TYPE_CHECKING:
    from kvscope.store.clickhouse import ClickHouseReader

    # A reader the ledger can stage its span kinds on (:func:`partitioned_turn_rows`).
    _Staging = DuckDBReader | ClickHouseReader

LEDGER_TABLE = "kvscope_ledger"
_T = TypeVar("_T")
logger = logging.getLogger(__name__)

# The ledger's columns and types: the typed contract the analyses and dashboards read.
LEDGER_SCHEMA: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "conversation_id": pl.String(),
    "turn_index": pl.Int64(),
    "x_request_id": pl.String(),
    "trace_id": pl.String(),
    "arrival": pl.Datetime("ns"),
    "end": pl.Datetime("ns"),
    "turn_ms": pl.Float64(),
    "ttft_ms": pl.Float64(),
    "prefill_ms": pl.Float64(),
    "decode_ms": pl.Float64(),
    "tool_wait_s": pl.Float64(),
    "prompt_tokens": pl.Int64(),
    "output_tokens": pl.Int64(),
    "router_lookup": pl.String(),
    "router_entry_age_s": pl.Float64(),
    "reuse_guard": pl.String(),
    "d_metadata_attached": pl.Boolean(),
    "prefill_request_id": pl.String(),
    "decode_request_id": pl.String(),
    "prefill_engine": pl.String(),
    "decode_engine": pl.String(),
    "decision": pl.String(),
    "decisions": pl.Int64(),
    "offered_tokens": pl.Int64(),
    "to_pull_tokens": pl.Int64(),
    "threshold_tokens": pl.Int64(),
    "prefill_bidirectional": pl.Boolean(),
    "d2p_status": pl.String(),
    "d2p_bytes": pl.Int64(),
    "d2p_ms": pl.Float64(),
    "p2d_bytes": pl.Int64(),
    "p2d_ms": pl.Float64(),
    "retention_id": pl.String(),
    "retention_bytes": pl.Int64(),
    "retention_held_s": pl.Float64(),
    "retention_release": pl.String(),
    "history": pl.String(),
    "reusable_tokens": pl.Int64(),
    "local_hit_tokens": pl.Int64(),
    "remote_reused_tokens": pl.Int64(),
    "recomputed_reusable_tokens": pl.Int64(),
    "errored": pl.Boolean(),
    "invalid_tokens": pl.Int64(),
    # Why the loaded KV does not match the prompt (kvscope.reuse.validity.INVALID_*: edited,
    # beyond_prefix, misaligned, after_release); null when it matches or nothing was loaded.
    "invalid_kind": pl.String(),
    "reuse_validity": pl.String(),
    "outcome": pl.String(),
    "evidence": pl.String(),
    # Who recorded the turn: null for the proxy, semconv.OBSERVER_CLIENT for a client's record.
    "observer": pl.String(),
    # Where prefill's reuse decision came from: ENGINE_EVIDENCE_* (null: not observed).
    "engine_evidence": pl.String(),
    # From vLLM's own llm_request spans (--otlp-traces-endpoint), joined by request id: the
    # first engine's arrival to the last engine's first token, and the time queued in all.
    "engine_ttft_ms": pl.Float64(),
    "engine_queue_ms": pl.Float64(),
    # The proxy's decode leg start to decode's first P->D read: decode issues the read only once
    # its scheduler allocated the request's blocks, so this is the time decode queued for KV
    # blocks (retained handles and running requests held them), plus the hop. Null: no read.
    "decode_queue_ms": pl.Float64(),
}

# engine_evidence: kvscope's engine hooks, or lines of a server's log (kvscope ingest).
ENGINE_EVIDENCE_HOOKS = "hooks"
ENGINE_EVIDENCE_LOG = "server_log"

# Whether the KV a turn loaded from decode belongs to its prompt (kvscope.reuse.validity).
VALIDITY_VALID = "valid"
VALIDITY_INVALID = "invalid"
VALIDITY_NOT_VERIFIED = "not_verified"  # loaded KV, but no boundary hashes to check it against

# History relation of turn k to turn k-1, from message-boundary hashes (the decision table's).
HISTORY_FIRST = decisions.HISTORY_FIRST
HISTORY_CONTINUES = decisions.HISTORY_CONTINUES
HISTORY_EDITED = decisions.HISTORY_EDITED
HISTORY_UNKNOWN = decisions.HISTORY_UNKNOWN


# Columns name what they read (kvscope.store.query): every key and value is a bound parameter,
# and the same definitions render for DuckDB and for ClickHouse.
_Columns = dict[str, query.Column]


_TURN_COLUMNS: _Columns = {
    "run_id": resource_attr(semconv.RUN_ID),
    "trace_id": "TraceId",
    "span_id": "SpanId",
    "x_request_id": span_attr(semconv.X_REQUEST_ID),
    "conversation_id": span_attr(semconv.GEN_AI_CONVERSATION_ID),
    "turn_index": span_attr(semconv.TURN_INDEX),
    "arrival": "Timestamp",
    "duration_ns": "Duration",
    "status_code": "StatusCode",
    "ttft_ms": span_attr(semconv.TTFT_MS),
    "prompt_tokens": span_attr(semconv.GEN_AI_USAGE_INPUT_TOKENS),
    "output_tokens": span_attr(semconv.GEN_AI_USAGE_OUTPUT_TOKENS),
    "router_lookup": span_attr(semconv.ROUTER_LOOKUP),
    "router_entry_age_s": span_attr(semconv.ROUTER_ENTRY_AGE_S),
    "reuse_guard": span_attr(semconv.REUSE_GUARD),
    "boundary_hashes": span_attr(semconv.MESSAGE_BOUNDARY_HASHES),
    "hash_key_id": span_attr(semconv.MESSAGE_BOUNDARY_HASH_KEY_ID),
    "messages": span_attr(semconv.MESSAGE_COUNT),
    "roles": span_attr(semconv.MESSAGE_ROLES),
    "reply_hash": span_attr(semconv.REPLY_BOUNDARY_HASH),
    "error_kind": span_attr(semconv.ERROR_KIND),
    "observer": span_attr(semconv.TURN_OBSERVER),
    "duration_measured": span_attr(semconv.DURATION_MEASURED),
    "route": span_attr(semconv.HTTP_ROUTE),
}
_PREFILL_COLUMNS: _Columns = {
    "trace_id": "TraceId",
    "parent_span_id": "ParentSpanId",
    "leg_time": "Timestamp",
    "leg_span_id": "SpanId",
    "prefill_ns": "Duration",
    "prefill_request_id": span_attr(semconv.VLLM_REQUEST_ID),
    "d_metadata_attached": span_attr(semconv.D_METADATA_ATTACHED),
    "offered_tokens_proxy": span_attr(semconv.REMOTE_OFFERED_TOKENS),
    "retention_id": span_attr(semconv.OFFERED_REQUEST_ID),
}
_DECODE_COLUMNS: _Columns = {
    "trace_id": "TraceId",
    "parent_span_id": "ParentSpanId",
    "leg_time": "Timestamp",
    "leg_span_id": "SpanId",
    "decode_ns": "Duration",
    "decode_request_id": span_attr(semconv.VLLM_REQUEST_ID),
    "metadata_returned": span_attr(semconv.RETENTION_METADATA_RETURNED),
    "decode_measured": span_attr(semconv.DURATION_MEASURED),
}
_WAIT_COLUMNS: _Columns = {
    "trace_id": "TraceId",
    "parent_span_id": "ParentSpanId",
    "leg_time": "Timestamp",
    "leg_span_id": "SpanId",
    "tool_wait_ns": "Duration",
}
# On each engine span kind: its run, and the hooks its engine could not install (resource).
_HOOKS_COLUMNS: _Columns = {
    "run_id": resource_attr(semconv.RUN_ID),
    "hooks_missing": resource_attr(semconv.HOOKS_MISSING),
}
_DECISION_COLUMNS: _Columns = {
    "request_id": span_attr(semconv.VLLM_REQUEST_ID),
    "span_id": "SpanId",
    "engine": span_attr(semconv.ENGINE_ID),
    "time": "Timestamp",
    "decision": span_attr(semconv.DECISION),
    "local_hit": span_attr(semconv.LOCAL_HIT_TOKENS),
    "offered": span_attr(semconv.REMOTE_OFFERED_TOKENS),
    "to_pull": span_attr(semconv.TOKENS_TO_PULL),
    "threshold": span_attr(semconv.THRESHOLD_TOKENS),
    "bidir": span_attr(semconv.BIDIR_ENABLED),
    "remote_count": span_attr(semconv.REMOTE_COUNT_TOKENS),
    "block_size": span_attr(semconv.KV_BLOCK_SIZE),
    "tokens_hash": span_attr(semconv.KV_TOKENS_HASH),
    "tokens_key": span_attr(semconv.KV_TOKENS_HASH_KEY_ID),
    "decision_measured": span_attr(semconv.DURATION_MEASURED),
    **_HOOKS_COLUMNS,
}
_VLLM_REQUEST_COLUMNS: _Columns = {
    "request_id": span_attr(semconv.VLLM_GEN_AI_REQUEST_ID),
    "span_id": "SpanId",
    "start": "Timestamp",
    "ttft_s": span_attr(semconv.VLLM_TIME_TO_FIRST_TOKEN),
    "queue_s": span_attr(semconv.VLLM_TIME_IN_QUEUE),
    "run_id": resource_attr(semconv.RUN_ID),
    "prompt_tokens": span_attr(semconv.VLLM_PROMPT_TOKENS),
    "completion_tokens": span_attr(semconv.VLLM_COMPLETION_TOKENS),
    "max_tokens": span_attr(semconv.VLLM_MAX_TOKENS),
}
_TRANSFER_COLUMNS: _Columns = {
    "request_id": span_attr(semconv.VLLM_REQUEST_ID),
    "span_id": "SpanId",
    "engine": span_attr(semconv.ENGINE_ID),
    "direction": span_attr(semconv.TRANSFER_DIRECTION),
    "status": span_attr(semconv.TRANSFER_STATUS),
    "size_bytes": span_attr(semconv.TRANSFER_BYTES),
    "start": "Timestamp",
    "duration_ns": "Duration",
    "request_outcome": span_attr(semconv.REQUEST_OUTCOME),
    "duration_measured": span_attr(semconv.DURATION_MEASURED),
    **_HOOKS_COLUMNS,
}
_RETENTION_COLUMNS: _Columns = {
    "request_id": span_attr(semconv.VLLM_REQUEST_ID),
    "span_id": "SpanId",
    "engine": span_attr(semconv.ENGINE_ID),
    "start": "Timestamp",
    "duration_ns": "Duration",
    "size_bytes": span_attr(semconv.RETENTION_BYTES),
    "reason": span_attr(semconv.RETENTION_RELEASE_REASON),
    "tokens": span_attr(semconv.REMOTE_NUM_TOKENS),
    "read_after_release": span_attr(semconv.RETENTION_READ_AFTER_RELEASE),
    "tokens_hash": span_attr(semconv.KV_TOKENS_HASH),
    "tokens_key": span_attr(semconv.KV_TOKENS_HASH_KEY_ID),
    **_HOOKS_COLUMNS,
}

# Each span kind the ledger reads: its span name and the columns taken from it.
_KINDS: dict[str, tuple[str, _Columns]] = {
    "turns": (semconv.SPAN_TURN, _TURN_COLUMNS),
    "prefill": (semconv.SPAN_INPUT_PROCESSING, _PREFILL_COLUMNS),
    "decode": (semconv.SPAN_GENERATION, _DECODE_COLUMNS),
    "waits": (semconv.SPAN_TOOL_WAIT, _WAIT_COLUMNS),
    "decisions": (semconv.SPAN_REUSE_DECISION, _DECISION_COLUMNS),
    "transfers": (semconv.SPAN_KV_TRANSFER, _TRANSFER_COLUMNS),
    "retentions": (semconv.SPAN_KV_RETENTION, _RETENTION_COLUMNS),
    "vllm_requests": (semconv.SPAN_VLLM_REQUEST, _VLLM_REQUEST_COLUMNS),
}
# The extraction queries: one per span kind, string-typed attributes. DISTINCT: OTLP delivery
# is at least once (a receiver that commits and dies before answering gets the spans again),
# and every kind's columns include its SpanId, so a resent span is read once.
QUERIES: dict[str, query.Query] = {
    name: query.spans(span, columns, distinct=True) for name, (span, columns) in _KINDS.items()}


def load_spans(reader: Reader) -> dict[str, pl.DataFrame]:
    """Run the extraction queries; one frame of string-typed attributes per span kind.

    What :func:`build` takes (the live ledger keeps these frames; tests shape them by hand).
    The store's ledger does not come this way: :func:`ledger` runs :data:`TURN_QUERY` in the
    engine and takes back one row per turn.
    """
    return {name: reader.frame(sql.named(name)) for name, sql in QUERIES.items()}


# --- per turn, in the engine --------------------------------------------------------------------
#
# The joins and per-request aggregations run as SQL in the engine that holds the spans (DuckDB,
# or ClickHouse: the dialect renders what differs), over the extraction queries as common table
# expressions; one row per turn comes back. Where several spans could serve one turn the first
# by time wins, its span id breaking ties, so both engines choose the same one. Attribute
# values stay strings unless SQL must compare or add them; :func:`_shape` casts the rest.

_ID_PREFIX = r"^(chatcmpl-|cmpl-)"
_ID_SUFFIX = r"-[0-9A-Za-z]{8}$"
# A completions request's engine ids also carry its prompt's index before the random suffix
# (vLLM's completion serving: ``f"{request_id}-{i}"``, so ``cmpl-<X-Request-Id>-0-<8>``); chat
# ids do not. At most 3 digits: a UUID's last group (12 characters) is never taken for one.
_COMPLETIONS_PREFIX = "cmpl-%"
_PROMPT_INDEX = r"-[0-9]{1,3}$"


def _key(b: query.Binder, column: str) -> str:
    """vLLM's internal request id reduced to the X-Request-Id it came from (SQL)."""
    d = b.dialect
    stripped = d.strip(d.strip(column, b(_ID_PREFIX)), b(_ID_SUFFIX))
    return (f"CASE WHEN {column} LIKE {b(_COMPLETIONS_PREFIX)} "
            f"THEN {d.strip(stripped, b(_PROMPT_INDEX))} ELSE {stripped} END")


def _measured(b: query.Binder, flag: str, value: str) -> str:
    """``value`` unless the span says its time was not measured (an ingested log's)."""
    return f"CASE WHEN {flag} = {b('false')} THEN NULL ELSE {value} END"


def _first(partition: str, order: str, columns: str, source: str, *windows: str) -> str:
    """Per ``partition``, the first row by ``order`` (with ``windows``' per-partition values)."""
    extra = "".join(f", {w}" for w in windows)
    return (f"SELECT * FROM (SELECT {columns}{extra}, row_number() OVER "
            f"(PARTITION BY {partition} ORDER BY {order}) AS rn FROM {source}) WHERE rn = 1")


def _decision_rows(b: query.Binder) -> str:
    keyed = f"SELECT {_key(b, 'request_id')} AS x_key, * FROM decisions"
    hooks = f"CASE WHEN decision_measured = {b('false')} THEN 0 ELSE 1 END"
    # Columns renamed (d_*): ClickHouse resolves a name to a select alias before a column, and
    # _first_decision's outputs reuse some of these names.
    taken = ", ".join(f"{column} AS d_{column}" for column in _DECISION_FIELDS)
    return (f"SELECT x_key, {taken}, {hooks} AS hooks, "
            f"row_number() OVER (PARTITION BY x_key ORDER BY \"time\", span_id) AS rn_first, "
            f"row_number() OVER (PARTITION BY x_key ORDER BY \"time\" DESC, span_id DESC) "
            f"AS rn_last FROM ({keyed})")


# Per request: (column of its decisions, name) taken from the first decision, and from the last.
_DECISION_FIELDS = ("decision", "local_hit", "offered", "to_pull", "threshold", "bidir",
                    "engine", "remote_count", "block_size", "tokens_hash", "tokens_key")
_FIRST_DECISION = (("decision", "decision"), ("local_hit", "decision_local_hit"),
                   ("offered", "offered_tokens"), ("to_pull", "to_pull_tokens"),
                   ("threshold", "threshold_tokens"), ("bidir", "prefill_bidirectional"),
                   ("engine", "prefill_engine"), ("remote_count", "decision_remote_count"),
                   ("block_size", "block_size"), ("tokens_hash", "offer_tokens_hash"),
                   ("tokens_key", "offer_tokens_key"))
_LAST_DECISION = (("local_hit", "final_local_hit"), ("decision", "last_decision"))


def _decision_keys(b: query.Binder) -> str:
    return f"SELECT {_key(b, 'request_id')} AS x_key, run_id, \"time\" FROM decisions"


def _first_decision(b: query.Binder) -> str:
    # The first decision says what prefill was offered and chose; the last one what the
    # request ran with after a preemption or a reissue. One pass over the decisions: each
    # request's first and last rows are picked out by their rank.
    d = b.dialect
    picked = ", ".join(
        f"max(CASE WHEN {rank} = 1 THEN d_{column} END) AS {name}"
        for rank, columns in (("rn_first", _FIRST_DECISION), ("rn_last", _LAST_DECISION))
        for column, name in columns)
    return (f"SELECT x_key, {picked}, {d.int64('count(*)')} AS decisions, "
            f"{d.int64('max(hooks)')} AS from_hooks FROM decision_rows GROUP BY x_key")


def _transfer_rows(b: query.Binder) -> str:
    d = b.dialect
    return (f"SELECT {_key(b, 'request_id')} AS x_key, run_id, engine, direction, status, "
            f"{d.to_int('size_bytes')} AS bytes, \"start\", span_id, request_outcome, "
            f"{_measured(b, 'duration_measured', 'duration_ns')} AS measured_ns FROM transfers")


def _d2p(b: query.Binder) -> str:
    # vLLM can report one failed read twice: the worker's span with the exact status
    # (declined_expired, handshake_failed, ...) and the scheduler's with the request's outcome.
    # The most specific status stands: ok first, then anything but the generic "failed".
    d = b.dialect
    specificity = (f"CASE WHEN status = {b(semconv.TRANSFER_OK)} THEN 0 "
                   f"WHEN status = {b(semconv.TRANSFER_FAILED)} THEN 2 ELSE 1 END")
    errored = f"CASE WHEN request_outcome = {b(semconv.OUTCOME_ERROR)} THEN 1 ELSE 0 END"
    reads = f"(SELECT * FROM transfer_rows WHERE direction = {b(semconv.DIRECTION_D_TO_P)})"
    return _first(
        "x_key", f"{specificity}, \"start\", span_id", "x_key, status AS d2p_status", reads,
        "max(bytes) OVER (PARTITION BY x_key) AS d2p_bytes",
        f"{d.int64('max(measured_ns) OVER (PARTITION BY x_key)')} AS d2p_ns",
        "min(\"start\") OVER (PARTITION BY x_key) AS d2p_start",
        f"{d.int64(f'max({errored}) OVER (PARTITION BY x_key)')} AS load_errored")


def _p2d(b: query.Binder) -> str:
    d = b.dialect
    writes = f"(SELECT * FROM transfer_rows WHERE direction = {b(semconv.DIRECTION_P_TO_D)})"
    return _first(
        "x_key", "\"start\", span_id", "x_key, engine AS decode_engine", writes,
        f"{d.int64('sum(bytes) OVER (PARTITION BY x_key)')} AS p2d_bytes",
        f"{d.int64('sum(measured_ns) OVER (PARTITION BY x_key)')} AS p2d_ns",
        "min(\"start\") OVER (PARTITION BY x_key) AS p2d_start")


def _retention_first(b: query.Binder) -> str:
    # One retention per decode request: the handle turn k is offered is turn k-1's. The hooks'
    # snapshot at pin time (open, no end) yields to the span of its release.
    snapshot = (f"CASE WHEN reason = {b(semconv.RELEASE_OPEN)} AND duration_ns = 0 "
                "THEN 1 ELSE 0 END")
    return _first("request_id", f"{snapshot}, \"start\", span_id",
                  "request_id, size_bytes, tokens, reason, \"start\", duration_ns, "
                  "read_after_release, tokens_hash, tokens_key", "retentions")


def _vllm(b: query.Binder) -> str:
    """Per X-Request-Id, what vLLM's own llm_request spans measured (one per engine leg).

    The span starts at the engine's arrival (output_processor.py:951, 997); its first token is
    ``time_to_first_token`` later. On a P/D turn the legs are prefill then decode: engine TTFT
    is the first leg's arrival to the last leg's first token (the proxy's hop between them
    included; on two hosts, their clocks' offset too), queueing the sum of the legs' queues.
    """
    d = b.dialect
    keyed = f"(SELECT {_key(b, 'request_id')} AS x_key, * FROM vllm_requests)"
    return _first(
        "x_key", "\"start\" DESC, span_id DESC",
        "x_key, \"start\" AS engine_last_start, ttft_s AS engine_last_ttft_s", keyed,
        "min(\"start\") OVER (PARTITION BY x_key) AS engine_first_start",
        f"sum({d.to_float('queue_s')}) OVER (PARTITION BY x_key) AS engine_queue_s")


def _engine_hooks(b: query.Binder) -> str:
    """Per run, the engine hooks kvscope could not install (the engines' resource attribute
    ``kvscope.vllm.hooks_missing``, read off every engine span kind: a missing hook leaves its
    own kind without spans)."""
    # Named apart from the output: ClickHouse resolves a name to a select alias first.
    sources = " UNION ALL ".join(f"SELECT run_id AS hooks_run, hooks_missing AS missing "
                                 f"FROM {kind}" for kind in ("decisions", "transfers",
                                                             "retentions"))
    return (f"SELECT hooks_run AS run_id, max(missing) AS hooks_missing FROM ({sources}) AS e "
            "WHERE missing IS NOT NULL GROUP BY hooks_run")


def _engine_turns(b: query.Binder, turns: str = "turns", only: str = "",
                  runs: str = "") -> str:
    """One row per X-Request-Id that engine spans of a run without ``kvscope.turn`` spans
    name (and no turn span does): the requests of a deployment routed by vLLM's own proxy,
    llm-d or any router but kvscope's. In a run the proxy recorded, an engine request no turn
    names (a warm-up sent to an engine directly, a turn whose spans were lost) adds no row.

    Its run is its engine spans'; it starts at the first of them. vLLM's ``llm_request`` spans
    give the prompt and the output (the decode leg's: the one asked for more than prefill's one
    token). Conversation, turn index and router fields stay null: only a proxy span knows them.
    Once a turn span names the request (``kvscope ingest`` of the proxy's log later, say), its
    row replaces this one.

    ``turns``: the relation of every turn span (the store's, when a partition's are not all);
    ``only``: one more condition on ``x_key`` (a partition's own requests); ``runs``: the
    runs with turn spans, when ``turns`` does not hold them all (a partition's: a request's
    spans in a run whose turns are in other partitions must not give it that run).
    """
    d = b.dialect
    turn_runs = f"SELECT run_id FROM {turns} WHERE run_id IS NOT NULL"
    keys = " UNION ALL ".join((
        "SELECT x_key, run_id AS key_run, \"time\" AS seen FROM decision_keys",
        "SELECT x_key, run_id AS key_run, \"start\" AS seen FROM transfer_rows",
        f"SELECT {_key(b, 'request_id')} AS x_key, run_id AS key_run, \"start\" AS seen "
        "FROM retentions",
        f"SELECT {_key(b, 'request_id')} AS x_key, run_id AS key_run, \"start\" AS seen "
        "FROM vllm_requests"))
    # Attribute strings, as a turn span's: both legs see one prompt; the output is the leg's
    # asked for more than one token (prefill's is max_tokens 1).
    decode_leg = f"({d.to_int('max_tokens')} > 1 OR max_tokens IS NULL)"
    usage = (f"SELECT {_key(b, 'request_id')} AS x_key, max(prompt_tokens) AS prompt_n, "
             f"max(CASE WHEN {decode_leg} THEN completion_tokens END) AS output_n "
             "FROM vllm_requests GROUP BY 1")
    nulls = {"trace_id", "span_id", "conversation_id", "turn_index", "duration_ns",
             "status_code", "ttft_ms", "router_lookup", "router_entry_age_s", "reuse_guard",
             "boundary_hashes", "hash_key_id", "messages", "roles", "error_kind",
             "duration_measured", "route", "reply_hash"}
    chosen = {"run_id": "k.run_id", "x_request_id": "k.x_key", "arrival": "k.arrival",
              "prompt_tokens": "u.prompt_n", "output_tokens": "u.output_n",
              "observer": b(semconv.OBSERVER_ENGINE)}
    columns = ", ".join(
        f"{'NULL' if name in nulls else chosen[name]} AS {quote(name)}" for name in _TURN_COLUMNS)
    return (f"SELECT {columns} FROM (SELECT x_key, max(key_run) AS run_id, "
            f"min(seen) AS arrival FROM ({keys}) AS e WHERE x_key IS NOT NULL AND x_key NOT IN "
            f"(SELECT x_request_id FROM {turns} WHERE x_request_id IS NOT NULL) "
            f"AND key_run NOT IN ({runs or turn_runs}){only} "
            "GROUP BY x_key) "
            f"AS k LEFT JOIN ({usage}) AS u ON u.x_key = k.x_key")


# The per-turn row: (table alias, column, name). ``t`` the turn; its first prefill, decode and
# tool-wait legs; ``f`` its decisions, ``v`` vLLM's request spans, ``r`` the D->P read, ``s``
# the P->D writes; ``o`` the retention it was offered, ``h`` the one its decode left.
_JOINED_FIELDS: tuple[tuple[str, str, str], ...] = (
    *(("t", name, name) for name in (
        "run_id", "trace_id", "span_id", "x_request_id", "conversation_id", "arrival",
        "duration_ns", "status_code", "ttft_ms", "router_lookup", "router_entry_age_s",
        "reuse_guard", "boundary_hashes", "hash_key_id", "roles", "observer",
        "duration_measured", "route", "reply_hash",
        "error_kind")),
    *(("p", name, name) for name in (
        "prefill_ns", "prefill_request_id", "d_metadata_attached", "offered_tokens_proxy",
        "retention_id")),
    *(("g", name, name) for name in (
        "decode_ns", "decode_request_id", "metadata_returned", "decode_measured",
        "decode_start")),
    ("w", "tool_wait_ns", "tool_wait_ns"),
    *(("f", name, name) for name in (
        "decision", "decision_local_hit", "offered_tokens", "to_pull_tokens",
        "threshold_tokens", "prefill_bidirectional", "prefill_engine", "decisions",
        "final_local_hit", "last_decision", "decision_remote_count", "from_hooks",
        "block_size", "offer_tokens_hash", "offer_tokens_key")),
    *(("v", name, name) for name in (
        "engine_first_start", "engine_last_start", "engine_last_ttft_s", "engine_queue_s")),
    *(("r", name, name) for name in (
        "d2p_status", "d2p_bytes", "d2p_ns", "d2p_start", "load_errored")),
    *(("s", name, name) for name in ("p2d_bytes", "p2d_ns", "decode_engine", "p2d_start")),
    ("o", "size_bytes", "retention_bytes"), ("o", "duration_ns", "retention_ns"),
    ("o", "reason", "retention_release"), ("o", "start", "retention_start"),
    ("o", "read_after_release", "retention_read_after_release"),
    ("o", "tokens_hash", "retention_tokens_hash"), ("o", "tokens_key", "retention_tokens_key"),
    ("h", "tokens", "held_tokens"),
    ("e", "hooks_missing", "hooks_missing"),
)
# The turn's counts, as numbers already in the engine (history compares them).
_TURN_NUMBERS = {"turn_number": "turn_index", "prompt_tokens": "prompt_tokens",
                 "output_tokens": "output_tokens", "messages": "messages"}
_JOINED_OUT = (*(name for _, _, name in _JOINED_FIELDS), *_TURN_NUMBERS)
# Previous turn's values: the row before in its conversation (same run), by turn index.
_PREVIOUS = {
    "prev_prompt": "prompt_tokens", "prev_output": "output_tokens",
    "prev_hashes": "boundary_hashes", "prev_hash_key_id": "hash_key_id",
    "prev_messages": "messages", "prev_returned": "metadata_returned",
    "prev_index": "turn_number", "prev_held": "held_tokens", "prev_reply": "reply_hash",
}


def _joined(b: query.Binder) -> str:
    d = b.dialect
    fields = ", ".join(f"{alias}.{quote(column)} AS {name}"
                       for alias, column, name in _JOINED_FIELDS)
    numbers = ", ".join(f"{d.to_int(f't.{column}')} AS {name}"
                        for name, column in _TURN_NUMBERS.items())
    # A union pairs columns by position: name them, in one order, on both sides (a frame built
    # by hand need not list its columns in the extraction's order).
    turn_columns = ", ".join(quote(name) for name in _TURN_COLUMNS)
    return (
        f"SELECT {fields}, {numbers} "
        f"FROM (SELECT {turn_columns} FROM turns "
        f"UNION ALL SELECT {turn_columns} FROM engine_turns) AS t "
        "LEFT JOIN prefill_leg AS p ON p.trace_id = t.trace_id AND p.parent_span_id = t.span_id "
        "LEFT JOIN decode_leg AS g ON g.trace_id = t.trace_id AND g.parent_span_id = t.span_id "
        "LEFT JOIN wait_leg AS w ON w.trace_id = t.trace_id AND w.parent_span_id = t.span_id "
        "LEFT JOIN first_decision AS f ON f.x_key = t.x_request_id "
        "LEFT JOIN vllm_request AS v ON v.x_key = t.x_request_id "
        "LEFT JOIN d2p AS r ON r.x_key = t.x_request_id "
        "LEFT JOIN p2d AS s ON s.x_key = t.x_request_id "
        "LEFT JOIN retention_first AS o ON o.request_id = p.retention_id "
        "LEFT JOIN retention_first AS h ON h.request_id = g.decode_request_id "
        "LEFT JOIN engine_hooks AS e ON e.run_id = t.run_id")


def _continues(b: query.Binder) -> str:
    """Whether turn k's prompt is turn k-1's messages, then the assistant's reply, then more.

    Boundary hashes are chained (hash i names messages 0..i), so k keeps k-1's messages exactly
    when k-1's last hash is among k's; the message right after them must be the assistant's
    reply (role ``a``) — a reset keeps the first messages too, then adds a summary instead. The
    proxy keeps only the last few hashes and roles per turn; if k added more messages than
    that, the relation is not decidable (see :func:`_history`). When roles were not recorded
    the message after k-1's is not checked. When k-1's span names the hash of its messages then
    the reply decode produced (``reply_hash``), k must carry that hash: a client that sent back
    another reply (compacted, reasoning stripped, rewritten) edited the history decode holds.
    """
    d = b.dialect
    comma = b(",")
    last = d.last_item("prev_hashes", comma)
    kept = f"({comma} || boundary_hashes || {comma})"
    found = d.find(kept, f"({comma} || {last} || {comma})")  # 1-based; 0: not among k's
    # k-1's last message's index among k's kept ones: the commas before where it was found.
    index = _count(b, f"substring({kept}, 1, {found} - 1)", comma)
    reply_role = f"substring(roles, {index} + 2, 1)"
    same_reply = f"{d.find(kept, f'({comma} || prev_reply || {comma})')} > 0"
    return (f"({found} > 0 AND messages > prev_messages "
            f"AND (roles IS NULL OR {reply_role} = {b('a')}) "
            f"AND (prev_reply IS NULL OR {same_reply}))")


def _count(b: query.Binder, text: str, comma: str) -> str:
    """How many times ``comma`` occurs in ``text`` (SQL)."""
    return f"(length({text}) - length(replace({text}, {comma}, {b('')})))"


def _history(b: query.Binder) -> str:
    """Turn k's history relative to its previous turn (turn k-1, or the earlier turn whose KV
    prefill was offered), from message-boundary hashes (HISTORY_*)."""
    same_key = ("(coalesce(hash_key_id = prev_hash_key_id, FALSE) "
                "OR (hash_key_id IS NULL AND prev_hash_key_id IS NULL))")
    has_prev = ("(prev_index IS NOT NULL AND (prev_index = turn_number - 1 OR prev_is_source) "
                "AND conversation_id IS NOT NULL)")
    empty = b("")
    return (
        f"CASE WHEN turn_number <= 1 THEN {b(HISTORY_FIRST)} "
        f"WHEN NOT {has_prev} THEN {b(HISTORY_UNKNOWN)} "
        f"WHEN boundary_hashes IS NULL OR prev_hashes IS NULL OR boundary_hashes = {empty} "
        f"OR prev_hashes = {empty} THEN {b(HISTORY_UNKNOWN)} "
        # Hashes made with different keys (a proxy restarted with a new key, two proxies with
        # keys of their own) never match: not comparable, so never an edit.
        f"WHEN NOT {same_key} THEN {b(HISTORY_UNKNOWN)} "
        # A completions prompt is one message whose text grows turn by turn: one hash each
        # cannot show a continuation (nor an edit). A chat's messages each have their hash, a
        # single one too: a single message replaced by another is an edit.
        f"WHEN messages <= 1 AND prev_messages <= 1 "
        f"AND coalesce(route, {empty}) NOT LIKE {b('%/chat/completions')} "
        f"THEN {b(HISTORY_UNKNOWN)} "
        f"WHEN {_continues(b)} THEN {b(HISTORY_CONTINUES)} "
        # k added more messages than the proxy keeps hashes for: not decidable.
        f"WHEN messages - prev_messages >= {_count(b, 'boundary_hashes', b(','))} + 1 "
        f"THEN {b(HISTORY_UNKNOWN)} "
        f"ELSE {b(HISTORY_EDITED)} END")


# What leaves the engine: the turn's own fields, its joined evidence and the previous turn's
# counts; the hashes stay behind (their verdict is ``history``).
_OUT_DROPPED = {"boundary_hashes", "prev_hashes", "hash_key_id", "prev_hash_key_id", "roles",
                "route", "reply_hash", "prev_reply", "offer_tokens_hash", "offer_tokens_key",
                "retention_tokens_hash", "retention_tokens_key"}


def _per_turn(b: query.Binder) -> str:
    d = b.dialect
    # Polars' order (nulls first) so the previous row is the same one on every path.
    partition = "run_id, conversation_id"
    order = "turn_number NULLS FIRST, arrival NULLS FIRST"
    linked = "run_id IS NOT NULL AND conversation_id IS NOT NULL"
    lagged = ", ".join(
        f"CASE WHEN {linked} THEN {d.lag(column, partition, order)} END AS lag_{name}"
        for name, column in _PREVIOUS.items())
    # The turn that left the KV prefill was offered (its decode request is the retention id):
    # under one conversation id, overlapping turns (two clients, a retry) can leave the router
    # another turn's entry than turn k-1's, and the read loads that turn's KV.
    ranked = ", ".join(f"{column} AS src_{name}" for name, column in _PREVIOUS.items())
    source = (f"SELECT * FROM (SELECT run_id AS src_run, conversation_id AS src_conversation, "
              f"decode_request_id AS src_request, {ranked}, row_number() OVER (PARTITION BY "
              f"run_id, conversation_id, decode_request_id ORDER BY {order}) AS src_rank "
              f"FROM joined WHERE {linked} AND decode_request_id IS NOT NULL) AS ranked "
              "WHERE src_rank = 1")
    from_source = "(src_prev_index IS NOT NULL AND src_prev_index < turn_number)"
    previous = ", ".join(
        f"CASE WHEN {from_source} THEN src_{name} ELSE lag_{name} END AS {name}"
        for name in _PREVIOUS)
    out = ", ".join(name for name in (*_JOINED_OUT, *_PREVIOUS) if name not in _OUT_DROPPED)
    # The whole prompt's identity (its last chained hash, with the key's id): a prompt another
    # request sends again hits the same blocks in prefill's prefix cache (kvscope.reuse.taint).
    empty = b("")
    prompt_hash = (f"CASE WHEN boundary_hashes IS NULL OR boundary_hashes = {empty} THEN NULL "
                   f"ELSE coalesce(hash_key_id, {empty}) || {b('|')} || "
                   f"{d.last_item('boundary_hashes', b(','))} END")
    # The engine's token hashes: the prompt's tokens a read of the offer covers against the
    # tokens decode holds KV for (1 equal, 0 not, null not comparable).
    tokens_match = ("CASE WHEN offer_tokens_hash IS NOT NULL "
                    "AND retention_tokens_hash IS NOT NULL "
                    "AND offer_tokens_key = retention_tokens_key THEN (CASE WHEN "
                    "offer_tokens_hash = retention_tokens_hash THEN 1 ELSE 0 END) END")
    # The ledger's order, the engine's to keep: the rows are shaped as they stream back.
    return (f"SELECT {out}, {_history(b)} AS history, {prompt_hash} AS prompt_hash, "
            f"{d.int64(tokens_match)} AS tokens_match "
            f"FROM (SELECT *, {previous}, {from_source} AS prev_is_source "
            f"FROM (SELECT *, {lagged} FROM joined) AS with_lag "
            f"LEFT JOIN ({source}) AS src ON src.src_run = with_lag.run_id "
            "AND src.src_conversation = with_lag.conversation_id "
            "AND src.src_request = with_lag.retention_id) AS with_previous "
            "ORDER BY run_id NULLS FIRST, conversation_id NULLS FIRST, "
            "turn_number NULLS FIRST, arrival NULLS FIRST")


# A turn's first leg of each kind: (extraction relation, the columns taken), by CTE name.
_LEGS: dict[str, tuple[str, str]] = {
    "prefill_leg": ("prefill", "prefill_ns, prefill_request_id, d_metadata_attached, "
                               "offered_tokens_proxy, retention_id"),
    "decode_leg": ("decode", "decode_ns, decode_request_id, metadata_returned, decode_measured, "
                             "leg_time AS decode_start"),
    "wait_leg": ("waits", "tool_wait_ns"),
}


def _leg(name: str) -> Callable[[query.Binder], str]:
    source, columns = _LEGS[name]

    def part(b: query.Binder) -> str:
        return _first("trace_id, parent_span_id", "leg_time, leg_span_id",
                      f"trace_id, parent_span_id, {columns}", source)
    return part


# The per-turn parts over the extraction relations (QUERIES' names), in dependency order.
_DERIVED: list[tuple[str, query.Part]] = [
    *((name, _leg(name)) for name in _LEGS),
    ("decision_rows", _decision_rows),
    ("first_decision", _first_decision),
    ("transfer_rows", _transfer_rows),
    ("d2p", _d2p),
    ("p2d", _p2d),
    ("retention_first", _retention_first),
    ("vllm_request", _vllm),
    ("engine_hooks", _engine_hooks),
    ("decision_keys", _decision_keys),
    ("engine_turns", _engine_turns),
    ("joined", _joined),
]

# The store's ledger rows before shaping: the extraction queries and the per-turn parts as one
# statement, run in the engine.
TURN_QUERY = query.compose([*QUERIES.items(), *_DERIVED], _per_turn).named("ledger turns")
# The same parts over extraction frames registered under QUERIES' names (:func:`build`).
_FRAMES_QUERY = query.compose(_DERIVED, _per_turn).named("ledger turns of frames")


def turn_rows(reader: Reader) -> pl.DataFrame:
    """The per-turn rows the engine computes from the store's spans (before :func:`shape`)."""
    return reader.frame(TURN_QUERY)


# Frames of at most this many rows in all are few turns (a live refresh's ~1-3k), whose per-turn
# rows DuckDBReader reads as small_results: ~20-35 ms less a refresh, a copy of few rows more.
SMALL_FRAME_ROWS = 100_000


def frame_turn_rows(frames: dict[str, pl.DataFrame],
                    con: duckdb.DuckDBPyConnection | None = None) -> pl.DataFrame:
    """The per-turn rows of extraction frames (:func:`load_spans`' shape), by the same SQL on
    an in-memory DuckDB: ``con`` (views named after the kinds are registered on it, then
    dropped; a caller that builds often saves a connect, ~15 ms), else a fresh one. A frame may
    lack columns or be missing: they read as nulls."""
    engine = duckdb.connect() if con is None else con
    small = sum(frame.height for frame in frames.values()) <= SMALL_FRAME_ROWS
    try:
        for name, (_, columns) in _KINDS.items():
            engine.register(name, _complete(frames.get(name), columns).to_arrow())
        return DuckDBReader(engine, time_limit_s=None, small_results=small).frame(_FRAMES_QUERY)
    finally:
        if con is None:
            engine.close()
        else:
            for name in _KINDS:
                engine.unregister(name)


# --- a large store: the per-turn parts a partition of its conversations at a time ------------
#
# One statement over a large store makes DuckDB hold (or spill) every turn's joins and windows
# at once: at 1M turns, 6.6 GB of buffers. Above PARTITION_TURNS turn spans (or when the one
# statement runs out of DuckDB's memory) the ledger instead extracts each span kind once into
# temporary tables, then runs the same per-turn parts over one range of conversations at a
# time (the ledger's order cut into ranges of about as many turns): their turn spans, their
# legs (by trace), the engine spans their requests name (by X-Request-Id) and the retentions
# their legs were offered or left. What spans partitions is decided once over all: each run's
# missing hooks, and which requests no turn names (an engine-only run's requests are one range
# unit). The rows equal the one statement's, in its order
# (tests/analysis/test_ledger_partitions.py). On ClickHouse the kinds are staged in a scratch
# database of the server's, as MergeTree tables sorted by partition, dropped after.

# Up to PARTITION_TURNS turn spans the one statement is fastest (at 1M under DuckDB's 4 GB
# limit: 29.0-29.1 s in one, 35.0-35.2 s in four partitions, 5.2-5.4 GB peak either way);
# above, partitions of PARTITION_SIZE turns: at 10M, 80 partitions of 125k build in 553 s,
# 40 of 250k in 613 s, 10 of 1M in 666-676 s, and the smaller spill less (docs/benchmarks.md).
PARTITION_TURNS = 1_000_000
PARTITION_SIZE = 125_000
# ClickHouse holds the one statement's joins and windows in memory (its memory limits fail the
# query rather than spill it): above this many turn spans it builds in partitions too.
CLICKHOUSE_PARTITION_TURNS = 250_000
# A build that runs out of DuckDB's memory is tried again in this many times more partitions
# (at 1M turns under a 1 GB limit the one statement fails; four partitions take 53 s and peak
# at 3.1 GB), up to MAX_PARTITIONS.
_RETRY_FACTOR = 4
MAX_PARTITIONS = 256
_SCRATCH = "_kvscope_ledger_"
_ENGINE_KINDS = ("decisions", "transfers", "retentions", "vllm_requests")
# Staged tables without the partition column (on ClickHouse the rest are sorted by it).
_UNPARTITIONED = frozenset({"all_turns", *(f"all_{kind}" for kind in _ENGINE_KINDS),
                            "engine_hooks", "unnamed", "turn_runs"})


def _scratch(name: str, db: str = "") -> str:
    """A staged table's name: temporary, or in the attached scratch database ``db``."""
    return f"{db}.{quote(_SCRATCH + name)}" if db else quote(_SCRATCH + name)


def _stages(reader: Reader) -> TypeGuard[_Staging]:
    """Whether ``reader``'s engine can build the ledger in partitions (:func:`_stage`)."""
    return isinstance(reader, DuckDBReader) or (
        reader.dialect is query.CLICKHOUSE and hasattr(reader, "execute"))


def partitions_for(reader: Reader) -> int:
    """How many partitions :func:`ledger` builds the store's rows in (1: one statement)."""
    if not _stages(reader):
        return 1
    _, rows = reader.rows(query.Query(
        f'SELECT count(*) FROM {quote(TRACES_TABLE)} WHERE "SpanName" = $span',
        {"span": semconv.SPAN_TURN}, name="ledger turn spans"))
    turns = int(rows[0][0])
    most = CLICKHOUSE_PARTITION_TURNS if reader.dialect is query.CLICKHOUSE else PARTITION_TURNS
    if turns <= most:
        return 1
    return min(MAX_PARTITIONS, -(-turns // min(PARTITION_SIZE, most)))


def _extraction(kind: str) -> Callable[[query.Binder], str]:
    build = QUERIES[kind].build
    assert build is not None  # built by query.spans
    return build


def _temporary(reader: _Staging, name: str, select: Callable[[query.Binder], str],
               db: str = "", *, partitioned: bool = False) -> None:
    table = _scratch(name, db)
    statement = query.compose(
        [], lambda b: f"{b.dialect.create_as(table, partitioned)} {select(b)}")
    start = time.perf_counter()
    reader.execute(statement.named(f"ledger partitions: {name}"))
    logger.info("ledger partitions: %s staged in %.1f s", name, time.perf_counter() - start)


def _stage(reader: _Staging, count: int, db: str = "") -> None:
    """The span kinds, extracted once, each row with its partition (``_p``; a row a turn of
    another partition also reads is there twice), stored in partition order so that a
    partition's scan skips the others' row groups.

    A partition is a range of units in the ledger's order (run, then conversation; a run's
    turns without a conversation id, and an engine-only run's requests, are one unit), about
    as many turns each: the partitions' rows, one after the other, are in the ledger's order.
    ``db``: an attached database to stage in (its tables are compressed; temporary ones are
    not, and spill as they are), else temporary tables; on ClickHouse a database of the
    server's (MergeTree tables sorted by partition).
    """
    def at(name: str) -> str:
        return _scratch(name, db)

    def stage(name: str, select: Callable[[query.Binder], str]) -> None:
        _temporary(reader, name, select, db, partitioned=name not in _UNPARTITIONED)

    def drop(table: str) -> None:
        reader.execute(query.Query(f"DROP TABLE {table}", name="ledger partitions"))
        if db and reader.dialect is query.DUCKDB:
            # A dropped table's blocks are free for the next one only after a checkpoint: else
            # the scratch file grows by every intermediate table (at 1M turns 852 MiB staged
            # for 516 MiB of tables kept).
            reader.execute(query.Query(f"CHECKPOINT {db}", name="ledger partitions"))

    def keyed(kind: str) -> Callable[[query.Binder], str]:
        return lambda b: (f"SELECT *, {_key(b, 'request_id')} AS _k "
                          f"FROM ({_extraction(kind)(b)}) AS e")

    def whole(kind: str) -> Callable[[query.Binder], str]:
        return lambda b: f"SELECT * {b.dialect.exclude} (_k) FROM {at('all_' + kind)}"

    def by_p(b: query.Binder, column: str) -> str:
        # In partition order: DuckDB as written; a ClickHouse table sorts by ``_p`` itself.
        return f" ORDER BY {column}" if b.dialect is query.DUCKDB else ""

    def leg(kind: str) -> Callable[[query.Binder], str]:
        return lambda b: (f"SELECT e.*, t._p FROM ({_extraction(kind)(b)}) AS e "
                          f"JOIN {at('traces')} AS t ON t.trace_id = e.trace_id"
                          + by_p(b, "t._p"))

    def placed(kind: str) -> Callable[[query.Binder], str]:
        source = at("all_" + kind)

        def rows(b: query.Binder) -> str:
            but = b.dialect.exclude
            rows = f"SELECT e.* {but} (_k), k._p FROM {source} AS e JOIN {keys} AS k ON k.k = e._k"
            if kind == "retentions":
                rows += (f" UNION DISTINCT SELECT e.* {but} (_k), h._p FROM {source} AS e "
                         f"JOIN {at('held')} AS h ON h.r = e.request_id")
            return f"SELECT * FROM ({rows}) AS e" + by_p(b, "_p")
        return rows

    every_turn, units, keys = at("all_turns"), at("units"), at("keys")
    stage("all_turns", _extraction("turns"))
    for kind in _ENGINE_KINDS:
        stage("all_" + kind, keyed(kind))
    everything: list[tuple[str, query.Part]] = [(kind, whole(kind)) for kind in _ENGINE_KINDS]
    hooks = query.compose(everything, _engine_hooks).build
    assert hooks is not None
    stage("engine_hooks", hooks)
    # The requests no turn names, of runs without turn spans: each an engine row (in its run's
    # unit; engine_turns takes the largest run among its spans).
    # Named apart from the output: ClickHouse resolves a name to a select alias first.
    named = " UNION ALL ".join(f"SELECT _k, run_id AS e_run FROM {at('all_' + kind)}"
                               for kind in _ENGINE_KINDS)
    stage("unnamed", lambda b: (
        f"SELECT _k AS k, max(e_run) AS run_id FROM ({named}) AS e WHERE _k IS NOT NULL "
        f"AND _k NOT IN (SELECT x_request_id FROM {every_turn} WHERE x_request_id IS NOT NULL) "
        f"AND e_run NOT IN (SELECT run_id FROM {every_turn} WHERE run_id IS NOT NULL) "
        "GROUP BY _k"))
    weights = (f"SELECT run_id, conversation_id, count(*) AS n FROM {every_turn} GROUP BY ALL "
               f"UNION ALL SELECT run_id, NULL, count(*) FROM {at('unnamed')} "
               "GROUP BY ALL")
    order = "run_id NULLS FIRST, conversation_id NULLS FIRST"
    stage("units", lambda b: (
        "SELECT run_id, conversation_id, " + b.dialect.int_div(
            f"(sum(n) OVER (ORDER BY {order} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) "
            f"- n) * {count}", f"(SELECT sum(n) FROM ({weights}))") + " AS _p "
        f"FROM ({weights}) AS w"))
    def turns_of(low: int, high: int) -> Callable[[query.Binder], str]:
        return lambda b: (
            f"SELECT t.*, u._p FROM {every_turn} AS t JOIN {units} AS u "
            "ON u.run_id IS NOT DISTINCT FROM t.run_id "
            "AND u.conversation_id IS NOT DISTINCT FROM t.conversation_id "
            f"WHERE u._p >= {low} AND u._p < {high}" + by_p(b, "u._p"))

    # The turns sorted by partition a group of partitions at a time, each group's sort within
    # DuckDB's memory: sorted whole, the 10M-turn store's turns (their boundary hashes most of
    # it) spilled beside the staged tables, the build's largest use of temporary space (7.6 GB
    # for 6.9 GB of spans; 6.7 at most sorted in groups). ClickHouse sorts a table by its key.
    groups = _sort_groups(reader, every_turn, count)
    stage("turns", turns_of(*groups[0]))
    for low, high in groups[1:]:
        reader.execute(query.compose([], _inserted(at("turns"), turns_of(low, high))).named(
            "ledger partitions: turns"))
    stage("turn_runs", lambda b: (
        f"SELECT DISTINCT run_id FROM {every_turn} WHERE run_id IS NOT NULL"))
    drop(every_turn)
    turns = at("turns")
    stage("traces", lambda b: (
        f"SELECT DISTINCT trace_id, _p FROM {turns} WHERE trace_id IS NOT NULL"))
    stage("keys", lambda b: (
        f"SELECT DISTINCT x_request_id AS k, _p FROM {turns} WHERE x_request_id IS NOT NULL "
        f"UNION DISTINCT SELECT e.k, u._p FROM {at('unnamed')} AS e JOIN {units} AS u "
        "ON u.run_id = e.run_id AND u.conversation_id IS NULL"))
    for kind in ("prefill", "decode", "waits"):
        stage(kind, leg(kind))
    # What no partition reads goes once read: the engine kinds placed next, and the taint
    # inputs the partitions write, reuse its blocks (the scratch file keeps its high-water mark).
    drop(at("traces"))
    stage("held", lambda b: (
        f"SELECT retention_id AS r, _p FROM {at('prefill')} WHERE retention_id IS NOT NULL "
        f"UNION DISTINCT SELECT decode_request_id, _p FROM {at('decode')} "
        "WHERE decode_request_id IS NOT NULL"))
    for kind in _ENGINE_KINDS:
        stage(kind, placed(kind))
        drop(at("all_" + kind))
    drop(keys)
    drop(at("held"))


def _inserted(table: str, select: Callable[[query.Binder], str]
              ) -> Callable[[query.Binder], str]:
    return lambda b: f"INSERT INTO {table} {select(b)}"


# The most turns one sort of staged turns holds (:func:`_sort_groups`): ~1 GB of their columns.
SORT_TURNS = 2_000_000


def _sort_groups(reader: _Staging, turns: str, count: int) -> list[tuple[int, int]]:
    """Ranges of the ``count`` partitions (low, high), about :data:`SORT_TURNS` turns each,
    for the staged ``turns`` table (one range on ClickHouse)."""
    if reader.dialect is not query.DUCKDB:
        return [(0, count)]
    _, rows = reader.rows(query.Query(f"SELECT count(*) FROM {turns}",
                                      name="ledger partitions: turns"))
    groups = min(count, max(1, -(-int(rows[0][0]) // SORT_TURNS)))
    bounds = [count * index // groups for index in range(groups + 1)]
    return list(itertools.pairwise(bounds))


def _partition_query(index: int, count: int, db: str = "") -> query.Query:
    """The per-turn parts over partition ``index`` of ``count`` (:func:`_stage`'s tables)."""
    def own(kind: str) -> query.Part:
        return lambda b: (f"SELECT * {b.dialect.exclude} (_p) FROM {_scratch(kind, db)} "
                          f"WHERE _p = {index}")

    unnamed = (f" AND x_key IN (SELECT e.k FROM {_scratch('unnamed', db)} AS e "
               f"JOIN {_scratch('units', db)} AS u ON u.run_id = e.run_id "
               f"AND u.conversation_id IS NULL WHERE u._p = {index})")
    replaced: dict[str, query.Part] = {
        "engine_hooks": lambda b: f"SELECT * FROM {_scratch('engine_hooks', db)}",
        # The partition's own turns suffice for the requests (the unnamed ones are no turn's
        # already), not for the runs: a request's spans of a run with turns elsewhere.
        "engine_turns": lambda b: _engine_turns(
            b, "turns", unnamed, f"SELECT run_id FROM {_scratch('turn_runs', db)}"),
    }
    derived = [(name, replaced.get(name, part)) for name, part in _DERIVED]
    return query.compose([*((kind, own(kind)) for kind in _KINDS), *derived], _per_turn).named(
        f"ledger turns, partition {index + 1} of {count}")


def partitioned_turn_rows(reader: _Staging, count: int, fn: Callable[[pl.DataFrame], _T],
                          *, db: str = "") -> list[_T]:
    """``fn`` over the per-turn rows of ``count`` partitions of the store's conversations, as
    they stream back, in :data:`TURN_QUERY`'s order. ``db``: stage in that attached database
    (:func:`_stage`) and drop what was staged there after. On ClickHouse the span kinds are
    staged in a database of their own on the server (created, then dropped)."""
    if not isinstance(reader, DuckDBReader):
        return _clickhouse_partitions(reader, count, fn)
    scratch = reader.cursor()  # its temporary tables are its own, and go with it
    try:
        size = ("SELECT total_blocks * block_size FROM pragma_database_size() "
                "WHERE database_name = $db") if db else ""
        return _each_partition(scratch, count, db, size, fn)
    finally:
        if db:
            _, staged = scratch.rows(query.Query(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = $db "
                "AND starts_with(table_name, $prefix)", {"db": db, "prefix": _SCRATCH},
                name="ledger partitions: staged tables"))
            for (name,) in staged:
                scratch.execute(query.Query(f"DROP TABLE {db}.{quote(name)}",
                                            name="ledger partitions"))
        scratch.close()


def _each_partition(reader: _Staging, count: int, db: str, size: str,
                    fn: Callable[[pl.DataFrame], _T]) -> list[_T]:
    """Stage the span kinds (in ``db``, its size logged by the query ``size`` when given), then
    ``fn`` over each partition's per-turn rows."""
    _stage(reader, count, db)
    if size:
        _, staged = reader.rows(query.Query(size, {"db": db}, name="ledger partitions: size"))
        logger.info("ledger partitions: staged in %.0f MiB", (staged[0][0] or 0) / 2**20)
    done: list[_T] = []
    for index in range(count):
        start = time.perf_counter()
        done.extend(reader.map_batches(_partition_query(index, count, db), fn))
        logger.info("ledger partition %d of %d in %.1f s", index + 1, count,
                    time.perf_counter() - start)
    return done


class NoScratch(Exception):
    """ClickHouse refused the scratch database the span kinds are staged in."""


def _clickhouse_partitions(reader: ClickHouseReader, count: int,
                           fn: Callable[[pl.DataFrame], _T]) -> list[_T]:
    """:func:`partitioned_turn_rows` on ClickHouse: staged in a scratch database, dropped after
    (a failed build's too)."""
    with _clickhouse_scratch(reader) as db:
        return _each_partition(reader, count, db, _CLICKHOUSE_SIZE, fn)


_CLICKHOUSE_SIZE = ("SELECT sum(bytes_on_disk) FROM system.parts "
                    "WHERE database = $db AND active")


@contextlib.contextmanager
def _clickhouse_scratch(reader: ClickHouseReader) -> Iterator[str]:
    """A database of its own on the server for a build's tables, dropped when the build ends
    (a failed one's too); :class:`NoScratch` when ClickHouse refuses it (a read-only user)."""
    db = f"kvscope_scratch_{uuid.uuid4().hex[:12]}"
    try:
        reader.execute(query.Query(f"CREATE DATABASE {db}", name="ledger partitions"))
    except StoreError as exc:  # a read-only user, say
        raise NoScratch(str(exc)) from None
    try:
        yield db
    finally:
        reader.execute(query.Query(f"DROP DATABASE IF EXISTS {db} SYNC",
                                   name="ledger partitions"))


_COLUMN_TYPES: dict[query.Column, pl.DataType] = {
    "Timestamp": pl.Datetime("ns"), "Duration": pl.UInt64()}


def _complete(frame: pl.DataFrame | None, columns: _Columns) -> pl.DataFrame:
    """``frame`` with every extraction column, those it lacks as typed nulls."""
    frame = pl.DataFrame() if frame is None else frame
    missing = [pl.lit(None, _COLUMN_TYPES.get(column, pl.String())).alias(name)
               for name, column in columns.items() if name not in frame.columns]
    if not missing:
        return frame
    if frame.width == 0:
        return pl.DataFrame(schema={name: _COLUMN_TYPES.get(column, pl.String())
                                    for name, column in columns.items()})
    return frame.with_columns(missing)


# --- shaping, per turn ------------------------------------------------------------------------

# vLLM methods whose hooks give a kind of evidence (kvscope.vllm.hooks_missing names them).
_DECISION_HOOKS = "get_num_new_matched_tokens|update_state_after_alloc"
_READ_HOOKS = "start_load_kv|get_transfer_results"
_FAILURE_CAUSE_HOOKS = "_read_blocks_for_req|_is_turn2_read_expired"

def hook_decided(frame: pl.DataFrame) -> pl.Expr:
    """Turns whose reuse decision came from kvscope's engine hooks (a decision an ingested
    server log implied comes with no read times: it is not evidence of the transfers)."""
    decided = pl.col("decision").is_not_null()
    if "engine_evidence" in frame.columns:  # hand-built frames of tests may lack it
        decided = decided & (pl.col("engine_evidence") != ENGINE_EVIDENCE_LOG).fill_null(True)
    return decided


def request_key(column: str) -> pl.Expr:
    """vLLM's internal request id reduced to the X-Request-Id it came from."""
    return (
        pl.col(column).str.replace(_ID_PREFIX, "").str.replace(_ID_SUFFIX, "")
    )


def _int(column: str) -> pl.Expr:
    return pl.col(column).cast(pl.Float64, strict=False).cast(pl.Int64, strict=False)


def _float(column: str) -> pl.Expr:
    return pl.col(column).cast(pl.Float64, strict=False)


def _bool(column: str) -> pl.Expr:
    return pl.col(column).str.to_lowercase() == "true"


def build(frames: dict[str, pl.DataFrame], *, across_conversations: bool = True,
          con: duckdb.DuckDBPyConnection | None = None) -> pl.DataFrame:
    """The ledger of extraction frames (:func:`load_spans`' shape): the per-turn SQL on an
    in-memory DuckDB over the frames (``con``, see :func:`frame_turn_rows`), then
    :func:`shape` (no I/O to a store)."""
    return finish(shape(frame_turn_rows(frames, con)),
                  across_conversations=across_conversations)


def shape(rows: pl.DataFrame) -> pl.DataFrame:
    """The ledger from the engine's per-turn rows: reusable tokens, where they came from,
    validity and outcome. Row by row (the joins, the previous turn and the history are done),
    so any batch of rows can be shaped on its own; the rows keep their order."""
    return _shape(rows.lazy()).collect()


def _shape(rows: pl.LazyFrame) -> pl.LazyFrame:
    def ms(column: str, scale: float = 1e6) -> pl.Expr:
        return pl.col(column).cast(pl.Float64) / scale

    def plus_ns(start: str, ns: pl.Expr) -> pl.Expr:
        return pl.col(start) + pl.duration(nanoseconds=ns.cast(pl.Int64))

    unmeasured = pl.col("duration_measured") == "false"
    ledger = rows.with_columns(
        pl.col("turn_number").alias("turn_index"),
        # The turn's own counts (and the previous turn's) are integers already (_TURN_NUMBERS).
        *(_int(c) for c in ("prev_held", "decision_local_hit", "block_size", "tokens_match",
                            "offered_tokens", "to_pull_tokens", "threshold_tokens",
                            "final_local_hit", "decision_remote_count", "retention_bytes",
                            "offered_tokens_proxy")),
        *(_float(c) for c in ("ttft_ms", "router_entry_age_s", "engine_last_ttft_s")),
        *(_bool(c) for c in ("d_metadata_attached", "metadata_returned", "prev_returned",
                             "prefill_bidirectional")),
    ).with_columns(
        # An ingested log that gave a turn's start only: its end and time are not measured.
        pl.when(~unmeasured.fill_null(False)).then(plus_ns("arrival", pl.col("duration_ns")))
        .alias("end"),
        pl.when(~unmeasured.fill_null(False)).then(ms("duration_ns")).alias("turn_ms"),
        ms("prefill_ns").alias("prefill_ms"),
        pl.when((pl.col("decode_measured") != "false").fill_null(True))
        .then(ms("decode_ns")).alias("decode_ms"),
        ms("tool_wait_ns", 1e9).alias("tool_wait_s"),
        # A read an ingested log only names has no measured time: null, never 0.
        ms("d2p_ns").alias("d2p_ms"),
        ms("p2d_ns").alias("p2d_ms"),
        ms("retention_ns", 1e9).alias("retention_held_s"),
        plus_ns("retention_start", pl.col("retention_ns")).alias("retention_released_at"),
        (pl.col("from_hooks") == 1).alias("_from_hooks"),
        (pl.col("load_errored") == 1).alias("load_errored"),
        ((pl.col("engine_last_start") + pl.duration(
            microseconds=(pl.col("engine_last_ttft_s") * 1e6).cast(pl.Int64))
          - pl.col("engine_first_start")).dt.total_microseconds() / 1000)
        .alias("engine_ttft_ms"),
        (pl.col("engine_queue_s") * 1000).alias("engine_queue_ms"),
        ((pl.col("p2d_start") - pl.col("decode_start")).dt.total_microseconds() / 1000)
        .alias("decode_queue_ms"),
    )
    offered_tokens = pl.coalesce(pl.col("offered_tokens"), pl.col("offered_tokens_proxy"))
    held_tokens = pl.coalesce(offered_tokens, pl.col("prev_held"),
                              pl.col("prev_prompt") + pl.col("prev_output") - 1)
    reusable = (
        pl.when(pl.col("history") == HISTORY_FIRST).then(pl.lit(0, pl.Int64))
        .when(pl.col("history") == HISTORY_CONTINUES)
        # What decode holds KV for: its offer, else its retention's remote_num_tokens (one
        # less than prompt + output under the synchronous scheduler, equal under the async one
        # after a stop token). Without either (decode kept nothing: bidir off there), prompt +
        # output − 1, what every scheduler computed (a lower bound: async may have computed one
        # more, which no span of such a run shows). Null when the previous turn left no output
        # count (it failed): min_horizontal would skip the null and return the prompt length.
        .then(pl.when(held_tokens.is_not_null()).then(
            pl.min_horizontal(held_tokens, pl.col("prompt_tokens"))))
        .when(pl.col("history") == HISTORY_UNKNOWN)
        .then(pl.when(offered_tokens.is_not_null()).then(
            pl.min_horizontal(offered_tokens, pl.col("prompt_tokens"))))
        .otherwise(pl.lit(None, pl.Int64))
    )
    errored = (pl.col("status_code") == "STATUS_CODE_ERROR") | pl.col("load_errored").fill_null(
        False)
    # An errored turn reused nothing, except when only its client left: prefill's evidence (its
    # read, its own hit) stands whatever happened to the turn after it (a client that leaves
    # mid-stream, real tier: prefill pulled and decode was aborted).
    reuse_void = errored & ~(
        (pl.col("error_kind") == semconv.ERROR_CLIENT_DISCONNECTED).fill_null(False)
        & ~pl.col("load_errored").fill_null(False))
    ledger = ledger.with_columns(
        reusable.clip(lower_bound=0).alias("reusable_tokens"),
        errored.alias("errored"),
        reuse_void.alias("_reuse_void"),
        offered_tokens.alias("offered_tokens"),
    )
    # P's evidence: the final schedule's local hit (after a preemption or recompute it is what
    # the request ran with); a read counts when it moved bytes and finished ok. A server log
    # names no bytes (null, not 0): its read counts when it finished ok.
    read_ok = (pl.col("d2p_status") == semconv.TRANSFER_OK) & (
        pl.col("d2p_bytes").fill_null(1) > 0)
    # Whether prefill's engine left any evidence for the turn (hooks or a server log): without
    # it, what the turn reused from decode is not measured (null), not 0.
    engine_seen = pl.col("decision").is_not_null() | pl.col("d2p_status").is_not_null()
    # Decode's reaper released the handle before the READ finished (D frees blocks on the
    # READ's notification, so a release by the reaper before then left the READ reading freed
    # blocks: P reports success, D logs "Potentially invalid KV blocks").
    read_end = pl.col("d2p_start") + pl.duration(microseconds=(pl.col("d2p_ms") * 1000).cast(
        pl.Int64))
    # A decode server's log names such a read ("Potentially invalid KV blocks for unrecognized
    # request"): ingest marks the retention, whose times the log does not give.
    stale = read_ok & (pl.col("retention_release") == semconv.RELEASE_EXPIRED) & (
        (pl.col("retention_released_at") <= read_end)
        | _bool("retention_read_after_release").fill_null(False))
    preempted = read_ok & (pl.col("decisions").fill_null(0) > 1)
    reusable_col = pl.col("reusable_tokens")
    # min_horizontal skips nulls: an unmeasured hit (or reusable span) stays unmeasured.
    local = (pl.when(pl.col("_reuse_void")).then(pl.lit(0, pl.Int64))
             .when(pl.col("final_local_hit").is_null()).then(pl.lit(None, pl.Int64))
             .otherwise(pl.min_horizontal(pl.col("final_local_hit"), reusable_col)))
    reach = pl.col("decision_local_hit") + pl.col("to_pull_tokens")
    remote = (
        pl.when(pl.col("_reuse_void") | stale.fill_null(False) | preempted.fill_null(False))
        .then(pl.lit(0, pl.Int64))
        .when(~engine_seen).then(pl.lit(None, pl.Int64))
        .when(~read_ok.fill_null(False)).then(pl.lit(0, pl.Int64))
        # A read whose reach (own hit + tokens pulled) or reusable span was not measured.
        .when(reusable_col.is_null() | reach.is_null()).then(pl.lit(None, pl.Int64))
        .otherwise((pl.min_horizontal(reach, reusable_col) - local).clip(lower_bound=0))
    )
    ledger = ledger.with_columns(
        local.alias("local_hit_tokens"),
        stale.fill_null(False).alias("_stale"),
        preempted.fill_null(False).alias("_preempted"),
        read_ok.fill_null(False).alias("_read_ok"),
    ).with_columns(remote.alias("remote_reused_tokens")).with_columns(
        # Null when either part was not measured: the rest is not known to be recomputed.
        (reusable_col - pl.col("local_hit_tokens")
         - pl.col("remote_reused_tokens")).alias("recomputed_reusable_tokens"),
    )
    ledger = _validity(ledger)
    # A misaligned read put decode's last blocks in the prompt's positions: nothing of it is
    # reuse (as after release).
    misaligned = (pl.col("_invalid_kind") == INVALID_MISALIGNED).fill_null(False)
    ledger = ledger.with_columns(
        pl.when(misaligned).then(pl.lit(0, pl.Int64)).otherwise(pl.col("remote_reused_tokens"))
        .alias("remote_reused_tokens"),
    ).with_columns(
        (reusable_col - pl.col("local_hit_tokens").fill_null(0)
         - pl.col("remote_reused_tokens").fill_null(0)).alias("recomputed_reusable_tokens"),
    )
    ledger = _label(ledger)
    ledger = ledger.with_columns(
        pl.when(pl.col("_from_hooks")).then(pl.lit(ENGINE_EVIDENCE_HOOKS))
        .when(pl.col("decision").is_not_null()).then(pl.lit(ENGINE_EVIDENCE_LOG))
        .otherwise(pl.lit(None, pl.String)).alias("engine_evidence"))
    # What the taint pass reads across turns (kvscope.reuse.taint), dropped after it.
    c = pl.col
    loaded = c("_read_ok") & ~c("_reuse_void")
    carried = {
        "_taint_prompt": c("prompt_hash"),
        "_taint_local": pl.when(c("_reuse_void")).then(0)
        .otherwise(c("final_local_hit").fill_null(0)),
        "_taint_pulled": pl.when(loaded).then(c("to_pull_tokens").fill_null(0)).otherwise(0),
        "_taint_clean": pl.when(c("_invalid_kind") == INVALID_BEYOND_PREFIX)
        .then(pl.max_horizontal(c("reusable_tokens"), c("decision_local_hit")))
        .otherwise(c("decision_local_hit")).fill_null(0),
    }
    # Row by row: the rows keep the order the engine sorted them in.
    return ledger.select(
        *(pl.col(name).cast(dtype) for name, dtype in LEDGER_SCHEMA.items()),
        *(expr.alias(name) for name, expr in carried.items()))


_TAINT_COLUMNS = ("_taint_prompt", "_taint_local", "_taint_pulled", "_taint_clean")
# What the taint pass reads of each row.
_TAINT_INPUTS = ("run_id", "conversation_id", "turn_index", "x_request_id", "arrival",
                 "prefill_ms", "prefill_engine", "decode_request_id", "retention_id", "history",
                 "invalid_kind", *_TAINT_COLUMNS)


def finish(frame: pl.DataFrame, *, across_conversations: bool = True) -> pl.DataFrame:
    """The ledger from shaped rows (:func:`shape`, any number of batches concatenated): the
    turns that read KV an earlier invalid load computed (:mod:`kvscope.reuse.taint`) marked
    ``reused_invalid`` (kind ``tainted``), the columns the pass read dropped.

    Across conversations and batches within a run, so on a run's whole ledger; in arrival order
    from the first invalid load on (nothing before it can be tainted). Without
    ``across_conversations`` a prompt sent again is linked only within its conversation: what
    the rows of some conversations alone can decide (live metrics recompute conversations one
    at a time; ``kvscope ledger`` rebuilds a run with an invalid load whole instead)."""
    own = frame["invalid_kind"].is_not_null()
    if not own.any():
        return frame.drop(_TAINT_COLUMNS)
    first = frame.filter(own)["arrival"].min()
    rows = (frame.select(_TAINT_INPUTS).with_row_index("_row")
            .filter(pl.col("arrival") >= first))
    marked = taint_marks(rows, across_conversations=across_conversations)
    frame = frame.drop(_TAINT_COLUMNS)
    if marked is None:
        return frame
    at = marked["_row"]
    return frame.with_columns(  # the marked rows' values written in place of theirs
        frame["invalid_kind"].scatter(at, INVALID_TAINTED),
        frame["invalid_tokens"].scatter(at, marked["_tokens"]),
        frame["reuse_validity"].scatter(at, VALIDITY_INVALID),
        frame["outcome"].scatter(at, marked["_outcome"]),
        frame["evidence"].scatter(at, marked["_evidence"])).select(list(LEDGER_SCHEMA))


def taint_marks(rows: pl.DataFrame, *, across_conversations: bool = True
                ) -> pl.DataFrame | None:
    """The rows :func:`finish` marks tainted: ``_row`` (each row's index in the ledger),
    ``_tokens``, ``_outcome``, ``_evidence``; None when none is. ``rows``: the ledger's
    :data:`_TAINT_INPUTS` with ``_row``, in the ledger's order, from the first invalid load's
    arrival on (the whole ledger held, or read back narrow from a table written a partition
    at a time)."""
    c = pl.col
    # The turn each follows: the one whose decode KV it was offered, else turn k-1 of its
    # conversation (nothing before the first invalid load can be dirty).
    decoded = (rows.filter(c("decode_request_id").is_not_null())
               .unique("decode_request_id", keep="first")
               .select(c("decode_request_id").alias("retention_id"),
                       c("x_request_id").alias("_offered_turn")))
    conversation = ["run_id", "conversation_id"]
    rows = (rows.join(decoded, on="retention_id", how="left")
            .sort(*conversation, "turn_index", "_row", nulls_last=True)
            .with_columns(
                pl.when(c("conversation_id").is_not_null()
                        & (c("turn_index").shift(1).over(conversation) == c("turn_index") - 1))
                .then(c("x_request_id").shift(1).over(conversation)).alias("_lag_turn")))
    # Within the run; within the conversation (the request, without one) when asked.
    scope = (pl.lit("") if across_conversations
             else pl.coalesce(c("conversation_id"), pl.lit("x:") + c("x_request_id")))
    arrival = c("arrival").dt.epoch("ns").fill_null(0)
    loaded = (c("_taint_local") > 0) | (c("_taint_pulled") > 0) | c("invalid_kind").is_not_null()
    rows = (rows.filter(loaded)  # a turn that read nothing is no reader, and no source
            .sort("arrival", "_row")
            .select(  # TaintTurn's fields, in order
                "_row", "x_request_id", pl.coalesce("_offered_turn", "_lag_turn").alias("p"),
                arrival.alias("a"),
                (arrival + (c("prefill_ms").fill_null(0) * 1e6).cast(pl.Int64)).alias("pa"),
                "prefill_engine",
                pl.when(c("_taint_prompt").is_not_null()).then(pl.concat_str(
                    [c("run_id").fill_null(""), scope, c("_taint_prompt")], separator="\x1f"))
                .alias("h"),
                "decode_request_id", "retention_id", c("_taint_local").fill_null(0),
                c("_taint_pulled").fill_null(0),
                (c("history") == HISTORY_CONTINUES).fill_null(False).alias("co"),
                c("invalid_kind").is_not_null().alias("own"), c("_taint_clean").fill_null(0),
                ~c("invalid_kind").is_in([INVALID_EDITED, INVALID_TOKENS]).fill_null(False)
                .alias("exact"),
                pl.when(c("conversation_id").is_not_null()).then(pl.concat_str(
                    [c("run_id").fill_null(""), c("conversation_id")], separator="\x1f"))
                .alias("_conversation")))
    # Streamed row by row in arrival order, over the turns an invalid load can reach at all
    # (the tracker's maps keep only the dirty ones; a turn no link reaches never changes them).
    rows = rows.filter(_reachable(rows)).drop("_conversation")
    turns = (taint.TaintTurn(*row) for row in rows.iter_rows())
    found = taint.propagate(turns)
    if not found:
        return None
    marked = pl.DataFrame(
        [(key, INVALID_TAINTED, mark.tokens, mark.read, mark.via, mark.source)
         for key, mark in found.items()], orient="row",
        schema={"_row": pl.UInt32, "_kind": pl.String, "_tokens": pl.Int64,
                "_read": pl.Int64, "_via": pl.String, "_source": pl.String})
    label, evidence = _taint_exprs()
    return marked.select("_row", "_tokens", label.alias("_outcome"),
                         evidence.alias("_evidence"))


@cache
def _taint_exprs() -> tuple[pl.Expr, pl.Expr]:
    """The decision table over a tainted turn's facts (rendered once: a rendering is ~5 ms,
    and the live ledger shapes a few hundred turns a refresh)."""
    facts = {name: pl.lit(None) for name in decisions.FACTS} | {
        "invalid_kind": pl.col("_kind"), "invalid_tokens": pl.col("_tokens"),
        "taint_read": pl.col("_read"), "taint_via": pl.col("_via"),
        "taint_source": pl.col("_source")}
    return decisions.polars_exprs(facts)


def _reachable(rows: pl.DataFrame) -> pl.Series:
    """Which of :func:`finish`'s taint rows an invalid load can reach by any chain of the
    rule's links, ignoring times and token counts (a superset; :func:`taint.propagate` decides).

    Links: a later turn of the same conversation (turn k-1, or the turn whose decode KV was
    offered, is one), the turn offered a reachable turn's decode KV, the same prompt on the
    same prefill. Closed over whole conversations at once, so a long chain costs one step.
    """
    c = pl.col
    keyed = rows.select(
        "own", "x_request_id", "decode_request_id", "retention_id", "p", "a",
        pl.concat_str(["prefill_engine", "h"], separator="\x1f").alias("eh"),
        c("_conversation").alias("conversation"))
    reach = keyed["own"]
    count = -1
    while (now := int(reach.sum())) != count:
        count = now
        found = keyed.filter(reach)
        firsts = found.group_by("conversation").agg(c("a").min().alias("_first"))
        decoded = found["decode_request_id"].drop_nulls().implode()
        turns = found["x_request_id"].drop_nulls().implode()
        prompts = found["eh"].drop_nulls().implode()
        reach = (keyed.join(firsts, on="conversation", how="left", maintain_order="left")
                 .select((c("own") | (c("a") >= c("_first")) | c("retention_id").is_in(decoded)
                          | c("p").is_in(turns) | c("eh").is_in(prompts)).fill_null(False)
                         | reach)
                 .to_series())
    return reach


def _validity(ledger: pl.LazyFrame) -> pl.LazyFrame:
    """Whether the KV each turn loaded from decode belongs to its prompt (spans alone).

    Invalid when the read came after decode released the blocks (TTL reaper); when it was
    misaligned (:func:`kvscope.reuse.validity.loaded_span`: decode's list is end-trimmed, so a
    sequence that needs more blocks than the read fills hands prefill decode's last blocks —
    decided from the block size the decision span records; without it, a continuing history
    whose decode sequence is longer than what the read reaches is misaligned, since nothing
    proves both ends fall in one block); when the history was edited since the previous turn
    (message-boundary hashes); or when a continuing history's read reached past what the prompt
    shares with decode's sequence (positions up to prefill's own hit are its own:
    :func:`kvscope.reuse.validity.invalid_tokens`'s rule). Without hashes an aligned read is
    ``not_verified``. ``invalid_tokens`` is the count whenever the evidence gives it (0 when
    prefill was seen loading nothing), null where it does not (an edited history, an
    unverified read, no engine evidence).
    """
    c = pl.col
    loaded = c("_read_ok") & (c("to_pull_tokens").fill_null(0) > 0) & ~c("_reuse_void")
    local = c("decision_local_hit").fill_null(0)
    reach = local + c("to_pull_tokens").fill_null(0)
    history = c("history")
    valid_end = pl.max_horizontal(c("reusable_tokens"), local)
    block = c("block_size")
    # Decode's sequence: what it offered (remote_num_tokens), the length its list is cut to.
    sequence = c("offered_tokens")
    shifted = (
        pl.when(block > 0)
        .then((sequence + block - 1) // block != (reach + block - 1) // block)
        .when(history == HISTORY_CONTINUES).then(sequence > reach)
    ).fill_null(False)
    # The engines' token hashes, where both recorded them with one key: the prompt's tokens a
    # read of the offer covers are (1) or are not (0) those decode holds KV for. They decide
    # over the message hashes: a reply re-sent as text can tokenize otherwise than decode
    # generated it (the messages continue, the tokens do not), and an edit the messages show
    # may leave every token the read covers the same.
    tokens = c("tokens_match")
    kind = (
        pl.when(~loaded).then(pl.lit(None, pl.String))
        .when(c("_stale")).then(pl.lit(INVALID_AFTER_RELEASE))
        .when(shifted).then(pl.lit(INVALID_MISALIGNED))
        .when(tokens == 0).then(pl.lit(INVALID_TOKENS))
        .when(tokens == 1).then(pl.lit(None, pl.String))
        .when(history == HISTORY_EDITED).then(pl.lit(INVALID_EDITED))
        .when((history == HISTORY_CONTINUES) & (reach > valid_end))
        .then(pl.lit(INVALID_BEYOND_PREFIX))
    )
    count = (
        pl.when(c("_invalid_kind").is_in([INVALID_AFTER_RELEASE, INVALID_MISALIGNED]))
        .then(c("to_pull_tokens"))
        .when(c("_invalid_kind") == INVALID_BEYOND_PREFIX).then(reach - valid_end)
        .when(c("_invalid_kind").is_null() & loaded
              & ((history == HISTORY_CONTINUES) | (tokens == 1).fill_null(False)))
        .then(pl.lit(0, pl.Int64))
        .when(~loaded & c("decision").is_not_null()).then(pl.lit(0, pl.Int64))
    )
    validity = (
        pl.when(~loaded).then(pl.lit(None, pl.String))
        .when(c("_invalid_kind").is_not_null()).then(pl.lit(VALIDITY_INVALID))
        .when((history == HISTORY_CONTINUES) | (tokens == 1).fill_null(False))
        .then(pl.lit(VALIDITY_VALID))
        .otherwise(pl.lit(VALIDITY_NOT_VERIFIED))
    )
    return ledger.with_columns(kind.alias("_invalid_kind")).with_columns(
        count.alias("invalid_tokens"), validity.alias("reuse_validity"),
        pl.col("_invalid_kind").alias("invalid_kind"))


def _label(ledger: pl.LazyFrame) -> pl.LazyFrame:
    """Decide each turn's outcome and its evidence: the facts its spans show, read by the one
    decision table (:data:`kvscope.reuse.decisions.TABLE`)."""
    label, evidence = _outcome_exprs()
    return ledger.with_columns(label.alias("outcome"), evidence.alias("evidence"))


@cache
def _outcome_exprs() -> tuple[pl.Expr, pl.Expr]:
    """The decision table over a shaped row's facts, rendered once (see :func:`_taint_exprs`)."""
    return decisions.polars_exprs(_facts())


def _facts() -> dict[str, pl.Expr]:
    """The decision table's facts (:data:`kvscope.reuse.decisions.FACTS`) from a shaped row."""
    c = pl.col
    engine_seen = c("decision").is_not_null()
    lookup = c("router_lookup")
    local, remote = c("local_hit_tokens"), c("remote_reused_tokens")
    offered = c("offered_tokens")
    # The previous turn gave the router nothing to keep: decode returned no params, or the turn
    # never reached decode (it failed first). Only where the proxy saw the previous turn: for a
    # client's record, a missing decode leg is evidence not collected (a proxy log joined to it
    # says whether decode returned params: prev_returned is then set).
    returned = c("prev_returned")
    prev_params = (
        pl.when(returned.fill_null(False)).then(pl.lit(decisions.PREV_RETURNED))
        .when(c("prev_index").is_not_null()
              & (c("observer").is_null() | returned.is_not_null()))
        .then(pl.when(returned.is_null()).then(pl.lit(decisions.PREV_NO_DECODE))
              .otherwise(pl.lit(decisions.PREV_NONE)))
    )
    missing = c("hooks_missing")
    named = missing.str.replace_all(",", ", ")
    return {
        "engine_only": c("observer") == semconv.OBSERVER_ENGINE,
        "decision_hooks_missing": pl.when(missing.str.contains(_DECISION_HOOKS)).then(named),
        "read_hooks_missing": pl.when(missing.str.contains(_READ_HOOKS)).then(named),
        "cause_hooks_missing": pl.when(missing.str.contains(_FAILURE_CAUSE_HOOKS)).then(named),
        # A client's own record (kvscope ingest) with no proxy or engine span joined to it:
        # nothing says whether or why the turn reused, so no miss cause is claimed.
        "client_only": (c("observer") == semconv.OBSERVER_CLIENT) & lookup.is_null()
        & ~engine_seen,
        "common_prefix": pl.lit(None, pl.Int64),  # not measurable from spans
        "prev_params": prev_params,
        "engine_seen": engine_seen,
        "bidir": c("prefill_bidirectional"),
        "offered": offered,
        # The connector's count: min(offered, prompt) - local hit (pull_count), as vLLM compares.
        "below_count": pl.coalesce(
            c("decision_remote_count"),
            pl.min_horizontal(offered, c("prompt_tokens")) - c("decision_local_hit")),
        "threshold": c("threshold_tokens"),
        "rescheduled": c("_preempted"),
        "read_status": c("d2p_status"),
        "load_errored": c("load_errored").fill_null(False),
        "load_reissued": c("last_decision") == semconv.DECISION_REISSUED,
        "loaded": c("to_pull_tokens"),
        "invalid_kind": c("_invalid_kind"),
        # Set by the taint pass across turns (_taint), after this.
        "taint_read": pl.lit(None, pl.Int64),
        "taint_via": pl.lit(None, pl.String),
        "taint_source": pl.lit(None, pl.String),
        "reusable": c("reusable_tokens"),
        "local": local,
        "remote": remote,
        "reused": local.fill_null(0) + remote.fill_null(0),
        "coverable": decisions.coverable_expr(c("reusable_tokens"), offered, local),
    }


def ledger(reader: Reader, *, across_conversations: bool = True,
           partitions: int | None = None, retry: bool = True) -> pl.DataFrame:
    """Build the ledger of every run in a store: per-turn rows from the engine, shaped as they
    stream back (a batch at a time, so a large store's rows are never all held at once), then
    finished (:func:`finish`). ``partitions``: build the rows that many conversations' parts
    at a time (DuckDB and ClickHouse; default :func:`partitions_for`: one statement up to
    PARTITION_TURNS turns, CLICKHOUSE_PARTITION_TURNS on ClickHouse, partitions of
    PARTITION_SIZE above); rows that run out of DuckDB's
    memory are built again in more partitions (unless not ``retry``: then QueryOutOfMemory is
    raised)."""
    count = partitions_for(reader) if partitions is None else partitions
    while True:
        try:
            frame = _shaped(reader, count)
            break
        except QueryOutOfMemory as exc:
            if not retry or not isinstance(reader, DuckDBReader) or count >= MAX_PARTITIONS:
                raise
            count = min(MAX_PARTITIONS, count * _RETRY_FACTOR)
            logger.warning("the ledger's per-turn rows ran out of DuckDB's memory (%s); "
                           "building them again in %d partitions of the conversations",
                           str(exc).split(" (query ")[0], count)
    return finish(frame, across_conversations=across_conversations)


def _shaped(reader: Reader, count: int) -> pl.DataFrame:
    """The store's per-turn rows, shaped: in ``count`` partitions (DuckDB), else in one."""
    if count > 1 and _stages(reader):
        try:
            return pl.concat(partitioned_turn_rows(reader, count, shape), rechunk=False)
        except NoScratch as exc:
            logger.warning("the ledger cannot stage its span kinds in partitions (%s); building "
                           "it in one statement", exc)
    return pl.concat(reader.map_batches(TURN_QUERY, shape), rechunk=False)



# Where a large store's ledger is written as it is built (:func:`build_table`), swapped in
# for LEDGER_TABLE by :func:`swap_in`.
BUILDING_TABLE = "_kvscope_ledger_building"


def build_table(con: duckdb.DuckDBPyConnection, *, across_conversations: bool = True,
                partitions: int | None = None) -> int | None:
    """Build the ledger of a store too large for one statement into :data:`BUILDING_TABLE`
    of the store (writable ``con``), a partition at a time; return its rows, or None when the
    store is built in one statement (the caller persists :func:`ledger`).

    Nothing of the whole ledger is held: each batch of shaped rows is written as it comes,
    its taint inputs to a scratch database beside DuckDB's temporary files (where the span
    kinds are staged too, compressed); then the taint pass reads those back narrow and marks
    its rows in the table (the same rules as :func:`finish`)."""
    reader = DuckDBReader(con, time_limit_s=None)
    count = partitions_for(reader) if partitions is None else partitions
    if count <= 1:
        return None
    folder = Path(str(con.execute("SELECT current_setting('temp_directory')").fetchall()[0][0])
                  or tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    db = f"kvscope_scratch_{uuid.uuid4().hex[:12]}"
    path = folder / f"{db}.duckdb"
    table, inputs = quote(BUILDING_TABLE), f"{db}._kvscope_taint_inputs"
    con.execute(f"ATTACH '{path}' AS {db}")
    try:
        writer = con.cursor()
        empty = shape(frame_turn_rows({}))  # the shaped columns, typed
        writer.register("_kvscope_empty", empty.to_arrow())
        writer.execute(f"CREATE OR REPLACE TABLE {table} AS SELECT "
                       f"{', '.join(quote(c) for c in LEDGER_SCHEMA)} FROM _kvscope_empty")
        writer.execute(f"CREATE TABLE {inputs} AS SELECT 0::UBIGINT AS _row, "
                       f"{', '.join(quote(c) for c in _TAINT_INPUTS)} FROM _kvscope_empty")
        writer.unregister("_kvscope_empty")
        written = 0

        def put(rows: pl.DataFrame) -> int:
            nonlocal written
            shaped = shape(rows)
            writer.register("_kvscope_shaped", shaped.select(list(LEDGER_SCHEMA)).to_arrow())
            writer.execute(f"INSERT INTO {table} SELECT * FROM _kvscope_shaped")
            writer.register("_kvscope_shaped", shaped.select(_TAINT_INPUTS).with_row_index(
                "_row", written).cast({"_row": pl.UInt64}).to_arrow())
            writer.execute(f"INSERT INTO {inputs} SELECT * FROM _kvscope_shaped")
            writer.unregister("_kvscope_shaped")
            written += shaped.height
            return shaped.height

        try:
            partitioned_turn_rows(reader, count, put, db=db)
        except QueryOutOfMemory as exc:
            if count >= MAX_PARTITIONS:
                raise
            retry = min(MAX_PARTITIONS, count * _RETRY_FACTOR)
            logger.warning("the ledger's per-turn rows ran out of DuckDB's memory (%s); "
                           "building them again in %d partitions of the conversations",
                           str(exc).split(" (query ")[0], retry)
            writer.close()
            con.execute(f"DETACH {db}")
            path.unlink(missing_ok=True)
            return build_table(con, across_conversations=across_conversations,
                               partitions=retry)
        start = time.perf_counter()
        _mark_tainted(writer, table, inputs, across_conversations)
        logger.info("ledger: %d rows written, taint pass in %.1f s", written,
                    time.perf_counter() - start)
        writer.close()
        return written
    finally:
        with contextlib.suppress(duckdb.Error):
            con.execute(f"DETACH {db}")
        for leftover in (path, path.with_name(path.name + ".wal")):
            leftover.unlink(missing_ok=True)


def full_build(con: duckdb.DuckDBPyConnection, *,
               partitions: int | None = None) -> pl.DataFrame | None:
    """The whole ledger of the store on writable ``con``: a frame to persist when one
    statement builds it, else None, written to :data:`BUILDING_TABLE` (:func:`build_table`;
    :func:`swap_in` it), as when the one statement runs out of DuckDB's memory.
    ``partitions``: as :func:`build_table`'s (1: the one statement)."""
    if build_table(con, partitions=partitions) is not None:
        return None
    try:
        return ledger(DuckDBReader(con, time_limit_s=None), retry=False)
    except QueryOutOfMemory as exc:
        logger.warning("the ledger's per-turn rows ran out of DuckDB's memory (%s); "
                       "building them again in %d partitions of the conversations",
                       str(exc).split(" (query ")[0], _RETRY_FACTOR)
    build_table(con, partitions=_RETRY_FACTOR)
    return None


def _mark_tainted(con: duckdb.DuckDBPyConnection, table: str, inputs: str,
                  across_conversations: bool) -> None:
    """:func:`finish`'s taint pass over a written table: its inputs read back from ``inputs``
    (``_row`` is the table's row), the marked rows updated in ``table``."""
    for marked in _taint_passes(DuckDBReader(con, time_limit_s=None), inputs,
                                across_conversations):
        con.register("_kvscope_marked", marked.to_arrow())
        try:
            con.execute(
                f"UPDATE {table} SET invalid_kind = ?, invalid_tokens = m._tokens, "
                "reuse_validity = ?, outcome = m._outcome, evidence = m._evidence "
                f"FROM _kvscope_marked AS m WHERE {table}.rowid = m._row",
                [INVALID_TAINTED, VALIDITY_INVALID])
        finally:
            con.unregister("_kvscope_marked")


def _taint_passes(reader: Reader, inputs: str, across_conversations: bool
                  ) -> Iterator[pl.DataFrame]:
    """:func:`finish`'s taint pass over the taint ``inputs`` of a ledger written a partition at
    a time (a table of :data:`_TAINT_INPUTS` with ``_row``, the ledger's row): the rows each
    group of runs marks (:func:`taint_marks`' frames).

    A group of runs at a time: runs that share no request id (X-Request-Id, decode's request,
    the retention offered) cannot link (a prompt and a conversation are keyed by their run), so
    each group with an invalid load is passed alone, from its own first invalid load on (nothing
    before that can be dirty): exactly what one pass over them all marks, in the memory of the
    largest group."""
    _, found = reader.rows(query.Query(
        f"SELECT DISTINCT coalesce(run_id, '') FROM {inputs} WHERE invalid_kind IS NOT NULL",
        name="ledger taint: runs with an invalid load"))
    for runs in _linked_runs(reader, inputs, {run for (run,) in found}):
        def group(b: query.Binder, runs: set[str] = runs) -> str:
            def among() -> str:
                return f"coalesce(run_id, '') IN ({', '.join(b(run) for run in sorted(runs))})"
            # A DuckDB scan keeps the insertion order (checked below); a ClickHouse one need not.
            ordered = " ORDER BY _row" if b.dialect is query.CLICKHOUSE else ""
            return (f"SELECT * FROM {inputs} WHERE {among()} AND arrival >= "
                    f"(SELECT min(arrival) FROM {inputs} WHERE invalid_kind IS NOT NULL "
                    f"AND {among()}){ordered}")

        rows = reader.frame(query.compose([], group).named("ledger taint inputs"))
        if not rows["_row"].is_sorted():  # never trusted blind
            rows = rows.sort("_row")
        marked = taint_marks(rows.cast({"_row": pl.UInt32}),
                             across_conversations=across_conversations)
        if marked is not None:
            yield marked


def _linked_runs(reader: Reader, inputs: str, dirty: set[str]) -> list[set[str]]:
    """The runs of the taint ``inputs`` (a null run as ``''``) linked to the ``dirty`` ones, in
    groups such that no request id is in two groups: each a dirty run's component, found by
    adding the runs that share an id with the runs added last until none does (each step holds
    the ids of those runs alone, not every run's)."""
    ids = " UNION ALL ".join(f"SELECT coalesce(run_id, '') AS r, {column} AS i FROM {inputs}"
                             for column in ("x_request_id", "decode_request_id", "retention_id"))
    groups: list[set[str]] = []
    for start in sorted(dirty):
        if any(start in group for group in groups):
            continue
        group, added = {start}, {start}
        while added:
            def sharing(b: query.Binder, group: set[str] = group,
                        added: set[str] = added) -> str:
                def among(runs: set[str]) -> str:
                    return ", ".join(b(run) for run in sorted(runs))
                return (f"SELECT DISTINCT r FROM ({ids}) AS e WHERE r NOT IN ({among(group)}) "
                        f"AND i IN (SELECT i FROM ({ids}) AS a WHERE r IN ({among(added)}) "
                        "AND i IS NOT NULL)")
            _, linked = reader.rows(query.compose([], sharing).named("ledger taint: links"))
            added = {run for (run,) in linked} - group
            group |= added
        groups.append(group)
    return groups


def swap_in(con: duckdb.DuckDBPyConnection) -> int:
    """Replace ``kvscope_ledger`` with what :func:`build_table` built (in the caller's
    transaction); return its row count."""
    con.execute(f"DROP TABLE IF EXISTS {quote(LEDGER_TABLE)}")
    con.execute(f"ALTER TABLE {quote(BUILDING_TABLE)} RENAME TO {quote(LEDGER_TABLE)}")
    return int(con.execute(f"SELECT count(*) FROM {quote(LEDGER_TABLE)}").fetchall()[0][0])


def persist(con: duckdb.DuckDBPyConnection, frame: pl.DataFrame) -> int:
    """Replace the derived ``kvscope_ledger`` table with ``frame``; return its row count."""
    arrow = frame.to_arrow()
    con.register("_kvscope_ledger", arrow)
    try:
        con.execute(
            f"CREATE OR REPLACE TABLE {quote(LEDGER_TABLE)} AS SELECT * FROM _kvscope_ledger"
        )
    finally:
        con.unregister("_kvscope_ledger")
    return frame.height


def rebuild(path: str | Path) -> int:
    """Rebuild the store's ``kvscope_ledger`` table from its raw spans; return its row count.

    Idempotent: the table is replaced whole in one transaction. Opens the file for writing, so a
    store another process is writing is refused (ask that process instead).
    """
    con = open_store(path, memory_limit=settings.resolve("store_memory_limit") or None)
    try:
        # The writer's own connection, through a reader's seam for its errors; no time limit,
        # as rebuilding may take a while. A large store's is written as it is built.
        frame = full_build(con)
        con.execute("BEGIN TRANSACTION")
        try:
            rows = swap_in(con) if frame is None else persist(con, frame)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        return rows
    finally:
        con.close()


# The ledger's table on ClickHouse has this column first: each row's place in the ledger's
# order, the table's sort key (columns read apart line up by it: a ClickHouse scan's order is
# not the table's).
ROW = "_row"
# What a tainted turn's row says in place of its own (the marks' columns, or a bound value).
_MARKED = {"invalid_kind": "$kind", "invalid_tokens": "m._tokens", "reuse_validity": "$validity",
           "outcome": "m._outcome", "evidence": "m._evidence"}


def build_clickhouse_table(reader: ClickHouseReader, count: int, *, comment: str = "",
                           across_conversations: bool = True) -> int:
    """:func:`build_table` on ClickHouse, in ``count`` partitions: ``kvscope_ledger`` replaced;
    return its rows; :class:`NoScratch` when ClickHouse refuses the scratch database (nothing
    written: build it in one statement instead). In a scratch database:
    the span kinds staged, each partition's shaped rows inserted as they come (numbered
    ``_row`` in the ledger's order) with their taint inputs beside them; the taint pass reads
    those back narrow (:func:`_taint_passes`) and writes its marks there; the ledger is then
    written from them on the server (the marked rows' values in place of theirs) and swapped
    in for ``kvscope_ledger`` (with ``comment``). Nothing of the whole ledger comes to this
    process."""
    empty = shape(frame_turn_rows({}))  # the shaped columns, typed
    written = 0

    def create(db: str, table: str, columns: Sequence[str]) -> None:
        from kvscope.store.clickhouse import clickhouse_type

        typed = ", ".join(f"{quote(c)} {clickhouse_type(empty.schema[c])}" for c in columns)
        reader.execute(query.Query(
            f"CREATE TABLE {db}.{quote(table)} (_row UInt64, {typed}) "
            "ENGINE = MergeTree ORDER BY _row", name="ledger table"))

    def numbered(frame: pl.DataFrame) -> pl.DataFrame:
        return frame.with_row_index("_row", written).cast({"_row": pl.UInt64})

    with _clickhouse_scratch(reader) as db:
        create(db, "_kvscope_rows", list(LEDGER_SCHEMA))
        create(db, "_kvscope_taint_inputs", _TAINT_INPUTS)

        def put(rows: pl.DataFrame) -> int:
            nonlocal written
            shaped = shape(rows)
            reader.insert("_kvscope_rows", numbered(shaped.select(list(LEDGER_SCHEMA))), db)
            reader.insert("_kvscope_taint_inputs", numbered(shaped.select(_TAINT_INPUTS)), db)
            written += shaped.height
            return shaped.height

        _each_partition(reader, count, db, _CLICKHOUSE_SIZE, put)
        start = time.perf_counter()
        marks = [m.cast({"_row": pl.UInt64}) for m in _taint_passes(
            reader, f"{db}._kvscope_taint_inputs", across_conversations)]
        logger.info("ledger: %d rows written, taint pass in %.1f s", written,
                    time.perf_counter() - start)
        rows = f"{db}._kvscope_rows AS r"
        if marks:
            reader.execute(query.Query(
                f"CREATE TABLE {db}._kvscope_marks (_row UInt64, _tokens Nullable(Int64), "
                "_outcome Nullable(String), _evidence Nullable(String)) "
                "ENGINE = MergeTree ORDER BY _row", name="ledger table"))
            reader.insert("_kvscope_marks", pl.concat(marks).select(
                "_row", "_tokens", "_outcome", "_evidence"), db)
            rows += f" LEFT JOIN {db}._kvscope_marks AS m ON m._row = r._row"
        listed = ", ".join(
            f"if(m._row IS NULL, r.{quote(c)}, {_MARKED[c]}) AS {quote(c)}"
            if marks and c in _MARKED else f"r.{quote(c)} AS {quote(c)}" for c in LEDGER_SCHEMA)
        start = time.perf_counter()
        reader.write_table_as(LEDGER_TABLE, {ROW: pl.UInt64(), **LEDGER_SCHEMA}, query.Query(
            f"SELECT r._row AS {ROW}, {listed} FROM {rows} SETTINGS join_use_nulls = 1",
            {"kind": INVALID_TAINTED, "validity": VALIDITY_INVALID} if marks else {},
            name="ledger table"), order_by=(ROW,), comment=comment)
        logger.info("ledger: table written in %.1f s", time.perf_counter() - start)
    return written


def runs(frame: pl.DataFrame) -> Sequence[str]:
    """Run ids present in a ledger, in first-arrival order."""
    return (
        frame.group_by("run_id").agg(pl.col("arrival").min()).sort("arrival")["run_id"].to_list()
    )


__all__ = ["BUILDING_TABLE", "CLICKHOUSE_PARTITION_TURNS", "ENGINE_EVIDENCE_HOOKS",
    "ENGINE_EVIDENCE_LOG", "HISTORY_CONTINUES", "HISTORY_EDITED", "HISTORY_FIRST",
    "HISTORY_UNKNOWN", "LEDGER_SCHEMA", "LEDGER_TABLE", "MAX_PARTITIONS", "NoScratch",
    "PARTITION_SIZE", "PARTITION_TURNS", "QUERIES", "ROW", "SMALL_FRAME_ROWS", "SORT_TURNS",
    "TURN_QUERY",
    "VALIDITY_INVALID", "VALIDITY_NOT_VERIFIED", "VALIDITY_VALID", "build",
    "build_clickhouse_table", "build_table", "finish", "frame_turn_rows", "full_build",
    "hook_decided", "ledger", "load_spans", "partitioned_turn_rows", "partitions_for", "persist",
    "rebuild", "request_key", "runs", "shape", "swap_in", "taint_marks", "turn_rows"]
