"""Retention cost and retained memory: exact numbers on hand-built frames, properties, and
simulator runs (with gauges and an open retention added through the store's own row builders)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope import semconv
from kvscope.analysis import registry
from kvscope.analysis.ledger import LEDGER_SCHEMA
from kvscope.analysis.retention import (
    COST_COLUMNS,
    GIB,
    MEMORY_COLUMNS,
    RETENTION_SCHEMA,
    SAMPLE_SCHEMA,
    SOURCE_GPU_TOTAL,
    SOURCE_GPU_USED,
    SOURCE_RETAINED_GAUGE,
    SOURCE_RETENTION_SPANS,
    observed_range,
    retained_series,
    retention_cost_table,
)
from kvscope.emulator.simulator import SimulationResult, SimulationSettings, simulate
from kvscope.emulator.workloads import synthetic
from kvscope.reuse import outcomes
from kvscope.store.database import open_store
from kvscope.store.query import Query
from kvscope.store.rows import GaugeRows, TraceRows
from kvscope.store.schema import GAUGE_TABLE, TRACES_TABLE
from kvscope.store.writer import insert_arrow

T0 = dt.datetime(2026, 1, 1)
S = 1_000_000_000


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(microseconds=round(seconds * 1e6))


def _typed(rows: Iterable[dict[str, Any]], schema: Mapping[str, Any]) -> pl.DataFrame:
    """``rows`` as a frame of ``schema``; a column a row does not set is null."""
    return pl.DataFrame([{name: row.get(name) for name in schema} for row in rows], schema=schema)


def retentions_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Typed retention rows from (start_s, held_s, size_bytes, reason, ...) dicts."""
    return _typed(({"run_id": "r1", "engine_id": "d0", "ttl_s": 480.0, **row,
                    "start": _at(row["start_s"]), "duration_ns": round(row["held_s"] * S)}
                   for row in rows), RETENTION_SCHEMA)


def ledger_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """A ledger with the given columns set and every other column null."""
    full = [{"run_id": "r1", "arrival_s": 0.0, "turn_ms": 100.0, **row} for row in rows]
    return _typed(({**row, "arrival": _at(row["arrival_s"]),
                    "end": _at(row["arrival_s"] + row["turn_ms"] / 1000.0)} for row in full),
                  LEDGER_SCHEMA)


def samples_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    return _typed(({**row, "time": _at(row["t_s"])} for row in rows), SAMPLE_SCHEMA)


# --- retention_cost, pure ---------------------------------------------------------------------

def test_gib_seconds_split_by_how_each_retention_ended() -> None:
    gib = int(GIB)
    retentions = retentions_frame([
        dict(request_id="a", start_s=0.0, held_s=10.0, size_bytes=gib, reason="read"),
        dict(request_id="b", start_s=0.0, held_s=5.0, size_bytes=gib, reason="notified"),
        dict(request_id="c", start_s=0.0, held_s=480.0, size_bytes=gib, reason="expired"),
        # Still pinned when the data ends: held until the last observed time (700 s).
        dict(request_id="d", start_s=100.0, held_s=0.0, size_bytes=gib, reason="open"),
    ])
    ledger = ledger_frame([dict(conversation_id="x", turn_index=1, turn_ms=700_000.0)])
    table = retention_cost_table(retentions, ledger)
    assert table.schema == pl.Schema(COST_COLUMNS)
    row = table.to_dicts()[0]
    assert (row["retentions"], row["released_read"], row["released_notified"], row["expired"],
            row["open"]) == (4, 1, 1, 1, 1)
    assert row["gib_s_useful"] == pytest.approx(10.0)
    assert row["gib_s_idle"] == pytest.approx(5.0)
    assert row["gib_s_wasted"] == pytest.approx(480.0)
    assert row["gib_s_open"] == pytest.approx(600.0)
    assert row["gib_s_total"] == pytest.approx(1095.0)
    assert row["useful_share"] == pytest.approx(10.0 / 1095.0)
    assert row["open_held_until"] == _at(700.0)
    # Hold times of released retentions only (5, 10, 480 s), against the TTL.
    assert row["held_s_p50"] == pytest.approx(10.0)
    assert row["held_s_p90"] == pytest.approx(10.0 + 0.8 * 470.0)
    assert row["held_s_max"] == pytest.approx(480.0)
    assert row["ttl_s"] == 480.0
    assert row["held_p90_of_ttl"] == pytest.approx(386.0 / 480.0)
    # No turn reused remotely: nothing saved, and no ratio to divide by it.
    assert row["reused_remote_turns"] == 0 and row["prefill_s_saved"] == 0.0
    assert row["gib_s_per_prefill_s_saved"] is None
    assert row["saved_basis"].startswith("no reused_remote turns")


def test_unmeasured_sizes_give_null_gib_seconds_not_zero() -> None:
    retentions = retentions_frame([
        dict(request_id="a", start_s=0.0, held_s=10.0, size_bytes=None, reason="read"),
        dict(request_id="b", start_s=0.0, held_s=20.0, size_bytes=None, reason="expired"),
    ])
    row = retention_cost_table(retentions, ledger_frame([])).to_dicts()[0]
    assert row["retentions"] == 2 and row["released_read"] == 1
    assert row["gib_s_useful"] is None and row["gib_s_wasted"] is None
    assert row["gib_s_total"] is None and row["useful_share"] is None
    assert row["gib_s_idle"] == 0.0  # no retention was released that way: a measured zero


def _fit_ledger(run_id: str = "r1", fitting: int = 12) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [
        # Turn 1s are left out of the fit (a shared-prefix hit is invisible there): if they
        # were in, these wild legs would spoil the exact line below.
        dict(run_id=run_id, conversation_id=f"{run_id}-c{i}", turn_index=1, prompt_tokens=5000,
             local_hit_tokens=0, prefill_ms=5.0) for i in range(3)
    ]
    for i in range(fitting):
        computed = 500 + 300 * i
        rows.append(dict(
            run_id=run_id, conversation_id=f"{run_id}-c{i % 3}", turn_index=2 + i,
            prompt_tokens=computed + 1000, local_hit_tokens=1000,
            prefill_ms=100.0 + 0.05 * computed, outcome=outcomes.BELOW_THRESHOLD,
        ))
    return rows


def _reused(run_id: str, handle: str, prefill_ms: float) -> dict[str, Any]:
    return dict(run_id=run_id, conversation_id=f"{run_id}-r", turn_index=5, prompt_tokens=5000,
                local_hit_tokens=1000, remote_reused_tokens=3900, prefill_ms=prefill_ms,
                d2p_status=semconv.TRANSFER_OK, d2p_ms=20.0, retention_id=handle,
                outcome=outcomes.REUSED_REMOTE)


def test_prefill_seconds_saved_from_a_fit_over_recomputing_turns() -> None:
    gib = int(GIB)
    retentions = retentions_frame([
        dict(request_id="h1", engine_id="d0", start_s=0.0, held_s=9.0, size_bytes=gib,
             reason="read"),
        dict(request_id="h2", engine_id="d1", start_s=0.0, held_s=18.0, size_bytes=gib,
             reason="read"),
    ])
    ledger = ledger_frame(_fit_ledger() + [_reused("r1", "h1", 120.0), _reused("r1", "h2", 150.0)])
    table = retention_cost_table(retentions, ledger)
    by = {r["engine_id"]: r for r in table.to_dicts()}
    for row in by.values():
        assert row["fit_turns"] == 12
        assert row["fit_fixed_ms"] == pytest.approx(100.0)
        assert row["fit_ms_per_token"] == pytest.approx(0.05)
        assert row["fit_r2"] == pytest.approx(1.0)
        assert row["reused_remote_turns"] == 1
        assert row["saved_basis"].startswith("estimate:")
    # Recomputing 5000 - 1000 tokens would take 100 + 0.05 * 4000 = 300 ms.
    assert by["d0"]["prefill_s_saved"] == pytest.approx(0.180)
    assert by["d1"]["prefill_s_saved"] == pytest.approx(0.150)
    assert by["d0"]["gib_s_per_prefill_s_saved"] == pytest.approx(9.0 / 0.180)
    assert by["d1"]["gib_s_per_prefill_s_saved"] == pytest.approx(18.0 / 0.150)

    # Too few recomputing turns: not measured, and the reason says so.
    strict = retention_cost_table(retentions, ledger, min_fit_turns=13).to_dicts()
    for row in strict:
        assert row["prefill_s_saved"] is None and row["gib_s_per_prefill_s_saved"] is None
        assert row["saved_basis"].startswith("not measured: 12 turns")


def test_a_fit_over_all_runs_prices_a_run_that_cannot_fit_itself() -> None:
    gib = int(GIB)
    retentions = retentions_frame([
        dict(run_id="r2", request_id="h9", start_s=0.0, held_s=1.0, size_bytes=gib,
             reason="read"),
    ])
    ledger = ledger_frame(_fit_ledger("r1") + [_reused("r2", "h9", 100.0)])
    per_run = retention_cost_table(retentions, ledger, fit_by="run")
    row = per_run.filter(pl.col("run_id") == "r2").to_dicts()[0]
    assert row["prefill_s_saved"] is None and row["fit_turns"] is None
    pooled = retention_cost_table(retentions, ledger, fit_by="all")
    row = pooled.filter(pl.col("run_id") == "r2").to_dicts()[0]
    assert row["fit_turns"] == 12 and row["prefill_s_saved"] == pytest.approx(0.200)


_retention = st.fixed_dictionaries({
    "start_s": st.floats(0.0, 1000.0), "held_s": st.floats(0.0, 600.0),
    "size_bytes": st.integers(1, 1 << 34),
    "reason": st.sampled_from(semconv.RELEASE_REASONS),
    "engine_id": st.sampled_from(["d0", "d1"]),
})


@settings(max_examples=40, deadline=None)
@given(st.lists(_retention, min_size=1, max_size=30), st.floats(0.5, 120.0))
def test_classes_add_up_and_the_series_integral_is_the_gib_seconds(
    rows: list[dict[str, Any]], step_s: float,
) -> None:
    retentions = retentions_frame([dict(r, request_id=str(i)) for i, r in enumerate(rows)])
    ledger = ledger_frame([])
    cost = retention_cost_table(retentions, ledger)
    for row in cost.to_dicts():
        parts = sum(row[f"gib_s_{c}"] for c in ("useful", "idle", "wasted", "open"))
        assert parts == pytest.approx(row["gib_s_total"], rel=1e-9)
    series = retained_series(retentions, samples_frame([]), observed_range(ledger, retentions),
                             step_s=step_s, max_points=500)
    integral = series.group_by("engine_id").agg(
        (pl.col("mean_bytes") * pl.col("step_s")).sum().alias("byte_s"),
        pl.len().alias("bins"), pl.col("max_bytes").max())
    for row in integral.to_dicts():
        engine = cost.filter(pl.col("engine_id") == row["engine_id"]).to_dicts()[0]
        assert row["byte_s"] == pytest.approx(engine["gib_s_total"] * GIB, rel=1e-6, abs=1e3)
        assert row["bins"] <= 500
        sizes = sum(r["size_bytes"] for r in rows if r["engine_id"] == row["engine_id"])
        assert row["max_bytes"] <= sizes


# --- retained_memory, pure --------------------------------------------------------------------

def test_step_function_resampled_to_bins() -> None:
    retentions = retentions_frame([
        dict(request_id="a", start_s=0.0, held_s=20.0, size_bytes=100, reason="read"),
        dict(request_id="b", start_s=5.0, held_s=10.0, size_bytes=50, reason="expired"),
    ])
    ledger = ledger_frame([])
    series = retained_series(retentions, samples_frame([]), observed_range(ledger, retentions),
                             step_s=10.0)
    assert series.schema == pl.Schema(MEMORY_COLUMNS)
    assert series["source"].unique().to_list() == [SOURCE_RETENTION_SPANS]
    assert series["time"].to_list() == [_at(0.0), _at(10.0), _at(20.0)]
    assert series["mean_bytes"].to_list() == pytest.approx([125.0, 125.0, 0.0])
    assert series["max_bytes"].to_list() == pytest.approx([150.0, 150.0, 0.0])
    assert series["points"].to_list() == [2, 1, 1]
    assert series["step_s"].to_list() == [10.0, 10.0, 10.0]


def test_a_long_run_gets_a_longer_step_and_stays_bounded() -> None:
    retentions = retentions_frame([
        dict(request_id=str(i), start_s=i * 10.0, held_s=5.0, size_bytes=1, reason="read")
        for i in range(1000)
    ])
    series = retained_series(retentions, samples_frame([]),
                             observed_range(ledger_frame([]), retentions), step_s=1.0,
                             max_points=50)
    assert series.height <= 51
    assert series["step_s"].min() >= 9995.0 / 49
    assert (series["mean_bytes"] * series["step_s"]).sum() == pytest.approx(5000.0)


def test_gauges_beside_spans_and_unlabelled_gpu_samples_join_the_run_they_overlap() -> None:
    retentions = retentions_frame([
        dict(request_id="a", start_s=0.0, held_s=20.0, size_bytes=100, reason="read"),
    ])
    samples = samples_frame([
        dict(run_id="r1", source=SOURCE_RETAINED_GAUGE, engine_id="d0", t_s=1.0, value=10.0),
        dict(run_id="r1", source=SOURCE_RETAINED_GAUGE, engine_id="d0", t_s=2.0, value=20.0),
        dict(run_id="r1", source=SOURCE_RETAINED_GAUGE, engine_id="d0", t_s=11.0, value=30.0),
        dict(run_id=None, source=SOURCE_GPU_USED, gpu_host="h", gpu_index="0", t_s=3.0,
             value=7e9),
        dict(run_id=None, source=SOURCE_GPU_USED, gpu_host="h", gpu_index="0", t_s=5000.0,
             value=9e9),
        dict(run_id="r1", source=SOURCE_GPU_TOTAL, gpu_host="h", gpu_index="0", t_s=3.0,
             value=80e9),
    ])
    ledger = ledger_frame([])
    series = retained_series(retentions, samples, observed_range(ledger, retentions, samples),
                             step_s=10.0)
    gauge = series.filter(pl.col("source") == SOURCE_RETAINED_GAUGE)
    assert gauge["mean_bytes"].to_list() == pytest.approx([15.0, 30.0])
    assert gauge["max_bytes"].to_list() == pytest.approx([20.0, 30.0])
    assert gauge["points"].to_list() == [2, 1]
    used = series.filter(pl.col("source") == SOURCE_GPU_USED)
    # The sample at 5000 s lies outside every run's observed range: not attached.
    assert used.select("run_id", "gpu_host", "gpu_index", "mean_bytes").rows() == [
        ("r1", "h", "0", 7e9)]
    assert series.filter(pl.col("source") == SOURCE_GPU_TOTAL).height == 1


# --- end to end on simulator data -------------------------------------------------------------

def _add_gauges_and_an_open_retention(db: Path, run_id: str, start_ns: int) -> None:
    gauges = GaugeRows()
    run_attrs = [("service.name", semconv.SERVICE_DECODE), (semconv.RUN_ID, run_id)]
    sampler = [("service.name", semconv.SERVICE_GPU_SAMPLER)]
    common: dict[str, Any] = dict(
        resource_schema_url="", scope_name=semconv.SCOPE_NAME, scope_version="",
        scope_attributes=[], scope_dropped_attr_count=0, scope_schema_url="",
        metric_description="", metric_unit="By", flags=0,
    )
    for i in range(5):
        t = start_ns + i * 15 * S
        gauges.add(resource_attributes=run_attrs, service_name=semconv.SERVICE_DECODE,
                   metric_name=semconv.METRIC_KV_RETAINED,
                   attributes=[(semconv.ENGINE_ID, "decode-0")], start_time_ns=t, time_ns=t,
                   value=float(i), **common)
        gauges.add(resource_attributes=sampler, service_name=semconv.SERVICE_GPU_SAMPLER,
                   metric_name=semconv.METRIC_GPU_MEMORY_USED,
                   attributes=[(semconv.GPU_HOST, "node-a"), (semconv.GPU_INDEX, "0")],
                   start_time_ns=t, time_ns=t, value=1e9 * (i + 1), **common)
    spans = TraceRows()
    spans.add(
        timestamp_ns=start_ns + 30 * S, trace_id="0" * 32, span_id="1" * 16, parent_span_id="",
        trace_state="", span_name=semconv.SPAN_KV_RETENTION, span_kind="SPAN_KIND_INTERNAL",
        service_name=semconv.SERVICE_DECODE, resource_attributes=run_attrs,
        scope_name=semconv.SCOPE_NAME, scope_version="",
        span_attributes=[
            (semconv.VLLM_REQUEST_ID, "chatcmpl-still-open-00000000"),
            (semconv.ENGINE_ID, "decode-0"), (semconv.RETENTION_BYTES, str(1 << 30)),
            (semconv.RETENTION_TTL_S, "30.0"), (semconv.RETENTION_RELEASE_REASON, "open"),
        ],
        duration_ns=0, status_code="STATUS_CODE_UNSET", status_message="", events=[], links=[],
    )
    con = open_store(db)
    try:
        insert_arrow(con, GAUGE_TABLE, gauges.to_arrow())
        insert_arrow(con, TRACES_TABLE, spans.to_arrow())
    finally:
        con.close()


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory,
              ) -> tuple[Path, SimulationResult, SimulationResult]:
    db = tmp_path_factory.mktemp("retention") / "sim.duckdb"
    workload = synthetic.generate(
        seed=5, conversations=12, turns_p50=6, max_turns=10, system_prompt_tokens=512,
        new_input_tokens_p50=300, think_time_p50_s=5, think_time_p90_s=60,
        reset_probability=0.0, subagent_probability=0.0,
    )
    on = simulate(workload, db, SimulationSettings(profile="tiny", label="ON",
                                                   decoder_kv_blocks_ttl=30.0, seed=2))
    off = simulate(workload, db, SimulationSettings(profile="tiny", label="OFF", seed=2,
                                                    prefill_bidirectional_kv_xfer=False))
    _add_gauges_and_an_open_retention(db, on.run_id, 1_767_225_600 * S)
    return db, on, off


def test_retention_cost_on_simulated_runs(
    simulated: tuple[Path, SimulationResult, SimulationResult],
) -> None:
    db, on, off = simulated
    assert {"retention_cost", "retained_memory"} <= set(registry.analyses())
    with registry.AnalysisContext.open(db) as ctx:
        cost = registry.run(ctx, "retention_cost", {"fit": "all"})
        # Independent of the analysis: counts and byte-seconds straight from the spans.
        _, counted = ctx.reader.rows(
            Query("SELECT ResourceAttributes[?], SpanAttributes[?], count(*), "
                  "sum(CAST(SpanAttributes[?] AS DOUBLE) * Duration / 1e9) "
                  "FROM otel_traces WHERE SpanName = ? GROUP BY 1, 2",
                  positional=(semconv.RUN_ID, semconv.RETENTION_RELEASE_REASON,
                              semconv.RETENTION_BYTES, semconv.SPAN_KV_RETENTION)))
        _, span_ends = ctx.reader.rows(
            Query("SELECT ResourceAttributes[?], max(epoch_ns(Timestamp) + Duration) FROM "
                  "otel_traces WHERE SpanName IN (?, ?) GROUP BY 1",
                  positional=(semconv.RUN_ID, semconv.SPAN_TURN, semconv.SPAN_KV_RETENTION)))
        ledger = ctx.ledger()
    assert cost.schema == pl.Schema(COST_COLUMNS)
    rows = {r["run_id"]: r for r in cost.to_dicts()}
    assert set(rows) == {on.run_id, off.run_id}
    column = {"read": "released_read", "notified": "released_notified", "expired": "expired",
              "open": "open"}
    byte_s = {run: 0.0 for run in rows}
    for run, reason, count, closed_byte_s in counted:
        assert rows[run][column[reason]] == count
        byte_s[run] += closed_byte_s
    on_row, off_row = rows[on.run_id], rows[off.run_id]
    # The open retention (1 GiB from 30 s) is held to the run's last observed time.
    # The run's last observed moment: its last turn's last byte or a later reaper release.
    start_ns = 1_767_225_600 * S
    last_ns = max(end_ns for run, end_ns in span_ends if run == on.run_id)
    open_s = (last_ns - start_ns) / S - 30.0
    held_until = cost.filter(pl.col("run_id") == on.run_id)["open_held_until"].dt.epoch("ns")
    assert on_row["open"] == 1 and held_until.to_list() == [last_ns]
    assert on_row["gib_s_open"] == pytest.approx(open_s, rel=1e-9)
    assert on_row["gib_s_total"] * GIB == pytest.approx(byte_s[on.run_id] + open_s * GIB,
                                                        rel=1e-7)
    assert off_row["gib_s_total"] * GIB == pytest.approx(byte_s[off.run_id], rel=1e-9)
    # Reads are what the ON run's reused_remote turns did; a 30 s TTL lets some handles expire.
    reused = ledger.filter((pl.col("run_id") == on.run_id)
                           & (pl.col("outcome") == outcomes.REUSED_REMOTE)).height
    assert on_row["reused_remote_turns"] == reused > 0
    assert on_row["expired"] > 0 and on_row["gib_s_wasted"] > 0
    assert on_row["held_s_max"] <= 30.0 + 1e-6 and on_row["ttl_s"] == 30.0
    # The OFF run never reads: everything it kept was wasted, nothing saved.
    assert off_row["released_read"] == 0 and off_row["useful_share"] == 0.0
    assert off_row["prefill_s_saved"] == 0.0
    # The fit recovers the tiny profile's prefill line: 2 ms + 0.01 ms per computed token.
    assert on_row["fit_ms_per_token"] == pytest.approx(0.01, rel=1e-3)
    assert on_row["fit_fixed_ms"] == pytest.approx(2.0, rel=1e-2)
    assert on_row["fit_r2"] == pytest.approx(1.0, abs=1e-6)
    assert on_row["prefill_s_saved"] > 0
    assert on_row["gib_s_per_prefill_s_saved"] == pytest.approx(
        on_row["gib_s_total"] / on_row["prefill_s_saved"])


def test_retained_memory_on_simulated_runs(
    simulated: tuple[Path, SimulationResult, SimulationResult],
) -> None:
    db, on, off = simulated
    with registry.AnalysisContext.open(db, runs=[on.run_id]) as ctx:
        series = registry.run(ctx, "retained_memory", {"step_s": 5.0, "max_points": 100})
        cost = registry.run(ctx, "retention_cost")
    assert series.schema == pl.Schema(MEMORY_COLUMNS)
    assert set(series["run_id"]) == {on.run_id}
    assert set(series["source"]) == {SOURCE_RETENTION_SPANS, SOURCE_RETAINED_GAUGE,
                                     SOURCE_GPU_USED}
    spans = series.filter(pl.col("source") == SOURCE_RETENTION_SPANS)
    assert spans.height <= 100
    area = (spans["mean_bytes"] * spans["step_s"]).sum()
    assert area == pytest.approx(cost["gib_s_total"].sum() * GIB, rel=1e-6)
    gpu = series.filter(pl.col("source") == SOURCE_GPU_USED)
    assert gpu["gpu_host"].unique().to_list() == ["node-a"]
    assert gpu["max_bytes"].max() == pytest.approx(5e9)


def test_a_notify_that_moved_bytes_counts_as_a_read() -> None:
    from kvscope.analysis.retention import read_handles, upgrade_reads

    retentions = pl.DataFrame({
        "run_id": ["r", "r"], "engine_id": ["d", "d"], "request_id": ["h1", "h2"],
        "start": [0, 0], "duration_ns": [5, 5], "size_bytes": [10, 10], "ttl_s": [480.0, 480.0],
        "reason": [semconv.RELEASE_NOTIFIED, semconv.RELEASE_NOTIFIED],
    })
    ledger = pl.DataFrame({
        "retention_id": ["h1", "h2"], "d2p_status": [semconv.TRANSFER_OK, semconv.TRANSFER_OK],
        "d2p_bytes": [4096, 0],
    })
    out = upgrade_reads(retentions, read_handles(ledger))
    assert out["reason"].to_list() == [semconv.RELEASE_READ, semconv.RELEASE_NOTIFIED]


def test_a_pin_time_snapshot_yields_to_its_release() -> None:
    """vLLM's hooks record a long-held retention open (no end) and then its release: one
    retention, released; a snapshot with no release stays open (the engine was killed)."""
    from kvscope.analysis.retention import shape_retentions
    from kvscope.analysis.whatif import shape_retentions as whatif_retentions

    gib = str(int(GIB))
    raw = pl.DataFrame([
        {"run_id": "r1", "engine_id": "d0", "request_id": "a", "start": _at(0.0),
         "duration_ns": 0, "size_bytes": gib, "ttl_s": "480", "reason": "open"},
        {"run_id": "r1", "engine_id": "d0", "request_id": "a", "start": _at(0.0),
         "duration_ns": 30 * S, "size_bytes": gib, "ttl_s": "480", "reason": "read"},
        {"run_id": "r1", "engine_id": "d0", "request_id": "b", "start": _at(50.0),
         "duration_ns": 0, "size_bytes": gib, "ttl_s": "480", "reason": "open"},
    ], schema_overrides={"duration_ns": pl.UInt64()})
    typed = shape_retentions(raw)
    assert typed.select("request_id", "reason").rows() == [("a", "read"), ("b", "open")]
    ledger = ledger_frame([dict(conversation_id="x", turn_index=1, turn_ms=100_000.0)])
    row = retention_cost_table(typed, ledger).to_dicts()[0]
    assert (row["retentions"], row["released_read"], row["open"]) == (2, 1, 1)
    assert row["gib_s_useful"] == pytest.approx(30.0)
    assert row["gib_s_open"] == pytest.approx(50.0)  # held from 50 s to the data's end, 100 s
    what = whatif_retentions(raw.drop("engine_id", "start").with_columns(tokens=pl.lit("10")))
    assert what.select("request_id", "reason").rows() == [("a", "read"), ("b", "open")]
