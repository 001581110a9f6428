"""The DuckDB store: schema (mirroring the OpenTelemetry Collector's ClickHouse tables), writer,
reader, migrations."""

from __future__ import annotations

from kvscope.store.database import begin_run, end_run, open_readonly, open_store, table_counts
from kvscope.store.reader import StoreReader
from kvscope.store.rows import GaugeRows, TraceRows
from kvscope.store.schema import SCHEMA_VERSION
from kvscope.store.writer import StoreWriter, WriterStats, insert_arrow

__all__ = [
    "SCHEMA_VERSION",
    "GaugeRows",
    "StoreReader",
    "StoreWriter",
    "TraceRows",
    "WriterStats",
    "begin_run",
    "end_run",
    "insert_arrow",
    "open_readonly",
    "open_store",
    "table_counts",
]
