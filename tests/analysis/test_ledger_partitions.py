"""A large store's ledger, built a range of its conversations at a time, equals the one
statement's, in its order (analysis/ledger.py, ``partitions``).

The store holds what crosses partitions: a faulted run (clients without conversation ids,
stripped metadata, failed transfers and handshakes, preemptions, so retentions offered to
later turns), a plain run, and an engine-only run (engine spans with no turn span, as a router
that writes none leaves) whose requests' keys the plain run's turns also name, and whose
engines said hooks were missing on a few spans only (the run's value is their largest).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from kvscope import semconv
from kvscope.analysis import ledger as ledger_module
from kvscope.analysis import ledger_units
from kvscope.analysis.ledger import ledger
from kvscope.emulator.simulator import SimulationSettings, simulate
from kvscope.errors import QueryOutOfMemory
from kvscope.store.clickhouse import ClickHouseReader, ClickHouseSource, load_store
from kvscope.store.database import open_store
from kvscope.store.duckdb_reader import DuckDBReader
from kvscope.store.schema import TRACES_TABLE
from tests.store import otelcol
from tests.store.chdb_http import ChdbHttp
from tests.stores import busy_workload, simulate_faults

_ORDER = ["run_id", "conversation_id", "turn_index", "arrival", "x_request_id", "observer"]
_ENGINE_SPANS = (semconv.SPAN_REUSE_DECISION, semconv.SPAN_KV_TRANSFER,
                 semconv.SPAN_KV_RETENTION, semconv.SPAN_VLLM_REQUEST)
# Sorts before every hex run id: a request of this run with spans of another run too is that
# other run's by max() unless the other is excluded as a run with turns (in any partition).
ENGINE_ONLY = "0-engine-only-run"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("partitions") / "store.duckdb"
    workload = busy_workload(turns_p50=5, max_turns=8)
    simulate_faults(workload, db)
    simulate(workload, db, SimulationSettings(profile="tiny", label="plain", seed=3))
    con = open_store(db)
    try:
        _retentions_named_apart(con)
        _an_engine_only_copy(con)
        # One span of the faulted run says a hook was missing: the run's value, on all its turns
        # (whichever partition they are in).
        con.execute(
            f"UPDATE {TRACES_TABLE} SET \"ResourceAttributes\" = map_concat("
            "\"ResourceAttributes\", MAP {$hooks: 'update_state_after_alloc'}) "
            f"WHERE \"SpanId\" = (SELECT max(\"SpanId\") FROM {TRACES_TABLE} "
            "WHERE \"SpanName\" = $span AND \"ResourceAttributes\"[$run_key] = "
            "(SELECT run_id FROM kvscope_runs WHERE label = 'faults'))",
            {"hooks": semconv.HOOKS_MISSING, "span": semconv.SPAN_KV_TRANSFER,
             "run_key": semconv.RUN_ID})
    finally:
        con.close()
    return db


def _retentions_named_apart(con: duckdb.DuckDBPyConnection) -> None:
    """Decode's request ids, as its legs and retentions say them, no longer reduce to the turn's
    X-Request-Id (a router whose ids do not embed it): a retention joins its turns only through
    the legs that name it (offered to turn k, left by turn k-1)."""
    renamed = {semconv.SPAN_KV_RETENTION: semconv.VLLM_REQUEST_ID,
               semconv.SPAN_GENERATION: semconv.VLLM_REQUEST_ID,
               semconv.SPAN_INPUT_PROCESSING: semconv.OFFERED_REQUEST_ID}
    for span, key in renamed.items():
        con.execute(
            f"UPDATE {TRACES_TABLE} SET \"SpanAttributes\" = map_concat(\"SpanAttributes\", "
            "MAP {$key: 'held-' || \"SpanAttributes\"[$key]}) "
            "WHERE \"SpanName\" = $span AND \"SpanAttributes\"[$key] IS NOT NULL",
            {"key": key, "span": span})


def _an_engine_only_copy(con: duckdb.DuckDBPyConnection) -> None:
    """The plain run's engine spans again, as another run's without turn spans (new span ids).
    Half the requests renamed (no turn names them: each makes an engine row), half keep their
    ids (the plain run's turns name them, and its legs its retentions'). One span says a hook
    was missing, a few others a shorter list: the run's value is the largest, on every row."""
    plain = con.execute("SELECT run_id FROM kvscope_runs WHERE label = 'plain'").fetchone()
    assert plain is not None
    names = ", ".join(f"'{name}'" for name in _ENGINE_SPANS)
    key = (f"CASE WHEN \"SpanName\" = '{semconv.SPAN_VLLM_REQUEST}' THEN $gen_ai_id "
           "ELSE $request_id END")
    request = f"\"SpanAttributes\"[{key}]"
    first = (f"(SELECT min(\"SpanId\") FROM {TRACES_TABLE} WHERE \"SpanName\" = "
             f"'{semconv.SPAN_REUSE_DECISION}' AND \"ResourceAttributes\"[$run_key] = $plain)")
    con.execute(
        f"INSERT INTO {TRACES_TABLE} SELECT * REPLACE ("
        "md5(\"SpanId\") AS \"SpanId\", "
        f"map_concat(\"SpanAttributes\", CASE WHEN hash({request}) % 2 = 0 "
        f"THEN MAP {{{key}: 'renamed-' || {request}}} "
        "ELSE MAP {}::MAP(VARCHAR, VARCHAR) END) AS \"SpanAttributes\", "
        "map_concat(\"ResourceAttributes\", CASE "
        f"WHEN \"SpanId\" = {first} THEN MAP {{$run_key: $run, $hooks: 'start_load_kv'}} "
        "WHEN hash(\"SpanId\") % 7 = 0 THEN MAP {$run_key: $run, $hooks: 'read_blocks'} "
        "ELSE MAP {$run_key: $run} END) AS \"ResourceAttributes\") "
        f"FROM {TRACES_TABLE} WHERE \"SpanName\" IN ({names}) "
        "AND \"ResourceAttributes\"[$run_key] = $plain",
        {"run_key": semconv.RUN_ID, "run": ENGINE_ONLY, "hooks": semconv.HOOKS_MISSING,
         "plain": plain[0], "gen_ai_id": semconv.VLLM_GEN_AI_REQUEST_ID,
         "request_id": semconv.VLLM_REQUEST_ID})


def _sorted(frame: pl.DataFrame, order: list[str]) -> pl.DataFrame:
    return frame.sort(order, nulls_last=False)


@pytest.fixture(scope="module")
def rows(store: Path) -> pl.DataFrame:
    """The one statement's per-turn rows (before shaping: every joined column)."""
    reader = DuckDBReader.open(store, time_limit_s=None)
    try:
        return ledger_module.turn_rows(reader)
    finally:
        reader.close()


def test_the_store_crosses_partitions(rows: pl.DataFrame) -> None:
    """What the equality below must survive is in the store (or the test proves little)."""
    engine_only = rows.filter(pl.col("run_id") == ENGINE_ONLY)
    assert engine_only.height > 0
    assert set(engine_only["observer"].to_list()) == {semconv.OBSERVER_ENGINE}
    # The run's largest list on every row, though only some of its spans carried one.
    assert set(engine_only["hooks_missing"].to_list()) == {"start_load_kv"}
    faulted = rows.filter((pl.col("run_id") != ENGINE_ONLY)
                          & pl.col("hooks_missing").is_not_null())
    assert set(faulted["hooks_missing"].to_list()) == {"update_state_after_alloc"}
    assert faulted.height == rows.filter(pl.col("run_id") == faulted["run_id"][0]).height
    assert rows.filter(pl.col("conversation_id").is_null()
                       & (pl.col("run_id") != ENGINE_ONLY)).height > 0
    # Retentions offered to turn k (turn k-1's decode left them) and the one k's decode left.
    assert rows["retention_bytes"].drop_nulls().len() > 0
    assert rows["held_tokens"].drop_nulls().len() > 0
    assert rows.filter(pl.col("retention_id").str.starts_with("held-")
                       & pl.col("retention_bytes").is_not_null()).height > 0
    assert {"first", "continues", "edited"} <= set(rows["history"].to_list())


@pytest.mark.parametrize("count", [2, 3, 7])
@pytest.mark.parametrize("sort_turns", [ledger_module.SORT_TURNS, 7])
def test_partitions_give_the_one_statements_rows(store: Path, rows: pl.DataFrame,
                                                 count: int, sort_turns: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Turns staged one group of partitions at a time too (7: each partition its own group).
    monkeypatch.setattr(ledger_module, "SORT_TURNS", sort_turns)
    reader = DuckDBReader.open(store, time_limit_s=None)
    try:
        parted = pl.concat(ledger_module.partitioned_turn_rows(reader, count, lambda f: f))
    finally:
        reader.close()
    assert parted.columns == rows.columns
    order = ["run_id", "conversation_id", "turn_number", "arrival", "x_request_id", "observer"]
    assert _sorted(parted, order).equals(_sorted(rows, order))
    # One partition after the other is the one statement's order: nothing to sort after.
    assert parted.select(order[:4]).equals(rows.select(order[:4]))


def test_a_large_store_is_built_in_partitions(store: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """Above PARTITION_TURNS turn spans the default is partitions: the same ledger, in the
    one statement's order; their temporary tables go with the build."""
    reader = DuckDBReader.open(store, time_limit_s=None)
    try:
        whole = ledger(reader)
        monkeypatch.setattr(ledger_module, "PARTITION_TURNS", 50)
        assert ledger_module.partitions_for(reader) > 2
        built = ledger(reader)
        _, left = reader.rows(ledger_module.query.Query(
            "SELECT count(*) FROM duckdb_tables() WHERE temporary", name="temporary tables"))
    finally:
        reader.close()
    assert built.height == whole.height
    order = ["run_id", "conversation_id", "turn_index", "arrival", "x_request_id", "observer"]
    assert _sorted(built, order).equals(_sorted(whole, order))
    keys = ["run_id", "conversation_id", "turn_index", "arrival"]
    assert built.select(keys).equals(whole.select(keys))
    assert left == [(0,)]


def test_rows_that_run_out_of_memory_are_built_again_in_partitions(
        store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """DuckDB out of memory in the one statement (at 1M turns under a 1 GB limit, say): the
    ledger is built again in partitions, says so once, and is the same ledger."""
    reader = DuckDBReader.open(store, time_limit_s=None)
    try:
        whole = ledger(reader)
        statements: list[str] = []
        monkeypatch.setattr(DuckDBReader, "map_batches", _short_of_memory(statements))
        with caplog.at_level(logging.WARNING, logger=ledger_module.__name__):
            built = ledger(reader)
    finally:
        reader.close()
    assert statements[0] == "ledger turns"
    assert statements[1:] == [f"ledger turns, partition {i} of 4" for i in range(1, 5)]
    assert [r.getMessage() for r in caplog.records] == [
        "the ledger's per-turn rows ran out of DuckDB's memory (query failed: Out of Memory "
        "Error: could not allocate block of size 256.0 KiB); building them again in 4 "
        "partitions of the conversations"]
    assert built.equals(whole)


def test_the_reader_names_running_out_of_memory(store: Path) -> None:
    """DuckDB's own out-of-memory error comes out of a reader as QueryOutOfMemory."""
    con = open_store(store)
    try:
        con.execute("SET memory_limit = '1MB'")
        reader = DuckDBReader(con, time_limit_s=None)
        with pytest.raises(QueryOutOfMemory, match="Out of Memory Error"):
            reader.frame(ledger_module.query.Query(
                "SELECT string_agg(repeat('x', 1000), ',') FROM range(100000)", name="big"))
    finally:
        con.close()


def _short_of_memory(statements: list[str]) -> Any:
    """DuckDBReader.map_batches, but the one statement runs out of DuckDB's memory (at 1M
    turns under a 1 GB limit, say); ``statements`` collects what ran."""
    real = DuckDBReader.map_batches

    def short_of_memory(self: DuckDBReader, query: Any, fn: Any, **kw: Any) -> Any:
        statements.append(query.name)
        if query.name == ledger_module.TURN_QUERY.name:
            raise QueryOutOfMemory("query failed: Out of Memory Error: could not allocate "
                                   "block of size 256.0 KiB (query ledger turns: …)")
        return real(self, query, fn, **kw)
    return short_of_memory


@pytest.fixture(scope="module")
def whole(store: Path) -> pl.DataFrame:
    """The store's ledger, from the one statement."""
    reader = DuckDBReader.open(store, time_limit_s=None)
    try:
        return ledger(reader)
    finally:
        reader.close()


def _table(db: Path) -> pl.DataFrame:
    """The ``kvscope_ledger`` table ``kvscope ledger`` wrote, typed."""
    with duckdb.connect(str(db), read_only=True) as con:
        return pl.DataFrame(con.sql(f"SELECT * FROM {ledger_module.LEDGER_TABLE}")
                            .to_arrow_table()).cast(ledger_module.LEDGER_SCHEMA)


def _copy(store: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "store.duckdb"
    copy.write_bytes(store.read_bytes())
    return copy


def test_analysing_a_large_store_without_its_current_table_says_what_it_costs(
        store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Analyses of a store above PARTITION_TURNS without a current ledger table compute the
    ledger in the process, holding all of it: a warning says so and names `kvscope ledger`;
    none while the table is current, nor for a store one statement builds."""
    from kvscope.analysis.registry import AnalysisContext

    copy = _copy(store, tmp_path)

    def warned() -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING), AnalysisContext.open(copy) as ctx:
            assert ctx.ledger(["run_id"]).height > 0
        return [r.getMessage() for r in caplog.records if "kvscope_ledger" in r.getMessage()]

    assert warned() == []  # one statement: nothing to say
    monkeypatch.setattr(ledger_module, "PARTITION_TURNS", 50)
    (message,) = warned()
    assert "not current" in message and "`kvscope ledger`" in message
    ledger_units.update(copy, full=True)
    assert warned() == []  # read from the table


def test_kvscope_ledger_writes_a_large_store_as_it_builds_it(
        store: Path, whole: pl.DataFrame, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvscope ledger` on a store above PARTITION_TURNS writes each partition's rows to the
    table as they come (nothing of the whole ledger held), staging in a scratch database it
    removes, and marks the tainted turns from their inputs read back: the table is the ledger
    the one statement gives, tainted turns included, in its order."""
    assert whole.filter(pl.col("invalid_kind") == "tainted").height > 0
    copy = _copy(store, tmp_path)
    monkeypatch.setattr(ledger_module, "PARTITION_TURNS", 50)
    monkeypatch.setattr(ledger_module, "SORT_TURNS", 40)  # turns staged in a few groups
    monkeypatch.setattr(ledger_module, "finish", None)  # nothing may hold the whole ledger
    done = ledger_units.update(copy, full=True)
    assert done.rows == whole.height
    assert _table(copy).equals(whole)
    with duckdb.connect(str(copy), read_only=True) as con:
        tables = {name for (name,) in con.execute(
            "SELECT table_name FROM duckdb_tables()").fetchall()}
    assert ledger_module.BUILDING_TABLE not in tables
    assert not any(name.startswith("_kvscope_ledger_") for name in tables)
    assert sorted(p.name for p in tmp_path.rglob("*scratch*")) == []


def test_kvscope_ledger_out_of_memory_writes_partitions_as_it_builds(
        store: Path, whole: pl.DataFrame, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The one statement out of DuckDB's memory in `kvscope ledger`: built again in four
    partitions written as they come (not held, as the reader's ledger() holds them)."""
    copy = _copy(store, tmp_path)
    statements: list[str] = []
    monkeypatch.setattr(DuckDBReader, "map_batches", _short_of_memory(statements))
    monkeypatch.setattr(ledger_module, "finish", None)  # nothing may hold the whole ledger
    with caplog.at_level(logging.WARNING, logger=ledger_module.__name__):
        done = ledger_units.update(copy, full=True)
    assert statements == ["ledger turns"] + [
        f"ledger turns, partition {i} of 4" for i in range(1, 5)]
    assert len(caplog.records) == 1 and "building them again in 4" in caplog.records[0].message
    assert done.rows == whole.height
    assert _table(copy).equals(whole)


def test_the_written_taint_pass_links_runs_that_share_request_ids(store: Path) -> None:
    """The taint pass over a written table goes a group of runs at a time; runs that share a
    request id are one group. A copy of the faulted run under another run id, without invalid
    loads of its own, whose turns were offered the original's decode requests: one pass over
    everything (finish) taints the copy's turns through them, and so must the written pass."""
    reader = DuckDBReader.open(store, time_limit_s=None)
    try:
        shaped = ledger_module._shaped(reader, 1)
    finally:
        reader.close()
    faulted = shaped.filter(pl.col("run_id").is_in(
        shaped.filter(pl.col("invalid_kind").is_not_null())["run_id"].unique().implode()))
    copy = faulted.with_columns(pl.lit("zz-copy").alias("run_id"),
                                pl.lit(None, pl.String).alias("invalid_kind"))
    frame = pl.concat([shaped, copy])
    expected = ledger_module.finish(frame)
    assert expected.filter((pl.col("run_id") == "zz-copy")
                           & (pl.col("invalid_kind") == "tainted")).height > 0
    con = duckdb.connect()
    try:
        con.register("f", frame.select(list(ledger_module.LEDGER_SCHEMA)).to_arrow())
        con.execute("CREATE TABLE t AS SELECT * FROM f")
        con.register("f", frame.select(ledger_module._TAINT_INPUTS).with_row_index("_row")
                     .cast({"_row": pl.UInt64}).to_arrow())
        con.execute("CREATE TABLE i AS SELECT * FROM f")
        dirty = set(frame.filter(pl.col("invalid_kind").is_not_null())["run_id"].to_list())
        groups = ledger_module._linked_runs(DuckDBReader(con, time_limit_s=None), "i", dirty)
        ledger_module._mark_tainted(con, "t", "i", True)
        table = pl.DataFrame(con.sql("SELECT * FROM t").to_arrow_table())
    finally:
        con.close()
    assert any("zz-copy" in group and group & dirty for group in groups)
    assert table.cast(ledger_module.LEDGER_SCHEMA).equals(expected)


def test_the_taint_pass_groups_runs_linked_through_others() -> None:
    """A dirty run's group is every run linked to it, through runs without an invalid load too
    (a shares an X-Request-Id with b, b a decode request with c); a run linked to none is its
    own group, and a clean run linked to no dirty one is in none."""
    con = duckdb.connect()
    try:
        con.execute("CREATE TABLE i (run_id VARCHAR, x_request_id VARCHAR, "
                    "decode_request_id VARCHAR, retention_id VARCHAR)")
        con.execute("INSERT INTO i VALUES ('a', '1', 'a-d', NULL), ('b', '1', '2', NULL), "
                    "('c', 'c-x', '2', 'c-r'), ('d', 'd-x', NULL, 'd-r'), "
                    "('e', 'e-x', NULL, NULL), (NULL, 'n-x', NULL, 'c-r')")
        groups = ledger_module._linked_runs(DuckDBReader(con, time_limit_s=None), "i",
                                            {"a", "e"})
    finally:
        con.close()
    assert groups == [{"a", "b", "c", ""}, {"e"}]


def test_cli_ledger_builds_in_the_partitions_asked_for(
        store: Path, whole: pl.DataFrame, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`kvscope ledger --partitions N` writes a whole build in N ranges (less memory, more
    time); anything but 1-256 is refused with the flag named, and nothing is written."""
    from kvscope import cli

    copy = _copy(store, tmp_path)
    for bad in ("0", "257", "three"):
        with pytest.raises(SystemExit) as exited:
            cli.main(["ledger", "--partitions", bad, str(copy)])
        assert exited.value.code == 2
        assert (f"argument --partitions: '{bad}': a whole number from 1 to 256"
                in capsys.readouterr().err)
    with duckdb.connect(str(copy), read_only=True) as con:
        assert not con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ?",
                               [ledger_module.LEDGER_TABLE]).fetchall()[0][0]
    with caplog.at_level(logging.INFO, logger=ledger_module.__name__):
        assert cli.main(["ledger", "--full", "--partitions", "3", str(copy)]) == 0
    assert f"{whole.height} turns rebuilt" in capsys.readouterr().out
    assert [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("ledger partition ")][-1].startswith(
        "ledger partition 3 of 3")
    assert _table(copy).equals(whole)


# --- ClickHouse (chdb): the same store, the same partitions ----------------------------------

CHDB_DATABASE = "kvscope_partitions"


@pytest.fixture(scope="module")
def clickhouse(store: Path, chdb_folder: Path) -> Iterator[ClickHouseReader]:
    """The store's spans in the OpenTelemetry Collector exporter's ClickHouse tables."""
    otelcol.create_database(chdb_folder, CHDB_DATABASE)
    reader = ClickHouseReader.connect(
        ClickHouseSource(f"chdb:{chdb_folder}", database=CHDB_DATABASE), time_limit_s=None)
    try:
        reader.engine.command(otelcol.render(otelcol.TRACES_DDL, CHDB_DATABASE, "otel_traces"))
        reader.engine.command(otelcol.render(otelcol.GAUGE_DDL, CHDB_DATABASE,
                                             "otel_metrics_gauge"))
        load_store(store, reader.engine)
        yield reader
    finally:
        reader.close()


@pytest.fixture(scope="module")
def http_clickhouse(clickhouse: ClickHouseReader, chdb_folder: Path
                    ) -> Iterator[ClickHouseReader]:
    """The same database through ClickHouse's HTTP interface (clickhouse-connect's path)."""
    server = ChdbHttp(chdb_folder).start()
    reader = ClickHouseReader.connect(
        ClickHouseSource(server.url, database=CHDB_DATABASE, user="default"), time_limit_s=None)
    try:
        yield reader
    finally:
        reader.close()
        server.stop()


def _databases(reader: ClickHouseReader) -> list[str]:
    return reader.frame(ledger_module.query.Query(
        "SELECT name FROM system.databases ORDER BY name", name="databases"))["name"].to_list()


@pytest.mark.parametrize("count", [2, 7])
def test_clickhouse_partitions_give_its_one_statements_rows(
        clickhouse: ClickHouseReader, rows: pl.DataFrame, count: int) -> None:
    """On ClickHouse the span kinds are staged in a scratch database of MergeTree tables sorted
    by partition: the rows equal ClickHouse's one statement's, in its order, and the store's
    rows (DuckDB's one statement); the scratch database goes with the build."""
    before = _databases(clickhouse)
    one = ledger_module.turn_rows(clickhouse)
    parted = pl.concat(ledger_module.partitioned_turn_rows(clickhouse, count, lambda f: f))
    assert _databases(clickhouse) == before
    assert parted.columns == one.columns == rows.columns
    order = ["run_id", "conversation_id", "turn_number", "arrival", "x_request_id", "observer"]
    assert _sorted(parted, order).equals(_sorted(one, order))
    assert parted.select(order[:4]).equals(one.select(order[:4]))
    assert parted.height == rows.height
    assert parted.select(order[:4]).equals(rows.select(order[:4]))


def _statements_run(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the statements ClickHouse readers run from now on (in this test)."""
    statements: list[str] = []
    real = ClickHouseReader.map_batches

    def counted(self: ClickHouseReader, query: Any, fn: Any, **kw: Any) -> Any:
        statements.append(query.name)
        return real(self, query, fn, **kw)
    monkeypatch.setattr(ClickHouseReader, "map_batches", counted)
    return statements


@pytest.mark.parametrize("path", ["chdb", "clickhouse-connect"])
def test_a_large_clickhouse_store_is_built_in_partitions(
        path: str, request: pytest.FixtureRequest, whole: pl.DataFrame,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Above its threshold a ClickHouse store's ledger is built in partitions too (in process,
    or over HTTP: the staging statements' parameters bound by the server), and is the DuckDB
    store's ledger; the scratch database goes with it."""
    clickhouse = request.getfixturevalue("clickhouse" if path == "chdb" else "http_clickhouse")
    before = _databases(clickhouse)
    monkeypatch.setattr(ledger_module, "CLICKHOUSE_PARTITION_TURNS", 50)
    assert ledger_module.partitions_for(clickhouse) > 2
    statements = _statements_run(monkeypatch)
    built = ledger(clickhouse)
    assert len(statements) > 2 and all(" partition " in s for s in statements)
    assert _databases(clickhouse) == before
    order = ["run_id", "conversation_id", "turn_index", "arrival", "x_request_id", "observer"]
    assert_frame_equal(_sorted(built, order), _sorted(whole, order), check_exact=False,
                       rel_tol=1e-12)


def _clickhouse_table(reader: ClickHouseReader) -> pl.DataFrame:
    """The ``kvscope_ledger`` table on ClickHouse, typed, in its rows' order (``_row``): the
    ledger's."""
    stored = reader.frame(ledger_module.query.Query(
        f"SELECT * FROM {ledger_module.LEDGER_TABLE} ORDER BY {ledger_module.ROW}",
        name="ledger table"))
    assert stored[ledger_module.ROW].to_list() == list(range(stored.height))
    return stored.drop(ledger_module.ROW).cast(ledger_module.LEDGER_SCHEMA)


@pytest.mark.parametrize("path", ["chdb", "clickhouse-connect"])
def test_kvscope_ledger_on_clickhouse_writes_the_ledger_built_in_partitions(
        path: str, request: pytest.FixtureRequest, whole: pl.DataFrame,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvscope ledger --clickhouse URL --partitions 3`` (:func:`rebuild_clickhouse`): built in
    three ranges of conversations, each written to the server as it comes and finished there
    (nothing of the whole ledger held in this process: ``finish`` is never called), the tainted
    turns marked from their inputs read back: the table is the DuckDB store's ledger, and the
    scratch database goes with the build."""
    clickhouse = request.getfixturevalue("clickhouse" if path == "chdb" else "http_clickhouse")
    assert whole.filter(pl.col("invalid_kind") == "tainted").height > 0
    before = _databases(clickhouse)
    statements = _statements_run(monkeypatch)
    monkeypatch.setattr(ledger_module, "finish", None)  # nothing may hold the whole ledger
    assert ledger_units.rebuild_clickhouse(clickhouse.source, partitions=3) == whole.height
    assert statements == [f"ledger turns, partition {i} of 3" for i in (1, 2, 3)]
    assert_frame_equal(_clickhouse_table(clickhouse), whole, check_exact=False, rel_tol=1e-12)
    assert _databases(clickhouse) == before


def test_a_clickhouse_ledger_that_fails_to_write_leaves_the_last_one(
        clickhouse: ClickHouseReader, whole: pl.DataFrame,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that fails on the way (here the server refuses the final write) leaves the
    ledger table as it was, and no scratch database or half-written table behind."""
    ledger_units.rebuild_clickhouse(clickhouse.source, partitions=1)
    before = _databases(clickhouse)
    real = ClickHouseReader.write_table_as

    def refused(self: ClickHouseReader, name: str, schema: Any, select: Any, **kw: Any) -> None:
        bad = ledger_module.query.Query(select.sql.replace("SELECT ", "SELECT no_such_column, ",
                                                           1), select.params, name=select.name)
        real(self, name, schema, bad, **kw)
    monkeypatch.setattr(ClickHouseReader, "write_table_as", refused)
    with pytest.raises(ledger_module.StoreError, match="no_such_column"):
        ledger_units.rebuild_clickhouse(clickhouse.source, partitions=2)
    assert _databases(clickhouse) == before
    assert_frame_equal(_clickhouse_table(clickhouse), whole, check_exact=False, rel_tol=1e-12)
    tables = clickhouse.frame(ledger_module.query.Query(
        "SELECT name FROM system.tables WHERE database = currentDatabase()", name="tables"))
    assert f"{ledger_module.LEDGER_TABLE}__new" not in tables["name"].to_list()


def test_a_clickhouse_user_that_cannot_create_a_database_gets_the_one_statement(
        clickhouse: ClickHouseReader, whole: pl.DataFrame, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A user ClickHouse lets read and set settings but not create (``readonly = 2``) cannot
    stage: the ledger says so once and is built in one statement, the same ledger."""
    monkeypatch.setattr(ledger_module, "CLICKHOUSE_PARTITION_TURNS", 50)
    reader = ClickHouseReader.connect(clickhouse.source, time_limit_s=None)  # a session of its own
    try:
        reader.engine.command("SET readonly = 2")
        with caplog.at_level(logging.WARNING, logger=ledger_module.__name__):
            built = ledger(reader)
    finally:
        reader.close()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "the ledger cannot stage its span kinds in partitions"]
    assert "readonly" in caplog.records[0].getMessage()
    order = ["run_id", "conversation_id", "turn_index", "arrival", "x_request_id", "observer"]
    assert_frame_equal(_sorted(built, order), _sorted(whole, order), check_exact=False,
                       rel_tol=1e-12)


@pytest.fixture()
def own_clickhouse(store: Path, chdb_folder: Path) -> Iterator[ClickHouseReader]:
    """The store's spans in a ClickHouse database of this test's own (it adds spans)."""
    name = f"kvscope_stamp_{uuid.uuid4().hex[:8]}"
    otelcol.create_database(chdb_folder, name)
    reader = ClickHouseReader.connect(ClickHouseSource(f"chdb:{chdb_folder}", database=name),
                                      time_limit_s=None)
    try:
        reader.engine.command(otelcol.render(otelcol.TRACES_DDL, name, "otel_traces"))
        reader.engine.command(otelcol.render(otelcol.GAUGE_DDL, name, "otel_metrics_gauge"))
        load_store(store, reader.engine)
        yield reader
    finally:
        reader.engine.command(f"DROP DATABASE {name} SYNC")
        reader.close()


def _span_rows(reader: ClickHouseReader) -> int:
    return int(reader.rows(ledger_module.query.Query("SELECT count() FROM otel_traces"))[1][0][0])


@pytest.mark.parametrize("partitions", [1, 3])
def test_analyses_on_clickhouse_read_the_ledger_table_while_it_is_current(
        own_clickhouse: ClickHouseReader, whole: pl.DataFrame, partitions: int,
        http_clickhouse: ClickHouseReader, monkeypatch: pytest.MonkeyPatch) -> None:
    """After ``kvscope ledger --clickhouse`` (one statement or partitions), analyses read its
    table a few columns at a time (the ledger is not computed: ``ledger()`` is unavailable),
    the ledger's rows in its order, in process and over HTTP. A span stored after it, a span
    replaced by another (the count the same), or other rules make it stale: the ledger is
    computed from the spans again."""
    from kvscope.analysis.registry import LEDGER, AnalysisContext, whole_ledger

    reader = own_clickhouse
    whole = ledger_units.categorical(whole)  # what analyses read (Categorical vocabularies)
    assert ledger_units.stored_columns(reader) is None  # no table yet
    ledger_units.rebuild_clickhouse(reader.source, partitions=partitions)
    spans = _span_rows(reader)
    with monkeypatch.context() as patched:
        patched.setattr(ledger_module, "ledger", None)
        stored = ledger_units.stored_columns(reader)
        assert stored is not None
        assert_frame_equal(stored.frame(), whole, check_exact=False, rel_tol=1e-12)
        ctx = AnalysisContext(reader)
        assert_frame_equal(whole_ledger(ctx, ["x_request_id", "outcome", "prefill_ms"]),
                           whole.select("x_request_id", "outcome", "prefill_ms"),
                           check_exact=False, rel_tol=1e-12)
        # Over HTTP (clickhouse-connect's types for the stamp, the comment and the columns).
        over_http = ClickHouseReader.connect(dataclasses.replace(
            http_clickhouse.source, database=reader.source.database), time_limit_s=None)
        try:
            stored = ledger_units.stored_columns(over_http)
            assert stored is not None
            assert_frame_equal(stored.frame(["x_request_id", "arrival", "outcome"]),
                               whole.select("x_request_id", "arrival", "outcome"))
        finally:
            over_http.close()
    with monkeypatch.context() as patched:
        patched.setattr(ledger_units, "rules_fingerprint", lambda: "other rules")
        assert ledger_units.stored_columns(reader) is None
    first = reader.rows(ledger_module.query.Query(
        "SELECT min(SpanId) FROM otel_traces WHERE SpanName = 'kvscope.turn'"))[1][0][0]
    reader.engine.command(
        "INSERT INTO otel_traces SELECT * REPLACE (concat(SpanId, 'x') AS SpanId) "
        f"FROM (SELECT * FROM otel_traces WHERE SpanId = '{first}')")  # (a WHERE here: the alias)
    assert _span_rows(reader) == spans + 1
    assert ledger_units.stored_columns(reader) is None  # one span more
    assert isinstance(AnalysisContext(reader).get(LEDGER), pl.DataFrame)  # computed
    reader.engine.command(f"ALTER TABLE otel_traces DELETE WHERE SpanId = '{first}' "
                          "SETTINGS mutations_sync = 2")
    assert _span_rows(reader) == spans  # as many span rows as it was built from, one other
    assert ledger_units.stored_columns(reader) is None
