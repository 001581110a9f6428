"""Overview: reuse over time, outcomes, TTFT p50/p90, retained memory, freshness, sources and
vLLM's own counters beside the ledger."""

from __future__ import annotations

from typing import Any

from dash import html

from kvscope.dashboards import figures
from kvscope.dashboards.data import DashboardData, Filters
from kvscope.dashboards.pages import (
    figure_of,
    filter_note,
    filtered_page,
    table,
    window_s,
    with_labels,
)
from kvscope.reuse import outcomes

CONTENT = "overview-content"
# What the page reads of the ledger itself (its turn count, freshness, alarm and window width).
LEDGER_COLUMNS = ("run_id", "arrival", "end", "outcome", "invalid_tokens")


def content(data: DashboardData, filters: Filters) -> list[Any]:
    """The page's figures and tables for one filter selection."""
    labels = data.labels()
    ledger = data.ledger(filters, LEDGER_COLUMNS)
    memory = data.result("retained_memory", None, filters)
    reuse_run = data.result("reuse_rate", {"by": "run"}, filters)
    width = window_s(ledger)
    ttft = data.result("ttft_windows", {"window_s": width}, filters)
    sources = data.result("evidence", None, filters)
    reconciled = data.result("reconciliation", None, filters)
    freshness = (f"last turn ended {ledger['end'].max()}" if "end" in ledger.columns
                 and ledger.height else "no turns stored yet")
    parts: list[Any] = [
        filter_note(filters),
        invalid_alarm(ledger),
        html.P(f"{data.name}: {ledger.height:,} turns; {freshness}; data read at "
               f"{data.built_at().isoformat(timespec='seconds')}"
               + (" (live: refreshes as spans arrive)" if data.live else ""),
               id="overview-freshness", className="meta"),
        html.H3("Sources"),
        table(sources.frame, "overview-sources", why=sources.why, labels=labels),
        html.H3("vLLM's own counters beside the ledger"),
        reconciliation_table(reconciled.frame, reconciled.why),
        html.H3("Reuse per run"),
        table(with_labels(reuse_run.frame, labels) if reuse_run.frame is not None else None,
              "overview-reuse-table", why=reuse_run.why),
        figure_of("overview-reuse", "reuse over time",
                  data.result("reuse_rate", {"by": "window", "window_s": width}, filters),
                  figures.reuse_over_time, labels),
        figure_of("overview-outcomes", "outcomes", data.result("miss_causes", None, filters),
                  figures.outcome_shares, labels),
        figure_of("overview-ttft", "TTFT over time", ttft, figures.ttft_over_time, labels),
        figure_of("overview-memory", "retained memory", memory, figures.retained_memory, labels),
    ]
    return [p for p in parts if p is not None]


def reconciliation_table(frame: Any, why: str | None) -> Any:
    """The reconciliation rows, or what would give them (a /metrics snapshot ingested)."""
    if frame is not None and frame.height == 0:
        return html.P("not measured: no vLLM /metrics snapshot in these runs (kvscope ingest "
                      "vllm-prefill-metrics:FILE)", className="missing",
                      id="overview-reconciliation")
    return table(frame, "overview-reconciliation", why=why)


def invalid_alarm(ledger: Any) -> Any:
    """A banner above everything when turns loaded decode KV that does not match their prompt."""
    if "outcome" not in getattr(ledger, "columns", ()):
        return None
    bad = ledger.filter(ledger["outcome"] == outcomes.REUSED_INVALID)
    if bad.height == 0:
        return None
    counted = bad["invalid_tokens"].drop_nulls().sum() if "invalid_tokens" in bad.columns else 0
    return html.Div(
        f"Correctness alarm: {bad.height:,} turn(s) loaded decode KV that does not match their "
        f"prompt (reused_invalid; {counted:,} tokens counted). Edited or truncated histories, or "
        "another client, under the same conversation id; see Missed reuse for the evidence, and "
        "kvscope proxy --reuse-guard.", id="overview-alarm", className="alarm",
        style={"border": "2px solid #d62728", "padding": ".5rem 1rem", "color": "#d62728"})


PAGE = filtered_page("/", "Overview", CONTENT, content)


__all__ = ["CONTENT", "LEDGER_COLUMNS", "PAGE", "content", "invalid_alarm", "reconciliation_table"]
