"""vLLM 0.33.0's own ``llm_request`` spans, made by its code, join an ingested run's ledger.

A child process runs ``vllm.tracing.init_tracer`` (the default OTLP/gRPC exporter) and
``OutputProcessor.do_tracing`` (``vllm/v1/engine/output_processor.py:941-1001``) for the two legs
of one P/D turn — prefill (``max_tokens`` 1, as the proxy sends it) then decode — into
``kvscope serve``'s receiver on 127.0.0.1; the run's turns come from ``kvscope ingest`` of the
benchmark's stats and vLLM's proxy log (no kvscope span anywhere). The ledger's engine TTFT and
queueing for that turn are what the two spans measured; kvscope's names are vLLM's constants.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope import semconv
from kvscope.collector.receiver import Receiver
from tests.collector.test_ingest_proxy_log import _at, _stats, _vllm_log

# do_tracing reads only its arguments: request state and stats as plain objects with the fields
# it reads, times in seconds as vLLM's RequestStateStats keeps them (queued/scheduled/first
# token on the engine's monotonic clock, arrival on the wall clock).
_CHILD = """
import sys
from types import SimpleNamespace
from opentelemetry import trace
from vllm.tracing import init_tracer
from vllm.v1.engine.output_processor import OutputProcessor

init_tracer("vllm.llm_engine", sys.argv[1])
rid, arrival = sys.argv[2], float(sys.argv[3])
# (arrival offset s, queued, scheduled, first token, last token, first-token latency, max_tokens)
legs = [(0.000, 50.000, 50.004, 50.016, 50.016, 0.012, 1),
        (0.020, 60.000, 60.001, 60.005, 60.300, 0.005, 64)]
for offset, queued, scheduled, first, last, latency, max_tokens in legs:
    stats = SimpleNamespace(arrival_time=arrival + offset, queued_ts=queued,
                            scheduled_ts=scheduled, first_token_ts=first, last_token_ts=last,
                            first_token_latency=latency, num_generation_tokens=max_tokens)
    state = SimpleNamespace(stats=stats, prompt_token_ids=list(range(170)), prompt_embeds=None,
                            external_req_id=f"chatcmpl-{rid}", top_p=None,
                            max_tokens_param=max_tokens, temperature=0.0, n=1)
    OutputProcessor.do_tracing(None, SimpleNamespace(trace_headers=None), state,
                               SimpleNamespace(iteration_timestamp=arrival + offset + 0.3))
trace.get_tracer_provider().shutdown()
"""


def test_kvscope_names_are_vllms_constants() -> None:
    from vllm.tracing.utils import SpanAttributes

    assert (semconv.VLLM_GEN_AI_REQUEST_ID, semconv.VLLM_TIME_IN_QUEUE,
            semconv.VLLM_TIME_TO_FIRST_TOKEN, semconv.VLLM_E2E,
            semconv.VLLM_TIME_IN_MODEL_PREFILL, semconv.VLLM_PROMPT_TOKENS,
            semconv.VLLM_COMPLETION_TOKENS, semconv.VLLM_MAX_TOKENS) == (
        SpanAttributes.GEN_AI_REQUEST_ID, SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE,
        SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, SpanAttributes.GEN_AI_LATENCY_E2E,
        SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
        SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS, SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS,
        SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS)


def test_do_tracing_spans_give_an_ingested_turn_its_engine_ttft_and_queueing(
        tmp_path: Path) -> None:
    from kvscope.analysis import ledger
    from kvscope.collector.ingest import ingest
    from kvscope.store.source import open_reader

    db = tmp_path / "run.duckdb"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    with Receiver(db, grpc_port=0) as receiver:
        done = subprocess.run([sys.executable, "-c", _CHILD, receiver.grpc_url, "r-0-2",
                               repr(_at(1000))], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-4000:]
        assert receiver.writer.flush(10)
        assert receiver.stats.spans_accepted == 2
    ingest(db, [_stats(tmp_path / "stats.json"), _vllm_log(tmp_path / "proxy.log")])
    reader = open_reader(db)
    try:
        rows = {r["x_request_id"]: r for r in ledger.ledger(reader).to_dicts()}
    finally:
        reader.close()
    assert len(rows) == 5
    turn = rows["r-0-2"]
    # Prefill's arrival → decode's first token: 0.020 + 0.005 s; queues 4 ms + 1 ms.
    assert turn["engine_ttft_ms"] == pytest.approx(25.0, abs=0.01)
    assert turn["engine_queue_ms"] == pytest.approx(5.0, abs=1e-6)
    assert all(r["engine_ttft_ms"] is None for rid, r in rows.items() if rid != "r-0-2")
