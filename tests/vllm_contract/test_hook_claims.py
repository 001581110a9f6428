"""kvscope's hooks record what vLLM 0.33.0 really did: the real classes, instrumented.

Each test drives the real ``Scheduler`` + ``NixlConnector`` (:mod:`test_scheduler_e2e`'s
``engines``) or the real NIXL worker over UCX (:mod:`test_worker`'s engines, here
``nixl_engines``) while :class:`NixlConnectorInstrumentor` records into in-memory providers
(``captured``), and checks the spans and the instrumentor's state against what vLLM did:

1. ``prompt_logprobs`` at prefill: the scheduler overrides an accepted pull to notify-only;
   the decision is ``scheduler_skipped``.
2. ``kv_load_failure_policy="recompute"`` after a failed read: ``pull``, then ``reissued``.
3. A notify-only recv whose handshake fails leaves nothing in the worker state, no span.
4. Private hook gating and a missing public target.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvscope import semconv
from kvscope.collector.vllm import instrumentor as instr
from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor, private_hook_matches
from tests.vllm_contract import test_scheduler_e2e as e2e
from tests.vllm_contract.conftest import Captured
from tests.vllm_contract.test_real_scheduler_claims import Runner, read_then_fail, spy
from tests.vllm_contract.test_real_worker_claims import (
    Results,
    messages,
    step,
    step_until,
    vllm_log,  # noqa: F401  (fixture)
)
from tests.vllm_contract.test_worker import engines as nixl_engines  # noqa: F401  (fixture)
from tests.vllm_contract.test_worker import free_port, request, schedule

# The module-scoped tiny-Llama fixtures and the instrumented-scheduler factory, registered here.
model_dir = e2e.model_dir
model_config = e2e.model_config
engines = e2e.engines

PUBLIC_HOOKS = (
    ("scheduler", "get_num_new_matched_tokens"),
    ("scheduler", "update_state_after_alloc"),
    ("scheduler", "update_connector_output"),
    ("scheduler", "request_finished"),
    ("worker", "start_load_kv"),
    ("worker", "get_transfer_results"),
)
PRIVATE_HOOKS = tuple(instr.PRIVATE_HOOK_SIGNATURES)


def add_traced(e: e2e.Engine, req_id: str, prompt_len: int, params: dict[str, Any],
               sampling: SamplingParams) -> Request:
    """A request with the proxy's traceparent (``check_decision`` compares the trace id)."""
    req = Request(req_id, list(range(1, prompt_len + 1)), sampling, None,
                  trace_headers={"traceparent": e2e.TRACEPARENT}, block_hasher=e._hasher)
    req.kv_transfer_params = params
    e.scheduler.add_request(req)
    return req


def decisions(captured: Captured) -> list[tuple[str, int]]:
    """(decision, to_pull) of every ``kvscope.reuse_decision`` span, in emission order."""
    return [(s.attributes[semconv.DECISION], s.attributes[semconv.TOKENS_TO_PULL])
            for s in captured.spans(semconv.SPAN_REUSE_DECISION)]


def is_wrapped(cls: type, name: str) -> bool:
    """Whether ``cls`` itself (not a base) holds kvscope's wrapper for ``name``."""
    return bool(getattr(cls.__dict__.get(name), "_kvscope_wrapper", False))


# --- 1. prompt_logprobs: the scheduler overrides the connector ---------------------------------
def test_prompt_logprobs_pull_is_reported_scheduler_skipped(
    captured: Captured, engines: Any
) -> None:
    """A prefill request with ``prompt_logprobs`` and a valid D→P offer above threshold (160 of
    170 tokens): the connector answers (160, True), the real Scheduler replaces it with 0
    (``skip_reading_prefix_cache``) and calls ``update_state_after_alloc`` with
    num_external_tokens 0, so vLLM registers a notify-only recv (no local blocks, not awaited)
    and computes all 170 tokens. The ``kvscope.reuse_decision`` span says ``scheduler_skipped``
    with ``to_pull_tokens`` 0 (from the scheduler's num_external_tokens, not the connector's
    answer); no pull is tracked and no ``kvscope.kv_transfer`` span follows."""
    p = engines("kv_producer")
    asked = spy(p.nixl, "get_num_new_matched_tokens")
    allocated = spy(p.nixl, "update_state_after_alloc", after=lambda req, blocks, n: n)
    req = add_traced(p, "p-t2", 170, e2e.offer(160),
                     SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert req.skip_reading_prefix_cache
    out = p.scheduler.schedule()
    # What vLLM did: the connector said pull, the scheduler computed everything, notify-only.
    assert [a[1] for a in asked] == [(160, True)]
    assert [a[1] for a in allocated] == [0]
    assert out.num_scheduled_tokens == {"p-t2": 170}
    meta = out.kv_connector_metadata.reqs_to_recv["p-t2"]
    assert meta.local_block_ids == () and meta.awaiting_kvs is False
    assert p.status("p-t2") == RequestStatus.RUNNING
    # What kvscope recorded.
    e2e.check_decision(e2e.the_span(captured, semconv.SPAN_REUSE_DECISION),
                       decision=semconv.DECISION_SCHEDULER_SKIPPED, local=0, offered=160,
                       to_pull=0)
    state = p.nixl._kvscope_state
    assert state.pulls == {} and state.pending_decisions == {}
    result = p.scheduler.update_from_output(out, Runner(p).answer(out))
    [final] = [o for batch in result.values() for o in batch.outputs]
    assert final.finish_reason is not None
    assert captured.spans(semconv.SPAN_KV_TRANSFER) == []
    assert (state.pulls, state.failed_loads, state.finished_pulls) == ({}, {}, {})
    assert len(captured.spans(semconv.SPAN_REUSE_DECISION)) == 1
    assert NixlConnectorInstrumentor().stats.hook_errors == 0


# --- 2. recompute after a failed read: pull, then reissued -------------------------------------
def test_recompute_after_failed_read_second_schedule_is_reissued(
    captured: Captured, engines: Any
) -> None:
    """``kv_load_failure_policy="recompute"``: the first schedule's decision span is ``pull``
    (160 tokens, a read registered). The worker reports the read failed as the NIXL worker does
    (failed_recving + every local block invalid); vLLM resets the request to 0 computed tokens
    and asks the connector again, which answers (160, True) from the unchanged offer, but
    ``_remote_blocks_processed`` stops a second read: the second decision span is ``reissued``
    with ``to_pull_tokens`` 0, no later schedule registers a read (``reqs_to_recv`` stays empty,
    the instrumentor tracks only the first pull), and the request parks in
    WAITING_FOR_REMOTE_KVS. When the client aborts, the first read is reported failed once."""
    p = engines("kv_producer", policy="recompute")
    allocated = spy(p.nixl, "update_state_after_alloc",
                    after=lambda req, blocks, n: (n, p.nixl._reqs_need_recv.get(req.request_id)))
    req, outputs = read_then_fail(p, "worker")
    assert outputs == [] and req.num_computed_tokens == 0
    assert decisions(captured) == [(semconv.DECISION_PULL, 160)]
    for _ in range(3):
        out = p.scheduler.schedule()
        assert out.num_scheduled_tokens == {}
        assert out.kv_connector_metadata.reqs_to_recv == {}  # no second read, ever
        p.scheduler.update_from_output(out, Runner(p).answer(out, KVConnectorOutput()))
        assert p.status("p-t2") == RequestStatus.WAITING_FOR_REMOTE_KVS
    # vLLM: allocated twice with 160 external tokens, a recv registered only the first time.
    assert [n for _, (n, _) in allocated] == [160, 160]
    assert allocated[0][1][1] is not None and allocated[1][1][1] is None
    # kvscope: pull, then reissued with nothing to pull; one tracked (failed) pull.
    assert decisions(captured) == [(semconv.DECISION_PULL, 160), (semconv.DECISION_REISSUED, 0)]
    state = p.nixl._kvscope_state
    assert list(state.pulls) == ["p-t2"] and state.pulls["p-t2"][0] == 160
    assert list(state.failed_loads) == ["p-t2"]
    assert captured.spans(semconv.SPAN_KV_TRANSFER) == []  # the turn has not ended
    p.scheduler.finish_requests({"p-t2"}, RequestStatus.FINISHED_ABORTED)
    span = e2e.the_span(captured, semconv.SPAN_KV_TRANSFER)
    assert span.attributes[semconv.TRANSFER_STATUS] == semconv.TRANSFER_FAILED
    assert span.attributes[semconv.REQUEST_OUTCOME] == "aborted"
    assert (state.pulls, state.failed_loads, state.finished_pulls) == ({}, {}, {})
    assert NixlConnectorInstrumentor().stats.hook_errors == 0


# --- 3. notify-only with a failed handshake on the real worker ---------------------------------
def ghost_offer(tokens: int, port: int, remote_blocks: list[int]) -> dict[str, Any]:
    """An offer from a decode engine nobody runs (nothing listens on ``port``)."""
    return dict(do_remote_decode=True, do_remote_prefill=False,
                remote_block_ids=(remote_blocks,), remote_engine_id="ghost-decode",
                remote_request_id="ghost-d", remote_host="127.0.0.1", remote_port=port,
                tp_size=1, dcp_size=1, pp_size=1, remote_num_tokens=tokens,
                remote_blocks_expiry_time=time.perf_counter() + 400.0,
                remote_registration_generation=0, transfer_mode="pull")


def test_notify_only_failed_handshake_leaves_no_read_failure(
    captured: Captured, nixl_engines: Any, vllm_log: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """A notify-only recv ("c3-p": 40 tokens < threshold 64) and a real read ("c3-r": 96
    tokens into 3 local blocks) to the same unreachable decode engine share one background
    handshake, which times out (5 s ZMQ receive timeout). vLLM logs ``handshake_failed`` for
    both through ``_log_failure`` (kvscope reads its record), reports "c3-r" in failed_recving
    and drops "c3-p" (not in ``_recving_metadata``). The instrumentor's worker state must hold
    no ``read_failures`` entry afterwards (it used to leak one for the notify-only request), and
    the only ``kvscope.kv_transfer`` span is c3-r's ``handshake_failed``: none for c3-p."""
    p, _ = nixl_engines
    worker = p.worker.connector_worker
    inst = NixlConnectorInstrumentor()
    assert inst.private_hooks_active and not is_wrapped(type(worker), "_log_failure")
    port = free_port()
    notify = request("c3-p", 140, ghost_offer(40, port, [20, 21]))
    read = request("c3-r", 140, ghost_offer(96, port, [22, 23, 24]))
    step(p)  # settle anything the fixture's set-up left to report
    errors = inst.stats.hook_errors
    assert schedule(p, notify, [7, 8, 9, 10, 11]) == 0  # P computes it, only notifies D
    assert schedule(p, read, [12, 13, 14]) == 96
    seen = Results()
    seen(p, step(p))
    assert "c3-p" not in worker._recving_metadata and "c3-r" in worker._recving_metadata
    state = inst._state(worker)
    assert set(state.reads) == {"c3-r"}  # kvscope tracks the read, not the notify-only recv
    started = time.monotonic()
    step_until(lambda: "c3-r" in seen.of(p, "failed") and worker._failed_recv_reqs.empty()
               and not worker._recv_failures, p, on=seen, timeout_s=20.0)
    seen(p, step(p))
    waited = time.monotonic() - started
    assert waited < 10.0, f"the real handshake failure took {waited:.1f} s"
    # What vLLM did: both failures logged, c3-r reported failed, c3-p dropped.
    failures = messages(vllm_log, "NIXL transfer failure: handshake_failed |")
    assert sorted("'request_id': 'c3-p'" in m for m in failures) == [False, True]
    assert any("'request_id': 'c3-r'" in m for m in failures)
    assert "c3-p" not in seen.of(p, "recving") | seen.of(p, "failed")
    # What kvscope kept and emitted.
    assert "c3-p" not in state.read_failures
    assert state.read_failures == {} and state.reads == {}
    spans = {s.attributes[semconv.VLLM_REQUEST_ID]: s.attributes
             for s in captured.spans(semconv.SPAN_KV_TRANSFER)}
    assert set(spans) == {"c3-r"}
    a = spans["c3-r"]
    assert a[semconv.TRANSFER_STATUS] == semconv.TRANSFER_HANDSHAKE_FAILED
    assert a[semconv.TRANSFER_DIRECTION] == semconv.DIRECTION_D_TO_P
    assert a[semconv.TRANSFER_BYTES] == 0 and a[semconv.TRANSFER_BLOCKS] == 0
    assert a[semconv.REMOTE_ENGINE_ID] == "ghost-decode"
    assert inst.stats.hook_errors == errors


# --- 4. private hook gating, a missing public target -------------------------------------------
@pytest.fixture
def bare_instrumentor() -> Iterator[NixlConnectorInstrumentor]:
    """The process's instrumentor, uninstrumented before and after (as ``captured`` leaves it)."""
    inst = NixlConnectorInstrumentor()
    inst.uninstrument()
    try:
        yield inst
    finally:
        inst.uninstrument()


def test_log_failure_records_keep_vllms_call_site(
    bare_instrumentor: NixlConnectorInstrumentor, nixl_engines: Any,  # noqa: F811
    vllm_log: pytest.LogCaptureFixture,  # noqa: F811
) -> None:
    """vLLM's ``_log_failure`` logs with ``stacklevel=2``: the record names the function that
    called it (base_worker.py:1471 for a failed handshake). Called from ``probe`` here, the
    record names ``probe`` in this file, uninstrumented and instrumented alike: kvscope reads
    the record with a logging filter instead of wrapping ``_log_failure`` (a wrapper was one
    more frame, and every such record named kvscope's file)."""
    from opentelemetry.sdk.trace import TracerProvider

    worker = nixl_engines[0].worker.connector_worker
    def probe(tag: str) -> Any:
        worker._log_failure(failure_type=f"kvscope_probe_{tag}", req_id=None)
        [record] = [r for r in {id(r): r for r in vllm_log.records}.values()
                    if f"kvscope_probe_{tag}" in r.getMessage()]
        return record

    plain = probe("plain")
    assert (plain.pathname, plain.funcName) == (__file__, "probe")
    assert bare_instrumentor.instrument(tracer_provider=TracerProvider())
    assert bare_instrumentor.private_hooks_active
    hooked = probe("hooked")
    where = (hooked.pathname, hooked.lineno)
    assert (hooked.pathname, hooked.funcName) == (__file__, "probe"), where


def real_classes() -> dict[str, type]:
    import importlib

    return {
        "scheduler": getattr(importlib.import_module(instr.SCHEDULER_MODULE),
                             instr.SCHEDULER_CLASS),
        "worker": getattr(importlib.import_module(instr.WORKER_MODULE), instr.WORKER_CLASS),
    }


def test_private_hooks_match_the_real_worker_and_are_installed(
    bare_instrumentor: NixlConnectorInstrumentor,
) -> None:
    """``private_hook_matches`` is True for ``_read_blocks_for_req`` and
    ``_is_turn2_read_expired`` of the real 0.33.0 ``NixlPullConnectorWorker``; ``instrument()``
    therefore installs them (``private_hooks_active``) next to the six public hooks, and
    ``uninstrument()`` puts every original back."""
    from opentelemetry.sdk.trace import TracerProvider

    classes = real_classes()
    worker_cls = classes["worker"]
    for name in PRIVATE_HOOKS:
        assert private_hook_matches(worker_cls, name), name
    assert not private_hook_matches(worker_cls, "_no_such_method")
    before = {(role, name): getattr(classes[role], name)
              for role, name in PUBLIC_HOOKS + tuple(("worker", n) for n in PRIVATE_HOOKS)}
    assert bare_instrumentor.instrument(tracer_provider=TracerProvider())
    assert bare_instrumentor.private_hooks_active
    for role, name in before:
        assert getattr(getattr(classes[role], name), "_kvscope_wrapper", False), name
    for name in PRIVATE_HOOKS:  # still matched through the wrapper (signature follows it)
        assert private_hook_matches(worker_cls, name), name
    bare_instrumentor.uninstrument()
    for (role, name), original in before.items():
        assert getattr(classes[role], name) is original, name


@pytest.mark.parametrize(("role", "missing"), PUBLIC_HOOKS)
def test_a_missing_public_target_leaves_the_other_hooks_installed(
    bare_instrumentor: NixlConnectorInstrumentor, monkeypatch: pytest.MonkeyPatch,
    role: str, missing: str,
) -> None:
    """With one public target missing (a throwaway subclass of the real role class whose
    ``missing`` attribute is None, put where ``instrument()`` resolves the class), the other
    five public hooks and the three private worker hooks are installed, the miss is warned,
    the real classes are not touched where the subclass stands in, and ``uninstrument()`` leaves
    the subclass and the real classes as they were."""
    import importlib

    from opentelemetry.sdk.trace import TracerProvider

    real = real_classes()
    throwaway = type(f"Throwaway{real[role].__name__}", (real[role],), {missing: None})
    module = importlib.import_module(
        instr.SCHEDULER_MODULE if role == "scheduler" else instr.WORKER_MODULE)
    monkeypatch.setattr(module, instr.SCHEDULER_CLASS if role == "scheduler"
                        else instr.WORKER_CLASS, throwaway)
    targets = {**real, role: throwaway}
    real_before = {name: dict(cls.__dict__) for name, cls in real.items()}
    try:
        assert bare_instrumentor.instrument(tracer_provider=TracerProvider())
        assert bare_instrumentor.is_instrumented and bare_instrumentor.private_hooks_active
        assert throwaway.__dict__[missing] is None  # nothing installed for the missing target
        assert f"missing:{missing}" in bare_instrumentor._warned
        for r, name in PUBLIC_HOOKS + tuple(("worker", n) for n in PRIVATE_HOOKS):
            if (r, name) != (role, missing):
                assert is_wrapped(targets[r], name), (r, name)
        # The real class behind the subclass is untouched.
        assert dict(real[role].__dict__) == real_before[role]
    finally:
        bare_instrumentor.uninstrument()
    assert throwaway.__dict__.get(missing, "absent") is None
    assert not any(is_wrapped(throwaway, n) for _, n in PUBLIC_HOOKS + tuple(
        ("worker", n) for n in PRIVATE_HOOKS))
    for name, cls in real.items():
        assert dict(cls.__dict__) == real_before[name], name


def test_private_hooks_with_another_signature_are_left_out(
    bare_instrumentor: NixlConnectorInstrumentor, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gating: a worker whose ``_is_turn2_read_expired`` takes other leading parameters (as a
    later vLLM might) fails ``private_hook_matches``; ``instrument()`` then installs none of the
    private hooks (``private_hooks_active`` False) but all six public ones."""
    import importlib

    from opentelemetry.sdk.trace import TracerProvider

    real = real_classes()

    def _is_turn2_read_expired(self: Any, request_meta: Any) -> bool:
        return False

    throwaway = type("ThrowawayOtherSignature", (real["worker"],),
                     {"_is_turn2_read_expired": _is_turn2_read_expired})
    assert not private_hook_matches(throwaway, "_is_turn2_read_expired")
    assert private_hook_matches(throwaway, "_read_blocks_for_req")
    monkeypatch.setattr(importlib.import_module(instr.WORKER_MODULE), instr.WORKER_CLASS,
                        throwaway)
    targets = {**real, "worker": throwaway}
    try:
        assert bare_instrumentor.instrument(tracer_provider=TracerProvider())
        assert not bare_instrumentor.private_hooks_active
        for name in PRIVATE_HOOKS:
            assert not getattr(getattr(throwaway, name), "_kvscope_wrapper", False), name
        for r, name in PUBLIC_HOOKS:
            assert is_wrapped(targets[r], name), (r, name)
    finally:
        bare_instrumentor.uninstrument()
    assert throwaway.__dict__["_is_turn2_read_expired"] is _is_turn2_read_expired
