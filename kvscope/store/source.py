"""What a reading command reads (a DuckDB store file, or a ClickHouse source) and the reader
that reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeAlias

from kvscope import settings
from kvscope.store.clickhouse import ClickHouseReader, ClickHouseSource
from kvscope.store.duckdb_reader import DuckDBReader
from kvscope.store.reader import Reader

Source: TypeAlias = "str | Path | ClickHouseSource"


def open_reader(source: Source, *,
                time_limit_s: float | None | Literal["setting"] = "setting") -> Reader:
    """A reader of ``source``: its DuckDB file read-only, or a ClickHouse connection.

    Each query may run ``time_limit_s`` seconds (None: no limit); by default the
    ``store_query_time_limit_s`` setting's (60 s; 0: no limit).
    """
    if time_limit_s == "setting":
        time_limit_s = float(settings.resolve("store_query_time_limit_s")) or None
    if isinstance(source, ClickHouseSource):
        return ClickHouseReader.connect(source, time_limit_s=time_limit_s)
    return DuckDBReader.open(source, time_limit_s=time_limit_s)


__all__ = ["Source", "open_reader"]
