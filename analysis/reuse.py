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


def reuse_table(ledger: pl.DataFrame, by: str = "run", window_s: float = 60.0) -> pl.DataFrame:
    """Reuse over turns k ≥ 2, grouped by ``by`` (pure: no I/O).

    Token-weighted rate = Σ(local + remote) / Σ reusable over turns whose reusable count was
    measured; turn-weighted rate = mean of per-turn (local + remote) / reusable over turns with
    reusable > 0. Rates are null where nothing was measured (never shown as 0).
    """
    later = ledger.filter(pl.col("turn_index") >= 2)
    if by == "window":
        later = later.with_columns(
            pl.col("arrival").dt.truncate(f"{max(int(window_s), 1)}s").alias("window_start")
        )
    keys = _GROUP_COLUMNS[by]
    measured = pl.col("reusable_tokens").is_not_null()
    reused = pl.col("local_hit_tokens").fill_null(0) + pl.col("remote_reused_tokens").fill_null(0)
    per_turn = pl.when(pl.col("reusable_tokens") > 0).then(reused / pl.col("reusable_tokens"))
    grouped = later.group_by(keys, maintain_order=True).agg(
        pl.len().alias("turns"),
        measured.sum().alias("measured_turns"),
        pl.col("reusable_tokens").sum().alias("reusable_tokens"),
        pl.col("local_hit_tokens").filter(measured).sum().alias("local_tokens"),
        pl.col("remote_reused_tokens").filter(measured).sum().alias("remote_tokens"),
        pl.col("recomputed_reusable_tokens").sum().alias("recomputed_tokens"),
        per_turn.mean().alias("turn_reuse_rate"),
        pl.col("outcome").is_in(REUSED).sum().alias("turns_fully_reused"),
        (pl.col("outcome") == outcomes.UNKNOWN).sum().alias("turns_unknown"),
    )
    total = pl.col("reusable_tokens")
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
    return reuse_table(ctx.ledger(), params["by"], params["window_s"])


@register("ledger", "The per-turn reuse ledger")
def ledger_rows(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return ctx.ledger()
