"""The dashboard's pages, one module each, and the pieces they share.

A page module defines ``PAGE``: a :class:`Page` with its path, its title, ``layout(data,
query)`` (the page's controls and empty content holders; cheap) and ``register(app, data)``
(its callbacks). A page's callbacks read the shell's ``filters`` and ``version`` stores, ask
:class:`~kvscope.dashboards.data.DashboardData` for analysis results and format them with the
shared figure builders: no SQL, no aggregation heavier than selecting rows.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
import polars as pl
from dash import Dash, dcc, html

from kvscope.dashboards import figures
from kvscope.dashboards.data import DashboardData, Filters, Result
from kvscope.dashboards.report import NOT_MEASURED, as_shown, format_cell

# Ids of the shell's stores every page reads.
FILTERS = "filters"
VERSION = "version"
MAX_ROWS = 50

# Page modules in navigation order.
MODULES = ("overview", "conversations", "missed", "retention", "task_time", "whatif", "compare")


@dataclass(frozen=True)
class Page:
    """One page: where it lives, what it is called, its layout and its callbacks."""

    path: str
    title: str
    layout: Callable[[DashboardData, Mapping[str, str]], Any]
    register: Callable[[Dash, DashboardData], None]


def pages() -> list[Page]:
    """Every page, in navigation order (imported on first use)."""
    return [importlib.import_module(f"{__name__}.{m}").PAGE for m in MODULES]


def filters_of(raw: Mapping[str, Any] | None) -> Filters:
    """The filters stored in the shell."""
    return Filters.from_store(raw)


def graph(id_: str, fig: go.Figure) -> dcc.Graph:
    """A figure on a page (plotly.js is served by Dash itself, never a CDN)."""
    return dcc.Graph(id=id_, figure=fig, config={"displaylogo": False, "responsive": True})


def figure_of(id_: str, title: str, result: Result,
              build: figures.Builder,
              labels: Mapping[str, str] | None = None) -> dcc.Graph:
    """The graph of one analysis result, or a figure saying why the result is missing."""
    if result.frame is None:
        return graph(id_, figures.missing(title, f"not measured: {result.why}"))
    return graph(id_, build(with_labels(result.frame, labels or {})))


def with_labels(frame: pl.DataFrame, labels: Mapping[str, str]) -> pl.DataFrame:
    """Add run labels to a result keyed by run_id (figures name runs by label)."""
    if "run_id" not in frame.columns or "label" in frame.columns or not labels:
        return frame
    return frame.with_columns(
        pl.col("run_id").replace_strict(dict(labels), default=pl.col("run_id"),
                                        return_dtype=pl.String).alias("label"))


def table(frame: pl.DataFrame | None, id_: str | None = None, max_rows: int = MAX_ROWS,
          why: str | None = None, labels: Mapping[str, str] | None = None) -> html.Div:
    """A frame as an HTML table; nulls read "not measured"; rows beyond ``max_rows`` counted;
    runs named by their label (``labels``: run id → label) rather than their id."""
    if frame is None:
        return html.Div(f"not measured: {why}", className="missing", id=id_ or "")
    frame = as_shown(with_labels(frame, labels or {}))
    head = html.Tr([html.Th(c) for c in frame.columns])
    body = []
    for row in frame.head(max_rows).iter_rows():
        cells = []
        for column, value in zip(frame.columns, row, strict=True):
            text, css = format_cell(value, column)
            cells.append(html.Td(text, className=css))
        body.append(html.Tr(cells))
    shown = min(frame.height, max_rows)
    caption = (f"first {shown:,} of {frame.height:,} rows" if frame.height > max_rows
               else f"{frame.height:,} row{'s' if frame.height != 1 else ''}")
    children = [html.P(caption, className="meta"),
                html.Div(html.Table([html.Thead(head), html.Tbody(body)]),
                         className="table-wrap")]
    return html.Div(children, id=id_) if id_ else html.Div(children)


# Time windows: about WINDOWS_PER_RUN over the longest selected run, 1 s to MAX_WINDOW_S wide.
WINDOWS_PER_RUN = 30
MAX_WINDOW_S = 60.0
# The ledger columns window_s reads.
WINDOW_COLUMNS = ("run_id", "arrival", "end")


def window_s(ledger: pl.DataFrame) -> float:
    """A time-window width sized to the selection's runs, so a run shorter than a minute still
    draws a line (whole seconds: windows are truncated to seconds)."""
    if ledger.is_empty() or "arrival" not in ledger.columns:
        return MAX_WINDOW_S
    ends = pl.coalesce(pl.col("end"), pl.col("arrival")) if "end" in ledger.columns \
        else pl.col("arrival")
    spans = ledger.group_by("run_id").agg(
        ((ends.max() - pl.col("arrival").min()).dt.total_milliseconds() / 1e3).alias("s"))
    longest = spans["s"].max()
    if not isinstance(longest, int | float):
        return MAX_WINDOW_S
    return float(min(MAX_WINDOW_S, max(1, round(longest / WINDOWS_PER_RUN))))


def hint(text: str, id_: str | None = None) -> html.P:
    """A line telling the reader what to do next (not an error: plain, muted)."""
    return html.P(text, className="meta", id=id_) if id_ else html.P(text, className="meta")


def message(text: str, id_: str | None = None) -> html.P:
    """A line saying what is missing or what was selected."""
    return html.P(text, className="missing", id=id_) if id_ else html.P(text, className="missing")


def filter_note(filters: Filters, applies_to_turns_only: bool = False) -> html.P | None:
    """Say which filters are on (and where a page's data ignores some of them)."""
    parts = []
    if filters.runs:
        parts.append(f"runs {', '.join(filters.runs)}")
    if filters.engine:
        parts.append(f"engine {filters.engine}")
    if filters.conversation:
        parts.append(f"conversation {filters.conversation}")
    if filters.start_s is not None or filters.end_s is not None:
        lo = f"{filters.start_s:g}" if filters.start_s is not None else "start"
        hi = f"{filters.end_s:g}" if filters.end_s is not None else "end"
        parts.append(f"time {lo}–{hi} s")
    if not parts:
        return None
    text = "filtered: " + "; ".join(parts)
    if applies_to_turns_only and filters.narrows_turns:
        text += " (time and conversation select turns; retention spans follow run and engine)"
    return html.P(text, className="meta")


__all__ = [
    "FILTERS",
    "MODULES",
    "NOT_MEASURED",
    "VERSION",
    "WINDOW_COLUMNS",
    "Page",
    "content_callback",
    "figure_of",
    "filter_note",
    "filtered_page",
    "filters_of",
    "graph",
    "message",
    "pages",
    "table",
    "with_labels",
]


def content_callback(app: Dash, data: DashboardData, content_id: str, controls: Sequence[str],
                     content: Callable[..., list[Any]]) -> None:
    """Re-render ``content_id`` with ``content(data, filters, *control values)`` whenever a
    control's value, the shell's filters or the data version change."""
    from dash import Input, Output

    @app.callback(Output(content_id, "children"), *[Input(c, "value") for c in controls],
                  Input(FILTERS, "data"), Input(VERSION, "data"))
    def _content(*values: Any) -> list[Any]:
        *chosen, raw, _version = values
        return content(data, filters_of(raw), *chosen)


def filtered_page(path: str, title: str, content_id: str,
                  content: Callable[[DashboardData, Filters], list[Any]]) -> Page:
    """A page whose only control is the shell's filters: a heading and one content holder."""

    def layout(data: DashboardData, query: Mapping[str, str]) -> html.Div:
        return html.Div([html.H2(title), html.Div(id=content_id)])

    def register(app: Dash, data: DashboardData) -> None:
        content_callback(app, data, content_id, (), content)

    return Page(path, title, layout, register)

