"""TTFT vs task time: what share of each agent task is time to first token, and where it goes."""

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
    with_labels,
)

CONTENT = "task-content"


def content(data: DashboardData, filters: Filters) -> list[Any]:
    """Task-time decomposition, Σ TTFT vs task time, and the per-run summary."""
    labels = data.labels()
    per_conversation = data.result("task_time", None, filters)
    summary = data.result("task_time_summary", None, filters)
    parts: list[Any] = [
        filter_note(filters),
        figure_of("task-decomposition", "task time", per_conversation, figures.task_time,
                  labels),
        figure_of("task-ttft", "TTFT vs task time", per_conversation, figures.ttft_vs_task,
                  labels),
        html.H3("Per run: median and p90 of each part"),
        table(with_labels(summary.frame, labels) if summary.frame is not None else None,
              "task-summary", max_rows=100, why=summary.why),
    ]
    return [p for p in parts if p is not None]


PAGE = filtered_page("/task-time", "TTFT vs task time", CONTENT, content)


__all__ = ["CONTENT", "PAGE", "content"]
