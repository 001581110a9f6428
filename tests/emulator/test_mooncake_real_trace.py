"""The Mooncake importer and generator against the head of the real FAST'25 conversation trace.

The data file and its quirks are described in ``tests/emulator/data/README.md``. The links below
were read off the file by hand (a row whose ids start with an earlier row's full-block ids and
go on with new ones), not derived from the importer's rule.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from kvscope.emulator.simulator import SimulationSettings, simulate
from kvscope.emulator.workloads import mooncake, mooncake_synthetic
from kvscope.reuse import outcomes

TRACE = Path(__file__).parent / "data" / "mooncake_conversation_trace_head.jsonl"

# (earlier line, follow-up line), 1-based file lines.
FOLLOW_UPS = {
    (2, 138), (11, 135), (16, 202), (21, 309), (22, 219), (25, 221), (31, 192), (42, 181),
    (43, 263), (45, 178), (63, 290), (65, 167), (66, 299), (67, 134), (134, 281), (72, 295),
    (73, 303), (85, 316), (91, 287), (101, 312), (112, 322), (137, 306), (141, 261), (154, 304),
    (171, 241), (191, 311), (197, 308),
}
RETRIES = {(41, 262), (266, 323)}  # identical ids and length: not follow-ups
# Start with only part of an earlier prompt's full blocks (edited or truncated history).
PARTIAL = {(114, 229), (92, 248), (8, 324), (54, 328)}


def _rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in TRACE.read_text().splitlines()]


def test_the_slice_holds_the_quirks_the_tests_rely_on() -> None:
    rows = _rows()
    assert len(rows) == 328
    assert {r["hash_ids"][0] for r in rows} == {0}
    for a, b in FOLLOW_UPS:
        full = rows[a - 1]["input_length"] // 512
        assert rows[b - 1]["hash_ids"][:full] == rows[a - 1]["hash_ids"][:full]
        assert rows[a - 1]["hash_ids"][full:full + 1] != rows[b - 1]["hash_ids"][full:full + 1]
    short = {(a, b) for a, b in FOLLOW_UPS if rows[b - 1]["input_length"]
             < rows[a - 1]["input_length"] + rows[a - 1]["output_length"]}
    assert short == {(16, 202), (66, 299)}
    for a, b in RETRIES:
        assert rows[a - 1]["hash_ids"] == rows[b - 1]["hash_ids"]
    for a, b in PARTIAL:
        full = rows[a - 1]["input_length"] // 512
        earlier, later = rows[a - 1]["hash_ids"], rows[b - 1]["hash_ids"]
        common = next(i for i, (x, y) in enumerate(zip(earlier, later, strict=False)) if x != y)
        assert 2 <= common < full  # more than block 0, less than the full blocks


def test_importer_finds_the_sessions_of_the_real_trace() -> None:
    found = mooncake.read_sessions(TRACE)
    links = {(parent, line) for line, (parent, kind) in found.parents.items()
             if kind == mooncake.FOLLOW_UP}
    assert links == FOLLOW_UPS
    # A retry joins the session of the request it repeats (it opened a session of its own).
    retries = {(parent, line) for line, (parent, kind) in found.parents.items()
               if kind == mooncake.RETRY}
    assert retries == RETRIES
    for parent, line in RETRIES:
        assert any(parent in lines and line in lines for lines in found.lines)
    summary = found.summary
    assert summary == mooncake.ImportSummary(
        requests=328, sessions=301 - len(RETRIES), follow_ups=27, multi_turn_sessions=28,
        turns_per_session_p50=1, turns_per_session_p90=1, turns_per_session_max=3,
        unlinked_on_prefix=0, retries=len(RETRIES), branches=0,
    )
    assert "299 sessions (28 with follow-ups), 27 follow-ups (0 of them branches), 2 retries" \
        in summary.line()


def test_a_fault_free_run_of_the_real_trace_shows_only_the_invalid_reuse_it_implies(
        tmp_path: Path) -> None:
    """The one follow-up 13 tokens shorter than the previous prompt and output (lines 16 ->
    202) is shorter than what decode holds: vLLM's read of decode's end-trimmed blocks is
    misaligned whatever its text, so the trace implies it. Every other follow-up is valid
    reuse or a miss (the one 1 token short, 66 -> 299, included: no block shifts)."""
    work = mooncake.load(TRACE)
    result = simulate(work, tmp_path / "real.duckdb", SimulationSettings())
    turns = {(c.id, t.index): t for c in work.conversations for t in c.turns}
    invalid = [row for row in result.truth if row.outcome == outcomes.REUSED_INVALID]
    assert len(invalid) == 1 and "misaligned" in invalid[0].evidence
    row = invalid[0]
    previous = turns[(row.conversation_id, row.turn_index - 1)]
    assert (previous.prompt_tokens, previous.output_tokens, row.prompt_tokens) == (9418, 145, 9550)


def test_think_times_on_the_real_trace_are_the_send_gaps() -> None:
    rows = _rows()
    work = mooncake.load(TRACE)
    found = mooncake.read_sessions(TRACE)
    gaps = []
    for conv, lines in zip(work.conversations, found.lines, strict=True):
        for (prev, turn), (a, b) in zip(itertools.pairwise(conv.turns),
                                        itertools.pairwise(lines), strict=True):
            # The trace records send times only: the gap, ticks 1 ms early included, is all
            # that can be said (an upper bound of the user's think time).
            gap = (rows[b - 1]["timestamp"] - rows[a - 1]["timestamp"]) / 1000
            assert turn.think_time_s == pytest.approx(gap)
            assert turn.sent_at_s == pytest.approx(rows[b - 1]["timestamp"] / 1000)
            # A follow-up re-sends the previous prompt and answer (the row 13 tokens short of
            # them: all it holds); a retry re-sends the previous prompt: all of it is shared.
            assert turn.shared_prefix_tokens == min(
                prev.prompt_tokens + prev.output_tokens, turn.prompt_tokens)
            if (a, b) in FOLLOW_UPS:
                gaps.append(gap)
            else:
                assert (a, b) in RETRIES and turn.prompt_tokens == prev.prompt_tokens
    assert len(gaps) == 27
    assert min(gaps) == 21.0 and max(gaps) == 105.0
    assert statistics.median(gaps) == 60.0


def _shape(rows: list[dict[str, Any]], firsts: list[int]) -> dict[str, float]:
    """Shape facts of a trace: ``firsts`` are the row indices of first turns."""
    outputs = [r["output_length"] for r in rows]
    ticks = {r["timestamp"] for r in rows}
    second_ids = [rows[i]["hash_ids"][1] for i in firsts if len(rows[i]["hash_ids"]) > 1]
    return {
        "first_input_p50": statistics.median(rows[i]["input_length"] for i in firsts),
        "first_input_p90": statistics.quantiles([rows[i]["input_length"] for i in firsts],
                                                n=10)[-1],
        "min_input": min(r["input_length"] for r in rows),
        "output_p50": statistics.median(outputs),
        "output_p90": statistics.quantiles(outputs, n=10)[-1],
        "short_outputs": sum(1 for o in outputs if o <= 40) / len(outputs),
        "max_output": max(outputs),
        "early_ticks": sum(1 for t in ticks if t % 3000) / len(ticks),
        "shared_second_ids": len(second_ids) - len(set(second_ids)),
    }


def test_mooncake_generator_matches_the_real_trace() -> None:
    real_rows = _rows()
    # First turns: rows no earlier row's user sent before (not follow-ups, retries, edits).
    linked = {b for _, b in FOLLOW_UPS | RETRIES | PARTIAL}
    real = _shape(real_rows, [i for i in range(len(real_rows)) if i + 1 not in linked])
    trace = mooncake_synthetic.generate(sessions=400, seed=11)
    generated = list(trace.rows)
    synthetic = _shape(generated, [s[0] for s in trace.sessions])
    assert {r["hash_ids"][0] for r in generated} == {0}
    assert {r["timestamp"] % 3000 for r in generated} == {0, 2999}
    assert real["shared_second_ids"] == synthetic["shared_second_ids"] == 0
    assert synthetic["max_output"] <= real["max_output"] == 2000  # the cap both hold
    for name in ("first_input_p50", "first_input_p90", "output_p50", "output_p90"):
        assert synthetic[name] == pytest.approx(real[name], rel=0.25), name
    assert synthetic["min_input"] == pytest.approx(real["min_input"], abs=60)
    assert synthetic["short_outputs"] == pytest.approx(real["short_outputs"], abs=0.05)
    assert synthetic["early_ticks"] == pytest.approx(real["early_ticks"], abs=0.08)
    # Follow-ups: mostly a short reply, sometimes a document (real median 21 new tokens).
    new = [generated[b]["input_length"] - generated[a]["input_length"]
           - generated[a]["output_length"] for a, b in trace.links()]
    real_new = [real_rows[b - 1]["input_length"] - real_rows[a - 1]["input_length"]
                - real_rows[a - 1]["output_length"] for a, b in FOLLOW_UPS]
    assert statistics.median(real_new) == 21
    assert 5 <= statistics.median(new) <= 60
    share = sum(1 for n in new if n > 100) / len(new)
    real_share = sum(1 for n in real_new if n > 100) / len(real_new)
    assert share == pytest.approx(real_share, abs=0.12)
