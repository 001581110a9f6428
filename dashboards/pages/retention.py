"""Retention & memory: retained bytes beside GPU memory, GiB·s by class, hold times vs TTL."""

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
)

CONTENT = "retention-content"
COST_COLUMNS = ("run_id", "engine_id", "retentions", "released_read", "released_notified",
                "expired", "open", "gib_s_useful", "gib_s_idle", "gib_s_wasted", "gib_s_open",
                "useful_share", "held_s_p50", "held_s_p90", "ttl_s", "prefill_s_saved",
                "gib_s_per_prefill_s_saved", "saved_basis", "decode_queue_s_total",
                "decode_queue_ms_p90")


def content(data: DashboardData, filters: Filters) -> list[Any]:
    """The page's figures and the cost table for one filter selection."""
    labels = data.labels()
    cost = data.result("retention_cost", None, filters)
    cost_table = (cost.frame.select([c for c in COST_COLUMNS if c in cost.frame.columns])
                  if cost.frame is not None else None)
    parts: list[Any] = [
        filter_note(filters, applies_to_turns_only=True),
        figure_of("retention-memory", "retained memory",
                  data.result("retained_memory", None, filters), figures.retained_memory,
                  labels),
        figure_of("retention-classes", "retention cost", cost, figures.retention_classes,
                  labels),
        figure_of("retention-holds", "hold times", data.retentions(filters),
                  figures.hold_times),
        html.H3("Retention cost per decode engine"),
        table(cost_table, "retention-table", why=cost.why, labels=labels),
    ]
    return [p for p in parts if p is not None]


PAGE = filtered_page("/retention", "Retention & memory", CONTENT, content)


__all__ = ["CONTENT", "COST_COLUMNS", "PAGE", "content"]
