"""What-if: the observed conversations replayed under other TTL, threshold and router-TTL settings.

DESIGN §5. Three steps, kept apart (STYLE §8): SQL (:data:`QUERIES`: retention and D→P transfer
spans, the router TTL the proxy recorded; map look-ups and plain filters only, so they run on the
OpenTelemetry Collector's ClickHouse tables too), pure shaping (:func:`timeline`,
:func:`replay`, :func:`whatif_table`) and the registered wrapper (``whatif``).

**Replay semantics.** The rules are those of :mod:`kvscope.emulator.reuse_model`, applied to
whole columns instead of one turn at a time: the model needs block hashes (the ledger has token
counts only) and one Python call per turn, while every rule that a TTL, threshold or router TTL
can change reduces to comparisons on one turn and its predecessor. That holds because a decode
handle is consumed only by the next turn of its conversation, and the time from turn k-1's decode
finish (when D pins and the router stores the params) to turn k's arrival is the tool wait, which
no setting changes. For turn k (``gap`` = that tool wait):

1. router (``ConversationRouter.lookup``): an entry existed (observed lookup ``hit`` or
   ``stale``) and its age ≤ router TTL → the offer reaches prefill;
2. prefill (``PrefillNode._decide``): ``count = min(offered, prompt) - local``; pull when
   ``count > 0`` and not ``(threshold > 0 and count < threshold)``; otherwise notify-only
   (``local_covers`` / ``below_threshold``);
3. worker (``PrefillNode._read``): a pull reads when ``gap + 5 s < TTL``
   (``KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S``); otherwise it is declined and D keeps the handle;
4. decode (``DecodeNode``): the handle is released at ``gap`` by a read, by a notify when
   ``gap < TTL`` (the reaper runs first), else at the TTL; a handle no turn consumes is held for
   the TTL. Held GiB·s = bytes × held seconds. A read or notify releases it as long after the
   turn's arrival as observed (prefill queueing, the READ: ``prev_ret_delay_s``), and a handle
   still held when the run ended is charged no longer than it was observed (its window): every
   setting is read over the run's observed time, so at the observed setting the replay gives
   the observed GiB·s.

**One time base.** Every time is read on the clock the spans were timed on: an emulator run at
``time_scale`` F (its settings say so) records TTLs in model seconds, so its TTL and vLLM's 5 s
margin are divided by F (:func:`on_run_clock`); TTLs asked for are seconds of that clock.

Turns whose observed outcome no setting can change, or that a fault decided (handshake, failed
READ, preemption, invalid params, no conversation id, …), are *carried*: they keep their observed
tokens, and their predecessor's handle is held ``min(observed, TTL)`` when it was read or
notified, else the TTL. Assumed independent of the settings (and checked against the simulator):
prefill's local prefix-cache hits (P caches every prompt it computes, pulled or not), D's offer
and the tool waits. Not modelled: queueing, and memory pressure that a longer TTL would add.

**Pricing.** The cost model fitted per run from the observed spans
(:mod:`kvscope.analysis.cost_fit`). A turn's estimated TTFT is its observed TTFT plus the model's
difference between the replayed and the observed path, so a turn the setting does not change
keeps its measured TTFT. A setting that needs a term the run never measured (a pull when no pull
was observed) gets no TTFT estimate (null, "not measured"), never a guess.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from kvscope import semconv
from kvscope.analysis import stored_queries
from kvscope.analysis.cost_fit import (
    COEFFICIENTS,
    coefficients,
    fits_of,
    prefill_estimate,
    run_ledger,
)
from kvscope.analysis.cost_fit import LEDGER_COLUMNS as _COST_FIT_READS
from kvscope.analysis.registry import (
    AnalysisContext,
    AnalysisError,
    Param,
    intermediate,
    register,
)
from kvscope.analysis.retention import without_superseded_snapshots
from kvscope.reuse import outcomes
from kvscope.reuse.params import KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S
from kvscope.store import query

DEFAULT_TTLS_S = (60.0, 120.0, 480.0, 900.0)
# Bounds of one what-if request (each setting replays the whole timeline).
MAX_SETTINGS = 64
MAX_SECONDS = 30 * 86400.0
MAX_TOKENS = 10_000_000
DEFAULT_THRESHOLDS = (0, 64, 256)
# How many settings one collect replays together (see whatif_table).
SETTINGS_AT_ONCE = 2
GIB = float(1 << 30)
SOURCE_OBSERVED = "observed"
SOURCE_REPLAY = "replay"
# What the replay did with a turn (column ``w_path``); decisions reuse semconv's values.
PATH_CARRIED = "carried"
PATH_NOT_LATER = "first_or_unmeasured"

# Outcomes a setting can change when the turn reached prefill's decision with a valid offer.
_DECIDED = (outcomes.REUSED_REMOTE, outcomes.REUSED_LOCAL, outcomes.PARTIAL,
            outcomes.BELOW_THRESHOLD)
_VALID_OFFER = (semconv.DECISION_PULL, semconv.DECISION_LOCAL_COVERS,
                semconv.DECISION_BELOW_THRESHOLD)


# --- SQL ---------------------------------------------------------------------------------------


_RUN = query.resource_attr(semconv.RUN_ID)

QUERIES: dict[str, query.Query] = {
    # One row per retention span: D pinned a finished request's blocks until their release.
    "retentions": stored_queries.WHATIF_RETENTIONS,
    # The router TTL the proxy recorded on its turn spans (one value per run in practice).
    "router_ttl": stored_queries.ROUTER_TTLS,
}


def _num(column: str, dtype: pl.DataType) -> pl.Expr:
    return pl.col(column).cast(pl.Float64, strict=False).cast(dtype, strict=False)


def shape_retentions(raw: pl.DataFrame) -> pl.DataFrame:
    """Typed retention spans: run_id, request_id, size_bytes, tokens, ttl_s, held_s, reason
    (one per retention: a pin's snapshot leaves when its release's span is there)."""
    return without_superseded_snapshots(raw).select(
        "run_id", "request_id", _num("size_bytes", pl.Int64()), _num("tokens", pl.Int64()),
        _num("ttl_s", pl.Float64()), "reason",
        (pl.col("duration_ns").cast(pl.Float64) / 1e9).alias("held_s"),
    )


def observed_settings(
    ledger: pl.DataFrame, retentions: pl.DataFrame, router_ttls: pl.DataFrame
) -> pl.DataFrame:
    """Per run, the settings in force: decoder TTL, threshold, router TTL (null: not measured)."""
    runs = ledger.select("run_id").unique()
    ttl = retentions.group_by("run_id").agg(pl.col("ttl_s").max().alias("ttl_s"))
    threshold = ledger.group_by("run_id").agg(
        pl.col("threshold_tokens").max().alias("threshold_tokens"))
    router = router_ttls.select(
        "run_id", _num("router_ttl_s", pl.Float64())
    ).group_by("run_id").agg(pl.col("router_ttl_s").max())
    return (
        runs.join(ttl, on="run_id", how="left").join(threshold, on="run_id", how="left")
        .join(router, on="run_id", how="left").sort("run_id")
    )


# --- timeline ----------------------------------------------------------------------------------

TIMELINE_COLUMNS = (
    "run_id", "conversation_id", "turn_index", "later", "replay", "gap_s", "age_s",
    "prompt_tokens", "reusable_tokens", "local_tokens", "observed_remote", "offered_tokens",
    "entry", "prev_ret_bytes", "prev_ret_held_s", "prev_ret_release", "prev_ret_ttl_s",
    "tail_ret_bytes", "ttft_ms", "outcome", "has_prev", "errored", "decision_local",
    "prev_decision_local", "expired_read",
    # Setting-independent parts of the rules, computed once rather than once per setting.
    "count", "read_local", "failed_local", "read_remote", "prev_contacted",
    # The run's clock: vLLM's expiry margin in it, the observation window of a handle still
    # held when the run ended, and how long after the next turn's arrival a read or notify
    # released the previous handle (see handle_times).
    "margin_s", "prev_ret_window_s", "tail_ret_window_s", "prev_ret_delay_s",
)


# What the what-if and the ladder read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    ("run_id", "conversation_id", "turn_index", "arrival", "end", "outcome", "errored",
    "prompt_tokens", "output_tokens", "ttft_ms", "tool_wait_s", "router_lookup",
    "router_entry_age_s", "decision", "prefill_bidirectional", "offered_tokens", "to_pull_tokens",
    "threshold_tokens", "reusable_tokens", "local_hit_tokens", "remote_reused_tokens",
    "d2p_status", "decode_request_id", "decode_queue_ms") + _COST_FIT_READS)


# The timeline's order of turns (the ledger's).
_TIMELINE_ORDER = ["run_id", "conversation_id", "turn_index", "arrival"]


# The timeline is derived this many turns at a time: each expression of a step makes temporaries
# as long as its input, and over every turn at once (10M) they came on top of the timeline's own
# columns; a slice's are a tenth of that. The rules reach two rows back (a shifted value derived
# from a shifted one: the previous turn's decision, from its offer) and one ahead, so each slice
# is derived with two rows either side of it and cut back: the rows are the same.
TIMELINE_SLICE_ROWS = 1 << 20
_REACH = 2


def timeline(ledger: pl.DataFrame, retentions: pl.DataFrame,
             time_scales: Mapping[str, float] | None = None, *,
             slice_rows: int = TIMELINE_SLICE_ROWS) -> pl.DataFrame:
    """Per turn, what the replay needs: gap, tokens, offer, router entry, the handles (pure).

    ``later``: turn k ≥ 2 whose reusable span was measured (the rows rates are over).
    ``replay``: a setting can change this turn (else it is carried as observed).
    ``prev_ret_*``: the handle turn k-1's decode pinned (the one turn k consumes);
    ``tail_ret_bytes``: this turn's own handle when no next turn consumes it.
    ``time_scales``: per run, how much faster than its clock its engines' model time ran (an
    emulator's ``time_scale``; default 1): ``retentions`` must already carry TTLs on the run's
    clock (:func:`on_run_clock`), and vLLM's 5 s margin shrinks by the same factor.
    """
    c = pl.col
    scales = dict(time_scales or {})
    ledger = ledger.with_columns(
        (KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S
         / c("run_id").replace_strict(scales, default=1.0, return_dtype=pl.Float64))
        .alias("margin_s"))
    handles = retentions.select(
        "run_id", c("request_id").alias("decode_request_id"),
        c("size_bytes").alias("ret_bytes"), c("tokens").alias("ret_tokens"),
        c("held_s").alias("ret_held_s"), c("reason").alias("ret_release"),
        c("ttl_s").alias("ret_ttl_s"),
    ).unique(["run_id", "decode_request_id"], keep="first")
    # Each turn's handle joined to its two keys alone (handles are unique by them), and the turns
    # put in order only when they are not already (a stored or computed ledger is): a join or a
    # sort of the whole frame copies every column (27 of them, ~2 GiB at 10M turns).
    keys = ["run_id", "decode_request_id"]
    # On the streaming engine, which joins a morsel at a time: in memory the join held its
    # keys' row encoding and copies whole (+3.1 GiB at 10M turns, +1.5 GiB streaming).
    handle = ledger.select(keys).lazy().join(
        handles.lazy(), on=keys, how="left", maintain_order="left",
    ).drop(keys).collect(engine="streaming")
    frame = ledger.hstack(handle.get_columns())
    del handle
    order = frame.select(pl.arg_sort_by(_TIMELINE_ORDER, maintain_order=True)).to_series()
    if not (order == pl.int_range(frame.height, dtype=pl.UInt32, eager=True)).all():
        frame = frame[order]
    del order
    if frame.height <= slice_rows:
        return _derived(frame)
    parts = []
    for start in range(0, frame.height, slice_rows):
        low = max(0, start - _REACH)
        part = _derived(frame.slice(low, slice_rows + start - low + _REACH))
        parts.append(part.slice(start - low, slice_rows))
    return pl.concat(parts, rechunk=False)


def _derived(frame: pl.DataFrame) -> pl.DataFrame:
    """:func:`timeline`'s columns of turns joined to their handles, in the ledger's order."""
    c = pl.col
    # Sorted by conversation, so a plain shift is the previous turn when the keys match (a
    # window function per column costs ~10x more at a million turns).
    same = (c("run_id") == c("run_id").shift(1)) & (
        c("conversation_id") == c("conversation_id").shift(1))
    frame = frame.with_columns(
        same.fill_null(False).alias("_same_prev"),
        same.shift(-1).fill_null(False).alias("_same_next"),
    )

    def prev(column: str) -> pl.Expr:
        return pl.when(c("_same_prev")).then(c(column).shift(1))

    has_id = c("conversation_id").is_not_null()
    has_prev = has_id & (prev("turn_index") == c("turn_index") - 1)
    has_next = has_id & c("_same_next") & (
        c("turn_index").shift(-1) == c("turn_index") + 1)
    since_prev = (c("arrival") - prev("end")).dt.total_nanoseconds().cast(pl.Float64) / 1e9
    frame = frame.with_columns(
        has_prev.fill_null(False).alias("_has_prev"),
        has_next.fill_null(False).alias("_has_next"),
        pl.when(has_prev).then(pl.coalesce(c("tool_wait_s"), since_prev)).alias("gap_s"),
        pl.when(has_prev).then(pl.coalesce(
            c("offered_tokens"), prev("ret_tokens"), prev("prompt_tokens") + prev("output_tokens")
            - 1)).alias("offered_tokens"),
        pl.when(has_prev).then(prev("ret_bytes")).alias("prev_ret_bytes"),
        pl.when(has_prev).then(prev("ret_held_s")).alias("prev_ret_held_s"),
        pl.when(has_prev).then(prev("ret_release")).alias("prev_ret_release"),
        pl.when(has_prev).then(prev("ret_ttl_s")).alias("prev_ret_ttl_s"),
    )
    later = (c("turn_index") >= 2) & c("reusable_tokens").is_not_null()
    # A declined read is the TTL's doing only when the gap really reached the TTL's margin;
    # otherwise a clock fault declined it (the system, carried).
    expired = (
        c("outcome").is_in([outcomes.DECODE_TTL_EXPIRED, outcomes.LOAD_FAILED_ERRORED])
        & (c("d2p_status") == semconv.TRANSFER_DECLINED_EXPIRED)
        & (c("gap_s") + c("margin_s") >= c("prev_ret_ttl_s"))
    )
    decided = c("outcome").is_in(_DECIDED) & c("decision").is_in(_VALID_OFFER)
    # A genuinely expired read failed the turn (errored) under either failure policy.
    replayable = (
        later & c("_has_prev") & c("prefill_bidirectional").fill_null(False)
        & c("offered_tokens").is_not_null()
        & ((decided & ~c("errored").fill_null(False))
           | (c("outcome") == outcomes.ROUTER_TTL_EXPIRED) | expired)
    )
    # P's local hit when it decided (the ledger's local is 0 for a failed turn): a pull's
    # count was min(offered, prompt) - local.
    decision_local = (
        pl.when((c("decision") == semconv.DECISION_PULL) & c("to_pull_tokens").is_not_null())
        .then(pl.min_horizontal(c("offered_tokens"), c("prompt_tokens")) - c("to_pull_tokens"))
        .otherwise(c("local_hit_tokens").fill_null(0))
    )
    frame = frame.with_columns(decision_local.alias("decision_local"))
    frame = frame.with_columns(
        pl.when(c("_has_prev")).then(prev("decision_local")).alias("prev_decision_local"),
        pl.min_horizontal(c("offered_tokens"), c("prompt_tokens")).sub(c("decision_local"))
        .alias("count"),
    )
    read_local = pl.min_horizontal(c("decision_local"), c("reusable_tokens"))
    return frame.with_columns(
        c("_has_prev").alias("has_prev"),
        expired.fill_null(False).alias("expired_read"),
        c("errored").fill_null(False),
        read_local.alias("read_local"),
        # After a failed turn P's cache lacks its prompt: the hit is the failed turn's.
        pl.min_horizontal(c("prev_decision_local"), c("reusable_tokens")).alias("failed_local"),
        pl.max_horizontal(
            pl.min_horizontal(c("decision_local") + c("count"), c("reusable_tokens"))
            - read_local, pl.lit(0)).alias("read_remote"),
        c("ret_release").is_in([semconv.RELEASE_READ, semconv.RELEASE_NOTIFIED])
        .shift(1).fill_null(False).alias("prev_contacted"),
        later.fill_null(False).alias("later"),
        replayable.fill_null(False).alias("replay"),
        pl.coalesce(c("router_entry_age_s"), c("gap_s")).alias("age_s"),
        c("local_hit_tokens").fill_null(0).alias("local_tokens"),
        c("remote_reused_tokens").fill_null(0).alias("observed_remote"),
        c("router_lookup").is_in([semconv.ROUTER_HIT, semconv.ROUTER_STALE]).fill_null(False)
        .alias("entry"),
        pl.when(~c("_has_next")).then(c("ret_bytes")).alias("tail_ret_bytes"),
    ).with_columns(*handle_times()).select(TIMELINE_COLUMNS)


def handle_times() -> tuple[pl.Expr, ...]:
    """The observed times a replayed handle's hold is bounded and shifted by (timeline columns).

    ``prev_ret_window_s`` / ``tail_ret_window_s``: a handle still held when the run ended
    (release ``open``) was observed that long; every setting is read over the same window, so
    none is charged for time after the run (a replay holding it for the TTL charged the demo's
    ON run 750 GiB·s where its spans hold 56). ``prev_ret_delay_s``: a handle released by the
    next turn's read or notify was released that long after the turn arrived (prefill queueing
    and the READ itself; 0 in the simulator, ~1 s on the demo's HTTP emulator, where tool waits
    are cut 12-fold and engine times are not); a replayed read or notify keeps it.
    """
    c = pl.col
    contacted = c("prev_ret_release").is_in([semconv.RELEASE_READ, semconv.RELEASE_NOTIFIED])
    return (
        pl.when(c("prev_ret_release") == semconv.RELEASE_OPEN).then(c("prev_ret_held_s"))
        .alias("prev_ret_window_s"),
        pl.when(c("tail_ret_bytes").is_not_null() & (c("ret_release") == semconv.RELEASE_OPEN))
        .then(c("ret_held_s")).alias("tail_ret_window_s"),
        pl.when(contacted & c("gap_s").is_not_null())
        .then(pl.max_horizontal(c("prev_ret_held_s") - c("gap_s"), pl.lit(0.0)))
        .otherwise(0.0).alias("prev_ret_delay_s"),
    )


def on_run_clock(retentions: pl.DataFrame, time_scales: Mapping[str, float]) -> pl.DataFrame:
    """Retention spans with ``ttl_s`` on the run's clock: an emulator run at ``time_scale`` F
    records the TTL in model seconds (480) and spans in wall time (held at most 480 / F), so
    every setting of the what-if is read in the seconds of the clock the spans were timed on."""
    if not time_scales or retentions.is_empty():
        return retentions
    return retentions.with_columns(
        pl.col("ttl_s") / pl.col("run_id").replace_strict(
            dict(time_scales), default=1.0, return_dtype=pl.Float64))


# --- the replay --------------------------------------------------------------------------------


def replay(
    frame: pl.LazyFrame, ttl_s: float, threshold: int, router_ttl_s: float | None,
    *, paths: bool = True,
) -> pl.LazyFrame:
    """Each turn under one setting (pure): path, tokens reused, failures, handles held.

    ``frame`` is a :func:`timeline`, sorted by run, conversation and turn. Adds ``w_path`` (the
    replayed decision, ``declined_expired`` for a failed turn, or ``carried``), ``w_local`` and
    ``w_remote`` (tokens reused), ``w_errored``, ``w_prev_held_s`` (seconds turn k-1's handle is
    held; null when it has none) and ``w_tail_held_s`` (this turn's own unconsumed handle).
    ``paths=False`` leaves out ``w_path`` (aggregates do not need it).

    A declined read fails the turn (policy ``fail`` errors it; ``recompute`` re-schedules it and
    the re-issued load stalls: ``NodeConfig.stall_on_reissued_load``), so decode never runs: the
    next turn gets no offer and P's cache lacks the failed prompt (its local hit is the failed
    turn's). A turn after a failed one cannot fail in turn, so within a streak of turns that
    would each fail, every other one does (odd positions), computed without a per-row loop.
    """
    c = pl.col
    ttl = float(ttl_s)
    gap = c("gap_s")
    count = c("count")
    offered = c("entry") if router_ttl_s is None else c("entry") & (
        c("age_s") <= float(router_ttl_s))
    wants = (count >= threshold) & (count > 0) if threshold > 0 else count > 0
    late = gap + c("margin_s") >= ttl
    would_fail = (c("replay") & offered & wants & late).fill_null(False)
    streak = would_fail.cum_sum()
    before = pl.when(~would_fail).then(streak).forward_fill().fill_null(0)
    # Materialised as columns: order-dependent expressions (cum_sum, shift) are not shared
    # between the outputs below otherwise, and would be recomputed for each.
    frame = frame.with_columns(
        (would_fail & ((streak - before) % 2 == 1)).alias("_fails"),
        offered.alias("_offered"), wants.alias("_wants"), late.alias("_late"),
    ).with_columns((c("has_prev") & c("_fails").shift(1)).fill_null(False).alias("_prev_fails"))
    fails, prev_fails = c("_fails"), c("_prev_fails")
    offered, wants, late = c("_offered"), c("_wants"), c("_late")
    hit = offered & ~prev_fails
    pull = hit & wants
    reads = pull & ~late
    notifies = hit & ~pull
    path = (
        pl.when(~c("later")).then(pl.lit(PATH_NOT_LATER))
        .when(~c("replay")).then(pl.lit(PATH_CARRIED))
        .when(fails).then(pl.lit(semconv.TRANSFER_DECLINED_EXPIRED))
        .when(~hit).then(pl.lit(semconv.DECISION_NO_OFFER))
        .when(reads).then(pl.lit(semconv.DECISION_PULL))
        .when(count <= 0).then(pl.lit(semconv.DECISION_LOCAL_COVERS))
        .otherwise(pl.lit(semconv.DECISION_BELOW_THRESHOLD))
    )
    carried_held = pl.when(c("prev_contacted")).then(
        pl.min_horizontal(c("prev_ret_held_s"), pl.lit(ttl))).otherwise(pl.lit(ttl))
    replay_held = pl.when(reads | (notifies & (gap < ttl))).then(
        pl.min_horizontal(gap + c("prev_ret_delay_s"), pl.lit(ttl))).otherwise(pl.lit(ttl))

    def observed_window(held: pl.Expr, window: str) -> pl.Expr:
        # A handle the run ended on was observed only so long (handle_times).
        return pl.when(c(window).is_not_null()).then(pl.min_horizontal(held, c(window))
                                                     ).otherwise(held)

    replayed = c("replay")
    return frame.with_columns(
        *([path.alias("w_path")] if paths else []),
        pl.when(~replayed).then(c("local_tokens")).when(fails).then(0)
        .when(prev_fails).then(c("failed_local")).otherwise(c("read_local"))
        .cast(pl.Int64).alias("w_local"),
        pl.when(~replayed).then(c("observed_remote")).when(reads).then(c("read_remote"))
        .otherwise(0).cast(pl.Int64).alias("w_remote"),
        pl.when(replayed).then(fails).otherwise(c("errored")).alias("w_errored"),
        pl.when(c("prev_ret_bytes").is_null() | prev_fails).then(None)
        .when(replayed).then(observed_window(replay_held, "prev_ret_window_s"))
        .otherwise(observed_window(carried_held, "prev_ret_window_s")).alias("w_prev_held_s"),
        pl.when(c("tail_ret_bytes").is_not_null() & ~fails)
        .then(observed_window(pl.lit(ttl), "tail_ret_window_s")).alias("w_tail_held_s"),
    ).drop("_fails", "_prev_fails", "_offered", "_wants", "_late")


# --- the what-if table -------------------------------------------------------------------------

WHATIF_COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "source": pl.String(),
    "decoder_kv_blocks_ttl": pl.Float64(),
    "kv_recompute_threshold": pl.Int64(),
    "router_ttl": pl.Float64(),
    "is_observed_setting": pl.Boolean(),
    "turns": pl.Int64(),
    "replayed_turns": pl.Int64(),
    "reusable_tokens": pl.Int64(),
    "reused_tokens": pl.Int64(),
    "remote_tokens": pl.Int64(),
    "token_reuse_rate": pl.Float64(),
    "turns_reused": pl.Int64(),
    "turns_pulled": pl.Int64(),
    "turns_errored": pl.Int64(),
    "retained_gib_s": pl.Float64(),
    "ttft_p50_ms": pl.Float64(),
    "ttft_p90_ms": pl.Float64(),
    "reuse_rate_delta": pl.Float64(),
    "retained_gib_s_delta": pl.Float64(),
    "ttft_p50_delta_ms": pl.Float64(),
    "ttft_p90_delta_ms": pl.Float64(),
    "recommended": pl.Boolean(),
    "note": pl.String(),
}


@dataclass(frozen=True)
class Setting:
    """One what-if setting; ``router_ttl_s`` None keeps the observed router lookups."""

    ttl_s: float
    threshold: int
    router_ttl_s: float | None


_REPLAY_INPUTS = (
    "later", "replay", "has_prev", "entry", "age_s", "gap_s", "count", "errored",
    "local_tokens", "observed_remote", "read_local", "failed_local", "read_remote",
    "prev_ret_bytes", "prev_ret_held_s", "prev_contacted", "tail_ret_bytes", "ttft_ms",
    "prompt_tokens", "margin_s", "prev_ret_window_s", "tail_ret_window_s", "prev_ret_delay_s",
)


def _summary(frame: pl.LazyFrame, setting: Setting, has_retention: bool) -> pl.LazyFrame:
    """One replayed setting's aggregate row (``frame`` carries ``est_obs``, see whatif_table)."""
    c = pl.col
    # Masks by multiplication: one pass per aggregate instead of a filtered copy each.
    later = c("later").cast(pl.Int64)
    reused = c("w_local") + c("w_remote")
    same = (c("w_remote") == c("observed_remote")) & (c("w_local") == c("local_tokens"))
    delta = pl.when(~c("replay") | same).then(0.0).otherwise(
        prefill_estimate(c("w_local"), c("w_remote")) - c("est_obs"))
    # A failed turn has no first token.
    ttft = pl.when(~c("w_errored")).then(c("ttft_ms") + delta)
    held = (
        (c("prev_ret_bytes").cast(pl.Float64) * c("w_prev_held_s")).sum()
        + (c("tail_ret_bytes").cast(pl.Float64) * c("w_tail_held_s")).sum()
    ) / GIB
    return frame.select(
        pl.lit(setting.ttl_s).alias("decoder_kv_blocks_ttl"),
        pl.lit(setting.threshold, pl.Int64).alias("kv_recompute_threshold"),
        pl.lit(setting.router_ttl_s, pl.Float64).alias("router_ttl"),
        (reused * later).sum().cast(pl.Int64).alias("reused_tokens"),
        (c("w_remote") * later).sum().cast(pl.Int64).alias("remote_tokens"),
        ((reused > 0).cast(pl.Int64) * later).sum().alias("turns_reused"),
        ((c("w_remote") > 0).cast(pl.Int64) * later).sum().alias("turns_pulled"),
        (c("w_errored").cast(pl.Int64) * later).sum().alias("turns_errored"),
        (held if has_retention else pl.lit(None, pl.Float64)).alias("retained_gib_s"),
        ttft.quantile(0.5, "linear").alias("ttft_p50_ms"),
        ttft.quantile(0.9, "linear").alias("ttft_p90_ms"),
        (c("ttft_ms").is_not_null() & ~c("w_errored") & ttft.is_null()).sum().alias("_unpriced"),
    )


# What _observed_row reads of the ledger.
_OBSERVED_READS = ("turn_index", "reusable_tokens", "local_hit_tokens", "remote_reused_tokens",
                   "ttft_ms", "errored")


# What :func:`inputs` gives of the ledger: the observed row's, the observed settings' and the
# ladder's decode queue.
_INPUT_COLUMNS = ("run_id", "threshold_tokens", "decode_queue_ms", *_OBSERVED_READS)


def _observed_row(ledger: pl.DataFrame, retentions: pl.DataFrame) -> dict[str, Any]:
    later = ledger.filter((pl.col("turn_index") >= 2) & pl.col("reusable_tokens").is_not_null())
    reusable = later["reusable_tokens"].sum()
    local = later["local_hit_tokens"].fill_null(0)
    remote = later["remote_reused_tokens"].fill_null(0)
    reused = int((local + remote).sum())
    ttft = ledger["ttft_ms"].drop_nulls()
    retained = (
        float((retentions["size_bytes"].cast(pl.Float64) * retentions["held_s"]).sum()) / GIB
        if retentions.height else None
    )
    return {
        "source": SOURCE_OBSERVED, "turns": later.height, "replayed_turns": None,
        "reusable_tokens": int(reusable), "reused_tokens": reused,
        "remote_tokens": int(remote.sum()),
        "token_reuse_rate": reused / reusable if reusable else None,
        "turns_reused": int(((local + remote) > 0).sum()),
        "turns_pulled": int((remote > 0).sum()),
        "turns_errored": int(later["errored"].fill_null(False).sum()),
        "retained_gib_s": retained,
        "ttft_p50_ms": ttft.quantile(0.5, "linear") if ttft.len() else None,
        "ttft_p90_ms": ttft.quantile(0.9, "linear") if ttft.len() else None,
    }


def _fmt_setting(row: Mapping[str, Any]) -> str:
    router = row["router_ttl"]
    return (
        f"ttl={row['decoder_kv_blocks_ttl']:g}s threshold={row['kv_recompute_threshold']} "
        f"router_ttl={'as observed' if router is None else f'{router:g}s'}"
    )


def _recommend(table: pl.DataFrame, budget_gib_s: float | None) -> pl.DataFrame:
    """Mark the replayed setting with the best TTFT p50 within the budget; say the trade-off."""
    replayed = table.filter(pl.col("source") == SOURCE_REPLAY)
    observed = table.filter(pl.col("source") == SOURCE_OBSERVED)
    seen = observed["retained_gib_s"].first()
    budget = budget_gib_s if budget_gib_s is not None else (
        float(seen) if isinstance(seen, int | float) else None)
    priced = replayed.filter(
        pl.col("ttft_p50_ms").is_not_null() & pl.col("retained_gib_s").is_not_null())
    order = ["ttft_p50_ms", "ttft_p90_ms", "retained_gib_s"]
    best_note = ""
    best_index: int | None = None
    if priced.height == 0:
        observed_note = "no recommendation: TTFT or retained memory not measured"
    elif budget is None:
        observed_note = "no recommendation: observed retained GiB·s not measured; give a budget"
    else:
        fastest = priced.sort(order).row(0, named=True)
        within = priced.filter(
            (pl.col("retained_gib_s") <= budget * (1 + 1e-9) + 1e-12)
            # The setting that ran kept the observed budget by definition: its replay is never
            # ruled out by the replay's own error against what was observed.
            | (pl.col("is_observed_setting") & pl.lit(budget_gib_s is None)))
        trade = (
            f"fastest: {_fmt_setting(fastest)} (TTFT p50 {fastest['ttft_p50_ms']:.1f} ms, "
            f"{fastest['retained_gib_s']:.2f} GiB·s)"
        )
        if within.height == 0:
            observed_note = (
                f"no setting within {budget:.2f} GiB·s; trade-off: {trade}"
            )
        else:
            best = within.sort(order).row(0, named=True)
            best_index = int(best["_row"])
            best_note = f"recommended: best TTFT p50 within {budget:.2f} GiB·s"
            observed_note = f"recommendation: {_fmt_setting(best)}; {trade}"
    is_best = pl.col("_row") == best_index if best_index is not None else pl.lit(False)
    return table.with_columns(
        is_best.alias("recommended"),
        pl.when(pl.col("source") == SOURCE_OBSERVED).then(pl.lit(observed_note))
        .when(is_best).then(pl.lit(best_note)).otherwise(pl.col("note")).alias("note"),
    )


def whatif_table(
    timeline_frame: pl.DataFrame,
    fits: pl.DataFrame,
    observed: pl.DataFrame,
    ledger: pl.DataFrame,
    retentions: pl.DataFrame,
    *,
    ttls: Sequence[float] = DEFAULT_TTLS_S,
    thresholds: Sequence[int] = DEFAULT_THRESHOLDS,
    router_ttls: Sequence[float] | None = None,
    budget_gib_s: float | None = None,
) -> pl.DataFrame:
    """Per run: the observed row, then one replayed row per setting, with deltas (pure).

    The grid is ``ttls × thresholds × router_ttls`` (router TTL default: the observed one) plus
    the observed setting, whose replay is marked ``is_observed_setting``.
    """
    out: list[pl.DataFrame] = []
    coefs = coefficients(fits)
    for run_id in sorted(observed["run_id"].to_list()):
        seen = observed.filter(pl.col("run_id") == run_id).row(0, named=True)
        # Lazily: only the columns read are filtered (an eager filter copies every column).
        run_turns = timeline_frame.lazy().filter(pl.col("run_id") == run_id)
        counts = run_turns.filter(pl.col("later")).select(
            pl.len().cast(pl.Int64).alias("turns"),
            pl.col("replay").sum().cast(pl.Int64).alias("replayed_turns"),
            pl.col("reusable_tokens").sum().cast(pl.Int64).alias("reusable_tokens"),
        ).collect()
        # Only what the replay and the summary read; the observed path priced once.
        # In the timeline's order: the replay reads the previous turn by position.
        turns = run_turns.join(coefs.lazy(), on="run_id", how="left",
                               maintain_order="left").select(
            *_REPLAY_INPUTS, *COEFFICIENTS,
            prefill_estimate(pl.col("local_tokens"), pl.col("observed_remote")).alias("est_obs"),
        ).collect().lazy()
        run_retentions = retentions.filter(pl.col("run_id") == run_id)
        routers: list[float | None] = (
            list(router_ttls) if router_ttls else [seen["router_ttl_s"]])
        grid = [Setting(float(t), int(h), None if r is None else float(r))
                for t in ttls for h in thresholds for r in routers]
        seen_setting = None
        if seen["ttl_s"] is not None and seen["threshold_tokens"] is not None:
            seen_setting = Setting(float(seen["ttl_s"]), int(seen["threshold_tokens"]),
                                   seen["router_ttl_s"])
            if seen_setting not in grid:
                grid.append(seen_setting)
        # A few settings at a time: each materialises its columns over every turn of the run
        # (all 13 default settings at once peaked past 10 GiB at 10M turns).
        summaries: list[pl.DataFrame] = []
        for start in range(0, len(grid), SETTINGS_AT_ONCE):
            summaries += pl.collect_all([
                _summary(replay(turns, s.ttl_s, s.threshold, s.router_ttl_s, paths=False), s,
                         run_retentions.height > 0)
                for s in grid[start:start + SETTINGS_AT_ONCE]
            ])
        # Gone before the next run's are made (at 10M turns in two runs, a run's are ~1 GiB).
        del turns
        rows = pl.concat(summaries).join(counts, how="cross").with_columns(
            pl.when(pl.col("reusable_tokens") > 0)
            .then(pl.col("reused_tokens") / pl.col("reusable_tokens")).alias("token_reuse_rate"),
            pl.lit(SOURCE_REPLAY).alias("source"),
            pl.Series("is_observed_setting", [s == seen_setting for s in grid]),
            pl.when(pl.col("_unpriced") > 0)
            .then(pl.lit("TTFT not measured: the replay pulls, but this run has no pulls to "
                         "price a transfer"))
            .alias("note"),
        ).with_columns(
            pl.when(pl.col("_unpriced") == 0).then(pl.col(name)).alias(name)
            for name in ("ttft_p50_ms", "ttft_p90_ms")
        ).sort(["decoder_kv_blocks_ttl", "kv_recompute_threshold", "router_ttl"])
        first = pl.DataFrame([{
            **_observed_row(ledger.lazy().filter(pl.col("run_id") == run_id).select(
                _OBSERVED_READS).collect(), run_retentions),
            "decoder_kv_blocks_ttl": seen["ttl_s"],
            "kv_recompute_threshold": seen["threshold_tokens"],
            "router_ttl": seen["router_ttl_s"],
            "is_observed_setting": True,
        }])
        table = pl.concat([first, rows], how="diagonal_relaxed").with_columns(
            pl.lit(run_id).alias("run_id"),
            pl.int_range(pl.len()).alias("_row"),
        )
        base = table.row(0, named=True)

        def minus(column: str, base_row: Mapping[str, Any] = base) -> pl.Expr:
            value = base_row[column]
            return pl.col(column) - value if value is not None else pl.lit(None, pl.Float64)

        table = table.with_columns(
            minus("token_reuse_rate").alias("reuse_rate_delta"),
            minus("retained_gib_s").alias("retained_gib_s_delta"),
            minus("ttft_p50_ms").alias("ttft_p50_delta_ms"),
            minus("ttft_p90_ms").alias("ttft_p90_delta_ms"),
        )
        out.append(_recommend(table, budget_gib_s))
    if not out:
        return pl.DataFrame(schema=WHATIF_COLUMNS)
    return pl.concat(out, how="diagonal_relaxed").select(
        [pl.col(name).cast(dtype) for name, dtype in WHATIF_COLUMNS.items()])


# --- registered analyses -----------------------------------------------------------------------


@intermediate("whatif_frames", shared=True)
def _store_frames(ctx: AnalysisContext) -> dict[str, pl.DataFrame]:
    """Retention spans and router TTLs of every run in the store."""
    raw = {name: ctx.frame(sql) for name, sql in QUERIES.items()}
    return {
        "retentions": shape_retentions(raw["retentions"]),
        "router_ttl": raw["router_ttl"],
    }


@intermediate("whatif_timeline", shared=False)
def _timeline(ctx: AnalysisContext, runs: tuple[str, ...]) -> pl.DataFrame:
    """The turns of ``runs`` on one timeline with their retentions (see :func:`timeline`)."""
    frames = _frames(ctx)
    return timeline(ctx.ledger(LEDGER_COLUMNS).filter(pl.col("run_id").is_in(list(runs))),
                    frames["retentions"].filter(pl.col("run_id").is_in(list(runs))),
                    _time_scales(ctx))


def _time_scales(ctx: AnalysisContext) -> dict[str, float]:
    """Per run, its engines' ``time_scale`` where the run's settings record one other than 1
    (an emulator run whose model time ran faster than the wall clock its spans are timed on)."""
    from kvscope.analysis.runs import all_runs, run_settings

    scales: dict[str, float] = {}
    for row in all_runs(ctx).select("run_id", "settings").iter_rows(named=True):
        value = run_settings(row["settings"]).get("time_scale")
        if isinstance(value, int | float) and math.isfinite(value) and value > 0 and value != 1:
            scales[str(row["run_id"])] = float(value)
    return scales


def _frames(ctx: AnalysisContext) -> dict[str, pl.DataFrame]:
    """Retention spans (TTLs on each run's clock) and router TTLs of the selected runs."""
    frames: dict[str, pl.DataFrame] = ctx.get(_store_frames)
    out = {name: ctx.select_runs(frame) for name, frame in frames.items()}
    out["retentions"] = on_run_clock(out["retentions"], _time_scales(ctx))
    return out


def inputs(ctx: AnalysisContext, run: str | None = None) -> dict[str, pl.DataFrame]:
    """Everything the what-if and the ladder read, for the selected runs (and ``run``): the
    ledger, retentions, the timeline and the observed settings."""
    frames = _frames(ctx)
    # The few columns read beside the timeline (the timeline reads its own): the ledger's
    # other columns are let go while the replay runs (~2 GiB at 10M turns).
    ledger = run_ledger(ctx, run, _INPUT_COLUMNS)
    if run is not None:
        frames = {k: v.filter(pl.col("run_id") == run) for k, v in frames.items()}
    turns = ctx.get(_timeline, tuple(sorted(ledger["run_id"].unique().to_list())))
    return {
        "ledger": ledger,
        "retentions": frames["retentions"],
        "timeline": turns,
        "observed": observed_settings(ledger, frames["retentions"], frames["router_ttl"]),
    }


def _floats(values: Sequence[Any], name: str, low: float, high: float) -> list[float]:
    """Distinct finite numbers within [low, high], in order; AnalysisError naming the value."""
    out: list[float] = []
    for v in values:
        try:
            number = float(v)
        except (TypeError, ValueError):
            raise AnalysisError(f"parameter {name}: {v!r} is not a number") from None
        if not math.isfinite(number) or not low <= number <= high:
            raise AnalysisError(f"parameter {name}: {v!r} is not within [{low:g}, {high:g}]")
        if number not in out:
            out.append(number)
    return out


@register(
    "whatif",
    "What-if: reuse, retained GiB·s and TTFT under other TTL / threshold / router-TTL settings",
    params=(
        Param("ttl", list, list(DEFAULT_TTLS_S), "decoder_kv_blocks_ttl values (s), comma list"),
        Param("threshold", list, list(DEFAULT_THRESHOLDS),
              "kv_recompute_threshold values (tokens), comma list"),
        Param("router_ttl", list, None, "router TTL values (s), comma list (default: observed)"),
        Param("run", str, None, "only this run id (default: every selected run)"),
        Param("budget_gib_s", float, None,
              "retained GiB·s budget for the recommendation (default: the observed)"),
    ),
    columns=WHATIF_COLUMNS,
)
def whatif(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    data = inputs(ctx, params["run"])
    ttls = _floats(params["ttl"], "ttl", 1e-3, MAX_SECONDS)
    thresholds = [int(v) for v in _floats(params["threshold"], "threshold", 0, MAX_TOKENS)]
    routers = (_floats(params["router_ttl"], "router_ttl", 1e-3, MAX_SECONDS)
               if params["router_ttl"] else None)
    settings = len(ttls) * len(thresholds) * (len(routers) if routers else 1)
    if settings > MAX_SETTINGS:
        # Each setting replays every observed turn: an unbounded grid (one dashboard request of
        # 400 TTLs x 25 thresholds) ran for minutes past 8 GiB and starved the receiver.
        raise AnalysisError(
            f"whatif: {settings} settings asked (ttl x threshold x router_ttl); at most "
            f"{MAX_SETTINGS} per request, since each one replays every observed turn")
    fits = ctx.get(fits_of, params["run"])
    return whatif_table(
        data["timeline"], fits, data["observed"], data["ledger"], data["retentions"],
        ttls=ttls, thresholds=thresholds, router_ttls=routers,
        budget_gib_s=params["budget_gib_s"],
    )


__all__ = ["DEFAULT_THRESHOLDS", "DEFAULT_TTLS_S", "GIB", "LEDGER_COLUMNS", "MAX_SECONDS",
    "MAX_SETTINGS", "MAX_TOKENS", "PATH_CARRIED", "PATH_NOT_LATER", "QUERIES", "SETTINGS_AT_ONCE",
    "SOURCE_OBSERVED", "SOURCE_REPLAY", "Setting", "TIMELINE_COLUMNS", "TIMELINE_SLICE_ROWS",
    "WHATIF_COLUMNS", "handle_times", "inputs", "observed_settings", "on_run_clock", "replay",
    "shape_retentions", "timeline", "whatif", "whatif_table"]
