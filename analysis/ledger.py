"""The per-turn reuse ledger: one typed row per (run, conversation, turn), rebuilt from raw spans.

Three steps, kept apart (STYLE §8): :func:`load_spans` runs the SQL (portable to the
OpenTelemetry Collector's ClickHouse tables: only map look-ups and plain filters), :func:`build`
shapes the frames into the ledger (pure polars), and :func:`persist` writes the typed derived
table ``kvscope_ledger`` (collectors never write it).

Joins (DESIGN §3): legs and tool waits hang off their ``kvscope.turn`` span (same trace, parent
span id); engine spans join on the vLLM request id reduced to the proxy's X-Request-Id (vLLM
prefixes ``chatcmpl-``/``cmpl-`` and appends ``-`` + 8 random characters unless
``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1``); turn k's previous turn is turn k-1 of the same
conversation in the same run.

Definitions (DESIGN §5, with the refinements written in docs/architecture.md):

* ``reusable_tokens`` — tokens of turn k's prompt whose KV earlier turns computed. When the
  message-boundary hashes show turn k extends turn k-1 (continuation), it is
  ``min(prompt_{k-1} + output_{k-1} - 1, prompt_k)``: decode never computes its last output
  token, so that token's KV exists nowhere. Without hashes, D's offer (``remote_num_tokens``)
  stands in. When the hashes show edited history the count is not measurable without a
  tokenizer: null, and the outcome is ``prefix_diverged``.
* ``local_hit_tokens`` / ``remote_reused_tokens`` / ``recomputed_reusable_tokens`` from P's
  reuse decision and the D→P transfer (a read that moved bytes and finished ``ok``).
* ``outcome`` — one label from :data:`kvscope.reuse.outcomes.OUTCOMES`, decided in the order
  of :mod:`kvscope.reuse.outcomes`, with ``evidence`` saying what decided it and which
  evidence was missing when it is ``unknown``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import polars as pl

from kvscope import semconv
from kvscope.reuse import outcomes
from kvscope.reuse.router import GUARD_EDITED
from kvscope.reuse.validity import (
    INVALID_AFTER_RELEASE,
    INVALID_BEYOND_PREFIX,
    INVALID_EDITED,
)
from kvscope.store import query
from kvscope.store.database import open_store
from kvscope.store.query import resource_attr, span_attr
from kvscope.store.reader import StoreReader
from kvscope.store.schema import quote

if TYPE_CHECKING:
    from kvscope.store.clickhouse import ClickHouseSource

LEDGER_TABLE = "kvscope_ledger"

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
}

# engine_evidence: kvscope's engine hooks, or lines of a server's log (kvscope ingest).
ENGINE_EVIDENCE_HOOKS = "hooks"
ENGINE_EVIDENCE_LOG = "server_log"

# Whether the KV a turn loaded from decode belongs to its prompt (kvscope.reuse.validity).
VALIDITY_VALID = "valid"
VALIDITY_INVALID = "invalid"
VALIDITY_NOT_VERIFIED = "not_verified"  # loaded KV, but no boundary hashes to check it against

# History relation of turn k to turn k-1, from message-boundary hashes.
HISTORY_FIRST = "first"
HISTORY_CONTINUES = "continues"
HISTORY_EDITED = "edited"
HISTORY_UNKNOWN = "unknown"


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
    "error_kind": span_attr(semconv.ERROR_KIND),
    "observer": span_attr(semconv.TURN_OBSERVER),
    "duration_measured": span_attr(semconv.DURATION_MEASURED),
}
_PREFILL_COLUMNS: _Columns = {
    "trace_id": "TraceId",
    "parent_span_id": "ParentSpanId",
    "prefill_ns": "Duration",
    "prefill_request_id": span_attr(semconv.VLLM_REQUEST_ID),
    "d_metadata_attached": span_attr(semconv.D_METADATA_ATTACHED),
    "offered_tokens_proxy": span_attr(semconv.REMOTE_OFFERED_TOKENS),
    "retention_id": span_attr(semconv.OFFERED_REQUEST_ID),
}
_DECODE_COLUMNS: _Columns = {
    "trace_id": "TraceId",
    "parent_span_id": "ParentSpanId",
    "decode_ns": "Duration",
    "decode_request_id": span_attr(semconv.VLLM_REQUEST_ID),
    "metadata_returned": span_attr(semconv.RETENTION_METADATA_RETURNED),
    "decode_measured": span_attr(semconv.DURATION_MEASURED),
}
_WAIT_COLUMNS: _Columns = {
    "trace_id": "TraceId",
    "parent_span_id": "ParentSpanId",
    "tool_wait_ns": "Duration",
}
_DECISION_COLUMNS: _Columns = {
    "request_id": span_attr(semconv.VLLM_REQUEST_ID),
    "engine": span_attr(semconv.ENGINE_ID),
    "time": "Timestamp",
    "decision": span_attr(semconv.DECISION),
    "local_hit": span_attr(semconv.LOCAL_HIT_TOKENS),
    "offered": span_attr(semconv.REMOTE_OFFERED_TOKENS),
    "to_pull": span_attr(semconv.TOKENS_TO_PULL),
    "threshold": span_attr(semconv.THRESHOLD_TOKENS),
    "bidir": span_attr(semconv.BIDIR_ENABLED),
    "remote_count": span_attr(semconv.REMOTE_COUNT_TOKENS),
    "decision_measured": span_attr(semconv.DURATION_MEASURED),
}
_VLLM_REQUEST_COLUMNS: _Columns = {
    "request_id": span_attr(semconv.VLLM_REQUEST_ID),
    "start": "Timestamp",
    "ttft_s": span_attr(semconv.VLLM_TIME_TO_FIRST_TOKEN),
    "queue_s": span_attr(semconv.VLLM_TIME_IN_QUEUE),
}
_TRANSFER_COLUMNS: _Columns = {
    "request_id": span_attr(semconv.VLLM_REQUEST_ID),
    "engine": span_attr(semconv.ENGINE_ID),
    "direction": span_attr(semconv.TRANSFER_DIRECTION),
    "status": span_attr(semconv.TRANSFER_STATUS),
    "size_bytes": span_attr(semconv.TRANSFER_BYTES),
    "start": "Timestamp",
    "duration_ns": "Duration",
    "request_outcome": span_attr(semconv.REQUEST_OUTCOME),
    "duration_measured": span_attr(semconv.DURATION_MEASURED),
}
_RETENTION_COLUMNS: _Columns = {
    "request_id": span_attr(semconv.VLLM_REQUEST_ID),
    "engine": span_attr(semconv.ENGINE_ID),
    "start": "Timestamp",
    "duration_ns": "Duration",
    "size_bytes": span_attr(semconv.RETENTION_BYTES),
    "reason": span_attr(semconv.RETENTION_RELEASE_REASON),
    "tokens": span_attr(semconv.REMOTE_NUM_TOKENS),
}

QUERIES: dict[str, query.Query] = {
    "turns": query.spans(semconv.SPAN_TURN, _TURN_COLUMNS),
    "prefill": query.spans(semconv.SPAN_INPUT_PROCESSING, _PREFILL_COLUMNS),
    "decode": query.spans(semconv.SPAN_GENERATION, _DECODE_COLUMNS),
    "waits": query.spans(semconv.SPAN_TOOL_WAIT, _WAIT_COLUMNS),
    "decisions": query.spans(semconv.SPAN_REUSE_DECISION, _DECISION_COLUMNS),
    "transfers": query.spans(semconv.SPAN_KV_TRANSFER, _TRANSFER_COLUMNS),
    "retentions": query.spans(semconv.SPAN_KV_RETENTION, _RETENTION_COLUMNS),
    "vllm_requests": query.spans(semconv.SPAN_VLLM_REQUEST, _VLLM_REQUEST_COLUMNS),
}


def load_spans(reader: StoreReader | duckdb.DuckDBPyConnection) -> dict[str, pl.DataFrame]:
    """Run the extraction queries; one frame of string-typed attributes per span kind.

    On either engine: the reader renders each query in its dialect (DuckDB or ClickHouse).
    """
    # A bare connection (the store's own writer, rebuilding) still goes through the reader's
    # seam for its error translation; it has no time limit, as rebuilding may take a while.
    seam = reader if isinstance(reader, StoreReader) else StoreReader(reader, time_limit_s=None)
    return {name: seam.frame(sql) for name, sql in QUERIES.items()}


# --- shaping ----------------------------------------------------------------------------------

_ID_PREFIX = r"^(chatcmpl-|cmpl-)"
_ID_SUFFIX = r"-[0-9A-Za-z]{8}$"


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


def _continues(prev: pl.Expr, cur: pl.Expr, prev_count: pl.Expr, cur_count: pl.Expr,
               roles: pl.Expr) -> pl.Expr:
    """Whether turn k's prompt is turn k-1's messages, then the assistant's reply, then more.

    Boundary hashes are chained (hash i names messages 0..i), so k keeps k-1's messages exactly
    when k-1's last hash is among k's; the message right after them must be the assistant's
    reply (role ``a``) — a reset keeps the first messages too, then adds a summary instead. The
    proxy keeps only the last few hashes and roles per turn; if k added more messages than
    that, the relation is not decidable (see the caller). When roles were not recorded the
    message after k-1's is not checked.
    """
    last = prev.str.split(",").list.last()
    haystack = pl.lit(",") + cur + pl.lit(",")
    found = haystack.str.find(pl.lit(",") + last + pl.lit(","), literal=True)
    # Index of k-1's last message within k's kept list = commas before where it was found.
    index = haystack.str.slice(0, found).str.count_matches(",")
    reply_role = roles.str.slice(index + 1, 1)
    return (
        found.is_not_null() & (cur_count > prev_count)
        & (roles.is_null() | (reply_role == "a"))
    )


def build(frames: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """Shape extracted span frames into the ledger (pure: no I/O).

    One lazy query, collected once, so polars drops unused columns early (1M turns: 4.5 GiB peak
    instead of 5.1). The in-memory engine: for these joins and sorts polars' streaming engine
    measured 25 % slower here.
    """
    return _build({name: frame.lazy() for name, frame in frames.items()}).collect(
        engine="in-memory")


def _build(frames: dict[str, pl.LazyFrame]) -> pl.LazyFrame:
    turns = frames["turns"]
    if "observer" not in turns.collect_schema().names():
        # Turn frames made without the column (callers shaping frames themselves): every turn
        # is then the proxy's.
        turns = turns.with_columns(pl.lit(None, pl.String).alias("observer"))
    if "hash_key_id" not in turns.collect_schema().names():
        # Likewise: hashes without a key id (stores from before keyed hashes) compare as before.
        turns = turns.with_columns(pl.lit(None, pl.String).alias("hash_key_id"))
    turns = turns.with_columns(
        _int("turn_index"), _int("prompt_tokens"), _int("output_tokens"), _float("ttft_ms"),
        _int("messages"),
        pl.col("boundary_hashes").str.count_matches(",").add(1).alias("hashes_kept"),
        _float("router_entry_age_s"),
        (pl.col("arrival") + pl.duration(nanoseconds=pl.col("duration_ns"))).alias("end"),
        (pl.col("duration_ns").cast(pl.Float64) / 1e6).alias("turn_ms"),
    )
    if "duration_measured" in turns.collect_schema().names():
        # An ingested log that gave a turn's start only: its end and time are not measured.
        unmeasured = pl.col("duration_measured") == "false"
        turns = turns.with_columns(
            pl.when(unmeasured).then(None).otherwise(pl.col(name)).alias(name)
            for name in ("end", "turn_ms"))
    prefill = frames["prefill"].rename({"parent_span_id": "span_id"}).with_columns(
        (pl.col("prefill_ns").cast(pl.Float64) / 1e6).alias("prefill_ms"),
        _bool("d_metadata_attached"), _int("offered_tokens_proxy"),
    ).drop("prefill_ns").unique(["trace_id", "span_id"], keep="first")
    decode = frames["decode"].rename({"parent_span_id": "span_id"})
    decode_measured = (pl.col("decode_measured") != "false").fill_null(True) if (
        "decode_measured" in decode.collect_schema().names()) else pl.lit(True)
    decode = decode.with_columns(
        pl.when(decode_measured).then(pl.col("decode_ns").cast(pl.Float64) / 1e6)
        .alias("decode_ms"),
        _bool("metadata_returned"),
    ).drop("decode_ns").unique(["trace_id", "span_id"], keep="first")
    waits = frames["waits"].rename({"parent_span_id": "span_id"}).with_columns(
        (pl.col("tool_wait_ns").cast(pl.Float64) / 1e9).alias("tool_wait_s"),
    ).drop("tool_wait_ns").unique(["trace_id", "span_id"], keep="first")

    ledger = (
        turns.join(prefill, on=["trace_id", "span_id"], how="left")
        .join(decode, on=["trace_id", "span_id"], how="left")
        .join(waits, on=["trace_id", "span_id"], how="left")
    )

    # Engine evidence, keyed by X-Request-Id.
    decisions = frames["decisions"].with_columns(
        request_key("request_id").alias("x_request_id"),
        _int("local_hit"), _int("offered"), _int("to_pull"), _int("threshold"), _bool("bidir"),
        *([_int("remote_count")] if "remote_count" in frames["decisions"].collect_schema().names()
          else [pl.lit(None, pl.Int64).alias("remote_count")]),
        # A decision an ingested server log implies has no measured time; the hooks' do.
        ((pl.col("decision_measured") != "false").fill_null(True)
         if "decision_measured" in frames["decisions"].collect_schema().names()
         else pl.lit(True)).alias("from_hooks"),
    ).sort("time")
    first_decisions = decisions.group_by("x_request_id", maintain_order=True).agg(
        pl.col("decision").first(), pl.col("local_hit").first().alias("decision_local_hit"),
        pl.col("offered").first().alias("offered_tokens"),
        pl.col("to_pull").first().alias("to_pull_tokens"),
        pl.col("threshold").first().alias("threshold_tokens"),
        pl.col("bidir").first().alias("prefill_bidirectional"),
        pl.col("engine").first().alias("prefill_engine"),
        pl.len().alias("decisions"),
        pl.col("local_hit").last().alias("final_local_hit"),
        pl.col("decision").last().alias("last_decision"),
        pl.col("remote_count").first().alias("decision_remote_count"),
        pl.col("from_hooks").any().alias("_from_hooks"),
    )
    transfer_measured = (pl.col("duration_measured") != "false").fill_null(True) if (
        "duration_measured" in frames["transfers"].collect_schema().names()) else pl.lit(True)
    transfers = frames["transfers"].with_columns(
        request_key("request_id").alias("x_request_id"), _int("size_bytes"),
        # A read an ingested log only names has no measured time: null, never 0.
        pl.when(transfer_measured).then(pl.col("duration_ns").cast(pl.Float64) / 1e6)
        .alias("ms"),
    )
    # vLLM can report one failed read twice: the worker's span with the exact status
    # (declined_expired, handshake_failed, ...) and the scheduler's with the request's outcome.
    # Keep the most specific status: ok first, then anything but the generic "failed".
    specificity = (
        pl.when(pl.col("status") == semconv.TRANSFER_OK).then(0)
        .when(pl.col("status") == semconv.TRANSFER_FAILED).then(2)
        .otherwise(1)
    )
    d2p = transfers.filter(pl.col("direction") == semconv.DIRECTION_D_TO_P).with_columns(
        specificity.alias("_specificity")
    ).sort(["_specificity", "start"]).group_by("x_request_id", maintain_order=True).agg(
        pl.col("status").first().alias("d2p_status"),
        pl.col("size_bytes").max().alias("d2p_bytes"),
        pl.col("ms").max().alias("d2p_ms"),
        pl.col("start").min().alias("d2p_start"),
        (pl.col("request_outcome") == semconv.OUTCOME_ERROR).any().alias("load_errored"),
    )
    p2d = transfers.filter(pl.col("direction") == semconv.DIRECTION_P_TO_D).group_by(
        "x_request_id", maintain_order=True
    ).agg(
        pl.col("size_bytes").sum().alias("p2d_bytes"),
        pl.col("ms").sum().alias("p2d_ms"),
        pl.col("engine").first().alias("decode_engine"),
    )
    retentions = frames["retentions"].with_columns(
        _int("size_bytes"), _int("tokens"),
        (pl.col("start") + pl.duration(nanoseconds=pl.col("duration_ns"))).alias("released_at"),
        (pl.col("duration_ns").cast(pl.Float64) / 1e9).alias("held_s"),
    )
    # The handle turn k was offered is turn k-1's decode retention (by its vLLM request id).
    offered = retentions.select(
        pl.col("request_id").alias("retention_id"),
        pl.col("size_bytes").alias("retention_bytes"),
        pl.col("held_s").alias("retention_held_s"),
        pl.col("reason").alias("retention_release"),
        pl.col("released_at").alias("retention_released_at"),
    ).unique("retention_id", keep="first")
    # What decode holds KV for after this turn (remote_num_tokens of its own retention).
    held = retentions.select(
        pl.col("request_id").alias("decode_request_id"), pl.col("tokens").alias("held_tokens"),
    ).unique("decode_request_id", keep="first")

    ledger = (
        ledger.join(first_decisions, on="x_request_id", how="left")
        .join(_vllm_requests(frames), on="x_request_id", how="left")
        .join(d2p, on="x_request_id", how="left")
        .join(p2d, on="x_request_id", how="left")
        .join(offered, on="retention_id", how="left")
        .join(held, on="decode_request_id", how="left")
    )

    # Previous turn of the same conversation in the same run.
    # Sorted by conversation, the previous row is the previous turn when it belongs to the same
    # run and conversation: a plain shift, much cheaper than a window per conversation.
    same = (pl.col("run_id") == pl.col("run_id").shift(1)) & (
        pl.col("conversation_id") == pl.col("conversation_id").shift(1))

    def previous(column: str) -> pl.Expr:
        return pl.when(same).then(pl.col(column).shift(1))

    ledger = ledger.sort(["run_id", "conversation_id", "turn_index", "arrival"]).with_columns(
        previous("prompt_tokens").alias("prev_prompt"),
        previous("output_tokens").alias("prev_output"),
        previous("boundary_hashes").alias("prev_hashes"),
        previous("hash_key_id").alias("prev_hash_key_id"),
        previous("messages").alias("prev_messages"),
        previous("metadata_returned").alias("prev_returned"),
        previous("turn_index").alias("prev_index"),
        previous("held_tokens").alias("prev_held"),
    )
    has_prev = pl.col("prev_index").is_not_null() & (
        pl.col("prev_index") == pl.col("turn_index") - 1
    ) & pl.col("conversation_id").is_not_null()
    history = (
        pl.when(pl.col("turn_index") <= 1).then(pl.lit(HISTORY_FIRST))
        .when(~has_prev).then(pl.lit(HISTORY_UNKNOWN))
        .when(pl.col("boundary_hashes").is_null() | pl.col("prev_hashes").is_null()
              | (pl.col("boundary_hashes") == "") | (pl.col("prev_hashes") == ""))
        .then(pl.lit(HISTORY_UNKNOWN))
        # Hashes made with different keys (a proxy restarted with a new key, two proxies with
        # keys of their own) never match: not comparable, so never an edit.
        .when(~pl.col("hash_key_id").eq_missing(pl.col("prev_hash_key_id")))
        .then(pl.lit(HISTORY_UNKNOWN))
        # A completions prompt is one message whose text grows turn by turn: one hash each
        # cannot show a continuation (nor an edit).
        .when((pl.col("messages") <= 1) & (pl.col("prev_messages") <= 1))
        .then(pl.lit(HISTORY_UNKNOWN))
        .when(_continues(pl.col("prev_hashes"), pl.col("boundary_hashes"),
                         pl.col("prev_messages"), pl.col("messages"), pl.col("roles")))
        .then(pl.lit(HISTORY_CONTINUES))
        .when(pl.col("messages") - pl.col("prev_messages") >= pl.col("hashes_kept"))
        .then(pl.lit(HISTORY_UNKNOWN))
        .otherwise(pl.lit(HISTORY_EDITED))
    )
    ledger = ledger.with_columns(history.alias("history"))
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
    ledger = ledger.with_columns(
        reusable.clip(lower_bound=0).alias("reusable_tokens"),
        errored.alias("errored"),
        offered_tokens.alias("offered_tokens"),
    )
    # P's evidence: the final schedule's local hit (after a preemption or recompute it is what
    # the request ran with); a read counts when it moved bytes and finished ok.
    read_ok = (pl.col("d2p_status") == semconv.TRANSFER_OK) & (
        pl.col("d2p_bytes").fill_null(0) > 0)
    # Decode's reaper released the handle before the READ finished (D frees blocks on the
    # READ's notification, so a release by the reaper before then left the READ reading freed
    # blocks: P reports success, D logs "Potentially invalid KV blocks").
    read_end = pl.col("d2p_start") + pl.duration(microseconds=(pl.col("d2p_ms") * 1000).cast(
        pl.Int64))
    stale = read_ok & (pl.col("retention_release") == semconv.RELEASE_EXPIRED) & (
        pl.col("retention_released_at") <= read_end)
    preempted = read_ok & (pl.col("decisions").fill_null(0) > 1)
    reusable_col = pl.col("reusable_tokens")
    local = pl.when(pl.col("errored")).then(pl.lit(0, pl.Int64)).otherwise(
        pl.min_horizontal(pl.col("final_local_hit"), reusable_col))
    reach = pl.col("decision_local_hit") + pl.col("to_pull_tokens")
    remote = (
        pl.when(pl.col("errored") | ~read_ok.fill_null(False) | stale.fill_null(False)
                | preempted.fill_null(False))
        .then(pl.lit(0, pl.Int64))
        # min_horizontal skips nulls: an unmeasured reusable span leaves remote unmeasured.
        .when(reusable_col.is_null()).then(pl.lit(None, pl.Int64))
        .otherwise((pl.min_horizontal(reach, reusable_col) - local).clip(lower_bound=0))
    )
    ledger = ledger.with_columns(
        local.alias("local_hit_tokens"),
        stale.fill_null(False).alias("_stale"),
        preempted.fill_null(False).alias("_preempted"),
        read_ok.fill_null(False).alias("_read_ok"),
    ).with_columns(remote.alias("remote_reused_tokens")).with_columns(
        (reusable_col - pl.col("local_hit_tokens").fill_null(0)
         - pl.col("remote_reused_tokens").fill_null(0)).alias("recomputed_reusable_tokens"),
    )
    ledger = _validity(ledger)
    ledger = _label(ledger)
    ledger = ledger.with_columns(
        pl.when(pl.col("_from_hooks")).then(pl.lit(ENGINE_EVIDENCE_HOOKS))
        .when(pl.col("decision").is_not_null()).then(pl.lit(ENGINE_EVIDENCE_LOG))
        .otherwise(pl.lit(None, pl.String)).alias("engine_evidence"))
    ledger = ledger.with_columns(
        (pl.col("arrival")).alias("arrival"),
        pl.col("tool_wait_s"),
    )
    return ledger.select(
        [pl.col(name).cast(dtype) for name, dtype in LEDGER_SCHEMA.items()]
    ).sort(["run_id", "conversation_id", "turn_index", "arrival"])


def _vllm_requests(frames: dict[str, pl.LazyFrame]) -> pl.LazyFrame:
    """Per X-Request-Id, what vLLM's own llm_request spans measured (one per engine leg).

    The span starts at the engine's arrival (output_processor.py:951, 997); its first token is
    ``time_to_first_token`` later. On a P/D turn the legs are prefill then decode: engine TTFT
    is the first leg's arrival to the last leg's first token (the proxy's hop between them
    included; on two hosts, their clocks' offset too), queueing the sum of the legs' queues.
    """
    schema = {"x_request_id": pl.String(), "engine_ttft_ms": pl.Float64(),
              "engine_queue_ms": pl.Float64()}
    requests = frames.get("vllm_requests")
    if requests is None or "request_id" not in requests.collect_schema().names():
        return pl.LazyFrame(schema=schema)  # frames shaped by a caller without vLLM's spans
    requests = requests.with_columns(
        request_key("request_id").alias("x_request_id"), _float("ttft_s"), _float("queue_s"),
    ).with_columns(
        (pl.col("start") + pl.duration(microseconds=(pl.col("ttft_s") * 1e6).cast(pl.Int64)))
        .alias("first_token"),
    )
    return requests.sort("start").group_by("x_request_id").agg(
        ((pl.col("first_token").last() - pl.col("start").first()).dt.total_microseconds()
         / 1000).alias("engine_ttft_ms"),
        # Σ of the measured legs; null when no leg reported its queue.
        pl.when(pl.col("queue_s").is_not_null().any())
        .then(pl.col("queue_s").sum() * 1000).alias("engine_queue_ms"),
    ).select(list(schema))


def _validity(ledger: pl.LazyFrame) -> pl.LazyFrame:
    """Whether the KV each turn loaded from decode belongs to its prompt (spans alone).

    Invalid when the read came after decode released the blocks (TTL reaper), when the
    history was edited since the previous turn (message-boundary hashes), or when a continuing
    history's read reached past what the prompt shares with decode's sequence (positions up to
    prefill's own hit are its own: :func:`kvscope.reuse.validity.invalid_tokens`'s rule).
    Without hashes a read is ``not_verified``: a decode sequence longer than the prompt is
    misaligned only when it needs more blocks than the read fills (``validity.loaded_span``),
    and the block size is not on the spans. ``invalid_tokens`` is null where the count is not
    measurable from counts alone (an edited history).
    """
    c = pl.col
    loaded = c("_read_ok") & (c("to_pull_tokens").fill_null(0) > 0) & ~c("errored")
    reach = c("decision_local_hit").fill_null(0) + c("to_pull_tokens").fill_null(0)
    history = c("history")
    valid_end = pl.max_horizontal(c("reusable_tokens"), c("decision_local_hit").fill_null(0))
    kind = (
        pl.when(~loaded).then(pl.lit(None, pl.String))
        .when(c("_stale")).then(pl.lit(INVALID_AFTER_RELEASE))
        .when(history == HISTORY_EDITED).then(pl.lit(INVALID_EDITED))
        .when((history == HISTORY_CONTINUES) & (reach > valid_end))
        .then(pl.lit(INVALID_BEYOND_PREFIX))
    )
    count = (
        pl.when(c("_invalid_kind") == INVALID_AFTER_RELEASE).then(c("to_pull_tokens"))
        .when(c("_invalid_kind") == INVALID_BEYOND_PREFIX).then(reach - valid_end)
        .when(c("_invalid_kind").is_null() & loaded & (history == HISTORY_CONTINUES))
        .then(pl.lit(0, pl.Int64))
    )
    validity = (
        pl.when(~loaded).then(pl.lit(None, pl.String))
        .when(c("_invalid_kind").is_not_null()).then(pl.lit(VALIDITY_INVALID))
        .when(history == HISTORY_CONTINUES).then(pl.lit(VALIDITY_VALID))
        .otherwise(pl.lit(VALIDITY_NOT_VERIFIED))
    )
    return ledger.with_columns(kind.alias("_invalid_kind")).with_columns(
        count.alias("invalid_tokens"), validity.alias("reuse_validity"))


def _label(ledger: pl.LazyFrame) -> pl.LazyFrame:
    """Decide each turn's outcome and its evidence, in the order of :mod:`outcomes`."""
    c = pl.col
    reusable, local, remote = c("reusable_tokens"), c("local_hit_tokens"), c("remote_reused_tokens")
    offered = c("offered_tokens")
    target = pl.when(offered.fill_null(0) > 0).then(
        pl.min_horizontal(reusable, pl.max_horizontal(offered, local))).otherwise(reusable)
    done = local.fill_null(0) + remote.fill_null(0)
    engine_seen = c("decision").is_not_null()
    lookup = c("router_lookup")
    status = c("d2p_status")
    kind = c("_invalid_kind")
    rules: list[tuple[pl.Expr, str, pl.Expr]] = [
        # Without a conversation id no turn can be linked to another, the first included.
        (lookup == semconv.ROUTER_NO_CONVERSATION_ID, outcomes.NO_CONVERSATION_ID,
         pl.lit(outcomes.EVIDENCE_NO_CONVERSATION_ID)),
        (c("turn_index") <= 1, outcomes.FIRST_TURN, pl.lit(outcomes.EVIDENCE_FIRST_TURN)),
        # A client's own record (kvscope ingest) with no proxy or engine span joined to it:
        # nothing says whether or why the turn reused, so no miss cause is claimed.
        ((c("observer") == semconv.OBSERVER_CLIENT) & lookup.is_null() & ~engine_seen,
         outcomes.UNKNOWN, pl.lit(outcomes.EVIDENCE_CLIENT_ONLY)),
        (kind == INVALID_AFTER_RELEASE, outcomes.REUSED_INVALID,
         pl.format(outcomes.EVIDENCE_INVALID[INVALID_AFTER_RELEASE], c("to_pull_tokens"))),
        (kind == INVALID_EDITED, outcomes.REUSED_INVALID,
         pl.format(outcomes.EVIDENCE_INVALID[INVALID_EDITED], c("to_pull_tokens"))),
        (kind == INVALID_BEYOND_PREFIX, outcomes.REUSED_INVALID,
         pl.format(outcomes.EVIDENCE_INVALID[INVALID_BEYOND_PREFIX], c("to_pull_tokens"),
                   c("invalid_tokens"), reusable)),
        (c("history") == HISTORY_EDITED, outcomes.PREFIX_DIVERGED,
         pl.when(c("reuse_guard") == GUARD_EDITED)
         .then(pl.lit(outcomes.EVIDENCE_EDITED + "; the proxy's reuse guard sent MISS params"))
         .otherwise(pl.lit(outcomes.EVIDENCE_EDITED + " (message-boundary hashes)"))),
        (engine_seen & (done >= target) & (done > 0) & (remote > 0), outcomes.REUSED_REMOTE,
         pl.format(outcomes.EVIDENCE_REUSED_REMOTE, remote, local)),
        (engine_seen & (done >= target) & (done > 0), outcomes.REUSED_LOCAL,
         pl.format(outcomes.EVIDENCE_REUSED_LOCAL, local)),
        # The previous turn gave the router nothing to keep: decode returned no params, or the
        # turn never reached decode (it failed first). A lookup then finds no entry ("miss",
        # or "consumed" when the previous turn's own lookup took the last one).
        # Only where the proxy saw the previous turn: for a client's record, a missing decode
        # leg is evidence not collected, not a turn that never reached decode (a proxy log
        # joined to it says whether decode returned params: prev_returned is then set).
        (c("prev_index").is_not_null() & ~c("prev_returned").fill_null(False)
         & (c("observer").is_null() | c("prev_returned").is_not_null()),
         outcomes.NO_DECODE_METADATA,
         pl.when(c("prev_returned").is_null())
         .then(pl.lit("previous turn never reached decode"))
         .otherwise(pl.lit(outcomes.EVIDENCE_NO_DECODE_METADATA))),
        (lookup == semconv.ROUTER_MISS, outcomes.ROUTER_NO_ENTRY, pl.lit("router lookup miss")),
        (lookup == semconv.ROUTER_STALE, outcomes.ROUTER_TTL_EXPIRED,
         pl.format("router entry {} s old", c("router_entry_age_s").round(1))),
        (lookup == semconv.ROUTER_CONSUMED, outcomes.HANDLE_CONSUMED,
         pl.lit("router entry already taken by an overlapping turn")),
        (~engine_seen, outcomes.UNKNOWN,
         pl.lit("no engine hooks: prefill's reuse decision not observed")),
        (c("decision") == semconv.DECISION_INVALID_PARAMS, outcomes.INVALID_PARAMS,
         pl.lit(outcomes.EVIDENCE_INVALID_PARAMS)),
        (c("decision") == semconv.DECISION_NO_OFFER, outcomes.ROUTER_NO_ENTRY,
         pl.lit(outcomes.EVIDENCE_NO_OFFER)),
        (~c("prefill_bidirectional").fill_null(True)
         & (c("decision") != semconv.DECISION_LOCAL_COVERS), outcomes.PREFILL_BIDIR_DISABLED,
         pl.lit(outcomes.EVIDENCE_BIDIR_OFF)),
        (c("decision") == semconv.DECISION_BELOW_THRESHOLD, outcomes.BELOW_THRESHOLD,
         pl.format(outcomes.EVIDENCE_BELOW_THRESHOLD,
                   pl.coalesce(c("offered_tokens") - c("decision_local_hit"),
                               c("decision_remote_count")), c("threshold_tokens"))),
        (c("decision") == semconv.DECISION_SCHEDULER_SKIPPED, outcomes.SCHEDULER_SKIPPED,
         pl.lit(outcomes.EVIDENCE_SCHEDULER_SKIPPED)),
        (c("_preempted"), outcomes.PREEMPTED, pl.lit(outcomes.EVIDENCE_PREEMPTED)),
        (status.is_not_null() & (status != semconv.TRANSFER_OK)
         & c("load_errored").fill_null(False),
         outcomes.LOAD_FAILED_ERRORED, pl.format(outcomes.EVIDENCE_LOAD_FAILED, status)),
        (status.is_not_null() & (status != semconv.TRANSFER_OK)
         & (c("last_decision") == semconv.DECISION_REISSUED),
         outcomes.LOAD_STALLED, pl.format(outcomes.EVIDENCE_LOAD_STALLED, status)),
        (status == semconv.TRANSFER_DECLINED_EXPIRED, outcomes.DECODE_TTL_EXPIRED,
         pl.lit(outcomes.EVIDENCE_DECLINED)),
        (status == semconv.TRANSFER_HANDSHAKE_FAILED, outcomes.HANDSHAKE_FAILED,
         pl.lit(outcomes.EVIDENCE_HANDSHAKE)),
        (status == semconv.TRANSFER_FAILED, outcomes.TRANSFER_FAILED,
         pl.lit(outcomes.EVIDENCE_TRANSFER)),
        (reusable.is_null(), outcomes.UNKNOWN,
         pl.lit("reusable tokens not measured (no boundary hashes and no offer)")),
        (done > 0, outcomes.PARTIAL, pl.format(outcomes.EVIDENCE_PARTIAL, done, reusable)),
    ]
    label: pl.Expr = pl.lit(outcomes.UNKNOWN)
    evidence: pl.Expr = pl.lit(outcomes.EVIDENCE_UNEXPLAINED)
    for condition, name, why in reversed(rules):
        label = pl.when(condition.fill_null(False)).then(pl.lit(name)).otherwise(label)
        evidence = pl.when(condition.fill_null(False)).then(why).otherwise(evidence)
    return ledger.with_columns(label.alias("outcome"), evidence.alias("evidence"))


def ledger(reader: StoreReader | duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Build the ledger of every run in a store."""
    return build(load_spans(reader))


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
    con = open_store(path)
    try:
        frame = ledger(con)
        con.execute("BEGIN TRANSACTION")
        try:
            rows = persist(con, frame)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        return rows
    finally:
        con.close()


def rebuild_clickhouse(source: ClickHouseSource) -> int:
    """Rebuild ``kvscope_ledger`` as a ClickHouse table from the Collector's raw spans there.

    The extraction queries run in ClickHouse; the per-turn shaping runs here in polars over
    the extracted span rows (as for DuckDB), and the ledger is written back whole, swapped in.
    """
    from kvscope.store.clickhouse import ClickHouseReader

    reader = ClickHouseReader.connect(source, time_limit_s=None)
    try:
        return reader.write_table(LEDGER_TABLE, ledger(reader),
                                  order_by=("run_id", "conversation_id", "turn_index"))
    finally:
        reader.close()


def runs(frame: pl.DataFrame) -> Sequence[str]:
    """Run ids present in a ledger, in first-arrival order."""
    return (
        frame.group_by("run_id").agg(pl.col("arrival").min()).sort("arrival")["run_id"].to_list()
    )
