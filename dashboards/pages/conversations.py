"""Conversations: pick one, see each turn's legs, transfers, tool wait, outcome and evidence."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl
from dash import Dash, Input, Output, State, dcc, html

from kvscope.dashboards import figures
from kvscope.dashboards.data import MAX_CONVERSATION_OPTIONS, DashboardData, Filters
from kvscope.dashboards.pages import FILTERS, VERSION, Page, filters_of, graph, message, table

CONTENT = "conversations-content"
PICK = "conversation-pick"
WANTED = "conversation-wanted"
_SEP = "\x1f"  # between run id and conversation id in a picker value (ids never hold it)

# The per-turn table under the waterfall: what decided each outcome.
TURN_COLUMNS = ("turn_index", "outcome", "evidence", "prompt_tokens", "reusable_tokens",
                "local_hit_tokens", "remote_reused_tokens", "ttft_ms", "prefill_ms", "d2p_ms",
                "p2d_ms", "decode_ms", "tool_wait_s", "x_request_id")


def pick_value(run_id: str, conversation_id: str) -> str:
    """The picker's value for one conversation of one run."""
    return f"{run_id}{_SEP}{conversation_id}"


def options(data: DashboardData, filters: Filters) -> tuple[list[dict[str, str]], str | None]:
    """Picker options (label · conversation, turns) and a note when the list was cut."""
    listed = data.conversations(filters)
    labels = data.labels()
    shown = listed.head(MAX_CONVERSATION_OPTIONS)
    opts = [{"label": f"{labels.get(r, r)} · {c} ({n} turns)", "value": pick_value(r, c)}
            for r, c, n in shown.iter_rows()]
    cut = (f"first {shown.height:,} of {listed.height:,} conversations listed: narrow the "
           "filters (run, engine, time) to reach the others" if listed.height > shown.height
           else None)
    return opts, cut


def content(data: DashboardData, filters: Filters, picked: str | None) -> list[Any]:
    """The waterfall and the turn table of the picked conversation."""
    if not picked or _SEP not in picked:
        return [message("pick a conversation above")]
    run_id, conversation_id = picked.split(_SEP, 1)
    turns = data.derived(
        f"conversation:{picked}",
        lambda ctx: ctx.ledger().filter((pl.col("run_id") == run_id)
                                        & (pl.col("conversation_id") == conversation_id)),
        filters)
    if turns.is_empty():
        return [message(f"conversation {conversation_id} has no turns in this selection")]
    shown = turns.sort("turn_index").select([c for c in TURN_COLUMNS if c in turns.columns])
    label = data.labels().get(run_id, run_id)
    return [
        html.H3(f"{label} · {conversation_id}"),
        graph("conversation-waterfall", figures.conversation_waterfall(turns)),
        html.Ul([html.Li(f"turn {t}: {o}", className="outcome-label")
                 for t, o in shown.select("turn_index", "outcome").iter_rows()],
                id="conversation-outcomes"),
        table(shown, "conversation-turns", max_rows=500, labels=data.labels()),
    ]


def layout(data: DashboardData, query: Mapping[str, str]) -> html.Div:
    wanted = None
    if query.get("run") and query.get("conversation"):
        wanted = pick_value(query["run"], query["conversation"])
    return html.Div([
        html.H2("Conversations"),
        # The link's conversation waits in a store: a dropdown drops a value not yet in its
        # options, and the options arrive with the first callback.
        dcc.Store(id=WANTED, data=wanted),
        dcc.Dropdown(id=PICK, placeholder="pick a conversation", clearable=False),
        html.P(id="conversation-pick-note", className="meta"),
        html.Div(id=CONTENT),
    ])


def register(app: Dash, data: DashboardData) -> None:
    @app.callback(Output(PICK, "options"), Output(PICK, "value"),
                  Output("conversation-pick-note", "children"),
                  Input(FILTERS, "data"), Input(VERSION, "data"), State(PICK, "value"),
                  State(WANTED, "data"))
    def _options(raw: dict[str, Any] | None, version: int | None, current: str | None,
                 wanted: str | None) -> tuple[list[dict[str, str]], str | None, str]:
        opts, cut = options(data, filters_of(raw))
        values = {o["value"] for o in opts}
        value = next((v for v in (current, wanted) if v in values),
                     opts[0]["value"] if opts else None)
        return opts, value, cut or ""

    @app.callback(Output(CONTENT, "children"), Input(PICK, "value"), Input(FILTERS, "data"),
                  Input(VERSION, "data"))
    def _content(picked: str | None, raw: dict[str, Any] | None,
                 version: int | None) -> list[Any]:
        return content(data, filters_of(raw), picked)


PAGE = Page("/conversations", "Conversations", layout, register)


__all__ = ["CONTENT", "PAGE", "PICK", "TURN_COLUMNS", "WANTED", "content", "layout", "options",
    "pick_value", "register"]
