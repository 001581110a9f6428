"""A/B comparison of two runs (feature ON vs OFF): TTFT by prompt length, prefill split, reuse.

Three steps (STYLE §8): the ledger and the run table come from the context (no SQL of its own
beyond the run table), pure functions shape them (:func:`run_info`, :func:`run_stats`,
:func:`prompt_bins`, :func:`by_prompt_table`, :func:`summary_table`), and two registered wrappers
expose them: ``compare`` (one row per metric, the two runs side by side, ratio a / b) and
``compare_by_prompt`` (p50/p90 TTFT and the prefill split per prompt-length bin per run).

Which runs: the ``runs`` parameter names two run ids or labels. Without it, the pair is chosen
from the selected runs (:func:`kvscope.analysis.runs.pick_runs`): a feature-ON run and a
feature-OFF run of the same workload (the most recent such pair), else the only two runs.

Prefill split: ``transfer`` is the D→P read time inside the prefill leg (``d2p_ms``; 0 for a turn
with no read when the run has engine hooks), ``compute`` = prefill leg − transfer. Without engine
hooks neither is measured: null, never 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import polars as pl

from kvscope.analysis import registry
from kvscope.analysis.ledger import hook_decided
from kvscope.analysis.registry import (
    AnalysisContext,
    AnalysisError,
    Param,
    intermediate,
    register,
)
from kvscope.analysis.reuse import LEDGER_COLUMNS as _REUSE_READS
from kvscope.analysis.reuse import reuse_table
from kvscope.analysis.runs import LEDGER_COLUMNS as _RUNS_READS
from kvscope.analysis.runs import all_runs, context_run_info, pick_runs, run_info
from kvscope.reuse import outcomes

STATS_COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "turns": pl.Int64(),
    "conversations": pl.Int64(),
    "errored_turns": pl.Int64(),
    "ttft_p50_ms": pl.Float64(),
    "ttft_p90_ms": pl.Float64(),
    "prefill_ms_mean": pl.Float64(),
    "prefill_compute_ms_mean": pl.Float64(),
    "transfer_ms_mean": pl.Float64(),
    "task_time_p50_s": pl.Float64(),
    "task_time_p90_s": pl.Float64(),
    "task_time_total_s": pl.Float64(),
    "ttft_share_of_task": pl.Float64(),
    "turns_reused_remote": pl.Int64(),
    "turns_reused_local": pl.Int64(),
    "engine_hooks": pl.Boolean(),
}

BY_PROMPT_COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "label": pl.String(),
    "bin": pl.Int64(),
    "bin_lo_tokens": pl.Int64(),
    "bin_hi_tokens": pl.Int64(),
    "turns": pl.Int64(),
    "ttft_p50_ms": pl.Float64(),
    "ttft_p90_ms": pl.Float64(),
    "prefill_ms_mean": pl.Float64(),
    "prefill_compute_ms_mean": pl.Float64(),
    "transfer_ms_mean": pl.Float64(),
}

SUMMARY_COLUMNS: dict[str, pl.DataType] = {
    "metric": pl.String(),
    "unit": pl.String(),
    "run_a": pl.String(),
    "label_a": pl.String(),
    "value_a": pl.Float64(),
    "run_b": pl.String(),
    "label_b": pl.String(),
    "value_b": pl.Float64(),
    "ratio": pl.Float64(),
}

# Metrics of the summary: (name, unit) in display order.
SUMMARY_METRICS: tuple[tuple[str, str], ...] = (
    ("turns", "turns"),
    ("conversations", "conversations"),
    ("ttft_p50_ms", "ms"),
    ("ttft_p90_ms", "ms"),
    ("prefill_compute_ms_mean", "ms"),
    ("transfer_ms_mean", "ms"),
    ("task_time_p50_s", "s"),
    ("task_time_p90_s", "s"),
    ("task_time_total_s", "s"),
    ("ttft_share_of_task", "fraction"),
    ("token_reuse_rate", "fraction"),
    ("local_share", "fraction"),
    ("remote_share", "fraction"),
    ("turns_reused_remote", "turns"),
    ("turns_reused_local", "turns"),
    ("retained_gib_s", "GiB*s"),
    ("retained_peak_gib", "GiB"),
    ("useful_gib_s", "GiB*s"),
    ("idle_gib_s", "GiB*s"),
    ("wasted_gib_s", "GiB*s"),
)

# retention_cost's columns (analysis/retention.py) → the names used here.
_RETENTION_TOTAL = "gib_s_total"
_RETENTION_PARTS = {"useful_gib_s": "gib_s_useful", "idle_gib_s": "gib_s_idle",
                    "wasted_gib_s": "gib_s_wasted"}
# retained_memory's sources of retained bytes (analysis/retention.py), best first.
_RETAINED_SOURCES = ("retained_bytes_gauge", "retention_spans")
PEAK_COLUMNS: dict[str, pl.DataType] = {"run_id": pl.String(), "retained_peak_gib": pl.Float64()}
RETENTION_COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "retained_gib_s": pl.Float64(),
    "useful_gib_s": pl.Float64(),
    "idle_gib_s": pl.Float64(),
    "wasted_gib_s": pl.Float64(),
}


_Frame = TypeVar("_Frame", pl.DataFrame, pl.LazyFrame)


# --- per-run numbers --------------------------------------------------------------------------


def _with_prefill_split(ledger: _Frame) -> _Frame:
    """Add ``transfer_ms`` and ``compute_ms`` (null where the run had no engine hooks)."""
    # hook_decided looks only at which columns there are: an empty frame of the schema serves.
    hooks = hook_decided(pl.DataFrame(schema=ledger.collect_schema())).any().over("run_id")
    transfer = pl.when(hooks).then(pl.col("d2p_ms").fill_null(0.0))
    return ledger.with_columns(
        transfer.alias("transfer_ms"), hooks.alias("engine_hooks")
    ).with_columns(
        (pl.col("prefill_ms") - pl.col("transfer_ms")).clip(lower_bound=0.0).alias("compute_ms")
    )


def run_stats(ledger: pl.DataFrame) -> pl.DataFrame:
    """TTFT, prefill split, task time and reused-turn counts per run (pure).

    Task time per conversation = first arrival → last byte; the TTFT share is Σ TTFT over Σ task
    time (turns without a TTFT, e.g. errored ones, add nothing).
    """
    split = _with_prefill_split(ledger)
    per_turn = split.group_by("run_id", maintain_order=True).agg(
        pl.len().alias("turns"),
        pl.col("conversation_id").n_unique().alias("conversations"),
        pl.col("errored").sum().alias("errored_turns"),
        pl.col("ttft_ms").quantile(0.5, "linear").alias("ttft_p50_ms"),
        pl.col("ttft_ms").quantile(0.9, "linear").alias("ttft_p90_ms"),
        pl.col("prefill_ms").mean().alias("prefill_ms_mean"),
        pl.col("compute_ms").mean().alias("prefill_compute_ms_mean"),
        pl.col("transfer_ms").mean().alias("transfer_ms_mean"),
        (pl.col("ttft_ms").sum() / 1e3).alias("_ttft_s"),
        pl.col("ttft_ms").is_not_null().any().alias("_ttft_seen"),
        (pl.col("outcome") == outcomes.REUSED_REMOTE).sum().alias("turns_reused_remote"),
        (pl.col("outcome") == outcomes.REUSED_LOCAL).sum().alias("turns_reused_local"),
        pl.col("engine_hooks").first().alias("engine_hooks"),
    )
    tasks = (
        ledger.group_by(["run_id", "conversation_id"])
        .agg(((pl.col("end").max() - pl.col("arrival").min()).dt.total_microseconds() / 1e6)
             .alias("task_s"))
        .group_by("run_id")
        .agg(
            pl.col("task_s").quantile(0.5, "linear").alias("task_time_p50_s"),
            pl.col("task_s").quantile(0.9, "linear").alias("task_time_p90_s"),
            # A run with no task time measured (no turn ends) has no total, not 0.
            pl.when(pl.col("task_s").is_not_null().any()).then(pl.col("task_s").sum())
            .alias("task_time_total_s"),
        )
    )
    joined = per_turn.join(tasks, on="run_id", how="left").with_columns(
        pl.when(pl.col("_ttft_seen") & (pl.col("task_time_total_s") > 0))
        .then(pl.col("_ttft_s") / pl.col("task_time_total_s")).alias("ttft_share_of_task")
    )
    return joined.select([pl.col(c).cast(t) for c, t in STATS_COLUMNS.items()])


def retention_totals(frame: pl.DataFrame | None) -> pl.DataFrame:
    """Retained GiB·s per run (engines summed) from the ``retention_cost`` result (pure).

    Empty, so every value reads "not measured", when the analysis is absent or lacks its total.
    """
    if frame is None or not {"run_id", _RETENTION_TOTAL} <= set(frame.columns):
        return pl.DataFrame(schema=RETENTION_COLUMNS)
    parts = [
        (pl.col(source).sum() if source in frame.columns else pl.lit(None, pl.Float64))
        .alias(name)
        for name, source in _RETENTION_PARTS.items()
    ]
    out = frame.group_by("run_id", maintain_order=True).agg(
        pl.col(_RETENTION_TOTAL).sum().alias("retained_gib_s"), *parts
    )
    return out.select([pl.col(c).cast(t) for c, t in RETENTION_COLUMNS.items()])


def retained_peak(frame: pl.DataFrame | None) -> pl.DataFrame:
    """Peak retained GiB per run from the ``retained_memory`` series (pure; empty when absent).

    Per run, the best source present (the decode's own gauge, else the retention spans); per
    time bin the engines' mean bytes are summed; the peak is the largest such sum. Binned means
    smooth spikes shorter than a bin, so this is a lower bound on the instantaneous peak.
    """
    needed = {"run_id", "source", "time", "mean_bytes"}
    if frame is None or not needed <= set(frame.columns):
        return pl.DataFrame(schema=PEAK_COLUMNS)
    rank = {source: i for i, source in enumerate(_RETAINED_SOURCES)}
    rows = frame.filter(pl.col("source").is_in(_RETAINED_SOURCES)).with_columns(
        pl.col("source").replace_strict(rank, return_dtype=pl.Int64).alias("_rank"))
    best = rows.filter(pl.col("_rank") == pl.col("_rank").min().over("run_id"))
    out = (best.group_by(["run_id", "time"]).agg(pl.col("mean_bytes").sum())
           .group_by("run_id").agg((pl.col("mean_bytes").max() / float(1 << 30))
                                   .alias("retained_peak_gib")))
    return out.select([pl.col(c).cast(t) for c, t in PEAK_COLUMNS.items()])


def optional_analysis(ctx: AnalysisContext, name: str,
                      params: Mapping[str, Any] | None = None) -> pl.DataFrame | None:
    """The result of analysis ``name``, or None while no module registers it."""
    if name not in registry.analyses():
        return None
    return registry.run(ctx, name, params)


def context_retention(ctx: AnalysisContext) -> pl.DataFrame:
    """Retained GiB·s per selected run; empty (not measured) without ``retention_cost``."""
    return retention_totals(optional_analysis(ctx, "retention_cost"))


# --- comparison -------------------------------------------------------------------------------


def _nice(value: float) -> int:
    """``value`` rounded to two significant digits (readable bin edges)."""
    if value <= 0:
        return 0
    digits = len(str(int(value))) - 2
    step = 10 ** max(digits, 0)
    return int(round(value / step) * step)


def prompt_bins(prompt_tokens: pl.Series, bins: int) -> list[int]:
    """Inner bin edges: quantiles of the prompt lengths, rounded, strictly increasing (pure)."""
    values = prompt_tokens.drop_nulls()
    if values.is_empty() or bins <= 1:
        return []
    edges: list[int] = []
    for i in range(1, bins):
        q = values.quantile(i / bins, "nearest")
        edge = _nice(float(q)) if q is not None else 0
        if edge > 0 and (not edges or edge > edges[-1]):
            edges.append(edge)
    return edges


def by_prompt_table(ledger: pl.DataFrame, labels: Mapping[str, str], edges: Sequence[int],
                    ) -> pl.DataFrame:
    """p50/p90 TTFT and the mean prefill split per prompt-length bin per run (pure).

    Bin i covers [edge_{i-1}, edge_i) with open ends; ``bin_lo_tokens``/``bin_hi_tokens`` are
    the observed minimum and maximum prompt length in the bin (so the open ends read true).
    """
    # Lazy: only the columns read are filtered (an eager filter copies every column given).
    split = _with_prefill_split(ledger.lazy().filter(pl.col("prompt_tokens").is_not_null()))
    bin_index = pl.sum_horizontal(
        [(pl.col("prompt_tokens") >= e).cast(pl.Int64) for e in edges] or [pl.lit(0, pl.Int64)]
    )
    table = (
        split.with_columns(bin_index.alias("bin"))
        .group_by(["run_id", "bin"])
        .agg(
            pl.col("prompt_tokens").min().alias("bin_lo_tokens"),
            pl.col("prompt_tokens").max().alias("bin_hi_tokens"),
            pl.len().alias("turns"),
            pl.col("ttft_ms").quantile(0.5, "linear").alias("ttft_p50_ms"),
            pl.col("ttft_ms").quantile(0.9, "linear").alias("ttft_p90_ms"),
            pl.col("prefill_ms").mean().alias("prefill_ms_mean"),
            pl.col("compute_ms").mean().alias("prefill_compute_ms_mean"),
            pl.col("transfer_ms").mean().alias("transfer_ms_mean"),
        )
        .with_columns(pl.col("run_id").replace_strict(labels, default=pl.col("run_id"))
                      .alias("label"))
    )
    order = {run: i for i, run in enumerate(labels)}
    return (
        table.with_columns(pl.col("run_id").replace_strict(order, default=len(order),
                                                           return_dtype=pl.Int64).alias("_o"))
        .sort(["bin", "_o"])
        .select([pl.col(c).cast(t) for c, t in BY_PROMPT_COLUMNS.items()])
    ).collect()


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def summary_table(pair: tuple[str, str], labels: Mapping[str, str], stats: pl.DataFrame,
                  reuse: pl.DataFrame, retention: pl.DataFrame) -> pl.DataFrame:
    """The two runs' metrics side by side, one row per metric, with ratio a / b (pure)."""
    merged = stats.join(
        reuse.select("run_id", "token_reuse_rate", "local_share", "remote_share"),
        on="run_id", how="left",
    ).join(retention, on="run_id", how="left")
    values: dict[str, dict[str, Any]] = {
        row["run_id"]: row for row in merged.iter_rows(named=True)
    }
    a, b = pair
    rows = []
    for metric, unit in SUMMARY_METRICS:
        va = values.get(a, {}).get(metric)
        vb = values.get(b, {}).get(metric)
        va = None if va is None else float(va)
        vb = None if vb is None else float(vb)
        rows.append({"metric": metric, "unit": unit, "run_a": a, "label_a": labels.get(a),
                     "value_a": va, "run_b": b, "label_b": labels.get(b), "value_b": vb,
                     "ratio": _ratio(va, vb)})
    return pl.DataFrame(rows, schema=SUMMARY_COLUMNS)


def _labels(info: pl.DataFrame, pair: Sequence[str]) -> dict[str, str]:
    """Display names for ``pair``, in that order: label, plus the id when labels repeat."""
    names = dict(info.select("run_id", "label").rows())
    labels = {run: names.get(run) or run for run in pair}
    if len(set(labels.values())) < len(labels):
        labels = {run: f"{name} ({run})" for run, name in labels.items()}
    return labels


def comparison(ctx: AnalysisContext, runs: Sequence[str] | None = None, bins: int = 8,
               ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(summary, by-prompt table) for the pair ``runs`` names, or the chosen pair (cached)."""
    pair = pick_runs(ctx, runs)
    result: tuple[pl.DataFrame, pl.DataFrame] = ctx.get(_comparison, pair, bins)
    return result


# What this module's analyses read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    ("run_id", "conversation_id", "arrival", "end", "outcome", "errored", "prompt_tokens",
    "prefill_ms", "ttft_ms", "d2p_ms", "decision", "engine_evidence") + _REUSE_READS + _RUNS_READS)


@intermediate("comparison", shared=False)
def _comparison(ctx: AnalysisContext, pair: tuple[str, str], bins: int,
                ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Build both comparison tables for ``pair``."""
    info = run_info(all_runs(ctx), ctx.ledger(_RUNS_READS))
    labels = _labels(info, pair)
    ledger = ctx.ledger(LEDGER_COLUMNS)
    if not ledger["run_id"].is_in(pair).all():  # a filtered copy only when other runs are in
        ledger = ledger.filter(pl.col("run_id").is_in(pair))
    if ledger.is_empty():
        raise AnalysisError(f"runs {pair[0]} and {pair[1]} have no turns in the store")
    edges = prompt_bins(ledger["prompt_tokens"], bins)
    by_prompt = by_prompt_table(ledger, labels, edges)
    retention = context_retention(ctx).join(
        retained_peak(optional_analysis(ctx, "retained_memory")), on="run_id", how="full",
        coalesce=True)
    summary = summary_table(pair, labels, run_stats(ledger), reuse_table(ledger, "run"),
                            retention)
    return summary, by_prompt


_RUNS_PARAM = Param("runs", list, None, "two run ids or labels (default: an ON/OFF pair)")


@register(
    "compare",
    "Two runs side by side (TTFT, task time, prefill split, reuse, retention; ratio a / b)",
    params=(_RUNS_PARAM,),
    columns=SUMMARY_COLUMNS,
)
def compare(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return comparison(ctx, params["runs"])[0]


@register(
    "compare_by_prompt",
    "TTFT p50/p90 and prefill compute vs transfer per prompt-length bin, two runs",
    params=(_RUNS_PARAM, Param("bins", int, 8, "number of prompt-length bins (quantiles)")),
    columns=BY_PROMPT_COLUMNS,
)
def compare_by_prompt(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return comparison(ctx, params["runs"], params["bins"])[1]


@register(
    "by_prompt",
    "TTFT p50/p90 and prefill compute vs transfer per prompt-length bin, every selected run",
    params=(Param("bins", int, 8, "number of prompt-length bins (quantiles)"),),
    columns=BY_PROMPT_COLUMNS,
)
def by_prompt(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    """What a single run (a production store's usual case) shows instead of an A/B overlay."""
    ledger = ctx.ledger(LEDGER_COLUMNS)
    if ledger.is_empty():
        raise AnalysisError("no turns in the selected runs")
    info = context_run_info(ctx)
    labels = {row["run_id"]: row["label"] or row["run_id"] for row in info.iter_rows(named=True)}
    edges = prompt_bins(ledger["prompt_tokens"], params["bins"])
    return by_prompt_table(ledger, labels, edges)


__all__ = ["BY_PROMPT_COLUMNS", "LEDGER_COLUMNS", "PEAK_COLUMNS", "RETENTION_COLUMNS",
    "STATS_COLUMNS", "SUMMARY_COLUMNS", "SUMMARY_METRICS", "by_prompt", "by_prompt_table",
    "compare", "compare_by_prompt", "comparison", "context_retention", "optional_analysis",
    "prompt_bins", "retained_peak", "retention_totals", "run_stats", "summary_table"]
