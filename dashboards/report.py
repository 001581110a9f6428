"""The single-file HTML report: verdict per run, then the figures, then the tables behind them.

:func:`write_report` opens a store read-only and writes one self-contained HTML file that opens
offline: plotly.js is embedded once, inline, in the head; every figure is a ``div`` plus an
inline script; nothing is fetched from anywhere. The report asks the analysis registry for every
number (nothing here runs SQL): the verdict comes from ``verdict``, each figure from one
analysis through a shared builder in :mod:`kvscope.dashboards.figures`, and the tables from
iterating :func:`registry.iter_analyses`, so a newly registered analysis appears without a
change here. Large results are cut to their first :data:`MAX_TABLE_ROWS` rows, and the figures
read aggregated results only, so the report stays bounded whatever the store holds.

The store holds no prompt or completion text (token counts, hashes and ids only), so neither
does the report. Every value is HTML-escaped; a null reads "not measured".
"""

from __future__ import annotations

import html
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import polars as pl
from plotly.offline import get_plotlyjs

from kvscope.analysis import registry
from kvscope.analysis import verdict as verdict_module
from kvscope.analysis.registry import AnalysisContext
from kvscope.analysis.runs import open_context, run_table
from kvscope.dashboards import figures
from kvscope.errors import KvscopeError
from kvscope.store.source import Source
from kvscope.tables import NOT_MEASURED, round_float

logger = logging.getLogger(__name__)

MAX_TABLE_ROWS = 200
TITLE = "kvscope report"
VERDICT = "verdict"


@dataclass(frozen=True)
class FigureSpec:
    """One figure of the report: which analysis feeds which shared builder."""

    id: str
    analysis: str
    build: figures.Builder
    params: Mapping[str, Any] = field(default_factory=dict)
    # Shown instead when ``analysis`` cannot run here (an A/B pair's figure on one run).
    fallback: str | None = None
    # Drawn instead, by ``sweep_build``, when this analysis has rows (a store holding the
    # published sweep: simulated beside published).
    sweep: str | None = None
    sweep_build: figures.Builder | None = None


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("ttft-vs-prompt", "compare_by_prompt", figures.ttft_vs_prompt,
               fallback="by_prompt", sweep="published_sweep",
               sweep_build=figures.sweep_ttft_vs_prompt),
    FigureSpec("prefill-split", "compare_by_prompt", figures.prefill_split,
               fallback="by_prompt", sweep="published_sweep",
               sweep_build=figures.sweep_prefill_split),
    FigureSpec("reuse-by-turn", "reuse_rate", figures.reuse_by_turn, {"by": "turn_index"}),
    FigureSpec("miss-causes", "miss_causes", figures.miss_causes),
    FigureSpec("retained-memory", "retained_memory", figures.retained_memory),
    FigureSpec("task-time", "task_time", figures.task_time),
    FigureSpec("whatif", "whatif", figures.whatif_curves),
    FigureSpec("ladder", "ladder", figures.reuse_ladder),
)

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;
max-width:1200px;padding:0 1rem;color:#222}
h1{margin-bottom:.2rem}.meta{color:#666;font-size:.9rem}
table{border-collapse:collapse;font-size:.8rem;margin:.5rem 0 1rem}
th,td{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}
td{max-width:28rem;overflow-wrap:anywhere}
th{background:#f4f4f4;position:sticky;top:0}td.num{text-align:right}
td.null{color:#999;font-style:italic}.verdict{border-left:4px solid #1f77b4;padding:.2rem 1rem;
margin:1rem 0;background:#f8fbff}.verdict li{margin:.2rem 0}.figure{margin:1rem 0 2rem}
.error{color:#a33}.table-wrap{max-height:480px;overflow:auto}
details summary{cursor:pointer}code{background:#f4f4f4;padding:0 3px}
"""


# --- cells and tables -------------------------------------------------------------------------


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _bytes(value: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:,.0f} B"


def _unit_of(column: str) -> str | None:
    """How a column's numbers read, from its name (units are part of names: STYLE §3)."""
    if column == "share" or column.endswith(("_share", "_rate")):
        return "%"
    if column.endswith("_ms"):
        return "ms"
    if column.endswith("_bytes"):
        return "bytes"
    if column.endswith("_s") and not column.startswith("gib_s"):
        return "s"
    return None


def format_cell(value: Any, column: str = "") -> tuple[str, str]:
    """(text, css class) for one table cell; null reads "not measured"; a number reads in the
    unit its column's name gives (shares as %, ``_ms`` as ms, ``_bytes`` in GiB/MiB, ``_s`` as
    s), rounded."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return NOT_MEASURED, "null"
    if isinstance(value, bool):
        return str(value).lower(), ""
    unit = _unit_of(column) if isinstance(value, int | float) else None
    if unit == "%":
        return f"{100 * value:.1f} %", "num"
    if unit == "ms":
        return f"{value:,.0f} ms" if abs(value) >= 100 else f"{value:.3g} ms", "num"
    if unit == "bytes":
        return _bytes(float(value)), "num"
    if unit == "s":
        return f"{value:,.0f} s" if abs(value) >= 100 else f"{value:.3g} s", "num"
    if isinstance(value, float):
        return round_float(value), "num"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value), "num"
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="milliseconds"), ""
    if isinstance(value, list | dict):
        return json.dumps(value, default=str), ""
    return str(value), ""


def as_shown(frame: pl.DataFrame) -> pl.DataFrame:
    """A frame as a table shows it: runs by label (the ``label`` column, as ``run``; a pair's
    ``label_a``/``label_b``), not by their hex id, where the frame has both."""
    if "label" in frame.columns and "run_id" in frame.columns and "run" not in frame.columns:
        frame = frame.drop("run_id").rename({"label": "run"})
        frame = frame.select("run", *[c for c in frame.columns if c != "run"])
    # A pair (compare): run_a / run_b beside label_a / label_b.
    for side in ("a", "b"):
        if {f"run_{side}", f"label_{side}"} <= set(frame.columns):
            frame = frame.drop(f"run_{side}")
    return frame


def table_html(frame: pl.DataFrame, max_rows: int = MAX_TABLE_ROWS,
               height: int | None = None) -> str:
    """An escaped HTML table of the first ``max_rows`` rows, saying when rows were left out
    (``height``: the whole result's rows, when ``frame`` is its head)."""
    frame = as_shown(frame)
    total = frame.height if height is None else height
    head = "".join(f"<th>{_e(c)}</th>" for c in frame.columns)
    body = []
    for row in frame.head(max_rows).iter_rows():
        cells = []
        for column, value in zip(frame.columns, row, strict=True):
            text, css = format_cell(value, column)
            cells.append(f'<td class="{css}">{_e(text)}</td>' if css else f"<td>{_e(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    shown = min(frame.height, max_rows)
    caption = (f"first {shown:,} of {total:,} rows" if total > shown
               else f"{total:,} row{'s' if total != 1 else ''}")
    return (f'<p class="meta">{_e(caption)}</p><div class="table-wrap"><table><thead><tr>'
            f"{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>")


# --- sections ---------------------------------------------------------------------------------


def _with_labels(frame: pl.DataFrame, labels: Mapping[str, str]) -> pl.DataFrame:
    """Add the runs' labels to a result keyed by run_id (figures name runs by label)."""
    if "run_id" not in frame.columns or "label" in frame.columns:
        return frame
    return frame.with_columns(
        pl.col("run_id").replace_strict(labels, default=pl.col("run_id"), return_dtype=pl.String)
        .alias("label"))


def _result(ctx: AnalysisContext, name: str, params: Mapping[str, Any] | None = None,
            ) -> tuple[pl.DataFrame | None, str | None]:
    """(frame, None), or (None, why not) when the analysis is absent or cannot run here."""
    if name not in registry.analyses():
        return None, f"the {name} analysis is not available in this kvscope"
    try:
        return registry.run(ctx, name, params), None
    except KvscopeError as exc:
        return None, str(exc)
    except Exception as exc:  # one broken analysis must not cost the rest of the report
        logger.warning("analysis %s failed", name, exc_info=True)
        return None, f"failed: {type(exc).__name__}: {exc}"


def _head(ctx: AnalysisContext, name: str) -> tuple[pl.DataFrame | None, int, str | None]:
    """As :func:`_result`, but only the first :data:`MAX_TABLE_ROWS` rows and the height (the
    ledger listing's whole result is every column of every turn)."""
    try:
        frame, height = registry.head(ctx, name, MAX_TABLE_ROWS)
        return frame, height, None
    except KvscopeError as exc:
        return None, 0, str(exc)
    except Exception as exc:  # one broken analysis must not cost the rest of the report
        logger.warning("analysis %s failed", name, exc_info=True)
        return None, 0, f"failed: {type(exc).__name__}: {exc}"


def _setting_text(value: Any) -> str:
    return json.dumps(value, default=str) if isinstance(value, dict | list) else str(value)


def _settings_html(raw: str | None) -> str:
    try:
        settings = json.loads(raw) if raw else {}
    except ValueError:
        return f"<code>{_e(raw)}</code>"
    if not isinstance(settings, dict) or not settings:
        return f'<span class="meta">{NOT_MEASURED}</span>'
    items = ", ".join(
        f"<code>{_e(k)}</code>={_e(_setting_text(v))}" for k, v in sorted(settings.items())
    )
    return f"<details><summary>{len(settings)} settings</summary>{items}</details>"


def _runs_html(runs: pl.DataFrame) -> str:
    rows = []
    for run in runs.iter_rows(named=True):
        started, _ = format_cell(run["started_at"])
        ended, _ = format_cell(run["ended_at"])
        rows.append(f"<tr><td>{_e(run['run_id'])}</td><td>{_e(run['label'] or '')}</td>"
                    f"<td>{_e(started)}</td><td>{_e(ended)}</td>"
                    f"<td>{_settings_html(run['settings'])}</td></tr>")
    return ("<table><thead><tr><th>run id</th><th>label</th><th>started</th><th>ended</th>"
            f"<th>settings</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _verdict_html(ctx: AnalysisContext) -> str:
    table, why = _result(ctx, VERDICT)
    if table is None:
        return f'<p class="error">verdict not available: {_e(why)}</p>'
    if table.is_empty():
        return '<p class="meta">The store holds no runs.</p>'
    parts = []
    for row in table.iter_rows(named=True):
        sentences = "".join(f"<li>{_e(s)}</li>" for s in verdict_module.verdict_sentences(row))
        name = row["label"] or row["run_id"]
        parts.append(f'<div class="verdict" id="verdict-{_e(row["run_id"])}">'
                     f"<h3>{_e(name)}</h3><ul>{sentences}</ul></div>")
    return "".join(parts)


def figure_html(fig: go.Figure, div_id: str) -> str:
    """One figure as a div and an inline script (plotly.js itself is in the page head)."""
    return str(fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                           config={"displaylogo": False, "responsive": True}))


def _figures_html(ctx: AnalysisContext, labels: Mapping[str, str]) -> str:
    parts = []
    for spec in FIGURES:
        if spec.sweep is not None and spec.sweep_build is not None:
            sweep, _ = _result(ctx, spec.sweep)
            if sweep is not None and not sweep.is_empty():
                fig = spec.sweep_build(sweep)
                parts.append(f'<div class="figure">{figure_html(fig, f"fig-{spec.id}")}</div>')
                continue
        frame, why = _result(ctx, spec.analysis, spec.params)
        if frame is None and spec.fallback is not None:
            # No A/B pair (one run, the common production store): the runs themselves.
            frame, why = _result(ctx, spec.fallback, {})
        if frame is None:
            fig = figures.missing(spec.id.replace("-", " "), f"not measured: {why}")
        else:
            fig = spec.build(_with_labels(frame, labels))
        parts.append(f'<div class="figure">{figure_html(fig, f"fig-{spec.id}")}</div>')
    return "".join(parts)


def _tables_html(ctx: AnalysisContext) -> str:
    parts = []
    for analysis in registry.iter_analyses():
        frame, height, why = _head(ctx, analysis.name)
        defaults = ", ".join(f"{p.name}={p.default}" for p in analysis.params)
        head = (f'<h3 id="table-{_e(analysis.name)}">{_e(analysis.title)}</h3>'
                f'<p class="meta"><code>{_e(analysis.name)}</code>'
                + (f" ({_e(defaults)})" if defaults else "") + "</p>")
        body = (table_html(frame, height=height) if frame is not None
                else f'<p class="error">{_e(why)}</p>')
        parts.append(head + body)
    return "".join(parts)


# The steps render() reports: ledger and verdict (the first to read the ledger builds it),
# figures, tables.
REPORT_STEPS = 3


def render(ctx: AnalysisContext, source: str,
           progress: Callable[[str], None] | None = None) -> str:
    """The whole report as one HTML string (``progress(step)`` hears each step begin)."""
    step = progress or (lambda name: None)
    runs = run_table(ctx)
    labels = {r: lbl or r for r, lbl in runs.select("run_id", "label").rows()}
    generated = datetime.now(UTC).isoformat(timespec="seconds")
    step("ledger and verdict")
    verdict = _verdict_html(ctx)
    step("figures")
    figures = _figures_html(ctx, labels)
    step("tables")
    tables = _tables_html(ctx)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{_e(TITLE)}: {_e(source)}</title><style>{_CSS}</style>"
        f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head><body>"
        f"<h1>{_e(TITLE)}</h1><p class=\"meta\">store {_e(source)}, generated {_e(generated)}"
        f", {runs.height} run{'s' if runs.height != 1 else ''}</p>"
        f"<h2>Runs</h2>{_runs_html(runs)}"
        f"<h2>Verdict</h2>{verdict}"
        f"<h2>Figures</h2>{figures}"
        f"<h2>Tables</h2>{tables}"
        "</body></html>\n"
    )


def write_report(db_path: Source, out_path: str | Path,
                 runs: Sequence[str] | None = None,
                 progress: Callable[[str], None] | None = None) -> Path:
    """Write the HTML report of the store ``db_path`` (optionally only ``runs``) to ``out_path``."""
    out = Path(out_path)
    with open_context(db_path, runs) as ctx:
        page = render(ctx, Path(db_path).name if isinstance(db_path, str | Path) else str(db_path),
                      progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)  # never leave a half-written report behind
    return out


__all__ = ["FIGURES", "FigureSpec", "MAX_TABLE_ROWS", "REPORT_STEPS", "TITLE", "VERDICT",
    "as_shown", "figure_html", "format_cell", "render", "table_html", "write_report"]
