"""Compare: two runs side by side (summary with ratios, TTFT and prefill split by prompt length)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from dash import Dash, dcc, html

from kvscope.dashboards import figures
from kvscope.dashboards.data import DashboardData, Filters
from kvscope.dashboards.pages import (
    Page,
    content_callback,
    figure_of,
    filter_note,
    message,
    table,
)

CONTENT = "compare-content"
RUN_A = "compare-a"
RUN_B = "compare-b"


def content(data: DashboardData, filters: Filters, run_a: str | None,
            run_b: str | None) -> list[Any]:
    """The comparison of two runs (the analysis picks ON vs OFF when none are chosen)."""
    # Compare reaches across runs by itself: the run filter does not narrow it.
    scope = replace(filters, runs=())
    chosen = [r for r in (run_a, run_b) if r]
    if len(chosen) == 1 or (len(chosen) == 2 and chosen[0] == chosen[1]):
        return [message("pick two different runs (or neither, to compare ON with OFF)")]
    params = {"runs": chosen} if chosen else {}
    summary = data.result("compare", params, scope)
    by_prompt = data.result("compare_by_prompt", params, scope)
    labels = data.labels()
    parts: list[Any] = [
        filter_note(scope),
        table(summary.frame, "compare-table", why=summary.why, labels=labels),
        figure_of("compare-ttft", "TTFT vs prompt", by_prompt, figures.ttft_vs_prompt, labels),
        figure_of("compare-prefill", "prefill split", by_prompt, figures.prefill_split, labels),
    ]
    return [p for p in parts if p is not None]


def default_pair(data: DashboardData) -> tuple[str, str] | None:
    """The labels of the runs compare picks when none is chosen (the analysis's own choice:
    the latest feature-ON run and its OFF baseline), or None when it cannot pick."""
    from kvscope.analysis.runs import pick_runs
    from kvscope.errors import KvscopeError

    def pick(ctx: Any) -> tuple[str, str] | None:
        try:
            return pick_runs(ctx, None)
        except KvscopeError:
            return None

    pair = data.derived("compare-default-pair", pick, Filters())
    if pair is None:
        return None
    labels = data.labels()
    return labels.get(pair[0], pair[0]), labels.get(pair[1], pair[1])


def layout(data: DashboardData, query: Mapping[str, str]) -> html.Div:
    runs = [{"label": label, "value": run} for run, label in data.labels().items()]
    pair = default_pair(data)
    first, second = pair if pair is not None else ("none: pick two", "none: pick two")
    return html.Div([
        html.H2("Compare two runs"),
        html.Div([dcc.Dropdown(id=RUN_A, options=runs, value=query.get("a"),
                               placeholder=f"run A (default: {first})"),
                  dcc.Dropdown(id=RUN_B, options=runs, value=query.get("b"),
                               placeholder=f"run B (default: {second}, its OFF baseline)")],
                 className="pair"),
        html.Div(id=CONTENT),
    ])


def register(app: Dash, data: DashboardData) -> None:
    content_callback(app, data, CONTENT, (RUN_A, RUN_B), content)


PAGE = Page("/compare", "Compare", layout, register)


__all__ = ["CONTENT", "PAGE", "RUN_A", "RUN_B", "content", "default_pair", "layout", "register"]
