"""Read-only access to a store through one ``execute`` seam (bound parameters, time limit)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from kvscope.errors import StoreError
from kvscope.store.database import open_readonly


class StoreReader:
    """Queries a store opened read-only (or a cursor on the writer's connection)."""

    def __init__(self, con: duckdb.DuckDBPyConnection, *, time_limit_s: float | None = 60.0):
        self._con = con
        self.time_limit_s = time_limit_s

    @classmethod
    def open(cls, path: str | Path, *, time_limit_s: float | None = 60.0) -> StoreReader:
        """Open the store at ``path`` read-only."""
        return cls(open_readonly(path), time_limit_s=time_limit_s)

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> duckdb.DuckDBPyConnection:
        """Run one statement with bound parameters; interrupt it past the time limit."""
        timer: threading.Timer | None = None
        if self.time_limit_s:
            timer = threading.Timer(self.time_limit_s, self._con.interrupt)
            timer.daemon = True
            timer.start()
        try:
            return self._con.execute(sql, list(params) if params else None)
        except duckdb.InterruptException:
            raise StoreError(f"query exceeded the {self.time_limit_s:g} s time limit") from None
        except duckdb.Error as exc:
            raise StoreError(f"query failed: {str(exc).splitlines()[0]}") from None
        finally:
            if timer is not None:
                timer.cancel()

    def frame(self, sql: str, params: Sequence[Any] | None = None) -> pl.DataFrame:
        """Run one query and return its result as a polars DataFrame."""
        return pl.DataFrame(self._relation(sql, params).to_arrow_table())

    def _relation(self, sql: str, params: Sequence[Any] | None) -> duckdb.DuckDBPyRelation:
        try:
            return self._con.sql(sql, params=list(params) if params else None)
        except duckdb.Error as exc:
            raise StoreError(f"query failed: {str(exc).splitlines()[0]}") from None

    def rows(self, sql: str, params: Sequence[Any] | None = None) -> tuple[list[str], list[tuple]]:
        """Run one query and return (column names, rows)."""
        result = self.execute(sql, params)
        names = [d[0] for d in result.description or []]
        return names, result.fetchall()

    def close(self) -> None:
        """Close the connection."""
        self._con.close()
