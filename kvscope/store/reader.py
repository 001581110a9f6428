"""Read-only access to a store through one ``execute`` seam (bound parameters, time limit)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeVar

import duckdb
import polars as pl

from kvscope import settings
from kvscope.errors import StoreError
from kvscope.store.database import open_readonly
from kvscope.store.query import DUCKDB, Dialect, Query

if TYPE_CHECKING:
    from kvscope.store.clickhouse import ClickHouseSource

T = TypeVar("T")
# What a reading command reads: a DuckDB store's path, or a ClickHouse source.
Source: TypeAlias = "str | Path | ClickHouseSource"
Params = Sequence[Any] | Mapping[str, Any] | None


def _statement(sql: str | Query, params: Params) -> tuple[str, Any]:
    """SQL text and its parameters (a list for ``?``, a dict for a :class:`Query`'s ``$name``)."""
    if isinstance(sql, Query):
        return sql.sql, dict(sql.params)
    if params is None or isinstance(params, Mapping):
        return sql, dict(params) if params else None
    return sql, list(params)


class StoreReader:
    """Queries a store opened read-only (or a cursor on the writer's connection).

    :class:`~kvscope.store.clickhouse.ClickHouseReader` is the same interface over the
    OpenTelemetry Collector's ClickHouse tables; :meth:`open` returns one for a
    :class:`~kvscope.store.clickhouse.ClickHouseSource`.
    """

    # The SQL dialect queries are rendered in (kvscope.store.query).
    dialect: Dialect = DUCKDB

    def __init__(self, con: duckdb.DuckDBPyConnection, *, time_limit_s: float | None = 60.0):
        self._con = con
        self.time_limit_s = time_limit_s

    @classmethod
    def open(cls, path: str | Path | ClickHouseSource, *,
             time_limit_s: float | None | Literal["setting"] = "setting") -> StoreReader:
        """Open the store at ``path`` read-only (or connect to a ClickHouse source).

        Each query may run ``time_limit_s`` seconds (None: no limit); by default the
        ``store_query_time_limit_s`` setting's (60 s; 0: no limit).
        """
        if time_limit_s == "setting":
            time_limit_s = float(settings.resolve("store_query_time_limit_s")) or None
        if not isinstance(path, str | Path):
            from kvscope.store.clickhouse import ClickHouseReader

            return ClickHouseReader.connect(path, time_limit_s=time_limit_s)
        return cls(open_readonly(path), time_limit_s=time_limit_s)

    def has_table(self, name: str) -> bool:
        """Whether the store has a table (or view) called ``name``."""
        _, rows = self.rows("SELECT count(*) FROM information_schema.tables "
                            "WHERE table_name = ?", [name])
        return bool(rows[0][0])

    def execute(self, sql: str | Query, params: Params = None) -> duckdb.DuckDBPyConnection:
        """Run one statement with bound parameters; interrupt it past the time limit."""
        text, bound = _statement(sql, params)
        return self._limited(lambda: self._con.execute(text, bound))

    def frame(self, sql: str | Query, params: Params = None) -> pl.DataFrame:
        """Run one query and return its result as a polars DataFrame (same limit and errors)."""
        text, bound = _statement(sql, params)
        # The relation is lazy: building its Arrow table is where the query runs, so that is
        # what the time limit and the error translation must cover.
        table = self._limited(lambda: self._con.sql(text, params=bound).to_arrow_table())
        return pl.DataFrame(table)

    def map_batches(self, sql: str | Query, fn: Callable[[pl.DataFrame], T], *,
                    rows: int = 1_000_000) -> list[T]:
        """Run one query and apply ``fn`` to its result in batches of about ``rows`` rows, in
        the result's order, so the whole result is never held at once (the ledger shapes a
        large store this way). An empty result is one empty batch."""
        text, bound = _statement(sql, None)

        def run() -> list[T]:
            stream = self._con.sql(text, params=bound).to_arrow_reader(rows)
            done = [fn(pl.DataFrame(batch)) for batch in stream]
            return done or [fn(pl.DataFrame(stream.schema.empty_table()))]
        return self._limited(run)

    def rows(self, sql: str | Query, params: Params = None, *,
             max_rows: int | None = None) -> tuple[list[str], list[tuple]]:
        """Run one query and return (column names, rows).

        ``max_rows``: refuse (StoreError) a result of more rows, fetched no further: DuckDB's
        memory limit bounds the engine, not the Python objects a large result becomes.
        """
        text, bound = _statement(sql, params)

        def run() -> tuple[list[str], list[tuple]]:
            result = self._con.execute(text, bound)
            names = [d[0] for d in result.description or []]
            if max_rows is None:
                return names, result.fetchall()
            fetched = result.fetchmany(max_rows + 1)
            if len(fetched) > max_rows:
                raise StoreError(f"the result has more than {max_rows} rows; add a LIMIT or "
                                 "aggregate in the query")
            return names, fetched
        return self._limited(run)

    def _limited(self, run: Callable[[], T]) -> T:
        """``run()`` interrupted past the time limit; DuckDB errors become StoreError (the one
        seam every query of a reader passes)."""
        timer: threading.Timer | None = None
        if self.time_limit_s:
            timer = threading.Timer(self.time_limit_s, self._con.interrupt)
            timer.daemon = True
            timer.start()
        try:
            return run()
        except duckdb.InterruptException:
            raise StoreError(f"query exceeded the {self.time_limit_s:g} s time limit") from None
        except duckdb.Error as exc:
            raise StoreError(f"query failed: {str(exc).splitlines()[0]}") from None
        finally:
            if timer is not None:
                timer.cancel()

    def interrupt(self) -> None:
        """Stop the query running on this reader now (from another thread); it fails with a
        StoreError. Nothing happens when none runs."""
        self._con.interrupt()

    def close(self) -> None:
        """Close the connection."""
        self._con.close()


__all__ = ["Params", "Source", "StoreReader"]
