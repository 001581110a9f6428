"""The :class:`~kvscope.store.reader.Reader` over a DuckDB store (read-only), or over a cursor
on the writer's connection."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import polars as pl

from kvscope.errors import QueryOutOfMemory
from kvscope.store.database import open_readonly, open_scanner
from kvscope.store.query import DUCKDB, Dialect, Query
from kvscope.store.reader import query_error

T = TypeVar("T")

# What execute's Arrow output says of its copy of the rows: known, and taken only for results
# known to be small (DuckDBReader's small_results).
warnings.filterwarnings("ignore", message="Arrow output on a DB-API result", category=UserWarning,
                        module=__name__.replace(".", r"\."))


def _statement(query: Query) -> tuple[str, Any]:
    """SQL text and its bindings: a list for ``?`` placeholders, else a dict for ``$name``."""
    if query.positional:
        return query.sql, list(query.positional)
    return query.sql, dict(query.params) if query.params else None


class DuckDBReader:
    """Queries a DuckDB store opened read-only (or a cursor on the writer's connection)."""

    dialect: Dialect = DUCKDB

    def __init__(self, con: duckdb.DuckDBPyConnection, *, time_limit_s: float | None = 60.0,
                 path: str | Path | None = None, small_results: bool = False):
        self._con = con
        self.time_limit_s = time_limit_s
        # Results known to be small (the live ledger's): :meth:`frame` runs a statement once,
        # through ``execute``. A relation binds it twice (to describe it, then to run it): 15-35
        # ms of the ledger's per-turn SQL over a refresh's frames, whose rows cost less. But it
        # streams a large result into Arrow, where ``execute`` holds the rows and copies them.
        self.small_results = small_results
        self._path = path  # the store file this reader opened (None: a cursor on another's)
        self._scanner: DuckDBReader | None = None

    @classmethod
    def open(cls, path: str | Path, *, time_limit_s: float | None = 60.0) -> DuckDBReader:
        """The store at ``path``, read-only."""
        return cls(open_readonly(path), time_limit_s=time_limit_s, path=path)

    def cursor(self) -> DuckDBReader:
        """A reader on a connection of its own to the same database: its temporary tables are
        its own and go when it is closed."""
        return DuckDBReader(self._con.cursor(), time_limit_s=self.time_limit_s)

    def scanner(self) -> DuckDBReader:
        """As :meth:`Reader.scanner`: the same file in a DuckDB instance of its own under a
        small memory limit (:func:`~kvscope.store.database.open_scanner`), opened once and
        closed with this reader; this reader itself where it opened no file (a cursor on the
        writer's connection)."""
        if self._path is None:
            return self
        if self._scanner is None:
            self._scanner = DuckDBReader(open_scanner(self._path),
                                         time_limit_s=self.time_limit_s)
        return self._scanner

    def has_table(self, name: str) -> bool:
        _, rows = self.rows(Query("SELECT count(*) FROM information_schema.tables "
                                  "WHERE table_name = $name", {"name": name}, name="has_table"))
        return bool(rows[0][0])

    def execute(self, query: Query) -> duckdb.DuckDBPyConnection:
        """Run one statement (a DuckDB cursor: no ClickHouse twin, so not on :class:`Reader`)."""
        text, bound = _statement(query)
        return self._limited(query, lambda: self._con.execute(text, bound))

    def frame(self, query: Query) -> pl.DataFrame:
        text, bound = _statement(query)
        if self.small_results:
            return pl.DataFrame(self._limited(
                query, lambda: self._con.execute(text, bound).to_arrow_table()))
        # The relation is lazy: building its Arrow table is where the query runs, so that is
        # what the time limit and the error translation must cover.
        table = self._limited(query, lambda: self._con.sql(text, params=bound).to_arrow_table())
        return pl.DataFrame(table)

    def map_batches(self, query: Query, fn: Callable[[pl.DataFrame], T], *,
                    rows: int = 1_000_000) -> list[T]:
        """As :meth:`Reader.map_batches`, streamed: the whole result is never held at once (the
        ledger shapes a large store this way)."""
        text, bound = _statement(query)

        def run() -> list[T]:
            stream = self._con.sql(text, params=bound).to_arrow_reader(rows)
            done = [fn(pl.DataFrame(batch)) for batch in stream]
            return done or [fn(pl.DataFrame(stream.schema.empty_table()))]
        return self._limited(query, run)

    def rows(self, query: Query, *,
             max_rows: int | None = None) -> tuple[list[str], list[tuple]]:
        """As :meth:`Reader.rows`: DuckDB's memory limit bounds the engine, not the Python
        objects a large result becomes, so ``max_rows`` stops the fetch at one row more."""
        text, bound = _statement(query)

        def run() -> tuple[list[str], list[tuple]]:
            result = self._con.execute(text, bound)
            names = [d[0] for d in result.description or []]
            if max_rows is None:
                return names, result.fetchall()
            fetched = result.fetchmany(max_rows + 1)
            if len(fetched) > max_rows:
                raise query_error(query, f"the result has more than {max_rows} rows; add a "
                                  "LIMIT or aggregate in the query")
            return names, fetched
        return self._limited(query, run)

    def _limited(self, query: Query, run: Callable[[], T]) -> T:
        """``run()`` interrupted past the time limit; DuckDB errors become QueryError naming
        ``query`` (the one seam every query of a reader passes)."""
        timer: threading.Timer | None = None
        if self.time_limit_s:
            timer = threading.Timer(self.time_limit_s, self._con.interrupt)
            timer.daemon = True
            timer.start()
        try:
            return run()
        except duckdb.InterruptException:
            raise query_error(
                query, f"query exceeded the {self.time_limit_s:g} s time limit") from None
        except duckdb.OutOfMemoryException as exc:
            raise query_error(query, f"query failed: {str(exc).splitlines()[0]}",
                              kind=QueryOutOfMemory) from None
        except duckdb.Error as exc:
            raise query_error(query, f"query failed: {str(exc).splitlines()[0]}") from None
        finally:
            if timer is not None:
                timer.cancel()

    def interrupt(self) -> None:
        self._con.interrupt()

    def close(self) -> None:
        if self._scanner is not None:
            self._scanner.close()
            self._scanner = None
        self._con.close()


__all__ = ["DuckDBReader"]
