"""``kvscope demo``: the telemetry pipeline end to end on this machine, no GPU needed.

This first version sends a seeded, generated multi-turn agent trace (proxy-side spans only: turns
and tool waits with token counts, no engine hooks) through the real OpenTelemetry SDK and the
in-process DuckDB exporter into ``out/kvscope.duckdb``, then prints what the store holds. It makes
no reuse claims: with no engine spans the ledger could only say "unknown". The emulated deployment
replaces the generator as the emulator lands.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from opentelemetry.trace import SpanKind, Tracer

from kvscope import semconv
from kvscope.collector.otel import setup_telemetry
from kvscope.store import begin_run, end_run, open_store, table_counts

_MS = 1_000_000


def _emit_conversation(tracer: Tracer, rng: random.Random, conv: int, start_ns: int) -> int:
    """Emit one conversation's turns and tool waits; return the number of turns."""
    conversation_id = f"demo-{conv:04d}"
    prompt = rng.randint(2_000, 12_000)
    now = start_ns
    turns = rng.randint(3, 12)
    previous_end: int | None = None
    for index in range(1, turns + 1):
        output = rng.randint(50, 600)
        if previous_end is not None:
            wait_ns = int(rng.lognormvariate(2.3, 1.2) * 1000 * _MS)
            with tracer.start_as_current_span(
                semconv.SPAN_TOOL_WAIT, start_time=previous_end, end_on_exit=False,
                attributes={semconv.GEN_AI_CONVERSATION_ID: conversation_id,
                            semconv.TURN_INDEX: index,
                            semconv.WAIT_SOURCE: semconv.WAIT_INFERRED},
            ) as wait:
                wait.end(previous_end + wait_ns)
            now = previous_end + wait_ns
        ttft_ns = int((60 + prompt * 0.03) * _MS)
        duration_ns = ttft_ns + output * 25 * _MS
        with tracer.start_as_current_span(
            semconv.SPAN_TURN, kind=SpanKind.SERVER, start_time=now, end_on_exit=False,
            attributes={semconv.GEN_AI_CONVERSATION_ID: conversation_id,
                        semconv.TURN_INDEX: index,
                        semconv.GEN_AI_REQUEST_MODEL: "demo-model",
                        semconv.GEN_AI_USAGE_INPUT_TOKENS: prompt,
                        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: output,
                        semconv.TTFT_MS: ttft_ns / _MS},
        ) as turn:
            turn.add_event(semconv.EVENT_FIRST_TOKEN, timestamp=now + ttft_ns)
            turn.end(now + duration_ns)
        previous_end = now + duration_ns
        prompt += output + rng.randint(100, 2_000)
    return turns


def run_demo(out: Path, conversations: int = 40, seed: int = 7) -> int:
    """Write the demo store under ``out`` and print its table counts."""
    out.mkdir(parents=True, exist_ok=True)
    db = out / "kvscope.duckdb"
    if db.exists():
        db.unlink()
    con = open_store(db)
    run_id = begin_run(con, "pipeline demo (generated trace)", {"seed": seed,
                                                                 "conversations": conversations})
    con.close()
    print(f"kvscope demo: writing a generated {conversations}-conversation trace to {db}")
    telemetry = setup_telemetry(semconv.SERVICE_PROXY, db=str(db), run_id=run_id)
    tracer = telemetry.tracer()
    rng = random.Random(seed)
    start = time.time_ns()
    turns = 0
    for conv in range(conversations):
        turns += _emit_conversation(tracer, rng, conv, start + conv * 5_000 * _MS)
    telemetry.flush()
    telemetry.shutdown()
    con = open_store(db)
    end_run(con, run_id)
    counts = table_counts(con)
    con.close()
    print(f"  {turns} turns emitted")
    for table, count in counts.items():
        print(f"  {table:<20} {count:>8} rows")
    print(f"query it: kvscope sql {db} \"SELECT SpanName, count(*) FROM otel_traces GROUP BY 1\"")
    return 0
