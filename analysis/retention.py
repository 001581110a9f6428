"""Retention cost: what keeping finished turns' KV on decode cost, and what it bought.

Two analyses (DESIGN §5, retention cost):

* ``retention_cost`` — per run × decode engine, GiB·s held (bytes × held seconds / 2^30) split
  by how each retention ended: ``useful`` (released by a READ, which is the only way decode
  releases with reason ``read``, so bytes moved), ``idle`` (released by a notify without a read:
  below threshold or a local hit), ``wasted`` (expired unread) and ``open`` (still held when the
  data ends: counted until the run's last observed time and flagged). Beside it: retentions by
  release reason, hold times against the TTL, and GiB·s per prefill-second saved.
* ``retained_memory`` — per run × decode engine, retained bytes over time (a step function of
  the retention spans, resampled to ``step_s``; and the ``kvscope.kv.retained_bytes`` gauge where
  a deployment wrote it) beside GPU memory samples, each row naming its source.

Prefill seconds saved are an estimate, never a measurement: a linear fit
``prefill_ms = fixed + per_token · computed_tokens`` over turns k ≥ 2 that pulled nothing
(computed = prompt − local hit) prices what each ``reused_remote`` turn would have cost had it
recomputed; the saving is that price minus the prefill leg the turn really took (which includes
the D→P transfer and the pull's own overheads). Turn 1 is left out of the fit because the ledger
clips local hits to reusable tokens (0 on turn 1), so a prefix hit shared across conversations
(a common system prompt) would look like computed tokens. Too few fitting turns, or no spread in
their token counts: "not measured" (null), with the reason in ``saved_basis``.

Query (portable SQL: map look-ups, bound parameters) → pure shaping functions (tested on small
hand-built frames) → registered wrappers, as STYLE §8 asks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope import semconv
from kvscope.analysis import stored_queries
from kvscope.analysis.registry import (
    AnalysisContext,
    Param,
    intermediate,
    register,
    whole_ledger,
)
from kvscope.reuse import outcomes
from kvscope.store import query

GIB = float(1 << 30)
_NS = 1_000_000_000

# Release reason → how the GiB·s it held are classed.
CLASS_USEFUL = "useful"
CLASS_IDLE = "idle"
CLASS_WASTED = "wasted"
CLASS_OPEN = "open"
CLASS_OF_REASON: dict[str, str] = {
    semconv.RELEASE_READ: CLASS_USEFUL,
    semconv.RELEASE_NOTIFIED: CLASS_IDLE,
    semconv.RELEASE_EXPIRED: CLASS_WASTED,
    semconv.RELEASE_OPEN: CLASS_OPEN,
}

# Sources of a retained_memory series.
SOURCE_RETENTION_SPANS = "retention_spans"
SOURCE_RETAINED_GAUGE = "retained_bytes_gauge"
SOURCE_GPU_USED = "gpu_memory_used"
SOURCE_GPU_TOTAL = "gpu_memory_total"
SOURCE_OF_METRIC: dict[str, str] = {
    semconv.METRIC_KV_RETAINED: SOURCE_RETAINED_GAUGE,
    semconv.METRIC_GPU_MEMORY_USED: SOURCE_GPU_USED,
    semconv.METRIC_GPU_MEMORY_TOTAL: SOURCE_GPU_TOTAL,
}

FIT_SCOPES = ("run", "all")

# Typed retention spans, as :func:`shape_retentions` returns them.
RETENTION_SCHEMA: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "engine_id": pl.String(),
    "request_id": pl.String(),
    "start": pl.Datetime("ns"),
    "duration_ns": pl.Int64(),
    "size_bytes": pl.Int64(),
    "ttl_s": pl.Float64(),
    "reason": pl.String(),
}

# Gauge samples, as :func:`shape_samples` returns them.
SAMPLE_SCHEMA: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "source": pl.String(),
    "engine_id": pl.String(),
    "gpu_host": pl.String(),
    "gpu_index": pl.String(),
    "time": pl.Datetime("ns"),
    "value": pl.Float64(),
}

COST_COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "engine_id": pl.String(),
    "retentions": pl.Int64(),
    "released_read": pl.Int64(),
    "released_notified": pl.Int64(),
    "expired": pl.Int64(),
    "open": pl.Int64(),
    "gib_s_useful": pl.Float64(),
    "gib_s_idle": pl.Float64(),
    "gib_s_wasted": pl.Float64(),
    "gib_s_open": pl.Float64(),
    "gib_s_total": pl.Float64(),
    "useful_share": pl.Float64(),
    "held_s_p50": pl.Float64(),
    "held_s_p90": pl.Float64(),
    "held_s_max": pl.Float64(),
    "ttl_s": pl.Float64(),
    "held_p90_of_ttl": pl.Float64(),
    "open_held_until": pl.Datetime("ns"),
    "reused_remote_turns": pl.Int64(),
    "fit_turns": pl.Int64(),
    "fit_fixed_ms": pl.Float64(),
    "fit_ms_per_token": pl.Float64(),
    "fit_r2": pl.Float64(),
    "prefill_s_saved": pl.Float64(),
    "gib_s_per_prefill_s_saved": pl.Float64(),
    "saved_basis": pl.String(),
    # What retention cost the engine's new requests: the ledger's decode_queue_ms of the turns it
    # decoded (vLLM queues a request that cannot get blocks; retained ones are never taken back).
    # Null when no turn there has a P->D read to time (not measured).
    "decode_queue_s_total": pl.Float64(),
    "decode_queue_ms_p90": pl.Float64(),
}

MEMORY_COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "source": pl.String(),
    "engine_id": pl.String(),
    "gpu_host": pl.String(),
    "gpu_index": pl.String(),
    "time": pl.Datetime("ns"),
    "mean_bytes": pl.Float64(),
    "max_bytes": pl.Float64(),
    "points": pl.Int64(),
    "step_s": pl.Float64(),
}


# --- queries ------------------------------------------------------------------------------------

# Engine spans name their run in the resource attributes (semconv.RUN_ID); the stored
# query's table is read instead while the ledger is current.
RETENTION_QUERY = stored_queries.RETENTION_SPANS

SAMPLES_QUERY = query.select(query.GAUGES, {
    "run_id": query.resource_attr(semconv.RUN_ID),
    "metric": "MetricName",
    "engine_id": query.point_attr(semconv.ENGINE_ID),
    "gpu_host": query.point_attr(semconv.GPU_HOST),
    "gpu_index": query.point_attr(semconv.GPU_INDEX),
    "time": "TimeUnix",
    "value": "Value",
}, where={"MetricName": (semconv.METRIC_KV_RETAINED, semconv.METRIC_GPU_MEMORY_USED,
                         semconv.METRIC_GPU_MEMORY_TOTAL)})


@intermediate("retentions", shared=True)
def _retentions(ctx: AnalysisContext) -> pl.DataFrame:
    """Every run's retention spans, typed, reads told from notifies by the whole ledger."""
    raw = ctx.frame(RETENTION_QUERY)
    return upgrade_reads(shape_retentions(raw),
                         read_handles(whole_ledger(ctx, READ_HANDLE_COLUMNS)))


def load_retentions(ctx: AnalysisContext) -> pl.DataFrame:
    """The selected runs' retention spans, typed (cached per context)."""
    return ctx.select_runs(ctx.get(_retentions))


# What read_handles reads of the ledger.
READ_HANDLE_COLUMNS = ("d2p_status", "d2p_bytes", "retention_id")


def read_handles(ledger: pl.DataFrame) -> pl.Series:
    """Decode request ids whose retained blocks a later turn's READ actually moved bytes from."""
    # Lazy: only the columns read are filtered (an eager filter copies every column given).
    return ledger.lazy().filter(
        (pl.col("d2p_status") == semconv.TRANSFER_OK) & (pl.col("d2p_bytes") > 0)
        & pl.col("retention_id").is_not_null()
    ).select(pl.col("retention_id").unique()).collect().to_series()


def upgrade_reads(retentions: pl.DataFrame, handles: pl.Series) -> pl.DataFrame:
    """Say ``read`` for handles released by a notify that a READ moved bytes from.

    Real vLLM decode cannot tell a READ from a notify-only release: both arrive as the same
    NIXL notification, so its hook reports ``notified``. Prefill's transfer span for the
    offered handle says whether bytes moved; that decides useful vs idle GiB·s.
    """
    if retentions.is_empty() or handles.is_empty():
        return retentions
    upgrade = (pl.col("reason") == semconv.RELEASE_NOTIFIED) & pl.col("request_id").is_in(
        handles.implode())
    return retentions.with_columns(
        pl.when(upgrade).then(pl.lit(semconv.RELEASE_READ)).otherwise(pl.col("reason"))
        .alias("reason")
    )


@intermediate("gauge_samples", shared=True)
def _samples(ctx: AnalysisContext) -> pl.DataFrame:
    return shape_samples(ctx.frame(SAMPLES_QUERY))


def load_samples(ctx: AnalysisContext) -> pl.DataFrame:
    """Retained-bytes and GPU memory gauge samples, typed (cached per context).

    Samples without a run id (a GPU sampler started without one) are kept: the shaping attaches
    them to the runs whose time range they fall in.
    """
    typed: pl.DataFrame = ctx.get(_samples)
    if ctx.runs is None:
        return typed
    return typed.filter(pl.col("run_id").is_in(ctx.runs) | pl.col("run_id").is_null())


# --- shaping (pure) -----------------------------------------------------------------------------

def _num(column: str, dtype: pl.DataType) -> pl.Expr:
    return pl.col(column).cast(pl.Float64, strict=False).cast(dtype, strict=False)


def shape_retentions(raw: pl.DataFrame) -> pl.DataFrame:
    """Type the string attributes of raw retention rows (:data:`RETENTION_SCHEMA`), one per
    retention (:func:`without_superseded_snapshots`)."""
    if raw.is_empty():
        return pl.DataFrame(schema=RETENTION_SCHEMA)
    duration = pl.col("duration_ns").cast(pl.Int64)
    if "measured" in raw.columns:
        # A retention an ingested log only names (decode's "Potentially invalid KV blocks"
        # line: released, then read): how long it was held is not measured, never 0.
        duration = (pl.when(pl.col("measured") == "false").then(None).otherwise(duration)
                    .alias("duration_ns"))
    return without_superseded_snapshots(raw).with_columns(
        _num("size_bytes", pl.Int64()), _num("ttl_s", pl.Float64()), duration,
    ).select([pl.col(n).cast(t) for n, t in RETENTION_SCHEMA.items()])


def without_superseded_snapshots(raw: pl.DataFrame) -> pl.DataFrame:
    """Retention rows less the ``open`` snapshots a later span of the same retention replaced.

    vLLM's engine hooks record each retention twice: when decode pins it (release reason
    ``open``, no end: what stays in the store if the engine is killed before it releases) and
    when decode releases it. Rows need ``run_id``, ``request_id``, ``reason``, ``duration_ns``.
    """
    snapshot = (pl.col("reason") == semconv.RELEASE_OPEN) & (
        pl.col("duration_ns").cast(pl.Int64, strict=False) == 0)
    spans = pl.len().over("run_id", "request_id")
    return raw.filter(~(snapshot & (spans > 1)).fill_null(False))


def shape_samples(raw: pl.DataFrame) -> pl.DataFrame:
    """Gauge rows named by source (:data:`SAMPLE_SCHEMA`); engine ids only on retained bytes."""
    if raw.is_empty():
        return pl.DataFrame(schema=SAMPLE_SCHEMA)
    source = pl.col("metric").replace_strict(SOURCE_OF_METRIC, default=None)
    retained = source == SOURCE_RETAINED_GAUGE
    return raw.with_columns(
        source.alias("source"),
        pl.when(retained).then(pl.col("engine_id")).alias("engine_id"),
        pl.when(~retained).then(pl.col("gpu_host")).alias("gpu_host"),
        pl.when(~retained).then(pl.col("gpu_index")).alias("gpu_index"),
    ).select([pl.col(n).cast(t) for n, t in SAMPLE_SCHEMA.items()])


def observed_range(
    ledger: pl.DataFrame, retentions: pl.DataFrame, samples: pl.DataFrame | None = None
) -> pl.DataFrame:
    """Per run: the first and last time anything was observed (turns, retentions, gauges)."""
    parts = [
        ledger.select("run_id", pl.col("arrival").alias("first"), pl.col("end").alias("last")),
        retentions.select(
            "run_id", pl.col("start").alias("first"),
            (pl.col("start") + pl.duration(nanoseconds=pl.col("duration_ns"))).alias("last"),
        ),
    ]
    if samples is not None:
        parts.append(samples.filter(pl.col("run_id").is_not_null()).select(
            "run_id", pl.col("time").alias("first"), pl.col("time").alias("last")))
    both = pl.concat([p.lazy().cast({"first": pl.Datetime("ns"), "last": pl.Datetime("ns")})
                      for p in parts])
    return both.group_by("run_id").agg(pl.col("first").min(), pl.col("last").max()).collect()


def held(retentions: pl.DataFrame, observed: pl.DataFrame) -> pl.DataFrame:
    """Each retention with its release time, held seconds, GiB·s and class.

    An ``open`` retention without an end (its span has zero duration) is held until its run's
    last observed time: the cost is real up to there, and unknown after.
    """
    still_open = (pl.col("reason") == semconv.RELEASE_OPEN) & (pl.col("duration_ns") == 0)
    span_end = pl.col("start") + pl.duration(nanoseconds=pl.col("duration_ns"))
    released = pl.when(still_open).then(pl.max_horizontal(pl.col("last"), span_end)).otherwise(
        span_end)
    frame = retentions.join(observed.select("run_id", "last"), on="run_id", how="left",
                            nulls_equal=True)
    return frame.with_columns(released.alias("released")).with_columns(
        ((pl.col("released") - pl.col("start")).dt.total_nanoseconds() / _NS).alias("held_s"),
        pl.col("reason").replace_strict(CLASS_OF_REASON, default=None).alias("class"),
        still_open.alias("held_to_end"),
    ).with_columns(
        (pl.col("size_bytes").cast(pl.Float64) * pl.col("held_s") / GIB).alias("gib_s"),
    )


def _measured_sum(expr: pl.Expr) -> pl.Expr:
    """Σ over measured values; null (not 0) when none was measured."""
    return pl.when(expr.is_not_null().any()).then(expr.sum())


def _fit_key(by: str) -> pl.Expr:
    return (pl.lit(None, pl.String) if by == "all" else pl.col("run_id")).alias("_fit_key")


def prefill_fit(ledger: pl.DataFrame, by: str = "run") -> pl.DataFrame:
    """Least-squares ``prefill_ms = fixed + per_token · computed`` per run (or over all runs).

    Fits over turns k ≥ 2 that pulled nothing and did not error, computed = prompt − local hit.
    Returns run_id (null when ``by='all'``), fit_turns, fit_fixed_ms, fit_ms_per_token, fit_r2.
    """
    computed = (pl.col("prompt_tokens") - pl.col("local_hit_tokens").fill_null(0)).cast(
        pl.Float64)
    rows = ledger.lazy().filter(
        (pl.col("turn_index") >= 2) & pl.col("d2p_status").is_null()
        & ~pl.col("errored").fill_null(False)
        & pl.col("prefill_ms").is_not_null() & pl.col("prompt_tokens").is_not_null()
    ).select(_fit_key(by).alias("run_id"), computed.alias("x"), pl.col("prefill_ms").alias("y"))
    fit = rows.group_by("run_id").agg(
        pl.len().alias("fit_turns"),
        pl.col("x").mean().alias("_mx"), pl.col("y").mean().alias("_my"),
        pl.cov("x", "y").alias("_cov"), pl.col("x").var().alias("_var"),
        pl.col("y").var().alias("_vary"),
    ).collect()
    slope = pl.when(pl.col("_var") > 0).then(pl.col("_cov") / pl.col("_var"))
    r2 = pl.when((pl.col("_var") > 0) & (pl.col("_vary") > 0)).then(
        pl.col("_cov") ** 2 / (pl.col("_var") * pl.col("_vary"))
    ).when(pl.col("_var") > 0).then(pl.lit(1.0))  # every y equal: the fit is exact
    return fit.with_columns(slope.alias("fit_ms_per_token"), r2.alias("fit_r2")).with_columns(
        (pl.col("_my") - pl.col("fit_ms_per_token") * pl.col("_mx")).alias("fit_fixed_ms"),
        pl.col("fit_turns").cast(pl.Int64),
    ).select("run_id", "fit_turns", "fit_fixed_ms", "fit_ms_per_token", "fit_r2")


def prefill_savings(
    ledger: pl.DataFrame, retentions: pl.DataFrame, fit: pl.DataFrame, by: str = "run",
    min_fit_turns: int = 10,
) -> pl.DataFrame:
    """Estimated prefill seconds saved per run × decode engine by ``reused_remote`` turns.

    A turn is attributed to the engine that held the handle it was offered (``retention_id``);
    without that span the engine is null. With no such turn nothing was saved (0); with turns
    but no usable fit the saving is not measured (null).
    """
    engines = retentions.select("run_id", pl.col("request_id").alias("retention_id"),
                                "engine_id").unique(["run_id", "retention_id"], keep="first")
    # In the ledger's order, so that sums add in one order every time.
    turns = ledger.lazy().filter(pl.col("outcome") == outcomes.REUSED_REMOTE).join(
        engines.lazy(), on=["run_id", "retention_id"], how="left", nulls_equal=True,
        maintain_order="left")
    fit = fit.rename({"run_id": "_fit_key"})
    usable = (pl.col("fit_turns") >= min_fit_turns) & pl.col("fit_ms_per_token").is_not_null()
    computed = pl.col("prompt_tokens") - pl.col("local_hit_tokens").fill_null(0)
    recompute_ms = pl.col("fit_fixed_ms") + pl.col("fit_ms_per_token") * computed
    per_turn = turns.with_columns(_fit_key(by)).join(
        fit.lazy(), on="_fit_key", how="left", nulls_equal=True, maintain_order="left",
    ).with_columns(pl.when(usable).then(recompute_ms - pl.col("prefill_ms")).alias("saved_ms"))
    grouped = per_turn.group_by(["run_id", "engine_id"]).agg(
        pl.len().alias("reused_remote_turns"),
        _measured_sum(pl.col("saved_ms")).alias("_saved_ms"),
    ).collect()
    # Every (run, engine) gets the fit's columns, also those without reused turns.
    keys = pl.concat([grouped.select("run_id", "engine_id"),
                      retentions.select("run_id", "engine_id")]).unique()
    out = keys.with_columns(_fit_key(by)).join(
        fit, on="_fit_key", how="left", nulls_equal=True,
    ).drop("_fit_key").join(grouped, on=["run_id", "engine_id"], how="left", nulls_equal=True)
    fit_turns = pl.col("fit_turns").fill_null(0)
    reused = pl.col("reused_remote_turns").fill_null(0)
    basis = (
        pl.when(reused == 0).then(pl.lit("no reused_remote turns: nothing saved"))
        .when(fit_turns < min_fit_turns)
        .then(pl.format("not measured: {} turns recomputed without a pull (the fit needs {})",
                        fit_turns, pl.lit(min_fit_turns)))
        .when(pl.col("fit_ms_per_token").is_null())
        .then(pl.format("not measured: the {} turns that recomputed all had one size",
                        fit_turns))
        .otherwise(pl.format(
            "estimate: prefill_ms = {} + {}·computed tokens over {} recomputing turns, R² = {}; "
            "saved = fitted recompute − observed prefill leg",
            pl.col("fit_fixed_ms").round(2), pl.col("fit_ms_per_token").round(5), fit_turns,
            pl.col("fit_r2").round(3)))
    )
    return out.with_columns(
        reused.cast(pl.Int64).alias("reused_remote_turns"),
        pl.when(reused == 0).then(pl.lit(0.0)).otherwise(pl.col("_saved_ms") / 1000.0)
        .alias("prefill_s_saved"),
        basis.alias("saved_basis"),
    ).drop("_saved_ms")


# What this module's analyses read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    "run_id", "turn_index", "arrival", "end", "outcome", "errored", "prompt_tokens", "prefill_ms",
    "local_hit_tokens", "d2p_status", "d2p_bytes", "retention_id", "decode_engine",
    "decode_queue_ms")


def retention_cost_table(
    retentions: pl.DataFrame, ledger: pl.DataFrame, samples: pl.DataFrame | None = None, *,
    fit_by: str = "run", min_fit_turns: int = 10,
) -> pl.DataFrame:
    """Retention cost per run × decode engine (pure: typed frames in, :data:`COST_COLUMNS` out)."""
    observed = observed_range(ledger, retentions, samples)
    rows = held(retentions, observed)
    reason = pl.col("reason")
    klass = pl.col("class")
    closed = pl.col("held_s").filter(~pl.col("held_to_end"))

    def gib(name: str) -> pl.Expr:
        return pl.when((klass == name).any()).then(
            _measured_sum(pl.col("gib_s").filter(klass == name))
        ).otherwise(pl.lit(0.0)).alias(f"gib_s_{name}")

    cost = rows.group_by(["run_id", "engine_id"]).agg(
        pl.len().alias("retentions"),
        (reason == semconv.RELEASE_READ).sum().alias("released_read"),
        (reason == semconv.RELEASE_NOTIFIED).sum().alias("released_notified"),
        (reason == semconv.RELEASE_EXPIRED).sum().alias("expired"),
        (reason == semconv.RELEASE_OPEN).sum().alias("open"),
        gib(CLASS_USEFUL), gib(CLASS_IDLE), gib(CLASS_WASTED), gib(CLASS_OPEN),
        _measured_sum(pl.col("gib_s")).alias("gib_s_total"),
        closed.quantile(0.5, "linear").alias("held_s_p50"),
        closed.quantile(0.9, "linear").alias("held_s_p90"),
        closed.max().alias("held_s_max"),
        pl.col("ttl_s").max().alias("ttl_s"),
        pl.when(pl.col("held_to_end").any()).then(pl.col("released").filter(
            pl.col("held_to_end")).max()).alias("open_held_until"),
    )
    fit = prefill_fit(ledger, fit_by)
    savings = prefill_savings(ledger, retentions, fit, fit_by, min_fit_turns)
    total = pl.col("gib_s_total")
    saved = pl.col("prefill_s_saved")
    queued = _decode_queue(ledger)
    table = cost.join(savings, on=["run_id", "engine_id"], how="full", coalesce=True,
                      nulls_equal=True).join(queued, on=["run_id", "engine_id"], how="left",
                                             nulls_equal=True).with_columns(
        pl.when(total > 0).then(pl.col("gib_s_useful") / total).alias("useful_share"),
        pl.when(pl.col("ttl_s") > 0).then(pl.col("held_s_p90") / pl.col("ttl_s"))
        .alias("held_p90_of_ttl"),
        pl.when(saved > 0).then(total / saved).alias("gib_s_per_prefill_s_saved"),
        pl.col("retentions").fill_null(0),
    )
    return table.select([pl.col(n).cast(t) for n, t in COST_COLUMNS.items()]).sort(
        ["run_id", "engine_id"], nulls_last=True)


def _decode_queue(ledger: pl.DataFrame) -> pl.DataFrame:
    """Per run × decode engine, the time its turns queued for KV blocks (ledger decode_queue_ms)."""
    schema = {"run_id": pl.String(), "engine_id": pl.String(),
              "decode_queue_s_total": pl.Float64(), "decode_queue_ms_p90": pl.Float64()}
    if not {"decode_queue_ms", "decode_engine"} <= set(ledger.columns):
        return pl.DataFrame(schema=schema)
    queue = pl.col("decode_queue_ms").cast(pl.Float64)
    return ledger.lazy().filter(
        queue.is_not_null() & pl.col("decode_engine").is_not_null()).group_by(
        "run_id", pl.col("decode_engine").alias("engine_id")).agg(
        (queue.sum() / 1000).alias("decode_queue_s_total"),
        queue.quantile(0.9, "linear").alias("decode_queue_ms_p90")).collect().cast(
        schema)  # type: ignore[arg-type]


def retained_series(
    retentions: pl.DataFrame, samples: pl.DataFrame, observed: pl.DataFrame, *,
    step_s: float = 10.0, max_points: int = 2000,
) -> pl.DataFrame:
    """Retained bytes and GPU memory over time, resampled (pure; :data:`MEMORY_COLUMNS`).

    Bins are aligned to multiples of the step from the epoch, so a run's series line up. A run
    whose time range would need more than ``max_points`` bins gets a longer step (its ``step_s``
    column says which); the output is bounded by runs × series × ``max_points``, whatever the
    number of spans. Retention spans give the time-weighted mean and the peak per bin; gauges
    give the mean and peak of their samples.
    """
    if step_s <= 0:
        raise ValueError(f"step_s must be > 0, got {step_s}")
    span_s = (pl.col("last") - pl.col("first")).dt.total_nanoseconds() / _NS
    steps = observed.select(
        "run_id", "first",
        (pl.max_horizontal(pl.lit(step_s), span_s / max(max_points - 1, 1)) * _NS)
        .ceil().cast(pl.Int64).alias("step_ns"),
    )
    frames = [_span_series(held(retentions, observed), steps)]
    frames.append(_gauge_series(samples, observed, steps))
    out = pl.concat([f.select([pl.col(n).cast(t) for n, t in MEMORY_COLUMNS.items()])
                     for f in frames])
    return out.sort(["run_id", "source", "engine_id", "gpu_host", "gpu_index", "time"],
                    nulls_last=True)


_SERIES_KEY = ["run_id", "engine_id"]


def _span_series(rows: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """Step function of retained bytes from retention spans, resampled per bin."""
    rows = rows.filter(pl.col("size_bytes").is_not_null()).join(
        steps.select("run_id", "step_ns"), on="run_id", how="left", nulls_equal=True)
    if rows.is_empty():
        return pl.DataFrame(schema=MEMORY_COLUMNS)
    t = pl.col("t")
    pins = rows.select(*_SERIES_KEY, "step_ns", pl.col("start").dt.epoch("ns").alias("t"),
                       pl.col("size_bytes").cast(pl.Float64).alias("delta"))
    frees = rows.select(*_SERIES_KEY, "step_ns", pl.col("released").dt.epoch("ns").alias("t"),
                        (-pl.col("size_bytes").cast(pl.Float64)).alias("delta"))
    # A zero-delta point at every bin start inside a series' range: each segment of the step
    # function then lies within one bin, so area per bin is a plain group sum.
    bounds = pl.concat([pins, frees]).group_by(_SERIES_KEY).agg(
        pl.col("step_ns").first(), t.min().alias("t0"), t.max().alias("t1"))
    grid = bounds.with_columns(
        pl.int_ranges(pl.col("t0") // pl.col("step_ns") + 1,
                      pl.col("t1") // pl.col("step_ns") + 1).alias("bin"),
    ).explode("bin").filter(pl.col("bin").is_not_null()).select(
        *_SERIES_KEY, "step_ns", (pl.col("bin") * pl.col("step_ns")).alias("t"),
        pl.lit(0.0).alias("delta"))
    # Releases before pins at the same instant: a bin's peak never counts both.
    events = pl.concat([pins, frees, grid]).sort([*_SERIES_KEY, "t", "delta"],
                                                 nulls_last=True)
    events = events.with_columns(
        pl.col("delta").cum_sum().over(_SERIES_KEY).clip(lower_bound=0.0).alias("level"),
        (t.shift(-1).over(_SERIES_KEY) - t).fill_null(0).alias("dt"),
        (t // pl.col("step_ns")).alias("bin"),
    )
    binned = events.group_by([*_SERIES_KEY, "bin"]).agg(
        pl.col("step_ns").first(),
        (pl.col("level") * pl.col("dt")).sum().alias("_area"),
        pl.col("level").max().alias("max_bytes"),
        (pl.col("delta") != 0).sum().alias("points"),
    )
    return binned.with_columns(
        pl.lit(SOURCE_RETENTION_SPANS).alias("source"),
        pl.lit(None, pl.String).alias("gpu_host"), pl.lit(None, pl.String).alias("gpu_index"),
        pl.from_epoch(pl.col("bin") * pl.col("step_ns"), time_unit="ns").alias("time"),
        # Outside a series' first pin and last release nothing is held: the mean is over the bin.
        (pl.col("_area") / pl.col("step_ns")).alias("mean_bytes"),
        (pl.col("step_ns") / _NS).alias("step_s"),
    )


def _gauge_series(samples: pl.DataFrame, observed: pl.DataFrame,
                  steps: pl.DataFrame) -> pl.DataFrame:
    """Gauge samples binned per series; samples without a run go to the runs they overlap."""
    if samples.is_empty():
        return pl.DataFrame(schema=MEMORY_COLUMNS)
    tagged = samples.filter(pl.col("run_id").is_not_null())
    untagged = samples.filter(pl.col("run_id").is_null()).drop("run_id")
    if not untagged.is_empty():
        ranges = observed.filter(pl.col("run_id").is_not_null())
        attached = untagged.join(ranges, how="cross").filter(
            pl.col("time").is_between(pl.col("first"), pl.col("last"))
        ).select(samples.columns)
        if ranges.is_empty():
            attached = samples.filter(pl.col("run_id").is_null())
        tagged = pl.concat([tagged, attached])
    key = ["run_id", "source", "engine_id", "gpu_host", "gpu_index"]
    with_step = tagged.join(steps.select("run_id", "step_ns"), on="run_id", how="left",
                            nulls_equal=True).with_columns(
        pl.col("step_ns").fill_null(pl.lit(10 * _NS)))
    binned = with_step.with_columns(
        (pl.col("time").dt.epoch("ns") // pl.col("step_ns")).alias("bin"),
    ).group_by([*key, "bin"]).agg(
        pl.col("step_ns").first(),
        pl.col("value").mean().alias("mean_bytes"),
        pl.col("value").max().alias("max_bytes"),
        pl.len().alias("points"),
    )
    return binned.with_columns(
        pl.from_epoch(pl.col("bin") * pl.col("step_ns"), time_unit="ns").alias("time"),
        (pl.col("step_ns") / _NS).alias("step_s"),
    )


# --- registered analyses ------------------------------------------------------------------------

@register(
    "retention_cost",
    "Retention cost per decode engine: GiB·s useful / idle / wasted / open, per prefill-s saved",
    params=(
        Param("fit", str, "run", "fit the prefill cost per run, or over all runs together",
              FIT_SCOPES),
        Param("min_fit_turns", int, 10,
              "fewest recomputing turns the prefill-cost fit needs (else not measured)"),
    ),
    columns=COST_COLUMNS,
)
def retention_cost(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return retention_cost_table(
        load_retentions(ctx), ctx.ledger(LEDGER_COLUMNS), load_samples(ctx),
        fit_by=params["fit"], min_fit_turns=params["min_fit_turns"],
    )


@register(
    "retained_memory",
    "Retained KV bytes over time per decode engine, beside GPU memory samples",
    params=(
        Param("step_s", float, 10.0, "resampling step in seconds (longer where a run needs it)"),
        Param("max_points", int, 2000, "most points per series"),
    ),
    columns=MEMORY_COLUMNS,
)
def retained_memory(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    retentions = load_retentions(ctx)
    samples = load_samples(ctx)
    observed = observed_range(ctx.ledger(LEDGER_COLUMNS), retentions, samples)
    return retained_series(retentions, samples, observed, step_s=params["step_s"],
                           max_points=params["max_points"])


__all__ = ["CLASS_IDLE", "CLASS_OF_REASON", "CLASS_OPEN", "CLASS_USEFUL", "CLASS_WASTED",
    "COST_COLUMNS", "FIT_SCOPES", "GIB", "LEDGER_COLUMNS", "MEMORY_COLUMNS", "READ_HANDLE_COLUMNS",
    "RETENTION_QUERY", "RETENTION_SCHEMA", "SAMPLES_QUERY", "SAMPLE_SCHEMA", "SOURCE_GPU_TOTAL",
    "SOURCE_GPU_USED", "SOURCE_OF_METRIC", "SOURCE_RETAINED_GAUGE", "SOURCE_RETENTION_SPANS",
    "held", "load_retentions", "load_samples", "observed_range", "prefill_fit", "prefill_savings",
    "read_handles", "retained_memory", "retained_series", "retention_cost", "retention_cost_table",
    "shape_retentions", "shape_samples", "upgrade_reads", "without_superseded_snapshots"]
