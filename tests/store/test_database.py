"""Opening stores: create, reopen; refuse foreign, newer or locked files without touching them."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import pytest

from kvscope.errors import NewerSchemaError, NotAKvscopeStore, StoreError, StoreLockedError
from kvscope.store import SCHEMA_VERSION, begin_run, end_run, open_store, table_counts
from kvscope.store.query import Query
from kvscope.store.schema import GAUGE_COLUMNS, TRACES_COLUMNS
from kvscope.store.source import open_reader

# The OpenTelemetry Collector ClickHouse exporter's column names, in its order.
CLICKHOUSE_TRACES = [
    "Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState", "SpanName", "SpanKind",
    "ServiceName", "ResourceAttributes", "ScopeName", "ScopeVersion", "SpanAttributes",
    "Duration", "StatusCode", "StatusMessage", "Events", "Links",
]
CLICKHOUSE_GAUGE = [
    "ResourceAttributes", "ResourceSchemaUrl", "ScopeName", "ScopeVersion", "ScopeAttributes",
    "ScopeDroppedAttrCount", "ScopeSchemaUrl", "ServiceName", "MetricName", "MetricDescription",
    "MetricUnit", "Attributes", "StartTimeUnix", "TimeUnix", "Value", "Flags", "Exemplars",
]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_refused_and_untouched(path: Path, error: type[StoreError], match: str) -> None:
    """open_store refuses ``path`` with ``error`` (message matching ``match``), open_reader
    refuses it with ``error`` too, and neither changes a byte of the file."""
    before = _digest(path)
    with pytest.raises(error, match=match):
        open_store(path)
    with pytest.raises(error):
        open_reader(path)
    assert _digest(path) == before


def test_new_store_has_the_clickhouse_shaped_tables(store_path: Path) -> None:
    con = open_store(store_path)
    cols = [r[0] for r in con.execute("DESCRIBE otel_traces").fetchall()]
    assert cols == CLICKHOUSE_TRACES == [c[0] for c in TRACES_COLUMNS]
    gauge = [r[0] for r in con.execute("DESCRIBE otel_metrics_gauge").fetchall()]
    assert gauge == CLICKHOUSE_GAUGE == [c[0] for c in GAUGE_COLUMNS]
    types = dict(con.execute("SELECT column_name, data_type FROM information_schema.columns "
                             "WHERE table_name = 'otel_traces'").fetchall())
    assert types["SpanAttributes"] == "MAP(VARCHAR, VARCHAR)"
    assert types["Duration"] == "UBIGINT"
    assert types["Timestamp"] == "TIMESTAMP_NS"
    assert types["Events"].startswith("STRUCT(") and types["Events"].endswith("[]")
    version = con.execute("SELECT value FROM kvscope_meta WHERE key = 'schema_version'").fetchone()
    assert version == (str(SCHEMA_VERSION),)
    con.close()


def test_reopening_keeps_data_and_runs(store_path: Path) -> None:
    con = open_store(store_path)
    run = begin_run(con, "feature ON", {"decoder_kv_blocks_ttl": 480, "bidir": True})
    end_run(con, run)
    con.close()
    con = open_store(store_path)
    label, settings, ended = con.execute(
        "SELECT label, settings->>'decoder_kv_blocks_ttl', ended_at IS NOT NULL FROM kvscope_runs"
    ).fetchone()
    assert (label, settings, ended) == ("feature ON", "480", True)
    assert table_counts(con)["kvscope_runs"] == 1
    con.close()


def test_a_foreign_duckdb_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "other.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE orders (id INTEGER)")
    con.close()
    _assert_refused_and_untouched(path, NotAKvscopeStore, "not a kvscope store")


def test_a_file_that_is_not_duckdb_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "notes.duckdb"
    path.write_text("these are my notes, not a database\n" * 100)
    before = _digest(path)
    with pytest.raises(NotAKvscopeStore, match="not a DuckDB database"):
        open_store(path)
    assert _digest(path) == before


def test_a_newer_schema_is_refused_and_left_alone(store_path: Path) -> None:
    con = open_store(store_path)
    con.execute("UPDATE kvscope_meta SET value = ? WHERE key = 'schema_version'",
                [str(SCHEMA_VERSION + 1)])
    con.close()
    _assert_refused_and_untouched(store_path, NewerSchemaError, "newer")


def test_missing_file_for_reading_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such store file"):
        open_reader(tmp_path / "absent.duckdb")


def test_a_store_held_by_another_process_gives_a_clear_error(store_path: Path) -> None:
    open_store(store_path).close()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from kvscope.store import open_store
            con = open_store({str(store_path)!r})
            print("ready", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(StoreLockedError, match="another process"):
            open_store(store_path)
    finally:
        holder.communicate("", timeout=20)


def test_readers_cannot_write_or_reach_files(store_path: Path, tmp_path: Path) -> None:
    open_store(store_path).close()
    reader = open_reader(store_path)
    with pytest.raises(StoreError):
        reader.execute(Query("DELETE FROM otel_traces"))
    with pytest.raises(StoreError):
        reader.execute(Query(f"COPY otel_traces TO '{tmp_path / 'leak.csv'}'"))
    assert not (tmp_path / "leak.csv").exists()
    names, rows = reader.rows(Query("SELECT count(*) AS n FROM otel_traces WHERE SpanName = ?",
                                    positional=("x",)))
    assert (names, rows) == (["n"], [(0,)])
    reader.close()


@pytest.mark.parametrize("version", ["0", "00"])
def test_a_schema_version_below_one_is_refused_in_one_line(store_path: Path, version: str) -> None:
    con = open_store(store_path)
    con.execute("UPDATE kvscope_meta SET value = ? WHERE key = 'schema_version'", [version])
    con.close()
    before = _digest(store_path)
    for opener in (open_store, open_reader):
        with pytest.raises(NotAKvscopeStore,
                           match="schema version 0 in kvscope_meta is not one kvscope ever"):
            opener(store_path)
    assert _digest(store_path) == before


# What a hand-edited or half-restored store can lack; each must be refused at open, naming it.
DAMAGE = [
    ("DROP TABLE otel_metrics_gauge", "table otel_metrics_gauge is missing"),
    ("ALTER TABLE otel_traces DROP COLUMN StatusMessage",
     "column otel_traces.StatusMessage is missing"),
    ("ALTER TABLE otel_traces ALTER Duration TYPE BIGINT",
     "column otel_traces.Duration is BIGINT, expected UBIGINT"),
    ("ALTER TABLE otel_traces ADD COLUMN note VARCHAR", "an extra column note"),
    ("DROP TABLE kvscope_runs", "table kvscope_runs is missing"),
]


@pytest.mark.parametrize(("damage", "named"), DAMAGE)
def test_a_damaged_store_is_refused_at_open_naming_what_is_wrong(
    store_path: Path, damage: str, named: str
) -> None:
    open_store(store_path).close()
    con = duckdb.connect(str(store_path))
    con.execute(damage)
    con.close()
    before = _digest(store_path)
    for opener in (open_store, open_reader):
        with pytest.raises(NotAKvscopeStore, match=named) as caught:
            opener(store_path)
        assert "\n" not in str(caught.value)
    assert _digest(store_path) == before
