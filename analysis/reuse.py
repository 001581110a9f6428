"""Reuse rate: how much of what earlier turns computed was reused, token- and turn-weighted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope.analysis.registry import AnalysisContext, Param, register
from kvscope.reuse import outcomes

REUSED = (outcomes.REUSED_REMOTE, outcomes.REUSED_LOCAL)
GROUPINGS = ("run", "conversation", "turn_index", "engine", "window")
_GROUP_COLUMNS = {
    "run": ["run_id"],
    "conversation": ["run_id", "conversation_id"],
    "turn_index": ["run_id", "turn_index"],
    "engine": ["run_id", "prefill_engine"],
    "window": ["run_id", "window_start"],
}

COLUMNS: dict[str, pl.DataType] = {
    "turns": pl.Int64(),
    "measured_turns": pl.Int64(),
    "reusable_tokens": pl.Int64(),
    "local_tokens": pl.Int64(),
    "remote_tokens": pl.Int64(),
    "recomputed_tokens": pl.Int64(),
    "token_reuse_rate": pl.Float64(),
    "local_share": pl.Float64(),
    "remote_share": pl.Float64(),
    "turn_reuse_rate": pl.Float64(),
    "turns_fully_reused": pl.Int64(),
    "turns_unknown": pl.Int64(),
}


def _measured_sum(values: pl.Expr) -> pl.Expr:
    """The sum of the values measured; null when none was (a sum of nothing is not 0)."""
    return pl.when(values.is_not_null().any()).then(values.sum())


# What this module's analyses read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    "run_id", "conversation_id", "turn_index", "arrival", "prefill_engine", "outcome",
    "reusable_tokens", "local_hit_tokens", "remote_reused_tokens", "recomputed_reusable_tokens")


def reuse_table(ledger: pl.DataFrame, by: str = "run", window_s: float = 60.0) -> pl.DataFrame:
    """Reuse over turns k ≥ 2, grouped by ``by`` (pure: no I/O).

    Token-weighted rate = Σ(local + remote) / Σ reusable over turns whose reusable, local and
    remote counts were measured; turn-weighted rate = mean of per-turn (local + remote) /
    reusable over such turns with reusable > 0. Rates and sums are null where nothing was
    measured (never shown as 0).
    """
    # Lazily: the filtered rows are grouped as they pass, never held as a copy of the ledger.
    later = ledger.lazy().filter(pl.col("turn_index") >= 2)
    if by == "window":
        later = later.with_columns(
            pl.col("arrival").dt.truncate(f"{max(int(window_s), 1)}s").alias("window_start")
        )
    keys = _GROUP_COLUMNS[by]
    # A turn is measured when its reusable span and both parts reused from it were: a turn
    # whose engine left no evidence has no local or remote count (null), and is left out.
    measured = (pl.col("reusable_tokens").is_not_null()
                & pl.col("local_hit_tokens").is_not_null()
                & pl.col("remote_reused_tokens").is_not_null())
    reused = pl.col("local_hit_tokens") + pl.col("remote_reused_tokens")
    per_turn = pl.when(measured & (pl.col("reusable_tokens") > 0)).then(
        reused / pl.col("reusable_tokens"))
    grouped = later.group_by(keys, maintain_order=True).agg(
        pl.len().alias("turns"),
        measured.sum().alias("measured_turns"),
        _measured_sum(pl.col("reusable_tokens")).alias("reusable_tokens"),
        pl.col("reusable_tokens").filter(measured).sum().alias("_measured_reusable"),
        _measured_sum(pl.col("local_hit_tokens").filter(measured)).alias("local_tokens"),
        _measured_sum(pl.col("remote_reused_tokens").filter(measured)).alias("remote_tokens"),
        _measured_sum(pl.col("recomputed_reusable_tokens")).alias("recomputed_tokens"),
        per_turn.mean().alias("turn_reuse_rate"),
        pl.col("outcome").is_in(REUSED).sum().alias("turns_fully_reused"),
        (pl.col("outcome") == outcomes.UNKNOWN).sum().alias("turns_unknown"),
    ).collect()
    total = pl.col("_measured_reusable")
    return grouped.with_columns(
        pl.when(total > 0).then((pl.col("local_tokens") + pl.col("remote_tokens")) / total)
        .alias("token_reuse_rate"),
        pl.when(total > 0).then(pl.col("local_tokens") / total).alias("local_share"),
        pl.when(total > 0).then(pl.col("remote_tokens") / total).alias("remote_share"),
    ).select(*keys, *(pl.col(name).cast(dtype) for name, dtype in COLUMNS.items())).sort(keys)


@register(
    "reuse_rate",
    "Reuse rate (token- and turn-weighted, local vs remote)",
    params=(
        Param("by", str, "run", "group by run, conversation, turn_index, engine or window",
              GROUPINGS),
        Param("window_s", float, 60.0, "window length in seconds when by=window"),
    ),
    columns={"run_id": pl.String(), **COLUMNS},  # grouped by run (the default)
)
def reuse_rate(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return reuse_table(ctx.ledger(LEDGER_COLUMNS), params["by"], params["window_s"])


def _ledger_head(ctx: AnalysisContext, params: Mapping[str, Any],
                 rows: int) -> tuple[pl.DataFrame, int]:
    return ctx.ledger_head(rows)


@register("ledger", "The per-turn reuse ledger", head=_ledger_head)
def ledger_rows(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return ctx.ledger()


__all__ = ["COLUMNS", "GROUPINGS", "LEDGER_COLUMNS", "REUSED", "ledger_rows", "reuse_rate",
    "reuse_table"]
