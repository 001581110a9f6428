"""What-if: replay the observed timelines under other TTL / threshold settings, recommend one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl
from dash import Dash, dcc, html

from kvscope.analysis.whatif import MAX_SETTINGS
from kvscope.dashboards import figures
from kvscope.dashboards.data import DashboardData, Filters
from kvscope.dashboards.pages import (
    Page,
    content_callback,
    figure_of,
    filter_note,
    message,
    table,
    with_labels,
)

CONTENT = "whatif-content"
TTL = "whatif-ttl"
THRESHOLD = "whatif-threshold"
DEFAULT_TTL = "60,120,240,480,900"
DEFAULT_THRESHOLD = "16,64,256"
SHOWN = ("label", "source", "decoder_kv_blocks_ttl", "kv_recompute_threshold", "router_ttl",
         "token_reuse_rate", "retained_gib_s", "ttft_p50_ms", "ttft_p90_ms", "reuse_rate_delta",
         "retained_gib_s_delta", "recommended", "note")


def content(data: DashboardData, filters: Filters, ttl: str | None,
            threshold: str | None) -> list[Any]:
    """The sweep's curves, the recommendation and the table, for the typed settings."""
    params = {"ttl": ttl or DEFAULT_TTL, "threshold": threshold or DEFAULT_THRESHOLD}
    result = data.result("whatif", params, filters)
    labels = data.labels()
    parts: list[Any] = [filter_note(filters),
                        html.P(f"At most {MAX_SETTINGS} settings (TTLs x thresholds) a request: "
                               "each one replays every observed turn.", className="meta"),
                        figure_of("whatif-curves", "what-if", result, figures.whatif_curves,
                                  labels)]
    if result.frame is None:
        parts.append(message(f"what-if not measured: {result.why}", "whatif-recommendation"))
        return [p for p in parts if p is not None]
    frame = with_labels(result.frame, labels)
    best = frame.filter(pl.col("recommended").fill_null(False))
    notes = frame.filter(pl.col("source") == "observed")["note"].drop_nulls().to_list() \
        if "source" in frame.columns else []
    lines = [f"{r['label']}: decoder_kv_blocks_ttl={r['decoder_kv_blocks_ttl']:g} s, "
             f"kv_recompute_threshold={r['kv_recompute_threshold']} ({r['note'] or ''})"
             for r in best.iter_rows(named=True)]
    parts.append(html.Div([html.H3("Recommended setting"),
                           html.Ul([html.Li(t) for t in lines or notes
                                    or ["no recommendation: not measured"]])],
                          id="whatif-recommendation"))
    parts.append(table(frame.select([c for c in SHOWN if c in frame.columns]), "whatif-table",
                       max_rows=200))
    return [p for p in parts if p is not None]


def layout(data: DashboardData, query: Mapping[str, str]) -> html.Div:
    return html.Div([
        html.H2("What-if"),
        html.Label(["decoder_kv_blocks_ttl (s): ",
                    dcc.Input(id=TTL, value=DEFAULT_TTL, debounce=True, type="text")]),
        html.Label([" kv_recompute_threshold (tokens): ",
                    dcc.Input(id=THRESHOLD, value=DEFAULT_THRESHOLD, debounce=True,
                              type="text")]),
        html.Div(id=CONTENT),
    ])


def register(app: Dash, data: DashboardData) -> None:
    content_callback(app, data, CONTENT, (TTL, THRESHOLD), content)


PAGE = Page("/whatif", "What-if", layout, register)


__all__ = ["CONTENT", "DEFAULT_THRESHOLD", "DEFAULT_TTL", "PAGE", "SHOWN", "THRESHOLD", "TTL",
    "content", "layout", "register"]
