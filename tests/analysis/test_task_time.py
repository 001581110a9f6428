"""Task time: exact splits on hand-built ledgers, a sum property, and simulator runs end to end."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope import semconv
from kvscope.analysis import registry
from kvscope.analysis.ledger import LEDGER_SCHEMA
from kvscope.analysis.task_time import (
    COLUMNS,
    COMPONENTS,
    ENGINE_COMPONENTS,
    SUMMARY_COLUMNS,
    task_summary,
    task_table,
)
from kvscope.emulator.simulator import SimulationResult, SimulationSettings, simulate
from kvscope.emulator.workloads import synthetic
from kvscope.store.query import Query

T0 = dt.datetime(2026, 1, 1)


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(microseconds=round(seconds * 1e6))


def ledger_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """A ledger with the given columns set and every other column null.

    Rows give ``arrival_s`` (seconds after T0) and ``turn_ms``; arrival and end follow from them.
    """
    full = []
    for row in rows:
        row = dict(row)
        arrival_s = row.pop("arrival_s")
        row.setdefault("run_id", "r1")
        row["arrival"] = _at(arrival_s)
        row["end"] = _at(arrival_s + row["turn_ms"] / 1000.0)
        full.append({name: row.get(name) for name in LEDGER_SCHEMA})
    return pl.DataFrame(full, schema=LEDGER_SCHEMA)


def _row(frame: pl.DataFrame, conversation: str) -> dict[str, Any]:
    return frame.filter(pl.col("conversation_id") == conversation).to_dicts()[0]


def test_parts_of_a_conversation_with_engine_hooks() -> None:
    ledger = ledger_frame([
        dict(conversation_id="a", turn_index=1, arrival_s=0.0, turn_ms=1000.0, prefill_ms=200.0,
             decode_ms=700.0, p2d_ms=50.0, ttft_ms=300.0, decision=semconv.DECISION_NO_OFFER),
        dict(conversation_id="a", turn_index=2, arrival_s=11.0, turn_ms=2000.0, prefill_ms=400.0,
             d2p_ms=100.0, decode_ms=1500.0, p2d_ms=60.0, ttft_ms=500.0, tool_wait_s=10.0),
        # No tool-wait span: the wait is the gap from turn 2's last byte (13 s) to 18 s.
        dict(conversation_id="a", turn_index=3, arrival_s=18.0, turn_ms=1000.0, prefill_ms=300.0,
             decode_ms=600.0, ttft_ms=500.0, errored=False),
    ])
    row = _row(task_table(ledger), "a")
    assert row["turns"] == 3 and row["errored_turns"] == 0
    assert row["task_s"] == pytest.approx(19.0)
    assert row["input_processing_s"] == pytest.approx(0.8)  # 200 + (400 - 100) + 300 ms
    assert row["transfer_s"] == pytest.approx(0.21)  # 50 + 100 + 60 ms
    assert row["generation_s"] == pytest.approx(2.69)  # (700-50) + (1500-60) + 600 ms
    assert row["tool_wait_s"] == pytest.approx(15.0)
    assert row["proxy_overhead_s"] == pytest.approx(0.3)
    assert row["unaccounted_s"] == pytest.approx(0.0, abs=1e-9)
    assert row["ttft_sum_s"] == pytest.approx(1.3)
    assert row["ttft_share"] == pytest.approx(1.3 / 19.0)


def test_without_engine_hooks_transfer_is_not_measured_and_legs_stay_whole() -> None:
    ledger = ledger_frame([
        dict(conversation_id="b", turn_index=1, arrival_s=0.0, turn_ms=500.0, prefill_ms=100.0,
             decode_ms=300.0),
        dict(conversation_id="b", turn_index=2, arrival_s=2.0, turn_ms=500.0, prefill_ms=100.0,
             decode_ms=300.0, tool_wait_s=1.5),
    ])
    row = _row(task_table(ledger), "b")
    assert row["transfer_s"] is None
    assert row["input_processing_s"] == pytest.approx(0.2)
    assert row["generation_s"] == pytest.approx(0.6)
    assert row["unaccounted_s"] == pytest.approx(0.0, abs=1e-9)
    assert row["ttft_sum_s"] is None and row["ttft_share"] is None


def test_unmeasured_parts_are_null_not_zero() -> None:
    ledger = ledger_frame([
        dict(conversation_id="c", turn_index=1, arrival_s=0.0, turn_ms=250.0, errored=True),
    ])
    row = _row(task_table(ledger), "c")
    assert row["input_processing_s"] is None and row["generation_s"] is None
    assert row["transfer_s"] is None and row["ttft_sum_s"] is None
    assert row["errored_turns"] == 1
    # No leg ran, so the whole turn was the proxy's; a one-turn task waited for no tool.
    assert row["proxy_overhead_s"] == pytest.approx(0.25)
    assert row["tool_wait_s"] == 0.0


def test_a_transfer_outside_any_timed_leg_is_not_counted() -> None:
    # A stalled prefill leg: the turn never reached decode, but a P→D span exists.
    ledger = ledger_frame([
        dict(conversation_id="s", turn_index=1, arrival_s=0.0, turn_ms=1000.0, prefill_ms=1000.0,
             d2p_ms=10.0, p2d_ms=5.0, errored=True),
        dict(conversation_id="s", turn_index=2, arrival_s=3.0, turn_ms=1000.0, prefill_ms=400.0,
             decode_ms=600.0, p2d_ms=20.0, tool_wait_s=2.0),
    ])
    row = _row(task_table(ledger), "s")
    assert row["transfer_s"] == pytest.approx(0.030)
    assert row["generation_s"] == pytest.approx(0.58)
    assert row["unaccounted_s"] == pytest.approx(0.0, abs=1e-9)


def test_overlapping_turns_show_as_negative_unaccounted_time() -> None:
    ledger = ledger_frame([
        dict(conversation_id="o", turn_index=1, arrival_s=0.0, turn_ms=4000.0, prefill_ms=1000.0,
             decode_ms=3000.0),
        dict(conversation_id="o", turn_index=2, arrival_s=1.0, turn_ms=4000.0, prefill_ms=1000.0,
             decode_ms=3000.0),
    ])
    row = _row(task_table(ledger), "o")
    assert row["task_s"] == pytest.approx(5.0)
    assert row["tool_wait_s"] == 0.0  # the inferred gap is clipped at zero
    assert row["unaccounted_s"] == pytest.approx(-3.0)


def test_summary_quantiles_and_shares() -> None:
    table = pl.DataFrame({
        "run_id": ["r", "r", "r"], "conversation_id": ["x", "y", "z"],
        "task_s": [10.0, 20.0, 30.0], "ttft_sum_s": [1.0, 2.0, None],
        "tool_wait_s": [5.0, 10.0, 15.0],
    })
    table = table.with_columns(
        [pl.lit(None, dtype).alias(name) for name, dtype in COLUMNS.items()
         if name not in table.columns]
    ).select(list(COLUMNS))
    summary = task_summary(table)
    assert summary.schema == pl.Schema(SUMMARY_COLUMNS)
    assert summary["component"].to_list() == [*COMPONENTS, *ENGINE_COMPONENTS]
    by = {r["component"]: r for r in summary.to_dicts()}
    assert by["task"]["p50_s"] == 20.0 and by["task"]["total_s"] == 60.0
    assert by["ttft"]["conversations"] == 2
    assert by["ttft"]["p50_s"] == pytest.approx(1.5)
    # Σ TTFT over the task time of the conversations that measured it.
    assert by["ttft"]["share_of_task"] == pytest.approx(3.0 / 30.0)
    assert by["ttft"]["share_p50"] == pytest.approx(0.1)
    assert by["tool_wait"]["share_of_task"] == pytest.approx(0.5)
    assert by["generation"]["conversations"] == 0
    assert by["generation"]["total_s"] is None and by["generation"]["p50_s"] is None


_turn = st.fixed_dictionaries({
    "prefill_ms": st.floats(1.0, 500.0), "decode_ms": st.floats(1.0, 2000.0),
    "overhead_ms": st.floats(0.0, 20.0), "d2p_ms": st.one_of(st.none(), st.floats(0.0, 1.0)),
    "p2d_ms": st.floats(0.0, 1.0), "gap_s": st.floats(0.0, 600.0),
    "wait_span": st.booleans(),
})


@settings(max_examples=60, deadline=None)
@given(st.lists(_turn, min_size=1, max_size=8))
def test_parts_add_up_to_the_task_when_turns_run_one_after_another(
    turns: list[dict[str, Any]],
) -> None:
    rows, clock = [], 0.0
    for i, t in enumerate(turns, start=1):
        turn_ms = t["prefill_ms"] + t["decode_ms"] + t["overhead_ms"]
        if i > 1:
            clock += t["gap_s"]
        rows.append(dict(
            conversation_id="p", turn_index=i, arrival_s=clock, turn_ms=turn_ms,
            prefill_ms=t["prefill_ms"], decode_ms=t["decode_ms"], d2p_ms=t["d2p_ms"],
            p2d_ms=t["p2d_ms"], tool_wait_s=t["gap_s"] if i > 1 and t["wait_span"] else None,
        ))
        clock += turn_ms / 1000.0
    row = _row(task_table(ledger_frame(rows)), "p")
    parts = sum(row[f"{p}_s"] for p in
                ("input_processing", "transfer", "generation", "tool_wait", "proxy_overhead"))
    assert parts == pytest.approx(row["task_s"], rel=1e-6, abs=1e-5)
    assert row["unaccounted_s"] == pytest.approx(0.0, abs=1e-5)


# --- end to end on simulator data ---------------------------------------------------------------

@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SimulationResult]:
    db = tmp_path_factory.mktemp("task_time") / "sim.duckdb"
    workload = synthetic.generate(
        seed=11, conversations=10, turns_p50=5, max_turns=8, system_prompt_tokens=512,
        new_input_tokens_p50=300, think_time_p50_s=5, think_time_p90_s=40,
        reset_probability=0.0, subagent_probability=0.0,
    )
    result = simulate(workload, db, SimulationSettings(profile="tiny", label="ON", seed=1))
    return db, result


def test_task_time_on_a_simulated_run(simulated: tuple[Path, SimulationResult]) -> None:
    db, result = simulated
    with registry.AnalysisContext.open(db) as ctx:
        table = registry.run(ctx, "task_time")
        # Independent of the ledger: first arrival → last byte of each conversation's turns.
        _, spans = ctx.reader.rows(
            Query("SELECT SpanAttributes[?], "
                  "(max(epoch_ns(Timestamp) + Duration) - min(epoch_ns(Timestamp))) / 1e9 "
                  "FROM otel_traces WHERE SpanName = ? GROUP BY 1",
                  positional=(semconv.GEN_AI_CONVERSATION_ID, semconv.SPAN_TURN)))
        summary = registry.run(ctx, "task_time_summary")
    assert table.schema == pl.Schema(COLUMNS)
    assert table.height == len({t.conversation_id for t in result.truth}) == len(spans)
    task = dict(zip(table["conversation_id"], table["task_s"], strict=True))
    for conversation, seconds in spans:
        assert task[conversation] == pytest.approx(seconds, abs=1e-6)
    # The simulator runs a conversation's turns one after another: nothing is unaccounted.
    assert table["unaccounted_s"].abs().max() == pytest.approx(0.0, abs=1e-6)
    assert table["transfer_s"].null_count() == 0 and table["transfer_s"].sum() > 0
    truth_ttft: dict[str, float] = {}
    for t in result.truth:
        truth_ttft[t.conversation_id] = truth_ttft.get(t.conversation_id, 0.0) + (t.ttft_ms or 0)
    for row in table.to_dicts():
        assert row["ttft_sum_s"] == pytest.approx(truth_ttft[row["conversation_id"]] / 1000.0,
                                                  rel=1e-6)
        assert 0.0 < row["ttft_share"] < 1.0
    assert summary["component"].to_list() == [*COMPONENTS, *ENGINE_COMPONENTS]
    by = {r["component"]: r for r in summary.to_dicts()}
    assert by["task"]["total_s"] == pytest.approx(table["task_s"].sum())
    assert by["ttft"]["share_of_task"] == pytest.approx(
        table["ttft_sum_s"].sum() / table["task_s"].sum())
    # Tool waits dominate an agent task with 5-40 s think times and millisecond turns.
    assert by["tool_wait"]["share_of_task"] > 0.9
    assert math.isclose(sum(by[p]["share_of_task"] for p in COMPONENTS[1:-1]), 1.0,
                        rel_tol=1e-6)
