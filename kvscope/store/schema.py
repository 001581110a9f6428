"""The store's raw tables, as DuckDB DDL and as the Arrow schemas the writer appends.

``otel_traces`` and ``otel_metrics_gauge`` mirror the OpenTelemetry Collector's ClickHouse
exporter (``exporter/clickhouseexporter``): the same column names and meanings, so the analysis
SQL also runs against ClickHouse. Type mapping:

    ClickHouse                          DuckDB here
    DateTime64(9)                       TIMESTAMP_NS, UTC without a zone, as ClickHouse stores it
    Map(LowCardinality(String), String) MAP(VARCHAR, VARCHAR)
    Nested(Timestamp, Name, Attributes) LIST of STRUCT with the same field names
    UInt64 Duration (ns)                UBIGINT
    SpanKind / StatusCode strings       the exporter's (traceutil.SpanKindStr/StatusCodeStr):
                                        'SPAN_KIND_SERVER', ... /
                                        'STATUS_CODE_UNSET', 'STATUS_CODE_OK', 'STATUS_CODE_ERROR'

The column lists below are the single definition: DDL and Arrow schemas are derived from them.
"""

from __future__ import annotations

import pyarrow as pa

# The version lives in its own light module; it is named here too, beside the tables it versions.
from kvscope.store.version import SCHEMA_VERSION as SCHEMA_VERSION

# OTLP enum value -> the string the ClickHouse exporter stores.
SPAN_KIND_NAMES = {
    0: "SPAN_KIND_UNSPECIFIED",
    1: "SPAN_KIND_INTERNAL",
    2: "SPAN_KIND_SERVER",
    3: "SPAN_KIND_CLIENT",
    4: "SPAN_KIND_PRODUCER",
    5: "SPAN_KIND_CONSUMER",
}
STATUS_CODE_NAMES = {0: "STATUS_CODE_UNSET", 1: "STATUS_CODE_OK", 2: "STATUS_CODE_ERROR"}

TRACES_TABLE = "otel_traces"
GAUGE_TABLE = "otel_metrics_gauge"
META_TABLE = "kvscope_meta"
RUNS_TABLE = "kvscope_runs"

_MAP_SQL = "MAP(VARCHAR, VARCHAR)"
_MAP_ARROW = pa.map_(pa.string(), pa.string())
_TS_ARROW = pa.timestamp("ns")

_EVENT_ARROW = pa.struct(
    [("Timestamp", _TS_ARROW), ("Name", pa.string()), ("Attributes", _MAP_ARROW)]
)
_LINK_ARROW = pa.struct(
    [
        ("TraceId", pa.string()),
        ("SpanId", pa.string()),
        ("TraceState", pa.string()),
        ("Attributes", _MAP_ARROW),
    ]
)
_EXEMPLAR_ARROW = pa.struct(
    [
        ("FilteredAttributes", _MAP_ARROW),
        ("TimeUnix", _TS_ARROW),
        ("Value", pa.float64()),
        ("SpanId", pa.string()),
        ("TraceId", pa.string()),
    ]
)

_EVENT_SQL = (
    'STRUCT("Timestamp" TIMESTAMP_NS, "Name" VARCHAR, "Attributes" MAP(VARCHAR, VARCHAR))[]'
)
_LINK_SQL = (
    'STRUCT("TraceId" VARCHAR, "SpanId" VARCHAR, "TraceState" VARCHAR, '
    '"Attributes" MAP(VARCHAR, VARCHAR))[]'
)
_EXEMPLAR_SQL = (
    'STRUCT("FilteredAttributes" MAP(VARCHAR, VARCHAR), "TimeUnix" TIMESTAMP_NS, '
    '"Value" DOUBLE, "SpanId" VARCHAR, "TraceId" VARCHAR)[]'
)

# (column, DuckDB type, Arrow type)
TRACES_COLUMNS: list[tuple[str, str, pa.DataType]] = [
    ("Timestamp", "TIMESTAMP_NS", pa.timestamp("ns")),
    ("TraceId", "VARCHAR", pa.string()),
    ("SpanId", "VARCHAR", pa.string()),
    ("ParentSpanId", "VARCHAR", pa.string()),
    ("TraceState", "VARCHAR", pa.string()),
    ("SpanName", "VARCHAR", pa.string()),
    ("SpanKind", "VARCHAR", pa.string()),
    ("ServiceName", "VARCHAR", pa.string()),
    ("ResourceAttributes", _MAP_SQL, _MAP_ARROW),
    ("ScopeName", "VARCHAR", pa.string()),
    ("ScopeVersion", "VARCHAR", pa.string()),
    ("SpanAttributes", _MAP_SQL, _MAP_ARROW),
    ("Duration", "UBIGINT", pa.uint64()),
    ("StatusCode", "VARCHAR", pa.string()),
    ("StatusMessage", "VARCHAR", pa.string()),
    ("Events", _EVENT_SQL, pa.list_(_EVENT_ARROW)),
    ("Links", _LINK_SQL, pa.list_(_LINK_ARROW)),
]

GAUGE_COLUMNS: list[tuple[str, str, pa.DataType]] = [
    ("ResourceAttributes", _MAP_SQL, _MAP_ARROW),
    ("ResourceSchemaUrl", "VARCHAR", pa.string()),
    ("ScopeName", "VARCHAR", pa.string()),
    ("ScopeVersion", "VARCHAR", pa.string()),
    ("ScopeAttributes", _MAP_SQL, _MAP_ARROW),
    ("ScopeDroppedAttrCount", "UINTEGER", pa.uint32()),
    ("ScopeSchemaUrl", "VARCHAR", pa.string()),
    ("ServiceName", "VARCHAR", pa.string()),
    ("MetricName", "VARCHAR", pa.string()),
    ("MetricDescription", "VARCHAR", pa.string()),
    ("MetricUnit", "VARCHAR", pa.string()),
    ("Attributes", _MAP_SQL, _MAP_ARROW),
    ("StartTimeUnix", "TIMESTAMP_NS", pa.timestamp("ns")),
    ("TimeUnix", "TIMESTAMP_NS", pa.timestamp("ns")),
    ("Value", "DOUBLE", pa.float64()),
    ("Flags", "UINTEGER", pa.uint32()),
    ("Exemplars", _EXEMPLAR_SQL, pa.list_(_EXEMPLAR_ARROW)),
]

TRACES_ARROW = pa.schema([(name, arrow) for name, _, arrow in TRACES_COLUMNS])
GAUGE_ARROW = pa.schema([(name, arrow) for name, _, arrow in GAUGE_COLUMNS])


def quote(identifier: str) -> str:
    """Quote one SQL identifier (the only place identifiers are quoted)."""
    return '"' + identifier.replace('"', '""') + '"'


def _create_table(table: str, columns: list[tuple[str, str, pa.DataType]]) -> str:
    body = ",\n    ".join(f"{quote(name)} {sql}" for name, sql, _ in columns)
    return f"CREATE TABLE IF NOT EXISTS {quote(table)} (\n    {body}\n)"


def ddl() -> list[str]:
    """Statements that create schema version :data:`SCHEMA_VERSION` in an empty database."""
    return [
        f"CREATE TABLE IF NOT EXISTS {quote(META_TABLE)} "
        "(key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS {quote(RUNS_TABLE)} ("
        "run_id VARCHAR PRIMARY KEY, label VARCHAR NOT NULL, settings JSON NOT NULL, "
        "started_at TIMESTAMPTZ NOT NULL, ended_at TIMESTAMPTZ)",
        _create_table(TRACES_TABLE, TRACES_COLUMNS),
        _create_table(GAUGE_TABLE, GAUGE_COLUMNS),
    ]


RAW_TABLES = (TRACES_TABLE, GAUGE_TABLE)
KVSCOPE_TABLES = (META_TABLE, RUNS_TABLE, TRACES_TABLE, GAUGE_TABLE)


__all__ = ["GAUGE_ARROW", "GAUGE_COLUMNS", "GAUGE_TABLE", "KVSCOPE_TABLES", "META_TABLE",
    "RAW_TABLES", "RUNS_TABLE", "SPAN_KIND_NAMES", "STATUS_CODE_NAMES", "TRACES_ARROW",
    "TRACES_COLUMNS", "TRACES_TABLE", "ddl", "quote"]
