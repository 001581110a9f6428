"""Turns over time and by engine: TTFT percentiles and outcomes per time window or prefill engine.

Three registered analyses the dashboard's overview and missed-reuse pages draw, and the report
can show: ``ttft_windows`` (TTFT p50/p90 per run and window), ``outcome_windows`` (turns k ≥ 2 per
run, window and outcome) and ``outcome_engines`` (turns k ≥ 2 per prefill engine and outcome, the
selected runs together). Windows are ``window_s`` seconds of wall time, truncated from the turn's
arrival. The shaping functions are pure; the wrappers read the context's ledger.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope.analysis.registry import AnalysisContext, Param, register

__all__ = ["ENGINE_COLUMNS", "LEDGER_COLUMNS", "OUTCOME_COLUMNS", "TTFT_COLUMNS", "outcome_engines",
    "outcome_engines_analysis", "outcome_windows", "outcome_windows_analysis", "ttft_windows",
    "ttft_windows_analysis"]

TTFT_COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(), "window_start": pl.Datetime("ns"), "turns": pl.UInt32(),
    "ttft_p50_ms": pl.Float64(), "ttft_p90_ms": pl.Float64(),
}
OUTCOME_COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(), "window_start": pl.Datetime("ns"), "outcome": pl.String(),
    "turns": pl.UInt32(),
}
ENGINE_COLUMNS: dict[str, pl.DataType] = {
    "prefill_engine": pl.String(), "outcome": pl.String(), "turns": pl.UInt32(),
}
_WINDOW = Param("window_s", float, 60.0, "window length (s)")


def _window(ledger: pl.DataFrame, window_s: float) -> pl.DataFrame:
    return ledger.with_columns(
        pl.col("arrival").dt.truncate(f"{max(int(window_s), 1)}s").alias("window_start"))


def _later(ledger: pl.DataFrame) -> pl.DataFrame:
    return ledger.filter(pl.col("turn_index") >= 2) if not ledger.is_empty() else ledger


# What this module's analyses read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    "run_id", "turn_index", "arrival", "outcome", "ttft_ms", "prefill_engine")


def ttft_windows(ledger: pl.DataFrame, window_s: float = 60.0) -> pl.DataFrame:
    """TTFT p50/p90 per run and time window; null where no turn of the window measured it."""
    if ledger.is_empty():
        return pl.DataFrame(schema=TTFT_COLUMNS)
    return (_window(ledger, window_s).group_by("run_id", "window_start")
            .agg(pl.len().alias("turns"),
                 pl.col("ttft_ms").quantile(0.5, "linear").alias("ttft_p50_ms"),
                 pl.col("ttft_ms").quantile(0.9, "linear").alias("ttft_p90_ms"))
            .sort("run_id", "window_start")
            .select([pl.col(c).cast(t) for c, t in TTFT_COLUMNS.items()]))


def outcome_windows(ledger: pl.DataFrame, window_s: float = 60.0) -> pl.DataFrame:
    """Turns k ≥ 2 per run, time window and outcome."""
    later = _later(ledger)
    if later.is_empty():
        return pl.DataFrame(schema=OUTCOME_COLUMNS)
    return (_window(later, window_s).group_by("run_id", "window_start", "outcome")
            .agg(pl.len().alias("turns")).sort("run_id", "window_start", "outcome")
            .select([pl.col(c).cast(t) for c, t in OUTCOME_COLUMNS.items()]))


def outcome_engines(ledger: pl.DataFrame) -> pl.DataFrame:
    """Turns k ≥ 2 per prefill engine and outcome (all selected runs together)."""
    later = _later(ledger)
    if later.is_empty():
        return pl.DataFrame(schema=ENGINE_COLUMNS)
    return (later.group_by("prefill_engine", "outcome").agg(pl.len().alias("turns"))
            .sort("prefill_engine", "outcome")
            .select([pl.col(c).cast(t) for c, t in ENGINE_COLUMNS.items()]))


@register("ttft_windows", "TTFT p50/p90 per run and time window", params=(_WINDOW,),
          columns=TTFT_COLUMNS)
def ttft_windows_analysis(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return ttft_windows(ctx.ledger(LEDGER_COLUMNS), params["window_s"])


@register("outcome_windows", "Outcomes of turns k ≥ 2 per run and time window",
          params=(_WINDOW,), columns=OUTCOME_COLUMNS)
def outcome_windows_analysis(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return outcome_windows(ctx.ledger(LEDGER_COLUMNS), params["window_s"])


@register("outcome_engines", "Outcomes of turns k ≥ 2 per prefill engine (selected runs "
          "together)", columns=ENGINE_COLUMNS)
def outcome_engines_analysis(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return outcome_engines(ctx.ledger(LEDGER_COLUMNS))
