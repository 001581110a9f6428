"""The ledger's reuse beside vLLM's own counters, per run and role (analysis ``reconciliation``).

vLLM's counters come from a snapshot of a server's ``/metrics`` ingested with the run
(``kvscope ingest vllm-prefill-metrics:FILE``, :mod:`kvscope.collector.ingest.vllm_metrics`;
``--run RUN`` adds them to a run kvscope recorded live), recorded in the run's settings; each
role's snapshots (all engines) are summed. Per quantity a row gives the ledger's value, vLLM's,
their difference (vLLM − ledger), what explains it, and whether it is flagged (a difference
nothing the ledger knows explains). Either side is null where not measured (no snapshot, a
series the snapshot lacks, or no turn with the evidence).

Prefill (vLLM's counts are its scheduler's, at admission, for every request it served):

* ``d2p_tokens_scheduled``: Σ ``to_pull_tokens`` of the turns whose decision was a pull against
  ``prompt_tokens_by_source{source="external_kv_transfer"}``, the tokens allocated to load from
  decode as vLLM counts them: set at a request's admission (``PrefillStats.set``), reported with
  its first output (``take_prefill_stats``). A pull whose read failed or was declined is not in
  vLLM's count: with policy ``fail`` the request ends in an error output that carries no stats;
  with ``recompute`` it goes back to waiting, is admitted again (the stats set again) and either
  re-issues the load, which parks it for good (the connector queues one read per request), or
  computes with nothing external. The ledger's failed reads explain the difference; what else
  differs is the ledger missing requests (a warm-up, a request no log or span placed);
* ``d2p_tokens_reused``: Σ ``remote_reused_tokens`` against the same counter: vLLM counts what
  was allocated to load, also tokens the ledger does not call reused (a read of released or
  misaligned blocks, a stale offer, a preempted read): explained by ``to_pull_tokens −
  remote_reused_tokens`` of the reads that finished;
* ``reads_ok``, ``reads_failed``, ``reads_declined_expired``: the turns' D→P read statuses
  against the NIXL counters (``vllm:nixl_xfer_time_seconds_count``,
  ``vllm:nixl_num_failed_transfers``, ``vllm:nixl_num_kv_expired_reqs``): vLLM counts
  transfers (one request's read may be several with tensor parallelism) and counts a failed
  handshake without a request;
* ``local_cache_hit_tokens``: Σ ``local_hit_tokens`` against ``source="local_cache_hit"``:
  vLLM counts every prompt's prefix-cache hit (first turns and shared prefixes too), the ledger
  only the part of a turn's reusable span, so vLLM's is the larger and this is never flagged.

Decode: ``notifications_after_expiry`` (``vllm:nixl_num_notifications_after_expiry``: reads
of blocks decode had already released) beside the turns the ledger found invalid after release
(``invalid_kind`` ``after_release``; an edited history's read is of blocks decode still held).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope import semconv
from kvscope.analysis.registry import AnalysisContext, register
from kvscope.analysis.runs import LEDGER_COLUMNS as _RUNS_READS
from kvscope.analysis.runs import run_settings, run_table
from kvscope.reuse import validity

COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "role": pl.String(),
    "vllm_engines": pl.String(),
    "quantity": pl.String(),
    "ledger_value": pl.Float64(),
    "vllm_value": pl.Float64(),
    "difference": pl.Float64(),
    "explained": pl.Float64(),
    "flagged": pl.Boolean(),
    "explanation": pl.String(),
}

_READ_FAILURES = [semconv.TRANSFER_FAILED, semconv.TRANSFER_HANDSHAKE_FAILED,
                  semconv.TRANSFER_DECLINED_EXPIRED]
_METRICS_KINDS = {"vllm-metrics": None, "vllm-prefill-metrics": semconv.ROLE_PREFILL,
                  "vllm-decode-metrics": semconv.ROLE_DECODE}


def vllm_counters(settings: Mapping[str, Any]) -> dict[str | None, tuple[list[str],
                                                                          dict[str, float]]]:
    """Per role (None: not named), the engines and summed counters of a run's snapshots."""
    found: dict[str | None, tuple[list[str], dict[str, float]]] = {}
    ingested = settings.get("ingested")
    later = ingested.get("files", []) if isinstance(ingested, dict) else []
    for entry in [*settings.get("files", []), *later]:
        if not isinstance(entry, dict) or entry.get("kind") not in _METRICS_KINDS:
            continue
        role = _METRICS_KINDS[entry["kind"]]
        engines, totals = found.setdefault(role, ([], {}))
        for engine, counters in (entry.get("vllm_counters") or {}).items():
            engines.append(str(engine))
            for name, value in counters.items():
                if isinstance(value, int | float):
                    totals[name] = totals.get(name, 0.0) + float(value)
    return found


def _sum(frame: pl.DataFrame, column: str) -> float | None:
    values = frame[column].drop_nulls()
    return float(values.sum()) if len(values) else None


def _row(run_id: str, role: str, engines: list[str], quantity: str, ledger: float | None,
         vllm: float | None, explained: float | None, note: str,
         never_flag: bool = False) -> dict[str, Any]:
    difference = vllm - ledger if ledger is not None and vllm is not None else None
    flagged = (difference is not None and not never_flag
               and abs(difference - (explained or 0.0)) > 0.5)
    return {"run_id": run_id, "role": role, "vllm_engines": ", ".join(engines),
            "quantity": quantity, "ledger_value": ledger, "vllm_value": vllm,
            "difference": difference, "explained": explained, "flagged": flagged,
            "explanation": note}


def _prefill_rows(run_id: str, engines: list[str], counters: dict[str, float],
                  turns: pl.DataFrame) -> list[dict[str, Any]]:
    c = pl.col
    pulled = turns.filter(c("decision") == semconv.DECISION_PULL)
    # Reads that failed or were declined: their requests report no prefill stats to vLLM.
    uncounted_reads = pulled.filter(c("d2p_status").is_in(_READ_FAILURES))
    counted_reads = pulled.filter(~c("d2p_status").is_in(_READ_FAILURES).fill_null(False))
    unmeasured = turns.filter((c("turn_index") >= 2) & c("remote_reused_tokens").is_null())
    external = counters.get("prompt_tokens_external_kv_transfer")
    status = turns["d2p_status"]
    has_reads = status.is_not_null().any()

    def reads(value: str) -> float | None:
        return float((status == value).sum()) if has_reads else None

    failed = _sum(uncounted_reads, "to_pull_tokens") or 0.0
    not_reuse = _sum(counted_reads.select(c("to_pull_tokens") - c("remote_reused_tokens")),
                     "to_pull_tokens") or 0.0
    rows = [
        _row(run_id, semconv.ROLE_PREFILL, engines, "d2p_tokens_scheduled",
             _sum(pulled, "to_pull_tokens"), external, -failed,
             f"tokens allocated to load from decode; vLLM does not count a read that failed "
             f"or was declined (its request reports no prefill stats: {failed:.0f} tokens in "
             f"this run's ledger); any other difference is a request the ledger has no turn "
             f"for"),
        _row(run_id, semconv.ROLE_PREFILL, engines, "d2p_tokens_reused",
             _sum(turns, "remote_reused_tokens"), external, not_reuse,
             f"vLLM counts what was allocated to load, also reads the ledger does not call "
             f"reuse (released, misaligned or stale blocks, a preempted read: {not_reuse:.0f} "
             f"tokens)"
             + (f"; {len(unmeasured)} turns not measured by the ledger" if len(unmeasured)
                else "")),
        _row(run_id, semconv.ROLE_PREFILL, engines, "reads_ok", reads(semconv.TRANSFER_OK),
             counters.get("nixl_transfers"), None,
             "vLLM counts transfers (several per read with tensor parallelism)",
             never_flag=True),
        _row(run_id, semconv.ROLE_PREFILL, engines, "reads_failed",
             None if not has_reads else float(status.is_in(
                 [semconv.TRANSFER_FAILED, semconv.TRANSFER_HANDSHAKE_FAILED]).sum()),
             counters.get("nixl_failed_transfers"), 0.0,
             "vLLM also counts a failed handshake no request waited on"),
        _row(run_id, semconv.ROLE_PREFILL, engines, "reads_declined_expired",
             reads(semconv.TRANSFER_DECLINED_EXPIRED), counters.get("nixl_kv_expired_reqs"),
             0.0, "reads prefill declined because decode's blocks were about to expire"),
        _row(run_id, semconv.ROLE_PREFILL, engines, "local_cache_hit_tokens",
             _sum(turns, "local_hit_tokens"), counters.get("prompt_tokens_local_cache_hit"),
             None, "vLLM counts every prompt's prefix-cache hit, the ledger only the part of a "
             "turn's reusable span: vLLM's is the larger", never_flag=True),
    ]
    # Unmeasured turns make the token comparison one-sided: say so rather than flag.
    if len(unmeasured):
        rows[1]["flagged"] = False
    # vLLM's expiry counter also counts this engine's own send-side leases that expired (blocks
    # it held for a P->D read that never came: "Releasing expired KV blocks" on prefill,
    # nixl/base_worker.py), which are no turn's read: the ledger's declined reads are a lower
    # bound of it (seen on real servers: 8 counted, 1 declined read, decode killed mid-run).
    declined = rows[4]
    if declined["difference"] is not None and declined["difference"] > 0:
        declined["flagged"] = False
        declined["explanation"] += ("; vLLM also counts this engine's send-side leases that "
                                    "expired unread (no turn's read): the ledger's count is a "
                                    "lower bound")
    # Pulls whose token count the evidence did not give (a server log's concurrent reads, whose
    # allocation lines name no request): the ledger's sum is a lower bound.
    uncounted = pulled.filter(c("to_pull_tokens").is_null())
    if len(uncounted):
        rows[0]["flagged"] = False
        rows[0]["explanation"] += (f"; {len(uncounted)} pulls whose token count was not "
                                   "measured (the ledger's sum is a lower bound)")
    return rows


def _decode_rows(run_id: str, engines: list[str], counters: dict[str, float],
                 turns: pl.DataFrame) -> list[dict[str, Any]]:
    after = turns.filter(pl.col("invalid_kind") == validity.INVALID_AFTER_RELEASE)
    return [_row(run_id, semconv.ROLE_DECODE, engines, "notifications_after_expiry",
                 float(len(after)) if len(turns) else None,
                 counters.get("nixl_notifications_after_expiry"), 0.0,
                 "reads of blocks decode had released (the ledger: turns whose loaded KV is "
                 "invalid after_release)")]


# What this module's analyses read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    ("run_id", "turn_index", "decision", "to_pull_tokens", "local_hit_tokens",
    "remote_reused_tokens", "d2p_status", "invalid_kind") + _RUNS_READS)


def reconcile_table(runs: pl.DataFrame, ledger: pl.DataFrame) -> pl.DataFrame:
    """One row per run, role and quantity where the run has vLLM's counters (pure)."""
    rows: list[dict[str, Any]] = []
    for run_id, raw in runs.select("run_id", "settings").iter_rows():
        turns = ledger.filter(pl.col("run_id") == run_id)
        for role, (engines, counters) in vllm_counters(run_settings(raw)).items():
            if role == semconv.ROLE_DECODE:
                rows += _decode_rows(run_id, engines, counters, turns)
                continue
            found = _prefill_rows(run_id, engines, counters, turns)
            if role is None:  # compared as prefill's, the role not named
                for row in found:
                    row["role"] = "not named"
            rows += found
    return pl.DataFrame(rows, schema=COLUMNS)


@register("reconciliation", "The ledger's reuse beside vLLM's own counters (per run and role)",
          columns=COLUMNS)
def reconciliation(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    runs = run_table(ctx)
    if runs.is_empty() or "settings" not in runs.columns:
        return pl.DataFrame(schema=COLUMNS)
    return reconcile_table(runs, ctx.ledger(LEDGER_COLUMNS))


__all__ = ["COLUMNS", "LEDGER_COLUMNS", "reconcile_table", "reconciliation", "vllm_counters"]
