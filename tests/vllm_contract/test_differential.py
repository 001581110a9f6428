"""Differential: the emulator's reuse model decides what the real NixlPullConnectorScheduler does.

On hypothesis-generated offers and prompts, :class:`kvscope.emulator.reuse_model.PrefillNode`
and ``DecodeNode`` must agree with the real 0.33.0 scheduler role on tokens to pull, the async
flag, whether a read (or notify-only) is registered, the returned params and retention — and the
hooks must label the decision the way the model does.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from kvscope import semconv
from kvscope.emulator import reuse_model as model
from kvscope.emulator.tokens import BlockSeq
from kvscope.reuse import params as rules
from tests.vllm_contract.conftest import BLOCK_SIZE, Captured, block_bytes

_connectors: dict[tuple[Any, ...], Any] = {}
_counter = iter(range(10**9))


def real_scheduler(make: Any, kv_role: str, bidir: bool, threshold: int) -> Any:
    key = (kv_role, bidir, threshold)
    if key not in _connectors:
        _connectors[key] = make(kv_role, bidir=bidir, threshold=threshold,
                                engine_id="decode-engine").connector_scheduler
    return _connectors[key]


@st.composite
def prefill_cases(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 400))
    keys = draw(st.sets(st.sampled_from(rules.D_TO_P_REQUIRED_KEYS))
                | st.just(set(rules.D_TO_P_REQUIRED_KEYS)))
    params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    for key in keys:
        params[key] = draw(st.sampled_from([None, "x", 5600])) if key != "remote_engine_id" \
            else "decode-engine"
    if draw(st.booleans()):
        params["remote_block_ids"] = [list(range(draw(st.integers(1, 30))))]
    else:
        params["remote_block_ids"] = draw(st.sampled_from([None, [], [[]]]))
    offered = draw(st.none() | st.integers(0, 500))
    if offered is not None:
        params["remote_num_tokens"] = offered
    return {
        "n": n,
        "local_blocks": draw(st.integers(0, (n - 1) // BLOCK_SIZE)),
        "bidir": draw(st.booleans()),
        "threshold": draw(st.sampled_from([0, 1, 16, 64, 100])),
        "params": params,
    }


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=prefill_cases())
def test_prefill_decision_matches_the_model(
    captured: Captured, make_scheduler_connector: Any, case: dict[str, Any]
) -> None:
    captured.clear()
    n, bidir, threshold = case["n"], case["bidir"], case["threshold"]
    sched = real_scheduler(make_scheduler_connector, "kv_producer", bidir, threshold)
    req_id = f"p-{next(_counter)}"
    tokens = list(range(n))
    local = case["local_blocks"] * BLOCK_SIZE

    node = model.PrefillNode(model.NodeConfig(
        engine_id="prefill", bidirectional_kv_xfer=bidir, kv_recompute_threshold=threshold))
    prompt = BlockSeq.from_tokens(tokens)
    node.cache.touch(prompt, case["local_blocks"])
    expected = node.decide(req_id, prompt, dict(case["params"]))
    assert expected.local_hit_tokens == local

    req = Request(req_id, tokens, SamplingParams(max_tokens=1), None)
    req.kv_transfer_params = dict(case["params"])
    count, load_async = sched.get_num_new_matched_tokens(req, local)
    external = count if load_async else 0
    fresh = math.ceil((n - local) / BLOCK_SIZE)
    sched.update_state_after_alloc(
        req, KVCacheBlocks(([KVCacheBlock(block_id=i) for i in range(fresh)],)), external)

    assert (external, load_async) == (expected.tokens_to_pull, expected.load_async)
    registered = sched._reqs_need_recv.pop(req_id, None)
    assert (registered is not None) == expected.read_registered
    if registered is not None:
        assert (not any(registered[1])) == expected.notify_only
    [span] = captured.spans(semconv.SPAN_REUSE_DECISION)
    assert span.attributes[semconv.DECISION] == expected.decision
    assert span.attributes[semconv.TOKENS_TO_PULL] == expected.tokens_to_pull
    sched._reqs_in_batch.discard(req_id)


_STATUSES = {
    rules.STATUS_STOPPED: RequestStatus.FINISHED_STOPPED,
    rules.STATUS_LENGTH_CAPPED: RequestStatus.FINISHED_LENGTH_CAPPED,
    rules.STATUS_ABORTED: RequestStatus.FINISHED_ABORTED,
    rules.STATUS_ERROR: RequestStatus.FINISHED_ERROR,
}


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(n=st.integers(2, 600), bidir=st.booleans(), status=st.sampled_from(sorted(_STATUSES)))
def test_decode_finish_matches_the_model(
    captured: Captured, make_scheduler_connector: Any, n: int, bidir: bool, status: str
) -> None:
    captured.clear()
    sched = real_scheduler(make_scheduler_connector, "kv_consumer", bidir, 64)
    req_id = f"d-{next(_counter)}"
    node = model.DecodeNode(model.NodeConfig(
        engine_id="decode-engine", bidirectional_kv_xfer=bidir, side_channel_host="localhost",
        side_channel_port=5600, kv_bytes_per_token=block_bytes() // BLOCK_SIZE,
        scheduling=rules.SCHEDULING_SYNC))  # the request below is finished as sync leaves it
    retention, expected = node.finish_request(req_id, BlockSeq.from_tokens(range(n)), status,
                                              now=0.0)

    req = Request(req_id, list(range(n)), SamplingParams(max_tokens=1), None)
    req.kv_transfer_params = {"do_remote_prefill": False, "do_remote_decode": False}
    req.status = _STATUSES[status]
    req.num_computed_tokens = n - 1
    blocks = math.ceil((n - 1) / BLOCK_SIZE)
    delay_free, params = sched.request_finished(req, (list(range(blocks)),))

    assert delay_free == (retention is not None)
    assert (params is None) == (expected is None)
    if params is not None and expected is not None:
        assert tuple(params) == rules.PARAMS_FIELDS
        assert [len(g) for g in params["remote_block_ids"]] == \
            [len(g) for g in expected["remote_block_ids"]]
        skip = {"remote_block_ids", "remote_blocks_expiry_time"}
        assert {k: v for k, v in params.items() if k not in skip} == \
            {k: v for k, v in expected.items() if k not in skip}
        assert params["remote_blocks_expiry_time"] is not None
        sched._reqs_need_send.pop(req_id, None)
    if retention is not None:
        from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor

        assert NixlConnectorInstrumentor().open_retentions(sched) == [req_id]
        from vllm.v1.outputs import KVConnectorOutput

        sched.update_connector_output(KVConnectorOutput(finished_sending={req_id}))
        [span] = captured.spans(semconv.SPAN_KV_RETENTION)
        assert span.attributes[semconv.RETENTION_BLOCKS] == retention.blocks
        assert span.attributes[semconv.RETENTION_BYTES] == retention.bytes
        assert span.attributes[semconv.REMOTE_NUM_TOKENS] == retention.tokens
    else:
        assert captured.spans(semconv.SPAN_KV_RETENTION) == []
