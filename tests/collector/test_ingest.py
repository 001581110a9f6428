"""``kvscope ingest`` of vLLM's multi-turn benchmark stats into real store files.

The stats files are written the way vLLM 0.33.0's benchmark writes them
(``benchmarks/multi_turn/benchmark_serving_multi_turn.py``: ``RequestStats`` at lines 119-131,
one ``_asdict()`` per successful request at line 1746, ``json.dump(..., indent=2)`` at line
1755): the field list below is that NamedTuple's, in its order, with its value types.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvscope import cli, semconv
from kvscope.analysis import ledger, task_time
from kvscope.collector.ingest import bench_stats, ingest
from kvscope.errors import IngestError
from kvscope.reuse import outcomes
from kvscope.store.source import open_reader
from tests.stores import query

# RequestStats (bsmt.py:119-131), in declaration order.
REQUEST_STATS_FIELDS = (
    "ttft_ms", "tpot_ms", "latency_ms", "start_time_ms", "input_num_turns", "input_num_tokens",
    "output_num_tokens", "output_num_chunks", "output_num_first_chunk_tokens",
    "approx_cached_percent", "conversation_id", "client_id",
)
# perf_counter_ns() in ms: an arbitrary monotonic origin (here ~2.3 h after boot).
CLOCK0_MS = 8_301_234.567


@dataclass
class Turn:
    conversation: str
    turn: int  # 1-based user turn: the request carries 2 * turn - 1 messages
    start_ms: float
    latency_ms: float
    ttft_ms: float
    client: int = 0


def request_stats(turn: Turn) -> dict[str, Any]:
    """One ``RequestStats(...)._asdict()`` as ``send_turn`` fills it (bsmt.py:513-524)."""
    values = {
        "ttft_ms": turn.ttft_ms,
        "tpot_ms": 3.25,
        "latency_ms": turn.latency_ms,
        "start_time_ms": CLOCK0_MS + turn.start_ms,
        "input_num_turns": 2 * turn.turn - 1,
        "input_num_tokens": 100 * turn.turn,
        "output_num_tokens": 20,
        "output_num_chunks": 19,
        "output_num_first_chunk_tokens": 1,
        "approx_cached_percent": 0.0 if turn.turn == 1 else 80.0,
        "conversation_id": turn.conversation,
        "client_id": turn.client,
    }
    assert tuple(values) == REQUEST_STATS_FIELDS
    return values


def write_stats(path: Path, turns: list[Turn]) -> Path:
    """The file as the benchmark writes it: its records in completion order (bsmt.py:1746-1755)."""
    records = [request_stats(t) for t in sorted(turns, key=lambda t: t.start_ms + t.latency_ms)]
    with open(path, "w") as f:
        json.dump(records, f, indent=2)
    return path


# Two clients; CONV_0 and CONV_1 interleave on client 0; CONV_2 starts at turn 2 (its first turn
# was the warm-up's, which the stats leave out, bsmt.py:1672-1674).
WORKLOAD = [
    Turn("CONV_0", 1, 0.0, 400.0, 120.0),
    Turn("CONV_1", 1, 450.0, 380.0, 110.0),
    Turn("CONV_0", 2, 900.0, 300.0, 40.0),
    Turn("CONV_1", 2, 1300.0, 310.0, 45.5),
    Turn("CONV_0", 3, 1700.0, 320.0, 42.0),
    Turn("CONV_2", 2, 100.0, 350.0, 130.0, client=1),
    Turn("CONV_2", 3, 600.0, 330.0, 50.0, client=1),
]


@pytest.fixture
def stats_file(tmp_path: Path) -> Path:
    return write_stats(tmp_path / "stats.json", WORKLOAD)


def _ledger(db: Path) -> list[dict[str, Any]]:
    reader = open_reader(db)
    try:
        rows: list[dict[str, Any]] = ledger.ledger(reader).to_dicts()
        return rows
    finally:
        reader.close()


def _count(db: Path) -> tuple[int, int]:
    [(traces, runs)] = query(db, "SELECT (SELECT count(*) FROM otel_traces), "
                                 "(SELECT count(*) FROM kvscope_runs)")
    return int(traces), int(runs)


def test_turns_and_tool_waits_land_in_the_ledger(tmp_path: Path, stats_file: Path) -> None:
    db = tmp_path / "run.duckdb"

    result = ingest(db, [stats_file], run_label="bench ON")

    assert result.label == "bench ON"
    (source,) = result.sources
    # 7 turns; tool waits before CONV_0 turns 2, 3, CONV_1 turn 2 and CONV_2 turn 3 (CONV_2's
    # turn 1 is not in the file, so nothing tells when the wait before its turn 2 began).
    assert (source.kind, source.records, source.spans) == ("vllm-bench-stats", 7, 11)
    rows = {(r["conversation_id"], r["turn_index"]): r for r in _ledger(db)}
    assert sorted(rows) == [("CONV_0", 1), ("CONV_0", 2), ("CONV_0", 3), ("CONV_1", 1),
                            ("CONV_1", 2), ("CONV_2", 2), ("CONV_2", 3)]
    assert {r["run_id"] for r in rows.values()} == {result.run_id}
    for turn in WORKLOAD:
        row = rows[(turn.conversation, turn.turn)]
        assert row["ttft_ms"] == turn.ttft_ms
        assert row["turn_ms"] == pytest.approx(turn.latency_ms)
        # The client's token counts are not the engine's: not claimed as prompt/output tokens.
        assert row["prompt_tokens"] is None and row["output_tokens"] is None
    # Tool wait = previous response's end to this request's start, in seconds.
    assert rows[("CONV_0", 2)]["tool_wait_s"] == pytest.approx(0.5)
    assert rows[("CONV_0", 3)]["tool_wait_s"] == pytest.approx(0.5)
    assert rows[("CONV_1", 2)]["tool_wait_s"] == pytest.approx((1300 - 830) / 1000)
    assert rows[("CONV_2", 3)]["tool_wait_s"] == pytest.approx(0.15)
    assert rows[("CONV_2", 2)]["tool_wait_s"] is None
    # Outcomes: the most specific the evidence supports, else unknown naming what is missing.
    for key, row in rows.items():
        if key[1] == 1:
            assert row["outcome"] == outcomes.FIRST_TURN
        else:
            assert (row["outcome"], row["evidence"]) == (outcomes.UNKNOWN,
                                                         outcomes.EVIDENCE_CLIENT_ONLY), key
        # Turn 1 has nothing to reuse by definition; after it, the reusable span is unmeasured.
        assert row["reusable_tokens"] == (0 if key[1] == 1 else None)
        assert row["observer"] == semconv.OBSERVER_CLIENT
    # The task timeline: tool waits measured, the proxy's legs and overhead not measured.
    reader = open_reader(db)
    try:
        tasks = {r["conversation_id"]: r
                 for r in task_time.task_table(ledger.ledger(reader)).to_dicts()}
    finally:
        reader.close()
    assert tasks["CONV_0"]["task_s"] == pytest.approx(2.02)
    assert tasks["CONV_0"]["tool_wait_s"] == pytest.approx(1.0)
    assert tasks["CONV_0"]["ttft_sum_s"] == pytest.approx(0.202)
    assert [tasks["CONV_0"][f"{part}_s"] for part in task_time.PARTS if part != "tool_wait"] \
        == [None, None, None, None]


def test_times_keep_their_differences_and_end_at_the_files_mtime(
    tmp_path: Path, stats_file: Path
) -> None:
    mtime_ns = 1_780_000_000_123_456_789
    os.utime(stats_file, ns=(mtime_ns, mtime_ns))
    db = tmp_path / "run.duckdb"
    ingest(db, [stats_file])

    rows = query(db, "SELECT SpanAttributes[?], SpanAttributes[?], epoch_ns(Timestamp), Duration, "
                     "epoch_ns(Events[1].Timestamp) FROM otel_traces WHERE SpanName = ?",
                 [semconv.GEN_AI_CONVERSATION_ID, semconv.TURN_INDEX, semconv.SPAN_TURN])
    [settings] = query(db, "SELECT settings FROM kvscope_runs")
    start = {(c, int(k)): (ts, dur, first) for c, k, ts, dur, first in rows}
    last_end = max(ts + dur for ts, dur, _ in start.values())
    assert last_end == mtime_ns
    ts0, _, first0 = start[("CONV_0", 1)]
    assert start[("CONV_0", 2)][0] - ts0 == 900_000_000
    assert first0 - ts0 == 120_000_000
    assert settings is not None
    (recorded,) = json.loads(settings[0])["files"]
    assert recorded["name"] == "stats.json" and len(recorded["sha256"]) == 64
    assert recorded["clock_offset_ns"] == mtime_ns - round((CLOCK0_MS + 2020.0) * 1e6)


# Written by vLLM 0.33.0's benchmark_serving_multi_turn.py itself, unchanged, through vLLM's
# disagg_proxy_multiturn.py against `kvscope emulate` (the contract tier's
# test_bidir_on_turns_after_the_first_are_pulled_from_decode, --send-conversation-id): 3
# conversations of 3 turns, times from perf_counter (about 2342 s after that machine's boot).
RECORDED = Path(__file__).parent / "data" / "vllm_0_33_0_bench_stats.json"


def test_a_file_the_real_benchmark_wrote(tmp_path: Path) -> None:
    records = json.loads(RECORDED.read_text())
    db = tmp_path / "run.duckdb"

    result = ingest(db, [RECORDED])

    assert (result.sources[0].records, result.sources[0].spans) == (9, 9 + 6)
    rows = {(r["conversation_id"], r["turn_index"]): r for r in _ledger(db)}
    for record in records:
        row = rows[(record["conversation_id"], (record["input_num_turns"] + 1) // 2)]
        assert row["ttft_ms"] == record["ttft_ms"]
        assert row["turn_ms"] == pytest.approx(record["latency_ms"], abs=1e-6)
        assert row["outcome"] == (outcomes.FIRST_TURN if row["turn_index"] == 1
                                  else outcomes.UNKNOWN)
    waits = [row["tool_wait_s"] for key, row in sorted(rows.items()) if key[1] > 1]
    assert len(waits) == 6 and all(w is not None and w >= 0 for w in waits)


def test_a_client_that_sent_no_conversation_id_writes_the_same_file(tmp_path: Path) -> None:
    # Without --send-conversation-id the benchmark still records its own conversation id
    # (bsmt.py:460 sends it or not; bsmt.py:521 records it always), so the file cannot tell
    # whether the server saw one: turns are linked by the client's id, and the ledger claims
    # neither reuse nor a miss cause (no_conversation_id included) for them.
    path = write_stats(tmp_path / "no-id.json", WORKLOAD[:3])
    db = tmp_path / "run.duckdb"
    ingest(db, [path])

    rows = {(r["conversation_id"], r["turn_index"]): r for r in _ledger(db)}
    assert rows[("CONV_0", 2)]["outcome"] == outcomes.UNKNOWN
    assert rows[("CONV_0", 2)]["tool_wait_s"] == pytest.approx(0.5)
    assert outcomes.NO_CONVERSATION_ID not in {r["outcome"] for r in rows.values()}


def test_an_empty_stats_file_records_an_empty_run(tmp_path: Path) -> None:
    path = write_stats(tmp_path / "empty.json", [])
    assert path.read_text() == "[]"
    db = tmp_path / "run.duckdb"

    result = ingest(db, [path])

    assert result.sources[0].records == 0
    assert _count(db) == (0, 1)


# --- never doubled, never lost -------------------------------------------------------------------


def test_re_ingesting_the_same_content_is_refused_and_changes_nothing(
    tmp_path: Path, stats_file: Path
) -> None:
    db = tmp_path / "run.duckdb"
    first = ingest(db, [stats_file])
    before = _count(db)
    copy = tmp_path / "renamed.json"
    copy.write_bytes(stats_file.read_bytes())

    for again in (stats_file, copy):
        with pytest.raises(IngestError, match=f"already in .* of run {first.run_id}"):
            ingest(db, [again])
    with pytest.raises(IngestError, match="given twice"):
        ingest(tmp_path / "other.duckdb", [stats_file, copy])

    assert _count(db) == before
    assert not (tmp_path / "other.duckdb").exists()


def _malformed(tmp_path: Path) -> list[tuple[str, str, str]]:
    good = json.dumps([request_stats(t) for t in WORKLOAD[:2]], indent=2)
    record = request_stats(WORKLOAD[0])
    cut = good[:-30]  # inside the last record's last string
    cases = [
        ("truncated", cut, f":{cut.count(chr(10)) + 1}: invalid JSON: Unterminated string"),
        ("not an array", json.dumps(record, indent=2), ":1: expected a JSON array"),
        ("missing field", json.dumps([{k: v for k, v in record.items() if k != "ttft_ms"}],
                                     indent=2), ":2: request stats record lacks ttft_ms"),
        ("wrong type", json.dumps([record, {**record, "conversation_id": 7,
                                            "input_num_turns": 3}], indent=2),
         ":27: conversation_id must be a finite string, got 7"),
        ("even turns", json.dumps([{**record, "input_num_turns": 2}], indent=2),
         ":7: input_num_turns must be odd"),
        ("duplicate", json.dumps([record, record], indent=2),
         ":16: conversation 'CONV_0' turn 1 already appears at line 2"),
        ("not a record", "[\n  1\n]", ":2: a request stats record must be an object"),
        ("trailing data", good + "\n{}",
         f":{good.count(chr(10)) + 2}: unexpected data after the array"),
        ("nan latency", good.replace('"latency_ms": 400.0', '"latency_ms": NaN'),
         ":5: latency_ms must be a finite number"),
        # Numbers no benchmark writes: each once gave a traceback (OverflowError with the store
        # already created, ValueError) or was stored.
        ("huge start time", json.dumps([{**record, "start_time_ms": 1e300}], indent=2),
         ":6: start_time_ms must be between 0 and 1e+12, got 1e+300"),
        ("long integer", json.dumps([record], indent=2).replace(
            '"input_num_tokens": 100', '"input_num_tokens": ' + "9" * 5000),
         ":2: a number in this record is too long"),
        ("negative tokens", json.dumps([{**record, "output_num_tokens": -5}], indent=2),
         ":9: output_num_tokens must be between 0 and 9223372036854775807, got -5"),
        ("negative start", json.dumps([{**record, "start_time_ms": -1.5}], indent=2),
         ":6: start_time_ms must be between 0 and 1e+12, got -1.5"),
    ]
    written = []
    for name, text, message in cases:
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        path.write_text(text)
        written.append((name, str(path), message))
    return written


def test_a_malformed_file_is_one_line_naming_file_and_line_and_keeps_the_store(
    tmp_path: Path, stats_file: Path
) -> None:
    db = tmp_path / "run.duckdb"
    ingest(db, [stats_file])
    before = _count(db)

    for name, path, message in _malformed(tmp_path):
        with pytest.raises(IngestError) as raised:
            # The good file first: a bad one anywhere in the list writes nothing at all.
            ingest(db, [write_stats(tmp_path / "more.json", WORKLOAD[:1]), path],
                   kind="vllm-bench-stats")
        text = str(raised.value)
        assert text.startswith(path + ":") and message in text and "\n" not in text, (name, text)

    assert _count(db) == before


def test_ingest_leaves_no_batch_folder_beside_the_store(tmp_path: Path) -> None:
    turns = [Turn(f"C{c}", t, c * 10_000.0 + t * 1000.0, 400.0, 100.0)
             for c in range(300) for t in (1, 2, 3)]  # enough rows for the Parquet path
    db = tmp_path / "run.duckdb"
    ingest(db, [write_stats(tmp_path / "big.json", turns)])
    assert _count(db)[0] > 900
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.json", "run.duckdb"]


def test_numbers_out_of_range_create_no_store(tmp_path: Path) -> None:
    record = request_stats(WORKLOAD[0])
    path = tmp_path / "huge.json"
    path.write_text(json.dumps([{**record, "start_time_ms": 1e300}], indent=2))
    with pytest.raises(IngestError, match="start_time_ms must be between"):
        ingest(tmp_path / "run.duckdb", [path])
    assert not (tmp_path / "run.duckdb").exists()


def test_an_unknown_kind_of_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "proxy.log"
    path.write_text("INFO 12-01 10:00:00 proxy started\n")
    with pytest.raises(IngestError, match="proxy.log: not a kind of source kvscope knows; name "
                                          "its kind with --kind"):
        ingest(tmp_path / "run.duckdb", [path])
    assert not (tmp_path / "run.duckdb").exists()


def test_field_list_matches_the_readers() -> None:
    assert tuple(bench_stats.FIELDS) == REQUEST_STATS_FIELDS


# --- the command line ----------------------------------------------------------------------------


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvscope.cli", *argv],
                          capture_output=True, text=True, timeout=60)


def test_cli_output_and_one_line_errors(tmp_path: Path, stats_file: Path) -> None:
    db = tmp_path / "run.duckdb"

    done = _cli("ingest", "--db", str(db), "--run-label", "ON", str(stats_file))

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"{stats_file}: vllm-bench-stats, 7 records, 11 spans"
    assert lines[1].startswith("run ") and lines[1].endswith(f" ('ON') written to {db}")
    again = _cli("ingest", "--db", str(db), str(stats_file))
    bad = tmp_path / "bad.json"
    bad.write_text(stats_file.read_text().replace('"client_id": 0', '"client_id": "zero"', 1))
    broken = _cli("ingest", "--db", str(db), str(bad))
    for result, message in ((again, "already in"),
                            (broken, f"{bad}:14: client_id must be a finite integer, got 'zero'")):
        assert result.returncode == cli.EXIT_USER_ERROR
        assert result.stderr.startswith("kvscope ingest: error: ")
        assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert _count(db) == (11, 1)
    report = _cli("report", str(db), "-o", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
