"""Task time: how long each conversation (agent task) took end to end, and where the time went.

Per conversation (DESIGN §5, task time): first arrival → last byte, split into

* ``input_processing`` — the prefill legs minus the D→P transfers inside them,
* ``transfer`` — D→P reads (inside prefill legs) plus P→D pulls (inside decode legs),
* ``generation`` — the decode legs minus the P→D pulls inside them,
* ``tool_wait`` — the gaps between a turn's last byte and the next turn's arrival (the proxy's
  ``kvscope.tool_wait`` span; inferred from the turns' times where that span is missing),
* ``proxy_overhead`` — each turn's duration minus its two legs (turns the proxy recorded),

and ``unaccounted`` = task − the five parts: about 0 when turns run one after another,
negative when turns of one conversation overlap. Σ TTFT and its share of the task say how much
of the task the first-token latency (what reuse shortens) is.

Transfers are known only from the engine hooks: in a conversation with no engine span at all the
transfer part is null ("not measured") and the legs are reported whole. Every part is null when
none of the conversation's turns measured it, never 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope import semconv
from kvscope.analysis.ledger import hook_decided
from kvscope.analysis.registry import AnalysisContext, intermediate, register

PARTS = ("input_processing", "transfer", "generation", "tool_wait", "proxy_overhead")
COMPONENTS = ("task", *PARTS, "unaccounted", "ttft")
# From vLLM's own llm_request spans (ledger engine_ttft_ms, engine_queue_ms), beside the TTFT
# the proxy or client saw; not parts of the task's sum.
ENGINE_COMPONENTS = ("engine_ttft", "engine_queue")

COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "conversation_id": pl.String(),
    "turns": pl.Int64(),
    "errored_turns": pl.Int64(),
    "first_arrival": pl.Datetime("ns"),
    "last_end": pl.Datetime("ns"),
    "task_s": pl.Float64(),
    "input_processing_s": pl.Float64(),
    "transfer_s": pl.Float64(),
    "generation_s": pl.Float64(),
    "tool_wait_s": pl.Float64(),
    "proxy_overhead_s": pl.Float64(),
    "unaccounted_s": pl.Float64(),
    "ttft_sum_s": pl.Float64(),
    "ttft_share": pl.Float64(),
    "engine_ttft_sum_s": pl.Float64(),
    "engine_queue_s": pl.Float64(),
}

SUMMARY_COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "component": pl.String(),
    "conversations": pl.Int64(),
    "p50_s": pl.Float64(),
    "p90_s": pl.Float64(),
    "mean_s": pl.Float64(),
    "total_s": pl.Float64(),
    "share_of_task": pl.Float64(),
    "share_p50": pl.Float64(),
    "share_p90": pl.Float64(),
}

_CONVERSATION = ["run_id", "conversation_id"]


def _measured_sum(expr: pl.Expr) -> pl.Expr:
    """Σ over measured values; null (not 0) when no turn measured it."""
    return pl.when(expr.is_not_null().any()).then(expr.sum())


# What this module's analyses read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    "run_id", "conversation_id", "turn_index", "arrival", "end", "observer", "errored", "turn_ms",
    "ttft_ms", "prefill_ms", "decode_ms", "d2p_ms", "p2d_ms", "tool_wait_s", "decision",
    "engine_evidence", "engine_ttft_ms", "engine_queue_ms")


def task_table(ledger: pl.DataFrame) -> pl.DataFrame:
    """Task time per conversation and its parts, in seconds (pure: ledger in, :data:`COLUMNS`)."""
    c = pl.col
    # A request only engine spans know has no conversation: it is no part of a task.
    ledger = ledger.filter(c("observer").ne_missing(semconv.OBSERVER_ENGINE))
    # Transfer spans come from the engine hooks: with hooks seen in the conversation, a turn
    # without one moved nothing; without any, transfer time is unknown (and inside the legs).
    hooks = (hook_decided(ledger) | c("d2p_ms").is_not_null() | c("p2d_ms").is_not_null()).any()
    # Only transfers inside a leg the proxy timed are part of the turn (a stalled prefill leg
    # can still show a P→D pull that no decode leg waited for).
    d2p = pl.when(c("prefill_ms").is_not_null()).then(c("d2p_ms").fill_null(0.0))
    p2d = pl.when(c("decode_ms").is_not_null()).then(c("p2d_ms").fill_null(0.0))
    previous_end = c("end").shift(1).over(_CONVERSATION, order_by=["turn_index", "arrival"])
    gap_s = (c("arrival") - previous_end).dt.total_nanoseconds() / 1e9
    turns = ledger.with_columns(
        (c("prefill_ms") - d2p).alias("_input_ms"),
        (d2p.fill_null(0.0) + p2d.fill_null(0.0)).alias("_transfer_ms"),
        (c("decode_ms") - p2d).alias("_generation_ms"),
        # The proxy runs the legs it can; a leg span that is missing did not run. A turn only
        # its client recorded has no legs to subtract: its overhead is not measured.
        pl.when(c("observer").is_null()).then(
            c("turn_ms") - c("prefill_ms").fill_null(0.0) - c("decode_ms").fill_null(0.0))
        .alias("_overhead_ms"),
        pl.coalesce(c("tool_wait_s"), gap_s.clip(lower_bound=0.0)).alias("_wait_s"),
    )
    table = turns.group_by(_CONVERSATION).agg(
        pl.len().alias("turns"),
        c("errored").fill_null(False).sum().alias("errored_turns"),
        c("arrival").min().alias("first_arrival"),
        c("end").max().alias("last_end"),
        (_measured_sum(c("_input_ms")) / 1000.0).alias("input_processing_s"),
        pl.when(hooks).then(c("_transfer_ms").sum() / 1000.0).alias("transfer_s"),
        (_measured_sum(c("_generation_ms")) / 1000.0).alias("generation_s"),
        # A one-turn task has no gaps: its tool wait is a measured 0.
        pl.when(pl.len() == 1).then(pl.lit(0.0))
        .otherwise(_measured_sum(c("_wait_s"))).alias("tool_wait_s"),
        (_measured_sum(c("_overhead_ms")) / 1000.0).alias("proxy_overhead_s"),
        (_measured_sum(c("ttft_ms")) / 1000.0).alias("ttft_sum_s"),
        *[(_measured_sum(c(name)) / 1000.0).alias(alias)
          for name, alias in (("engine_ttft_ms", "engine_ttft_sum_s"),
                              ("engine_queue_ms", "engine_queue_s"))
          if name in ledger.columns],
    )
    task = (c("last_end") - c("first_arrival")).dt.total_nanoseconds() / 1e9
    # Without transfers measured the legs are whole, so the other parts still add up.
    parts = pl.sum_horizontal(
        [c("transfer_s").fill_null(0.0) if p == "transfer" else c(f"{p}_s") for p in PARTS],
        ignore_nulls=False,
    )
    # A ledger without vLLM's own span columns (frames shaped by a caller): not measured.
    table = table.with_columns(pl.lit(None, pl.Float64).alias(name) for name in (
        "engine_ttft_sum_s", "engine_queue_s") if name not in table.columns)
    return table.with_columns(task.alias("task_s")).with_columns(
        (c("task_s") - parts).alias("unaccounted_s"),
        pl.when(c("task_s") > 0).then(c("ttft_sum_s") / c("task_s")).alias("ttft_share"),
    ).select([c(n).cast(t) for n, t in COLUMNS.items()]).sort(_CONVERSATION)


def task_summary(table: pl.DataFrame) -> pl.DataFrame:
    """Per run and component: median, p90, mean, total, and share of task time (pure).

    ``share_of_task`` = Σ component / Σ task over the conversations where both were measured;
    ``share_p50``/``share_p90`` are quantiles of the per-conversation share.
    """
    column = {name: f"{name}_s" for name in (*COMPONENTS, *ENGINE_COMPONENTS)}
    column["ttft"] = "ttft_sum_s"
    column["engine_ttft"] = "engine_ttft_sum_s"
    long = table.unpivot(
        index=["run_id", "conversation_id", "task_s"], on=list(column.values()),
        variable_name="_column", value_name="seconds",
    ).with_columns(
        pl.col("_column").replace_strict({v: k for k, v in column.items()}).alias("component"),
        pl.when(pl.col("task_s") > 0).then(pl.col("seconds") / pl.col("task_s")).alias("_share"),
    )
    measured = pl.col("seconds").is_not_null()
    summary = long.group_by(["run_id", "component"]).agg(
        measured.sum().alias("conversations"),
        pl.col("seconds").quantile(0.5, "linear").alias("p50_s"),
        pl.col("seconds").quantile(0.9, "linear").alias("p90_s"),
        pl.col("seconds").mean().alias("mean_s"),
        _measured_sum(pl.col("seconds")).alias("total_s"),
        pl.col("task_s").filter(measured).sum().alias("_task_total"),
        pl.col("_share").quantile(0.5, "linear").alias("share_p50"),
        pl.col("_share").quantile(0.9, "linear").alias("share_p90"),
    ).with_columns(
        pl.when(pl.col("_task_total") > 0).then(pl.col("total_s") / pl.col("_task_total"))
        .alias("share_of_task"),
        pl.col("component").replace_strict(
            {name: i for i, name in enumerate((*COMPONENTS, *ENGINE_COMPONENTS))},
            return_dtype=pl.Int64
        ).alias("_order"),
    )
    return summary.sort(["run_id", "_order"]).select(
        [pl.col(n).cast(t) for n, t in SUMMARY_COLUMNS.items()])


@register("task_time", "Task time per conversation: input, transfer, generation, tool wait, "
          "proxy overhead; TTFT share", columns=COLUMNS)
def task_time(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    frame: pl.DataFrame = ctx.get(_tasks)
    return frame


@intermediate("task_table", shared=False)
def _tasks(ctx: AnalysisContext) -> pl.DataFrame:
    return task_table(ctx.ledger(LEDGER_COLUMNS))


@register("task_time_summary", "Task time per run: median and p90 of each part, TTFT share",
          columns=SUMMARY_COLUMNS)
def task_time_summary(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return task_summary(ctx.get(_tasks))


__all__ = ["COLUMNS", "COMPONENTS", "ENGINE_COMPONENTS", "LEDGER_COLUMNS", "PARTS",
    "SUMMARY_COLUMNS", "task_summary", "task_table", "task_time", "task_time_summary"]
