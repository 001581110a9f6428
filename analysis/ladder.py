"""The reuse ladder: from every reusable token to what was reused, each step's loss attributed.

DESIGN §5. Per run, over turns k ≥ 2 whose reusable span was measured, five steps, each a bound
on the tokens that could have been reused:

1. ``ideal`` — every reusable token (measured: the ledger's ``reusable_tokens``);
2. ``ttl_bounded`` — only turns whose gap fits the TTLs keep their whole span: ``gap + 5 s <
   decoder_kv_blocks_ttl`` (the worker's expiry guard) and router entry age ≤ router TTL; other
   turns keep only prefill's local hit (estimated from gaps and the observed TTLs). A read
   declined as expired fails its turn (nothing reused) and leaves the next turn without an
   offer (local hit only): both count against the TTL;
3. ``threshold_bounded`` — also, a turn whose pull ``0 < min(offered, prompt) − local <
   threshold`` keeps only its local hit (estimated with the observed threshold);
4. ``capacity_bounded`` — also, a turn lost to memory keeps only its local hit (estimated from
   observed evidence: the ``preempted`` outcome; prefix-cache evictions are not observable
   without more hooks). Memory also costs time without costing tokens: vLLM 0.33.0 queues a
   request decode cannot allocate while it retains blocks (it never frees retained blocks to
   make room; tests/vllm_contract/test_decode_memory_claims.py), so this row's
   ``decode_queue_s`` is the run's total ledger ``decode_queue_ms`` (null: not measured);
5. ``observed`` — the ledger's local + remote (measured).

Each step is taken per turn as ``max(observed, min(previous step, rule))``: a bound never claims
less than was reused, so the steps are monotone and the last equals the observed reuse. The loss
between steps is attributed to ``ttl``, ``threshold``, ``memory`` and ``system`` (everything
else: faults, missing ids, failed reads, the stream tail…). Where a step's setting was not
measured (no retention spans, so no TTL) its rule keeps every token and its ``basis`` says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope.analysis import whatif
from kvscope.analysis.registry import AnalysisContext, Param, register
from kvscope.reuse import outcomes
from kvscope.reuse.params import KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S
from kvscope.tables import NOT_MEASURED

STEPS = ("ideal", "ttl_bounded", "threshold_bounded", "capacity_bounded", "observed")
CAUSES = (None, "ttl", "threshold", "memory", "system")
MEASURED = "measured"
ESTIMATED = "estimated"

COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "step_order": pl.Int64(),
    "step": pl.String(),
    "tokens": pl.Int64(),
    "rate": pl.Float64(),
    "turns_limited": pl.Int64(),
    "lost_tokens": pl.Int64(),
    "lost_to": pl.String(),
    "basis": pl.String(),
    "evidence": pl.String(),
    # capacity_bounded only: seconds the run's turns queued at decode for KV blocks.
    "decode_queue_s": pl.Float64(),
}


def ladder_table(turns: pl.DataFrame, observed: pl.DataFrame,
                 ledger: pl.DataFrame | None = None) -> pl.DataFrame:
    """The ladder per run from a :func:`whatif.timeline` and the observed settings (pure)."""
    c = pl.col
    # A read declined as expired fails the turn (nothing reused, local included) and leaves the
    # next turn without an offer: both losses are the TTL's.
    failed = c("expired_read") & c("errored")
    after_failure = pl.when(c("has_prev")).then(failed.shift(1)).otherwise(False)
    # Lazily: the filter and the join copy only the columns the steps read (eagerly they
    # copied every timeline column, ~3 GiB at 10M turns).
    frame = turns.lazy().with_columns(
        failed.alias("_ttl_failed"), after_failure.fill_null(False).alias("_after_failure"),
    ).filter(c("later")).join(observed.lazy(), on="run_id", how="left")
    reusable = c("reusable_tokens")
    local = pl.min_horizontal(c("local_tokens"), reusable)
    seen = pl.min_horizontal(c("local_tokens") + c("observed_remote"), reusable)
    ttl = pl.coalesce(c("prev_ret_ttl_s"), c("ttl_s"))
    # vLLM's margin on the run's clock (whatif.timeline: 5 s, cut by an emulator's scale).
    margin = (c("margin_s") if "margin_s" in turns.columns
              else pl.lit(KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S))
    # Unknown gap or TTL: the TTL cannot be blamed (the loss falls to a later step).
    fits = (
        (c("gap_s") + margin < ttl).fill_null(True)
        & (c("age_s") <= c("router_ttl_s")).fill_null(True)
    )
    count = pl.min_horizontal(c("offered_tokens"), c("prompt_tokens")) - c("decision_local")
    below = ((c("threshold_tokens") > 0) & (count > 0)
             & (count < c("threshold_tokens"))).fill_null(False)
    lost_to_memory = c("outcome") == outcomes.PREEMPTED

    def bound(previous: pl.Expr, keeps_all: pl.Expr, keeps: pl.Expr = local) -> pl.Expr:
        return pl.max_horizontal(seen, pl.min_horizontal(
            previous, pl.when(keeps_all).then(reusable).otherwise(keeps)))

    ttl_keeps = pl.when(c("_ttl_failed")).then(0).otherwise(local)
    ttl_b = bound(reusable, fits & ~c("_after_failure"), ttl_keeps)
    thr_b = bound(ttl_b, ~below)
    cap_b = bound(thr_b, ~lost_to_memory)
    steps = frame.select(
        "run_id", "ttl_s", "threshold_tokens", "router_ttl_s",
        reusable.alias("ideal"), ttl_b.alias("ttl_bounded"), thr_b.alias("threshold_bounded"),
        cap_b.alias("capacity_bounded"), seen.alias("observed"),
    )
    per_run = steps.group_by("run_id").agg(
        *[c(step).sum().alias(step) for step in STEPS],
        *[(c(step) < c(prev)).sum().alias(f"_limited_{step}")
          for prev, step in zip(STEPS, STEPS[1:], strict=False)],
        c("ttl_s").first(), c("threshold_tokens").first(), c("router_ttl_s").first(),
    ).sort("run_id").collect()
    queue = _decode_queue_s(ledger)
    rows: list[dict[str, Any]] = []
    for run in per_run.iter_rows(named=True):
        ideal = run["ideal"]
        run["decode_queue_s"] = queue.get(run["run_id"])
        evidence = _evidence(run)
        for order, (step, cause) in enumerate(zip(STEPS, CAUSES, strict=True)):
            previous = run[STEPS[order - 1]] if order else None
            rows.append({
                "run_id": run["run_id"], "step_order": order + 1, "step": step,
                "tokens": run[step],
                "rate": run[step] / ideal if ideal else None,
                "turns_limited": run[f"_limited_{step}"] if order else None,
                "lost_tokens": previous - run[step] if previous is not None else None,
                "lost_to": cause,
                "basis": _basis(step, run),
                "evidence": evidence[step],
                "decode_queue_s": run["decode_queue_s"] if step == "capacity_bounded" else None,
            })
    return pl.DataFrame(rows, schema=COLUMNS)


def _decode_queue_s(ledger: pl.DataFrame | None) -> dict[str, float]:
    """Per run, the seconds its turns queued at decode (runs with no timed turn are absent)."""
    if ledger is None or "decode_queue_ms" not in ledger.columns:
        return {}
    queue = pl.col("decode_queue_ms").cast(pl.Float64)
    sums = ledger.filter(queue.is_not_null()).group_by("run_id").agg(
        (queue.sum() / 1000).alias("s"))
    return dict(zip(sums["run_id"].to_list(), sums["s"].to_list(), strict=True))


def _basis(step: str, run: Mapping[str, Any]) -> str:
    if step in ("ideal", "observed"):
        return MEASURED
    if step == "ttl_bounded" and run["ttl_s"] is None and run["router_ttl_s"] is None:
        return NOT_MEASURED
    if step == "threshold_bounded" and run["threshold_tokens"] is None:
        return NOT_MEASURED
    return ESTIMATED


def _evidence(run: Mapping[str, Any]) -> dict[str, str]:
    ttl = "not measured" if run["ttl_s"] is None else f"{run['ttl_s']:g} s"
    router = "not measured" if run["router_ttl_s"] is None else f"{run['router_ttl_s']:g} s"
    threshold = ("not measured" if run["threshold_tokens"] is None
                 else f"{run['threshold_tokens']} tokens")
    return {
        "ideal": "ledger reusable_tokens (turns k >= 2)",
        "ttl_bounded": f"gap + {KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S:g} s < decoder_kv_blocks_ttl "
                       f"({ttl}) and router entry age <= router TTL ({router})",
        "threshold_bounded": f"pull of min(offered, prompt) - local >= threshold ({threshold})",
        "capacity_bounded": "turns preempted after their read keep only the local hit; decode "
                            "queued for KV blocks "
                            + ("not measured" if run["decode_queue_s"] is None
                               else f"{run['decode_queue_s']:.1f} s in all"),
        "observed": "ledger local_hit_tokens + remote_reused_tokens",
    }


@register(
    "ladder",
    "Reuse ladder: ideal → TTL → threshold → capacity → observed, the gap attributed",
    params=(Param("run", str, None, "only this run id (default: every selected run)"),),
    columns=COLUMNS,
)
def ladder(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    data = whatif.inputs(ctx, params["run"])
    return ladder_table(data["timeline"], data["observed"], data["ledger"])


__all__ = ["CAUSES", "COLUMNS", "ESTIMATED", "MEASURED", "STEPS", "ladder", "ladder_table"]
