"""The reader's one seam: every query path has the time limit and the error translation."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import cast

import duckdb
import pytest

from kvscope.errors import StoreError
from kvscope.store import open_store, query
from kvscope.store.duckdb_reader import DuckDBReader
from kvscope.store.query import Query
from kvscope.store.reader import Reader
from kvscope.store.source import open_reader

# A query that runs for minutes unless interrupted.
SLOW = Query("SELECT count(*) FROM range(10000000000) a", name="slow")


@pytest.fixture
def reader(tmp_path: Path) -> Reader:
    path = tmp_path / "r.duckdb"
    open_store(path).close()
    return open_reader(path, time_limit_s=0.3)


def _batches(reader: Reader, sql: Query) -> list[int]:
    return reader.map_batches(sql, len)


def _path(reader: Reader, how: str) -> Callable[[Query], object]:
    """The reader's query path named ``how`` (small_frame: frame, its results declared small)."""
    if how == "batches":
        return partial(_batches, reader)
    if how == "small_frame":
        assert isinstance(reader, DuckDBReader)
        reader.small_results = True
        return reader.frame
    return cast(Callable[[Query], object], getattr(reader, how))


@pytest.mark.parametrize("how", ["execute", "frame", "small_frame", "rows", "batches"])
def test_every_query_path_is_interrupted_at_the_time_limit(reader: Reader, how: str) -> None:
    """``frame`` ran its (lazy) query outside the limit before: a slow analysis query ran on."""
    run = _path(reader, how)
    with pytest.raises(StoreError, match="exceeded the 0.3 s time limit"):
        result = run(SLOW)
        if how == "execute":
            assert isinstance(result, duckdb.DuckDBPyConnection)
            result.fetchall()


@pytest.mark.parametrize("how", ["execute", "frame", "small_frame", "rows", "batches"])
def test_every_query_path_translates_duckdb_errors(reader: Reader, how: str) -> None:
    run = _path(reader, how)
    with pytest.raises(StoreError, match="query failed: "):
        run(Query("SELECT * FROM no_such_table"))
    assert reader.frame(Query("SELECT ? AS x", positional=(7,)))["x"].to_list() == [7]


def test_batches_keep_the_order_and_an_empty_result_is_one_empty_batch(
        reader: Reader) -> None:
    sql = Query("SELECT range AS n FROM range(10) ORDER BY n DESC")
    parts = reader.map_batches(sql, lambda frame: frame["n"].to_list(), rows=3)
    assert len(parts) >= 2 and [n for part in parts for n in part] == list(range(9, -1, -1))
    empty = reader.map_batches(Query("SELECT 1 AS n WHERE false"), lambda frame: frame.columns)
    assert empty == [["n"]]


def test_a_small_result_is_the_frame_a_relation_gives(tmp_path: Path) -> None:
    """``small_results`` runs a statement once (``execute``) where a relation binds it twice:
    the same frame, typed the same, for rows, nulls, nested values, named and positional
    parameters and an empty result."""
    path = tmp_path / "s.duckdb"
    open_store(path).close()
    reader = open_reader(path, time_limit_s=None)
    assert isinstance(reader, DuckDBReader)
    queries = [
        Query("SELECT range AS n, range::VARCHAR || $suffix AS s, [range, NULL] AS l, "
              "{'a': range, 'b': NULL::DOUBLE} AS st, MAP {'k': range} AS m, "
              "NULLIF(range, 2) AS maybe, TIMESTAMP '2026-01-01' + INTERVAL (range) SECOND AS t "
              "FROM range(5) ORDER BY n", {"suffix": "-x"}),
        Query("SELECT ? AS x, ?::HUGEINT AS big", positional=(7, 2**70)),
        Query("SELECT 1 AS n, 'a' AS s WHERE false"),
        Query("SELECT SpanName, count(*) AS n FROM otel_traces GROUP BY ALL"),
    ]
    expected = [reader.frame(sql) for sql in queries]
    reader.small_results = True
    got = [reader.frame(sql) for sql in queries]
    for before, after in zip(expected, got, strict=True):
        assert after.schema == before.schema
        assert after.equals(before)
    assert got[0].height == 5 and got[2].height == 0


def test_the_store_memory_limit_setting_bounds_a_reader(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.duckdb"
    open_store(path).close()
    monkeypatch.setenv("KVSCOPE_STORE_MEMORY_LIMIT", "256MiB")
    limited = open_reader(path)
    try:
        assert limited.rows(Query("SELECT current_setting('memory_limit')"))[1] == [("256.0 MiB",)]
    finally:
        limited.close()
    # A value that is not an amount is ignored with a warning: DuckDB's default stays.
    monkeypatch.setenv("KVSCOPE_STORE_MEMORY_LIMIT", "256; DROP")
    default = open_reader(path)
    try:
        assert default.rows(Query("SELECT current_setting('memory_limit')"))[1] != [("256.0 MiB",)]
    finally:
        default.close()



def test_a_query_binds_every_key_and_value_by_name(tmp_path: Path) -> None:
    """Attribute keys and compared values are parameters, never SQL text (a quote is harmless)."""
    path = tmp_path / "q.duckdb"
    con = open_store(path)
    con.execute(
        "INSERT INTO otel_traces (Timestamp, TraceId, SpanId, SpanName, SpanAttributes, "
        "ResourceAttributes, Duration) VALUES "
        "(now(), 't1', 's1', 'a''span', MAP {'k''ey': 'v1', 'dir': 'in'}, MAP {'run': 'r'}, 5), "
        "(now(), 't2', 's2', 'a''span', MAP {'k''ey': 'v2', 'dir': 'out'}, MAP {'run': 'r'}, 7), "
        "(now(), 't3', 's3', 'other', MAP {'k''ey': 'v3', 'dir': 'in'}, MAP {'run': 'r'}, 9)")
    con.close()
    q = query.spans("a'span", {"run": query.resource_attr("run"), "value": query.span_attr("k'ey"),
                               "ns": "Duration"},
                    where={query.span_attr("dir"): ("in", "sideways")})
    assert "'" not in q.sql and "k'ey" in q.params.values()
    reader = open_reader(path)
    try:
        assert reader.frame(q).rows() == [("r", "v1", 5)]
        assert reader.rows(q)[1] == [("r", "v1", 5)]
    finally:
        reader.close()


def test_the_query_time_limit_setting_is_the_readers_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.duckdb"
    open_store(path).close()
    monkeypatch.setenv("KVSCOPE_STORE_QUERY_TIME_LIMIT_S", "0.3")
    limited = open_reader(path)
    try:
        with pytest.raises(StoreError, match="exceeded the 0.3 s time limit"):
            limited.rows(SLOW)
    finally:
        limited.close()
    monkeypatch.setenv("KVSCOPE_STORE_QUERY_TIME_LIMIT_S", "0")  # no limit
    unlimited = open_reader(path)
    try:
        assert unlimited.time_limit_s is None
    finally:
        unlimited.close()
    explicit = open_reader(path, time_limit_s=5.0)  # an explicit limit wins
    try:
        assert explicit.time_limit_s == 5.0
    finally:
        explicit.close()


def test_two_readers_of_one_store_in_one_process(tmp_path: Path) -> None:
    """DuckDB shares a file's database instance within a process: the second reader finds its
    configuration locked by the first, and must still open (read-only and sealed)."""
    path = tmp_path / "two.duckdb"
    open_store(path).close()
    first, second = open_reader(path), open_reader(path)
    try:
        assert second.rows(Query("SELECT count(*) FROM otel_traces"))[1] == [(0,)]
        assert second.rows(Query("SELECT current_setting('enable_external_access')"))[1] == [
            (False,)]
    finally:
        first.close()
        second.close()


def test_an_error_names_the_query_and_its_sql(reader: Reader) -> None:
    """A failed analysis says which of its queries failed, and the SQL that ran."""
    from kvscope.errors import QueryError

    broken = Query("SELECT nothing_here FROM otel_traces WHERE SpanName = $name",
                   {"name": "x"}, name="spans by name")
    with pytest.raises(QueryError) as caught:
        reader.frame(broken)
    error = caught.value
    assert error.query_name == "spans by name" and error.sql == broken.sql
    assert "(query spans by name: SELECT nothing_here FROM otel_traces WHERE SpanName = $name)" \
        in str(error)
    with pytest.raises(QueryError, match=r"exceeded the 0.3 s time limit \(query slow: SELECT"):
        reader.rows(SLOW)
    # An unnamed query says so; long SQL is quoted up to a point (the error keeps it whole).
    long = Query("SELECT " + ", ".join(f"{i} AS c{i}" for i in range(200)) + " FROM no_table")
    with pytest.raises(QueryError, match=r"\(query unnamed: SELECT 0 AS c0, .* …\)") as caught:
        reader.frame(long)
    assert caught.value.sql == long.sql


def test_the_readers_are_siblings_with_no_import_cycle() -> None:
    """Both engines' readers satisfy one protocol; neither is the other's subclass."""
    from kvscope.store.clickhouse import ClickHouseReader
    from kvscope.store.duckdb_reader import DuckDBReader

    assert not issubclass(ClickHouseReader, DuckDBReader)
    assert not issubclass(DuckDBReader, ClickHouseReader)
    for cls in (ClickHouseReader, DuckDBReader):
        for method in ("frame", "rows", "map_batches", "has_table", "interrupt", "close"):
            assert callable(getattr(cls, method)), (cls, method)
