"""Missed reuse: causes over time and by engine, tokens lost, example turns and suggestions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl
from dash import Dash, Input, Output, dcc, html

from kvscope.dashboards import figures
from kvscope.dashboards.data import DashboardData, Filters
from kvscope.dashboards.pages import (
    FILTERS,
    VERSION,
    WINDOW_COLUMNS,
    Page,
    figure_of,
    filter_note,
    filters_of,
    hint,
    table,
    window_s,
    with_labels,
)

CONTENT = "missed-content"
CAUSE = "missed-cause"
DRILL = "missed-drill"
EXAMPLES = 20
EXAMPLE_COLUMNS = ("run_id", "conversation_id", "turn_index", "x_request_id", "reusable_tokens",
                   "recomputed_reusable_tokens", "evidence")


def causes(data: DashboardData, filters: Filters) -> list[str]:
    """The miss causes present in the selection, most turns first."""
    result = data.result("miss_causes", None, filters)
    if result.frame is None or result.frame.is_empty():
        return []
    misses = result.frame.filter(~pl.col("outcome").is_in(figures.NOT_MISSES))
    return (misses.group_by("outcome").agg(pl.col("turns").sum())
            .sort("turns", descending=True)["outcome"].to_list())


def content(data: DashboardData, filters: Filters) -> list[Any]:
    """Figures and the cause table (with suggestions) of one filter selection."""
    labels = data.labels()
    result = data.result("miss_causes", None, filters)
    width = window_s(data.ledger(filters, WINDOW_COLUMNS))
    windows = data.result("outcome_windows", {"window_s": width}, filters)
    engines = data.result("outcome_engines", None, filters)
    # With one prefill engine the by-engine chart repeats the totals: left out.
    several = (engines.frame is not None and "prefill_engine" in engines.frame.columns
               and engines.frame["prefill_engine"].n_unique() > 1)
    table_frame = None
    if result.frame is not None:
        table_frame = with_labels(result.frame, labels).filter(
            ~pl.col("outcome").is_in(figures.NOT_MISSES)).select(
            "label", "outcome", "turns", "share", "recomputed_tokens", "suggestion")
    parts: list[Any] = [
        filter_note(filters),
        figure_of("missed-over-time", "causes over time", windows, figures.outcomes_over_time,
                  labels),
        figure_of("missed-by-engine", "causes by engine", engines, figures.outcomes_by_engine)
        if several else None,
        figure_of("missed-tokens", "tokens lost", result, figures.tokens_lost, labels),
        html.H3("Causes and the change each suggests"),
        table(table_frame, "missed-table", why=result.why),
    ]
    return [p for p in parts if p is not None]


def drill(data: DashboardData, filters: Filters, cause: str | None) -> list[Any]:
    """Example turns of one cause, with the suggestion."""
    if not cause:
        return [hint("pick a cause to see example turns", "missed-hint")]
    from kvscope.analysis.causes import SUGGESTIONS

    examples = data.derived(
        f"examples:{cause}",
        lambda ctx: ctx.ledger().filter(pl.col("outcome") == cause).head(EXAMPLES), filters)
    shown = examples.select([c for c in EXAMPLE_COLUMNS if c in examples.columns])
    return [html.P(["suggested change: ", html.Strong(SUGGESTIONS.get(cause, "none recorded"))],
                   id="missed-suggestion"),
            table(shown, "missed-examples", labels=data.labels())]


def layout(data: DashboardData, query: Mapping[str, str]) -> html.Div:
    return html.Div([
        html.H2("Missed reuse"), html.Div(id=CONTENT),
        html.H3("Example turns"),
        dcc.Dropdown(id=CAUSE, placeholder="pick a cause"), html.Div(id=DRILL),
    ])


def register(app: Dash, data: DashboardData) -> None:
    @app.callback(Output(CONTENT, "children"), Output(CAUSE, "options"),
                  Input(FILTERS, "data"), Input(VERSION, "data"))
    def _content(raw: dict[str, Any] | None, version: int | None,
                 ) -> tuple[list[Any], list[str]]:
        filters = filters_of(raw)
        return content(data, filters), causes(data, filters)

    @app.callback(Output(DRILL, "children"), Input(CAUSE, "value"), Input(FILTERS, "data"),
                  Input(VERSION, "data"))
    def _drill(cause: str | None, raw: dict[str, Any] | None,
               version: int | None) -> list[Any]:
        return drill(data, filters_of(raw), cause)


PAGE = Page("/missed", "Missed reuse", layout, register)


__all__ = ["CAUSE", "CONTENT", "DRILL", "EXAMPLES", "EXAMPLE_COLUMNS", "PAGE", "causes", "content",
    "drill", "layout", "register"]
