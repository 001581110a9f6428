"""Per-run verdict: did reuse happen, how much, why not, what retention cost, what it changed.

:func:`verdict_table` shapes one row per run from frames the other analyses produce (pure);
:func:`verdict_sentences` turns a row into the plain sentences the report opens with; the
registered ``verdict`` wrapper gathers the inputs. Retained GiB·s comes from the
``retention_cost`` analysis when a module registers it, and is null ("not measured") otherwise.
The change in TTFT and task time is measured against the most recent feature-OFF run of the
same workload among the selected runs (:func:`kvscope.analysis.runs.baseline_for`); null
when there is none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope.analysis import compare, runs
from kvscope.analysis.causes import EXAMPLE_COLUMNS as _CAUSE_EXAMPLES
from kvscope.analysis.causes import LEDGER_COLUMNS as _CAUSES_READS
from kvscope.analysis.causes import cause_table
from kvscope.analysis.compare import LEDGER_COLUMNS as _COMPARE_READS
from kvscope.analysis.registry import AnalysisContext, register
from kvscope.analysis.reuse import LEDGER_COLUMNS as _REUSE_READS
from kvscope.analysis.reuse import reuse_table
from kvscope.analysis.runs import LEDGER_COLUMNS as _RUNS_READS
from kvscope.analysis.sources import LEDGER_COLUMNS as _SOURCES_READS
from kvscope.analysis.sources import source_table, sources_sentence
from kvscope.reuse import outcomes
from kvscope.tables import NOT_MEASURED

TOP_CAUSES = 3
# Outcomes that are not misses: the first turn and full reuse.
_NOT_MISSES = (outcomes.FIRST_TURN, outcomes.REUSED_REMOTE, outcomes.REUSED_LOCAL)

COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "label": pl.String(),
    "feature": pl.String(),
    "feature_source": pl.String(),
    "turns": pl.Int64(),
    "later_turns": pl.Int64(),
    "turns_reused_remote": pl.Int64(),
    "turns_reused_local": pl.Int64(),
    "token_reuse_rate": pl.Float64(),
    "local_share": pl.Float64(),
    "remote_share": pl.Float64(),
    "turns_unknown": pl.Int64(),
    "turns_reused_invalid": pl.Int64(),
    "invalid_tokens": pl.Int64(),
    "invalid_tokens_unmeasured_turns": pl.Int64(),
    **{f"cause_{i}{suffix}": dtype for i in range(1, TOP_CAUSES + 1)
       for suffix, dtype in (("", pl.String()), ("_share", pl.Float64()))},
    "retained_gib_s": pl.Float64(),
    "useful_gib_s": pl.Float64(),
    "idle_gib_s": pl.Float64(),
    "wasted_gib_s": pl.Float64(),
    "retention_note": pl.String(),
    "ttft_p50_ms": pl.Float64(),
    "ttft_p90_ms": pl.Float64(),
    "ttft_share_of_task": pl.Float64(),
    "task_time_total_s": pl.Float64(),
    "baseline_run_id": pl.String(),
    "baseline_label": pl.String(),
    "ttft_p50_change": pl.Float64(),
    "ttft_p90_change": pl.Float64(),
    "task_time_change": pl.Float64(),
    # Which sources of evidence the run had (kvscope.analysis.sources).
    "sources": pl.String(),
    # vLLM's own counters beside the ledger (analysis ``reconciliation``): quantities compared
    # (null: no /metrics snapshot with the run), how many differ unexplained, and which.
    "vllm_quantities": pl.Int64(),
    "vllm_flagged": pl.Int64(),
    "vllm_flagged_detail": pl.String(),
}


def _top_causes(causes: pl.DataFrame) -> pl.DataFrame:
    """The top miss causes per run as columns cause_i / cause_i_share (pure)."""
    misses = causes.filter(~pl.col("outcome").is_in(_NOT_MISSES)).sort(
        ["run_id", "turns", "outcome"], descending=[False, True, False]
    )
    ranked = misses.with_columns(pl.int_range(1, pl.len() + 1).over("run_id").alias("_rank"))
    wide = ranked.filter(pl.col("_rank") <= TOP_CAUSES).group_by("run_id").agg(
        [pl.col("outcome").filter(pl.col("_rank") == i).first().alias(f"cause_{i}")
         for i in range(1, TOP_CAUSES + 1)]
        + [pl.col("share").filter(pl.col("_rank") == i).first().alias(f"cause_{i}_share")
           for i in range(1, TOP_CAUSES + 1)]
    )
    return wide


def _invalid(ledger: pl.DataFrame) -> pl.DataFrame:
    """Per run: turns that loaded KV not matching their prompt, and the tokens where counted."""
    bad = pl.col("outcome") == outcomes.REUSED_INVALID
    return ledger.group_by("run_id").agg(
        bad.sum().cast(pl.Int64).alias("turns_reused_invalid"),
        pl.col("invalid_tokens").filter(bad).sum().cast(pl.Int64).alias("invalid_tokens"),
        (bad & pl.col("invalid_tokens").is_null()).sum().cast(pl.Int64)
        .alias("invalid_tokens_unmeasured_turns"),
    )


def _change(new: Any, old: Any) -> float | None:
    """Relative change new vs old (-0.3 = 30 % lower); None where either is not measured."""
    if new is None or old is None or old == 0:
        return None
    return float(new) / float(old) - 1.0


def _reconciled(reconciled: pl.DataFrame | None) -> pl.DataFrame:
    """Per run: vLLM quantities compared, flagged, and the flagged ones in words (pure)."""
    if reconciled is None or reconciled.is_empty():
        return pl.DataFrame(schema={"run_id": pl.String(), "vllm_quantities": pl.Int64(),
                                    "vllm_flagged": pl.Int64(),
                                    "vllm_flagged_detail": pl.String()})

    def number(column: str) -> pl.Expr:
        value = pl.col(column)
        return pl.when(value.is_null()).then(pl.lit(NOT_MEASURED)).otherwise(
            value.round(0).cast(pl.Int64).cast(pl.String))

    flagged = pl.col("flagged").fill_null(False)
    detail = pl.format("{} ({}: ledger {}, vLLM {})", pl.col("quantity"), pl.col("role"),
                       number("ledger_value"), number("vllm_value"))
    return reconciled.group_by("run_id", maintain_order=True).agg(
        pl.len().cast(pl.Int64).alias("vllm_quantities"),
        flagged.sum().cast(pl.Int64).alias("vllm_flagged"),
        detail.filter(flagged).str.join("; ").alias("vllm_flagged_detail"))


# What this module's analyses read of the ledger.
# (Its top causes need no examples: their request ids and evidence text are not read.)
LEDGER_COLUMNS: tuple[str, ...] = tuple(dict.fromkeys(
    ("run_id", "outcome", "invalid_tokens") + _COMPARE_READS + _RUNS_READS
    + tuple(c for c in _CAUSES_READS if c not in _CAUSE_EXAMPLES) + _REUSE_READS
    + _SOURCES_READS))


def verdict_table(info: pl.DataFrame, ledger: pl.DataFrame, retention: pl.DataFrame | None,
                  reconciled: pl.DataFrame | None = None) -> pl.DataFrame:
    """One verdict row per run of ``info`` (pure).

    ``info`` is :func:`runs.run_info` (the runs, among which baselines are found),
    ``ledger`` the per-turn ledger of those runs, ``retention`` the ``retention_cost``
    result and ``reconciled`` the ``reconciliation`` one (None when no module registers it).
    """
    totals = compare.retention_totals(retention)
    stats = compare.run_stats(ledger)
    reuse = reuse_table(ledger, "run").select(
        "run_id", "turns", "token_reuse_rate", "local_share", "remote_share", "turns_unknown"
    ).rename({"turns": "later_turns"})
    frame = (
        info.select("run_id", "label", "feature", "feature_source", "started_at")
        .join(stats, on="run_id", how="left")
        .join(reuse, on="run_id", how="left")
        .join(_top_causes(cause_table(ledger, with_examples=False)), on="run_id", how="left")
        .join(totals, on="run_id", how="left")
        .join(_invalid(ledger), on="run_id", how="left")
        .join(source_table(ledger), on="run_id", how="left")
        .join(_reconciled(reconciled), on="run_id", how="left")
        .with_columns(pl.col("later_turns").fill_null(
            pl.when(pl.col("turns").is_not_null()).then(0)))
    )
    by_id = {row["run_id"]: row for row in frame.iter_rows(named=True)}
    rows = []
    for run_id, row in by_id.items():
        base_id = runs.baseline_for(info, run_id)
        base = by_id.get(base_id) if base_id else None
        row = dict(row)
        if retention is None:
            row["retention_note"] = "the retention_cost analysis is not available"
        elif row.get("retained_gib_s") is None:
            row["retention_note"] = "no retention spans in this run"
        row["baseline_run_id"] = base_id
        row["baseline_label"] = base["label"] if base else None
        for col, metric in (("ttft_p50_change", "ttft_p50_ms"),
                            ("ttft_p90_change", "ttft_p90_ms"),
                            ("task_time_change", "task_time_total_s")):
            row[col] = _change(row.get(metric), base.get(metric)) if base else None
        rows.append({name: row.get(name) for name in COLUMNS})
    return pl.DataFrame(rows, schema=COLUMNS)


# --- sentences --------------------------------------------------------------------------------



def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return NOT_MEASURED
    # Small shares keep one significant digit so they do not read as 0 %.
    digits = 0 if value == 0 or abs(value) >= 0.01 else 1 - math.floor(math.log10(abs(value * 100)))
    return f"{value * 100:+.{digits}f}%" if signed else f"{value * 100:.{digits}f}%"


def _ms(value: float | None) -> str:
    if value is None:
        return NOT_MEASURED
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def verdict_sentences(row: Mapping[str, Any]) -> list[str]:
    """Plain sentences for one verdict row; every missing number reads "not measured"."""
    name = row.get("label") or row["run_id"]
    feature = row.get("feature")
    state = (f"bidirectional KV transfer {feature} ({row.get('feature_source')})" if feature
             else "bidirectional KV transfer on/off not recorded")
    out = [f"Run {name} ({row['run_id']}): {state}; {row.get('turns') or 0} turns."]
    invalid = row.get("turns_reused_invalid") or 0
    if invalid:
        # A correctness alarm before anything else: these turns ran on KV of other tokens.
        unmeasured = row.get("invalid_tokens_unmeasured_turns") or 0
        tokens = row.get("invalid_tokens") or 0
        counted = (f"{tokens:,} tokens counted" + (f", {unmeasured} turn(s) not countable from "
                                                   "hashes" if unmeasured else ""))
        out.append(f"CORRECTNESS ALARM: {invalid} later turn(s) loaded decode KV that does not "
                   f"match their prompt (reused_invalid: edited or truncated history under the "
                   f"same conversation id, or a read after decode released the blocks; "
                   f"{counted}). Their output was computed on the wrong context.")
    later = row.get("later_turns")
    remote = row.get("turns_reused_remote") or 0
    local = row.get("turns_reused_local") or 0
    rate = row.get("token_reuse_rate")
    if not later:
        out.append("No turn after a conversation's first: there was nothing to reuse.")
    elif rate is None:
        out.append(f"Reuse was not measured for its {later} later turns (reusable tokens unknown; "
                   "see the miss causes).")
    elif rate == 0:
        out.append(f"Reuse did not happen: none of the reusable tokens of its {later} later turns "
                   "were reused.")
    else:
        # Tokens and turns said separately: a turn that pulled from decode usually also hit
        # prefill's own cache, so the turn counts are not a split of the tokens.
        out.append(
            f"Reuse happened: {_pct(rate)} of reusable tokens were reused "
            f"(pulled from decode: {_pct(row.get('remote_share'))}, "
            f"from prefill's own prefix cache: {_pct(row.get('local_share'))}). "
            f"{remote + local} of {later} later turns reused all they could: {remote} with a "
            f"pull from decode, {local} from prefill's cache alone."
        )
    causes = [(row.get(f"cause_{i}"), row.get(f"cause_{i}_share"))
              for i in range(1, TOP_CAUSES + 1)]
    causes = [(c, s) for c, s in causes if c]
    if causes:
        listed = ", ".join(f"{c} ({_pct(s)} of later turns)" for c, s in causes)
        out.append(f"Top reasons reuse did not happen: {listed}.")
    elif later:
        out.append("No later turn missed reuse.")
    gib_s = row.get("retained_gib_s")
    if gib_s is None:
        why = row.get("retention_note") or "no retention data"
        out.append(f"Retention cost: {NOT_MEASURED} ({why}).")
    else:
        parts = [(k, row.get(f"{k}_gib_s")) for k in ("useful", "idle", "wasted")]
        split = ", ".join(f"{k} {v:,.2f}" for k, v in parts if v is not None)
        out.append(f"Decode held retained KV for {gib_s:,.2f} GiB·s"
                   + (f" ({split})." if split else "."))
    out.append(
        f"TTFT p50 {_ms(row.get('ttft_p50_ms'))}, p90 {_ms(row.get('ttft_p90_ms'))}; "
        f"TTFT is {_pct(row.get('ttft_share_of_task'))} of task time."
    )
    if row.get("baseline_run_id"):
        base = row.get("baseline_label") or row["baseline_run_id"]
        out.append(
            f"Against the feature-OFF run {base} ({row['baseline_run_id']}) of the same "
            f"workload: TTFT p50 {_pct(row.get('ttft_p50_change'), True)}, "
            f"p90 {_pct(row.get('ttft_p90_change'), True)}, "
            f"task time {_pct(row.get('task_time_change'), True)}."
        )
    elif feature == runs.FEATURE_ON:
        out.append("No feature-OFF run of the same workload in the store: the change in TTFT "
                   f"and task time is {NOT_MEASURED}.")
    out.append(_counters_sentence(row))
    told = sources_sentence(row)
    if told:
        out.append(told)
    return out


def _counters_sentence(row: Mapping[str, Any]) -> str:
    """What vLLM's own counters (/metrics) say of the ledger's reuse."""
    compared = row.get("vllm_quantities")
    if not compared:
        return (f"vLLM's own reuse counters: {NOT_MEASURED} (no /metrics snapshot with this "
                "run; kvscope ingest vllm-prefill-metrics:FILE --run RUN adds one).")
    flagged = row.get("vllm_flagged") or 0
    if not flagged:
        return (f"vLLM's own reuse counters agree with the ledger: {compared} quantities, "
                "every difference explained.")
    return (f"vLLM's own reuse counters DISAGREE with the ledger on {flagged} of {compared} "
            f"quantities, unexplained: {row.get('vllm_flagged_detail')}. The ledger may be "
            "missing requests (see the reconciliation table).")


def context_verdict(ctx: AnalysisContext) -> pl.DataFrame:
    """The verdict of the selected runs (baselines are looked for among them too)."""
    return verdict_table(runs.context_run_info(ctx), ctx.ledger(LEDGER_COLUMNS),
                         compare.optional_analysis(ctx, "retention_cost"),
                         compare.optional_analysis(ctx, "reconciliation"))


@register("verdict", "Per-run verdict: reuse, top miss causes, retention cost, TTFT change",
          columns=COLUMNS)
def verdict(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return context_verdict(ctx)


__all__ = ["COLUMNS", "LEDGER_COLUMNS", "TOP_CAUSES", "context_verdict", "verdict",
    "verdict_sentences", "verdict_table"]
