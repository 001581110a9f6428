"""How kvscope reads a store: the :class:`Reader` protocol, and the errors every reader raises.

One reader per engine, siblings: :class:`~kvscope.store.duckdb_reader.DuckDBReader` (a DuckDB
store file, or a cursor on the writer's connection) and
:class:`~kvscope.store.clickhouse.ClickHouseReader` (the OpenTelemetry Collector's ClickHouse
tables); :func:`kvscope.store.source.open_reader` opens the one a source names. A reader runs
:class:`~kvscope.store.query.Query` objects only, each through one seam: bound parameters, a
time limit, and errors (:class:`~kvscope.errors.QueryError`) that name the query and its SQL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvscope.errors import QueryError
from kvscope.store.query import Dialect, Query

if TYPE_CHECKING:
    import polars as pl

T = TypeVar("T")
# Characters of a query's SQL an error message quotes (the text is on the error whole).
_SQL_QUOTED = 240


class Reader(Protocol):
    """Read-only queries on a store, in its engine's SQL dialect."""

    # The dialect queries are rendered in (kvscope.store.query).
    dialect: Dialect
    # Seconds one query may run (None: no limit).
    time_limit_s: float | None

    def frame(self, query: Query) -> pl.DataFrame:
        """Run ``query``; its result as a polars DataFrame."""
        ...

    def rows(self, query: Query, *,
             max_rows: int | None = None) -> tuple[list[str], list[tuple]]:
        """Run ``query``; (column names, rows). A result of more than ``max_rows`` rows is
        refused (QueryError), fetched no further where the engine allows."""
        ...

    def map_batches(self, query: Query, fn: Callable[[pl.DataFrame], T], *,
                    rows: int = 1_000_000) -> list[T]:
        """Run ``query`` and apply ``fn`` to its result in batches of about ``rows`` rows, in
        the result's order (an empty result is one empty batch)."""
        ...

    def has_table(self, name: str) -> bool:
        """Whether the store has a table (or view) called ``name``."""
        ...

    def scanner(self) -> Reader:
        """A reader of the same store for plain scans that need little of the engine's memory
        (a stored table read a column at a time), whose cache of what it read stays small;
        this reader where its engine keeps no such cache beside its results."""
        ...

    def interrupt(self) -> None:
        """Stop the query running on this reader now, from another thread (it fails with a
        QueryError); nothing when none runs."""
        ...

    def close(self) -> None:
        """Close the connection."""
        ...


def query_error(query: Query, problem: str, sql: str | None = None, *,
                kind: type[QueryError] = QueryError) -> QueryError:
    """``problem`` as a QueryError (or ``kind``) naming ``query`` (its name, or "unnamed") and
    its SQL."""
    text = query.sql if sql is None else sql
    one_line = " ".join(text.split())
    quoted = one_line if len(one_line) <= _SQL_QUOTED else one_line[:_SQL_QUOTED] + " …"
    name = query.name or "unnamed"
    return kind(f"{problem} (query {name}: {quoted})", query_name=query.name, sql=text)


__all__ = ["Reader", "query_error"]
