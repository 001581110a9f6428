"""What vLLM 0.33.0's real scheduler does when decode's KV blocks run out while it retains blocks.

The claim :mod:`kvscope.emulator.capacity` models (its module docstring cites the code): blocks
a bidirectional decode engine retains for a later turn (``request_finished`` → delay free) are
in neither the waiting nor the running list, so ``Scheduler.schedule`` never frees them to make
room. A *waiting* request that cannot allocate stays queued (the waiting loop ``break``s, FCFS);
a *running* request that needs a block preempts the last running request (``self.running[-1]``,
``NixlConnector.has_pending_block_frees`` being the base class's False); the retained blocks
come back only through the connector (a READ notification, or the worker's TTL reaper which
reports them the same way). Checked here on the real ``Scheduler`` and ``NixlConnector``.
"""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams
from vllm.v1.request import Request, RequestStatus

from kvscope.collector.vllm.instrumentor import NixlConnectorInstrumentor
from tests.vllm_contract.conftest import BLOCK_SIZE, Captured
from tests.vllm_contract.test_scheduler_e2e import Engine, model_config, model_dir, p_params

__all__ = ["model_config", "model_dir"]  # the module-scoped tiny-Llama fixtures, registered here

# 16 blocks: one is vLLM's null block, so 15 hold KV.
NUM_BLOCKS = 16


def _add_other_chat(d: Engine, req_id: str, prompt_len: int, params: Any,
                    first_token: int = 300) -> None:
    """A request whose tokens share no prefix with turn 1's (its blocks cannot be hit)."""
    tokens = list(range(first_token, first_token + prompt_len))
    req = Request(req_id, tokens, SamplingParams(max_tokens=10), None, block_hasher=d._hasher)
    req.kv_transfer_params = params
    d.scheduler.add_request(req)


def _decode(model_config: Any, **connector: Any) -> Engine:
    return Engine(model_config, "kv_consumer", engine_id="decode-engine",
                  num_blocks=NUM_BLOCKS, **connector)


def _retain_first_turn(d: Engine) -> int:
    """Turn 1 (100-token prompt, 4 tokens out) finishes; its 7 blocks stay retained."""
    d.add("d-t1", 100, p_params(100), max_tokens=4)
    d.step()
    d.step(finished_recving={"d-t1"})
    d.run("d-t1")
    assert d.scheduler.requests["d-t1"].is_finished()  # finished, kept only for its blocks
    assert d.scheduler.requests["d-t1"] not in d.scheduler.running
    assert NixlConnectorInstrumentor().open_retentions(d.nixl) == ["d-t1"]
    return d.free_blocks()


def test_a_waiting_request_queues_behind_retained_blocks(
    captured: Captured, model_config: Any
) -> None:
    d = _decode(model_config)
    free0 = d.free_blocks()
    assert free0 == NUM_BLOCKS - 1
    free = _retain_first_turn(d)
    assert free == free0 - 7
    # Turn 2 of another chat needs ceil(150 / 16) = 10 blocks; 8 are free.
    _add_other_chat(d, "d-t2", 150, p_params(150))
    assert -(-150 // BLOCK_SIZE) > free
    for _ in range(5):
        d.step()
        assert d.status("d-t2") == RequestStatus.WAITING  # queued: no read issued, no blocks
        assert d.recv_targets() == {}
        assert d.scheduler.running == []
        assert d.free_blocks() == free  # the retained blocks were not taken back
        assert NixlConnectorInstrumentor().open_retentions(d.nixl) == ["d-t1"]
    # P's READ notification (or the worker's TTL reaper, reported the same way) frees them.
    d.step(finished_sending={"d-t1"})
    assert d.free_blocks() == free0
    assert NixlConnectorInstrumentor().open_retentions(d.nixl) == []
    d.step()
    assert d.status("d-t2") == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert list(d.recv_targets()) == ["d-t2"]


def test_a_running_request_that_needs_a_block_preempts_a_running_one_not_the_retained(
    captured: Captured, model_config: Any
) -> None:
    d = _decode(model_config)
    free = _retain_first_turn(d)
    assert free == 8
    # Two local requests of 64 tokens take the 8 free blocks; the first decoded token of each
    # needs a 5th block.
    _add_other_chat(d, "a", 64, None)
    _add_other_chat(d, "b", 64, None, first_token=400)
    d.step()
    assert d.free_blocks() == 0
    assert [r.request_id for r in d.scheduler.running] == ["a", "b"]
    d.step()
    # b (the last running request) was preempted to give a its block; the retention stays.
    assert d.status("b") == RequestStatus.PREEMPTED
    assert [r.request_id for r in d.scheduler.running] == ["a"]
    assert [r.request_id for r in d.scheduler.waiting] == ["b"]
    assert d.scheduler.requests["b"].num_computed_tokens == 0  # recomputed from scratch
    assert NixlConnectorInstrumentor().open_retentions(d.nixl) == ["d-t1"]


def test_without_retention_the_same_engine_admits_the_request(
    captured: Captured, model_config: Any
) -> None:
    d = _decode(model_config, bidir=False)
    free0 = d.free_blocks()
    d.add("d-t1", 100, p_params(100), max_tokens=4)
    d.step()
    d.step(finished_recving={"d-t1"})
    d.run("d-t1")
    assert d.free_blocks() == free0  # nothing retained
    _add_other_chat(d, "d-t2", 150, p_params(150))
    d.step()
    assert d.status("d-t2") == RequestStatus.WAITING_FOR_REMOTE_KVS
