"""The real v1 ``Scheduler`` end to end on CPU: real requests, real connector, spans field by field.

vLLM 0.33.0's ``vllm.v1.core.sched.scheduler.Scheduler`` is built on CPU (a tiny LlamaConfig in a
temp dir, ``ModelConfig(skip_tokenizer_init=True)``, 16-token blocks) with the real
``NixlConnector`` and driven through ``schedule()`` / ``update_from_output()`` with hand-made
``ModelRunnerOutput`` / ``KVConnectorOutput`` (the worker's ``finished_recving``,
``failed_recving`` and ``finished_sending``), while :class:`NixlConnectorInstrumentor` records
into in-memory providers.

Besides the spans, these tests pin what the real scheduler does in the cases the emulator models
by code reading (``kvscope.emulator.reuse_model``): bidir off at prefill with an offer (the
request parks in WAITING_FOR_REMOTE_KVS and nothing ever wakes it) and a second schedule of a
request whose read was already issued once (``stall_on_reissued_load``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvscope import semconv
from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor
from tests.vllm_contract.conftest import (
    BLOCK_SIZE,
    Captured,
    assert_notified_retention,
    assert_reuse_decision,
    block_bytes,
    kv_cache_config,
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
NUM_BLOCKS = 128
MAX_MODEL_LEN = 1024
TOKEN = 7  # every sampled token (ids only; no text anywhere)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama config (no weights): all ModelConfig needs; 2 KV heads of size 8."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=MAX_MODEL_LEN,
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_config(model_dir: Path) -> Any:
    from vllm.config import ModelConfig

    return ModelConfig(model=str(model_dir), dtype="float16", skip_tokenizer_init=True,
                       max_model_len=MAX_MODEL_LEN)


class Engine:
    """One real v1 Scheduler with the real NixlConnector, stepped by hand as EngineCore does."""

    def __init__(self, model_config: Any, kv_role: str, *, prefix_caching: bool = True,
                 max_batched_tokens: int = 512, log_stats: bool = False,
                 num_blocks: int = NUM_BLOCKS, **connector: Any) -> None:
        from vllm.config import CacheConfig, SchedulerConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from tests.vllm_contract.conftest import vllm_config

        cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching)
        cache.num_gpu_blocks = num_blocks
        scheduler = SchedulerConfig(max_num_batched_tokens=max_batched_tokens, max_num_seqs=8,
                                    max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False)
        self.config = vllm_config(kv_role, model=model_config, scheduler=scheduler, cache=cache,
                                  **connector)
        self.scheduler = Scheduler(self.config, kv_cache_config(num_blocks),
                                   block_size=BLOCK_SIZE,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   log_stats=log_stats)
        hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.last: Any = None

    @property
    def nixl(self) -> Any:
        """The real NixlPullConnectorScheduler behind the facade."""
        return self.scheduler.connector.connector_scheduler

    def add(self, req_id: str, prompt_len: int, params: dict[str, Any] | None,
            max_tokens: int = 1) -> Request:
        req = Request(req_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                      None, trace_headers={"traceparent": TRACEPARENT}, block_hasher=self._hasher)
        req.kv_transfer_params = params
        self.scheduler.add_request(req)
        return req

    def step(self, *, finished_recving: Iterable[str] = (), failed_recving: Iterable[str] = (),
             finished_sending: Iterable[str] = ()) -> list[Any]:
        """schedule(), then the model runner's answer: one sampled token per finished prefill."""
        out = self.scheduler.schedule()
        self.last = out
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = self.scheduler.requests[req_id]
            # num_computed_tokens already counts this step's tokens: a partial prefill samples none.
            sampled.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        recving = set(finished_recving) | set(failed_recving)
        kv_out = KVConnectorOutput(finished_recving=recving or None,
                                   failed_recving=set(failed_recving),
                                   finished_sending=set(finished_sending) or None)
        runner = ModelRunnerOutput(req_ids=req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled, kv_connector_output=kv_out)
        outputs = self.scheduler.update_from_output(out, runner)
        return [o for batch in outputs.values() for o in batch.outputs]

    def run(self, req_id: str, steps: int = 8) -> list[Any]:
        """Step until ``req_id`` has left the scheduler; its outputs."""
        outputs: list[Any] = []
        for _ in range(steps):
            outputs += self.step()
            if req_id not in self.scheduler.requests:
                break
        return outputs

    def recv_targets(self) -> dict[str, Any]:
        """What the last schedule() told the worker to read: request id → local block ids."""
        meta = self.last.kv_connector_metadata
        return {rid: m.local_block_ids for rid, m in meta.reqs_to_recv.items()}

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def status(self, req_id: str) -> RequestStatus | None:
        req = self.scheduler.requests.get(req_id)
        return req.status if req is not None else None

    def preempt(self, req_id: str) -> None:
        """What schedule()'s running loop does to a request it must evict (``_preempt_request``)."""
        req = self.scheduler.requests[req_id]
        self.scheduler.running.remove(req)
        self.scheduler._preempt_request(req, time.monotonic())


def offer(tokens: int, *, expiry_in: float = 480.0, **overrides: Any) -> dict[str, Any]:
    """D's params as the multi-turn proxy forwards them to the next prefill."""
    params: dict[str, Any] = {
        "do_remote_decode": True, "do_remote_prefill": False,
        "remote_block_ids": [list(range(50, 50 + -(-tokens // BLOCK_SIZE)))],
        "remote_engine_id": "decode-engine", "remote_request_id": "chatcmpl-t1",
        "remote_host": "127.0.0.1", "remote_port": 5600, "remote_num_tokens": tokens,
        "remote_blocks_expiry_time": time.perf_counter() + expiry_in,
        "tp_size": 1, "dcp_size": 1, "pp_size": 1, "transfer_mode": "pull",
    }
    params.update(overrides)
    return params


def p_params(prompt_len: int) -> dict[str, Any]:
    """P's params for a normal P→D handoff (what decode receives on turn 1)."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [list(range(-(-prompt_len // BLOCK_SIZE)))],
            "remote_engine_id": "prefill-engine", "remote_request_id": "p-req",
            "remote_host": "127.0.0.1", "remote_port": 5601, "remote_num_tokens": prompt_len,
            "remote_blocks_expiry_time": None, "tp_size": 1}


@pytest.fixture
def engines(captured: Captured, model_config: Any) -> Iterator[Any]:
    """A factory of instrumented real schedulers (objects built after instrument(), as in vLLM)."""

    def make(kv_role: str, **kwargs: Any) -> Engine:
        return Engine(model_config, kv_role, **kwargs)

    yield make


def the_span(captured: Captured, name: str) -> Any:
    spans = captured.spans(name)
    assert len(spans) == 1, [s.attributes for s in spans]
    return spans[0]


# --- decode role ------------------------------------------------------------------------------
def test_decode_turn_pins_its_blocks_and_a_notification_releases_them(
    captured: Captured, engines: Any
) -> None:
    d = engines("kv_consumer", engine_id="decode-engine")
    free0 = d.free_blocks()
    d.add("d-t1", 100, p_params(100), max_tokens=4)
    assert d.step() == []
    assert d.status("d-t1") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert list(d.recv_targets()) == ["d-t1"]  # D pulls P's KV first (P→D)
    d.step(finished_recving={"d-t1"})
    final = [o for o in d.run("d-t1") if o.finish_reason is not None]
    assert len(final) == 1
    params = final[0].kv_transfer_params
    # 100 prompt + 4 sampled, the last not yet computed: 103 tokens in 7 blocks stay pinned.
    assert params["remote_num_tokens"] == 103
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_blocks_expiry_time"] == pytest.approx(time.perf_counter() + 480, abs=30)
    assert NixlConnectorInstrumentor().open_retentions(d.nixl) == ["d-t1"]
    assert captured.gauge(semconv.METRIC_KV_RETAINED) == {
        ((semconv.ENGINE_ID, "decode-engine"),): 7 * block_bytes()}
    assert captured.spans(semconv.SPAN_KV_RETENTION) == []
    assert captured.spans(semconv.SPAN_REUSE_DECISION) == []  # decode decides nothing
    assert d.free_blocks() == free0 - 7  # pinned, not freed
    d.step(finished_sending={"d-t1"})  # P's READ notification arrived
    assert d.free_blocks() == free0
    span = the_span(captured, semconv.SPAN_KV_RETENTION)
    assert span.attributes[semconv.ENGINE_ID] == "decode-engine"
    assert_notified_retention(span, "d-t1", blocks=7, remote_num_tokens=103)
    assert format(span.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    assert 0 <= span.end_time - span.start_time < 10e9
    assert captured.gauge(semconv.METRIC_KV_RETAINED) == {
        ((semconv.ENGINE_ID, "decode-engine"),): 0}


def test_decode_with_bidir_off_retains_nothing(captured: Captured, engines: Any) -> None:
    d = engines("kv_consumer", bidir=False)
    free0 = d.free_blocks()
    d.add("d-t1", 100, p_params(100), max_tokens=2)
    d.step()
    d.step(finished_recving={"d-t1"})
    outputs = d.run("d-t1")
    [final] = [o for o in outputs if o.finish_reason is not None]
    assert final.kv_transfer_params is None
    assert d.free_blocks() == free0
    assert captured.spans() == []
    assert NixlConnectorInstrumentor().open_retentions(d.nixl) == []


# --- prefill role -----------------------------------------------------------------------------
def check_decision(span: Any, *, decision: str, local: int, offered: int, to_pull: int,
                   bidir: bool = True, prompt: int = 170) -> None:
    """The reuse decision of "p-t2", a request carrying :data:`TRACEPARENT`."""
    assert_reuse_decision(span, TRACEPARENT, req_id="p-t2", decision=decision, local=local,
                          offered=offered, to_pull=to_pull, bidir=bidir, prompt=prompt)


def test_prefill_pulls_an_offer_above_threshold_then_resumes(
    captured: Captured, engines: Any
) -> None:
    p = engines("kv_producer")
    p.add("p-t2", 170, offer(160))
    assert p.step() == []
    assert p.status("p-t2") == RequestStatus.WAITING_FOR_REMOTE_KVS
    [targets] = p.recv_targets().values()
    assert [len(group) for group in targets] == [10]  # 160 tokens into 10 fresh local blocks
    check_decision(the_span(captured, semconv.SPAN_REUSE_DECISION),
                   decision=semconv.DECISION_PULL, local=0, offered=160, to_pull=160)
    assert p.step() == []  # nothing arrived yet: still parked
    assert p.status("p-t2") == RequestStatus.WAITING_FOR_REMOTE_KVS
    p.step(finished_recving={"p-t2"})
    outputs = p.step()
    assert p.last.num_scheduled_tokens == {"p-t2": 10}  # only the 10 tokens D did not have
    [final] = outputs
    assert final.finish_reason is not None
    assert final.kv_transfer_params["do_remote_prefill"] is True  # P→D lease for this turn
    assert final.kv_transfer_params["remote_blocks_expiry_time"] is None
    assert len(captured.spans(semconv.SPAN_REUSE_DECISION)) == 1  # one schedule, one decision
    assert captured.spans(semconv.SPAN_KV_RETENTION) == []  # a P lease is not retention
    assert captured.spans(semconv.SPAN_KV_TRANSFER) == []  # the worker reports the read
    state = p.nixl._kvscope_state
    assert (state.pulls, state.failed_loads, state.finished_pulls) == ({}, {}, {})


def test_prefill_below_threshold_computes_and_only_notifies(
    captured: Captured, engines: Any
) -> None:
    p = engines("kv_producer")
    p.add("p-t2", 170, offer(48))
    [final] = p.step()
    assert p.last.num_scheduled_tokens == {"p-t2": 170}
    assert final.finish_reason is not None
    # Registered with no local blocks: the worker only notifies D, which releases its handle.
    assert p.recv_targets() == {"p-t2": ()}
    check_decision(the_span(captured, semconv.SPAN_REUSE_DECISION),
                   decision=semconv.DECISION_BELOW_THRESHOLD, local=0, offered=48, to_pull=0)


def test_prefill_local_hit_covers_the_offer(captured: Captured, engines: Any) -> None:
    p = engines("kv_producer")
    p.add("warm", 170, None)
    p.step()  # computes and caches 10 full blocks of the same prompt
    p.add("p-t2", 170, offer(160))
    p.step()
    assert p.last.num_scheduled_tokens == {"p-t2": 10}
    assert p.recv_targets() == {"p-t2": ()}
    check_decision(the_span(captured, semconv.SPAN_REUSE_DECISION),
                   decision=semconv.DECISION_LOCAL_COVERS, local=160, offered=160, to_pull=0)


def test_bidir_off_at_prefill_parks_the_request_for_good(
    captured: Captured, engines: Any
) -> None:
    """R10 confirmed on the real scheduler: (count, async) without a registered read."""
    p = engines("kv_producer", bidir=False)
    free0 = p.free_blocks()
    p.add("p-t2", 170, offer(160))
    for _ in range(5):
        assert p.step() == []
        assert p.recv_targets() == {}  # no read, not even a notify: D is never told
        assert p.status("p-t2") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert p.scheduler.get_num_unfinished_requests() == 1
    check_decision(the_span(captured, semconv.SPAN_REUSE_DECISION),
                   decision=semconv.DECISION_PULL, local=0, offered=160, to_pull=160,
                   bidir=False)
    # The client gives up: the abort frees the request, but its blocks wait for a
    # finished_recving that no read will ever send.
    p.scheduler.finish_requests({"p-t2"}, RequestStatus.FINISHED_ABORTED)
    assert p.scheduler.get_num_unfinished_requests() == 0
    assert p.free_blocks() == free0 - 10


@pytest.mark.parametrize("expired", [False, True])
def test_failed_load_with_fail_policy_ends_the_turn_in_error(
    captured: Captured, engines: Any, expired: bool
) -> None:
    # A declined expired offer reaches the scheduler as the same failed_recving as a failed READ.
    p = engines("kv_producer")
    free0 = p.free_blocks()
    p.add("p-t2", 170, offer(160, expiry_in=1.0 if expired else 480.0))
    p.step()
    [final] = p.step(failed_recving={"p-t2"})
    assert final.finish_reason is not None and p.status("p-t2") is None
    assert final.kv_transfer_params is None
    assert p.free_blocks() == free0
    span = the_span(captured, semconv.SPAN_KV_TRANSFER)
    a = span.attributes
    assert a[semconv.VLLM_REQUEST_ID] == "p-t2"
    assert a[semconv.ENGINE_ROLE] == semconv.ROLE_PREFILL
    assert a[semconv.TRANSFER_DIRECTION] == semconv.DIRECTION_D_TO_P
    assert a[semconv.TRANSFER_STATUS] == semconv.TRANSFER_FAILED
    assert a[semconv.REQUEST_OUTCOME] == semconv.OUTCOME_ERROR
    assert a[semconv.TRANSFER_BYTES] == 0 and a[semconv.TRANSFER_BLOCKS] == 0
    assert a[semconv.REMOTE_ENGINE_ID] == "decode-engine"
    assert format(span.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    state = p.nixl._kvscope_state  # nothing about the request is left behind
    assert (state.pulls, state.failed_loads, state.finished_pulls) == ({}, {}, {})


def reissued(p: Engine) -> None:
    """After the request is back in the waiting queue: it asks for an async load again."""
    for _ in range(4):
        assert p.step() == []
        assert p.status("p-t2") == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert p.recv_targets() == {}  # _remote_blocks_processed: nothing registers a read


def test_recompute_policy_after_a_failed_load_reissues_a_load_nobody_serves(
    captured: Captured, engines: Any
) -> None:
    """``stall_on_reissued_load`` confirmed: recompute resets to 0, the offer is asked again."""
    p = engines("kv_producer", policy="recompute")
    p.add("p-t2", 170, offer(160))
    p.step()
    assert p.step(failed_recving={"p-t2"}) == []
    reissued(p)
    decisions = captured.spans(semconv.SPAN_REUSE_DECISION)
    # The connector answers (160, async) twice; the second schedule registers no read: it is
    # recorded as its own decision, so the ledger tells a stall from a recompute.
    assert [s.attributes[semconv.DECISION] for s in decisions] == [
        semconv.DECISION_PULL, semconv.DECISION_REISSUED]
    assert [s.attributes[semconv.TOKENS_TO_PULL] for s in decisions] == [160, 0]
    assert captured.spans(semconv.SPAN_KV_TRANSFER) == []  # the turn has not ended
    p.scheduler.finish_requests({"p-t2"}, RequestStatus.FINISHED_ABORTED)
    span = the_span(captured, semconv.SPAN_KV_TRANSFER)
    assert span.attributes[semconv.TRANSFER_STATUS] == semconv.TRANSFER_FAILED
    assert span.attributes[semconv.REQUEST_OUTCOME] == "aborted"


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_after_the_read(captured: Captured, engines: Any,
                                   prefix_caching: bool) -> None:
    """Preempted after its read: prefix caching covers the span again, without it the load is
    asked for again and nothing serves it (the blog's P runs --no-enable-prefix-caching)."""
    p = engines("kv_producer", prefix_caching=prefix_caching, max_batched_tokens=64)
    p.add("p-t2", 300, offer(160))  # 140 tokens left after the read: 3 chunks of 64
    p.step()
    p.step(finished_recving={"p-t2"})
    p.step()
    assert p.last.num_scheduled_tokens == {"p-t2": 64}
    p.preempt("p-t2")
    if prefix_caching:
        outputs = p.run("p-t2")
        assert [o.finish_reason is not None for o in outputs] == [True]
        decisions = [s.attributes for s in captured.spans(semconv.SPAN_REUSE_DECISION)]
        assert [d[semconv.DECISION] for d in decisions] == [
            semconv.DECISION_PULL, semconv.DECISION_LOCAL_COVERS]
        assert decisions[1][semconv.LOCAL_HIT_TOKENS] == 224  # 160 read + 64 computed, cached
    else:
        reissued(p)
        decisions = [s.attributes for s in captured.spans(semconv.SPAN_REUSE_DECISION)]
        assert [d[semconv.DECISION] for d in decisions] == [
            semconv.DECISION_PULL, semconv.DECISION_REISSUED]


@pytest.mark.parametrize(("expired", "failed_read", "reason"), [
    (1, False, semconv.RELEASE_EXPIRED),
    (0, False, semconv.RELEASE_NOTIFIED),
    # The counter also counts a read the worker declined as expired (claim 4 in
    # test_real_worker_claims shows it on the real worker): with a failed receive in the same
    # step the count says nothing of the send, and the deadline (480 s away) decides.
    (1, True, semconv.RELEASE_NOTIFIED),
])
def test_the_release_cause_comes_from_the_workers_stats(
    captured: Captured, engines: Any, expired: int, failed_read: bool, reason: str
) -> None:
    """The worker's TTL reaper counts each release in ``num_kv_expired_reqs``
    (base_worker.py ``_reap_expired_send_leases``), carried by the same KVConnectorOutput as
    ``finished_sending``: the retention's release reason is that observation, not a guess from
    the deadline (a reaper release before our perf_counter reaches it still reads expired)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    d = engines("kv_consumer", engine_id="decode-engine")
    d.add("d-t1", 100, p_params(100), max_tokens=4)
    d.step()
    d.step(finished_recving={"d-t1"})
    d.run("d-t1")
    stats = NixlKVConnectorStats()
    stats.data["num_kv_expired_reqs"] = [1] * expired
    out = d.scheduler.schedule()
    d.scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=[], req_id_to_index={}, sampled_token_ids=[],
        kv_connector_output=KVConnectorOutput(
            finished_sending={"d-t1"}, kv_connector_stats=stats,
            failed_recving={"d-other"} if failed_read else set())))
    span = the_span(captured, semconv.SPAN_KV_RETENTION)
    # 480 s before the deadline: the old guess said "notified" for both.
    assert span.attributes[semconv.RETENTION_RELEASE_REASON] == reason
