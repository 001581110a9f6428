"""In-process exporters: SDK spans and gauges → store → read back, never raising into the host."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvscope import semconv
from kvscope.collector.convert import spans_to_rows
from kvscope.collector.exporters import DuckDBSpanExporter
from kvscope.collector.otel import QueueSpanProcessor, setup_telemetry
from kvscope.store import StoreWriter, insert_arrow, open_store
from kvscope.store import writer as writer_module
from kvscope.store.query import Query
from kvscope.store.rows import TraceRows, stringify
from kvscope.store.source import open_reader

attr_values = st.one_of(
    st.text(max_size=40),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.lists(st.text(max_size=8), max_size=4),
    st.lists(st.integers(min_value=-1000, max_value=1000), max_size=4),
)
attr_dicts = st.dictionaries(st.text(min_size=1, max_size=24), attr_values, max_size=12)


def _record(attrs_per_span: list[dict]) -> list:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": semconv.SERVICE_PROXY}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(semconv.SCOPE_NAME, "1.0")
    for attrs in attrs_per_span:
        with tracer.start_as_current_span(semconv.SPAN_TURN, kind=SpanKind.SERVER) as parent:
            parent.set_attributes(attrs)
            parent.add_event(semconv.EVENT_FIRST_TOKEN, {"n": 1})
            with tracer.start_as_current_span(semconv.SPAN_INPUT_PROCESSING,
                                              kind=SpanKind.CLIENT) as child:
                child.set_status(Status(StatusCode.ERROR, "prefill 502"))
    return list(memory.get_finished_spans())


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(attr_dicts, min_size=1, max_size=5))
def test_span_attributes_round_trip(tmp_path_factory: pytest.TempPathFactory,
                                    batch: list[dict]) -> None:
    path = tmp_path_factory.mktemp("rt") / "s.duckdb"
    spans = _record(batch)
    writer = StoreWriter.open(path)
    exporter = DuckDBSpanExporter(writer, close_writer=True)
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    reader = open_reader(path)
    _, rows = reader.rows(
        Query("SELECT SpanId, SpanAttributes, ParentSpanId, SpanKind, StatusCode, StatusMessage, "
        "ServiceName, ScopeName, ScopeVersion, Duration, len(Events) FROM otel_traces")
    )
    reader.close()
    stored = {r[0]: r for r in rows}
    assert len(stored) == len(spans)
    for span in spans:
        row = stored[format(span.context.span_id, "016x")]
        expected = {k: stringify(v) for k, v in (span.attributes or {}).items()}
        assert row[1] == expected
        if span.parent is None:
            assert row[2:5] == ("", "SPAN_KIND_SERVER", "STATUS_CODE_UNSET")
            assert row[10] == 1
        else:
            assert row[2] == format(span.parent.span_id, "016x")
            assert row[3:6] == ("SPAN_KIND_CLIENT", "STATUS_CODE_ERROR", "prefill 502")
        assert row[6:9] == (semconv.SERVICE_PROXY, semconv.SCOPE_NAME, "1.0")
        assert row[9] == span.end_time - span.start_time


def test_stringify_matches_the_collectors_encoding() -> None:
    assert [stringify(v) for v in (True, 3, 1.5, "x", [1, 2], ("a",))] == [
        "true", "3", "1.5", "x", "[1,2]", '["a"]']


def _rows(n: int) -> pa.Table:
    rows = TraceRows()
    for i in range(n):
        rows.add(timestamp_ns=i, trace_id="0" * 32, span_id=f"{i:016x}", parent_span_id="",
                 trace_state="", span_name="s", span_kind="SPAN_KIND_INTERNAL", service_name="t",
                 resource_attributes=[], scope_name="", scope_version="", span_attributes=[],
                 duration_ns=1, status_code="STATUS_CODE_UNSET", status_message="", events=[],
                 links=[])
    return rows.to_arrow()


def test_writer_drops_and_counts_when_its_queue_is_full(store_path: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()

    def gated_insert(con, table, rows):  # type: ignore[no-untyped-def]
        entered.set()
        gate.wait(10)
        insert_arrow(con, table, rows)

    writer = StoreWriter(open_store(store_path), max_queue_rows=10, insert=gated_insert)
    table = _rows(4)
    assert writer.submit_traces(table)
    assert entered.wait(10)  # the writer thread holds this batch; the queue is empty again
    accepted = [writer.submit_traces(table) for _ in range(5)]
    assert accepted == [True, True, False, False, False]
    assert writer.stats.dropped_rows == 12
    gate.set()
    assert writer.flush(10)
    writer.close()
    reader = open_reader(store_path)
    assert reader.rows(Query("SELECT count(*) FROM otel_traces"))[1] == [(12,)]
    reader.close()


def test_concurrent_submitters_all_land(store_path: Path) -> None:
    writer = StoreWriter.open(store_path)
    table = _rows(50)
    threads = [threading.Thread(target=lambda: [writer.submit_traces(table) for _ in range(20)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert writer.flush(30)
    assert (writer.stats.written_rows, writer.stats.dropped_rows) == (4000, 0)
    writer.close()


def test_exporter_never_raises_into_the_host(store_path: Path) -> None:
    writer = StoreWriter.open(store_path)
    exporter = DuckDBSpanExporter(writer)
    spans = _record([{"a": 1}])
    writer.close()  # the store is gone: submits are refused
    assert exporter.export(spans) is SpanExportResult.FAILURE

    class Broken:
        def submit_traces(self, table: pa.Table) -> bool:
            raise RuntimeError("disk on fire")

    broken = DuckDBSpanExporter(Broken())  # type: ignore[arg-type]
    assert broken.export(spans) is SpanExportResult.FAILURE
    assert broken.failed == len(spans)


def test_processor_queue_is_bounded_and_counts_drops() -> None:
    release = threading.Event()

    class Slow(InMemorySpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            release.wait(10)
            return super().export(spans)

    slow = Slow()
    processor = QueueSpanProcessor(slow, max_queue_size=5, max_batch_size=1, schedule_delay_s=0.01)
    spans = _record([{"i": i} for i in range(10)])
    for span in spans:
        processor.on_end(span)
    # At most one batch of one span is in the exporter; the rest beyond 5 are dropped.
    assert processor.stats.dropped >= len(spans) - 6
    assert processor.stats.queued + processor.stats.dropped == len(spans)
    release.set()
    assert processor.force_flush(10_000)
    assert len(slow.get_finished_spans()) == processor.stats.queued
    processor.shutdown()


def test_setup_telemetry_writes_spans_and_gauges(store_path: Path) -> None:
    telemetry = setup_telemetry(semconv.SERVICE_DECODE, db=str(store_path), run_id="run-1")
    tracer = telemetry.tracer()
    with tracer.start_as_current_span(semconv.SPAN_KV_RETENTION) as span:
        span.set_attribute(semconv.RETENTION_BLOCKS, 12)
    gauge = telemetry.meter().create_gauge(semconv.METRIC_KV_RETAINED, unit="By")
    gauge.set(4096, {semconv.ENGINE_ID: "decode-0"})
    assert telemetry.flush(10)
    telemetry.shutdown()
    reader = open_reader(store_path)
    _, spans = reader.rows(
        Query("SELECT SpanName, ServiceName, ResourceAttributes[?], SpanAttributes[?] FROM "
              "otel_traces",
              positional=(semconv.RUN_ID, semconv.RETENTION_BLOCKS)))
    assert spans == [(semconv.SPAN_KV_RETENTION, semconv.SERVICE_DECODE, "run-1", "12")]
    _, points = reader.rows(
        Query("SELECT DISTINCT MetricName, MetricUnit, Value, Attributes[?] FROM "
              "otel_metrics_gauge",
              positional=(semconv.ENGINE_ID,)))
    assert points == [(semconv.METRIC_KV_RETAINED, "By", 4096.0, "decode-0")]
    reader.close()


def test_the_parquet_route_stores_what_the_arrow_scan_stores(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    spans = _record([{semconv.X_REQUEST_ID: f"r{i}", semconv.TURN_INDEX: i, "k.f": i / 3,
                      "k.b": i % 2 == 0, "k.list": [i, i + 1]} for i in range(600)])
    table = spans_to_rows(spans).to_arrow()
    assert table.num_rows >= writer_module.PARQUET_MIN_ROWS  # the Parquet route

    def stored(path: Path, insert: Callable[..., None]) -> list[tuple[object, ...]]:
        con = open_store(path)
        insert(con, "otel_traces", table)
        rows = con.execute("SELECT * FROM otel_traces ORDER BY SpanId").fetchall()
        con.close()
        return rows

    spills: list[str] = []
    real_spill = writer_module._spill
    monkeypatch.setattr(writer_module, "_spill",
                        lambda rows, folder: spills.append(str(folder)) or real_spill(rows, folder))
    parquet = stored(tmp_path / "parquet.duckdb", insert_arrow)
    # The file route really ran, in the folder beside the store, and left nothing there.
    assert spills == [str(tmp_path / "parquet.duckdb.kvscope-tmp")]
    assert parquet == stored(tmp_path / "scan.duckdb", writer_module.insert_arrow_scan)
    assert len(parquet) == len(spans)
    assert not list((tmp_path / "parquet.duckdb.kvscope-tmp").iterdir())  # cleaned up


def test_an_unwritable_batch_folder_falls_back_to_the_arrow_scan(tmp_path: Path) -> None:
    path = tmp_path / "fallback.duckdb"
    con = open_store(path)
    (tmp_path / "fallback.duckdb.kvscope-tmp").write_text("a file where the folder would be")
    table = _rows(writer_module.PARQUET_MIN_ROWS + 10)
    insert_arrow(con, "otel_traces", table)  # no folder, no file: no raise, the scan inserts
    assert con.execute("SELECT count(*) FROM otel_traces").fetchone() == (table.num_rows,)
    con.close()


def test_a_writer_leaves_no_batch_folder_beside_its_store(tmp_path: Path) -> None:
    writer = StoreWriter.open(tmp_path / "tidy.duckdb")
    assert writer.submit_traces(_rows(writer_module.PARQUET_MIN_ROWS * 2))
    assert writer.flush(10)
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tidy.duckdb"]
