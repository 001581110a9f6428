"""The DuckDB store: schema (mirroring the OpenTelemetry Collector's ClickHouse tables), writer,
migrations; and reading it, or the Collector's ClickHouse tables, through one Reader protocol
(``open_reader``).

The names below load their module on first use (PEP 562), so ``kvscope.store.version`` (what
``kvscope version`` prints) imports neither DuckDB nor Arrow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.lazy import lazy_names

if TYPE_CHECKING:
    from kvscope.store.database import (
        begin_run,
        end_run,
        open_readonly,
        open_store,
        table_counts,
    )
    from kvscope.store.duckdb_reader import DuckDBReader
    from kvscope.store.reader import Reader
    from kvscope.store.rows import GaugeRows, TraceRows
    from kvscope.store.source import Source, open_reader
    from kvscope.store.version import SCHEMA_VERSION
    from kvscope.store.writer import StoreWriter, WriterStats, insert_arrow

_MODULE_OF = {
    "SCHEMA_VERSION": "version",
    "GaugeRows": "rows",
    "DuckDBReader": "duckdb_reader",
    "Reader": "reader",
    "Source": "source",
    "StoreWriter": "writer",
    "TraceRows": "rows",
    "WriterStats": "writer",
    "begin_run": "database",
    "end_run": "database",
    "insert_arrow": "writer",
    "open_reader": "source",
    "open_readonly": "database",
    "open_store": "database",
    "table_counts": "database",
}

__all__ = [
    "SCHEMA_VERSION",
    "DuckDBReader",
    "GaugeRows",
    "Reader",
    "Source",
    "StoreWriter",
    "TraceRows",
    "WriterStats",
    "begin_run",
    "end_run",
    "insert_arrow",
    "open_reader",
    "open_readonly",
    "open_store",
    "table_counts",
]


__getattr__ = lazy_names(
    __name__, {name: f"{__name__}.{module}" for name, module in _MODULE_OF.items()}, globals())
