"""Claims about vLLM 0.33.0's scheduler side, checked on the real classes (CPU, no model).

Each test drives the real ``Scheduler`` / ``AsyncScheduler`` with the real ``NixlConnector``
(built by :class:`tests.vllm_contract.test_scheduler_e2e.Engine`) through ``schedule()`` /
``update_from_output()`` with hand-made ``ModelRunnerOutput``; its docstring states the claim,
the verdict (CONFIRMED / REFUTED) and the vLLM code that causes it. Under the AsyncScheduler the
steps interleave as ``EngineCore.step_with_batch_queue`` does (v1/engine/core.py): step k+1 is
scheduled before the output of step k is applied.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from tests.vllm_contract import test_scheduler_e2e as e2e
from tests.vllm_contract.conftest import BLOCK_SIZE

# The module-scoped tiny-Llama fixtures of the end-to-end tests, registered here too.
model_dir = e2e.model_dir
model_config = e2e.model_config

TOKEN = e2e.TOKEN
EOS = 2
STOP_TOKEN = 3
PROMPT = 100
OUTPUT = 4  # every decode turn below ends on its 4th sampled token
Calls = list[tuple[tuple[Any, ...], Any]]


def engine(model_config: Any, kv_role: str, *, async_sched: bool = False,
           **connector: Any) -> e2e.Engine:
    """An :class:`e2e.Engine`; with ``async_sched`` its scheduler is the real AsyncScheduler
    under ``async_scheduling=True`` (what config/vllm.py resolves off CPU; the CPU platform
    hook forces False), so ``max_concurrent_batches`` is 2 as in production."""
    if not async_sched:
        return e2e.Engine(model_config, kv_role, **connector)
    import vllm.v1.core.sched.scheduler as sched_module
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    def make(config: Any, *args: Any, **kwargs: Any) -> AsyncScheduler:
        config.scheduler_config.async_scheduling = True
        return AsyncScheduler(config, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sched_module, "Scheduler", make)
        e = e2e.Engine(model_config, kv_role, **connector)
    assert type(e.scheduler) is AsyncScheduler and e.scheduler.defer_block_free is (
        kv_role == "kv_consumer")
    return e


def add(e: e2e.Engine, req_id: str, prompt_len: int, params: dict[str, Any] | None,
        sampling: SamplingParams) -> Request:
    req = Request(req_id, list(range(1, prompt_len + 1)), sampling, None,
                  block_hasher=e._hasher)
    req.kv_transfer_params = params
    e.scheduler.add_request(req)
    return req


def spy(obj: Any, name: str, after: Callable[..., Any] | None = None) -> Calls:
    """Record (args, result) of every call of ``obj.name`` (an instance attribute shadows it)."""
    calls: Calls = []
    original = getattr(obj, name)

    def wrapper(*args: Any) -> Any:
        result = original(*args)
        calls.append((args, after(*args) if after else result))
        return result

    setattr(obj, name, wrapper)
    return calls


class Runner:
    """The model runner's answers: a token per request whose prompt is computed (chosen by
    ``token_at(n)`` for its n-th sample); every awaited read reported finished at once, unless
    ``kv`` overrides the step's KVConnectorOutput."""

    def __init__(self, e: e2e.Engine, token_at: Callable[[int], int] = lambda n: TOKEN) -> None:
        self.e = e
        self.token_at = token_at
        self.samples: dict[str, int] = {}

    def answer(self, out: Any, kv: KVConnectorOutput | None = None) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            req = self.e.scheduler.requests[req_id]
            if req.num_computed_tokens >= req.num_tokens:  # at schedule time, as the GPU sees it
                self.samples[req_id] = self.samples.get(req_id, 0) + 1
                sampled.append([self.token_at(self.samples[req_id])])
            else:
                sampled.append([])
        if kv is None:
            awaited = {r for r, m in out.kv_connector_metadata.reqs_to_recv.items()
                       if m.awaiting_kvs}
            kv = KVConnectorOutput(finished_recving=awaited or None)
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv)


def drive(e: e2e.Engine, runner: Runner, *, async_sched: bool, steps: int = 16,
          until: Callable[[list[Any]], bool] = lambda outputs: False) -> list[Any]:
    """Step like EngineCore: sync = schedule/update; async = a batch queue of 2, so step k+1 is
    scheduled before step k's output is applied (step_with_batch_queue). Stops when ``until``
    holds for the outputs so far (the frontend's view) or the scheduler is empty."""
    queue: deque[tuple[Any, ModelRunnerOutput]] = deque()
    outputs: list[Any] = []
    for _ in range(steps):
        if e.scheduler.has_requests():
            out = e.scheduler.schedule()
            queue.appendleft((out, runner.answer(out)))
            if async_sched and len(queue) < 2:
                continue
        if not queue:
            break
        out, answer = queue.pop()
        result = e.scheduler.update_from_output(out, answer)
        outputs += [o for batch in result.values() for o in batch.outputs]
        if until(outputs):
            break
    return outputs


def sampled(outputs: Iterable[Any], req_id: str) -> int:
    return sum(len(o.new_token_ids) for o in outputs if o.request_id == req_id)


# --- claim 1: what D's request_finished offers -----------------------------------------------
FINISHES: dict[str, tuple[Callable[[], SamplingParams], Callable[[int], int]]] = {
    # eos_token_id is set by the input processor from the generation config (same call here).
    "eos": (lambda: _with_eos(SamplingParams(max_tokens=16)),
            lambda n: EOS if n == OUTPUT else TOKEN),
    "stop_token_id": (lambda: SamplingParams(max_tokens=16, stop_token_ids=[STOP_TOKEN]),
                      lambda n: STOP_TOKEN if n == OUTPUT else TOKEN),
    "length": (lambda: SamplingParams(max_tokens=OUTPUT), lambda n: TOKEN),
    # Stop strings are matched by the frontend's detokenizer (v1/engine/output_processor.py),
    # which then aborts the request in the engine: EngineCore.abort_requests → FINISHED_ABORTED.
    "stop_string": (lambda: SamplingParams(max_tokens=16), lambda n: TOKEN),
}


def _with_eos(params: SamplingParams) -> SamplingParams:
    params.update_from_generation_config({}, EOS)
    return params


# (scheduler, finish reason) → remote_num_tokens - (prompt + output); None: no params at all.
MEASURED = {
    ("sync", "eos"): -1, ("sync", "stop_token_id"): -1, ("sync", "length"): -1,
    ("sync", "stop_string"): None,
    ("async", "eos"): 0, ("async", "stop_token_id"): 0, ("async", "length"): -1,
    ("async", "stop_string"): None,
}


@pytest.mark.parametrize("finish", list(FINISHES))
@pytest.mark.parametrize("sched", ["sync", "async"])
def test_decode_remote_num_tokens_by_scheduler_and_finish(
    model_config: Any, sched: str, finish: str
) -> None:
    """Claim 1: D's ``request_finished`` returns remote_num_tokens == request.num_computed_tokens,
    which is prompt+output or prompt+output-1 for EOS, stop-string and length finishes.

    CONFIRMED for the first half (pull_scheduler.py:NixlPullConnectorScheduler.request_finished,
    ``remote_num_tokens = request.num_computed_tokens``) and for EOS / stop token / length, with
    the offset depending on the scheduler: sync is always prompt+output-1
    (scheduler.py:_update_request_with_output: the last sampled token is not computed); the
    AsyncScheduler has already scheduled the next decode step when the stop token is applied
    (core.py:step_with_batch_queue, async_scheduler.py:_update_after_schedule), so EOS / stop
    token give prompt+output, while a length finish gives prompt+output-1 because schedule()
    skips the step past max_tokens (scheduler.py:schedule, "Avoid scheduling an extra step").
    REFUTED for stop strings: the frontend aborts the request (output_processor.py
    process_outputs → EngineCore.abort_requests → FINISHED_ABORTED), request_finished returns
    (False, None) for any status but LENGTH_CAPPED / STOPPED: no kv_transfer_params, no
    retention, nothing for the next turn to read.
    """
    async_sched = sched == "async"
    d = engine(model_config, "kv_consumer", engine_id="decode-engine", async_sched=async_sched)
    make_params, token_at = FINISHES[finish]
    finished = spy(d.nixl, "request_finished",
                   after=lambda req, _: (req.num_computed_tokens, req.status))
    results = spy(d.nixl, "request_finished")
    add(d, "d-t1", PROMPT, e2e.p_params(PROMPT), make_params())
    free0 = d.free_blocks()
    if finish == "stop_string":  # the frontend sees the 4th token and aborts
        outputs = drive(d, Runner(d, token_at), async_sched=async_sched,
                        until=lambda outs: sampled(outs, "d-t1") >= OUTPUT)
        assert sampled(outputs, "d-t1") == OUTPUT
        d.scheduler.finish_requests({"d-t1"}, RequestStatus.FINISHED_ABORTED)
        [(_, (computed, status))] = finished
        assert status == RequestStatus.FINISHED_ABORTED
        assert results[0][1] == (False, None)
        # Nothing stays pinned for a readback (async: freed once the in-flight step is done).
        deferred = sum(len(blocks) for _, blocks in d.scheduler.deferred_frees)
        assert d.free_blocks() + deferred == free0
        assert MEASURED[(sched, finish)] is None
        return
    outputs = drive(d, Runner(d, token_at), async_sched=async_sched)
    [final] = [o for o in outputs if o.finish_reason is not None]
    assert sampled(outputs, "d-t1") == OUTPUT
    [(_, (computed, status))] = finished
    expected_status = (RequestStatus.FINISHED_LENGTH_CAPPED if finish == "length"
                       else RequestStatus.FINISHED_STOPPED)
    assert status == expected_status
    params = final.kv_transfer_params
    assert results[0][1] == (True, params)
    assert params["remote_num_tokens"] == computed  # request.num_computed_tokens at finish
    assert params["remote_num_tokens"] - (PROMPT + OUTPUT) == MEASURED[(sched, finish)]
    # kvscope's one rule (kvscope.reuse.params) says the same.
    from kvscope.reuse import params as rules

    mode = rules.SCHEDULING_ASYNC if async_sched else rules.SCHEDULING_SYNC
    status_name = (rules.STATUS_LENGTH_CAPPED if finish == "length" else rules.STATUS_STOPPED)
    assert rules.remote_num_tokens(PROMPT + OUTPUT, mode, status_name) == computed
    assert params["do_remote_decode"] is True
    # The offered blocks cover exactly remote_num_tokens.
    [blocks] = params["remote_block_ids"]
    assert len(blocks) == -(-params["remote_num_tokens"] // BLOCK_SIZE)


def test_async_scheduling_is_the_default_off_cpu(monkeypatch: pytest.MonkeyPatch,
                                                 model_config: Any) -> None:
    """Claim 1 (default): async scheduling is vLLM 0.33.0's default. CONFIRMED off CPU:
    SchedulerConfig.async_scheduling defaults to None (config/scheduler.py) and
    VllmConfig.__post_init__ (config/vllm.py, ``elif ... async_scheduling is None``) turns it
    True unless pooling / an executor without support / ROCm DeepEP DBO / a V1-runner
    incompatibility (non-EAGLE spec decode, PP); get_scheduler_cls then picks AsyncScheduler.
    On CPU the platform hook (platforms/cpu.py:CpuPlatform.check_and_update_config) forces it
    False afterwards, so the contract tier's Engine runs the sync Scheduler.
    """
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.platforms import current_platform
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from tests.vllm_contract.conftest import vllm_config

    def build() -> Any:
        scheduler = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8,
                                    max_model_len=e2e.MAX_MODEL_LEN, is_encoder_decoder=False)
        assert scheduler.async_scheduling is None
        return vllm_config("kv_consumer", model=model_config, scheduler=scheduler,
                           cache=CacheConfig(block_size=BLOCK_SIZE))

    cpu = build()
    assert cpu.scheduler_config.async_scheduling is False
    assert cpu.scheduler_config.get_scheduler_cls() is Scheduler
    monkeypatch.setattr(type(current_platform), "check_and_update_config",
                        classmethod(lambda cls, config: None))
    default = build()
    assert default.scheduler_config.async_scheduling is True
    assert default.scheduler_config.get_scheduler_cls() is AsyncScheduler
    assert default.max_concurrent_batches == 2


# --- claim 2: prompt_logprobs at P -----------------------------------------------------------
def test_prompt_logprobs_at_prefill_overrides_a_valid_offer_to_notify_only(
    model_config: Any,
) -> None:
    """Claim 2: with ``prompt_logprobs`` (skip_reading_prefix_cache) P's connector answers
    (count, True) for a valid D→P offer above threshold, but update_state_after_alloc gets
    num_external_tokens == 0. CONFIRMED: scheduler.py:Scheduler.schedule replaces the answer
    (``if request.skip_reading_prefix_cache: ext_tokens, load_kv_async = 0, False``) before
    allocating; pull_scheduler.py:update_state_after_alloc then registers a notify-only recv
    ``_reqs_need_recv[id] = (request, (), (10,), False)`` (no local blocks, awaiting_kvs False)
    and marks ``_remote_blocks_processed``; the whole prompt is computed in the same step and
    the worker only notifies D (which releases its pinned blocks).
    """
    p = engine(model_config, "kv_producer")
    asked = spy(p.nixl, "get_num_new_matched_tokens")
    registered = spy(p.nixl, "update_state_after_alloc",
                     after=lambda req, blocks, n: (n, p.nixl._reqs_need_recv.get(req.request_id)))
    req = add(p, "p-t2", 170, e2e.offer(160), SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert req.skip_reading_prefix_cache
    outputs = drive(p, Runner(p), async_sched=False, steps=1)
    assert [a[1] for a in asked] == [(160, True)]
    [(_, (num_external, entry))] = registered
    assert num_external == 0
    assert entry is not None
    # No local blocks to read into, not awaited; the 10 freshly allocated prompt blocks already
    # carry their hashes (cached at allocation), so they count as "locally computed".
    assert entry[0] is req and entry[1:] == ((), (10,), False)
    assert req.kv_transfer_params["_remote_blocks_processed"] is True
    [final] = outputs
    assert final.finish_reason is not None


def test_prompt_logprobs_notify_only_recv_in_the_worker_metadata(model_config: Any) -> None:
    """Claim 2, the metadata the worker gets: CONFIRMED. base_scheduler.py:build_connector_meta
    turns the entry into reqs_to_recv[id] with empty local_block_ids and awaiting_kvs False;
    the request runs at once (170 tokens scheduled, never WAITING_FOR_REMOTE_KVS)."""
    p = engine(model_config, "kv_producer")
    add(p, "p-t2", 170, e2e.offer(160), SamplingParams(max_tokens=1, prompt_logprobs=1))
    out = p.scheduler.schedule()
    assert out.num_scheduled_tokens == {"p-t2": 170}
    meta = out.kv_connector_metadata.reqs_to_recv["p-t2"]
    assert meta.local_block_ids == () and meta.awaiting_kvs is False
    assert meta.remote.num_tokens == 160
    assert p.status("p-t2") == RequestStatus.RUNNING


# --- claim 3: kv_load_failure_policy after a failed read -------------------------------------
def read_then_fail(p: e2e.Engine, how: str, bad_block: int = 0) -> tuple[Request, list[Any]]:
    """P pulls a 160-token offer; the worker then reports the read failed in one
    KVConnectorOutput: ``failed_recving`` (the id in finished_recving too), ``invalid_block_ids``
    (the ``bad_block``-th local block, plus finished_recving: a report NIXL never sends alone),
    ``worker``: what the real NIXL worker sends for a failed non-HMA read, both at once with
    every local block invalid (base_worker.py:get_transfer_results,
    kv_connector_model_runner_mixin.py), or ``worker_bad_block``: failed_recving with only the
    ``bad_block``-th block invalid (NIXL's shape, the bad block anywhere)."""
    req = add(p, "p-t2", 170, e2e.offer(160), SamplingParams(max_tokens=1))
    out = p.scheduler.schedule()
    [local] = out.kv_connector_metadata.reqs_to_recv["p-t2"].local_block_ids
    assert len(local) == 10 and req.num_computed_tokens == 160
    p.scheduler.update_from_output(out, Runner(p).answer(out, KVConnectorOutput()))
    out = p.scheduler.schedule()
    assert out.num_scheduled_tokens == {}
    kv = KVConnectorOutput(finished_recving={"p-t2"})
    if how in ("failed_recving", "worker", "worker_bad_block"):
        kv.failed_recving = {"p-t2"}
    if how in ("invalid_block_ids", "worker_bad_block"):
        kv.invalid_block_ids = {local[bad_block]}
    if how == "worker":
        kv.invalid_block_ids = set(local)
    result = p.scheduler.update_from_output(out, Runner(p).answer(out, kv))
    return req, [o for batch in result.values() for o in batch.outputs]


def assert_parked(p: e2e.Engine, steps: int) -> None:
    """For ``steps`` scheduler steps "p-t2" is scheduled nothing, the worker is sent no read,
    and it stays in WAITING_FOR_REMOTE_KVS."""
    for _ in range(steps):
        out = p.scheduler.schedule()
        assert out.num_scheduled_tokens == {}
        assert out.kv_connector_metadata.reqs_to_recv == {}
        p.scheduler.update_from_output(out, Runner(p).answer(out))
        assert p.status("p-t2") == RequestStatus.WAITING_FOR_REMOTE_KVS


@pytest.mark.parametrize("how", ["failed_recving", "invalid_block_ids", "worker"])
def test_recompute_policy_resets_to_zero_and_stalls_for_good(model_config: Any, how: str) -> None:
    """Claim 3 (recompute): reset to 0 computed tokens, the connector is asked again, no new
    read is registered, and the request stays in WAITING_FOR_REMOTE_KVS indefinitely.
    CONFIRMED (for failed_recving, for invalid_block_ids naming the first block, and for both
    together, as the NIXL worker reports a failed read):
    scheduler.py:_handle_failed_recving sets num_computed_tokens = 0 (resp.
    _update_requests_with_invalid_blocks truncates to the first bad block = 0);
    _update_waiting_for_remote_kv frees the blocks and returns it to WAITING; schedule() asks
    get_num_new_matched_tokens again (num_computed_tokens == 0), which answers (160, True) from
    the unchanged offer; pull_scheduler.py:update_state_after_alloc skips the read because
    ``_remote_blocks_processed`` is set; nothing will ever report it finished.
    """
    p = engine(model_config, "kv_producer", policy="recompute")
    asked = spy(p.nixl, "get_num_new_matched_tokens")
    registered = spy(p.nixl, "update_state_after_alloc",
                     after=lambda req, blocks, n: (n, p.nixl._reqs_need_recv.get(req.request_id)))
    free0 = p.free_blocks()
    req, outputs = read_then_fail(p, how)
    assert outputs == []  # no error, no output
    assert req.num_computed_tokens == 0
    assert_parked(p, steps=20)
    assert [a[1] for a in asked] == [(160, True), (160, True)]  # asked once more, then parked
    assert [r[1][0] for r in registered] == [160, 160]
    assert registered[0][1][1] is not None and registered[1][1][1] is None  # no second read
    assert req.kv_transfer_params["_remote_blocks_processed"] is True
    assert req.num_computed_tokens == 160  # set at the second schedule, never loaded
    assert p.free_blocks() == free0 - 10  # held for a read nobody issues


@pytest.mark.parametrize("bad_block", [0, 3, 9])
def test_recompute_policy_stalls_after_every_failed_nixl_read(model_config: Any,
                                                              bad_block: int) -> None:
    """Claim 3 for NIXL, whichever block was bad: CONFIRMED that recompute stalls. The NIXL
    worker reports every failed read in ``failed_recving`` and fills ``invalid_block_ids`` only
    in that same branch (base_worker.py:get_transfer_results); update_from_output runs
    _handle_failed_recving (num_computed_tokens = 0) *before* _handle_invalid_blocks, which then
    finds no computed block of the request to truncate. The unchanged offer is accepted again,
    no read is registered, and the request waits in WAITING_FOR_REMOTE_KVS for good."""
    p = engine(model_config, "kv_producer", policy="recompute")
    req, outputs = read_then_fail(p, "worker_bad_block", bad_block=bad_block)
    assert outputs == [] and req.num_computed_tokens == 0
    assert_parked(p, steps=10)


def test_a_lone_invalid_block_report_nixl_never_sends_would_recompute_locally(
        model_config: Any) -> None:
    """Why "recompute always stalls" once read as refuted: a report of ``invalid_block_ids``
    naming a later block (the 4th of 10) *without* ``failed_recving`` makes
    scheduler.py:_update_requests_with_invalid_blocks truncate num_computed_tokens to 3 * 16 =
    48, and the remaining 122 prompt tokens are recomputed locally. NIXL never sends that report
    (see test_recompute_policy_stalls_after_every_failed_nixl_read): it is another connector's
    shape, kept here so the scheduler's branch stays pinned down.
    """
    p = engine(model_config, "kv_producer", policy="recompute")
    asked = spy(p.nixl, "get_num_new_matched_tokens")
    req, outputs = read_then_fail(p, "invalid_block_ids", bad_block=3)
    assert outputs == [] and req.num_computed_tokens == 48
    outputs = drive(p, Runner(p), async_sched=False, steps=2)
    [final] = outputs
    assert final.finish_reason == FinishReason.LENGTH
    assert len(asked) == 1


@pytest.mark.parametrize("how", ["failed_recving", "invalid_block_ids", "worker"])
def test_fail_policy_ends_the_request_in_error(model_config: Any, how: str) -> None:
    """Claim 3 (fail): CONFIRMED: the request ends FINISHED_ERROR in the same update.
    scheduler.py:_handle_failed_recving / _handle_invalid_blocks return the ids, update_from_output
    finishes them with finish_requests(..., FINISHED_ERROR) and emits finish_reason ERROR."""
    p = engine(model_config, "kv_producer", policy="fail")
    free0 = p.free_blocks()
    req, outputs = read_then_fail(p, how)
    [final] = outputs
    assert final.finish_reason == FinishReason.ERROR
    assert req.status == RequestStatus.FINISHED_ERROR
    assert p.status("p-t2") is None and p.free_blocks() == free0


# --- claim 4: expiry is the worker's business ------------------------------------------------
def test_scheduler_never_checks_the_offer_expiry(model_config: Any) -> None:
    """Claim 4: the scheduler side never looks at ``remote_blocks_expiry_time``; an expired offer
    is still answered (count, True) and a read is registered. CONFIRMED:
    pull_scheduler.py:get_num_new_matched_tokens / update_state_after_alloc and scheduler.py
    never read it (metadata.py:add_new_req_to_recv only copies it into RemoteMeta); only the
    worker declines it, pull_worker.py:_read_blocks_for_req → _is_turn2_read_expired (within
    start_load_kv), which reports the request in failed_recving.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
        NixlBaseConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker,
    )
    from vllm.v1.core.sched import scheduler

    for fn in (NixlPullConnectorScheduler.get_num_new_matched_tokens,
               NixlPullConnectorScheduler.update_state_after_alloc, NixlBaseConnectorScheduler,
               scheduler):
        assert "blocks_expiry_time" not in inspect.getsource(fn)
    assert "blocks_expiry_time" in inspect.getsource(NixlPullConnectorWorker._is_turn2_read_expired)

    p = engine(model_config, "kv_producer")
    asked = spy(p.nixl, "get_num_new_matched_tokens")
    expired = time.perf_counter() - 3600.0
    add(p, "p-t2", 170, e2e.offer(160, remote_blocks_expiry_time=expired),
        SamplingParams(max_tokens=1))
    out = p.scheduler.schedule()
    assert [a[1] for a in asked] == [(160, True)]
    assert p.status("p-t2") == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = out.kv_connector_metadata.reqs_to_recv["p-t2"]
    assert [len(g) for g in meta.local_block_ids] == [10] and meta.awaiting_kvs
    assert meta.remote.blocks_expiry_time == expired
