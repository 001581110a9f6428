"""The incremental ``kvscope_ledger`` (analysis/ledger_units.py) equals a full rebuild.

A simulated store (faults on: clients without conversation ids, stripped metadata, failed
transfers and handshakes, preemptions) is replayed into a fresh DuckDB file in random batches of
random order, so engine and leg spans arrive before their turn and after it, and turn k-1's
retention after turn k. After every batch the table is brought up to date by recomputing only
the touched conversations, and compared, row for row, with the ledger rebuilt from every span.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvscope import cli, semconv
from kvscope.analysis.ledger import LEDGER_TABLE, QUERIES, ledger
from kvscope.analysis.ledger_units import (
    _named_units,
    stored_queries,
    stored_table_query,
    stored_tables,
    unit_expr,
    units_of,
    update_connection,
)
from kvscope.emulator.simulator import SimulationSettings, simulate
from kvscope.errors import QueryError
from kvscope.store import query
from kvscope.store.database import open_store
from kvscope.store.duckdb_reader import DuckDBReader
from tests.stores import busy_workload, simulate_faults

_ORDER = ["run_id", "conversation_id", "turn_index", "arrival", "x_request_id"]


@pytest.fixture(scope="module")
def spans(tmp_path_factory: pytest.TempPathFactory) -> pa.Table:
    db = tmp_path_factory.mktemp("units") / "source.duckdb"
    workload = busy_workload(turns_p50=5, max_turns=8)
    simulate_faults(workload, db)
    simulate(workload, db, SimulationSettings(profile="tiny", label="plain", seed=3))
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.sql("SELECT * FROM otel_traces").to_arrow_table()
    finally:
        con.close()


def _sorted(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.sort(_ORDER, nulls_last=False)


def _table(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    return pl.DataFrame(con.sql(f"SELECT * FROM {LEDGER_TABLE}").to_arrow_table())


@settings(max_examples=5, deadline=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), first=st.floats(0.25, 0.5),
       cuts=st.lists(st.floats(0.5, 0.98), min_size=1, max_size=5))
def test_incremental_equals_full_rebuild(spans: pa.Table, tmp_path_factory: pytest.TempPathFactory,
                                         seed: int, first: float, cuts: list[float]) -> None:
    # The first batch holds every run's turn spans in any order (a quarter of the spans at
    # least): before that, a run's engine spans alone make engine rows, and the update falls
    # back to a full rebuild (tested apart below).
    order = pl.Series(range(spans.num_rows)).shuffle(seed=seed).to_list()
    shuffled = spans.take(order)
    bounds = sorted({0, *(round(c * spans.num_rows) for c in (first, *cuts)), spans.num_rows})
    con = open_store(tmp_path_factory.mktemp("inc") / "store.duckdb")
    incremental = changed_later = 0
    reasons: list[str | None] = []
    outcome_seen: dict[tuple, str] = {}
    try:
        for low, high in zip(bounds, bounds[1:], strict=False):
            con.register("batch", shuffled.slice(low, high - low))
            con.execute("INSERT INTO otel_traces SELECT * FROM batch")
            con.unregister("batch")
            done = update_connection(con)
            incremental += done.units is not None
            reasons.append(done.reason)
            table = _table(con)
            full = ledger(DuckDBReader(con, time_limit_s=None))
            assert _sorted(table).equals(_sorted(full)), (low, high, done)
            _assert_stored_queries_current(con)
            for row in table.select(*_ORDER, "outcome").iter_rows():
                key = row[:-1]
                if key in outcome_seen and outcome_seen[key] != row[-1]:
                    changed_later += 1
                outcome_seen[key] = row[-1]
        again = update_connection(con)
        assert again.units == 0  # nothing new: nothing recomputed
    finally:
        con.close()
    # Batches after the first were incremental, and late spans changed earlier turns' outcomes.
    assert incremental == len(bounds) - 2, reasons
    assert changed_later > 0


def test_the_units_of_turn_spans_up_to_the_mark_are_the_ledger_tables(
        spans: pa.Table, tmp_path: Path) -> None:
    """An update finds the conversations new spans touch in the ledger table, for the turn
    spans it was built from, and in the store past its mark: the same units as scanning every
    stored span (which the update did before), for every trace and X-Request-Id there is, and
    for ids of engine-only rows and ids no span has. Engine spans first (their rows are engine
    rows with no trace until their turns arrive), then the rest in random order."""
    con = open_store(tmp_path / "store.duckdb")
    try:
        con.register("spans", spans)
        con.execute("INSERT INTO otel_traces SELECT * FROM spans ORDER BY "
                    f"SpanName <> '{semconv.SPAN_REUSE_DECISION}', hash(SpanId)")
        con.unregister("spans")
        reader = DuckDBReader(con, time_limit_s=None)
        every = reader.frame(QUERIES["turns"])
        traces = [*every["trace_id"].drop_nulls().unique().to_list(), "no-such-trace"]
        keys = [*every["x_request_id"].drop_nulls().unique().to_list(), "no-such-request"]
        whole = units_of(reader, traces, keys).unique().sort(pl.all())
        assert whole.height >= every.select(unit_expr()).n_unique()
        total = spans.num_rows
        for mark in (total // 50, total // 3, 2 * total // 3, total - 1):
            con.execute(f"CREATE TEMP TABLE held AS SELECT * FROM otel_traces WHERE rowid > {mark}")
            con.execute(f"DELETE FROM otel_traces WHERE rowid > {mark}")
            update_connection(con, full=True)
            con.execute("INSERT INTO otel_traces SELECT * FROM held")
            con.execute("DROP TABLE held")
            found = _named_units(reader, traces, keys, mark).sort(pl.all())
            engine_rows = con.execute(f"SELECT count(*) FROM {LEDGER_TABLE} "
                                      "WHERE trace_id IS NULL").fetchall()[0][0]
            assert found.equals(whole), (mark, engine_rows)
    finally:
        con.close()


def _assert_stored_queries_current(con: duckdb.DuckDBPyConnection) -> None:
    """Each stored query's table (as analyses read it) holds what the query gives now, rows
    in the same order (a DISTINCT query's rows as a set)."""
    reader = DuckDBReader(con, time_limit_s=None)
    names = stored_tables(reader)
    assert names == set(stored_queries())
    for name, sql in stored_queries().items():
        kept, fresh = reader.frame(stored_table_query(name, sql)), reader.frame(sql)
        if sql.sql.startswith("SELECT DISTINCT "):
            kept, fresh = kept.sort(pl.all()), fresh.sort(pl.all())
        assert kept.equals(fresh), name
        assert fresh.height or name == "d2p_reads", name  # each query finds spans here


def test_the_watermark_falls_back_to_a_full_rebuild_when_rows_go(spans: pa.Table,
                                                                  tmp_path: Path) -> None:
    con = open_store(tmp_path / "store.duckdb")
    try:
        con.register("batch", spans)
        con.execute("INSERT INTO otel_traces SELECT * FROM batch")
        con.unregister("batch")
        assert update_connection(con).reason == "no table or watermark from an earlier build"
        con.execute("DELETE FROM otel_traces WHERE rowid % 7 = 0")
        done = update_connection(con)
        assert done.units is None and "not those counted" in str(done.reason)
        assert _sorted(_table(con)).equals(_sorted(ledger(DuckDBReader(con, time_limit_s=None))))
        _assert_stored_queries_current(con)
    finally:
        con.close()


def test_a_table_an_earlier_kvscope_built_is_rebuilt_not_appended_to(spans: pa.Table,
                                                                     tmp_path: Path) -> None:
    """A store whose kvscope_ledger lacks a column this kvscope adds (invalid_kind): new rows
    cannot go into it, so the next update rebuilds it whole."""
    con = open_store(tmp_path / "store.duckdb")
    half = spans.num_rows // 2
    try:
        con.register("batch", spans.slice(0, half))
        con.execute("INSERT INTO otel_traces SELECT * FROM batch")
        update_connection(con)
        con.execute(f"ALTER TABLE {LEDGER_TABLE} DROP COLUMN invalid_kind")
        con.register("batch", spans.slice(half))
        con.execute("INSERT INTO otel_traces SELECT * FROM batch")
        done = update_connection(con)
        assert done.units is None and done.reason == "the table has an earlier kvscope's columns"
        assert _sorted(_table(con)).equals(_sorted(ledger(DuckDBReader(con, time_limit_s=None))))
    finally:
        con.close()


def _append(db: Path, rows: pa.Table) -> None:
    """Store span rows, as a receiver does between two ``kvscope ledger`` runs."""
    con = open_store(db)
    try:
        con.register("batch", rows)
        con.execute("INSERT INTO otel_traces SELECT * FROM batch")
    finally:
        con.close()


def test_cli_ledger_says_what_it_recomputed(spans: pa.Table, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "store.duckdb"
    half = spans.num_rows // 2
    _append(db, spans.slice(0, half))
    assert cli.main(["ledger", str(db)]) == 0
    assert "rebuilt from the raw spans" in capsys.readouterr().out
    _append(db, spans.slice(half))
    assert cli.main(["ledger", str(db)]) == 0
    out = capsys.readouterr().out
    assert "conversations touched by new spans recomputed" in out, out


def test_analyses_read_the_stored_ledger_only_while_it_is_current(
        spans: pa.Table, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After ``kvscope ledger`` the analyses read its table (equal to the ledger computed from
    the spans) instead of computing it; a span row stored since, or other rules than the ones
    that built it, and they compute it again."""
    from kvscope.analysis import ledger as ledger_module
    from kvscope.analysis import ledger_units, registry

    db = tmp_path / "store.duckdb"
    half = spans.num_rows // 2
    _append(db, spans.slice(0, half))
    computed: list[int] = []
    compute = ledger_module.ledger

    def counted(reader: object, **options: bool) -> pl.DataFrame:
        computed.append(1)
        return compute(reader, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(ledger_module, "ledger", counted)

    def analysed() -> pl.DataFrame:
        with registry.AnalysisContext.open(db) as ctx:
            return ctx.ledger()

    assert cli.main(["ledger", str(db)]) == 0
    stored = analysed()
    assert computed == [1]  # the build's own
    assert _sorted(stored).equals(
        _sorted(ledger_units.categorical(compute(DuckDBReader.open(db)))))
    # The stored contract's types, with vocabularies as Categoricals (what analyses read).
    assert stored.schema == pl.Schema({
        name: pl.Categorical() if name in ledger_units.CATEGORICAL else dtype
        for name, dtype in ledger_module.LEDGER_SCHEMA.items()})

    _append(db, spans.slice(half, 10))
    assert analysed().schema == stored.schema  # computed, the same types
    assert computed == [1, 1]  # spans stored since the build: computed
    assert cli.main(["ledger", str(db)]) == 0
    updated = analysed()
    assert len(computed) == 2  # current again (the update recomputed touched units only)
    assert _sorted(updated).equals(_sorted(compute(DuckDBReader.open(db))))
    keys = ["run_id", "conversation_id", "turn_index", "arrival"]
    assert updated.equals(updated.sort(keys, nulls_last=False, maintain_order=True))

    monkeypatch.setattr(ledger_units, "rules_fingerprint", lambda: "other rules")
    analysed()
    assert len(computed) == 3


def test_analyses_read_stored_queries_tables_only_while_they_are_current(
        spans: pa.Table, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the stored ledger is current, a stored query (the retention spans) is read from
    the table ``kvscope ledger`` keeps, with the same result; a span row stored since, or other
    query text than the table's, and the query runs on the spans again. A build whose only
    change is the queries' text rebuilds their tables, not the ledger."""
    from kvscope.analysis import ledger_units, registry, retention, stored_queries

    db = tmp_path / "store.duckdb"
    half = spans.num_rows // 2
    _append(db, spans.slice(0, half))
    ran: list[str] = []
    frame = DuckDBReader.frame

    def recorded(self: DuckDBReader, sql: object) -> pl.DataFrame:
        ran.append(getattr(sql, "sql", ""))
        return frame(self, sql)  # type: ignore[arg-type]

    monkeypatch.setattr(DuckDBReader, "frame", recorded)

    def retentions() -> pl.DataFrame:
        ran.clear()
        with registry.AnalysisContext.open(db) as ctx:
            return ctx.frame(retention.RETENTION_QUERY)

    table = f'FROM "{ledger_units.STORED_PREFIX}retention_spans"'
    from_spans = retentions()
    assert from_spans.height > 0 and not any(table in sql for sql in ran)
    assert cli.main(["ledger", str(db)]) == 0
    assert retentions().equals(from_spans) and any(table in sql for sql in ran)

    _append(db, spans.slice(half))
    later = retentions()
    assert later.height > from_spans.height and not any(table in sql for sql in ran)
    assert cli.main(["ledger", str(db)]) == 0  # the new rows appended to the table
    assert retentions().equals(later) and any(table in sql for sql in ran)

    # Another kvscope's query text: read from the spans until the next build rebuilds it.
    changed = type(retention.RETENTION_QUERY)(
        retention.RETENTION_QUERY.sql + " AND 1 = 1", retention.RETENTION_QUERY.params)
    monkeypatch.setitem(stored_queries.STORED_QUERIES, "retention_spans", changed)
    ran.clear()
    with registry.AnalysisContext.open(db) as ctx:
        assert ctx.frame(changed).equals(later)
    assert not any(table in sql for sql in ran)
    con = open_store(db)
    try:
        done = update_connection(con)
        assert done.reason is None and done.units == 0  # the ledger stayed as it was
        _assert_stored_queries_current(con)
    finally:
        con.close()


_KEYS = st.lists(st.tuples(st.sampled_from(["a", "b", None]), st.sampled_from(["x", "y", None]),
                           st.integers(0, 2) | st.none(), st.integers(0, 3) | st.none()),
                 max_size=12)


@settings(max_examples=300, deadline=None)
@given(rows=_KEYS)
def test_rows_are_in_order_exactly_when_a_stable_sort_leaves_them(
        rows: list[tuple[object, ...]]) -> None:
    """The stored ledger's order check (no sort) against the sort it stands for: nulls first,
    ties kept, every key column deciding only on a tie of those before it."""
    from kvscope.analysis.ledger_units import _in_order

    keys = pl.DataFrame(rows, schema={"run_id": pl.String, "conversation_id": pl.String,
                                      "turn_index": pl.Int64, "arrival": pl.Int64},
                        orient="row")
    order = keys.select(pl.arg_sort_by(*keys.columns, nulls_last=False,
                                       maintain_order=True)).to_series()
    assert _in_order(keys) == (order.to_list() == list(range(keys.height)))


def _cached_table_bytes(reader: DuckDBReader) -> int:
    return int(reader.rows(query.Query(
        "SELECT coalesce(sum(memory_usage_bytes), 0) FROM duckdb_memory() "
        "WHERE tag = 'BASE_TABLE'"))[1][0][0])


class _Exhausted:
    """A scanner every read of which runs out of memory."""

    def frame(self, *args: object, **kwargs: object) -> pl.DataFrame:
        from kvscope.errors import QueryOutOfMemory

        raise QueryOutOfMemory("out of the scanner's memory")

    map_batches = frame


def test_the_stored_ledger_is_read_through_a_scanner_that_caches_little(
        spans: pa.Table, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Analyses read the stored ledger's columns and the stored queries' tables through the
    reader's scanner (a DuckDB instance of the file under SCAN_MEMORY_LIMIT, sealed as readers
    are), so the reader's own instance caches none of those tables' blocks; where the scanner
    runs out of memory they are read through the reader, with the same result."""
    from kvscope.analysis import registry, stored_queries
    from kvscope.store.database import SCAN_MEMORY_LIMIT

    db = tmp_path / "store.duckdb"
    _append(db, spans)
    assert cli.main(["ledger", str(db)]) == 0
    limit = duckdb.connect()
    limit.execute(f"SET memory_limit = '{SCAN_MEMORY_LIMIT}'")
    shown = limit.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]

    def analysed() -> tuple[pl.DataFrame, pl.DataFrame, int]:
        with registry.AnalysisContext.open(db) as ctx:
            reader = ctx.reader
            assert isinstance(reader, DuckDBReader)
            before = _cached_table_bytes(reader)
            frames = ctx.ledger(), ctx.frame(stored_queries.RETENTION_SPANS)
            return *frames, _cached_table_bytes(reader) - before

    reader = DuckDBReader.open(db)
    try:
        scanner = reader.scanner()
        assert scanner is not reader and scanner is reader.scanner()
        assert scanner.rows(query.Query(
            "SELECT current_setting('memory_limit'), current_setting('enable_external_access'), "
            "current_setting('lock_configuration')"))[1] == [(shown, False, True)]
        cursor = reader.cursor()
        assert cursor.scanner() is cursor  # a cursor on another's connection has no file
    finally:
        reader.close()
    with pytest.raises(QueryError, match="closed"):  # closed with its reader
        scanner.rows(query.Query("SELECT 1"))

    ledger_frame, retentions, cached = analysed()
    assert ledger_frame.height and retentions.height
    assert cached == 0  # fails when the reader itself reads them (DuckDB caches what it read)
    monkeypatch.setattr(DuckDBReader, "scanner", lambda self: _Exhausted())
    again, retentions_again, cached = analysed()
    assert cached > 0  # read through the reader this time
    assert again.equals(ledger_frame) and retentions_again.equals(retentions)


def test_the_head_of_a_stored_ledger_is_the_listings_without_holding_it(
        spans: pa.Table, tmp_path: Path) -> None:
    """``StoredLedger.head`` (the report's ledger table) gives the listing's first rows and
    height, of a table in the ledger's order and of one an update left out of it, for every
    run or some; it keeps only what finding those rows read."""
    from kvscope.analysis import ledger_units, registry

    db = tmp_path / "store.duckdb"
    half = spans.num_rows // 2
    _append(db, spans.slice(0, half))
    assert cli.main(["ledger", str(db)]) == 0
    orders = []
    for state in ("built", "updated", "reversed", "gaps"):
        with registry.AnalysisContext.open(db) as ctx:
            reader = ctx.reader
            whole = ledger_units.StoredLedger(reader).frame()
            runs = sorted(set(whole["run_id"].to_list()))
            assert len(runs) > 1
            for chosen in (None, runs[1:], runs[:1]):
                listing = (whole if chosen is None
                           else whole.filter(pl.col("run_id").is_in(chosen)))
                # Rows read by their places, and (past rows_by_place) whole columns cut.
                for rows, by_place in itertools.product((0, 7, listing.height + 5), (10_000, 5)):
                    fresh = ledger_units.StoredLedger(reader)
                    fresh.rows_by_place = by_place
                    orders.append(fresh._order is None)
                    before = set(fresh._columns)
                    head, height = fresh.head(rows, chosen)
                    assert height == listing.height
                    assert head.equals(listing.head(rows)), (chosen, rows, by_place)
                    assert set(fresh._columns) <= before | {"run_id"}
            head, height = registry.head(ctx, "ledger", 9)
            assert head.equals(whole.head(9)) and height == whole.height
            stored = ctx.get(registry.LEDGER)
            assert isinstance(stored, ledger_units.StoredLedger)
            assert len(stored._columns) < len(whole.columns) // 4  # the listing not held
        if state == "built":
            _append(db, spans.slice(half, spans.num_rows - half))
            assert cli.main(["ledger", str(db)]) == 0  # an update: its units' rows appended
        elif state == "updated":
            # Whether the update's rows fall out of order depends on the ids drawn: out of it
            # for certain, the table written again in reverse (still current: same rows).
            with duckdb.connect(str(db)) as con:
                con.execute(f"CREATE OR REPLACE TABLE {LEDGER_TABLE} AS SELECT * FROM "
                            f"{LEDGER_TABLE} ORDER BY run_id DESC, conversation_id DESC")
        elif state == "reversed":
            # Rows deleted and stored again (as an update does): the table's rowids have gaps,
            # so a row's place in a scan is not its rowid.
            with duckdb.connect(str(db)) as con:
                # Left in the write-ahead log: a checkpoint rewrites so small a table densely.
                con.execute("PRAGMA disable_checkpoint_on_shutdown")
                con.execute(f"CREATE TEMP TABLE kept AS SELECT * FROM {LEDGER_TABLE} "
                            "WHERE rowid % 3 = 0")
                con.execute(f"DELETE FROM {LEDGER_TABLE} WHERE rowid % 3 = 0")
                con.execute(f"INSERT INTO {LEDGER_TABLE} SELECT * FROM kept")
                count, last = con.execute(
                    f"SELECT count(*), max(rowid) FROM {LEDGER_TABLE}").fetchone() or (0, 0)
                assert last + 1 > count
    assert True in orders and False in orders  # in the ledger's order, and out of it
