"""Shared figure builders: one analysis frame in, one plotly figure out (no SQL, no loading).

The HTML report and the Dash pages draw with these, so both show the same picture (STYLE §8).
Every builder takes the frame its analysis returns (column names in its docstring) and never
raises on an empty or partial frame: it returns a figure whose annotation says what is missing
(for example "no engine hooks: transfer times not measured"). Nulls stay gaps, never zeros.

Runs are named by a ``label`` column when the frame has one, else by ``run_id``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import plotly.graph_objects as go
import polars as pl

from kvscope.reuse import outcomes

GIB = float(1 << 30)
# A figure builder: an analysis frame (None when not computed) in, a figure out.
Builder = Callable[[pl.DataFrame | None], go.Figure]
_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf",
            "#7f7f7f")
# One colour per outcome, on every page and in the report, in the order of the outcome table
# (kvscope.reuse.outcomes.OUTCOMES): reuses green, the correctness alarm red, the first turn
# grey, each miss cause its own hue; an outcome the table gains later gets a colour in turn.
_OUTCOME_FIXED = {outcomes.FIRST_TURN: "#9e9e9e", outcomes.REUSED_REMOTE: "#2ca02c",
                  outcomes.REUSED_LOCAL: "#98df8a", outcomes.PARTIAL: "#bcbd22",
                  outcomes.REUSED_INVALID: "#d62728", outcomes.UNKNOWN: "#7f7f7f"}
_MISS_PALETTE = ("#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#aec7e8",
                 "#ffbb78", "#c5b0d5", "#c49c94", "#f7b6d2", "#9edae5", "#393b79", "#637939",
                 "#8c6d31", "#843c39", "#7b4173", "#3182bd")
OUTCOME_COLORS: dict[str, str] = {
    **{o: _MISS_PALETTE[i % len(_MISS_PALETTE)]
       for i, o in enumerate(o for o in outcomes.OUTCOMES if o not in _OUTCOME_FIXED)},
    **_OUTCOME_FIXED,
}


def outcome_color(outcome: object) -> str:
    """The colour of ``outcome`` wherever it is drawn (grey for a label not in the table)."""
    return OUTCOME_COLORS.get(str(outcome), "#c7c7c7")


_LAYOUT = {"template": "plotly_white", "height": 420, "margin": {"t": 60, "l": 60, "r": 20},
           "showlegend": True}


# --- helpers ----------------------------------------------------------------------------------


def missing(title: str, message: str) -> go.Figure:
    """A figure with no data and one annotation saying what is missing."""
    fig = go.Figure()
    fig.update_layout(title=title, **_LAYOUT)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.add_annotation(text=message, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font={"size": 14})
    return fig


def note(fig: go.Figure, message: str) -> go.Figure:
    """Add a note under the plot saying what part of the picture was not measured."""
    count = len(fig.layout.annotations or ())
    fig.add_annotation(text=message, showarrow=False, xref="paper", yref="paper", x=0,
                       xanchor="left", y=0, yanchor="top", yshift=-52 - 18 * count,
                       font={"size": 12, "color": "#a33"})
    fig.update_layout(margin={"b": 90 + 18 * count}, height=440 + 18 * count)
    return fig


def _lacks(frame: pl.DataFrame | None, columns: Iterable[str]) -> list[str]:
    if frame is None:
        return list(columns)
    return [c for c in columns if c not in frame.columns]


def _unusable(title: str, frame: pl.DataFrame | None, columns: Sequence[str],
              what: str) -> go.Figure | None:
    """The 'missing' figure when ``frame`` is absent, empty or lacks ``columns``; else None."""
    lacking = _lacks(frame, columns)
    if frame is None or lacking and len(lacking) == len(columns):
        return missing(title, f"no data: {what} not measured")
    if lacking:
        return missing(title, f"input lacks column(s) {', '.join(lacking)}: {what} not shown")
    if frame.is_empty():
        return missing(title, f"no data: {what} not measured")
    return None


def _draws(title: str, columns: Sequence[str], what: str
           ) -> Callable[[Callable[[pl.DataFrame, str], go.Figure]], Builder]:
    """Decorator: the builder of ``title``, drawn by the function from a frame that holds
    ``columns``; an absent, empty or partial frame gets the figure saying what is missing."""

    def decorate(draw: Callable[[pl.DataFrame, str], go.Figure]) -> Builder:
        @functools.wraps(draw)
        def build(frame: pl.DataFrame | None) -> go.Figure:
            bad = _unusable(title, frame, columns, what)
            if bad is not None or frame is None:
                return bad or missing(title, "no data")
            return draw(frame, title)

        return build

    return decorate


def _run_names(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with a ``_name`` column: its label where present, else its run id."""
    if "label" in frame.columns:
        name = pl.coalesce(pl.col("label"), pl.col("run_id").cast(pl.String))
    elif "run_id" in frame.columns:
        name = pl.col("run_id").cast(pl.String)
    else:
        name = pl.lit("all runs")
    return frame.with_columns(name.fill_null("unnamed run").alias("_name"))


def _groups(frame: pl.DataFrame, key: str = "_name") -> list[tuple[str, pl.DataFrame]]:
    """Rows per value of ``key``, values in sorted order (so a run keeps its colour everywhere)."""
    names = sorted(frame[key].unique().to_list(), key=lambda v: (v is None, str(v)))
    return [(str(n), frame.filter(pl.col(key) == n)) for n in names]


def _color(i: int) -> str:
    return _PALETTE[i % len(_PALETTE)]


def _all_null(frame: pl.DataFrame, column: str) -> bool:
    return column not in frame.columns or frame[column].null_count() == frame.height


# --- A/B: TTFT and prefill by prompt length ---------------------------------------------------


def _bin_labels(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.with_columns(
        pl.format("{}–{}", pl.col("bin_lo_tokens"), pl.col("bin_hi_tokens")).alias("_bin"),
        ((pl.col("bin_lo_tokens") + pl.col("bin_hi_tokens")) / 2).alias("_mid"),
    )


@_draws("TTFT vs prompt length", ("bin_lo_tokens", "bin_hi_tokens", "ttft_p50_ms"),
        "TTFT by prompt length")
def ttft_vs_prompt(frame: pl.DataFrame, title: str) -> go.Figure:
    """TTFT p50 (solid) and p90 (dashed) against prompt length, one pair of lines per run.

    Input: ``compare_by_prompt`` (run_id, label, bin_lo_tokens, bin_hi_tokens, ttft_p50_ms,
    ttft_p90_ms).
    """
    data = _bin_labels(_run_names(frame)).sort("_mid")
    if _all_null(data, "ttft_p50_ms"):
        return missing(title, "no first-token times: TTFT not measured")
    fig = go.Figure()
    for i, (name, rows) in enumerate(_groups(data)):
        custom = rows.select("_bin", "turns").rows() if "turns" in rows.columns else None
        hover = "%{customdata[0]} tokens (%{customdata[1]} turns)<br>%{y:.1f} ms" if custom \
            else "%{x:.0f} tokens<br>%{y:.1f} ms"
        fig.add_trace(go.Scatter(
            x=rows["_mid"].to_list(), y=rows["ttft_p50_ms"].to_list(), name=f"{name} p50",
            mode="lines+markers", line={"color": _color(i)}, customdata=custom,
            hovertemplate=hover, legendgroup=name))
        if "ttft_p90_ms" in rows.columns:
            fig.add_trace(go.Scatter(
                x=rows["_mid"].to_list(), y=rows["ttft_p90_ms"].to_list(), name=f"{name} p90",
                mode="lines+markers", line={"color": _color(i), "dash": "dash"},
                customdata=custom, hovertemplate=hover, legendgroup=name))
    fig.update_layout(title=title, xaxis_title="prompt tokens (bin midpoint)",
                      yaxis_title="TTFT (ms)", **_LAYOUT)
    return fig


@_draws("Prefill: compute vs D→P transfer, by prompt length",
        ("bin_lo_tokens", "bin_hi_tokens", "prefill_ms_mean"),
        "prefill time by prompt length")
def prefill_split(frame: pl.DataFrame, title: str) -> go.Figure:
    """Prefill leg per prompt bin: paired bars per run, each split into compute and transfer.

    Input: ``compare_by_prompt`` (run_id, label, bin_lo_tokens, bin_hi_tokens,
    prefill_ms_mean, prefill_compute_ms_mean, transfer_ms_mean). A run without engine hooks has
    no split: its bar is the whole prefill leg, and a note says transfer was not measured.
    """
    data = _bin_labels(_run_names(frame)).sort(["bin_lo_tokens", "_name"])
    if _all_null(data, "prefill_ms_mean"):
        return missing(title, "no prefill legs: prefill time not measured")
    fig = go.Figure()
    unsplit = []
    for i, (name, rows) in enumerate(_groups(data)):
        bins = rows["_bin"].to_list()
        if _all_null(rows, "prefill_compute_ms_mean") or _all_null(rows, "transfer_ms_mean"):
            unsplit.append(name)
            fig.add_trace(go.Bar(x=bins, y=rows["prefill_ms_mean"].to_list(),
                                 name=f"{name} prefill (split not measured)", offsetgroup=name,
                                 marker={"color": _color(i), "opacity": 0.5}))
            continue
        compute = rows["prefill_compute_ms_mean"].to_list()
        fig.add_trace(go.Bar(x=bins, y=compute, name=f"{name} compute", offsetgroup=name,
                             marker={"color": _color(i)}))
        fig.add_trace(go.Bar(x=bins, y=rows["transfer_ms_mean"].to_list(), base=compute,
                             name=f"{name} transfer", offsetgroup=name,
                             marker={"color": _color(i), "pattern": {"shape": "/"},
                                     "opacity": 0.6}))
    fig.update_layout(title=title, barmode="group", xaxis_title="prompt tokens",
                      yaxis_title="mean prefill leg (ms)", **_LAYOUT)
    _bins_in_order(fig, data)
    if unsplit:
        note(fig, f"no engine hooks: transfer times not measured for {', '.join(unsplit)}")
    return fig


def _bins_in_order(fig: go.Figure, data: pl.DataFrame) -> None:
    """Prompt-length bins along x by their lower bound (as numbers, not as text, and whichever
    run has a bin first)."""
    order = data.unique("bin_lo_tokens").sort("bin_lo_tokens")["_bin"].to_list()
    fig.update_xaxes(categoryorder="array", categoryarray=order)


# --- the published sweep: simulated vs published -----------------------------------------------


def _sweep_groups(frame: pl.DataFrame) -> list[tuple[str, pl.DataFrame]]:
    """Rows per (model, feature), ON before OFF, each sorted by prompt length."""
    data = frame.with_columns(
        pl.format("{} {}", pl.col("model").fill_null(pl.col("profile")),
                  pl.col("feature").str.to_uppercase()).alias("_series"))
    return [(name, rows.sort("prompt_tokens")) for name, rows in _groups(data, "_series")]


@_draws("TTFT vs prompt length", ("model", "feature", "prompt_tokens", "ttft_ms"),
        "the published sweep")
def sweep_ttft_vs_prompt(frame: pl.DataFrame, title: str) -> go.Figure:
    """TTFT against the swept prompt length: simulated (solid) and published (dashed).

    Input: ``published_sweep`` (model, profile, feature, prompt_tokens, ttft_ms,
    ttft_published_ms). Published points exist at the two ends of each sweep only.
    """
    fig = go.Figure()
    for i, (name, rows) in enumerate(_sweep_groups(frame)):
        fig.add_trace(go.Scatter(
            x=rows["prompt_tokens"].to_list(), y=rows["ttft_ms"].to_list(),
            name=f"{name} simulated", mode="lines+markers", line={"color": _color(i)},
            legendgroup=name, hovertemplate="%{x:,} tokens<br>%{y:.0f} ms (simulated)"))
        pub = rows.filter(pl.col("ttft_published_ms").is_not_null())
        if not pub.is_empty():
            fig.add_trace(go.Scatter(
                x=pub["prompt_tokens"].to_list(), y=pub["ttft_published_ms"].to_list(),
                name=f"{name} published", mode="lines+markers",
                line={"color": _color(i), "dash": "dash"}, marker={"symbol": "diamond"},
                legendgroup=name, hovertemplate="%{x:,} tokens<br>%{y:.0f} ms (published)"))
    fig.update_layout(title=title, xaxis_title="shared prefix (tokens)",
                      yaxis_title="mean TTFT (ms)", **_LAYOUT)
    return fig


@_draws("Prefill: compute vs D→P transfer, by prompt length",
        ("model", "feature", "prompt_tokens", "prefill_ms"),
        "the published sweep")
def sweep_prefill_split(frame: pl.DataFrame, title: str) -> go.Figure:
    """Prefill per swept prompt length: paired ON/OFF bars, ON split into compute and transfer;
    the published prefill as dashed lines over them.

    Input: ``published_sweep`` (model, profile, feature, prompt_tokens, prefill_ms, compute_ms,
    transfer_ms, prefill_published_ms).
    """
    fig = go.Figure()
    for i, (name, rows) in enumerate(_sweep_groups(frame)):
        x = [f"{t / 1000:g}k" for t in rows["prompt_tokens"].to_list()]
        if _all_null(rows, "transfer_ms"):  # OFF: nothing pulled, the leg is all compute
            fig.add_trace(go.Bar(x=x, y=rows["prefill_ms"].to_list(), name=f"{name} compute",
                                 offsetgroup=name, marker={"color": _color(i)}))
        else:
            compute = rows["compute_ms"].to_list()
            fig.add_trace(go.Bar(x=x, y=compute, name=f"{name} compute", offsetgroup=name,
                                 marker={"color": _color(i)}))
            fig.add_trace(go.Bar(x=x, y=(rows["prefill_ms"] - rows["compute_ms"]).to_list(),
                                 base=compute, name=f"{name} transfer", offsetgroup=name,
                                 marker={"color": _color(i), "pattern": {"shape": "/"},
                                         "opacity": 0.6}))
        pub = rows.filter(pl.col("prefill_published_ms").is_not_null())
        if not pub.is_empty():
            fig.add_trace(go.Scatter(
                x=[f"{t / 1000:g}k" for t in pub["prompt_tokens"].to_list()],
                y=pub["prefill_published_ms"].to_list(), name=f"{name} published",
                mode="lines+markers", line={"color": _color(i), "dash": "dash"},
                marker={"symbol": "diamond", "size": 10}))
    fig.update_layout(title=title, barmode="group", xaxis_title="shared prefix (tokens)",
                      yaxis_title="mean prefill leg (ms)", **_LAYOUT)
    return fig


# --- reuse ------------------------------------------------------------------------------------


@_draws("Reuse by turn index (share of reusable tokens)",
        ("turn_index", "local_share", "remote_share"),
        "reuse by turn")
def reuse_by_turn(frame: pl.DataFrame, title: str) -> go.Figure:
    """Share of reusable tokens reused, by turn index: remote (solid) and local (dotted) per run.

    Input: ``reuse_rate`` with by=turn_index (run_id, turn_index, local_share, remote_share).
    """
    return _reuse_shares(title, _run_names(frame).sort("turn_index"), "turn_index",
                         "turn index")


def _reuse_shares(title: str, data: pl.DataFrame, x: str, x_title: str) -> go.Figure:
    """Remote (solid) and local (dotted) share of reusable tokens against ``x``, per run."""
    if _all_null(data, "local_share") and _all_null(data, "remote_share"):
        return missing(title, "reusable tokens not measured (no boundary hashes, no offers)")
    fig = go.Figure()
    for i, (name, rows) in enumerate(_groups(data)):
        xs = rows[x].to_list()
        fig.add_trace(go.Scatter(x=xs, y=rows["remote_share"].to_list(), name=f"{name} remote",
                                 mode="lines+markers", line={"color": _color(i)},
                                 legendgroup=name))
        fig.add_trace(go.Scatter(x=xs, y=rows["local_share"].to_list(), name=f"{name} local",
                                 mode="lines+markers", line={"color": _color(i), "dash": "dot"},
                                 legendgroup=name))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title="share of reusable",
                      yaxis_tickformat=".0%", yaxis_range=[0, 1.05], **_LAYOUT)
    return fig


# Outcomes that are not misses, and the correctness alarm.
NOT_MISSES = (outcomes.FIRST_TURN, outcomes.REUSED_REMOTE, outcomes.REUSED_LOCAL)
INVALID = outcomes.REUSED_INVALID


@_draws("Why reuse did not happen (share of turns k ≥ 2)", ("outcome", "share"), "miss causes")
def miss_causes(frame: pl.DataFrame, title: str) -> go.Figure:
    """Missed-reuse causes: share of later turns per cause, one bar series per run.

    Input: ``miss_causes`` (run_id, outcome, turns, share); full-reuse outcomes are left out.
    """
    data = _run_names(frame).filter(~pl.col("outcome").is_in(NOT_MISSES))
    if data.is_empty():
        return missing(title, "no missed reuse: every later turn reused its earlier KV")
    order = (data.group_by("outcome").agg(pl.col("share").sum()).sort("share")["outcome"]
             .to_list())
    if INVALID in order:
        # A correctness alarm, not a miss: on top, and named in the title.
        order = [o for o in order if o != INVALID] + [INVALID]
        title += f" — ALARM: {INVALID} (KV loaded that does not match the prompt)"
    fig = go.Figure()
    for i, (name, rows) in enumerate(_groups(data)):
        custom = rows["turns"].to_list() if "turns" in rows.columns else None
        fig.add_trace(go.Bar(
            y=rows["outcome"].to_list(), x=rows["share"].to_list(), orientation="h", name=name,
            marker={"color": _color(i)}, customdata=custom,
            hovertemplate="%{y}: %{x:.1%}" + (" (%{customdata} turns)" if custom else "")))
    fig.update_layout(title=title, barmode="group", xaxis_tickformat=".0%",
                      xaxis_title="share of later turns", **_LAYOUT)
    fig.update_yaxes(categoryorder="array", categoryarray=order)
    return fig


# --- memory -----------------------------------------------------------------------------------

_GPU_SOURCES = ("gpu_memory_used", "gpu_memory_total")
# Legend names of the retained-memory sources (analysis.retention.SOURCE_*).
MEMORY_SOURCES = {"retention_spans": "retained KV (from spans)",
                  "retained_bytes_gauge": "retained KV (engine gauge)",
                  "gpu_memory_used": "GPU memory used", "gpu_memory_total": "GPU memory total"}


@_draws("Retained KV and GPU memory", ("run_id", "source", "time", "mean_bytes"),
        "retained memory (no retention spans or gauges)")
def retained_memory(frame: pl.DataFrame, title: str) -> go.Figure:
    """Retained KV bytes over time (per decode engine) beside GPU memory, in GiB.

    Input: ``retained_memory`` (run_id, source, engine_id, gpu_host, gpu_index, time,
    mean_bytes, max_bytes). Time is seconds since each run's first point, so runs recorded at
    different times line up. GPU series are dashed; without them a note says so.
    """
    data = _run_names(frame).with_columns(
        ((pl.col("time") - pl.col("time").min().over("run_id")).dt.total_milliseconds() / 1e3)
        .alias("_t"),
        (pl.col("mean_bytes") / GIB).alias("_gib"),
    )
    where = pl.coalesce(
        [pl.col(c).cast(pl.String) for c in ("engine_id", "gpu_host") if c in data.columns]
        + [pl.lit("")]
    )
    gpu_index = pl.col("gpu_index").cast(pl.String) if "gpu_index" in data.columns else pl.lit(None)
    data = data.with_columns(
        pl.concat_str([pl.col("_name"), pl.lit(" "),
                       pl.col("source").replace_strict(MEMORY_SOURCES, default=pl.col("source"),
                                                       return_dtype=pl.String),
                       pl.lit(" "), where,
                       pl.when(gpu_index.is_not_null()).then(pl.lit(":") + gpu_index)
                       .otherwise(pl.lit(""))]).str.strip_chars().alias("_series")
    ).sort(["_series", "_t"])
    fig = go.Figure()
    runs = sorted(data["_name"].unique().to_list())
    for series, rows in _groups(data, "_series"):
        gpu = rows["source"][0] in _GPU_SOURCES
        color = _color(runs.index(rows["_name"][0]))
        fig.add_trace(go.Scatter(
            x=rows["_t"].to_list(), y=rows["_gib"].to_list(), name=series, mode="lines",
            line={"color": color, "dash": "dash" if gpu else "solid", "shape": "hv"}))
    fig.update_layout(title=title, xaxis_title="seconds since the run's first sample",
                      yaxis_title="GiB", **_LAYOUT)
    if not data["source"].is_in(_GPU_SOURCES).any():
        note(fig, "no GPU memory samples: GPU memory not measured")
    if data["source"].is_in(_GPU_SOURCES).all():
        note(fig, "no retention spans or retained-bytes gauge: retained KV not measured")
    return fig


# --- task time --------------------------------------------------------------------------------

# Components of task time (DESIGN §5), in stacking order: label → accepted column names.
TASK_COMPONENTS: dict[str, tuple[str, ...]] = {
    "input processing": ("input_processing_s",),
    "transfer": ("transfer_s",),
    "generation": ("generation_s",),
    "tool wait": ("tool_wait_s",),
    "proxy overhead": ("proxy_overhead_s",),
}


def task_time(frame: pl.DataFrame | None, group: str | None = None) -> go.Figure:
    """Task time decomposed into stacked components, one bar per run (or per ``group`` value).

    Input: a task-time frame with run_id (or ``group``) and component columns in seconds
    (input_processing_s, transfer_s, generation_s, tool_wait_s, proxy_overhead_s); bars stack
    the components' sums per group. Components absent or all-null are named in a note.
    """
    title = "Task time decomposition"
    if frame is None or frame.is_empty():
        return missing(title, "no data: task time not measured")
    found = {label: next((c for c in names if c in frame.columns), None)
             for label, names in TASK_COMPONENTS.items()}
    present = {label: col for label, col in found.items()
               if col is not None and not _all_null(frame, col)}
    if not present:
        return missing(title, "input has no task-time components: task time not measured")
    data = _run_names(frame)
    key = group if group and group in data.columns else "_name"
    sums = data.group_by(key, maintain_order=True).agg(
        [pl.when(pl.col(col).is_not_null().any()).then(pl.col(col).sum()).alias(label)
         for label, col in present.items()]
    )
    x = sums[key].cast(pl.String).to_list()
    fig = go.Figure()
    for i, label in enumerate(present):
        fig.add_trace(go.Bar(x=x, y=sums[label].to_list(), name=label,
                             marker={"color": _color(i)}))
    fig.update_layout(title=title, barmode="stack", yaxis_title="seconds (sum over "
                      "conversations)", **_LAYOUT)
    absent = [label for label in TASK_COMPONENTS if label not in present]
    if absent:
        note(fig, f"not measured: {', '.join(absent)}")
    return fig


# --- what-if and ladder -----------------------------------------------------------------------


_OBSERVED = "observed"


@_draws("What-if: reuse and retention cost vs decoder_kv_blocks_ttl",
        ("decoder_kv_blocks_ttl", "kv_recompute_threshold", "token_reuse_rate", "retained_gib_s"),
        "what-if results")
def whatif_curves(frame: pl.DataFrame, title: str) -> go.Figure:
    """Reuse rate (left) and retained GiB·s (right) against the decode TTL, one line per threshold.

    Input: ``whatif`` (run_id, source, decoder_kv_blocks_ttl, kv_recompute_threshold,
    router_ttl, is_observed_setting, token_reuse_rate, retained_gib_s). Replayed settings are
    lines; the observed run is a star (rows with source ``observed``), so the replay can be
    checked against it. Router TTLs and runs that vary get lines of their own.
    """
    from plotly.subplots import make_subplots

    data = frame.with_columns(
        pl.format("threshold {}", pl.col("kv_recompute_threshold")).alias("_line"))
    data = _run_names(data)
    for column, text in (("router_ttl", "router TTL {}"), ("_name", "{}")):
        if column in data.columns and data[column].n_unique() > 1:
            data = data.with_columns(
                pl.format("{}, " + text, pl.col("_line"), pl.col(column)).alias("_line"))
    observed = (data.filter(pl.col("source") == _OBSERVED) if "source" in data.columns
                else data.head(0))
    replay = data.filter(pl.col("source") != _OBSERVED) if "source" in data.columns else data
    replay = replay.sort(["_line", "decoder_kv_blocks_ttl"])
    if replay.is_empty():
        return missing(title, "no replayed settings: what-if not measured")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("token reuse rate", "retained GiB·s"))
    for i, (line, rows) in enumerate(_groups(replay, "_line")):
        x = rows["decoder_kv_blocks_ttl"].to_list()
        for col, (metric, legend) in enumerate((("token_reuse_rate", True),
                                                ("retained_gib_s", False)), start=1):
            fig.add_trace(go.Scatter(x=x, y=rows[metric].to_list(), name=line,
                                     mode="lines+markers", line={"color": _color(i)},
                                     legendgroup=line, showlegend=legend), row=1, col=col)
    for col, metric in enumerate(("token_reuse_rate", "retained_gib_s"), start=1):
        if observed.height:
            fig.add_trace(go.Scatter(
                x=observed["decoder_kv_blocks_ttl"].to_list(), y=observed[metric].to_list(),
                name="observed", mode="markers", marker={"symbol": "star", "size": 14,
                                                         "color": "#000"},
                legendgroup="observed", showlegend=col == 1), row=1, col=col)
    fig.update_xaxes(title_text="decoder_kv_blocks_ttl (s)")
    fig.update_yaxes(tickformat=".0%", row=1, col=1)
    fig.update_layout(title=title, **_LAYOUT)
    return fig


@_draws("Reuse ladder: ideal → observed (reusable tokens)", ("step", "tokens"), "the reuse ladder")
def reuse_ladder(frame: pl.DataFrame, title: str) -> go.Figure:
    """The reuse ladder as a waterfall per run: ideal, the loss at each bound, observed.

    Input: ``ladder`` (run_id, step_order, step, tokens, basis): reusable tokens reachable at
    each step, ideal first and observed last. The first step is a bar, each later one its loss
    from the step before, and the last step also a total bar (the running sum). A step whose
    tokens were not measured is left out and named in a note (its loss then shows in the next
    measured step).
    """
    data = _run_names(frame)
    if "step_order" in data.columns:
        data = data.sort("step_order", maintain_order=True)
    fig = go.Figure()
    skipped: list[str] = []
    for i, (name, rows) in enumerate(_groups(data)):
        known = rows.filter(pl.col("tokens").is_not_null())
        skipped += [f"{name}: {s}" for s in rows.filter(pl.col("tokens").is_null())["step"]]
        steps = known["step"].cast(pl.String).to_list()
        tokens = known["tokens"].to_list()
        if len(steps) < 2:
            continue
        # A "total" bar shows the running sum, so the loss into the last step gets its own
        # bar before it: the total then equals the last step's tokens.
        x = [*steps[:-1], f"lost before {steps[-1]}", steps[-1]]
        measures = ["absolute"] + ["relative"] * (len(steps) - 1) + ["total"]
        values = [tokens[0]] + [tokens[k] - tokens[k - 1] for k in range(1, len(tokens))]
        values.append(tokens[-1])
        fig.add_trace(go.Waterfall(x=x, y=values, measure=measures, name=name,
                                   offsetgroup=name,
                                   decreasing={"marker": {"color": "#d62728"}},
                                   increasing={"marker": {"color": "#2ca02c"}},
                                   totals={"marker": {"color": _color(i)}}))
    if not fig.data:
        return missing(title, "fewer than two measured ladder steps: the ladder is not measured")
    fig.update_layout(title=title, waterfallgroupgap=0.2, yaxis_title="tokens", **_LAYOUT)
    if skipped:
        note(fig, f"not measured: {', '.join(skipped)}")
    return fig


# --- dashboard: over time, outcomes, conversations --------------------------------------------


def _since_run_start(frame: pl.DataFrame, column: str) -> pl.DataFrame:
    """``frame`` with ``_t``: seconds of ``column`` since each run's first value."""
    return frame.with_columns(
        ((pl.col(column) - pl.col(column).min().over("_name")).dt.total_milliseconds() / 1e3)
        .alias("_t"))


@_draws("Reuse over time (share of reusable tokens, turns k ≥ 2)",
        ("window_start", "local_share", "remote_share"),
        "reuse over time")
def reuse_over_time(frame: pl.DataFrame, title: str) -> go.Figure:
    """Share of reusable tokens reused per time window: remote (solid), local (dotted), per run.

    Input: ``reuse_rate`` with by=window (run_id, window_start, local_share, remote_share);
    time is seconds since each run's first window, so runs recorded apart line up.
    """
    return _reuse_shares(title, _since_run_start(_run_names(frame), "window_start").sort("_t"),
                         "_t", "seconds since the run's first turn")


@_draws("Outcomes of turns k ≥ 2", ("outcome", "share"), "outcomes")
def outcome_shares(frame: pl.DataFrame, title: str) -> go.Figure:
    """Every outcome of turns k ≥ 2 (reuses and misses), stacked to 100 % per run.

    Input: ``miss_causes`` (run_id, outcome, turns, share).
    """
    data = _run_names(frame)
    fig = go.Figure()
    outcomes = sorted(data["outcome"].unique().to_list(),
                      key=lambda o: (o not in NOT_MISSES, str(o)))
    for outcome in outcomes:
        rows = data.filter(pl.col("outcome") == outcome).sort("_name")
        custom = rows["turns"].to_list() if "turns" in rows.columns else None
        fig.add_trace(go.Bar(x=rows["_name"].to_list(), y=rows["share"].to_list(),
                             name=str(outcome), marker={"color": outcome_color(outcome)},
                             customdata=custom,
                             hovertemplate=f"{outcome}: " + "%{y:.1%}"
                             + (" (%{customdata} turns)" if custom else "")))
    fig.update_layout(title=title, barmode="stack", yaxis_tickformat=".0%",
                      yaxis_title="share of later turns", **_LAYOUT)
    return fig


@_draws("TTFT over time", ("window_start", "ttft_p50_ms"), "TTFT over time")
def ttft_over_time(frame: pl.DataFrame, title: str) -> go.Figure:
    """TTFT p50 (solid) and p90 (dashed) per time window, per run.

    Input: run_id, window_start, ttft_p50_ms, ttft_p90_ms (the dashboard shapes it from the
    ledger); windows without first-token times stay gaps.
    """
    data = _since_run_start(_run_names(frame), "window_start").sort("_t")
    if _all_null(data, "ttft_p50_ms"):
        return missing(title, "no first-token times: TTFT not measured")
    fig = go.Figure()
    for i, (name, rows) in enumerate(_groups(data)):
        x = rows["_t"].to_list()
        fig.add_trace(go.Scatter(x=x, y=rows["ttft_p50_ms"].to_list(), name=f"{name} p50",
                                 mode="lines+markers", line={"color": _color(i)},
                                 legendgroup=name))
        if "ttft_p90_ms" in rows.columns:
            fig.add_trace(go.Scatter(x=x, y=rows["ttft_p90_ms"].to_list(), name=f"{name} p90",
                                     mode="lines+markers",
                                     line={"color": _color(i), "dash": "dash"},
                                     legendgroup=name))
    fig.update_layout(title=title, xaxis_title="seconds since the run's first turn",
                      yaxis_title="TTFT (ms)", **_LAYOUT)
    return fig


# Waterfall segments of one turn: (label, colour).
WATERFALL_PARTS = (
    ("tool wait", "#bbbbbb"),
    ("input processing", "#1f77b4"),
    ("D→P transfer", "#ff7f0e"),
    ("P→D transfer", "#9467bd"),
    ("generation", "#2ca02c"),
)


@_draws("Conversation waterfall", ("turn_index", "outcome"), "the conversation")
def conversation_waterfall(frame: pl.DataFrame, title: str) -> go.Figure:
    """One conversation turn by turn: each turn's legs from its arrival, and the tool wait.

    Input: ledger rows of one conversation (turn_index, outcome, prefill_ms, d2p_ms, p2d_ms,
    decode_ms, tool_wait_s). Left: milliseconds since the turn's arrival — input processing,
    then generation, with the D→P pull drawn inside input processing and the P→D pull inside
    generation (the legs contain them). Right: the tool wait before the turn, in seconds (tool
    waits dwarf the legs, so they get their own axis). Each row is labelled with its outcome.
    Parts not measured are left out and named in a note.
    """
    from plotly.subplots import make_subplots

    rows = frame.sort("turn_index").to_dicts()
    labels = [f"turn {r['turn_index']}: {r['outcome']}" for r in rows]
    segments: dict[str, tuple[list[Any], list[Any], list[Any]]] = {
        name: ([], [], []) for name, _ in WATERFALL_PARTS}
    measured: set[str] = set()

    def add(name: str, label: str, start: float, length: Any) -> None:
        if length is None:
            return
        measured.add(name)
        xs, bases, ys = segments[name]
        xs.append(float(length))
        bases.append(start)
        ys.append(label)

    for label, r in zip(labels, rows, strict=True):
        prefill = r.get("prefill_ms")
        add("tool wait", label, 0.0, r.get("tool_wait_s"))
        add("input processing", label, 0.0, prefill)
        add("D→P transfer", label, 0.0, r.get("d2p_ms"))
        add("generation", label, prefill or 0.0, r.get("decode_ms"))
        add("P→D transfer", label, prefill or 0.0, r.get("p2d_ms"))
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.72, 0.28],
                        horizontal_spacing=0.03,
                        subplot_titles=("legs (ms since the turn's arrival)",
                                        "tool wait before the turn (s)"))
    for name, color in WATERFALL_PARTS:
        xs, bases, ys = segments[name]
        if not xs:
            continue
        thin = name in ("D→P transfer", "P→D transfer")
        unit = "s" if name == "tool wait" else "ms"
        fig.add_trace(go.Bar(x=xs, base=bases, y=ys, orientation="h", name=name,
                             marker={"color": color}, width=0.35 if thin else 0.7,
                             hovertemplate=f"{name}: %{{x:.3f}} {unit}<extra>%{{y}}</extra>"),
                      row=1, col=2 if name == "tool wait" else 1)
    if not fig.data:
        return missing(title, "no leg times: the conversation's turns were not measured")
    layout = {**_LAYOUT, "height": max(420, 24 * len(rows) + 160)}
    fig.update_layout(title=title, barmode="overlay", **layout)
    fig.update_yaxes(categoryorder="array", categoryarray=labels[::-1], automargin=True,
                     dtick=1)
    absent = [name for name, _ in WATERFALL_PARTS if name not in measured]
    if "D→P transfer" in absent and "P→D transfer" in absent:
        absent = [a for a in absent if "transfer" not in a]
        note(fig, "no engine hooks: transfer times not measured"
             + (f"; also not measured: {', '.join(absent)}" if absent else ""))
    else:
        if "D→P transfer" in absent:
            # P→D pulls were seen, so the hooks are there: no turn pulled its history back.
            absent.remove("D→P transfer")
            note(fig, "no D→P pull in this conversation")
        if absent:
            note(fig, f"not measured: {', '.join(absent)}")
    return fig


@_draws("Missed-reuse causes over time (turns)", ("window_start", "outcome", "turns"),
        "causes over time")
def outcomes_over_time(frame: pl.DataFrame, title: str) -> go.Figure:
    """Missed-reuse causes per time window: stacked turns per cause, one panel per run.

    Input: run_id, window_start, outcome, turns (shaped from the ledger, misses only).
    """
    from plotly.subplots import make_subplots

    data = _since_run_start(_run_names(frame), "window_start")
    data = data.filter(~pl.col("outcome").is_in(NOT_MISSES))
    if data.is_empty():
        return missing(title, "no missed reuse: every later turn reused its earlier KV")
    runs = _groups(data)
    fig = make_subplots(rows=len(runs), cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[name for name, _ in runs])
    shown: set[str] = set()
    for row, (_, rows) in enumerate(runs, start=1):
        sums = rows.group_by("_t", "outcome").agg(pl.col("turns").sum()).sort("_t")
        for outcome, cause in _groups(sums, "outcome"):
            fig.add_trace(go.Bar(x=cause["_t"].to_list(), y=cause["turns"].to_list(),
                                 name=outcome, legendgroup=outcome,
                                 showlegend=outcome not in shown,
                                 marker={"color": outcome_color(outcome)}), row=row, col=1)
            shown.add(outcome)
        fig.update_yaxes(title_text="turns", row=row, col=1)
    fig.update_xaxes(title_text="seconds since the run's start", row=len(runs), col=1)
    layout = {**_LAYOUT, "height": max(420, 220 * len(runs))}
    fig.update_layout(title=title, barmode="stack", **layout)
    return fig


@_draws("Missed-reuse causes by prefill engine (turns)", ("prefill_engine", "outcome", "turns"),
        "causes by engine")
def outcomes_by_engine(frame: pl.DataFrame, title: str) -> go.Figure:
    """Missed-reuse causes per prefill engine: stacked turns per cause.

    Input: prefill_engine, outcome, turns (shaped from the ledger, misses only).
    """
    data = frame.filter(~pl.col("outcome").is_in(NOT_MISSES)).with_columns(
        pl.col("prefill_engine").fill_null("engine not measured"))
    if data.is_empty():
        return missing(title, "no missed reuse: every later turn reused its earlier KV")
    fig = go.Figure()
    for outcome, rows in _groups(data, "outcome"):
        fig.add_trace(go.Bar(x=rows["prefill_engine"].to_list(), y=rows["turns"].to_list(),
                             name=outcome, marker={"color": outcome_color(outcome)}))
    fig.update_layout(title=title, barmode="stack", yaxis_title="turns", **_LAYOUT)
    return fig


@_draws("Reusable tokens recomputed, by cause", ("outcome", "recomputed_tokens"),
        "tokens lost per cause")
def tokens_lost(frame: pl.DataFrame, title: str) -> go.Figure:
    """Reusable tokens recomputed per miss cause, one bar series per run.

    Input: ``miss_causes`` (run_id, outcome, recomputed_tokens); a null count stays a gap.
    """
    data = _run_names(frame).filter(~pl.col("outcome").is_in(NOT_MISSES))
    if data.is_empty():
        return missing(title, "no missed reuse: no tokens lost")
    fig = go.Figure()
    for i, (name, rows) in enumerate(_groups(data)):
        fig.add_trace(go.Bar(y=rows["outcome"].to_list(), x=rows["recomputed_tokens"].to_list(),
                             orientation="h", name=name, marker={"color": _color(i)}))
    fig.update_layout(title=title, barmode="group", xaxis_title="tokens recomputed", **_LAYOUT)
    if _all_null(data, "recomputed_tokens"):
        note(fig, "reusable tokens not measured: tokens lost not measured")
    return fig


# --- dashboard: retention ---------------------------------------------------------------------

_RETENTION_CLASSES = (("useful", "gib_s_useful", "#2ca02c"), ("idle", "gib_s_idle", "#ff7f0e"),
                      ("wasted", "gib_s_wasted", "#d62728"), ("open", "gib_s_open", "#7f7f7f"))


@_draws("Retention cost: GiB·s useful / idle / wasted",
        ("engine_id", "gib_s_useful", "gib_s_wasted"),
        "retention cost (no retention spans)")
def retention_classes(frame: pl.DataFrame, title: str) -> go.Figure:
    """GiB·s held per run and decode engine, stacked useful / idle / wasted / open.

    Input: ``retention_cost`` (run_id, engine_id, gib_s_useful, gib_s_idle, gib_s_wasted,
    gib_s_open).
    """
    data = _run_names(frame).with_columns(
        pl.concat_str([pl.col("_name"), pl.lit(" · "),
                       pl.col("engine_id").fill_null("engine not measured")]).alias("_bar"))
    fig = go.Figure()
    for label, column, color in _RETENTION_CLASSES:
        if column in data.columns:
            fig.add_trace(go.Bar(x=data["_bar"].to_list(), y=data[column].to_list(), name=label,
                                 marker={"color": color}))
    fig.update_layout(title=title, barmode="stack", yaxis_title="GiB·s", **_LAYOUT)
    return fig


@_draws("Retention hold times against decoder_kv_blocks_ttl", ("held_s", "reason"),
        "hold times (no retention spans)")
def hold_times(frame: pl.DataFrame, title: str) -> go.Figure:
    """Distribution of retention hold times per release reason, with the TTL as a line.

    Input: retention spans (held_s, reason, ttl_s).
    """
    data = frame.filter(pl.col("held_s").is_not_null())
    if data.is_empty():
        return missing(title, "no hold times: retention spans not measured")
    fig = go.Figure()
    for i, (reason, rows) in enumerate(_groups(data.with_columns(
            pl.col("reason").fill_null("reason not measured")), "reason")):
        fig.add_trace(go.Histogram(x=rows["held_s"].to_list(), name=reason, nbinsx=40,
                                   marker={"color": _color(i)}, opacity=0.75))
    fig.update_layout(title=title, barmode="overlay", xaxis_title="held (s)",
                      yaxis_title="retentions", **_LAYOUT)
    ttls = (sorted(v for v in data["ttl_s"].unique().to_list() if v is not None)
            if "ttl_s" in data.columns else [])
    for ttl in ttls:
        fig.add_vline(x=ttl, line={"color": "#000", "dash": "dash"},
                      annotation_text=f"TTL {ttl:g} s")
    if not ttls:
        note(fig, "no TTL on the retention spans: the TTL is not measured")
    return fig


# --- dashboard: TTFT vs task time -------------------------------------------------------------


@_draws("Σ TTFT vs task time, per conversation", ("task_s", "ttft_sum_s"), "TTFT and task time")
def ttft_vs_task(frame: pl.DataFrame, title: str) -> go.Figure:
    """Σ TTFT against task time per conversation, one colour per run (the diagonal = all TTFT).

    Input: ``task_time`` (run_id, conversation_id, task_s, ttft_sum_s).
    """
    data = _run_names(frame)
    if _all_null(data, "ttft_sum_s"):
        return missing(title, "no first-token times: TTFT not measured")
    fig = go.Figure()
    for i, (name, rows) in enumerate(_groups(data)):
        ids = rows["conversation_id"].to_list() if "conversation_id" in rows.columns else None
        fig.add_trace(go.Scattergl(x=rows["task_s"].to_list(), y=rows["ttft_sum_s"].to_list(),
                                   mode="markers", name=name, marker={"color": _color(i)},
                                   text=ids, hovertemplate="%{text}<br>task %{x:.1f} s<br>"
                                   "Σ TTFT %{y:.2f} s"))
    top = data["task_s"].max()
    if isinstance(top, int | float):
        fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="Σ TTFT = task",
                                 line={"color": "#999", "dash": "dot"}))
    fig.update_layout(title=title, xaxis_title="task time (s)", yaxis_title="Σ TTFT (s)",
                      **_LAYOUT)
    return fig


__all__ = ["Builder", "GIB", "INVALID", "MEMORY_SOURCES", "NOT_MISSES", "OUTCOME_COLORS",
    "TASK_COMPONENTS", "WATERFALL_PARTS", "conversation_waterfall", "hold_times", "miss_causes",
    "missing", "note", "outcome_color", "outcome_shares", "outcomes_by_engine",
    "outcomes_over_time", "prefill_split", "retained_memory", "retention_classes", "reuse_by_turn",
    "reuse_ladder", "reuse_over_time", "sweep_prefill_split", "sweep_ttft_vs_prompt", "task_time",
    "tokens_lost", "ttft_over_time", "ttft_vs_prompt", "ttft_vs_task", "whatif_curves"]
