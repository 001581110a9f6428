"""Overview: reuse over time, outcomes, TTFT p50/p90, retained memory, freshness and sources."""

from __future__ import annotations

from typing import Any

from dash import html

from kvscope.dashboards import figures
from kvscope.dashboards.data import DashboardData, Filters, source_table, ttft_windows
from kvscope.dashboards.pages import (
    figure_of,
    filter_note,
    filtered_page,
    graph,
    table,
    with_labels,
)

CONTENT = "overview-content"
WINDOW_S = 60.0


def content(data: DashboardData, filters: Filters) -> list[Any]:
    """The page's figures and tables for one filter selection."""
    labels = data.labels()
    ledger = data.ledger(filters)
    memory = data.result("retained_memory", None, filters)
    reuse_run = data.result("reuse_rate", {"by": "run"}, filters)
    ttft = data.derived(f"ttft_windows:{WINDOW_S}",
                        lambda ctx: ttft_windows(ctx.ledger(), WINDOW_S), filters)
    sources = source_table(ledger, memory.frame)
    freshness = (f"last turn ended {ledger['end'].max()}" if "end" in ledger.columns
                 and ledger.height else "no turns stored yet")
    parts: list[Any] = [
        filter_note(filters),
        html.P(f"{data.name}: {ledger.height:,} turns; {freshness}; data read at "
               f"{data.built_at().isoformat(timespec='seconds')}"
               + (" (live: refreshes as spans arrive)" if data.live else ""),
               id="overview-freshness", className="meta"),
        html.H3("Sources"),
        table(sources, "overview-sources"),
        html.H3("Reuse per run"),
        table(with_labels(reuse_run.frame, labels) if reuse_run.frame is not None else None,
              "overview-reuse-table", why=reuse_run.why),
        figure_of("overview-reuse", "reuse over time",
                  data.result("reuse_rate", {"by": "window", "window_s": WINDOW_S}, filters),
                  figures.reuse_over_time, labels),
        figure_of("overview-outcomes", "outcomes", data.result("miss_causes", None, filters),
                  figures.outcome_shares, labels),
        graph("overview-ttft", figures.ttft_over_time(with_labels(ttft, labels))),
        figure_of("overview-memory", "retained memory", memory, figures.retained_memory, labels),
    ]
    return [p for p in parts if p is not None]


PAGE = filtered_page("/", "Overview", CONTENT, content)
