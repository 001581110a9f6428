"""Runs: which runs a store holds, what each one was (label, feature state, workload), and pairs.

A run is one experiment however many processes exported to it (engines, proxy, GPU sampler).
Everything about runs lives here: the run table (:data:`RUN_TABLE`), naming runs by id or label
(:func:`resolve_runs`, :func:`open_context`), what a run was (:func:`run_info`: feature state and
its source, workload key) and which runs belong together (:func:`baseline_for`,
:func:`choose_pair`, :func:`pick_runs`).

Feature state comes from the run's settings (``prefill_bidirectional_kv_xfer`` /
``decode_bidirectional_kv_xfer`` in simulator runs, ``bidirectional_kv_xfer`` in emulator runs),
else from an ``on``/``off`` word in the label, else from prefill's reuse decisions. The workload
key comes from the settings' ``workload`` entries, else a fingerprint of the ledger that a fault
cannot change (conversations and turns): a baseline is matched on the workload, never on the
whole settings dict, so a run with faults injected finds the OFF run of the same workload.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from kvscope import semconv
from kvscope.analysis.registry import AnalysisContext, AnalysisError, intermediate
from kvscope.errors import KvscopeError
from kvscope.store import query
from kvscope.store.reader import Reader
from kvscope.store.schema import RUNS_TABLE, TRACES_TABLE
from kvscope.store.source import open_reader

__all__ = ["FEATURE_OFF", "FEATURE_ON", "LEDGER_COLUMNS", "RUNS_FROM_SPANS", "RUNS_SQL",
    "RUN_INFO_COLUMNS", "RUN_TABLE", "all_runs", "baseline_for", "choose_pair", "context_over",
    "context_run_info", "feature_state", "open_context", "pick_runs", "require_spans",
    "resolve_runs", "run_info", "run_settings", "run_table", "runs_query", "with_run_labels"]

if TYPE_CHECKING:
    from kvscope.store.clickhouse import ClickHouseSource

FEATURE_ON = "on"
FEATURE_OFF = "off"

# Settings keys that say whether bidirectional KV transfer was on (vLLM's own names).
_FEATURE_KEYS = (
    "prefill_bidirectional_kv_xfer",
    "decode_bidirectional_kv_xfer",
    "bidirectional_kv_xfer",
)
_WORKLOAD_KEYS = ("workload", "workload_settings")
_LABEL_WORD = re.compile(r"(?<![a-z0-9])(on|off)(?![a-z0-9])")

RUNS_SQL = query.Query("SELECT run_id, label, settings, started_at, ended_at FROM kvscope_runs "
                       "ORDER BY started_at", name="runs")
# Where no kvscope process recorded runs (the OpenTelemetry Collector writing ClickHouse), the
# runs are the run ids the spans' resources carry: labelled by their id, settings not recorded.
# (A missing key reads as NULL on DuckDB and as '' on ClickHouse: both are left out.)
RUNS_FROM_SPANS = query.Query(
    "SELECT run_id, run_id AS label, '{}' AS settings, min(Timestamp) AS started_at, "
    "max(Timestamp) AS ended_at FROM (SELECT ResourceAttributes[$key] AS run_id, Timestamp "
    "FROM otel_traces) AS spans WHERE run_id IS NOT NULL AND run_id <> '' "
    "GROUP BY run_id ORDER BY started_at, run_id", {"key": semconv.RUN_ID},
    name="runs from spans")

RUN_INFO_COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "label": pl.String(),
    "feature": pl.String(),
    "feature_source": pl.String(),
    "workload_key": pl.String(),
    "started_at": pl.Datetime("us", "UTC"),
}


# --- the run table ----------------------------------------------------------------------------


@intermediate("runs", shared=True)
def RUN_TABLE(ctx: AnalysisContext) -> pl.DataFrame:  # noqa: N802 (a registered constant)
    """Every run recorded in the store (id, label, settings JSON, start, end), oldest first."""
    return ctx.frame(runs_query(ctx.reader))


def runs_query(reader: Reader) -> query.Query:
    """The query for the run table: ``kvscope_runs``, else the run ids the spans carry."""
    return RUNS_SQL if reader.has_table(RUNS_TABLE) else RUNS_FROM_SPANS


def all_runs(ctx: AnalysisContext) -> pl.DataFrame:
    """Every run in the store (not only the selected ones), oldest first."""
    frame: pl.DataFrame = ctx.get(RUN_TABLE)
    return frame


def run_table(ctx: AnalysisContext) -> pl.DataFrame:
    """The selected runs of the store, oldest first."""
    return ctx.select_runs(all_runs(ctx))


def resolve_runs(runs: pl.DataFrame, names: Sequence[str]) -> list[str]:
    """Run ids for ``names`` (each a run id or a label; a label may name several runs)."""
    resolved: list[str] = []
    for name in names:
        ids = runs.filter(pl.col("run_id") == name)["run_id"].to_list()
        ids = ids or runs.filter(pl.col("label") == name)["run_id"].to_list()
        if not ids:
            known = ", ".join(f"{r} ({lbl})" for r, lbl in runs.select("run_id", "label").rows())
            raise AnalysisError(f"no run with id or label {name!r}; runs: {known or 'none'}")
        resolved += [i for i in ids if i not in resolved]
    return resolved


def open_context(db: str | Path | ClickHouseSource,
                 runs: Sequence[str] | None = None) -> AnalysisContext:
    """Open ``db`` read-only for analysis (a DuckDB store, or a ClickHouse source), selecting
    ``runs`` (ids or labels) when given."""
    reader = open_reader(db)
    try:
        return context_over(reader, runs)
    except KvscopeError:
        reader.close()
        raise


def context_over(reader: Reader, runs: Sequence[str] | None = None) -> AnalysisContext:
    """An analysis context over an open reader (``kvscope serve``'s own cursor, for one),
    selecting ``runs`` (ids or labels) when given."""
    if not runs:
        return AnalysisContext(reader)
    table = reader.frame(runs_query(reader))
    ctx = AnalysisContext(reader, runs=resolve_runs(table, runs))
    ctx.cached((RUN_TABLE, ()), lambda: table)  # read once: the context's run table
    return ctx


def with_run_labels(frame: pl.DataFrame, runs: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with its ``run_id`` column shown as a ``run`` column of labels."""
    labels = {rid: label or rid for rid, label in runs.select("run_id", "label").rows()}
    return frame.with_columns(
        pl.col("run_id").replace_strict(labels, default=pl.col("run_id"),
                                        return_dtype=pl.String)).rename({"run_id": "run"})


def require_spans(db: str | Path | ClickHouseSource) -> None:
    """Raise :class:`AnalysisError` when ``db`` holds no spans: a report or an analysis of it
    would print empty tables and look like a run in which nothing happened."""
    reader = open_reader(db)
    try:
        _, rows = reader.rows(query.Query(f"SELECT 1 FROM {TRACES_TABLE} LIMIT 1",
                                          name="any span"))
    finally:
        reader.close()
    if not rows:
        raise AnalysisError(f"{db}: the store holds no spans ({TRACES_TABLE} is empty); "
                            "nothing to analyze")


# --- what each run was ------------------------------------------------------------------------


def run_settings(raw: str | None) -> dict[str, Any]:
    """A run's settings JSON as a dict (empty when absent or not an object)."""
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def feature_state(settings: Mapping[str, Any], label: str | None,
                  prefill_bidirectional: bool | None = None) -> tuple[str | None, str]:
    """Whether a run had bidirectional KV transfer on, and where that came from.

    Settings win (ON only when every recorded flag is on); then an ``on``/``off`` word in the
    label; then what prefill's reuse decisions reported. ``(None, "not recorded")`` otherwise.
    """
    flags = [_truthy(settings[k]) for k in _FEATURE_KEYS if k in settings]
    if flags:
        return (FEATURE_ON if all(flags) else FEATURE_OFF), "settings"
    words = _LABEL_WORD.findall((label or "").lower())
    if len(set(words)) == 1:
        return words[0], "label"
    if prefill_bidirectional is not None:
        return (FEATURE_ON if prefill_bidirectional else FEATURE_OFF), "reuse decisions"
    return None, "not recorded"


# What this module's analyses read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    "run_id", "conversation_id", "prefill_bidirectional")


def run_info(runs: pl.DataFrame, ledger: pl.DataFrame) -> pl.DataFrame:
    """One row per run: label, feature state (and its source), workload key (pure)."""
    fingerprint = ledger.group_by("run_id").agg(
        pl.col("conversation_id").n_unique().alias("_conversations"),
        pl.len().alias("_turns"),
        pl.col("prefill_bidirectional").drop_nulls().all().alias("_bidir_all"),
        pl.col("prefill_bidirectional").is_not_null().any().alias("_bidir_seen"),
    )
    prints = {row["run_id"]: row for row in fingerprint.iter_rows(named=True)}
    rows = []
    for run in runs.iter_rows(named=True):
        settings = run_settings(run["settings"])
        seen = prints.get(run["run_id"])
        bidir = seen["_bidir_all"] if seen and seen["_bidir_seen"] else None
        feature, source = feature_state(settings, run["label"], bidir)
        if any(k in settings for k in _WORKLOAD_KEYS):
            workload = json.dumps({k: settings.get(k) for k in _WORKLOAD_KEYS}, sort_keys=True,
                                  default=str)
        elif seen:
            # Counts a fault cannot change (a failed turn still counts; its tokens may not).
            workload = f"{seen['_conversations']} conversations, {seen['_turns']} turns"
        else:
            workload = None
        rows.append({"run_id": run["run_id"], "label": run["label"], "feature": feature,
                     "feature_source": source, "workload_key": workload,
                     "started_at": run["started_at"]})
    return pl.DataFrame(rows, schema=RUN_INFO_COLUMNS)


@intermediate("run_info", shared=False)
def _context_run_info(ctx: AnalysisContext) -> pl.DataFrame:
    return run_info(run_table(ctx), ctx.ledger(LEDGER_COLUMNS))


def context_run_info(ctx: AnalysisContext) -> pl.DataFrame:
    """:func:`run_info` of the selected runs, cached per context."""
    frame: pl.DataFrame = ctx.get(_context_run_info)
    return frame


# --- which runs belong together ---------------------------------------------------------------


def baseline_for(info: pl.DataFrame, run_id: str) -> str | None:
    """The most recent feature-OFF run of the same workload as the feature-ON run ``run_id``."""
    row = info.filter(pl.col("run_id") == run_id)
    if row.is_empty() or row["feature"][0] != FEATURE_ON or row["workload_key"][0] is None:
        return None
    offs = info.filter(
        (pl.col("feature") == FEATURE_OFF) & (pl.col("workload_key") == row["workload_key"][0])
    ).sort("started_at")
    return offs["run_id"][-1] if offs.height else None


def choose_pair(info: pl.DataFrame) -> tuple[str, str]:
    """The pair to compare when none was named: (ON, OFF) of one workload, else the only two."""
    ons = info.filter(pl.col("feature") == FEATURE_ON).sort("started_at", descending=True)
    for run_id in ons["run_id"]:
        off = baseline_for(info, run_id)
        if off is not None:
            return run_id, off
    if info.height == 2:
        a, b = info["run_id"].to_list()
        return a, b
    raise AnalysisError(
        f"compare needs two runs: found {info.height} and no feature ON/OFF pair of one "
        "workload; name them with runs=A,B (ids or labels)"
    )


def pick_runs(ctx: AnalysisContext, names: Sequence[str] | None) -> tuple[str, str]:
    """The two run ids to compare: named ones (ids or labels), else :func:`choose_pair`."""
    if names:
        ids = resolve_runs(all_runs(ctx), names)
        if len(ids) != 2:
            raise AnalysisError(
                f"compare needs exactly two runs; {', '.join(names)} name {len(ids)}"
            )
        missing = [i for i in ids if ctx.runs is not None and i not in ctx.runs]
        if missing:
            raise AnalysisError(f"run(s) {', '.join(missing)} are not in the selected runs")
        return ids[0], ids[1]
    return choose_pair(context_run_info(ctx))
