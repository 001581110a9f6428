"""The DuckDB store's raw tables against the OpenTelemetry Collector's ClickHouse exporter DDL.

The exporter's tables are transcribed in :mod:`tests.store.otelcol` (collector-contrib
``exporter/clickhouseexporter/internal/sqltemplates/``, commits named there). Column by column:
the same names in the same order, and each DuckDB type means what the ClickHouse type means.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.store import open_store
from kvscope.store.query import Query
from kvscope.store.schema import GAUGE_COLUMNS, GAUGE_TABLE, TRACES_COLUMNS, TRACES_TABLE
from tests.store import otelcol

_MAP = "Map(LowCardinality(String), String)"
# ClickHouse type -> the DuckDB type that means the same (strings: LowCardinality is storage).
_SCALARS = {
    "DateTime64(9)": "TIMESTAMP_NS",  # ns since the epoch, UTC, no zone in the column
    "String": "VARCHAR",
    "LowCardinality(String)": "VARCHAR",
    "UInt64": "UBIGINT",
    "UInt32": "UINTEGER",
    "Float64": "DOUBLE",
    _MAP: "MAP(VARCHAR, VARCHAR)",
}


def _duckdb_type(ch_type: str) -> str:
    if ch_type.startswith("Nested"):
        # Nested(a T, b U) is parallel arrays of one record each: a LIST of STRUCT here.
        fields = ", ".join(f'"{n}" {_duckdb_type(t)}' for n, t in otelcol.nested_fields(ch_type))
        return f"STRUCT({fields})[]"
    return _SCALARS[ch_type]


@pytest.mark.parametrize(("ddl", "ours"), [
    (otelcol.TRACES_DDL, TRACES_COLUMNS), (otelcol.GAUGE_DDL, GAUGE_COLUMNS),
], ids=["otel_traces", "otel_metrics_gauge"])
def test_declared_columns_match_the_exporter_column_by_column(ddl: otelcol.ExporterTable,
                                                             ours: list) -> None:
    theirs = otelcol.columns(ddl)
    assert [c[0] for c in ours] == [n for n, _ in theirs]
    for (name, duck, _), (_, ch_type) in zip(ours, theirs, strict=True):
        assert duck == _duckdb_type(ch_type), name


def test_the_transcribed_tables_hold_every_exporter_column() -> None:
    """The transcription keeps all 17 columns of each table and the nested fields."""
    traces = otelcol.columns(otelcol.TRACES_DDL)
    assert len(traces) == 17 and dict(traces)["Duration"] == "UInt64"
    assert dict(traces)["SpanAttributes"] == _MAP
    assert [n for n, _ in otelcol.nested_fields(dict(traces)["Events"])] == [
        "Timestamp", "Name", "Attributes"]
    assert len(otelcol.columns(otelcol.GAUGE_DDL)) == 17


def _described(con, table: str) -> list[tuple[str, str]]:
    rows = con.execute(f'DESCRIBE "{table}"').fetchall()
    return [(r[0], r[1]) for r in rows]


@pytest.mark.parametrize(("ddl", "table"), [
    (otelcol.TRACES_DDL, TRACES_TABLE), (otelcol.GAUGE_DDL, GAUGE_TABLE),
], ids=["otel_traces", "otel_metrics_gauge"])
def test_a_created_store_has_the_exporter_columns(tmp_path: Path, ddl: otelcol.ExporterTable,
                                                  table: str) -> None:
    """What DuckDB actually created (not only what we declared) means the exporter's types."""
    con = open_store(tmp_path / "s.duckdb")
    try:
        described = _described(con, table)
    finally:
        con.close()
    theirs = otelcol.columns(ddl)
    assert [n for n, _ in described] == [n for n, _ in theirs]
    for (name, duck), (_, ch_type) in zip(described, theirs, strict=True):
        expected = _duckdb_type(ch_type).replace('"', "")
        assert duck.replace('"', "") == expected, name


def test_duration_is_nanoseconds_and_timestamps_keep_nanoseconds(tmp_path: Path) -> None:
    """``Duration`` is end − start in ns (the exporter's ``EndTimestamp - StartTimestamp``) and
    ``Timestamp``/``Events.Timestamp`` keep ns precision, as DateTime64(9) does."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvscope.collector.exporters import DuckDBSpanExporter
    from kvscope.store import StoreWriter
    from kvscope.store.source import open_reader

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "t"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    start = 1_764_000_000_123_456_789
    span = provider.get_tracer("s").start_span("x", start_time=start)
    span.add_event("e", timestamp=start + 7)
    span.end(end_time=start + 1_500_000_001)
    writer = StoreWriter.open(tmp_path / "d.duckdb")
    exporter = DuckDBSpanExporter(writer, close_writer=True)
    exporter.export(memory.get_finished_spans())
    exporter.shutdown()
    reader = open_reader(tmp_path / "d.duckdb")
    try:
        _, rows = reader.rows(Query("SELECT epoch_ns(Timestamp), Duration, "
                              "epoch_ns(Events[1].Timestamp), Events[1].Name FROM otel_traces"))
    finally:
        reader.close()
    assert rows == [(start, 1_500_000_001, start + 7, "e")]
