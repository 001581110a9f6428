"""Missed-reuse causes: how often each outcome happened, what it cost and what to change."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope.analysis.registry import AnalysisContext, Param, register
from kvscope.reuse import outcomes

# The configuration change (or investigation) each miss cause suggests.
SUGGESTIONS: dict[str, str] = {
    outcomes.NO_CONVERSATION_ID: "send conversation_id in the body (vLLM's benchmark: "
    "--send-conversation-id) or the X-Session-ID header",
    outcomes.ROUTER_NO_ENTRY: "the proxy had nothing for this conversation: proxy restarted, or "
    "turns reached different proxy replicas",
    outcomes.ROUTER_TTL_EXPIRED: "tool waits outlast the proxy's router TTL: raise --router-ttl "
    "(keep it below decoder_kv_blocks_ttl)",
    outcomes.HANDLE_CONSUMED: "overlapping turns of one conversation: the handle is single-use; "
    "serialise turns or accept recompute",
    outcomes.NO_DECODE_METADATA: "decode returned no kv_transfer_params: enable "
    "bidirectional_kv_xfer on decode, return params in streams, check for errored turns",
    outcomes.INVALID_PARAMS: "params lack engine/request/host/port: a router or client "
    "rewrote them",
    outcomes.BELOW_THRESHOLD: "new-to-prefill tokens under kv_recompute_threshold: lower the "
    "threshold if transfers are cheap",
    outcomes.DECODE_TTL_EXPIRED: "tool waits outlast decoder_kv_blocks_ttl (minus 5 s): raise the "
    "TTL if memory allows (see what-if)",
    outcomes.HANDSHAKE_FAILED: "prefill cannot reach decode's NIXL side channel: check "
    "VLLM_NIXL_SIDE_CHANNEL_HOST/PORT and the proxy's remote_host rewrite",
    outcomes.TRANSFER_FAILED: "NIXL READ failed: check the fabric, backends and NIXL logs",
    outcomes.PREFIX_DIVERGED: "the client edited history (reset, compaction, stripped reasoning): "
    "decode's KV no longer matches the prompt",
    outcomes.PREFILL_BIDIR_DISABLED: "enable bidirectional_kv_xfer on prefill as well as decode",
    outcomes.PREEMPTED: "prefill was preempted after its read; a request reads at most once: "
    "give prefill more KV memory",
    outcomes.LOAD_FAILED_ERRORED: "kv_load_failure_policy=fail turned a failed read into an "
    "error: set it to recompute on prefill",
    outcomes.PARTIAL: "part of the reusable span was reused: look at the evidence column",
    outcomes.UNKNOWN: "evidence missing: install the engine hooks (kvscope's vLLM plugin) and "
    "use the kvscope proxy",
}

COLUMNS: dict[str, pl.DataType] = {
    "outcome": pl.String(),
    "turns": pl.Int64(),
    "share": pl.Float64(),
    "recomputed_tokens": pl.Int64(),
    "example_requests": pl.String(),
    "example_evidence": pl.String(),
    "suggestion": pl.String(),
}


# What this module's analyses read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    "run_id", "turn_index", "x_request_id", "outcome", "evidence", "recomputed_reusable_tokens")
# ... of which the examples' (request ids and evidence text: ~1.5 GiB at 10M turns).
EXAMPLE_COLUMNS: tuple[str, ...] = ("x_request_id", "evidence")


def cause_table(ledger: pl.DataFrame, examples: int = 3, *,
                with_examples: bool = True) -> pl.DataFrame:
    """Outcomes of turns k ≥ 2 per run: count, share, tokens recomputed, examples (pure).

    ``with_examples=False``: the example columns are null, and ``ledger`` need not have the
    :data:`EXAMPLE_COLUMNS` (a caller that reads only counts and shares).
    """
    read = [c for c in LEDGER_COLUMNS if with_examples or c not in EXAMPLE_COLUMNS]
    # The columns read, then the filter: a filter copies every column it is given.
    later = ledger.select(read).filter(pl.col("turn_index") >= 2)
    per_run = later.group_by("run_id").agg(pl.len().alias("_run_turns"))
    shown = (
        [pl.col("x_request_id").head(examples).str.join(", ").alias("example_requests"),
         pl.col("evidence").first().alias("example_evidence")] if with_examples
        else [pl.lit(None, pl.String).alias(name)
              for name in ("example_requests", "example_evidence")])
    table = (
        later.group_by(["run_id", "outcome"], maintain_order=True)
        .agg(
            pl.len().alias("turns"),
            # Null where no turn's count was measured (never a sum of nothing shown as 0).
            pl.when(pl.col("recomputed_reusable_tokens").is_not_null().any())
            .then(pl.col("recomputed_reusable_tokens").sum()).alias("recomputed_tokens"),
            *shown,
        )
        .join(per_run, on="run_id")
        .with_columns(
            (pl.col("turns") / pl.col("_run_turns")).alias("share"),
            pl.col("outcome").replace_strict(SUGGESTIONS, default="").alias("suggestion"),
        )
    )
    return table.select(
        "run_id", *(pl.col(name).cast(dtype) for name, dtype in COLUMNS.items())
    ).sort(["run_id", "turns"], descending=[False, True])


@register(
    "miss_causes",
    "Outcomes and missed-reuse causes, with what each suggests",
    params=(Param("examples", int, 3, "example request ids per cause"),),
    columns={"run_id": pl.String(), **COLUMNS},
)
def miss_causes(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    return cause_table(ctx.ledger(LEDGER_COLUMNS), params["examples"])


__all__ = ["COLUMNS", "EXAMPLE_COLUMNS", "LEDGER_COLUMNS", "SUGGESTIONS", "cause_table",
    "miss_causes"]
