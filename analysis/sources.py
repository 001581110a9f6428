"""Which sources of evidence a run had, and what each absent one would have told (pure).

A run's ledger says what it was built from: client records (``observer`` = client: the
benchmark's stats), the router's lookups (kvscope's proxy spans, or a proxy's log), prefill's
reuse decisions (kvscope's engine hooks, or a server's log: ``engine_evidence``), decode's
retention (the hooks), and vLLM's own ``llm_request`` spans (``engine_ttft_ms``). The verdict
names the ones present and, for each one absent, what it would have added — so an ``unknown``
outcome or a "not measured" figure points at the file or flag that would have measured it.

The registered ``evidence`` analysis says the same for the selected runs together, per part of
the picture (proxy spans, first tokens, the hooks' decisions, transfers and retention, tool waits,
GPU memory samples, the retained-bytes gauge): present, on how many turns, and what is *not
measured* without it. The dashboard's overview shows it; the report lists it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from kvscope import semconv
from kvscope.analysis import retention
from kvscope.analysis.ledger import ENGINE_EVIDENCE_HOOKS, ENGINE_EVIDENCE_LOG
from kvscope.analysis.registry import AnalysisContext, register, run
from kvscope.errors import KvscopeError

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


# --- the evidence a store holds (the dashboard's overview, the report) -------------------------

# Which evidence each part of the picture needs: (name, ledger column, what is lost without it).
EVIDENCE: tuple[tuple[str, str, str], ...] = (
    ("proxy turn spans", "turn_ms", "no proxy spans: turns, TTFT and task time not measured"),
    ("first-token times", "ttft_ms", "no first-token events: TTFT not measured"),
    ("engine hooks: reuse decisions", "decision",
     "no engine hooks: reuse decisions not measured (outcomes fall back to unknown)"),
    ("engine hooks: D→P transfers", "d2p_status",
     "no engine hooks: transfer times not measured"),
    ("engine hooks: retention spans", "retention_bytes",
     "no retention spans: retention cost not measured"),
    ("tool waits", "tool_wait_s", "no tool-wait spans: tool wait not measured"),
)

EVIDENCE_COLUMNS: dict[str, pl.DataType] = {
    "source": pl.String(), "present": pl.Boolean(), "turns_with_it": pl.Int64(),
    "missing": pl.String(),
}


# What this module's analyses read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    "run_id", "observer", "turn_ms", "ttft_ms", "tool_wait_s", "decision", "d2p_status",
    "retention_id", "retention_bytes", "router_lookup", "engine_evidence",
    "engine_ttft_ms", "engine_queue_ms")


def evidence_table(ledger: pl.DataFrame, memory: pl.DataFrame | None) -> pl.DataFrame:
    """Which evidence the store holds: source, present, rows, and what is missing without it.

    ``memory`` is the ``retained_memory`` result (None when it could not be computed).
    """
    rows: list[tuple[str, bool, int | None, str]] = []
    for name, column, lost in EVIDENCE:
        count = (ledger.height - ledger[column].null_count()) if column in ledger.columns else 0
        rows.append((name, count > 0, count, "" if count else lost))
    sources = memory["source"].unique().to_list() if memory is not None and \
        "source" in memory.columns else []
    gpu = retention.SOURCE_GPU_USED in sources or retention.SOURCE_GPU_TOTAL in sources
    gauge = retention.SOURCE_RETAINED_GAUGE in sources
    rows.append(("GPU memory samples", gpu, None,
                 "" if gpu else "no GPU sampler: GPU memory not measured"))
    rows.append(("retained-bytes gauge", gauge, None,
                 "" if gauge else "no gauge: retained bytes derived from retention spans"))
    return pl.DataFrame(rows, schema=EVIDENCE_COLUMNS, orient="row")


@register("evidence", "Which evidence the selected runs have, and what is not measured without "
          "each missing source", columns=EVIDENCE_COLUMNS)
def evidence(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    try:
        memory: pl.DataFrame | None = run(ctx, "retained_memory")
    except KvscopeError:  # no memory evidence is itself the finding
        memory = None
    # Only the columns whose evidence it counts (the module's list also serves source_table).
    return evidence_table(ctx.ledger(["run_id", *(column for _, column, _ in EVIDENCE)]), memory)


__all__ = ["CLIENT", "COLUMNS", "ENGINE_HOOKS", "EVIDENCE", "EVIDENCE_COLUMNS", "LEDGER_COLUMNS",
    "PROXY_LOG", "PROXY_SPANS", "RETENTION", "SERVER_LOG", "SOURCES", "VLLM_TRACES", "evidence",
    "evidence_table", "source_table", "sources_sentence"]
