"""vLLM 0.33.0's own request tracing, with only an endpoint, into ``kvscope serve`` over gRPC.

A vLLM server started with ``--otlp-traces-endpoint URL`` builds its tracer with
``vllm.tracing.init_tracer`` (the exporter from ``get_span_exporter``: gRPC unless
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says otherwise, ``vllm/tracing/otel.py:94-102``) and
emits one ``llm_request`` span per finished request from ``OutputProcessor.do_tracing``
(``vllm/v1/engine/output_processor.py:941``). Both run here, unchanged, in a child process (the
tracer provider is process-global), against a receiver on 127.0.0.1 with a real store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvscope.collector.receiver import Receiver

# do_tracing reads only its arguments; its request state and stats are given as plain objects
# with the fields it reads, times in seconds as vLLM's RequestStateStats keeps them.
_CHILD = """
import sys, time
from types import SimpleNamespace
from opentelemetry import trace
from vllm.tracing import init_tracer
from vllm.v1.engine.output_processor import OutputProcessor

init_tracer("vllm.llm_engine", sys.argv[1])
now = time.time()
stats = SimpleNamespace(arrival_time=now - 1.0, queued_ts=10.0, scheduled_ts=10.2,
                        first_token_ts=10.5, last_token_ts=10.9, first_token_latency=0.5,
                        num_generation_tokens=12)
state = SimpleNamespace(stats=stats, prompt_token_ids=list(range(17)), prompt_embeds=None,
                        external_req_id="chatcmpl-kvscope-turn-1", top_p=0.9,
                        max_tokens_param=32, temperature=0.0, n=1)
OutputProcessor.do_tracing(None, SimpleNamespace(trace_headers=None), state,
                           SimpleNamespace(iteration_timestamp=now))
trace.get_tracer_provider().shutdown()
"""


def test_vllms_default_tracing_lands_llm_request_spans_over_grpc(tmp_path: Path) -> None:
    from vllm.tracing.utils import SpanAttributes

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    with Receiver(tmp_path / "traced.duckdb", grpc_port=0) as receiver:
        done = subprocess.run([sys.executable, "-c", _CHILD, receiver.grpc_url], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-4000:]
        assert receiver.writer.flush(10)
        rows = receiver.writer.connection.cursor().execute(
            "SELECT SpanName, SpanKind, SpanAttributes[?], SpanAttributes[?], "
            "SpanAttributes[?] FROM otel_traces",
            [SpanAttributes.GEN_AI_REQUEST_ID, SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS,
             SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN],
        ).fetchall()
        stats = receiver.stats
    assert rows == [("llm_request", "SPAN_KIND_SERVER", "chatcmpl-kvscope-turn-1", "17", "0.5")]
    assert (stats.spans_accepted, stats.bad_requests) == (1, 0)
