"""Reading the OpenTelemetry Collector's ClickHouse tables through the same reader interface.

A fleet sends OTLP to a Collector whose ClickHouse exporter writes ``otel_traces`` and
``otel_metrics_gauge``, the tables the DuckDB store mirrors (:mod:`kvscope.store.schema`).
:class:`ClickHouseReader` is a :class:`~kvscope.store.reader.Reader` over those tables, so
an :class:`~kvscope.analysis.registry.AnalysisContext` and every analysis run on it unchanged:
it renders each :class:`~kvscope.store.query.Query` in the ClickHouse dialect, binds its values
as server-side parameters (``{p0:String}``), and returns the frames a DuckDB store returns.

One :class:`ClickHouseSource` names the engine by its URL:

    ``http://host:8123``, ``https://…``   a ClickHouse server, through clickhouse-connect
    ``chdb:/path/to/folder``              ClickHouse's own engine in this process (chdb) on a data
                                          folder (chdb allows one folder per process)

Results are normalised to the DuckDB store's types: ``DateTime64`` columns without a zone (UTC,
as the exporter writes them) come back without a zone, dictionary-encoded (``LowCardinality``)
columns as plain values. ClickHouse's errors become :class:`~kvscope.errors.StoreError` here, as
DuckDB's do in the reader. Writing (the ledger table, copying a DuckDB store's raw tables) goes
through :meth:`Engine.insert_arrow`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import polars as pl
import polars.selectors as cs
import pyarrow as pa

from kvscope.errors import StoreError
from kvscope.store.query import CLICKHOUSE, Query
from kvscope.store.reader import query_error
from kvscope.store.schema import quote

__all__ = ["CHDB_SCHEME", "ClickHouseReader", "ClickHouseSource", "Engine", "RUNS_DDL",
    "clickhouse_type", "connect", "fill_table", "load_store", "normalise", "replace_table"]

CHDB_SCHEME = "chdb"
T = TypeVar("T")
# The error name ClickHouse gives a query stopped by max_execution_time.
_TIMEOUT_EXCEEDED = "TIMEOUT_EXCEEDED"
# The zone kvscope's own ClickHouse tables declare for zoned times (DateTime64(6, 'UTC')); any
# other zone on a result column is the server's default on a column declared without one.
_DECLARED_ZONE = "UTC"


@dataclass(frozen=True)
class ClickHouseSource:
    """Where the Collector's tables are: a server URL or a chdb data folder, and a database."""

    url: str
    database: str = "default"
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def is_chdb(self) -> bool:
        """Whether this names ClickHouse's in-process engine (chdb) rather than a server."""
        return urlsplit(self.url).scheme == CHDB_SCHEME

    @property
    def chdb_path(self) -> str:
        """The chdb data folder (``chdb:/path`` or ``chdb:///path``)."""
        parts = urlsplit(self.url)
        return (parts.netloc + parts.path) if parts.netloc else parts.path

    def __str__(self) -> str:
        # Names the source in messages: never the password.
        return f"{self.url} (database {self.database})"


class Engine(Protocol):
    """What a reader needs of a ClickHouse connection."""

    def query_arrow(self, sql: str, params: Mapping[str, Any]) -> pa.Table: ...

    def command(self, sql: str, params: Mapping[str, Any] | None = None) -> None: ...

    def insert_arrow(self, table: str, data: pa.Table, database: str = "") -> None: ...

    def close(self) -> None: ...


class _Chdb:
    """ClickHouse's engine in this process (chdb) on one data folder; a session of its own."""

    def __init__(self, source: ClickHouseSource, time_limit_s: float | None) -> None:
        from chdb import session

        if not source.chdb_path:
            raise StoreError(f"{source.url}: name chdb's data folder, e.g. chdb:/var/lib/kvscope")
        self._session = session.Session(source.chdb_path)
        self._database = source.database
        # A session keeps its current database and settings (another session's do not mix in).
        # Reading creates nothing: a database that does not exist is refused here.
        try:
            self.command(f"USE {quote(self._database)}")
            if time_limit_s:
                self.command(f"SET max_execution_time = {float(time_limit_s)}")
        except BaseException:
            self._session.close()
            raise

    def query_arrow(self, sql: str, params: Mapping[str, Any]) -> pa.Table:
        # The Arrow stream format carries the schema even for no rows (chdb's "ArrowTable"
        # fails on an empty result).
        try:
            result = self._session.query(sql, "ArrowStream", params=dict(params))
        except Exception as exc:
            if _TIMEOUT_EXCEEDED in str(exc):
                # chdb 4.4: the query after a timed-out one gets an empty result in its place;
                # one throw-away query takes it (tests/store/test_clickhouse.py checks this).
                self._session.query("SELECT 1")
            raise
        # Decompressed with the C library's allocator, which returns what polars' copy of the
        # result frees at once (pyarrow's default pool kept it: +0.4 GiB at 10M turns).
        return pa.ipc.open_stream(result.bytes(),
                                  memory_pool=pa.system_memory_pool()).read_all()

    def command(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        self._session.query(sql, params=dict(params or {}))

    def insert_arrow(self, table: str, data: pa.Table, database: str = "") -> None:
        # chdb reads the Arrow table in place: its Python() table function looks the name up
        # in this frame (a Parquet file in between took ~2x as long, the same rows stored).
        if not data.num_rows:
            return
        columns = ", ".join(quote(c) for c in data.column_names)
        into = f"{quote(database)}.{quote(table)}" if database else quote(table)
        self._session.query(f"INSERT INTO {into} ({columns}) SELECT * FROM Python(data)")

    def close(self) -> None:
        self._session.close()


class _Server:
    """A ClickHouse server over HTTP(S), through clickhouse-connect."""

    def __init__(self, source: ClickHouseSource, time_limit_s: float | None) -> None:
        import clickhouse_connect

        # A refused connection is logged by both libraries, then raised: the raise becomes one
        # line naming the source (_translate), so their warnings would only repeat it.
        for noisy in ("urllib3.connectionpool", "clickhouse_connect"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
        settings = {"max_execution_time": int(time_limit_s)} if time_limit_s else {}
        parts = urlsplit(source.url)
        self._client = clickhouse_connect.get_client(
            host=parts.hostname or "127.0.0.1", port=parts.port or 0,
            interface=parts.scheme or "http", username=source.user or "default",
            password=source.password or "", database=source.database, settings=settings,
        )

    def query_arrow(self, sql: str, params: Mapping[str, Any]) -> pa.Table:
        table: pa.Table = self._client.query_arrow(sql, parameters=dict(params))
        return table

    def command(self, sql: str, params: Mapping[str, Any] | None = None) -> None:
        self._client.command(sql, parameters=dict(params or {}))

    def insert_arrow(self, table: str, data: pa.Table, database: str = "") -> None:
        self._client.insert_arrow(table, data, database=database or None)

    def close(self) -> None:
        self._client.close()


def _translate(source: ClickHouseSource, time_limit_s: float | None,
               run: Callable[[], T], doing: str = "query failed on", *,
               query: Query | None = None, sql: str | None = None) -> T:
    """``run()`` with ClickHouse's errors (either engine) as one-line StoreErrors (QueryErrors
    naming ``query`` when one runs)."""
    try:
        return run()
    except StoreError:
        raise
    except Exception as exc:  # chdb raises RuntimeError subclasses, clickhouse-connect its own
        if not _is_clickhouse_error(exc):
            raise
        text = str(exc).strip()
        if _TIMEOUT_EXCEEDED in text:
            problem = f"query exceeded the {time_limit_s:g} s time limit"
        else:
            problem = f"{doing} {source}: {text.splitlines()[0] if text else type(exc).__name__}"
        if query is not None:
            raise query_error(query, problem, sql) from None
        raise StoreError(problem) from None


def _is_clickhouse_error(exc: Exception) -> bool:
    module = type(exc).__module__ or ""
    return module.startswith(("chdb", "clickhouse_connect")) or "DB::Exception" in str(exc)


def connect(source: ClickHouseSource, time_limit_s: float | None = None) -> Engine:
    """An engine for ``source`` (chdb in this process, or a server through clickhouse-connect)."""
    def make() -> Engine:
        if source.is_chdb:
            return _Chdb(source, time_limit_s)
        if urlsplit(source.url).scheme not in ("http", "https"):
            raise StoreError(f"{source.url}: expected http(s)://host:port of a ClickHouse "
                             f"server or {CHDB_SCHEME}:/folder")
        return _Server(source, time_limit_s)
    return _translate(source, time_limit_s, make, "cannot connect to")


def normalise(table: pa.Table) -> pa.Table:
    """A ClickHouse result with the DuckDB store's types (zoneless UTC times, plain values)."""
    columns = []
    for column in table.columns:
        kind = column.type
        if pa.types.is_dictionary(kind):
            column = column.cast(kind.value_type)
            kind = kind.value_type
        if pa.types.is_timestamp(kind) and kind.tz is not None and kind.tz != _DECLARED_ZONE:
            # Same instant, no zone: the column was declared without one (UTC by convention).
            column = column.cast(pa.timestamp(kind.unit, "UTC")).cast(pa.timestamp(kind.unit))
        columns.append(column)
    return pa.table(columns, names=table.column_names)


class ClickHouseReader:
    """The :class:`~kvscope.store.reader.Reader` over ClickHouse tables (the Collector's),
    read-only."""

    dialect = CLICKHOUSE

    def __init__(self, engine: Engine, source: ClickHouseSource, *,
                 time_limit_s: float | None = 60.0) -> None:
        self._engine = engine
        self.source = source
        self.time_limit_s = time_limit_s

    @classmethod
    def connect(cls, source: ClickHouseSource, *,
                time_limit_s: float | None = 60.0) -> ClickHouseReader:
        """Connect to ``source`` (``open_reader(source)`` comes here)."""
        return cls(connect(source, time_limit_s), source, time_limit_s=time_limit_s)

    def arrow(self, query: Query) -> pa.Table:
        """Run ``query``; its result as an Arrow table with the DuckDB store's types."""
        if query.positional:
            raise query_error(query, "positional (?) parameters do not run on ClickHouse: name "
                              "them ($name) and pass a mapping")
        text = query.text(CLICKHOUSE)
        bound = dict(query.params)
        return normalise(_translate(self.source, self.time_limit_s,
                                    lambda: self._engine.query_arrow(text, bound), query=query,
                                    sql=text))

    def frame(self, query: Query) -> pl.DataFrame:
        return pl.DataFrame(self.arrow(query))

    def scanner(self) -> ClickHouseReader:
        """As :meth:`Reader.scanner`: this reader (ClickHouse keeps no cache of the blocks a
        query read unless asked: ``use_uncompressed_cache`` is off by default)."""
        return self

    def execute(self, query: Query) -> None:
        """Run ``query``, a statement with no result (the ledger's scratch tables)."""
        text = query.text(CLICKHOUSE)
        bound = dict(query.params)
        _translate(self.source, self.time_limit_s,
                   lambda: self._engine.command(text, bound), query=query, sql=text)

    def map_batches(self, query: Query, fn: Callable[[pl.DataFrame], T], *,
                    rows: int = 1_000_000) -> list[T]:
        """As :meth:`Reader.map_batches`; the result arrives whole (one Arrow stream), and is
        converted and handed to ``fn`` a batch at a time."""
        table = self.arrow(query)
        done = [fn(pl.DataFrame(batch)) for batch in table.to_batches(max_chunksize=rows)]
        return done or [fn(pl.DataFrame(table.schema.empty_table()))]

    def rows(self, query: Query, *,
             max_rows: int | None = None) -> tuple[list[str], list[tuple]]:
        frame = self.frame(query)
        if max_rows is not None and frame.height > max_rows:
            raise query_error(query, f"the result has more than {max_rows} rows; add a LIMIT "
                              "or aggregate in the query")
        return frame.columns, frame.rows()

    def has_table(self, name: str) -> bool:
        found = self.frame(Query("SELECT count() AS n FROM system.tables WHERE database = "
                                 "currentDatabase() AND name = $name", {"name": name},
                                 name="has_table"))
        return bool(found["n"][0])

    def write_table(self, name: str, frame: pl.DataFrame, order_by: tuple[str, ...] = (),
                    comment: str = "") -> int:
        """Replace the table ``name`` with ``frame`` (the derived ledger); return its rows."""
        return _translate(self.source, self.time_limit_s,
                          lambda: replace_table(self._engine, name, frame, order_by, comment))

    def write_table_as(self, name: str, schema: Mapping[str, pl.DataType], select: Query,
                       order_by: tuple[str, ...] = (), comment: str = "") -> None:
        """Replace the table ``name`` (of ``schema``'s columns, in order) with the rows of
        ``select``, a query run on the server (``INSERT … SELECT``: the rows never come here),
        swapped in as :meth:`write_table`'s are."""
        text, bound = select.text(CLICKHOUSE), dict(select.params)
        listed = ", ".join(quote(c) for c in schema)

        def fill(staging: str) -> None:
            self._engine.command(f"INSERT INTO {quote(staging)} ({listed}) {text}", bound)

        _translate(self.source, self.time_limit_s,
                   lambda: fill_table(self._engine, name, schema, fill, order_by, comment),
                   query=select, sql=text)

    def insert(self, table: str, frame: pl.DataFrame, database: str = "") -> None:
        """Append ``frame``'s rows to ``table`` (of ``database``, else the reader's)."""
        _translate(self.source, self.time_limit_s,
                   lambda: self._engine.insert_arrow(table, _strings(frame).to_arrow(),
                                                     database))

    @property
    def engine(self) -> Engine:
        """The connection (for writers: :func:`replace_table`, loading raw tables)."""
        return self._engine

    def interrupt(self) -> None:
        """Nothing to stop in this process: the query runs in ClickHouse, bounded by the
        reader's time limit."""

    def close(self) -> None:
        """Close the connection."""
        self._engine.close()


def _strings(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with its Categorical columns (an analysis's vocabularies) as the strings they
    are stored as."""
    return frame.with_columns(cs.categorical().cast(pl.String))


def clickhouse_type(dtype: pl.DataType) -> str:
    """The ClickHouse column type for a polars type of a derived table (nullable)."""
    if isinstance(dtype, pl.Datetime):
        unit = {"ns": 9, "us": 6, "ms": 3}[dtype.time_unit or "us"]
        zone = f", '{dtype.time_zone}'" if dtype.time_zone else ""
        inner = f"DateTime64({unit}{zone})"
    else:
        names = {pl.String: "String", pl.Categorical: "String", pl.Int64: "Int64",
                 pl.Int32: "Int32", pl.Float64: "Float64", pl.Boolean: "Bool",
                 pl.UInt64: "UInt64"}
        inner = next((v for k, v in names.items() if isinstance(dtype, k)), "")
        if not inner:
            raise TypeError(f"no ClickHouse column type for {dtype}")
    return f"Nullable({inner})"


def replace_table(engine: Engine, name: str, frame: pl.DataFrame,
                  order_by: tuple[str, ...] = (), comment: str = "") -> int:
    """Replace table ``name`` with ``frame``: written under a new name, then swapped in.

    Readers see the old table or the new one, never a half-written one (``EXCHANGE TABLES``
    where the database supports it; a drop and a rename otherwise). ``comment``: the new
    table's (what it was built from, say), swapped in with it.
    """
    frame = _strings(frame)

    def fill(staging: str) -> None:
        if frame.height:
            engine.insert_arrow(staging, frame.to_arrow())

    fill_table(engine, name, dict(frame.schema), fill, order_by, comment)
    return frame.height


def fill_table(engine: Engine, name: str, schema: Mapping[str, pl.DataType],
               fill: Callable[[str], None], order_by: tuple[str, ...] = (),
               comment: str = "") -> None:
    """Replace table ``name`` with a table of ``schema`` that ``fill(staging)`` writes under a
    new name (rows inserted, or an ``INSERT … SELECT``), then swapped in, as
    :func:`replace_table` does."""
    staging = f"{name}__new"
    columns = ", ".join(f"{quote(c)} {clickhouse_type(t)}" for c, t in schema.items())
    key = ", ".join(quote(c) for c in order_by) if order_by else ""
    literal = comment.replace("\\", "\\\\").replace("'", "\\'")
    engine.command(f"DROP TABLE IF EXISTS {quote(staging)}")
    engine.command(f"CREATE TABLE {quote(staging)} ({columns}) ENGINE = MergeTree "
                   f"ORDER BY tuple({key}) SETTINGS allow_nullable_key = 1"
                   + (f" COMMENT '{literal}'" if comment else ""))
    try:
        fill(staging)
    except BaseException:
        with contextlib.suppress(Exception):
            engine.command(f"DROP TABLE IF EXISTS {quote(staging)}")
        raise
    engine.command(f"CREATE TABLE IF NOT EXISTS {quote(name)} AS {quote(staging)}")
    engine.command(f"EXCHANGE TABLES {quote(staging)} AND {quote(name)}")
    engine.command(f"DROP TABLE {quote(staging)}")


# kvscope's own run table on ClickHouse (the Collector writes none: see analysis/runs.py).
RUNS_DDL = (
    "CREATE TABLE IF NOT EXISTS kvscope_runs (run_id String, label String, settings String, "
    "started_at DateTime64(6, 'UTC'), ended_at Nullable(DateTime64(6, 'UTC'))) "
    "ENGINE = MergeTree ORDER BY run_id"
)


def _flat_select(table: str, columns: list[tuple[str, str, pa.DataType]]) -> str:
    """DuckDB SELECT of a raw table with each LIST-of-STRUCT column as ClickHouse's Nested
    arrays (``Events`` -> ``Events.Timestamp``, ``Events.Name``, …: the exporter's layout)."""
    parts = []
    for name, _, arrow in columns:
        if pa.types.is_list(arrow) and pa.types.is_struct(arrow.value_type):
            for field_ in arrow.value_type:
                parts.append(f"list_transform({quote(name)}, lambda e: e.{quote(field_.name)}) "
                             f"AS {quote(name + '.' + field_.name)}")
        else:
            parts.append(quote(name))
    return f"SELECT {', '.join(parts)} FROM {quote(table)}"


def load_store(db: str | Path, engine: Engine, *, batch_rows: int = 1_000_000) -> dict[str, int]:
    """Copy a DuckDB store's raw tables (and its runs) into ClickHouse tables that exist.

    ``otel_traces`` and ``otel_metrics_gauge`` must have been created as the exporter creates
    them; ``kvscope_runs`` is created here (:data:`RUNS_DDL`). Returns rows copied per table.
    For moving a store into ClickHouse, and for the tests that compare the two engines.
    """
    from kvscope.store.database import open_readonly
    from kvscope.store.schema import GAUGE_COLUMNS, GAUGE_TABLE, TRACES_COLUMNS, TRACES_TABLE

    engine.command(RUNS_DDL)
    con = open_readonly(db)
    copied: dict[str, int] = {}
    try:
        sources = [
            (TRACES_TABLE, _flat_select(TRACES_TABLE, TRACES_COLUMNS)),
            (GAUGE_TABLE, _flat_select(GAUGE_TABLE, GAUGE_COLUMNS)),
            ("kvscope_runs", "SELECT run_id, label, CAST(settings AS VARCHAR) AS settings, "
                             "started_at, ended_at FROM kvscope_runs"),
        ]
        for table, sql in sources:
            copied[table] = 0
            reader = con.sql(sql).to_arrow_reader(batch_rows)
            for batch in reader or ():
                if batch.num_rows:
                    engine.insert_arrow(table, pa.Table.from_batches([batch]))
                    copied[table] += batch.num_rows
    finally:
        con.close()
    return copied
