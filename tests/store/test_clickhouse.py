"""The ledger and every registered analysis on ClickHouse (chdb, the real engine in-process)
against the same spans in a DuckDB store: identical results, one set of query definitions.

The ClickHouse tables are created with the OpenTelemetry Collector exporter's own DDL
(:mod:`tests.store.otelcol`), and filled from a simulator store with every fault switched on, plus a
feature-OFF run of the same workload (the pair ``compare`` needs).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from kvscope import semconv
from kvscope.analysis import registry
from kvscope.analysis.ledger import LEDGER_TABLE, load_spans
from kvscope.analysis.registry import AnalysisContext
from kvscope.analysis.runs import RUNS_FROM_SPANS, all_runs
from kvscope.emulator.simulator import SIM_FAULTS, SimulationSettings, simulate
from kvscope.errors import StoreError
from kvscope.reuse import outcomes
from kvscope.store.clickhouse import ClickHouseReader, ClickHouseSource, load_store
from kvscope.store.query import Query
from kvscope.store.source import open_reader
from tests.store import otelcol
from tests.store.chdb_http import ChdbHttp
from tests.stores import busy_workload

DATABASE = "kvscope_xengine"
# Float results may differ in the last digits only (summation order).
FLOAT_REL_TOL = 1e-12


def create_exporter_tables(reader: ClickHouseReader, database: str) -> None:
    """``otel_traces`` and ``otel_metrics_gauge`` exactly as the exporter creates them."""
    reader.engine.command(otelcol.render(otelcol.TRACES_DDL, database, "otel_traces"))
    reader.engine.command(otelcol.render(otelcol.GAUGE_DDL, database, "otel_metrics_gauge"))


@pytest.fixture(scope="module")
def duck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("xengine") / "sim.duckdb"
    workload = busy_workload(turns_p50=7, max_turns=10)
    every_fault = dict.fromkeys(SIM_FAULTS, 0.08)
    simulate(workload, db, SimulationSettings(
        profile="tiny", label="faults ON", seed=17, faults=every_fault,
        decoder_kv_blocks_ttl=20.0, kv_load_failure_policy="recompute"))
    simulate(workload, db, SimulationSettings(
        profile="tiny", label="OFF", seed=17, prefill_bidirectional_kv_xfer=False,
        decode_bidirectional_kv_xfer=False))
    return db


@pytest.fixture(scope="module")
def source(duck: Path, chdb_folder: Path) -> ClickHouseSource:
    otelcol.create_database(chdb_folder, DATABASE)
    src = ClickHouseSource(f"chdb:{chdb_folder}", database=DATABASE)
    reader = ClickHouseReader.connect(src)
    try:
        create_exporter_tables(reader, DATABASE)
        copied = load_store(duck, reader.engine)
    finally:
        reader.close()
    assert copied["otel_traces"] > 0 and copied["kvscope_runs"] == 2
    return src


@pytest.fixture(scope="module")
def http_source(source: ClickHouseSource, chdb_folder: Path) -> Iterator[ClickHouseSource]:
    """The same database through ClickHouse's HTTP interface (clickhouse-connect's path), served
    by an adapter over the same chdb engine (tests/store/chdb_http.py says what it leaves out)."""
    server = ChdbHttp(chdb_folder).start()
    try:
        yield ClickHouseSource(server.url, database=DATABASE, user="default")
    finally:
        server.stop()


@pytest.fixture(params=["chdb", "clickhouse-connect"])
def both(request: pytest.FixtureRequest,
         duck: Path) -> Iterator[tuple[AnalysisContext, AnalysisContext]]:
    """(DuckDB, ClickHouse) contexts: ClickHouse in-process (chdb) or over HTTP."""
    source = request.getfixturevalue("source" if request.param == "chdb" else "http_source")
    with AnalysisContext(open_reader(duck)) as d, AnalysisContext(
            open_reader(source)) as c:
        assert isinstance(c.reader, ClickHouseReader)
        yield d, c


def test_the_extracted_span_rows_are_identical(duck: Path, source: ClickHouseSource) -> None:
    """Row for row (sorted: neither engine promises an order), nulls where attributes are absent
    (ClickHouse's map look-up would give '' without the dialect)."""
    d, c = open_reader(duck), open_reader(source)
    try:
        on_duck, on_click = load_spans(d), load_spans(c)
    finally:
        d.close()
        c.close()
    for name, frame in on_duck.items():
        other = on_click[name]
        # Every span kind is in the store but vLLM's own llm_request (the simulator has none).
        assert frame.height > 0 or name == "vllm_requests", name
        assert_frame_equal(frame.sort(frame.columns, nulls_last=True),
                           other.sort(other.columns, nulls_last=True), check_dtypes=True)
    assert on_duck["turns"]["conversation_id"].null_count() > 0  # the no_conversation_id fault


def test_the_ledgers_are_identical(both: tuple[AnalysisContext, AnalysisContext]) -> None:
    d, c = both
    ledger = d.ledger()
    assert_frame_equal(ledger, c.ledger(), check_exact=True)
    # The store is a hard case: many outcomes, miss causes included (a test on easy data could
    # not tell a broken dialect from a working one).
    seen = set(ledger["outcome"].unique())
    assert {outcomes.FIRST_TURN, outcomes.REUSED_REMOTE, outcomes.NO_CONVERSATION_ID} <= seen
    assert len(seen) >= 8, seen


def test_the_engine_sends_back_one_row_per_turn(
        both: tuple[AnalysisContext, AnalysisContext],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger's joins run in each engine: what comes back is one row per turn span, the
    same on both; the span rows themselves never leave the engine on the ledger's path."""
    d, c = both
    from kvscope.analysis import ledger as ledger_module
    from kvscope.analysis.ledger_units import categorical

    def no_extraction(reader: object) -> None:
        raise AssertionError("the ledger read span rows back instead of per-turn rows")

    monkeypatch.setattr(ledger_module, "load_spans", no_extraction)
    _, counted = d.reader.rows(Query("SELECT count(*) FROM otel_traces WHERE SpanName = $name",
                                     {"name": semconv.SPAN_TURN}))
    on_duck, on_click = ledger_module.turn_rows(d.reader), ledger_module.turn_rows(c.reader)
    assert on_duck.height == on_click.height == counted[0][0]
    keys = ["trace_id", "span_id"]
    assert_frame_equal(on_duck.sort(keys), on_click.sort(keys), check_exact=True)
    # The unmatched sides of the LEFT JOINs read as NULL on ClickHouse too (join_use_nulls):
    # turns with no conversation id have no previous turn, first turns no read.
    assert on_click["prev_index"].null_count() > 0 and on_click["d2p_status"].null_count() > 0
    assert_frame_equal(ledger_module.finish(ledger_module.shape(on_click)),
                       ledger_module.finish(ledger_module.shape(on_duck)), check_exact=True)
    # Shaped a batch at a time (as a large store is), in the engine's order: the same ledger.
    whole = d.ledger()
    for reader in (d.reader, c.reader):
        parts = reader.map_batches(ledger_module.TURN_QUERY, ledger_module.shape, rows=97)
        assert len(parts) > 1
        assert_frame_equal(categorical(ledger_module.finish(pl.concat(parts))),
                           whole, check_exact=True)


@pytest.mark.parametrize("name", list(registry.analyses()))
def test_every_registered_analysis_gives_the_same_table(
        both: tuple[AnalysisContext, AnalysisContext], name: str) -> None:
    d, c = both
    # The store has both runs of a pair, so every analysis runs (none refuses the store).
    expected = registry.run(d, name)
    got = registry.run(c, name)
    # Every analysis has rows on this store but the published sweep's (it needs a sweep run)
    # and the reconciliation's (it needs vLLM's own counters, ingested from /metrics).
    assert expected.height > 0 or name in ("published_sweep", "reconciliation"), name
    # Exact, but for float sums: their last digits follow the order rows come in, which
    # neither engine promises (the ledger itself is exact, see above).
    assert_frame_equal(expected, got, rel_tol=FLOAT_REL_TOL, abs_tol=0.0)


def test_runs_come_from_the_spans_where_no_run_table_was_written(
        duck: Path, chdb_folder: Path) -> None:
    """The Collector writes no ``kvscope_runs``: the run ids the spans' resources carry are the
    runs, and the ledger is still identical."""
    otelcol.create_database(chdb_folder, "kvscope_collector_only")
    src = ClickHouseSource(f"chdb:{chdb_folder}", database="kvscope_collector_only")
    reader = ClickHouseReader.connect(src)
    try:
        create_exporter_tables(reader, src.database)
        load_store(duck, reader.engine)
        reader.engine.command("DROP TABLE kvscope_runs")
        assert not reader.has_table("kvscope_runs")
        with AnalysisContext(reader) as ctx, AnalysisContext(open_reader(duck)) as dctx:
            runs = all_runs(ctx)
            assert sorted(runs["run_id"]) == sorted(all_runs(dctx)["run_id"])
            assert runs["label"].to_list() == runs["run_id"].to_list()
            assert_frame_equal(ctx.ledger(), dctx.ledger())
        duck_reader = open_reader(duck)
        try:  # the same portable query on DuckDB names the same runs
            assert sorted(duck_reader.frame(RUNS_FROM_SPANS)["run_id"]) == sorted(runs["run_id"])
        finally:
            duck_reader.close()
    finally:
        reader.close()


def test_the_ledger_is_written_back_as_a_clickhouse_table(
        both: tuple[AnalysisContext, AnalysisContext]) -> None:
    _, c = both
    assert isinstance(c.reader, ClickHouseReader)
    ledger = c.ledger()
    assert c.reader.write_table(LEDGER_TABLE, ledger) == ledger.height
    c.reader.write_table(LEDGER_TABLE, ledger)  # replacing keeps one copy
    # Stored as strings; analyses read the vocabularies as Categoricals.
    from kvscope.analysis.ledger_units import categorical

    stored = categorical(c.reader.frame(Query(f"SELECT * FROM {LEDGER_TABLE}")))
    key = ["run_id", "conversation_id", "turn_index", "arrival"]
    assert_frame_equal(stored.sort(key, nulls_last=True), ledger.sort(key, nulls_last=True))


def test_clickhouse_errors_are_one_line_store_errors(source: ClickHouseSource) -> None:
    reader = ClickHouseReader.connect(source, time_limit_s=0.5)
    try:
        with pytest.raises(StoreError, match=r"query failed on chdb:.*UNKNOWN_TABLE|no_such"):
            reader.frame(Query("SELECT * FROM no_such_table"))
        with pytest.raises(StoreError, match="exceeded the 0.5 s time limit"):
            reader.frame(Query("SELECT count() FROM numbers(100000000000)"))
        with pytest.raises(StoreError, match="positional"):
            reader.rows(Query("SELECT ? AS x", positional=(1,)))
        assert reader.rows(Query("SELECT {x:Int64} + 1 AS y", {"x": 41})) == (["y"], [(42,)])
    finally:
        reader.close()


def test_a_missing_database_is_refused_and_not_created(chdb_folder: Path) -> None:
    with pytest.raises(StoreError, match="cannot connect to chdb:.*no_such_db.*UNKNOWN_DATABASE"):
        ClickHouseReader.connect(ClickHouseSource(f"chdb:{chdb_folder}", database="no_such_db"))
    reader = ClickHouseReader.connect(ClickHouseSource(f"chdb:{chdb_folder}"))
    try:
        assert reader.frame(Query("SELECT count() AS n FROM system.databases "
                            "WHERE name = 'no_such_db'"))["n"][0] == 0
    finally:
        reader.close()
