"""StoreWriter.commit: a future per batch, resolved once its rows are committed (issue 22)."""

from __future__ import annotations

import threading
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from kvscope.store import writer as writer_module
from kvscope.store.database import open_store
from kvscope.store.rows import TraceRows
from kvscope.store.writer import StoreWriter, insert_arrow


def _rows(n: int, name: str = "s", first: int = 0) -> pa.Table:
    rows = TraceRows()
    for i in range(first, first + n):
        rows.add(timestamp_ns=i, trace_id="0" * 32, span_id=f"{i:016x}", parent_span_id="",
                 trace_state="", span_name=name, span_kind="SPAN_KIND_INTERNAL",
                 service_name="t", resource_attributes=[], scope_name="", scope_version="",
                 span_attributes=[], duration_ns=1, status_code="STATUS_CODE_UNSET",
                 status_message="", events=[], links=[])
    return rows.to_arrow()


def _stored(path: Path) -> list[str]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return [row[0] for row in con.execute(
            "SELECT SpanName FROM otel_traces ORDER BY SpanName").fetchall()]
    finally:
        con.close()


def test_a_commit_future_resolves_after_the_rows_are_visible_to_another_cursor(
        tmp_path: Path) -> None:
    writer = StoreWriter(open_store(tmp_path / "c.duckdb"), max_queue_rows=10)
    try:
        # More rows than the row queue holds: commit() is bounded by its caller, not the queue.
        done = writer.commit("otel_traces", _rows(300))
        assert done is not None
        assert done.result(30) is None
        cursor = writer.connection.cursor()
        assert cursor.execute("SELECT count(*) FROM otel_traces").fetchone() == (300,)
        cursor.close()
    finally:
        writer.close()
    assert writer.commit("otel_traces", _rows(1)) is None  # closed: no future


def test_one_refused_batch_fails_only_its_own_future_in_a_group(tmp_path: Path) -> None:
    gate = threading.Event()
    entered = threading.Event()

    def insert(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table) -> None:
        entered.set()
        gate.wait(10)
        if "poison" in rows.column("SpanName").to_pylist():
            raise duckdb.ConstraintException("poisoned batch")
        insert_arrow(con, table, rows)

    path = tmp_path / "g.duckdb"
    writer = StoreWriter(open_store(path), insert=insert)
    first = writer.commit("otel_traces", _rows(1, "a"))
    assert entered.wait(10)  # the writer holds the first batch; the next three form one group
    group = [writer.commit("otel_traces", _rows(2, name, 10 * k))
             for k, name in enumerate(("b", "poison", "c"), start=1)]
    gate.set()
    assert first is not None and first.result(30) is None
    assert group[0] is not None and group[0].result(30) is None
    assert group[2] is not None and group[2].result(30) is None
    assert group[1] is not None
    with pytest.raises(duckdb.ConstraintException, match="poisoned batch"):
        group[1].result(30)
    assert writer.stats.failed_rows == 2
    assert writer.stats.written_rows == 5
    writer.close()
    assert _stored(path) == ["a", "b", "b", "c", "c"]


def test_a_group_over_a_row_group_is_inserted_in_parts_all_or_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "ROW_GROUP_ROWS", 10)
    parts: list[int] = []

    def insert(con: duckdb.DuckDBPyConnection, table: str, rows: pa.Table) -> None:
        parts.append(rows.num_rows)
        if len(parts) == 3:
            raise duckdb.IOException("disk full on the third part")
        insert_arrow(con, table, rows)

    path = tmp_path / "p.duckdb"
    writer = StoreWriter(open_store(path), insert=insert)
    failed = writer.commit("otel_traces", _rows(35, "x"))
    assert failed is not None
    with pytest.raises(duckdb.IOException):
        failed.result(30)
    stored = writer.commit("otel_traces", _rows(25, "y", 100))
    assert stored is not None and stored.result(30) is None
    writer.close()
    assert parts == [10, 10, 10, 10, 10, 5]
    # The failed batch's first two parts were rolled back with it.
    assert _stored(path) == ["y"] * 25
