"""The OpenTelemetry Collector's ClickHouse exporter tables, as kvscope's tests know them.

The column lists and table keys below are transcribed (as facts, not copied text) from the
exporter's DDL templates in open-telemetry/opentelemetry-collector-contrib,
``exporter/clickhouseexporter/internal/sqltemplates/``: ``traces_table.sql`` at commit
``f92a5763be13aeb59ecf6f8b47e31d54109191bb`` and ``metrics_gauge_table.sql`` at commit
``e3bd2d1d648f1868f50a8f2c1b68f7ce451ee6eb`` (Apache-2.0). Compression codecs and skip indexes
are left out: they change no column's name, type or meaning. :func:`render` writes the
``CREATE TABLE`` the exporter would run (no cluster, no TTL: its defaults), so the cross-engine
tests create these tables in ClickHouse's own engine (chdb).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_MAP = "Map(LowCardinality(String), String)"


@dataclass(frozen=True)
class ExporterTable:
    """One table of the exporter: its columns (name, ClickHouse type) in order, and its keys."""

    columns: tuple[tuple[str, str], ...]
    partition_by: str
    order_by: str


TRACES_DDL = ExporterTable(
    columns=(
        ("Timestamp", "DateTime64(9)"),
        ("TraceId", "String"),
        ("SpanId", "String"),
        ("ParentSpanId", "String"),
        ("TraceState", "String"),
        ("SpanName", "LowCardinality(String)"),
        ("SpanKind", "LowCardinality(String)"),
        ("ServiceName", "LowCardinality(String)"),
        ("ResourceAttributes", _MAP),
        ("ScopeName", "String"),
        ("ScopeVersion", "String"),
        ("SpanAttributes", _MAP),
        ("Duration", "UInt64"),
        ("StatusCode", "LowCardinality(String)"),
        ("StatusMessage", "String"),
        ("Events", f"Nested (Timestamp DateTime64(9), Name LowCardinality(String), "
                   f"Attributes {_MAP})"),
        ("Links", f"Nested (TraceId String, SpanId String, TraceState String, "
                  f"Attributes {_MAP})"),
    ),
    partition_by="toDate(Timestamp)",
    order_by="(ServiceName, SpanName, toDateTime(Timestamp))",
)

GAUGE_DDL = ExporterTable(
    columns=(
        ("ResourceAttributes", _MAP),
        ("ResourceSchemaUrl", "String"),
        ("ScopeName", "String"),
        ("ScopeVersion", "String"),
        ("ScopeAttributes", _MAP),
        ("ScopeDroppedAttrCount", "UInt32"),
        ("ScopeSchemaUrl", "String"),
        ("ServiceName", "LowCardinality(String)"),
        ("MetricName", "String"),
        ("MetricDescription", "String"),
        ("MetricUnit", "String"),
        ("Attributes", _MAP),
        ("StartTimeUnix", "DateTime64(9)"),
        ("TimeUnix", "DateTime64(9)"),
        ("Value", "Float64"),
        ("Flags", "UInt32"),
        ("Exemplars", f"Nested (FilteredAttributes {_MAP}, TimeUnix DateTime64(9), "
                      "Value Float64, SpanId String, TraceId String)"),
    ),
    partition_by="toDate(TimeUnix)",
    order_by="(ServiceName, MetricName, Attributes, toUnixTimestamp64Nano(TimeUnix))",
)


def _split(body: str) -> list[str]:
    """Split a field list at its top-level commas."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [" ".join(p.split()) for p in parts if p.strip()]


def columns(table: ExporterTable) -> list[tuple[str, str]]:
    """(name, ClickHouse type) per column, in order; a Nested column's type keeps its fields."""
    return list(table.columns)


def nested_fields(ch_type: str) -> list[tuple[str, str]]:
    """(name, type) of each field of a ``Nested (...)`` type."""
    inner = ch_type[ch_type.index("(") + 1:ch_type.rindex(")")]
    return [(p.partition(" ")[0], p.partition(" ")[2]) for p in _split(inner)]


def render(table: ExporterTable, database: str, name: str, engine: str = "MergeTree()") -> str:
    """The ``CREATE TABLE`` the exporter runs for ``database.name`` (no cluster, no TTL)."""
    body = ",\n    ".join(f"{column} {ch_type}" for column, ch_type in table.columns)
    return (f'CREATE TABLE IF NOT EXISTS "{database}"."{name}" (\n    {body}\n) '
            f"ENGINE = {engine}\nPARTITION BY {table.partition_by}\nORDER BY {table.order_by}\n"
            "SETTINGS index_granularity=8192, ttl_only_drop_parts = 1\n")


def load_into_chdb(duck: str, folder: str, database: str) -> dict[str, int]:
    """Create the exporter's tables in chdb (``folder``, ``database``) and copy ``duck`` in.

    Run it in a process of its own when the caller's process uses another chdb folder (chdb
    allows one per process): ``python -c`` with this module importable from the repo root.
    """
    from kvscope.store.clickhouse import ClickHouseReader, ClickHouseSource, load_store

    create_database(folder, database)
    reader = ClickHouseReader.connect(ClickHouseSource(f"chdb:{folder}", database=database))
    try:
        reader.engine.command(render(TRACES_DDL, database, "otel_traces"))
        reader.engine.command(render(GAUGE_DDL, database, "otel_metrics_gauge"))
        return load_store(duck, reader.engine)
    finally:
        reader.close()


def create_database(folder: str | Path, database: str) -> None:
    """Create ``database`` in the chdb data folder (as the exporter does with create_schema)."""
    from kvscope.store.clickhouse import ClickHouseReader, ClickHouseSource

    reader = ClickHouseReader.connect(ClickHouseSource(f"chdb:{folder}"))
    try:
        reader.engine.command(f"CREATE DATABASE IF NOT EXISTS `{database}`")
    finally:
        reader.close()
