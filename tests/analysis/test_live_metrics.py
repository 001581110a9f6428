"""The live ledger behind ``kvscope serve``'s ``/metrics``: incremental equals a rebuild, and a
scrape (parsed by Prometheus' own text parser) agrees with ``kvscope analyze`` on the same store.

The spans are a simulated run's (the simulator emits them through the collector's own code, with
faults switched on), replayed into a store in shuffled batches, so engine and leg spans arrive
before their turn, and after it.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import duckdb
import httpx
import polars as pl
import pyarrow as pa
import pytest
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscope import cli, semconv
from kvscope.analysis import live_metrics
from kvscope.analysis.ledger import ledger
from kvscope.analysis.live_metrics import LiveLedger, _Seen, contributions, metrics_source
from kvscope.collector.receiver import MetricsSource, QuerySource, Receiver
from kvscope.emulator.simulator import SimulationSettings, simulate
from kvscope.store.database import open_store
from kvscope.store.duckdb_reader import DuckDBReader
from kvscope.store.schema import TRACES_ARROW
from tests.stores import busy_workload, simulate_faults


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with two simulated runs: one with a mix of faults, one plain."""
    db = tmp_path_factory.mktemp("live") / "source.duckdb"
    workload = busy_workload(turns_p50=6, max_turns=9)
    simulate_faults(workload, db)
    simulate(workload, db, SimulationSettings(profile="tiny", label="plain", seed=3,
                                              model="other-model"))
    return db


def _shuffled_batches(source: Path, batches: int, seed: int) -> list[pa.Table]:
    con = duckdb.connect(str(source), read_only=True)
    try:
        table = con.sql(
            "SELECT * FROM otel_traces ORDER BY hash(SpanId || ?), SpanId", params=[str(seed)]
        ).to_arrow_table()
    finally:
        con.close()
    size = -(-table.num_rows // batches)
    return [table.slice(i, size) for i in range(0, table.num_rows, size)]


def _copy_runs(source: Path, con: duckdb.DuckDBPyConnection) -> None:
    con.execute(f"ATTACH '{source}' AS src (READ_ONLY)")
    con.execute("INSERT INTO kvscope_runs SELECT * FROM src.kvscope_runs")
    con.execute("DETACH src")


def _serving_runs_of(source: Path, db: Path, *, metrics: MetricsSource | None = None,
                     queries: QuerySource | None = None) -> Receiver:
    """A started receiver writing ``db`` (``metrics`` and ``queries`` as ``Receiver`` takes
    them) that holds ``source``'s runs and none of its spans yet; the caller stops it."""
    receiver = Receiver(db, port=0, metrics=metrics, queries=queries).start()
    try:
        cursor = receiver.writer.connection.cursor()
        _copy_runs(source, cursor)
        cursor.close()
    except BaseException:
        receiver.stop()
        raise
    return receiver


def _rebuilt(con: duckdb.DuckDBPyConnection, labels: dict[str, str]) -> dict:
    # Live metrics link a prompt sent again within its conversation only (ledger.finish).
    rows = ledger(DuckDBReader(con, time_limit_s=None), across_conversations=False)
    models = pl.DataFrame(con.sql(
        f"SELECT SpanAttributes['{semconv.X_REQUEST_ID}'] AS x_request_id, "
        f"SpanAttributes['{semconv.GEN_AI_REQUEST_MODEL}'] AS model FROM otel_traces "
        f"WHERE SpanName = '{semconv.SPAN_TURN}'").to_arrow_table())
    totals: dict = defaultdict(float)
    for series in contributions(rows, models, labels).values():
        for key, value in series.items():
            totals[key] += value
    return dict(totals)


@pytest.mark.parametrize(("seed", "idle_s"), [(1, 600.0), (2, 600.0), (3, 0.0)])
def test_incremental_equals_rebuild(source: Path, tmp_path: Path, seed: int,
                                    idle_s: float) -> None:
    """Spans arrive in shuffled batches (engine spans before and after their turn); after each
    batch only the touched conversations are recomputed, and the totals equal a rebuild. With
    ``idle_s`` 0 every conversation leaves memory after each refresh and every unclaimed span
    is dropped: late spans and later turns bring their conversations back from the store."""
    con = open_store(tmp_path / "live.duckdb")
    try:
        _copy_runs(source, con)
        live = LiveLedger(con, idle_s=idle_s)
        batches = _shuffled_batches(source, 7, seed)
        recomputed = []
        for batch in batches:
            con.register("batch", batch)
            con.execute("INSERT INTO otel_traces SELECT * FROM batch")
            con.unregister("batch")
            recomputed.append(live.refresh())
        assert live.refresh() == 0  # nothing new: nothing recomputed
        labels = dict(con.execute("SELECT run_id, label FROM kvscope_runs").fetchall())
        expected = _rebuilt(con, labels)
        totals = live.totals()
        assert {k: v for k, v in totals.items() if v} == {k: v for k, v in expected.items() if v}
        conversations = con.execute(
            f"SELECT count(DISTINCT SpanAttributes['{semconv.GEN_AI_CONVERSATION_ID}']) "
            f"FROM otel_traces WHERE SpanName = '{semconv.SPAN_TURN}'").fetchone()[0]
        # Late spans made conversations dirty again: more recomputations than conversations,
        # and no batch recomputed everything.
        assert sum(recomputed) > conversations
        outcomes_seen = {key[1][4] for key in totals if key[0] == live_metrics.TURNS}
        assert len(outcomes_seen) >= 5, outcomes_seen
        if idle_s == 0:
            # Nothing stays resident; conversations came back from the store.
            assert live.resident() == {"conversations": 0, "span_rows": 0, "keys": 0}
            assert live.store_reads > 0
    finally:
        con.close()


def test_the_per_turn_sql_reads_each_frame_in_one_chunk(
        source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept frames gain a chunk every refresh (appending does not copy them); what the
    per-turn SQL scans is one chunk a frame, or refreshes slow down as the live ledger ages."""
    built: list[dict[str, pl.DataFrame]] = []
    build = live_metrics.ledger_module.build

    def capture(frames: dict[str, pl.DataFrame], **kwargs: Any) -> pl.DataFrame:
        built.append(frames)
        return build(frames, **kwargs)

    monkeypatch.setattr(live_metrics.ledger_module, "build", capture)
    con = open_store(tmp_path / "live.duckdb")
    try:
        _copy_runs(source, con)
        live = LiveLedger(con, idle_s=600.0)
        for batch in _shuffled_batches(source, 5, 1):
            con.register("batch", batch)
            con.execute("INSERT INTO otel_traces SELECT * FROM batch")
            con.unregister("batch")
            live.refresh()
        assert max(frame.n_chunks() for frame in live._frames.values()) > 1
        assert built and all(frame.n_chunks() == 1 for frames in built
                             for frame in frames.values())
    finally:
        con.close()


def test_a_restart_reads_the_stored_history_in_steps_and_lets_old_conversations_go(
        source: Path, tmp_path: Path) -> None:
    """``kvscope serve`` restarted on a store that already holds spans: the first refresh reads
    them in steps of ``step_rows`` and lets go, step by step, the conversations whose newest
    turn ended ``idle_s`` before the newest span (at 1M stored turns it held every one: 12 GB
    at its peak and 7 GB for ``idle_s`` after). The totals equal a rebuild, then and after the
    rest of the spans arrive (conversations let go come back from the store)."""
    con = open_store(tmp_path / "live.duckdb")
    try:
        _copy_runs(source, con)
        history = duckdb.connect(str(source), read_only=True)
        try:
            rows = history.sql("SELECT * FROM otel_traces ORDER BY rowid").to_arrow_table()
        finally:
            history.close()
        stored = rows.num_rows * 7 // 10
        con.register("batch", rows.slice(0, stored))
        con.execute("INSERT INTO otel_traces SELECT * FROM batch")
        con.unregister("batch")
        labels = dict(con.execute("SELECT run_id, label FROM kvscope_runs").fetchall())
        live = LiveLedger(con, idle_s=1.0)
        live.step_rows = 97
        recomputed = live.refresh()
        conversations = con.execute(
            f"SELECT count(DISTINCT (ResourceAttributes['{semconv.RUN_ID}'], "
            f"SpanAttributes['{semconv.GEN_AI_CONVERSATION_ID}'])) "
            f"FROM otel_traces WHERE SpanName = '{semconv.SPAN_TURN}'").fetchall()[0][0]
        assert recomputed >= conversations
        # Turns end within seconds of one another here: all but the newest are history.
        assert live.resident()["conversations"] < conversations / 2
        totals = live.totals()
        expected = _rebuilt(con, labels)
        assert {k: v for k, v in totals.items() if v} == {k: v for k, v in expected.items() if v}
        con.register("batch", rows.slice(stored))
        con.execute("INSERT INTO otel_traces SELECT * FROM batch")
        con.unregister("batch")
        live.refresh()
        assert live.store_reads > 0  # conversations let go came back
        totals = live.totals()
        expected = _rebuilt(con, labels)
        assert {k: v for k, v in totals.items() if v} == {k: v for k, v in expected.items() if v}
    finally:
        con.close()


def test_a_scrape_does_not_wait_for_a_long_refresh(source: Path, tmp_path: Path) -> None:
    """A restart's first refresh over a large store takes minutes (84 s at 1M turns); the
    scrape that starts it answers after ``wait_s`` with the series as of the last step and how
    many span rows are still to read, while the refresh goes on in its thread. Once it ends,
    a scrape shows what a refresh done at once shows; ``close`` ends a refresh early."""
    con = open_store(tmp_path / "live.duckdb")
    try:
        _copy_runs(source, con)
        con.execute(f"ATTACH '{source}' AS src (READ_ONLY)")
        con.execute("INSERT INTO otel_traces SELECT * FROM src.otel_traces ORDER BY rowid")
        stored = con.execute("SELECT count(*) FROM otel_traces").fetchall()[0][0]
        metrics = metrics_source(con)
        metrics.wait_s = 0.0
        metrics.ledger.step_rows = 40
        mid = None
        for _ in range(200):
            page = _parsed(metrics(None)[0])
            if metrics._thread is not None and metrics._thread.is_alive() and _value(
                    page["kvscope_live_pending_span_rows"],
                    "kvscope_live_pending_span_rows") > 0:
                mid = page
                break
            time.sleep(0.01)
        assert mid is not None  # answered while the refresh was still reading
        pending = _value(mid["kvscope_live_pending_span_rows"], "kvscope_live_pending_span_rows")
        assert 0 < pending <= stored
        assert mid["kvscope_live_refreshes"][0].value == 0
        assert metrics._thread is not None
        metrics._thread.join()
        metrics.wait_s = 30.0
        done = _parsed(metrics(None)[0])
        assert _value(done["kvscope_live_pending_span_rows"],
                      "kvscope_live_pending_span_rows") == 0
        at_once = LiveLedger(con)
        at_once.refresh()
        assert metrics.ledger.totals() == at_once.totals()
        # A new run's spans arrive; close() (the receiver stopping) ends the refresh early.
        con.execute("INSERT INTO otel_traces SELECT * FROM src.otel_traces ORDER BY rowid")
        metrics.wait_s = 0.0
        metrics(None)
        metrics.close()
        assert metrics._thread is not None and not metrics._thread.is_alive()
        closed = _parsed(generate_latest(metrics.registry))
        assert _value(closed["kvscope_live_pending_span_rows"],
                      "kvscope_live_pending_span_rows") > 0
    finally:
        con.close()


def _parsed(text: bytes | str) -> dict[str, list]:
    families: dict[str, list] = {}
    for family in text_string_to_metric_families(
            text.decode() if isinstance(text, bytes) else text):
        families[family.name] = family.samples
    return families


def _scrape(url: str, accept: str | None = None) -> dict[str, list]:
    headers = {"Accept": accept} if accept else {}
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    assert response.status_code == 200
    families: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        families[family.name] = family.samples
    return families


def _analyze(capsys: pytest.CaptureFixture[str], db: Path, name: str) -> list[dict]:
    capsys.readouterr()
    assert cli.main(["analyze", str(db), name, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def _wait_for_gauges(receiver: Any, count: int) -> None:
    """Wait (10 s at most) until the receiver has stored ``count`` gauge points."""
    deadline = time.monotonic() + 10
    while receiver.writer.connection.cursor().execute(
            "SELECT count(*) FROM otel_metrics_gauge").fetchone()[0] < count:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _send_gauges(url: str, run_id: str) -> None:
    """Retained-KV and GPU-memory gauges over real OTLP/HTTP, as engines and the sampler send."""
    values = {"retained": [3 << 20, 5 << 20], "used": [40 << 30], "total": [80 << 30]}
    exporter = OTLPMetricExporter(endpoint=f"{url}/v1/metrics")
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    provider = MeterProvider(
        resource=Resource.create({"service.name": semconv.SERVICE_DECODE,
                                  semconv.RUN_ID: run_id}),
        metric_readers=[reader])
    meter = provider.get_meter("test")
    retained = meter.create_gauge(semconv.METRIC_KV_RETAINED, unit="By")
    used = meter.create_gauge(semconv.METRIC_GPU_MEMORY_USED, unit="By")
    total = meter.create_gauge(semconv.METRIC_GPU_MEMORY_TOTAL, unit="By")
    for value in values["retained"]:
        retained.set(value, {semconv.ENGINE_ID: "decode-0"})
        reader.collect()
    used.set(values["used"][0], {semconv.GPU_HOST: "node-1", semconv.GPU_INDEX: "0"})
    total.set(values["total"][0], {semconv.GPU_HOST: "node-1", semconv.GPU_INDEX: "0"})
    reader.collect()
    provider.shutdown()


def _value(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_scrape_agrees_with_analyze(source: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``kvscope serve``'s receiver, filled batch by batch through its own writer, scraped over
    HTTP; every ledger number equals what ``kvscope analyze`` prints for the same store."""
    db = tmp_path / "served.duckdb"
    receiver = _serving_runs_of(source, db, metrics=metrics_source)
    try:
        for batch in _shuffled_batches(source, 5, 3):
            assert receiver.writer.submit_traces(batch.cast(TRACES_ARROW))
            assert receiver.writer.flush(30)
            _scrape(receiver.url)  # each scrape refreshes what arrived since the last one
        runs = dict(receiver.writer.connection.cursor().execute(
            "SELECT label, run_id FROM kvscope_runs").fetchall())
        _send_gauges(receiver.url, runs["faults"])
        _wait_for_gauges(receiver, 4)
        receiver.writer.flush(30)
        families = _scrape(receiver.url)
        openmetrics = httpx.get(f"{receiver.url}/metrics", timeout=30,
                                headers={"Accept": "application/openmetrics-text"})
    finally:
        receiver.stop()
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")

    ledger_rows = pl.DataFrame(_analyze(capsys, db, "ledger"))
    reuse = {row["run_id"]: row for row in _analyze(capsys, db, "reuse_rate")}
    labels = {run_id: label for label, run_id in runs.items()}
    turns = families[live_metrics.TURNS]
    for run_id, outcome, count in ledger_rows.group_by(["run_id", "outcome"]).len().rows():
        assert _value(turns, live_metrics.TURNS, run_id=run_id, outcome=outcome) == count, outcome
        # The run's label, not its id, names it.
        assert _value(turns, live_metrics.TURNS, run=labels[run_id], outcome=outcome) == count
    assert sum(s.value for s in turns) == ledger_rows.height
    for run_id, row in reuse.items():
        pairs = {live_metrics.REUSABLE_TOKENS: "reusable_tokens",
                 live_metrics.REUSED_LOCAL_TOKENS: "local_tokens",
                 live_metrics.REUSED_REMOTE_TOKENS: "remote_tokens",
                 live_metrics.RECOMPUTED_TOKENS: "recomputed_tokens"}
        for series, column in pairs.items():
            assert _value(families[series], series, run_id=run_id) == row[column], series
        scraped = _value(families[live_metrics.REUSED_LOCAL_TOKENS],
                         live_metrics.REUSED_LOCAL_TOKENS, run_id=run_id)
        scraped += _value(families[live_metrics.REUSED_REMOTE_TOKENS],
                          live_metrics.REUSED_REMOTE_TOKENS, run_id=run_id)
        reusable = _value(families[live_metrics.REUSABLE_TOKENS], live_metrics.REUSABLE_TOKENS,
                          run_id=run_id)
        assert scraped / reusable == pytest.approx(row["token_reuse_rate"])
    invalid = ledger_rows.filter(pl.col("outcome") == "reused_invalid")
    assert invalid.height > 0
    assert _value(families[live_metrics.INVALID_REUSE_TURNS],
                  live_metrics.INVALID_REUSE_TURNS) == invalid.height
    assert _value(turns, live_metrics.TURNS, model="other-model") == ledger_rows.filter(
        pl.col("run_id") == runs["plain"]).height

    # TTFT: one observation per turn with a TTFT, sum in seconds.
    ttft = families[live_metrics.TTFT_SECONDS]
    with_ttft = ledger_rows.filter(pl.col("ttft_ms").is_not_null())
    assert _value(ttft, live_metrics.TTFT_SECONDS + "_count") == with_ttft.height
    assert _value(ttft, live_metrics.TTFT_SECONDS + "_sum") == pytest.approx(
        with_ttft["ttft_ms"].sum() / 1e3)
    # Transfers against the store's own spans, by direction and status.
    con = duckdb.connect(str(db), read_only=True)
    try:
        transfers = con.execute(
            f"SELECT SpanAttributes['{semconv.TRANSFER_DIRECTION}'], "
            f"SpanAttributes['{semconv.TRANSFER_STATUS}'], count(*), "
            f"sum(TRY_CAST(SpanAttributes['{semconv.TRANSFER_BYTES}'] AS BIGINT)) "
            f"FROM otel_traces WHERE SpanName = '{semconv.SPAN_KV_TRANSFER}' GROUP BY ALL"
        ).fetchall()
    finally:
        con.close()
    assert len(transfers) >= 2
    for direction, status, count, size in transfers:
        assert _value(families[live_metrics.TRANSFERS], live_metrics.TRANSFERS + "_total",
                      direction=direction, status=status) == count
        assert _value(families[live_metrics.TRANSFER_BYTES],
                      live_metrics.TRANSFER_BYTES + "_total", direction=direction,
                      status=status) == (size or 0)
    # Gauges: the latest sample per engine / GPU, labelled with the run.
    assert _value(families[live_metrics.RETAINED_BYTES], live_metrics.RETAINED_BYTES,
                  engine="decode-0", run="faults") == 5 << 20
    assert _value(families[live_metrics.GPU_USED_BYTES], live_metrics.GPU_USED_BYTES,
                  host="node-1", gpu="0") == 40 << 30
    assert _value(families[live_metrics.GPU_TOTAL_BYTES], live_metrics.GPU_TOTAL_BYTES,
                  host="node-1", gpu="0") == 80 << 30


def test_a_series_no_turn_measured_is_absent_not_zero() -> None:
    """Turns whose engine left no evidence (remote and local null) add no reuse series: the
    series is absent from /metrics, never 0 (issue 30)."""
    from kvscope.analysis.ledger import LEDGER_SCHEMA

    def turn(conv: str, **values: Any) -> dict[str, Any]:
        row = {name: None for name in LEDGER_SCHEMA}
        row.update(run_id="r", conversation_id=conv, x_request_id=f"x-{conv}", turn_index=2,
                   outcome="unknown", reusable_tokens=400, **values)
        return row

    models = pl.DataFrame({"x_request_id": ["x-a"], "model": ["m"]})
    unmeasured = pl.DataFrame([turn("a")], schema=LEDGER_SCHEMA)
    series = {name for unit in contributions(unmeasured, models, {}).values()
              for name, _ in unit}
    assert live_metrics.REUSABLE_TOKENS in series
    assert live_metrics.REUSED_REMOTE_TOKENS not in series
    assert live_metrics.REUSED_LOCAL_TOKENS not in series
    assert live_metrics.RECOMPUTED_TOKENS not in series
    measured = pl.DataFrame([turn("b", local_hit_tokens=0, remote_reused_tokens=0,
                                  recomputed_reusable_tokens=400)], schema=LEDGER_SCHEMA)
    values = {name: value for unit in contributions(measured, models, {}).values()
              for (name, _), value in unit.items()}
    assert values[live_metrics.REUSED_REMOTE_TOKENS] == 0.0  # measured 0 stays 0
    assert values[live_metrics.RECOMPUTED_TOKENS] == 400.0


def test_what_was_let_go_is_remembered_exactly() -> None:
    """The live ledger remembers what it let go by 64-bit hashes: every string added is seen,
    across merges of the pending ones, and none of 200,000 never added is. The fixed 1 MiB Bloom
    filter before said "seen" for ~75 of them at 300,000 added (and for ~16 % of keys at the ~2M
    a 1M-turn store lets go: each a needless read of the store)."""
    seen = _Seen()
    added = [f"chatcmpl-r-{i}-1-{i:08x}" for i in range(300_000)]
    for row, text in enumerate(added):
        seen.add(text, 1000 + row)
    seen.add(added[0], 5)  # again: kept once, with the lower row
    seen.add(added[1], 5000)  # again with a higher row: keeps its first
    assert len(seen) == len(added)
    assert all(text in seen for text in added)
    assert not any(f"cmpl-other-{i}" in seen for i in range(200_000))
    # Each string's row, across merges: the lowest it was added with.
    assert seen.first_row(added[0]) == 5 and seen.first_row(added[1]) == 1001
    assert [seen.first_row(t) for t in added[2:2000]] == list(range(1002, 3000))
    assert seen.lowest_row([added[9], "never", added[7]]) == 1007
    assert seen.lowest_row(["never"]) is None and seen.first_row("never") is None
