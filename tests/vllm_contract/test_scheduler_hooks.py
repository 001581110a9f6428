"""Hooks on the real NixlPullConnectorScheduler: spans field by field, restore, no leaks."""

from __future__ import annotations

import time
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvscope import semconv
from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor
from tests.vllm_contract.conftest import (
    BLOCK_SIZE,
    Captured,
    assert_notified_retention,
    assert_reuse_decision,
    block_bytes,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def offer(tokens: int, **overrides: Any) -> dict[str, Any]:
    """D's kv_transfer_params as the router forwards them to the next prefill."""
    params = {
        "do_remote_decode": True, "do_remote_prefill": False,
        "remote_block_ids": [list(range(max(tokens // BLOCK_SIZE, 1)))],
        "remote_engine_id": "decode-engine", "remote_request_id": "chatcmpl-prev",
        "remote_host": "127.0.0.1", "remote_port": 5600, "remote_num_tokens": tokens,
        "remote_blocks_expiry_time": time.perf_counter() + 480.0,
    }
    params.update(overrides)
    return params


def request(req_id: str, prompt_len: int, params: dict[str, Any] | None) -> Request:
    req = Request(req_id, list(range(prompt_len)), SamplingParams(max_tokens=8), None,
                  trace_headers={"traceparent": TRACEPARENT})
    req.kv_transfer_params = params
    return req


def blocks(n: int, start: int = 100) -> KVCacheBlocks:
    """n freshly allocated (unhashed) blocks: what update_state_after_alloc receives."""
    return KVCacheBlocks(([KVCacheBlock(block_id=start + i) for i in range(n)],))


def schedule(sched: NixlPullConnectorScheduler, req: Request, local: int) -> tuple[int, bool]:
    """What vLLM's scheduler does for a waiting request: ask, allocate, tell."""
    count, load_async = sched.get_num_new_matched_tokens(req, local)
    n_blocks = -(-(req.num_prompt_tokens - local) // BLOCK_SIZE)
    sched.update_state_after_alloc(req, blocks(n_blocks), count or 0)
    return count, load_async


@pytest.mark.parametrize(
    ("offered", "local", "bidir", "expected"),
    [
        (160, 16, True, (144, True, semconv.DECISION_PULL)),
        (32, 0, True, (0, False, semconv.DECISION_BELOW_THRESHOLD)),
        (160, 160, True, (0, False, semconv.DECISION_LOCAL_COVERS)),
        (160, 16, False, (144, True, semconv.DECISION_PULL)),  # R10: P answers, never reads
        (50, 0, False, (0, False, semconv.DECISION_BELOW_THRESHOLD)),
    ],
)
def test_reuse_decision_span_field_by_field(
    captured: Captured, make_scheduler_connector: Any, offered: int, local: int, bidir: bool,
    expected: tuple[int, bool, str],
) -> None:
    sched = make_scheduler_connector("kv_producer", bidir=bidir).connector_scheduler
    req = request("chatcmpl-t2", 170, offer(offered))
    count, load_async = schedule(sched, req, local)
    assert (count, load_async) == expected[:2]  # the hook did not change vLLM's answer
    [span] = captured.spans(semconv.SPAN_REUSE_DECISION)
    assert_reuse_decision(span, TRACEPARENT, req_id="chatcmpl-t2", decision=expected[2],
                          local=local, offered=offered, to_pull=expected[0], bidir=bidir,
                          prompt=170)
    # cache_config.block_size, so the ledger can tell an aligned read from a misaligned one.
    assert span.attributes[semconv.KV_BLOCK_SIZE] == sched.block_size > 0
    # The read is registered exactly when bidir is on at P (R10 otherwise).
    assert ("chatcmpl-t2" in sched._reqs_need_recv) is bidir


@pytest.mark.parametrize(
    ("params", "decision"),
    [
        (offer(160, remote_host=None, remote_port=None), semconv.DECISION_PULL),  # presence only
        ({k: v for k, v in offer(160).items() if k != "remote_port"},
         semconv.DECISION_INVALID_PARAMS),
        (offer(160, remote_block_ids=None), semconv.DECISION_INVALID_PARAMS),
        ({"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
          "remote_block_ids": None, "remote_host": None, "remote_port": None},
         semconv.DECISION_NO_OFFER),
    ],
)
def test_invalid_and_missing_offers(
    captured: Captured, make_scheduler_connector: Any, params: dict[str, Any], decision: str
) -> None:
    sched = make_scheduler_connector("kv_producer").connector_scheduler
    schedule(sched, request("r", 170, params), 0)
    [span] = captured.spans(semconv.SPAN_REUSE_DECISION)
    assert span.attributes[semconv.DECISION] == decision


def test_one_decision_per_schedule_not_per_failed_allocation(
    captured: Captured, make_scheduler_connector: Any
) -> None:
    sched = make_scheduler_connector("kv_producer").connector_scheduler
    req = request("r", 170, offer(160))
    for _ in range(3):  # the scheduler asks again while allocation keeps failing
        sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, blocks(11), 160)
    assert len(captured.spans(semconv.SPAN_REUSE_DECISION)) == 1


def test_requests_without_an_offer_role_emit_no_decision(
    captured: Captured, make_scheduler_connector: Any
) -> None:
    sched = make_scheduler_connector("kv_consumer").connector_scheduler
    req = request("d1", 64, {"do_remote_prefill": True, "do_remote_decode": False,
                             **{k: v for k, v in offer(64).items()
                                if k.startswith("remote_") and k != "remote_blocks_expiry_time"}})
    schedule(sched, req, 0)
    schedule(sched, request("plain", 64, None), 0)
    assert captured.spans(semconv.SPAN_REUSE_DECISION) == []


def finish(sched: NixlPullConnectorScheduler, req: Request, status: RequestStatus,
           n_blocks: int) -> tuple[bool, dict[str, Any] | None]:
    req.status = status
    req.num_computed_tokens = req.num_prompt_tokens + 3
    return sched.request_finished(req, (list(range(n_blocks)),))


def test_decode_retention_pinned_then_released_by_notification(
    captured: Captured, make_scheduler_connector: Any
) -> None:
    sched = make_scheduler_connector("kv_consumer", engine_id="d0").connector_scheduler
    req = request("d-turn1", 170, {"do_remote_prefill": False, "do_remote_decode": False})
    delay, params = finish(sched, req, RequestStatus.FINISHED_STOPPED, 11)
    assert delay and params is not None and params["remote_num_tokens"] == 173
    assert captured.gauge(semconv.METRIC_KV_RETAINED) == {
        ((semconv.ENGINE_ID, "d0"),): 11 * block_bytes()}
    assert captured.spans(semconv.SPAN_KV_RETENTION) == []  # still held
    sched.update_connector_output(KVConnectorOutput(finished_sending={"d-turn1"}))
    [span] = captured.spans(semconv.SPAN_KV_RETENTION)
    assert_notified_retention(span, "d-turn1", blocks=11, remote_num_tokens=173)
    assert 0 <= span.end_time - span.start_time < 5e9
    assert captured.gauge(semconv.METRIC_KV_RETAINED) == {((semconv.ENGINE_ID, "d0"),): 0}


def test_decode_retention_released_by_the_ttl_reaper_is_expired(
    captured: Captured, make_scheduler_connector: Any
) -> None:
    sched = make_scheduler_connector("kv_consumer", ttl=0.05).connector_scheduler
    req = request("d-late", 40, {"do_remote_prefill": False, "do_remote_decode": False})
    finish(sched, req, RequestStatus.FINISHED_LENGTH_CAPPED, 3)
    time.sleep(0.1)
    sched.update_connector_output(KVConnectorOutput(finished_sending={"d-late"}))
    [span] = captured.spans(semconv.SPAN_KV_RETENTION)
    assert span.attributes[semconv.RETENTION_RELEASE_REASON] == semconv.RELEASE_EXPIRED
    assert span.attributes[semconv.RETENTION_TTL_S] == pytest.approx(0.05)
    assert span.end_time - span.start_time >= 0.05e9


@pytest.mark.parametrize(
    ("bidir", "status"),
    [(False, RequestStatus.FINISHED_STOPPED), (True, RequestStatus.FINISHED_ABORTED),
     (True, RequestStatus.FINISHED_ERROR)],
)
def test_no_retention_without_bidir_or_after_abort(
    captured: Captured, make_scheduler_connector: Any, bidir: bool, status: RequestStatus
) -> None:
    sched = make_scheduler_connector("kv_consumer", bidir=bidir).connector_scheduler
    req = request("d", 40, {"do_remote_prefill": False, "do_remote_decode": False})
    assert finish(sched, req, status, 3) == (False, None)
    assert NixlConnectorInstrumentor().open_retentions(sched) == []


def test_failed_load_reports_the_request_outcome(
    captured: Captured, make_scheduler_connector: Any
) -> None:
    sched = make_scheduler_connector("kv_producer").connector_scheduler
    req = request("p-late", 170, offer(160))
    schedule(sched, req, 0)
    sched.update_connector_output(KVConnectorOutput(failed_recving={"p-late"}))
    req.status = RequestStatus.FINISHED_ERROR  # kv_load_failure_policy "fail" (the default)
    assert sched.request_finished(req, ([1, 2],)) == (False, None)
    [span] = captured.spans(semconv.SPAN_KV_TRANSFER)
    a = span.attributes
    assert a[semconv.TRANSFER_STATUS] == semconv.TRANSFER_FAILED
    assert a[semconv.REQUEST_OUTCOME] == semconv.OUTCOME_ERROR
    assert a[semconv.TRANSFER_DIRECTION] == semconv.DIRECTION_D_TO_P
    assert a[semconv.VLLM_REQUEST_ID] == "p-late"
    assert a[semconv.REMOTE_ENGINE_ID] == "decode-engine"


def test_uninstrument_restores_the_originals(make_scheduler_connector: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )

    names = ("get_num_new_matched_tokens", "update_state_after_alloc",
             "update_connector_output", "request_finished")
    before = {n: getattr(NixlPullConnectorScheduler, n) for n in names}
    scheduler_dict = dict(NixlPullConnectorScheduler.__dict__)
    worker_dict = dict(NixlPullConnectorWorker.__dict__)
    instrumentor = NixlConnectorInstrumentor()
    instrumentor.uninstrument()
    assert instrumentor.instrument() and instrumentor.instrument()  # idempotent
    assert instrumentor.private_hooks_active
    assert all(getattr(NixlPullConnectorScheduler, n) is not before[n] for n in names)
    # Inherited methods get a wrapper on the role class itself, never on the base class.
    assert "update_connector_output" in NixlPullConnectorScheduler.__dict__
    assert "get_transfer_results" in NixlPullConnectorWorker.__dict__
    instrumentor.uninstrument()
    instrumentor.uninstrument()
    assert {n: getattr(NixlPullConnectorScheduler, n) for n in names} == before
    assert dict(NixlPullConnectorScheduler.__dict__) == scheduler_dict
    assert dict(NixlPullConnectorWorker.__dict__) == worker_dict


def test_an_exception_inside_a_hook_never_reaches_vllm(
    captured: Captured, make_scheduler_connector: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    instrumentor = NixlConnectorInstrumentor()

    def boom(*_: object) -> None:
        raise RuntimeError("hook bug")

    for name in ("_after_alloc", "_connector_output", "_finished", "_state"):
        monkeypatch.setattr(instrumentor, name, boom)
    errors = instrumentor.stats.hook_errors
    sched = make_scheduler_connector("kv_consumer").connector_scheduler
    req = request("d", 40, {"do_remote_prefill": False, "do_remote_decode": False})
    assert schedule(sched, request("p", 170, offer(160)), 0) == (160, True)
    delay, params = finish(sched, req, RequestStatus.FINISHED_STOPPED, 3)
    assert delay and params is not None
    sched.update_connector_output(KVConnectorOutput(finished_sending={"d"}))
    assert instrumentor.stats.hook_errors > errors


def test_token_hashes_say_whether_the_prompt_holds_the_tokens_decode_holds(
    captured: Captured, make_scheduler_connector: Any
) -> None:
    """Decode's retention hashes the tokens it holds KV for (prompt + output, remote_num_tokens
    of them); prefill's decision hashes the prompt's tokens a read of that offer covers. Equal
    exactly when those tokens are the same: a reply re-sent as text that tokenizes otherwise
    (one token differs here) gives another hash, though counts and messages may agree."""
    dec = make_scheduler_connector("kv_consumer", engine_id="d0").connector_scheduler
    held = request("d-turn1", 170, {"do_remote_prefill": False, "do_remote_decode": False})
    held.append_output_token_ids([170, 171, 172])
    _, params = finish(dec, held, RequestStatus.FINISHED_STOPPED, 11)
    assert params is not None and params["remote_num_tokens"] == 173
    dec.update_connector_output(KVConnectorOutput(finished_sending={"d-turn1"}))
    [retention] = captured.spans(semconv.SPAN_KV_RETENTION)
    pre = make_scheduler_connector("kv_producer").connector_scheduler
    same = request("p-same", 200, offer(173))
    # One token of the reply tokenized otherwise.
    prompt = [9 if i == 171 else i for i in range(200)]
    retokenized = Request("p-retokenized", prompt, SamplingParams(max_tokens=8), None)
    retokenized.kv_transfer_params = offer(173)
    for req in (same, retokenized):
        schedule(pre, req, 0)
    by_id = {s.attributes[semconv.VLLM_REQUEST_ID]: s.attributes
             for s in captured.spans(semconv.SPAN_REUSE_DECISION)}
    held_hash = retention.attributes[semconv.KV_TOKENS_HASH]
    key_id = retention.attributes[semconv.KV_TOKENS_HASH_KEY_ID]
    assert len(held_hash) == 16 and key_id
    assert by_id["p-same"][semconv.KV_TOKENS_HASH] == held_hash
    assert by_id["p-retokenized"][semconv.KV_TOKENS_HASH] != held_hash
    assert {a[semconv.KV_TOKENS_HASH_KEY_ID] for a in by_id.values()} == {key_id}
    # A prompt shorter than the offer: no hash (its read is judged by counts).
    schedule(pre, request("p-shorter", 170, offer(173)), 0)
    [shorter] = [s.attributes for s in captured.spans(semconv.SPAN_REUSE_DECISION)
                 if s.attributes[semconv.VLLM_REQUEST_ID] == "p-shorter"]
    assert semconv.KV_TOKENS_HASH not in shorter


def test_token_hashes_off_by_setting(captured: Captured, make_scheduler_connector: Any,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from kvscope.collector.vllm import instrumentor as module

    monkeypatch.setenv("KVSCOPE_TOKEN_HASHES", "off")
    monkeypatch.setattr(NixlConnectorInstrumentor(), "_token_key", module._UNRESOLVED)
    schedule(make_scheduler_connector("kv_producer").connector_scheduler,
             request("p", 200, offer(173)), 0)
    [decision] = captured.spans(semconv.SPAN_REUSE_DECISION)
    assert semconv.KV_TOKENS_HASH not in decision.attributes
