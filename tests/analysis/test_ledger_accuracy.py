"""The ledger against the simulator's ground truth: every turn's outcome, and the token split.

Each fault of the simulator is switched on alone and in a mix; the ledger, built only from the
spans in the store, must name the same outcome as the simulator's truth for every turn and the
same local / remote / recomputed split wherever it could measure the reusable span.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from kvscope import semconv
from kvscope.analysis import ledger as ledger_module
from kvscope.analysis.ledger import HISTORY_CONTINUES, HISTORY_UNKNOWN, ledger
from kvscope.emulator import simulator as sim
from kvscope.emulator.simulator import SimulationSettings, iter_truth, simulate
from kvscope.emulator.workloads.model import Workload
from kvscope.reuse import outcomes
from kvscope.store.query import Query
from kvscope.store.source import open_reader
from tests.stores import busy_workload

SPLIT = ["reusable_tokens", "local_hit_tokens", "remote_reused_tokens",
         "recomputed_reusable_tokens"]


@pytest.fixture(scope="module")
def workload() -> Workload:
    # Resets, sub-agents and a shared system prompt included: the hard cases stay in.
    return busy_workload(conversations=6, turns_p50=7, max_turns=10)


def _compare(workload: Workload, db: Path, settings: SimulationSettings) -> pl.DataFrame:
    result = simulate(workload, db, settings)
    truth = pl.DataFrame([row | {"facts": json.dumps(row["facts"])}
                          for row in iter_truth(result)])
    reader = open_reader(db)
    try:
        observed = ledger(reader).filter(pl.col("run_id") == result.run_id)
    finally:
        reader.close()
    assert observed.height == truth.height == result.turns
    joined = truth.join(observed, on="x_request_id", suffix="_ledger", how="inner")
    assert joined.height == truth.height
    return joined


# The decision table's facts the ledger shows in its columns: fact -> ledger column.
LEDGER_FACTS = {"router_lookup": "router_lookup_ledger", "decision": "decision",
                "read_status": "d2p_status", "reusable": "reusable_tokens_ledger",
                "local": "local_hit_tokens_ledger", "remote": "remote_reused_tokens_ledger",
                "invalid_tokens": "invalid_tokens", "offered": "offered_tokens"}


def disagreeing_facts(row: dict[str, Any]) -> list[str]:
    """The facts truth and ledger both measured for a turn and do not agree on."""
    facts = json.loads(row["facts"])
    if facts.get("router_lookup") == semconv.ROUTER_NO_CONVERSATION_ID:
        return []  # without an id the spans link the turn to nothing: no fact to compare
    off = [f"{fact}: truth {facts.get(fact)!r}, ledger {row[column]!r}"
           for fact, column in LEDGER_FACTS.items()
           if facts.get(fact) is not None and row[column] is not None
           and facts[fact] != row[column]
           # local and remote count inside the reusable span: only where the ledger measured it
           and (fact not in ("local", "remote") or row["reusable_tokens_ledger"] is not None)]
    # Where decode kept nothing the ledger's reusable span is a lower bound by one token (the
    # async scheduler computed one more, which no span shows): see _assert_matches.
    kept_nothing = row["offered_tokens"] is None and row["retention_id"] is None
    if kept_nothing and (facts.get("reusable") or 0) - (row["reusable_tokens_ledger"] or 0) == 1:
        off = [o for o in off if not o.startswith("reusable:")]
    if row["history"] not in (None, HISTORY_UNKNOWN) and facts.get("history") != row["history"]:
        off.append(f"history: truth {facts.get('history')!r}, ledger {row['history']!r}")
    return off


def _assert_matches(joined: pl.DataFrame) -> None:
    wrong = joined.filter(pl.col("outcome") != pl.col("outcome_ledger"))
    assert wrong.height == 0, [
        (row["conversation_id"], row["turn_index"], row["outcome"], row["outcome_ledger"],
         disagreeing_facts(row)) for row in wrong.to_dicts()[:5]]
    # Turn by turn, every fact both sides measured agrees (a disagreement names the fact).
    off = [(row["conversation_id"], row["turn_index"], facts) for row in joined.to_dicts()
           if (facts := disagreeing_facts(row))]
    assert not off, off[:5]
    # The split is compared wherever the ledger measured the reusable span: the history
    # continues and the previous turn finished (an errored turn leaves no output to count).
    measured = joined.filter((pl.col("history") == HISTORY_CONTINUES)
                             & pl.col("reusable_tokens_ledger").is_not_null())
    assert measured.height > 0
    unmeasured = joined.filter((pl.col("history") == HISTORY_CONTINUES)
                               & pl.col("reusable_tokens_ledger").is_null())
    assert unmeasured["outcome"].is_in([outcomes.NO_DECODE_METADATA]).all()
    # Where decode kept nothing (no offer, no retention) the ledger counts prompt + output − 1,
    # a lower bound: the async scheduler computed one token more, which no span shows.
    bound = pl.col("offered_tokens").is_null() & pl.col("retention_id").is_null() & (
        pl.col("decision").is_null() | (pl.col("decision") == "no_offer"))
    short = measured.filter(bound & (pl.col("reusable_tokens") != pl.col("reusable_tokens_ledger")))
    assert (short["reusable_tokens"] - short["reusable_tokens_ledger"]).is_in([1]).all()
    measured = measured.filter(~bound | (pl.col("reusable_tokens")
                                         == pl.col("reusable_tokens_ledger")))
    for column in SPLIT:
        off = measured.filter(pl.col(column) != pl.col(f"{column}_ledger"))
        assert off.height == 0, (column, off.select(
            "conversation_id", "turn_index", "outcome", *SPLIT,
            *[f"{c}_ledger" for c in SPLIT]).to_dicts()[:5])


FAULT_CASES = {
    "none": {},
    sim.FAULT_NO_CONVERSATION_ID: {"faults": {sim.FAULT_NO_CONVERSATION_ID: 0.5}},
    sim.FAULT_STRIP_METADATA: {"faults": {sim.FAULT_STRIP_METADATA: 0.5}},
    sim.FAULT_INVALID_PARAMS: {"faults": {sim.FAULT_INVALID_PARAMS: 0.5}},
    sim.FAULT_PROXY_RESTART: {"faults": {sim.FAULT_PROXY_RESTART: 0.3}},
    sim.FAULT_PREEMPT: {"faults": {sim.FAULT_PREEMPT: 0.5}},
    "handshake_recompute": {"faults": {sim.FAULT_HANDSHAKE: 0.5},
                            "kv_load_failure_policy": "recompute"},
    "transfer_fail_policy": {"faults": {sim.FAULT_TRANSFER: 0.5}},
    "transfer_recompute": {"faults": {sim.FAULT_TRANSFER: 0.5},
                           "kv_load_failure_policy": "recompute"},
    "clock_skew_recompute": {"faults": {sim.FAULT_CLOCK_SKEW: 0.5},
                             "kv_load_failure_policy": "recompute"},
    "short_decode_ttl": {"decoder_kv_blocks_ttl": 8.0, "kv_load_failure_policy": "recompute"},
    "short_router_ttl": {"router_ttl": 6.0},
    "high_threshold": {"kv_recompute_threshold": 400},
    "prefill_bidir_off": {"prefill_bidirectional_kv_xfer": False},
    "decode_bidir_off": {"decode_bidirectional_kv_xfer": False},
    "small_prefill_cache": {"prefill_cache_blocks": 200},
    "mix": {"faults": {sim.FAULT_NO_CONVERSATION_ID: 0.15, sim.FAULT_STRIP_METADATA: 0.1,
                       sim.FAULT_TRANSFER: 0.1, sim.FAULT_HANDSHAKE: 0.05, sim.FAULT_PREEMPT: 0.1,
                       sim.FAULT_INVALID_PARAMS: 0.05, sim.FAULT_PROXY_RESTART: 0.05},
            "decoder_kv_blocks_ttl": 20.0, "kv_load_failure_policy": "recompute"},
    # kvscope proxy --reuse-guard: edited histories get MISS params instead of decode's KV.
    "reuse_guard": {"reuse_guard": True},
    # The synchronous scheduler (vLLM on CPU, or async scheduling off): D offers one less.
    "sync": {"scheduling": "sync"},
    "mix_sync": {"faults": {sim.FAULT_NO_CONVERSATION_ID: 0.15, sim.FAULT_STRIP_METADATA: 0.1,
                            sim.FAULT_TRANSFER: 0.1, sim.FAULT_HANDSHAKE: 0.05,
                            sim.FAULT_PREEMPT: 0.1, sim.FAULT_INVALID_PARAMS: 0.05,
                            sim.FAULT_PROXY_RESTART: 0.05},
                 "decoder_kv_blocks_ttl": 20.0, "scheduling": "sync"},
}


@pytest.mark.parametrize("case", list(FAULT_CASES))
def test_ledger_equals_ground_truth(workload: Workload, tmp_path: Path, case: str) -> None:
    settings = SimulationSettings(profile="tiny", label=case, seed=17, **FAULT_CASES[case])
    joined = _compare(workload, tmp_path / "acc.duckdb", settings)
    _assert_matches(joined)


def test_the_runs_hold_the_hard_cases(workload: Workload, tmp_path: Path) -> None:
    """Edited histories (a reset keeps the id: decode's KV is pulled anyway), hence invalid
    reuse, are in the compared runs; the ledger names the edit from hashes alone, and the later
    turns that read the KV computed from it (kvscope.reuse.taint)."""
    result = simulate(workload, tmp_path / "hard.duckdb",
                      SimulationSettings(profile="tiny", seed=17))
    truth = list(iter_truth(result))
    assert sum(t["outcome"] == outcomes.REUSED_INVALID for t in truth) >= 3
    reader = open_reader(tmp_path / "hard.duckdb")
    try:
        observed = ledger(reader)
    finally:
        reader.close()
    evidence = observed.filter(pl.col("outcome") == outcomes.REUSED_INVALID)["evidence"]
    assert evidence.str.contains(
        "longer than the prompt|history was edited|computed from an invalid load").all()
    # The turns after an invalid load read its KV again (decode's retention, prefill's cache).
    assert evidence.str.contains("computed from an invalid load").any()


def test_the_taint_pass_follows_only_what_an_invalid_load_can_reach(
        workload: Workload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass feeds the tracker only turns some chain of links reaches from an invalid load
    (``ledger._reachable``); fed every turn instead, it marks the same turns the same way."""
    settings = SimulationSettings(profile="tiny", label="mix", seed=17, **FAULT_CASES["mix_sync"])
    result = simulate(workload, tmp_path / "reach.duckdb", settings)
    reader = open_reader(tmp_path / "reach.duckdb")
    try:
        shaped = ledger_module.shape(ledger_module.turn_rows(reader))
    finally:
        reader.close()
    pruned = ledger_module.finish(shaped)
    assert result.turns and (pruned["invalid_kind"] == "tainted").any()
    monkeypatch.setattr(ledger_module, "_reachable",
                        lambda rows: pl.Series([True] * rows.height))
    assert ledger_module.finish(shaped).equals(pruned)


def test_several_runs_in_one_store_stay_apart(workload: Workload, tmp_path: Path) -> None:
    db = tmp_path / "two.duckdb"
    first = _compare(workload, db, SimulationSettings(profile="tiny", label="ON", seed=1))
    second = _compare(workload, db, SimulationSettings(
        profile="tiny", label="OFF", seed=1, prefill_bidirectional_kv_xfer=False,
        decode_bidirectional_kv_xfer=False))
    _assert_matches(first)
    _assert_matches(second)
    assert set(second["outcome"]) <= {outcomes.FIRST_TURN, outcomes.NO_DECODE_METADATA,
                                      outcomes.PREFIX_DIVERGED}


def test_a_failed_read_reported_twice_keeps_the_specific_status() -> None:
    from kvscope import semconv
    from kvscope.analysis.ledger import QUERIES, build

    frames = {name: pl.DataFrame() for name in QUERIES}
    turn = {"run_id": "r", "trace_id": "t", "span_id": "s", "x_request_id": "x1",
            "conversation_id": "c", "turn_index": "2", "arrival": 0, "duration_ns": 10,
            "status_code": "STATUS_CODE_ERROR", "ttft_ms": None, "prompt_tokens": "100",
            "output_tokens": None, "router_lookup": semconv.ROUTER_HIT,
            "router_entry_age_s": "1.0", "boundary_hashes": None, "messages": None,
            "roles": None, "error_kind": "kv_load_failed", "reuse_guard": None}
    frames["turns"] = pl.DataFrame([turn]).with_columns(
        pl.col("arrival").cast(pl.Datetime("ns")), pl.col("duration_ns").cast(pl.UInt64),
        pl.col("ttft_ms").cast(pl.String), pl.col("output_tokens").cast(pl.String),
        pl.col("boundary_hashes").cast(pl.String), pl.col("messages").cast(pl.String),
        pl.col("roles").cast(pl.String), pl.col("reuse_guard").cast(pl.String))
    frames["decisions"] = pl.DataFrame([{
        "request_id": "chatcmpl-x1-abcdef12", "engine": "p0", "time": 1,
        "decision": semconv.DECISION_PULL, "local_hit": "0", "offered": "99", "to_pull": "99",
        "threshold": "64", "bidir": "true"}]).with_columns(pl.col("time").cast(pl.Datetime("ns")))
    rows = [{"request_id": "chatcmpl-x1-abcdef12", "engine": "p0",
             "direction": semconv.DIRECTION_D_TO_P, "status": status, "size_bytes": "0",
             "start": start, "duration_ns": 5, "request_outcome": outcome}
            for status, start, outcome in ((semconv.TRANSFER_FAILED, 2, semconv.OUTCOME_ERROR),
                                           (semconv.TRANSFER_DECLINED_EXPIRED, 3, None))]
    frames["transfers"] = pl.DataFrame(rows).with_columns(
        pl.col("start").cast(pl.Datetime("ns")), pl.col("duration_ns").cast(pl.UInt64),
        pl.col("request_outcome").cast(pl.String))
    for name, columns in (("prefill", ["trace_id", "parent_span_id", "prefill_ns",
                                       "prefill_request_id", "d_metadata_attached",
                                       "offered_tokens_proxy", "retention_id"]),
                          ("decode", ["trace_id", "parent_span_id", "decode_ns",
                                      "decode_request_id", "metadata_returned"]),
                          ("waits", ["trace_id", "parent_span_id", "tool_wait_ns"]),
                          ("retentions", ["request_id", "engine", "start", "duration_ns",
                                          "size_bytes", "reason", "tokens"])):
        frames[name] = pl.DataFrame({c: pl.Series([], dtype=pl.String) for c in columns})
    frames["prefill"] = frames["prefill"].with_columns(pl.col("prefill_ns").cast(pl.UInt64))
    frames["decode"] = frames["decode"].with_columns(pl.col("decode_ns").cast(pl.UInt64))
    frames["waits"] = frames["waits"].with_columns(pl.col("tool_wait_ns").cast(pl.UInt64))
    frames["retentions"] = frames["retentions"].with_columns(
        pl.col("start").cast(pl.Datetime("ns")), pl.col("duration_ns").cast(pl.UInt64))
    row = build(frames).row(0, named=True)
    assert row["d2p_status"] == semconv.TRANSFER_DECLINED_EXPIRED
    assert row["outcome"] == outcomes.LOAD_FAILED_ERRORED


def test_the_ledger_table_is_rebuilt_idempotently(workload: Workload, tmp_path: Path) -> None:
    from kvscope.analysis.ledger import LEDGER_SCHEMA, LEDGER_TABLE, rebuild

    db = tmp_path / "rebuild.duckdb"
    result = simulate(workload, db, SimulationSettings(profile="tiny", seed=3))
    assert rebuild(db) == result.turns
    assert rebuild(db) == result.turns  # replaced, not appended
    reader = open_reader(db)
    try:
        columns, rows = reader.rows(Query(f"SELECT * FROM {LEDGER_TABLE} ORDER BY x_request_id"))
        assert columns == list(LEDGER_SCHEMA)
        assert len(rows) == result.turns
        # The stored table is the ledger the analyses compute from the spans.
        again = ledger(reader).sort("x_request_id")
        assert [r[columns.index("outcome")] for r in rows] == again["outcome"].to_list()
    finally:
        reader.close()


def test_a_read_the_reaper_overtook_is_invalid_reuse() -> None:
    """Decode's TTL reaper released the handle while the READ was in flight (D frees blocks on
    the READ's notification): P's read reports ok, but it read freed blocks."""
    from kvscope import semconv
    from kvscope.analysis.ledger import QUERIES, build

    ns = pl.Datetime("ns")
    frames = {name: pl.DataFrame() for name in QUERIES}
    frames["turns"] = pl.DataFrame([{
        "run_id": "r", "trace_id": "t", "span_id": "s", "x_request_id": "x2",
        "conversation_id": "c", "turn_index": "2", "arrival": 0, "duration_ns": 10_000_000,
        "status_code": "STATUS_CODE_UNSET", "ttft_ms": "5", "prompt_tokens": "400",
        "output_tokens": "10", "router_lookup": semconv.ROUTER_HIT, "router_entry_age_s": "1.0",
        "boundary_hashes": None, "messages": None, "roles": None, "error_kind": None,
        "reuse_guard": None}], schema_overrides={"boundary_hashes": pl.String,
                                                 "messages": pl.String, "roles": pl.String,
                                                 "error_kind": pl.String,
                                                 "reuse_guard": pl.String}).with_columns(
        pl.col("arrival").cast(ns), pl.col("duration_ns").cast(pl.UInt64))
    frames["prefill"] = pl.DataFrame([{
        "trace_id": "t", "parent_span_id": "s", "prefill_ns": 1000, "prefill_request_id": "p",
        "d_metadata_attached": "true", "offered_tokens_proxy": "300", "retention_id": "d1"}]
    ).with_columns(pl.col("prefill_ns").cast(pl.UInt64))
    frames["decisions"] = pl.DataFrame([{
        "request_id": "chatcmpl-x2-abcdef12", "engine": "p0", "time": 1,
        "decision": semconv.DECISION_PULL, "local_hit": "0", "offered": "300", "to_pull": "300",
        "threshold": "64", "bidir": "true"}]).with_columns(pl.col("time").cast(ns))
    # The READ runs from 2 ms to 7 ms; the reaper released decode's handle at 4 ms.
    frames["transfers"] = pl.DataFrame([{
        "request_id": "chatcmpl-x2-abcdef12", "engine": "p0",
        "direction": semconv.DIRECTION_D_TO_P, "status": semconv.TRANSFER_OK,
        "size_bytes": "1000", "start": 2_000_000, "duration_ns": 5_000_000,
        "request_outcome": None}], schema_overrides={"request_outcome": pl.String}
    ).with_columns(pl.col("start").cast(ns), pl.col("duration_ns").cast(pl.UInt64))
    frames["retentions"] = pl.DataFrame([{
        "request_id": "d1", "engine": "d0", "start": 0, "duration_ns": 4_000_000,
        "size_bytes": "1000", "reason": semconv.RELEASE_EXPIRED, "tokens": "300"}]
    ).with_columns(pl.col("start").cast(ns), pl.col("duration_ns").cast(pl.UInt64))
    for name, columns in (("decode", ["trace_id", "parent_span_id", "decode_ns",
                                      "decode_request_id", "metadata_returned"]),
                          ("waits", ["trace_id", "parent_span_id", "tool_wait_ns"])):
        frames[name] = pl.DataFrame({c: pl.Series([], dtype=pl.String) for c in columns})
    frames["decode"] = frames["decode"].with_columns(pl.col("decode_ns").cast(pl.UInt64))
    frames["waits"] = frames["waits"].with_columns(pl.col("tool_wait_ns").cast(pl.UInt64))
    # Decode's request "d1" names no turn here: it is a row of its own (engine spans alone).
    row = build(frames).filter(pl.col("x_request_id") == "x2").row(0, named=True)
    assert row["outcome"] == outcomes.REUSED_INVALID, row["evidence"]
    assert row["invalid_tokens"] == 300 and row["remote_reused_tokens"] == 0
    assert "after decode released the blocks" in row["evidence"]


@pytest.mark.parametrize("engine_request_id", [
    "chatcmpl-9f0c2b7e-1d2a-4c3b-8e4f-123456789012-abcdef12",  # chat
    # /v1/completions: vLLM makes one engine request per prompt, f"{request_id}-{i}"
    # (vLLM 0.32 and 0.33 completion serving): found on real servers by tests/vllm_real.
    "cmpl-9f0c2b7e-1d2a-4c3b-8e4f-123456789012-0-abcdef12",
    "cmpl-9f0c2b7e-1d2a-4c3b-8e4f-123456789012-abcdef12",
])
def test_engine_spans_join_chat_and_completions_turns(engine_request_id: str) -> None:
    from kvscope import semconv
    from kvscope.analysis.ledger import QUERIES, build

    x_request_id = "9f0c2b7e-1d2a-4c3b-8e4f-123456789012"  # a UUID whose last group is digits
    frames = {name: pl.DataFrame() for name in QUERIES}
    frames["turns"] = pl.DataFrame([{
        "run_id": "r", "trace_id": "t", "span_id": "s", "x_request_id": x_request_id,
        "conversation_id": "c", "turn_index": "2", "arrival": 0, "duration_ns": 10,
        "prompt_tokens": "200", "router_lookup": semconv.ROUTER_HIT}]).with_columns(
        pl.col("arrival").cast(pl.Datetime("ns")), pl.col("duration_ns").cast(pl.UInt64))
    frames["decisions"] = pl.DataFrame([{
        "request_id": engine_request_id, "engine": "p0", "time": 1,
        "decision": semconv.DECISION_PULL, "local_hit": "32", "offered": "111",
        "to_pull": "79", "threshold": "64", "bidir": "true"}]).with_columns(
        pl.col("time").cast(pl.Datetime("ns")))
    row = build(frames).row(0, named=True)
    assert (row["decision"], row["to_pull_tokens"]) == (semconv.DECISION_PULL, 79)
