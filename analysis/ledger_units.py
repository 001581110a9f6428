"""The ledger by conversation: which conversations new spans touch, and their rows alone.

A turn's ledger row reads its own spans (its legs by trace id, engine spans by the X-Request-Id
its vLLM request ids reduce to, retentions by vLLM request id) and its previous turn's row of
the same conversation (turn k-1, or the earlier turn whose KV it was offered), so a *unit* — a
conversation (run id + conversation id), or a turn of its own when it has none — can be
recomputed alone. :func:`unit_frames` reads one set of units' spans from
the store through the ledger's own extraction queries (:data:`kvscope.analysis.ledger.QUERIES`,
filtered by those keys), and :func:`kvscope.analysis.ledger.build` decides their rows by the
ledger's one per-turn statement: no second definition of any rule.

:func:`update` keeps the store's ``kvscope_ledger`` table current this way (``kvscope
ledger``): the span rows appended since the last build (``rowid`` above the watermark kept in
``kvscope_meta``) name the units they touch (:func:`touched`), those units' rows are deleted and
built again, and the watermark moves, in one transaction. A late span (an engine span after its
turn, turn k-1's retention after turn k) touches its unit again, so its turns are decided anew.

Where a unit's rows depend on more than its own spans the update rebuilds the whole table
instead (counted in :class:`Update`): rows of engine-only runs (no ``kvscope.turn`` span, so
rows per vLLM request that any later turn span removes), a run whose engines' missing-hooks
list changed (it feeds every turn of the run), and a table an earlier kvscope built with other
columns. The watermark is checked too: if the rows at or
below it are not the ones counted at the last build (rows deleted, a copied file), the table is
rebuilt whole.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import polars as pl

import kvscope
from kvscope import semconv, settings
from kvscope.analysis import ledger as ledger_module
from kvscope.analysis import stored_queries as stored_queries_module
from kvscope.errors import QueryOutOfMemory
from kvscope.store import query
from kvscope.store.database import open_store
from kvscope.store.duckdb_reader import DuckDBReader
from kvscope.store.reader import Reader
from kvscope.store.schema import META_TABLE, TRACES_TABLE, quote

if TYPE_CHECKING:
    from kvscope.store.clickhouse import ClickHouseSource

logger = logging.getLogger(__name__)

# kvscope_meta keys: the highest otel_traces rowid the table has read, and the row count then.
MARK_KEY = "ledger_span_mark"
COUNT_KEY = "ledger_span_count"
# ... and the fingerprint of the rules that built it (rules_fingerprint).
RULES_KEY = "ledger_rules"
# The modules whose code decides a ledger row: a table built by other code is not this ledger.
_RULE_MODULES = ("kvscope.analysis.ledger", "kvscope.reuse.boundaries", "kvscope.reuse.content",
                 "kvscope.reuse.decisions", "kvscope.reuse.outcomes", "kvscope.reuse.params",
                 "kvscope.reuse.taint", "kvscope.reuse.validity", "kvscope.store.query")

# ... and the fingerprint of the stored queries' tables (analysis/stored_queries.py), named with
# this prefix and the query's name.
STORED_KEY = "stored_queries"
STORED_PREFIX = "kvscope_stored_"

_SEP = "\x1f"


def unit_key(run_id: str | None, conversation_id: str | None, x_request_id: str | None) -> str:
    """The conversation a turn belongs to (its own unit when it has no conversation id)."""
    if conversation_id is not None:
        return f"{run_id or ''}{_SEP}c{_SEP}{conversation_id}"
    return f"{run_id or ''}{_SEP}x{_SEP}{x_request_id or ''}"


def unit_expr() -> pl.Expr:
    """:func:`unit_key` over a frame's ``run_id``, ``conversation_id``, ``x_request_id``."""
    run = pl.col("run_id").fill_null("")
    return (
        pl.when(pl.col("conversation_id").is_not_null())
        .then(pl.concat_str([run, pl.lit(f"{_SEP}c{_SEP}"), pl.col("conversation_id")]))
        .otherwise(pl.concat_str([run, pl.lit(f"{_SEP}x{_SEP}"),
                                  pl.col("x_request_id").fill_null("")]))
    )


def _unit_sql(run: str, conversation: str, x_request_id: str) -> str:
    """:func:`unit_key` in SQL (chr(31) is the separator)."""
    return (f"CASE WHEN {conversation} IS NOT NULL THEN coalesce({run}, '') || chr(31) || 'c' "
            f"|| chr(31) || {conversation} ELSE coalesce({run}, '') || chr(31) || 'x' "
            f"|| chr(31) || coalesce({x_request_id}, '') END")


def _rows_between(extraction: query.Query, low: int | None, high: int | None) -> query.Query:
    """An extraction query limited to ``low < rowid <= high`` (DuckDB text)."""
    sql, params = extraction.sql, dict(extraction.params)
    if low is not None:
        sql, params["row_low"] = sql + " AND rowid > $row_low", low
    if high is not None:
        sql, params["row_high"] = sql + " AND rowid <= $row_high", high
    return query.Query(sql, params)


def _filtered(extraction: query.Query, where: str, values: dict[str, object], *,
              columns: str = "*") -> query.Query:
    """``SELECT columns FROM (extraction) WHERE where`` (``where`` names the extraction's
    columns; its ``$name`` placeholders bound from ``values``)."""
    return query.Query(f"SELECT {columns} FROM ({extraction.sql}) AS q WHERE {where}",
                       {**extraction.params, **values})


def _narrowed(extraction: query.Query, condition: str, values: dict[str, object]) -> query.Query:
    """An extraction query with one more condition on ``otel_traces``' own columns (so DuckDB
    filters before it looks attributes up)."""
    return query.Query(f"{extraction.sql} AND {condition}", {**extraction.params, **values})


_BY_TRACE = '"TraceId" IN (SELECT unnest($traces))'
_BY_X_REQUEST_ID = '"SpanAttributes"[$x_key] IN (SELECT unnest($keys))'


def _key_sql(column: str, params: dict[str, object]) -> str:
    """The ledger's own request-id reduction (``ledger._key``) on ``column``, its parameters
    bound into ``params`` under names of their own."""
    binder = query.Binder(query.DUCKDB)
    text = ledger_module._key(binder, column)
    for name, value in binder.params.items():
        params[f"k_{name}"] = value
        text = text.replace(f"${name}", f"$k_{name}")
    return text


def _raw_request_id(kind: str, params: dict[str, object]) -> str:
    """The extraction ``kind``'s ``request_id`` as the attribute look-up on ``otel_traces``
    (its key bound into ``params``): a condition on it filters before the extraction's
    DISTINCT."""
    _, columns = ledger_module._KINDS[kind]
    column = columns["request_id"]
    assert isinstance(column, query.Attr)
    params["raw_request_key"] = column.key
    return f'"{column.map}"[$raw_request_key]'


def unit_frames(reader: Reader, units: Iterable[str], *, high: int | None = None,
                rows: bool = False, low: int | None = None) -> dict[str, pl.DataFrame]:
    """The extraction frames (:func:`kvscope.analysis.ledger.load_spans`' shape) of the spans
    ``units``' rows read, among the rows with ``rowid <= high`` (all when None). ``low``: the
    caller knows none of those spans is at or before that row (a scan skips the row groups
    before it); the run-wide hook carriers below are looked for in every row all the same.

    Also, per run of those turns, one engine span for each distinct missing-hooks list (the
    ledger takes the run's largest): that evidence is run-wide, and a span no turn names adds
    no row in a run that has turn spans. ``rows``: each frame also says the span's row
    (``_row``, its otel_traces rowid; a span stored twice is kept once, at its first row).
    """
    def numbered(queries: dict[str, query.Query]) -> dict[str, query.Query]:
        if not rows:
            return queries
        return {name: query.Query(q.sql.replace("SELECT DISTINCT ", "SELECT rowid AS _row, ", 1),
                                  q.params) for name, q in queries.items()}

    everywhere = numbered({name: _rows_between(q, None, high)
                           for name, q in ledger_module.QUERIES.items()})
    queries = numbered({name: _rows_between(q, low, high)
                        for name, q in ledger_module.QUERIES.items()})
    wanted = sorted(set(units))
    unit = _unit_sql("run_id", "conversation_id", "x_request_id")
    # First by the attributes themselves (one look-up a span), then by the exact unit.
    conversations = [u.split(_SEP, 2)[2] for u in wanted if u.split(_SEP, 2)[1] == "c"]
    requests = [u.split(_SEP, 2)[2] for u in wanted if u.split(_SEP, 2)[1] == "x"]
    narrowed = _narrowed(
        queries["turns"], '("SpanAttributes"[$c_key] IN (SELECT unnest($convs)) OR '
        '"SpanAttributes"[$x_key] IN (SELECT unnest($keys)))',
        {"c_key": semconv.GEN_AI_CONVERSATION_ID, "convs": conversations,
         "x_key": semconv.X_REQUEST_ID, "keys": requests})
    frames = {"turns": reader.frame(_filtered(
        narrowed, f"{unit} IN (SELECT unnest($units))", {"units": wanted}))}
    turns = frames["turns"]
    traces = turns["trace_id"].drop_nulls().unique().to_list()
    keys = turns["x_request_id"].drop_nulls().unique().to_list()
    runs = turns["run_id"].drop_nulls().unique().to_list()
    for name in ("prefill", "decode", "waits"):
        frames[name] = reader.frame(_narrowed(queries[name], _BY_TRACE, {"traces": traces}))
    held = {*frames["prefill"]["retention_id"].drop_nulls().to_list(),
            *frames["decode"]["decode_request_id"].drop_nulls().to_list()}
    # Engine spans by their request's key, decided on the raw attribute before the extraction's
    # DISTINCT (after it, DuckDB de-duplicates every span of the kind first: 14 s a kind at 10M
    # turns, against a scan's few).
    for name in ("decisions", "transfers", "vllm_requests"):
        params: dict[str, object] = {"keys": keys}
        key = _key_sql(_raw_request_id(name, params), params)
        frames[name] = reader.frame(_narrowed(
            queries[name], f"{key} IN (SELECT unnest($keys))", params))
    params = {"keys": keys, "held": sorted(held)}
    raw = _raw_request_id("retentions", params)
    key = _key_sql(raw, params)
    frames["retentions"] = reader.frame(_narrowed(
        queries["retentions"],
        f"({raw} IN (SELECT unnest($held)) OR {key} IN (SELECT unnest($keys)))", params))
    if runs:
        for name in ("decisions", "transfers", "retentions"):
            carriers = reader.frame(_filtered(
                everywhere[name],
                "hooks_missing IS NOT NULL AND run_id IN (SELECT unnest($runs)) "
                "QUALIFY row_number() OVER (PARTITION BY run_id, hooks_missing "
                "ORDER BY span_id) = 1", {"runs": runs}))
            if carriers.height:
                frames[name] = pl.concat([frames[name], carriers],
                                         how="vertical_relaxed").unique(maintain_order=True)
    if rows:
        frames = {name: frame.sort("_row").unique(
            [c for c in frame.columns if c != "_row"], keep="first", maintain_order=True)
            for name, frame in frames.items()}
    return frames


def unit_rows(reader: Reader, units: Iterable[str], *, high: int | None = None
              ) -> pl.DataFrame:
    """The ledger rows of ``units`` (the ledger's columns), from the store's spans."""
    return ledger_module.build(unit_frames(reader, units, high=high))


# --- which units new spans touch --------------------------------------------------------------


@dataclass(frozen=True)
class Touched:
    """What the span rows in (low, high] touch: units, or a reason to rebuild everything."""

    units: frozenset[str]
    rebuild_all: str | None = None


_ENGINE_KINDS = ("decisions", "transfers", "retentions", "vllm_requests")


def touched(reader: Reader, low: int, high: int) -> Touched:
    """The units whose rows the span rows with ``low < rowid <= high`` can change."""
    fresh = {name: reader.frame(_rows_between(q, low, high))
             for name, q in ledger_module.QUERIES.items()}
    units: set[str] = set()
    turns = fresh["turns"]
    if turns.height:
        units.update(turns.select(unit_expr()).to_series().to_list())
    # Legs: the turn of their trace. Engine spans: the turns they name (by X-Request-Id), and
    # for a retention also the turn whose prefill was offered it.
    traces = sorted({t for name in ("prefill", "decode", "waits")
                     for t in fresh[name]["trace_id"].drop_nulls().to_list()})
    keys: set[str] = set()
    for name in _ENGINE_KINDS:
        frame = fresh[name]
        if frame.height:
            keys.update(frame.select(ledger_module.request_key("request_id"))
                        .to_series().drop_nulls().to_list())
    retained = sorted(set(fresh["retentions"]["request_id"].drop_nulls().to_list()))
    if retained:
        offered = reader.frame(_filtered(
            ledger_module.QUERIES["prefill"], "retention_id IN (SELECT unnest($held))",
            {"held": retained}))
        traces = sorted({*traces, *offered["trace_id"].drop_nulls().to_list()})
    # Engine spans name their request by vLLM's id: reduce it the ledger's way, in SQL too
    # (completions ids carry a prompt index the polars reduction keeps).
    engine_keys: set[str] = set(keys)
    for name in _ENGINE_KINDS:
        if fresh[name].height:
            params: dict[str, object] = {}
            key = _key_sql("request_id", params)
            found = reader.frame(_filtered(_rows_between(ledger_module.QUERIES[name], low, high),
                                           "TRUE", params, columns=f"DISTINCT {key} AS k"))
            engine_keys.update(found["k"].drop_nulls().to_list())
    named = _named_units(reader, traces, engine_keys, low)
    units.update(named["unit"].to_list())
    # An engine span no turn names makes a row of its own in a run without turn spans.
    unnamed = engine_keys - set(named["x_request_id"].drop_nulls().to_list())
    if unnamed:
        runs = {r for name in _ENGINE_KINDS for r in fresh[name].filter(
            ledger_module.request_key("request_id").is_in(list(unnamed)))["run_id"].to_list()}
        if not runs <= _runs_with_turns(reader, runs):
            return Touched(frozenset(units), "engine spans of a run without turn spans")
    runs_now = turns["run_id"].unique().to_list()
    if (turns.height and reader.has_table(ledger_module.LEDGER_TABLE)
            and _engine_only_rows(reader, runs_now)):
        return Touched(frozenset(units), "turn spans in a run the ledger holds engine rows of")
    changed = _hooks_changed(reader, fresh, low)
    if changed:
        return Touched(frozenset(units), f"the missing-hooks list of run {changed[0]} changed")
    return Touched(frozenset(units))


def units_of(reader: Reader, traces: Iterable[str], keys: Iterable[str], *,
             low: int | None = None) -> pl.DataFrame:
    """The units (``unit``, with ``run_id`` and ``x_request_id``) of the turn spans in the
    store whose trace is among ``traces`` or whose X-Request-Id is among ``keys`` (after row
    ``low``: the caller knows none is at or before it)."""
    unit = _unit_sql("run_id", "conversation_id", "x_request_id")
    lookups: list[tuple[str, dict[str, object]]] = [
        (_BY_TRACE, {"traces": sorted(set(traces))}),
        (_BY_X_REQUEST_ID, {"keys": sorted(set(keys)), "x_key": semconv.X_REQUEST_ID})]
    return pl.concat([reader.frame(_filtered(
        _narrowed(_rows_between(ledger_module.QUERIES["turns"], low, None), condition, values),
        "TRUE", {},
        columns=f"DISTINCT {unit} AS unit, run_id, x_request_id"))
        for condition, values in lookups])


def _named_units(reader: Reader, traces: Iterable[str], keys: Iterable[str],
                 low: int) -> pl.DataFrame:
    """:func:`units_of`, the turn spans up to row ``low`` looked up in the ledger table instead
    of the store: :func:`update_connection` has checked that the table was built from exactly
    those rows, and each of their turn spans is a row of it with its trace id (an engine-only
    row has none) and X-Request-Id. The spans past ``low`` are read from the store, which skips
    the row groups before them. At 1M turns the two scans of every span this replaces took
    1.8 s of a 6 s update."""
    traces, keys = sorted(set(traces)), sorted(set(keys))
    unit = _unit_sql("run_id", "conversation_id", "x_request_id")
    known = reader.frame(query.Query(
        f"SELECT DISTINCT {unit} AS unit, run_id, x_request_id "
        f"FROM {quote(ledger_module.LEDGER_TABLE)} WHERE trace_id IS NOT NULL "
        "AND (trace_id IN (SELECT unnest($traces)) OR x_request_id IN (SELECT unnest($keys)))",
        {"traces": traces, "keys": keys}, name="units the ledger table names"))
    return pl.concat([known, units_of(reader, traces, keys, low=low)],
                     how="vertical_relaxed").unique()


def _runs_with_turns(reader: Reader, runs: set[str | None]) -> set[str | None]:
    # One look-up a turn span (the whole extraction, DISTINCT over every column, took 25 s at
    # 10M turns).
    named = [r for r in runs if r is not None]
    found = reader.frame(query.Query(
        f'SELECT DISTINCT "ResourceAttributes"[$run_key] AS run_id FROM {quote(TRACES_TABLE)} '
        'WHERE "SpanName" = $span AND "ResourceAttributes"[$run_key] IN (SELECT unnest($runs))',
        {"run_key": semconv.RUN_ID, "span": semconv.SPAN_TURN, "runs": named},
        name="runs with turn spans"))
    return set(found["run_id"].to_list())


def _engine_only_rows(reader: Reader, runs: list[str | None]) -> bool:
    _, rows = reader.rows(query.Query(
        f"SELECT count(*) FROM {quote(ledger_module.LEDGER_TABLE)} WHERE observer = $observer "
        "AND (run_id IN (SELECT unnest($runs)) OR run_id IS NULL)",
        {"observer": semconv.OBSERVER_ENGINE, "runs": [r for r in runs if r is not None]},
        name="engine-only ledger rows"))
    return bool(rows[0][0])


def _hooks_changed(reader: Reader, fresh: dict[str, pl.DataFrame], low: int) -> list[str]:
    """Runs whose largest missing-hooks list (the ledger's per-run value) the new rows raise."""
    new = pl.concat([fresh[name].select("run_id", "hooks_missing")
                     for name in ("decisions", "transfers", "retentions")],
                    how="vertical_relaxed").drop_nulls()
    if not new.height:
        return []
    changed = []
    for run_id, group in new.group_by("run_id"):
        top = group["hooks_missing"].max()
        before = None
        for name in ("decisions", "transfers", "retentions"):
            older = _rows_between(ledger_module.QUERIES[name], None, low)
            _, rows = reader.rows(_filtered(older, "run_id = $run", {"run": run_id[0]},
                                            columns="max(hooks_missing)"))
            value = rows[0][0]
            if value is not None and (before is None or value > before):
                before = value
        if before is None or top > before:
            changed.append(str(run_id[0]))
    return changed


# --- the store's table, kept current ----------------------------------------------------------


@dataclass(frozen=True)
class Update:
    """What :func:`update` did: ``rows`` in the table now, ``units`` recomputed (None: the
    table was rebuilt whole, for ``reason``), ``seconds`` it took."""

    rows: int
    units: int | None
    reason: str | None
    seconds: float


def _runs_with_invalid(con: duckdb.DuckDBPyConnection, frame: pl.DataFrame) -> list[str]:
    """The runs of ``frame`` (rows just built) with an invalid load, in it or in the table."""
    runs = frame["run_id"].fill_null("").unique().to_list()
    fresh = set(frame.filter(pl.col("invalid_kind").is_not_null())["run_id"].fill_null(""))
    stored = {run for (run,) in con.execute(
        f"SELECT DISTINCT coalesce(run_id, '') FROM {quote(ledger_module.LEDGER_TABLE)} "
        "WHERE invalid_kind IS NOT NULL AND coalesce(run_id, '') IN (SELECT unnest(?))",
        [runs]).fetchall()}
    return sorted(fresh | stored)


def _units_of_runs(con: duckdb.DuckDBPyConnection, runs: list[str]) -> frozenset[str]:
    unit = _unit_sql("run_id", "conversation_id", "x_request_id")
    return frozenset(u for (u,) in con.execute(
        f"SELECT DISTINCT {unit} FROM {quote(ledger_module.LEDGER_TABLE)} "
        "WHERE coalesce(run_id, '') IN (SELECT unnest(?))", [runs]).fetchall())


@cache
def rules_fingerprint() -> str:
    """A hash of the source of the modules that decide ledger rows (kvscope's version where a
    source cannot be read): a stored table whose fingerprint differs was built by other rules."""
    digest = hashlib.sha256()
    for name in _RULE_MODULES:
        try:
            digest.update(Path(inspect.getfile(importlib.import_module(name))).read_bytes())
        except (OSError, TypeError):
            digest.update(f"{name} {kvscope.__version__}".encode())
    return digest.hexdigest()[:32]


def clickhouse_stamp(reader: Reader) -> str:
    """What a ClickHouse ``kvscope_ledger`` table is built from, kept as its comment: these
    rules (:func:`rules_fingerprint`) over the span table's rows as they are now (their count,
    and a sum of their trace and span ids' hashes: the Collector's table has no row number to
    keep a watermark by)."""
    _, rows = reader.rows(query.Query(
        f'SELECT count(), sum(cityHash64("TraceId", "SpanId")) FROM {quote(TRACES_TABLE)}',
        name="span rows' stamp"))
    count, hashed = rows[0]
    return f"{_stamp_head(count)}, hash {hashed}"


def _stamp_head(count: int) -> str:
    return f"kvscope ledger: rules {rules_fingerprint()}, spans {count}"


def rebuild_clickhouse(source: ClickHouseSource, *, partitions: int | None = None) -> int:
    """Rebuild ``kvscope_ledger`` as a ClickHouse table from the Collector's raw spans there;
    return its row count (``kvscope ledger --clickhouse``).

    The per-turn query runs in ClickHouse (as in DuckDB); only its rows come back and are
    shaped here. ``partitions``: as :func:`~kvscope.analysis.ledger.ledger`'s (ranges of
    conversations the rows are built in). Built in partitions, each one's rows are written
    back to the server as they come and the ledger is finished there
    (:func:`~kvscope.analysis.ledger.build_clickhouse_table`: nothing of the whole ledger held
    here); in one statement, it is written back whole. Either is swapped in, commented with
    :func:`clickhouse_stamp`, taken before the build reads anything (spans stored while it
    builds make it stale).
    """
    from kvscope.store.clickhouse import ClickHouseReader

    reader = ClickHouseReader.connect(source, time_limit_s=None)
    try:
        stamp = clickhouse_stamp(reader)
        count = ledger_module.partitions_for(reader) if partitions is None else partitions
        if count > 1:
            try:
                return ledger_module.build_clickhouse_table(reader, count, comment=stamp)
            except ledger_module.NoScratch as exc:
                logger.warning("the ledger cannot stage its span kinds in partitions (%s); "
                               "building it in one statement", exc)
        whole = ledger_module.ledger(reader, partitions=1)
        row = ledger_module.ROW
        return reader.write_table(ledger_module.LEDGER_TABLE,
                                  whole.with_row_index(row).cast({row: pl.UInt64}),
                                  order_by=(row,), comment=stamp)
    finally:
        reader.close()


def stored_ledger(reader: Reader) -> pl.DataFrame | None:
    """The store's ``kvscope_ledger`` table when it is the ledger its spans give now (``kvscope
    ledger`` built or updated it since the last span row was stored, with these rules and
    columns), in the ledger's order; else None (the caller computes it). On ClickHouse, when
    ``kvscope ledger --clickhouse`` built it from the span rows there now
    (:func:`clickhouse_stamp`)."""
    stored = stored_columns(reader)
    return None if stored is None else stored.frame()


# The columns that put the ledger in order (and select a context's runs: run_id).
_ORDER = ("run_id", "conversation_id", "turn_index", "arrival")

# Ledger columns of few distinct values (a vocabulary, or the store's engines) that analyses
# get as polars Categoricals (:func:`categorical`): 4 bytes a row where a String's view is 16,
# ~1 GiB less of what an analysis holds of a 10M-turn ledger. Stored and queried as strings
# (the ledger's rules and tables are untouched: this is how analyses read them).
CATEGORICAL = (
    "router_lookup", "reuse_guard", "prefill_engine", "decode_engine", "decision", "d2p_status",
    "retention_release", "history", "invalid_kind", "reuse_validity", "outcome", "observer",
    "engine_evidence",
)


def categorical(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with its :data:`CATEGORICAL` columns as Categoricals (what analyses read)."""
    return frame.cast({name: pl.Categorical() for name in CATEGORICAL if name in frame.columns})


class StoredLedger:
    """The stored ``kvscope_ledger`` table (:func:`stored_columns`), read a column at a time
    as analyses ask for them, each kept once read (vocabularies as Categoricals:
    :data:`CATEGORICAL`).

    An analysis that needs six of the ledger's columns holds those six: at 10M turns the whole
    ledger is ~12 GiB resident in polars (its strings keep DuckDB's Arrow buffers), most of it
    request ids and evidence text few analyses read. A DuckDB
    table scan returns the rows in their stored order every time, so columns read apart line
    up; rows stored out of the ledger's order (an update appends its units' rows) are put in
    order by one permutation, taken once from the ordering columns. ClickHouse's table is read
    ``ORDER BY _row`` (its sort key: the ledger's order), so no ordering column is read first.
    """

    # The most columns one query reads: one, so what a read holds beside the columns kept (the
    # engine's result, its copy in polars) is one column's. The whole 10M-turn ledger from chdb
    # peaked at 8.8 GiB eight at a time, 7.5 one at a time, in the same ~20 s (1M: 1.6 and 1.3
    # GiB, ~2 s).
    read_columns = 1
    # Rows a batch of a column's read is cast in (:meth:`_read`).
    batch_rows = 1 << 20
    # The most rows :meth:`head` reads by naming their places (the report's table: 200).
    rows_by_place = 10_000

    def __init__(self, reader: Reader) -> None:
        self._reader = reader
        self._columns: dict[str, pl.Series] = {}
        # The columns the last frame() asked for: its caller holds them, so letting them go
        # would free nothing.
        self._asked: set[str] = set()
        self._read_s = 0.0
        self._read_bytes = 0
        self._order: pl.Series | None = None
        if reader.dialect is query.CLICKHOUSE:
            return  # read ORDER BY _row: in the ledger's order already, no key read first
        keys = pl.concat([self._read([name]) for name in _ORDER], how="horizontal")
        # Built whole: already in order, and no permutation is taken (sorting 10M rows by the
        # four keys held ~1.7 GiB more).
        self._order = None if _in_order(keys) else keys.select(pl.arg_sort_by(
            *_ORDER, nulls_last=False, maintain_order=True)).to_series()
        self._keep(keys)

    @property
    def height(self) -> int:
        if not self._columns:
            self.frame(["run_id"])
        return len(next(iter(self._columns.values())))

    def frame(self, columns: Iterable[str] | None = None) -> pl.DataFrame:
        """The ledger's ``columns`` (all, in the table's order of columns, when None), in the
        ledger's order of rows."""
        names = list(ledger_module.LEDGER_SCHEMA if columns is None else dict.fromkeys(columns))
        unknown = [name for name in names if name not in ledger_module.LEDGER_SCHEMA]
        if unknown:
            raise KeyError(f"the ledger has no column {', '.join(map(repr, unknown))}")
        missing = [name for name in names if name not in self._columns]
        # A column a query: its Arrow result and the frame made of it coexist for a moment, so
        # what one read adds beyond the columns kept stays small.
        for start in range(0, len(missing), self.read_columns):
            began = time.perf_counter()
            read = self._read(missing[start:start + self.read_columns])
            self._read_s += time.perf_counter() - began
            self._read_bytes += int(read.estimated_size())
            self._keep(read)
        for name in names:  # now the most recently used
            self._columns[name] = self._columns.pop(name)
        self._asked = set(names)
        return pl.DataFrame([self._columns[name] for name in names])

    def head(self, rows: int, runs: Sequence[str] | None = None) -> tuple[pl.DataFrame, int]:
        """The first ``rows`` rows of every column (of ``runs`` only, when given), as
        :meth:`frame` would order them, and how many rows there are in all. A column not kept
        is read, cut to those rows and let go: the whole listing is never held."""
        if runs is None:
            height = self.height
            at = pl.int_range(min(rows, height), dtype=pl.UInt32, eager=True)
        else:
            chosen = self.frame(["run_id"]).get_column("run_id").is_in(list(runs))
            height = int(chosen.sum())
            at = chosen.arg_true().head(rows)
        # Where those rows lie in the table's own order.
        stored = at if self._order is None else self._order.gather(at)
        missing = [name for name in ledger_module.LEDGER_SCHEMA if name not in self._columns]
        if len(stored) > self.rows_by_place:  # too many to name: each column read whole, cut
            read = pl.DataFrame([self._read([name]).to_series().gather(stored)
                                 for name in missing])
        else:
            read = self._rows(missing, stored) if missing else pl.DataFrame()
        columns = [self._columns[name].gather(at) if name in self._columns
                   else read.get_column(name) for name in ledger_module.LEDGER_SCHEMA]
        return pl.DataFrame(columns), height

    def _rows(self, names: list[str], stored: pl.Series) -> pl.DataFrame:
        """The columns ``names`` of the rows at ``stored`` (places in the table's own order),
        in that order: those rows alone are read (DuckDB by their ``rowid``, which a delete
        leaves gaps in, so read first; ClickHouse by ``_row``, the place itself), not the
        columns (a string column of 10M rows is ~0.8 GiB through the engine)."""
        if self._reader.dialect is query.CLICKHOUSE:
            ids, at = stored.cast(pl.Int64), ledger_module.ROW
        else:
            ids, at = self._read(["rowid"]).to_series().gather(stored), "rowid"
        if ids.is_empty():
            return pl.DataFrame(schema=self._wanted(names))
        listed = ", ".join(str(int(value)) for value in ids)
        read = self._read(names, where=f"{at} IN ({listed})", at=at)
        return pl.DataFrame({"_at": ids}).join(
            read, on="_at", how="left", maintain_order="left").drop("_at")

    def _wanted(self, names: Iterable[str]) -> dict[str, pl.DataType]:
        return {name: pl.Int64() if name == "rowid" else pl.Categorical()
                if name in CATEGORICAL else ledger_module.LEDGER_SCHEMA[name] for name in names}

    def seconds_per_byte(self) -> float:
        """What reading its columns has taken, per byte read (0 before any)."""
        return self._read_s / max(self._read_bytes, 1)

    def cached_bytes(self) -> int:
        """What the kept columns hold, by polars' estimate."""
        return sum(int(series.estimated_size()) for series in self._columns.values())

    def release(self, wanted: int) -> int:
        """Let go of the least recently used columns until ``wanted`` bytes are freed (or none
        is kept but those the last :meth:`frame` asked for, which its caller holds); the bytes
        let go. A column let go is read again when asked for."""
        freed = 0
        for name in list(self._columns):
            if freed >= wanted:
                break
            if name not in self._asked:
                freed += int(self._columns.pop(name).estimated_size())
        return freed

    def _read(self, names: Iterable[str], *, where: str = "", at: str = "") -> pl.DataFrame:
        """Columns of every row (or of the rows ``where`` selects, with ``at``, their place,
        as ``_at``)."""
        wanted = self._wanted(names)
        listed = ", ".join(name if name == "rowid" else quote(name) for name in wanted)
        if at:
            wanted = {"_at": pl.Int64(), **wanted}
            listed = f"{at} AS _at, {listed}"
        # A ClickHouse scan's order is no table's: its rows are read by their place.
        ordered = (f" ORDER BY {ledger_module.ROW}"
                   if self._reader.dialect is query.CLICKHOUSE else "")
        where = f" WHERE {where}" if where else ""
        read = query.Query(
            f"SELECT {listed} FROM {quote(ledger_module.LEDGER_TABLE)}{where}{ordered}",
            name="stored ledger columns")
        try:
            # A plain scan: on DuckDB through an instance that caches little of what it read.
            return self._scan(self._reader.scanner(), read, wanted)
        except QueryOutOfMemory:
            return self._scan(self._reader, read, wanted)

    def _scan(self, reader: Reader, read: query.Query,
              wanted: dict[str, pl.DataType]) -> pl.DataFrame:
        if not set(CATEGORICAL).intersection(wanted):
            return reader.frame(read).cast(wanted)  # type: ignore[arg-type]
        # A vocabulary is cast a batch at a time: read whole it was a String column of every
        # row before it became a Categorical, memory the allocators kept (10M rows: 50-300 MiB
        # a column, where its Categorical is 38). Not other strings: their batches, put in one
        # chunk, held more than one read (request ids: +890 MiB against +690).
        parts = reader.map_batches(read, lambda batch: batch.cast(
            wanted), rows=self.batch_rows)  # type: ignore[arg-type]
        return pl.concat(parts, rechunk=True)  # one chunk: analyses over many cost more

    def _keep(self, frame: pl.DataFrame) -> None:
        if self._order is not None:
            frame = frame[self._order]
        for series in frame.iter_columns():
            self._columns[series.name] = series


def _in_order(keys: pl.DataFrame) -> bool:
    """Whether ``keys``' rows are in the order a stable sort by its columns, nulls first,
    would give them: each row compared with the one before, column by column, no sort."""
    later = pl.lit(True)  # what decides a tie on every column (a stable sort keeps the rows)
    for name in reversed(keys.columns):
        before, this = pl.col(name).shift(1), pl.col(name)
        # A null sorts before any value and ties with a null.
        less = (before < this).fill_null(before.is_null() & this.is_not_null())
        later = less | (before.eq_missing(this) & later)
    return bool(keys.lazy().select(later.slice(1).all()).collect().item())


def _current(reader: Reader) -> bool:
    """Whether the store's ``kvscope_ledger`` table is the ledger its spans give now (see
    :func:`stored_ledger`)."""
    if not reader.has_table(ledger_module.LEDGER_TABLE):
        return False
    if reader.dialect is query.CLICKHOUSE:
        return _current_on_clickhouse(reader)
    if reader.dialect is not query.DUCKDB:
        return False
    _, meta = reader.rows(query.Query(
        f"SELECT key, value FROM {quote(META_TABLE)} WHERE key IN ($mark, $count, $rules)",
        {"mark": MARK_KEY, "count": COUNT_KEY, "rules": RULES_KEY}, name="ledger watermark"))
    kept = dict(meta)
    _, spans = reader.rows(query.Query("SELECT max(rowid), count(*) FROM otel_traces",
                                       name="span rows"))
    high, count = spans[0]
    _, columns = reader.rows(query.Query(
        "SELECT column_name FROM duckdb_columns() WHERE table_name = $table "
        "ORDER BY column_index", {"table": ledger_module.LEDGER_TABLE}, name="ledger columns"))
    return (kept.get(RULES_KEY) == rules_fingerprint()
            and kept.get(MARK_KEY) == str(-1 if high is None else high)
            and kept.get(COUNT_KEY) == str(count)
            and [c for (c,) in columns] == list(ledger_module.LEDGER_SCHEMA))


def _current_on_clickhouse(reader: Reader) -> bool:
    """:func:`_current` on ClickHouse: the table's comment is the stamp of the spans there now,
    and its columns are these (its row number first)."""
    _, found = reader.rows(query.Query(
        "SELECT comment FROM system.tables WHERE database = currentDatabase() "
        "AND name = $table", {"table": ledger_module.LEDGER_TABLE}, name="ledger stamp"))
    # The count first: ClickHouse answers it from its parts' metadata, where the stamp's hash
    # reads every span id (a table the Collector still writes to is stale at once).
    _, counted = reader.rows(query.Query(f"SELECT count() FROM {quote(TRACES_TABLE)}",
                                         name="span rows"))
    if not found or not str(found[0][0]).startswith(_stamp_head(counted[0][0]) + ", "):
        return False
    _, columns = reader.rows(query.Query(
        "SELECT name FROM system.columns WHERE database = currentDatabase() AND table = $table "
        "ORDER BY position", {"table": ledger_module.LEDGER_TABLE}, name="ledger columns"))
    return ([c for (c,) in columns] == [ledger_module.ROW, *ledger_module.LEDGER_SCHEMA]
            and found[0][0] == clickhouse_stamp(reader))


def stored_columns(reader: Reader) -> StoredLedger | None:
    """The store's ``kvscope_ledger`` table to read by columns (:class:`StoredLedger`) when it
    is the ledger its spans give now (see :func:`stored_ledger`); else None."""
    return StoredLedger(reader) if _current(reader) else None


# --- stored queries ----------------------------------------------------------------------------


def stored_queries() -> dict[str, query.Query]:
    """The queries whose results the ledger's build keeps (:mod:`kvscope.analysis.stored_queries`),
    by name."""
    return dict(sorted(stored_queries_module.STORED_QUERIES.items()))


def stored_fingerprint(queries: dict[str, query.Query]) -> str:
    """What the stored queries' tables were built by: each one's name, SQL and parameters."""
    text = repr([(name, q.sql, sorted(q.params.items())) for name, q in queries.items()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stored_tables(reader: Reader) -> frozenset[str]:
    """The stored queries whose tables hold what the queries give now: while the stored ledger
    is current, those ``kvscope ledger`` built with these queries' text; else none (always on
    ClickHouse: its build keeps none)."""
    if reader.dialect is not query.DUCKDB or not _current(reader):
        return frozenset()
    queries = stored_queries()
    _, meta = reader.rows(query.Query(
        f"SELECT value FROM {quote(META_TABLE)} WHERE key = $key", {"key": STORED_KEY},
        name="stored queries' fingerprint"))
    if meta != [(stored_fingerprint(queries),)]:
        return frozenset()
    return frozenset(name for name in queries if reader.has_table(STORED_PREFIX + name))


def scan(reader: Reader, read: query.Query) -> pl.DataFrame:
    """``read``, a plain scan of a table kvscope keeps, through the reader's
    :meth:`~kvscope.store.reader.Reader.scanner` (on DuckDB an instance that caches little of
    what it read), or through the reader itself where that runs out of memory."""
    try:
        return reader.scanner().frame(read)
    except QueryOutOfMemory:
        return reader.frame(read)


def stored_table_query(name: str, sql: query.Query) -> query.Query:
    """What reads the stored query ``name``'s table: its rows in the order they were stored
    (the spans' order), or distinct ones for a ``SELECT DISTINCT`` (rows appended by later
    builds may repeat earlier ones)."""
    distinct = "DISTINCT " if sql.sql.startswith("SELECT DISTINCT ") else ""
    return query.Query(f"SELECT {distinct}* FROM {quote(STORED_PREFIX + name)}",
                       name=f"stored {sql.name or name}")


def _keep_stored(con: duckdb.DuckDBPyConnection, mark: int | None, high: int,
                 whole: bool) -> None:
    """Bring the stored queries' tables up to the span rows ``rowid <= high`` (in the caller's
    transaction): built whole when ``whole``, when the queries changed or a table is missing,
    else the rows above ``mark`` appended."""
    queries = stored_queries()
    fingerprint = stored_fingerprint(queries)
    tables = {r[0] for r in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE starts_with(table_name, ?)",
        [STORED_PREFIX]).fetchall()}
    whole = (whole or mark is None or _meta_text(con, STORED_KEY) != fingerprint
             or any(STORED_PREFIX + name not in tables for name in queries))
    for name, sql in queries.items():
        table = quote(STORED_PREFIX + name)
        if whole:
            rows = _rows_between(sql, None, high)
            con.execute(f"CREATE OR REPLACE TABLE {table} AS {rows.sql}", dict(rows.params))
        elif mark is not None and high > mark:
            rows = _rows_between(sql, mark, high)
            con.execute(f"INSERT INTO {table} {rows.sql}", dict(rows.params))
    for gone in sorted(tables - {STORED_PREFIX + name for name in queries}):
        con.execute(f"DROP TABLE {quote(gone)}")
    _set_meta(con, STORED_KEY, fingerprint)


def _meta(con: duckdb.DuckDBPyConnection, key: str) -> int | None:
    rows = con.execute(f"SELECT value FROM {quote(META_TABLE)} WHERE key = ?", [key]).fetchall()
    return int(rows[0][0]) if rows else None


def _meta_text(con: duckdb.DuckDBPyConnection, key: str) -> str | None:
    rows = con.execute(f"SELECT value FROM {quote(META_TABLE)} WHERE key = ?", [key]).fetchall()
    return str(rows[0][0]) if rows else None


def _set_meta(con: duckdb.DuckDBPyConnection, key: str, value: int | str) -> None:
    con.execute(f"INSERT OR REPLACE INTO {quote(META_TABLE)} VALUES (?, ?)", [key, str(value)])


def _has_ledger(con: duckdb.DuckDBPyConnection) -> bool:
    return bool(con.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE table_name = ?",
        [ledger_module.LEDGER_TABLE]).fetchall()[0][0])


def _ledger_columns(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [r[0] for r in con.execute(
        "SELECT column_name FROM duckdb_columns() WHERE table_name = ? ORDER BY column_index",
        [ledger_module.LEDGER_TABLE]).fetchall()]


def update_connection(con: duckdb.DuckDBPyConnection, *, full: bool = False,
                      partitions: int | None = None) -> Update:
    """Bring ``kvscope_ledger`` up to the store's spans on a writable connection (see
    :func:`update`)."""
    started = time.perf_counter()
    high, count = con.execute("SELECT max(rowid), count(*) FROM otel_traces").fetchall()[0]
    high = -1 if high is None else high
    mark, counted = _meta(con, MARK_KEY), _meta(con, COUNT_KEY)
    reason: str | None = "asked for a full rebuild" if full else None
    if reason is None and (mark is None or counted is None or not _has_ledger(con)):
        reason = "no table or watermark from an earlier build"
    if reason is None and _ledger_columns(con) != list(ledger_module.LEDGER_SCHEMA):
        reason = "the table has an earlier kvscope's columns"
    if reason is None and _meta_text(con, RULES_KEY) != rules_fingerprint():
        reason = "the ledger's rules changed since the last build"
    if reason is None and con.execute("SELECT count(*) FROM otel_traces WHERE rowid <= ?",
                                      [mark]).fetchall()[0][0] != counted:
        reason = "the span rows below the watermark are not those counted at the last build"
    reader = DuckDBReader(con, time_limit_s=None)
    units: frozenset[str] = frozenset()
    if reason is None and high > (mark or -1):
        touch = touched(reader, mark or -1, high)
        reason, units = touch.rebuild_all, touch.units
    # A full build of a large store is written as it is built (never held whole: built).
    frame = (ledger_module.full_build(con, partitions=partitions) if reason is not None
             else unit_rows(reader, units, high=high) if units else None)
    built = reason is not None and frame is None
    if frame is not None and reason is None:
        # A run with an invalid load: its KV may be read again by any later turn of the run
        # (kvscope.reuse.taint), so the run's units are decided together.
        runs = _runs_with_invalid(con, frame)
        if runs:
            units = units | _units_of_runs(con, runs)
            frame = unit_rows(reader, units, high=high)
    con.execute("BEGIN TRANSACTION")
    try:
        if built:
            ledger_module.swap_in(con)
        elif reason is not None:
            assert frame is not None
            ledger_module.persist(con, frame)
        elif frame is not None:
            table = quote(ledger_module.LEDGER_TABLE)
            unit = _unit_sql("run_id", "conversation_id", "x_request_id")
            con.execute(f"DELETE FROM {table} WHERE {unit} IN (SELECT unnest(?))",
                        [sorted(units)])
            con.register("_kvscope_ledger_rows", frame.to_arrow())
            try:
                con.execute(f"INSERT INTO {table} SELECT * FROM _kvscope_ledger_rows")
            finally:
                con.unregister("_kvscope_ledger_rows")
        _keep_stored(con, mark, high, whole=reason is not None)
        _set_meta(con, MARK_KEY, high)
        _set_meta(con, COUNT_KEY, count)
        _set_meta(con, RULES_KEY, rules_fingerprint())
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    rows = con.execute(
        f"SELECT count(*) FROM {quote(ledger_module.LEDGER_TABLE)}").fetchall()[0][0]
    return Update(rows, None if reason is not None else len(units), reason,
                  time.perf_counter() - started)


def update(path: str | Path, *, full: bool = False, partitions: int | None = None) -> Update:
    """Bring the store's ``kvscope_ledger`` table up to its spans, recomputing only the units
    touched since the last build (the whole table on the first build, when ``full``, or when
    the new spans reach beyond their units: see the module's docstring). ``partitions``: a
    whole build in that many ranges of conversations, each written as it is built (the
    default: one statement up to ``ledger.PARTITION_TURNS`` turn spans)."""
    con = open_store(path, memory_limit=settings.resolve("store_memory_limit") or None)
    try:
        con.execute("SET enable_progress_bar = false")  # the CLI draws its own
        return update_connection(con, full=full, partitions=partitions)
    finally:
        con.close()


__all__ = ["CATEGORICAL", "COUNT_KEY", "MARK_KEY", "RULES_KEY", "STORED_KEY", "STORED_PREFIX",
    "StoredLedger", "Touched", "Update", "categorical", "clickhouse_stamp", "rebuild_clickhouse",
    "rules_fingerprint", "scan", "stored_columns", "stored_fingerprint", "stored_ledger",
    "stored_queries", "stored_table_query", "stored_tables", "touched", "unit_expr",
    "unit_frames", "unit_key", "unit_rows", "units_of", "update", "update_connection"]
