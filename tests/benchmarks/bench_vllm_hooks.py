"""Per-call overhead of kvscope's hooks on the real vLLM 0.33.0 NIXL scheduler role.

Run in the vLLM venv: ``.venv-vllm/bin/python tests/benchmarks/bench_vllm_hooks.py``. Each hooked
scheduler method is timed on the real ``NixlPullConnectorScheduler``, uninstrumented and
instrumented, in the same run, interleaved in rounds (best round kept, so background noise on a
shared machine inflates neither side); the table prints both and the added µs per call. The
target is ≤ 5 µs added per call. Worker-side hooks are not timed: the worker role needs
registered KV caches (a GPU) to be constructed.

``--prompt-tokens N`` (default 170) sizes the prompts and offers: the token hashes
(``kvscope.kv.tokens_hash``: the offered prompt tokens on prefill's decision, the held tokens on
decode's pin) cost in proportion to them.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor  # noqa: E402

N = 2000
WARMUP = 200
# Tokens of each request's prompt (--prompt-tokens); the offer is 10 fewer, the local hit 16.
PROMPT = 170
ROUNDS = 7
MATCHED = "get_num_new_matched_tokens"
SCHEDULE = "schedule (matched + update_state_after_alloc)"
PIN = "request_finished (pin)"
PIN_RELEASE = "request_finished + update_connector_output (pin, release)"


class Discard(SpanExporter):
    """Accepts spans and drops them: the export cost is not on the scheduler's path anyway."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def cases() -> dict[str, Callable[[], Callable[[], None]]]:
    """Name → factory of a no-argument call on fresh real objects (built outside the timing)."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request, RequestStatus

    from tests.vllm_contract.conftest import kv_cache_config, vllm_config

    def connector(kv_role: str) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

        return NixlConnector(vllm_config(kv_role), KVConnectorRole.SCHEDULER,
                             kv_cache_config(4096)).connector_scheduler

    offered = PROMPT - 10
    offer = {"do_remote_decode": True, "do_remote_prefill": False,
             "remote_block_ids": [list(range(-(-offered // 16)))], "remote_engine_id": "d",
             "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 5600,
             "remote_num_tokens": offered}

    def matched() -> Callable[[], None]:
        sched = connector("kv_producer")
        req = Request("p", list(range(PROMPT)), SamplingParams(max_tokens=1), None)
        req.kv_transfer_params = dict(offer)
        return lambda: sched.get_num_new_matched_tokens(req, 16)

    def schedule() -> Callable[[], None]:
        sched = connector("kv_producer")
        req = Request("p", list(range(PROMPT)), SamplingParams(max_tokens=1), None)
        blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(-(-(offered - 16) // 16))],))

        def call() -> None:
            req.kv_transfer_params = dict(offer)
            count, _ = sched.get_num_new_matched_tokens(req, 16)
            sched.update_state_after_alloc(req, blocks, count)
            sched._reqs_need_recv.clear()
            sched._reqs_in_batch.clear()

        return call

    def pin_release() -> Callable[[], None]:
        sched = connector("kv_consumer")
        req = Request("d", list(range(PROMPT)), SamplingParams(max_tokens=1), None)
        req.status = RequestStatus.FINISHED_STOPPED
        req.num_computed_tokens = PROMPT + 2
        block_ids = (list(range(-(-(PROMPT + 2) // 16))),)
        output = KVConnectorOutput(finished_sending={"d"})

        def call() -> None:
            req.kv_transfer_params = {"do_remote_prefill": False, "do_remote_decode": False}
            sched.request_finished(req, block_ids)
            sched.update_connector_output(output)
            sched._reqs_need_send.clear()

        return call

    def pin_only() -> Callable[[], None]:
        sched = connector("kv_consumer")
        requests = []
        for i in range(N + WARMUP):  # one request per call: each finishes once, as in vLLM
            req = Request(f"d{i}", list(range(PROMPT)), SamplingParams(max_tokens=1), None)
            req.status = RequestStatus.FINISHED_STOPPED
            req.num_computed_tokens = PROMPT + 2
            req.kv_transfer_params = {"do_remote_prefill": False, "do_remote_decode": False}
            requests.append(req)
        block_ids = (list(range(-(-(PROMPT + 2) // 16))),)
        pending = iter(requests)

        def call() -> None:
            sched.request_finished(next(pending), block_ids)
            sched._reqs_need_send.clear()

        return call

    def idle_output() -> Callable[[], None]:
        sched = connector("kv_consumer")
        output = KVConnectorOutput()
        return lambda: sched.update_connector_output(output)

    return {
        MATCHED: matched,
        SCHEDULE: schedule,
        PIN: pin_only,
        PIN_RELEASE: pin_release,
        "update_connector_output (empty step)": idle_output,
    }


def per_call_us(call: Callable[[], None]) -> float:
    for _ in range(WARMUP):
        call()
    start = time.perf_counter()
    for _ in range(N):
        call()
    return (time.perf_counter() - start) / N * 1e6


def main() -> None:
    import argparse
    import logging

    global PROMPT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT)
    PROMPT = parser.parse_args().prompt_tokens

    from kvscope.collector import engine_telemetry

    logging.disable(logging.WARNING)  # vLLM's connector banner per construction
    instrumentor = NixlConnectorInstrumentor()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(Discard()))
    meter_provider = MeterProvider()
    span_builders = {name: getattr(engine_telemetry.EngineTelemetry, name)
                     for name in ("_emit_decision", "_emit_transfer", "_emit_retention")}

    token_hash = NixlConnectorInstrumentor._tokens_hash

    def run(mode: str, factory: Callable[[], Callable[[], None]]) -> float:
        if mode != "plain":
            instrumentor.instrument(tracer_provider=tracer_provider,
                                    meter_provider=meter_provider)
        # "no token hash": the hook path without kvscope.kv.tokens_hash (its share, side by side).
        NixlConnectorInstrumentor._tokens_hash = (  # type: ignore[method-assign]
            (lambda self, ids, count: (None, None)) if mode == "no token hash" else token_hash)
        for name, builder in span_builders.items():
            # "hook path": the telemetry thread drains records without building spans, so
            # the time is what the scheduler's thread pays; "all": span building shares the
            # 2 cores and the GIL with it.
            setattr(engine_telemetry.EngineTelemetry, name,
                    (lambda self, r: None) if mode == "hook path" else builder)
        try:
            return per_call_us(factory())  # objects built after instrumenting, as in vLLM
        finally:
            NixlConnectorInstrumentor._tokens_hash = token_hash  # type: ignore[method-assign]
            instrumentor.uninstrument()
            for name, builder in span_builders.items():
                setattr(engine_telemetry.EngineTelemetry, name, builder)

    modes = ("plain", "no token hash", "hook path", "all")
    print(f"{'hooked call':58} {'plain µs':>9} {'no hash':>8} {'hook path':>10} {'added':>7} "
          f"{'with spans':>11} {'added':>7}")
    added: dict[str, tuple[float, float]] = {}
    for name, factory in cases().items():
        best = dict.fromkeys(modes, float("inf"))
        for _ in range(ROUNDS):
            for mode in modes:
                best[mode] = min(best[mode], run(mode, factory))
        plain = best["plain"]
        added[name] = (best["hook path"] - plain, best["all"] - plain)
        print(f"{name:58} {plain:9.2f} {best['no token hash']:8.2f} {best['hook path']:10.2f} "
              f"{best['hook path'] - plain:7.2f} {best['all']:11.2f} {best['all'] - plain:7.2f}")
    # Hooks that only run after another one: their own share is the difference of two rows.
    for name, pair, first in (
        ("update_state_after_alloc", SCHEDULE, MATCHED),
        ("update_connector_output (release)", PIN_RELEASE, PIN),
    ):
        hook = added[pair][0] - added[first][0]
        spans = added[pair][1] - added[first][1]
        print(f"{name + ' (row difference)':58} {'':9} {'':8} {'':10} {hook:7.2f} {'':11} "
              f"{spans:7.2f}")
    print(f"(prompts of {PROMPT} tokens; µs per call, best of {ROUNDS} rounds × {N} calls, "
          "interleaved; target: hook path "
          "adds ≤ 5 µs per call)")


if __name__ == "__main__":
    main()
