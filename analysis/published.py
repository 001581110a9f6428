"""The published bidirectional-KV sweep, simulated vs measured: one row per run of the sweep.

Runs of ``kvscope simulate --workload sweep`` record the sweep's workload settings
(``workload_settings.format == "published_sweep"``, the shared prefix, the profile). For each,
this analysis takes the run's means over all its turns (the benchmark's warm-up 0 %): TTFT,
prefill leg, its compute part and the D→P read time per read, and puts beside them the
published value at that prompt length from :mod:`kvscope.published`, with the ratio
simulated / published. Only the two ends of each published sweep were measured; every other
point reads "not measured" (null), never 0.

Every published point is a calibration point: the profiles (``emulator/cost_model.py``) are
solved so that their means over the sweep's own turns (history re-sent, each chat's first turn
pulling nothing, follow-ups pulling their history) meet the published ends. A point therefore
matches when the run's turns have the composition the profile was solved on and the simulator
prices them as the fit did; where it misses ±15 %, ``why`` says which of the two moved, from the
run's own turns (follow-ups that pulled nothing, a workload other than the published setup) or,
failing that, the cost term that carries the quantity. Query (the ledger, the run table) →
shaping (:func:`sweep_table`, pure) → registration, as everywhere in ``analysis/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope import published
from kvscope.analysis.registry import AnalysisContext, register
from kvscope.analysis.runs import LEDGER_COLUMNS as _RUNS_READS
from kvscope.analysis.runs import feature_state, run_settings, run_table

SWEEP_FORMAT = "published_sweep"
TOLERANCE = 0.15

COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "label": pl.String(),
    "model": pl.String(),
    "profile": pl.String(),
    "feature": pl.String(),
    "prompt_tokens": pl.Int64(),
    "turns": pl.Int64(),
    "mean_prompt_tokens": pl.Float64(),
    "ttft_ms": pl.Float64(),
    "ttft_published_ms": pl.Float64(),
    "ttft_ratio": pl.Float64(),
    "prefill_ms": pl.Float64(),
    "prefill_published_ms": pl.Float64(),
    "prefill_ratio": pl.Float64(),
    "compute_ms": pl.Float64(),
    "transfer_ms": pl.Float64(),
    "transfer_published_ms": pl.Float64(),
    "transfer_ratio": pl.Float64(),
    "within_15pct": pl.Boolean(),
    "why": pl.String(),
}


def sweep_runs(runs: pl.DataFrame) -> list[dict[str, Any]]:
    """The runs of a published sweep: run id, label, profile, feature, prefix and shape (pure)."""
    out = []
    for run in runs.iter_rows(named=True):
        settings = run_settings(run["settings"])
        workload = settings.get("workload_settings")
        if not isinstance(workload, dict) or workload.get("format") != SWEEP_FORMAT:
            continue
        feature, _source = feature_state(settings, run["label"])
        out.append({
            "run_id": run["run_id"], "label": run["label"],
            "profile": str(settings.get("profile")), "feature": feature,
            "cost_model": str(settings.get("cost_model", "fitted")),
            "prompt_tokens": int(workload["shared_prefix_tokens"]),
            "workload": workload,
        })
    return out


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def _why(run: Mapping[str, Any], stats: Mapping[str, Any], ratios: Mapping[str, float | None],
         sweep: published.PublishedSweep | None) -> str:
    """Why a published point is matched or missed, from the run's own turns."""
    if sweep is None:
        return f"no published sweep for profile {run['profile']}"
    if run["prompt_tokens"] not in sweep.prompt_tokens:
        ends = " and ".join(f"{t:,}" for t in sweep.prompt_tokens)
        return f"not measured: published at {ends} tokens only"
    missed = [name for name, r in ratios.items() if r is not None and abs(r - 1) > TOLERANCE]
    physics = run.get("cost_model") == "physics"
    if not missed:
        if physics:
            return ("within ±15 % (in-sample: the physics constants were fitted on every "
                    "published prefill and read)")
        return "within ±15 % (a calibration point: the profile was solved from the published ends)"
    parts = [f"{', '.join(missed)} off by more than 15 %"]
    setup = {"conversations": sweep.conversations, "turns": sweep.turns,
             "new_tokens": sweep.new_tokens, "output_tokens": sweep.output_tokens}
    differs = {k: run["workload"].get(k) for k, v in setup.items() if run["workload"].get(k) != v}
    if differs:
        parts.append(
            "workload: " + ", ".join(f"{k} {v}" for k, v in differs.items()) + " where the "
            "profile was solved on the published setup ("
            + ", ".join(f"{k} {v}" for k, v in setup.items()) + ")")
    follow_ups = 1.0 - stats["first_turn_share"]
    if run["feature"] == "on" and stats["pull_share"] < follow_ups - 1e-9:
        parts.append(
            f"pull path: {stats['pull_share']:.0%} of turns used KV pulled from decode, the "
            f"profile was solved with every follow-up pulling its chat's history "
            f"({follow_ups:.0%} of turns); the others recomputed at the OFF price")
    if len(parts) == 1 and physics:
        terms = {
            "ttft": "first-token leg (one decode step at the HBM floor: the physics has no term "
                    "for the rest of the D leg, 34-46 ms in the published TTFT − prefill gaps)",
            "prefill": "prefill (compute and weights at the fitted efficiency, the read's host "
                       "work per descriptor)",
            "transfer": "the read (latency + a cost per block)",
        }
        parts.append("the run's turns have the published composition; the miss is in the "
                     "physics model's " + "; ".join(terms[name] for name in missed))
    elif len(parts) == 1:
        terms = {
            "ttft": "first-token leg (one line in the prompt for ON and OFF, least squares over "
                    "the four published TTFT − prefill gaps)",
            "prefill": "prefill terms (fixed, per computed token, pull path)",
            "transfer": "transfer (latency + bytes / bandwidth, from the two published reads)",
        }
        parts.append(
            "the run's turns have the composition the profile was solved on; the miss is in the "
            + "; ".join(terms[name] for name in missed))
    return "; ".join(parts)


# What this module's analyses read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    ("run_id", "turn_index", "prompt_tokens", "output_tokens", "prefill_ms", "ttft_ms", "d2p_ms",
    "remote_reused_tokens") + _RUNS_READS)


def sweep_table(runs: list[dict[str, Any]], ledger: pl.DataFrame) -> pl.DataFrame:
    """Per sweep run: simulated means beside the published values, with ratios (pure)."""
    if not runs:
        return pl.DataFrame(schema=COLUMNS)
    wanted = [r["run_id"] for r in runs]
    rows = ledger.filter(pl.col("run_id").is_in(wanted))
    transfer = pl.col("d2p_ms")
    means = rows.group_by("run_id").agg(
        pl.len().alias("turns"),
        pl.col("prompt_tokens").mean().alias("mean_prompt_tokens"),
        pl.col("ttft_ms").mean().alias("ttft_ms"),
        pl.col("prefill_ms").mean().alias("prefill_ms"),
        (pl.col("prefill_ms") - transfer.fill_null(0.0)).mean().alias("compute_ms"),
        transfer.mean().alias("transfer_ms"),  # per read: turns without one are null
        (pl.col("turn_index") == 1).mean().alias("first_turn_share"),
        (pl.col("remote_reused_tokens").fill_null(0) > 0).mean().alias("pull_share"),
    )
    by_run = {row["run_id"]: row for row in means.iter_rows(named=True)}
    out = []
    for run in runs:
        stats = by_run.get(run["run_id"])
        if stats is None:
            continue
        sweep = published.for_profile(run["profile"])
        on = run["feature"] == "on"

        def value(quantity: str, sweep: published.PublishedSweep | None = sweep,
                  on: bool = on, prompt: int = run["prompt_tokens"]) -> float | None:
            return None if sweep is None else sweep.value(quantity, on, prompt)

        ttft_pub, prefill_pub = value(published.TTFT), value(published.PREFILL)
        transfer_pub = value(published.TRANSFER)
        ratios = {
            "ttft": _ratio(stats["ttft_ms"], ttft_pub),
            "prefill": _ratio(stats["prefill_ms"], prefill_pub),
            "transfer": _ratio(stats["transfer_ms"], transfer_pub),
        }
        measured = [r for r in ratios.values() if r is not None]
        out.append({
            "run_id": run["run_id"], "label": run["label"],
            "model": sweep.model if sweep else None, "profile": run["profile"],
            "feature": run["feature"], "prompt_tokens": run["prompt_tokens"],
            "turns": stats["turns"], "mean_prompt_tokens": stats["mean_prompt_tokens"],
            "ttft_ms": stats["ttft_ms"], "ttft_published_ms": ttft_pub,
            "ttft_ratio": ratios["ttft"],
            "prefill_ms": stats["prefill_ms"], "prefill_published_ms": prefill_pub,
            "prefill_ratio": ratios["prefill"],
            "compute_ms": stats["compute_ms"], "transfer_ms": stats["transfer_ms"],
            "transfer_published_ms": transfer_pub, "transfer_ratio": ratios["transfer"],
            "within_15pct": (all(abs(r - 1) <= TOLERANCE for r in measured) if measured
                             else None),
            "why": _why(run, stats, ratios, sweep),
        })
    frame = pl.DataFrame(out, schema=COLUMNS)
    return frame.sort(["profile", "feature", "prompt_tokens"], descending=[False, True, False])


@register(
    "published_sweep",
    "The published bidirectional-KV sweep: simulated vs published TTFT, prefill, transfer",
    columns=COLUMNS,
)
def published_sweep(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    runs = sweep_runs(run_table(ctx))
    if not runs:
        return pl.DataFrame(schema=COLUMNS)
    return sweep_table(runs, ctx.ledger(LEDGER_COLUMNS))


__all__ = ["COLUMNS", "LEDGER_COLUMNS", "SWEEP_FORMAT", "TOLERANCE", "published_sweep",
    "sweep_runs", "sweep_table"]
