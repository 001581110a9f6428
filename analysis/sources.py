"""Which sources of evidence a run had, and what each absent one would have told (pure).

A run's ledger says what it was built from: client records (``observer`` = client: the
benchmark's stats), the router's lookups (kvscope's proxy spans, or a proxy's log), prefill's
reuse decisions (kvscope's engine hooks, or a server's log: ``engine_evidence``), decode's
retention (the hooks), and vLLM's own ``llm_request`` spans (``engine_ttft_ms``). The verdict
names the ones present and, for each one absent, what it would have added — so an ``unknown``
outcome or a "not measured" figure points at the file or flag that would have measured it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope import semconv
from kvscope.analysis.ledger import ENGINE_EVIDENCE_HOOKS, ENGINE_EVIDENCE_LOG

CLIENT = "client"
PROXY_SPANS = "proxy_spans"
PROXY_LOG = "proxy_log"
ENGINE_HOOKS = "engine_hooks"
SERVER_LOG = "server_log"
RETENTION = "retention"
VLLM_TRACES = "vllm_traces"

# In the order a verdict lists them: name, then what it would tell when absent.
SOURCES: dict[str, tuple[str, str]] = {
    CLIENT: ("the client's record (the benchmark's --stats-json-output)",
             "the client's TTFT, latency and tool waits per turn"),
    PROXY_SPANS: ("kvscope proxy's spans", ""),
    PROXY_LOG: ("the proxy's log", ""),
    ENGINE_HOOKS: ("kvscope's engine hooks", "tokens pulled, read bytes and times, and the "
                   "exact reason a pull did not happen"),
    SERVER_LOG: ("the prefill server's log", ""),
    RETENTION: ("decode's retention spans (kvscope's hooks on decode)",
                "what keeping the KV on decode cost (GiB·s) and whether it expired unread"),
    VLLM_TRACES: ("vLLM's own request traces (llm_request)",
                  "engine-side TTFT and queueing (vLLM --otlp-traces-endpoint pointed at "
                  "kvscope serve)"),
}
# Told when neither of a pair is there.
_ROUTER_MISSING = ("the proxy's log or kvscope proxy", "the router's HIT/MISS per turn, whether "
                   "decode returned its params, and the prefill leg's time")
_ENGINE_MISSING = ("prefill's reuse decision (kvscope's engine hooks, or the prefill server's "
                   "log at DEBUG)", "whether a turn the router offered decode's KV pulled it, "
                   "skipped it below the threshold, or had its read declined or fail; without "
                   "it such turns are unknown")

COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    # The names of the sources present, comma-separated (a plain column: CSV and tables).
    "sources": pl.String(),
}


def source_table(ledger: pl.DataFrame) -> pl.DataFrame:
    """Per run, the names (:data:`SOURCES` keys) of the sources its ledger shows (pure)."""
    if ledger.is_empty():
        return pl.DataFrame(schema=COLUMNS)
    c = pl.col
    seen = {
        CLIENT: (c("observer") == semconv.OBSERVER_CLIENT),
        PROXY_SPANS: c("router_lookup").is_not_null() & c("observer").is_null(),
        PROXY_LOG: c("router_lookup").is_not_null() & c("observer").is_not_null(),
        ENGINE_HOOKS: c("engine_evidence") == ENGINE_EVIDENCE_HOOKS,
        SERVER_LOG: c("engine_evidence") == ENGINE_EVIDENCE_LOG,
        RETENTION: c("retention_id").is_not_null() & c("retention_bytes").is_not_null(),
        VLLM_TRACES: c("engine_ttft_ms").is_not_null() | c("engine_queue_ms").is_not_null(),
    }
    flags = ledger.group_by("run_id").agg(
        [expr.fill_null(False).any().alias(name) for name, expr in seen.items()])
    rows = [{"run_id": row["run_id"], "sources": ",".join(name for name in SOURCES if row[name])}
            for row in flags.iter_rows(named=True)]
    return pl.DataFrame(rows, schema=COLUMNS)


def sources_sentence(row: Mapping[str, Any]) -> str | None:
    """One sentence: the run's sources, then each absent one and what it would have told."""
    present = row.get("sources")
    if present is None:
        return None
    had = set(filter(None, present.split(",")))
    named = [SOURCES[name][0] for name in SOURCES if name in had]
    missing: list[tuple[str, str]] = []
    if not had & {CLIENT, PROXY_SPANS}:  # kvscope's proxy times the turns itself
        missing.append(SOURCES[CLIENT])
    if not had & {PROXY_SPANS, PROXY_LOG}:
        missing.append(_ROUTER_MISSING)
    if not had & {ENGINE_HOOKS, SERVER_LOG}:
        missing.append(_ENGINE_MISSING)
    elif ENGINE_HOOKS not in had:
        missing.append(SOURCES[ENGINE_HOOKS])
    for name in (RETENTION, VLLM_TRACES):
        if name not in had:
            missing.append(SOURCES[name])
    text = f"Sources: {', '.join(named) if named else 'none recognised'}."
    if missing:
        text += " Not in this run: " + "; ".join(f"{what} (would have told {why})"
                                                for what, why in missing) + "."
    return text


__all__ = ["COLUMNS", "SOURCES", "source_table", "sources_sentence"]
