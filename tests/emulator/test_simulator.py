"""The virtual-time simulator: spans in the store, ground truth per turn, every fault's outcome."""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

import pytest

from kvscope import semconv
from kvscope.emulator import simulator as sim
from kvscope.emulator.simulator import SimulationSettings, simulate
from kvscope.emulator.workloads import mooncake, mooncake_synthetic
from kvscope.emulator.workloads.model import Workload
from kvscope.reuse import outcomes
from kvscope.store.query import Query
from kvscope.store.source import open_reader
from tests.stores import calm_workload


@pytest.fixture(scope="module")
def workload() -> Workload:
    return calm_workload(seed=3, conversations=4, turns_p50=6, max_turns=8,
                         system_prompt_tokens=512, new_input_tokens_p50=300)


def _later_outcomes(result) -> collections.Counter[str]:  # type: ignore[no-untyped-def]
    return collections.Counter(t.outcome for t in result.truth if t.turn_index > 1)


def test_feature_on_reuses_remotely_and_writes_every_span(workload: Workload,
                                                          tmp_path: Path) -> None:
    db = tmp_path / "sim.duckdb"
    result = simulate(workload, db, SimulationSettings(profile="tiny", label="ON"))
    assert result.turns == workload.num_requests == len(result.truth)
    later = _later_outcomes(result)
    # A turn that adds fewer than 64 tokens to what P already holds is below the threshold.
    assert set(later) <= {outcomes.REUSED_REMOTE, outcomes.BELOW_THRESHOLD}
    assert later[outcomes.REUSED_REMOTE] >= 0.9 * sum(later.values())
    for row in result.truth:
        assert (row.local_hit_tokens + row.remote_reused_tokens
                + row.recomputed_reusable_tokens) == row.reusable_tokens
    reader = open_reader(db)
    _, counts = reader.rows(
        Query("SELECT SpanName, count(*) FROM otel_traces WHERE ResourceAttributes[?] = ? "
        "GROUP BY 1 ORDER BY 1", positional=(semconv.RUN_ID, result.run_id)))
    by_name = dict(counts)
    assert by_name[semconv.SPAN_TURN] == result.turns
    assert by_name[semconv.SPAN_INPUT_PROCESSING] == result.turns
    assert by_name[semconv.SPAN_GENERATION] == result.turns
    assert by_name[semconv.SPAN_TOOL_WAIT] == result.turns - len(workload.conversations)
    assert by_name[semconv.SPAN_REUSE_DECISION] == result.turns
    # Every retention is closed by a read (the next turn pulled it) or by the final reaper.
    _, reasons = reader.rows(
        Query("SELECT SpanAttributes[?], count(*) FROM otel_traces WHERE SpanName = ? GROUP BY 1",
              positional=(semconv.RETENTION_RELEASE_REASON, semconv.SPAN_KV_RETENTION)))
    expected = {semconv.RELEASE_READ: later[outcomes.REUSED_REMOTE],
                semconv.RELEASE_NOTIFIED: later[outcomes.BELOW_THRESHOLD],
                semconv.RELEASE_EXPIRED: len(workload.conversations)}
    assert dict(reasons) == {k: v for k, v in expected.items() if v}
    # Engine spans join the proxy's turn through the vLLM request id the proxy recorded.
    _, joined = reader.rows(
        Query("SELECT count(*) FROM otel_traces d JOIN otel_traces p "
              "ON d.SpanAttributes[?] = p.SpanAttributes[?] "
              "WHERE d.SpanName = ? AND p.SpanName = ?",
              positional=(semconv.VLLM_REQUEST_ID, semconv.VLLM_REQUEST_ID,
                          semconv.SPAN_REUSE_DECISION, semconv.SPAN_INPUT_PROCESSING)))
    assert joined == [(result.turns,)]
    _, run = reader.rows(Query("SELECT label, settings->>'profile', ended_at IS NOT NULL "
                         "FROM kvscope_runs WHERE run_id = ?", positional=(result.run_id,)))
    assert run == [("ON", "tiny", True)]
    reader.close()


def test_feature_off_never_pulls(workload: Workload, tmp_path: Path) -> None:
    result = simulate(workload, tmp_path / "off.duckdb", SimulationSettings(
        profile="tiny", prefill_bidirectional_kv_xfer=False, decode_bidirectional_kv_xfer=False))
    assert set(_later_outcomes(result)) == {outcomes.NO_DECODE_METADATA}
    assert all(t.remote_reused_tokens == 0 for t in result.truth)


def test_same_seed_same_truth(workload: Workload, tmp_path: Path) -> None:
    settings = SimulationSettings(profile="tiny", faults={sim.FAULT_TRANSFER: 0.3}, seed=11)
    a = simulate(workload, tmp_path / "a.duckdb", settings)
    b = simulate(workload, tmp_path / "b.duckdb", settings)
    strip = [(t.conversation_id, t.turn_index, t.outcome, t.remote_reused_tokens, t.ttft_ms)
             for t in a.truth]
    assert strip == [(t.conversation_id, t.turn_index, t.outcome, t.remote_reused_tokens,
                      t.ttft_ms) for t in b.truth]


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"faults": {sim.FAULT_NO_CONVERSATION_ID: 1.0}}, {outcomes.NO_CONVERSATION_ID}),
        ({"faults": {sim.FAULT_STRIP_METADATA: 1.0}}, {outcomes.NO_DECODE_METADATA}),
        ({"faults": {sim.FAULT_INVALID_PARAMS: 1.0}}, {outcomes.INVALID_PARAMS}),
        ({"faults": {sim.FAULT_PROXY_RESTART: 1.0}}, {outcomes.ROUTER_NO_ENTRY}),
        # A rescheduled request reads nothing again and computes locally, or stalls when its
        # remainder still asks for an asynchronous load (0.33.0 registers no second read).
        ({"faults": {sim.FAULT_PREEMPT: 1.0}}, {outcomes.PREEMPTED, outcomes.REUSED_LOCAL,
                                             outcomes.BELOW_THRESHOLD}),
        # Policy recompute: the re-issued load registers no read and waits forever (0.33.0).
        ({"faults": {sim.FAULT_HANDSHAKE: 1.0}, "kv_load_failure_policy": "recompute"},
         {outcomes.LOAD_STALLED, outcomes.NO_DECODE_METADATA}),
        ({"faults": {sim.FAULT_TRANSFER: 1.0}, "kv_load_failure_policy": "recompute"},
         {outcomes.LOAD_STALLED, outcomes.NO_DECODE_METADATA}),
        ({"faults": {sim.FAULT_CLOCK_SKEW: 1.0}, "kv_load_failure_policy": "recompute"},
         {outcomes.LOAD_STALLED, outcomes.NO_DECODE_METADATA}),
        ({"faults": {sim.FAULT_TRANSFER: 1.0}}, {outcomes.LOAD_FAILED_ERRORED,
                                              outcomes.NO_DECODE_METADATA}),
        ({"decoder_kv_blocks_ttl": 1.0, "kv_load_failure_policy": "recompute"},
         {outcomes.LOAD_STALLED, outcomes.NO_DECODE_METADATA}),
        ({"router_ttl": 0.5}, {outcomes.ROUTER_TTL_EXPIRED}),
        ({"kv_recompute_threshold": 1_000_000}, {outcomes.BELOW_THRESHOLD}),
        ({"prefill_bidirectional_kv_xfer": False}, {outcomes.PREFILL_BIDIR_DISABLED,
                                                     outcomes.NO_DECODE_METADATA}),
    ],
)
def test_each_fault_gives_its_outcome(workload: Workload, tmp_path: Path,
                                      settings: dict, expected: set[str]) -> None:
    result = simulate(workload, tmp_path / "f.duckdb",
                      SimulationSettings(profile="tiny", **settings))
    later = _later_outcomes(result)
    assert set(later) == expected, later
    # Without a conversation id nothing links turns, the first included.
    first = (outcomes.NO_CONVERSATION_ID if expected == {outcomes.NO_CONVERSATION_ID}
             else outcomes.FIRST_TURN)
    assert result.truth[0].outcome == first


def test_unknown_faults_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        SimulationSettings(faults={"gremlins": 1.0})
    with pytest.raises(ValueError, match="probability"):
        SimulationSettings(faults={sim.FAULT_TRANSFER: 2.0})


def test_mooncake_follow_ups_continue_and_are_sent_at_their_trace_time(tmp_path: Path) -> None:
    trace = mooncake_synthetic.generate(sessions=40, seed=1)
    # Trace time compressed: some follow-ups are due before their previous answer has ended.
    work = mooncake.load(trace.write(tmp_path / "trace.jsonl"), time_compression=20.0)
    result = simulate(work, tmp_path / "mooncake.duckdb", SimulationSettings())
    truth = {(row.conversation_id, row.turn_index): row for row in result.truth}
    on_time = late = 0
    for conv in work.conversations:
        for prev, turn in itertools.pairwise(conv.turns):
            assert turn.sent_at_s is not None
            arrival = truth[(conv.id, turn.index)].arrival_s
            # Never before the trace's send time; later only when the previous answer ran past
            # it (the quantised timestamps put some follow-ups in their parent's 3 s slot).
            assert arrival >= turn.sent_at_s - 1e-6
            assert arrival > truth[(conv.id, prev.index)].arrival_s
            if arrival == pytest.approx(turn.sent_at_s):
                on_time += 1
            else:
                late += 1
    assert on_time > 10 and late > 10
    # A follow-up re-sends the previous prompt and answer: a continuation, reused from decode.
    later = _later_outcomes(result)
    assert set(later) <= {outcomes.REUSED_REMOTE, outcomes.BELOW_THRESHOLD}
    assert later[outcomes.REUSED_REMOTE] >= 0.8 * sum(later.values())
    # Below threshold: P's own cache already holds all but a few tokens of what decode offers
    # (short answers and short replies, as in the real trace).
    for row in result.truth:
        if row.outcome == outcomes.BELOW_THRESHOLD:
            assert row.local_hit_tokens >= row.reusable_tokens - 64
