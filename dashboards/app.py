"""The live dashboard: a Dash app over a store file (read-only) or a live receiver's store.

:func:`create_app` builds the app; nothing is read until a browser asks for a page. The shell
holds the navigation, the filters (run, engine, conversation, time window) and two stores every
page reads: ``filters`` (the selection) and ``version`` (the data version; in live mode a
``dcc.Interval`` re-checks it and pages re-render when rows arrived). Pages live in
:mod:`kvscope.dashboards.pages`, one module each; results come from
:class:`~kvscope.dashboards.data.DashboardData`, cached per analysis, parameters, filters and
data version. Dash serves its own scripts (plotly.js included): nothing is fetched from a CDN.

:class:`DashboardServer` serves an app on a thread; the commands that run it (``kvscope
dashboard`` and ``kvscope serve --dashboard``) live in :mod:`kvscope.cli.serve`. Servers bind
127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl

from dash import Dash, Input, Output, State, dcc, html
from werkzeug.serving import BaseWSGIServer, make_server

from kvscope import settings
from kvscope.dashboards.data import DEFAULT_REFRESH_S, DashboardData, Filters, open_data
from kvscope.dashboards.deadline import BodyDeadline, DeadlineRequestHandler
from kvscope.dashboards.pages import FILTERS, VERSION, Page, message, pages
from kvscope.store.source import Source
from kvscope.store.writer import StoreWriter

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8050
TITLE = "kvscope"
TICK = "tick"

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222}
header{background:#f4f6fa;border-bottom:1px solid #dde;padding:.5rem 1rem}
nav a{margin-right:1rem;text-decoration:none;color:#1f5fa8}nav a.active{font-weight:bold}
.filters{display:flex;gap:1rem;flex-wrap:wrap;align-items:center;margin-top:.5rem}
.filters>div{min-width:14rem}.meta{color:#666;font-size:.85rem}.missing{color:#a33}
main{padding:0 1rem 2rem}table{border-collapse:collapse;font-size:.8rem}
th,td{border:1px solid #ddd;padding:2px 6px;text-align:left}th{background:#f4f4f4}
td{max-width:28rem;overflow-wrap:anywhere}
td.num{text-align:right}td.null{color:#999;font-style:italic}
.table-wrap{max-height:420px;overflow:auto}.pair{display:flex;gap:1rem}.pair>div{flex:1}
"""


def _shell(data: DashboardData, live: bool, refresh_s: float) -> html.Div:
    """The page shell: navigation, filters, stores and the page holder."""
    nav = [dcc.Link(p.title, href=p.path, id=f"nav-{p.path.strip('/') or 'overview'}")
           for p in pages()]
    filters = html.Div([
        html.Div([html.Span("runs ", className="meta"),
                  dcc.Checklist(id="filter-runs", inline=True)]),
        html.Div(dcc.Dropdown(id="filter-engine", placeholder="all engines")),
        html.Div(dcc.Dropdown(id="filter-conversation", placeholder="all conversations")),
        html.Div([html.Span("seconds since each run's start", className="meta"),
                  dcc.RangeSlider(id="filter-time", min=0, max=1, value=[0, 1],
                                  allowCross=False, updatemode="mouseup",
                                  tooltip={"placement": "bottom"})],
                 style={"minWidth": "22rem"}),
    ], className="filters")
    children: list[Any] = [
        dcc.Location(id="url"),
        dcc.Store(id=FILTERS, data=Filters().to_store()),
        dcc.Store(id=VERSION, data=0),
        html.Header([html.Strong(f"{TITLE} · {data.name}"), html.Span(" "), html.Nav(nav),
                     filters, html.Div(id="freshness", className="meta")]),
        html.Main(id="page"),
    ]
    if live:
        children.append(dcc.Interval(id=TICK, interval=int(refresh_s * 1000)))
    return html.Div(children)


def _page_for(path: str | None) -> Page:
    listed = pages()
    return next((p for p in listed if p.path == (path or "/")), listed[0])


def warm(data: DashboardData) -> None:
    """Compute every page's unfiltered results once, so first renders only format them.

    A file's data never changes, so the dashboard pays the heavy analyses (ledger, cost fit,
    what-if sweep, retention) once when it opens instead of on a user's first click. Live
    stores are not warmed: their version changes as spans arrive.
    """
    from kvscope.dashboards.pages import (
        compare,
        missed,
        overview,
        retention,
        task_time,
        whatif,
    )
    from kvscope.progress import steps

    unfiltered = Filters()
    pages = {
        "overview": lambda: overview.content(data, unfiltered),
        "missed": lambda: missed.content(data, unfiltered),
        "retention": lambda: retention.content(data, unfiltered),
        "task time": lambda: task_time.content(data, unfiltered),
        "what-if": lambda: whatif.content(data, unfiltered, None, None),
        "compare": lambda: compare.content(data, unfiltered, None, None),
    }
    with steps("kvscope dashboard: warming pages", len(pages)) as step:
        for name, render in pages.items():
            if data.closing.is_set():  # stopping: DashboardData.close() interrupts queries
                return
            step(name)
            try:
                render()
            except Exception:  # a page that cannot render says so itself when opened
                if not data.closing.is_set():
                    logger.warning("warming a dashboard page failed", exc_info=True)


def create_app(source: Source | StoreWriter | DashboardData, *,
               refresh_s: float = DEFAULT_REFRESH_S) -> Dash:
    """The Dash app over ``source``: a store path (read-only), a live writer, or prepared data.

    Live mode (a :class:`StoreWriter`) adds an interval that re-checks the data version every
    ``refresh_s`` seconds; pages re-render only when rows were written since.
    """
    data = source if isinstance(source, DashboardData) else open_data(source, refresh_s=refresh_s)
    if not data.live:
        threading.Thread(target=warm, args=(data,), name="kvscope-dashboard-warm",
                         daemon=True).start()
    app = Dash(__name__, title=TITLE, serve_locally=True, suppress_callback_exceptions=True,
               update_title="")
    app.index_string = app.index_string.replace("{%css%}", "{%css%}<style>" + _CSS + "</style>")
    app.layout = lambda: _shell(data, data.live, data.refresh_s)
    app.server.config["kvscope_data"] = data

    @app.callback(Output("page", "children"), Input("url", "pathname"), State("url", "search"))
    def _route(path: str | None, search: str | None) -> Any:
        query: Mapping[str, str] = dict(parse_qsl((search or "").lstrip("?")))
        page = _page_for(path)
        try:
            return page.layout(data, query)
        except Exception as exc:  # a broken page says so instead of a blank screen
            logger.warning("page %s failed", page.path, exc_info=True)
            return message(f"{page.title} failed: {type(exc).__name__}: {exc}")

    @app.callback(Output("filter-runs", "options"), Output("filter-runs", "value"),
                  Output("filter-engine", "options"), Output("filter-conversation", "options"),
                  Output("filter-time", "max"), Output("filter-time", "value"),
                  Output("freshness", "children"),
                  Input(VERSION, "data"), State("filter-runs", "value"),
                  State("filter-time", "value"), State("filter-time", "max"))
    def _options(version: int | None, runs: list[str] | None, window: list[float] | None,
                 old_top: float | None) -> tuple[Any, ...]:
        table = data.runs()
        run_options = [{"label": label, "value": run} for run, label in table.rows()]
        ids = [o["value"] for o in run_options]
        kept = [r for r in (runs or []) if r in ids]
        value = kept or ids  # first load, or every ticked run gone: all runs
        conversations = data.conversations(Filters())["conversation_id"].unique().sort()
        span = data.time_span_s()
        # Whole seconds: the slider's ends read "18", not "17.0963488".
        top = float(math.ceil(span)) if span else 1.0
        lo, hi = (window or [0.0, top])[:2]
        # A window reaching the old end keeps reaching the end as a live store grows.
        if window is None or old_top is None or hi >= old_top:
            hi = top
        freshness = (f"data read {data.built_at().isoformat(timespec='seconds')}"
                     + (f"; live, version {version}" if data.live else "; read-only file")
                     + ("" if span is not None else "; no turns stored yet"))
        return (run_options, value, data.engines(),
                conversations.head(2000).to_list(), top,
                [min(lo, top), min(hi, top)], freshness)

    @app.callback(Output(FILTERS, "data"), Input("filter-runs", "value"),
                  Input("filter-engine", "value"), Input("filter-conversation", "value"),
                  Input("filter-time", "value"), State("filter-time", "max"))
    def _filters(runs: list[str] | None, engine: str | None, conversation: str | None,
                 window: list[float] | None, top: float | None) -> dict[str, Any]:
        return selection(data, runs, engine, conversation, window, top).to_store()

    if data.live:
        @app.callback(Output(VERSION, "data"), Input(TICK, "n_intervals"),
                      State(VERSION, "data"))
        def _tick(n: int | None, current: int | None) -> int:
            return data.version()

    for page in pages():
        page.register(app, data)
    return app


def selection(data: DashboardData, runs: list[str] | None, engine: str | None,
              conversation: str | None, window: list[float] | None,
              top: float | None) -> Filters:
    """The filters the shell's controls select (every run ticked means no run filter)."""
    ids = set(data.labels())
    chosen = tuple(sorted(r for r in (runs or []) if r in ids))
    if set(chosen) == ids:
        chosen = ()  # all runs: share the unfiltered context and its cache
    start_s = end_s = None
    if window and len(window) == 2:
        if window[0] > 0:
            start_s = float(window[0])
        if top is not None and window[1] < top:
            end_s = float(window[1])
    return Filters(runs=chosen, engine=engine or None, conversation=conversation or None,
                   start_s=start_s, end_s=end_s)


# --- serving ----------------------------------------------------------------------------------


class DashboardServer:
    """A dashboard on a WSGI server thread (tests, ``serve --dashboard``); ``port=0`` picks one."""

    def __init__(self, app: Dash, host: str | None = None, port: int = 0,
                 sock: socket.socket | None = None) -> None:
        self.app = app
        self.host = settings.resolve("host", host)
        # Every socket read has a timeout and a body must arrive within one (408 otherwise):
        # a client holding a partial request no longer holds a thread for ever.
        wsgi = BodyDeadline(app.server)
        if sock is None:
            self._server: BaseWSGIServer = make_server(
                self.host, port, wsgi, threaded=True, request_handler=DeadlineRequestHandler)
        else:
            # A socket bound earlier (kvscope.serving.bind): the server takes over a copy.
            sock.listen()
            self._server = make_server(self.host, int(sock.getsockname()[1]), wsgi,
                                       threaded=True, fd=sock.fileno(),
                                       request_handler=DeadlineRequestHandler)
            sock.close()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.socket.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> DashboardServer:
        """Serve on a background thread and return self."""
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="kvscope-dashboard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the data side's reader."""
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)
        data = self.app.server.config.get("kvscope_data")
        if isinstance(data, DashboardData):
            data.close()

    def __enter__(self) -> DashboardServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["DEFAULT_PORT", "DashboardServer", "TICK", "TITLE", "create_app", "selection", "warm"]
