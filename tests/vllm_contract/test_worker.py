"""The worker side on CPU: real NIXL READs over UCX between two engines in one process.

A prefill engine and a decode engine each get vLLM 0.33.0's real ``NixlConnector`` in both roles
(the scheduler role runs the side-channel handshake listener; the worker role registers small
CPU KV cache tensors with NIXL's UCX backend) after vLLM's distributed groups are initialised for
world size 1 on gloo. The turns follow the production order: P's turn-1 lease, D's P→D READ, D
pins the finished turn, P's turn-2 D→P READ releases it by notification. The instrumented
worker's ``kvscope.kv_transfer`` spans are asserted field by field, including an offer that is
too close to its deadline (``declined_expired``).

CPU specifics, found here: vLLM's CPU attention backend needs block sizes that are multiples of
32 and head sizes ≥ 32; the KV cache layout must be set (``HND``) because the engine core that
normally resolves it is absent; the facade's ``set_xfer_handshake_metadata`` is the base class's
no-op, the engine core calls ``set_xfer_handshake_metadata_pp_aware``; the worker reads only on
the ``start_load_kv`` after the background handshake finished, so it is stepped as the model
runner steps it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from kvscope import semconv
from tests.vllm_contract.conftest import LAYERS, Captured, vllm_config

BLOCK = 32
KV_HEADS = 2
HEAD_SIZE = 32
NUM_BLOCKS = 32
# K and V × heads × block tokens × head size × 2 bytes (fp16) × layers.
BLOCK_BYTES = 2 * KV_HEADS * BLOCK * HEAD_SIZE * 2 * len(LAYERS)

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_cache_config() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float16)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


@dataclass
class Engine:
    """One engine's two real connector roles and its CPU KV cache."""

    scheduler: Any
    worker: Any
    caches: dict[str, torch.Tensor]

    @property
    def nixl(self) -> Any:
        return self.scheduler.connector_scheduler

    def step_with(self, poll: Callable[[Any], T]) -> T:
        """One model-runner step: bind this step's metadata, start loads, ``poll(worker)``."""
        meta = self.scheduler.build_connector_meta(None)
        self.worker.bind_connector_metadata(meta)
        self.worker.connector_worker.start_load_kv(meta)
        polled = poll(self.worker)
        self.worker.clear_connector_metadata()
        return polled

    def step(self) -> tuple[set[str], set[str]]:
        """One model-runner step polling completions: (finished sending, finished recving)."""
        return self.step_with(lambda worker: worker.get_finished(set()))

    def fill(self, block_ids: list[int], value: float) -> None:
        for cache in self.caches.values():
            cache[block_ids] = value

    def values(self, block_ids: list[int]) -> list[float]:
        """One number per block (every element of a filled block holds the same value)."""
        cache = self.caches[LAYERS[-1]]
        return [float(cache[b].float().mean()) for b in block_ids]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """A prefill and a decode engine, each with its side channel on 127.0.0.1."""
    import transformers
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )

    path: Path = tmp_path_factory.mktemp("tiny-llama-worker")
    transformers.LlamaConfig(
        hidden_size=4 * HEAD_SIZE, intermediate_size=256, num_hidden_layers=len(LAYERS),
        num_attention_heads=4, num_key_value_heads=KV_HEADS, vocab_size=512,
        max_position_embeddings=1024,
    ).save_pretrained(path)
    model = ModelConfig(model=str(path), dtype="float16", skip_tokenizer_init=True,
                        max_model_len=1024)

    def config(kv_role: str, engine_id: str) -> Any:
        cache = CacheConfig(block_size=BLOCK)
        cache.num_gpu_blocks = NUM_BLOCKS
        cache.kv_cache_layout = "HND"  # the engine core would resolve it; NIXL needs HND
        scheduler = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8,
                                    max_model_len=1024, is_encoder_decoder=False)
        return vllm_config(kv_role, model=model, scheduler=scheduler, cache=cache,
                           engine_id=engine_id)

    saved = {k: os.environ.get(k) for k in ("VLLM_NIXL_SIDE_CHANNEL_HOST",
                                            "VLLM_NIXL_SIDE_CHANNEL_PORT")}
    built: list[Any] = []

    def engine(kv_role: str, engine_id: str) -> Engine:
        cfg = config(kv_role, engine_id)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        with set_current_vllm_config(cfg):
            if not model_parallel_is_initialized():
                init_distributed_environment(
                    world_size=1, rank=0, local_rank=0, backend="gloo",
                    distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
                ensure_model_parallel_initialized(1, 1)
            scheduler = NixlConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
            worker = NixlConnector(cfg, KVConnectorRole.WORKER, kv_cache_config())
        built.extend((worker, scheduler))
        caches = {layer: torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_SIZE,
                                     dtype=torch.float16) for layer in LAYERS}
        worker.register_kv_caches(caches)
        scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): worker.get_handshake_metadata()})
        return Engine(scheduler, worker, caches)

    try:
        yield engine("kv_producer", "prefill-engine"), engine("kv_consumer", "decode-engine")
    finally:
        for connector in built:
            connector.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def until(condition: Callable[[], bool], *steppers: Engine, timeout_s: float = 15.0) -> None:
    """Step both engines until ``condition`` holds (UCX progresses on the workers' polls)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "NIXL transfer did not complete"
        for engine in steppers:
            engine.step()
        time.sleep(0.01)


def request(req_id: str, prompt_len: int, params: dict[str, Any]) -> Request:
    req = Request(req_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), None)
    req.kv_transfer_params = params
    return req


def blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(block_id=i) for i in ids],))


def finish(engine: Engine, req: Request, block_ids: list[int], computed: int) -> dict[str, Any]:
    req.status = RequestStatus.FINISHED_STOPPED
    req.num_computed_tokens = computed
    delay, params = engine.nixl.request_finished(req, (block_ids,))
    assert delay and params is not None
    return dict(params)


def schedule(engine: Engine, req: Request, local_blocks: list[int]) -> int:
    """What vLLM's scheduler does when it admits a waiting request: ask, allocate, tell."""
    count, _ = engine.nixl.get_num_new_matched_tokens(req, 0)
    engine.nixl.update_state_after_alloc(req, blocks(local_blocks), count)
    return int(count)


def transfers(captured: Captured) -> dict[str, Any]:
    return {s.attributes[semconv.VLLM_REQUEST_ID]: s
            for s in captured.spans(semconv.SPAN_KV_TRANSFER)}


def read_until_released(reader: Engine, read_id: str, holder: Engine, held_id: str) -> None:
    """Step the reader, then the holder, until the READ is received and the holder released."""
    recving: set[str] = set()
    released: set[str] = set()

    def done() -> bool:
        recving.update(reader.step()[1])
        released.update(holder.step()[0])
        return read_id in recving and held_id in released

    until(done)


def assert_read_ok(span: Any, engine_id: str, role: str, direction: str, blocks_read: int,
                   remote_engine_id: str) -> None:
    """A completed READ's span: who read, which way, how many blocks and bytes, from whom."""
    a = span.attributes
    assert a[semconv.ENGINE_ID] == engine_id
    assert a[semconv.ENGINE_ROLE] == role
    assert a[semconv.TRANSFER_DIRECTION] == direction
    assert a[semconv.TRANSFER_STATUS] == semconv.TRANSFER_OK
    assert a[semconv.TRANSFER_BLOCKS] == blocks_read
    assert a[semconv.TRANSFER_BYTES] == blocks_read * BLOCK_BYTES
    assert a[semconv.REMOTE_ENGINE_ID] == remote_engine_id


def test_p_to_d_then_d_to_p_reads_over_ucx(
    captured: Captured, engines: tuple[Engine, Engine]
) -> None:
    p, d = engines
    # Turn 1 on P: 96 prompt tokens in P's blocks 1-3, held for D under a lease.
    p.fill([1, 2, 3], 1.0)
    p_req = request("p-t1", 96, {"do_remote_decode": True})  # the router's MISS params
    assert schedule(p, p_req, [1, 2, 3]) == 0
    p_params = finish(p, p_req, [1, 2, 3], 96)
    assert p_params["do_remote_prefill"] is True
    # D reads them into its blocks 4-6 (P→D).
    d_req = request("d-t1", 96, p_params)
    assert schedule(d, d_req, [4, 5, 6]) == 96
    read_until_released(d, "d-t1", p, "p-t1")
    assert d.values([4, 5, 6]) == [1.0, 1.0, 1.0]
    # D finishes the turn: 96 + 4 generated, 99 computed, blocks 4-7 pinned.
    d.fill([7], 2.0)
    offer = finish(d, d_req, [4, 5, 6, 7], 99)
    assert offer["remote_blocks_expiry_time"] is not None
    # Turn 2 on P: the router forwards D's params; P reads D's 4 blocks into its 8-11 (D→P).
    offer.update(do_remote_decode=True, do_remote_prefill=False)
    p_req = request("p-t2", 140, offer)
    assert schedule(p, p_req, [8, 9, 10, 11]) == 99
    read_until_released(p, "p-t2", d, "d-t1")
    assert p.values([8, 9, 10, 11]) == [1.0, 1.0, 1.0, 2.0]

    spans = transfers(captured)
    assert set(spans) == {"d-t1", "p-t2"}
    assert_read_ok(spans["p-t2"], "prefill-engine", semconv.ROLE_PREFILL,
                   semconv.DIRECTION_D_TO_P, 4, "decode-engine")
    assert_read_ok(spans["d-t1"], "decode-engine", semconv.ROLE_DECODE,
                   semconv.DIRECTION_P_TO_D, 3, "prefill-engine")
    for span in spans.values():
        assert 0 < span.end_time - span.start_time < 15e9
    # The scheduler side closes D's retention when the worker reports the handle released.
    d.nixl.update_connector_output(_output(finished_sending={"d-t1"}))
    [retention] = captured.spans(semconv.SPAN_KV_RETENTION)
    assert retention.attributes[semconv.RETENTION_RELEASE_REASON] == semconv.RELEASE_NOTIFIED
    assert retention.attributes[semconv.RETENTION_BLOCKS] == 4


def _output(**kwargs: Any) -> Any:
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(**kwargs)


def test_an_offer_inside_the_safety_margin_is_declined_expired(
    captured: Captured, engines: tuple[Engine, Engine]
) -> None:
    p, d = engines
    d.fill([12, 13, 14, 15], 3.0)
    d_req = request("d-t1b", 96, {"do_remote_prefill": False, "do_remote_decode": False})
    offer = finish(d, d_req, [12, 13, 14, 15], 99)
    d.step()  # D's worker learns the deadline
    # 2 s left: inside vLLM's 5 s safety margin, so P declines instead of reading.
    offer.update(do_remote_decode=True, do_remote_prefill=False,
                 remote_blocks_expiry_time=time.perf_counter() + 2.0)
    p.fill([16, 17, 18, 19], 0.0)
    assert schedule(p, request("p-t2b", 140, offer), [16, 17, 18, 19]) == 99
    failed: set[str] = set()

    def reported() -> bool:
        failed.update(p.step()[1])
        return "p-t2b" in failed

    until(reported)
    assert p.values([16, 17, 18, 19]) == [0.0] * 4  # nothing was read
    [span] = captured.spans(semconv.SPAN_KV_TRANSFER)
    a = span.attributes
    assert a[semconv.VLLM_REQUEST_ID] == "p-t2b"
    assert a[semconv.TRANSFER_STATUS] == semconv.TRANSFER_DECLINED_EXPIRED
    assert a[semconv.TRANSFER_DIRECTION] == semconv.DIRECTION_D_TO_P
    assert a[semconv.TRANSFER_BYTES] == 0 and a[semconv.TRANSFER_BLOCKS] == 0
    assert a[semconv.REMOTE_ENGINE_ID] == "decode-engine"
