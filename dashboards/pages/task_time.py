"""TTFT vs task time: what share of each agent task is time to first token, and where it goes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dash import Dash, Input, Output, html

from kvscope.dashboards import figures
from kvscope.dashboards.data import DashboardData, Filters
from kvscope.dashboards.pages import (
    FILTERS,
    VERSION,
    Page,
    figure_of,
    filter_note,
    filters_of,
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


def layout(data: DashboardData, query: Mapping[str, str]) -> html.Div:
    return html.Div([html.H2("TTFT vs task time"), html.Div(id=CONTENT)])


def register(app: Dash, data: DashboardData) -> None:
    @app.callback(Output(CONTENT, "children"), Input(FILTERS, "data"), Input(VERSION, "data"))
    def _content(raw: dict[str, Any] | None, version: int | None) -> list[Any]:
        return content(data, filters_of(raw))


PAGE = Page("/task-time", "TTFT vs task time", layout, register)
