"""Decode memory: how many KV blocks a decode engine holds, and what happens when they run out.

**Blocks from hardware.** vLLM sizes its KV cache from what the GPU has left after the weights:
``gpu_memory_utilization × GPU memory`` per GPU, minus the weights (and the activation peak and
CUDA graphs, which vLLM profiles and which :attr:`HardwareProfile.reserved_bytes` stands for;
0 by default, so the figure is an upper bound), divided by the bytes a block of
``block_size`` tokens takes (``block_size × KV bytes per token``). With tensor parallelism the
weights and the KV heads are split over ``tensor_parallel_size`` GPUs, so the engine's blocks
are the pooled figure. Sources of the numbers below are cited where they are defined.

**When decode cannot allocate.** Read in vLLM 0.33.0's ``vllm/v1/core/sched/scheduler.py``
(``Scheduler.schedule``): a *waiting* request whose ``kv_cache_manager.allocate_slots`` returns
None is not scheduled and the loop ``break``s, so it and every request behind it wait (FCFS
queueing); a *running* request that needs a block preempts the last running request
(``self.running[-1]``, recomputed later). A finished request whose blocks the NIXL connector
holds for a later reader (``request_finished`` → ``delay_free_blocks``) is in neither list: its
blocks are freed only by the connector (a read, a notify, or the TTL reaper), never to make room.
So retained blocks make new requests *queue*; nothing retained is lost to memory pressure.
``tests/vllm_contract/test_decode_memory_claims.py`` checks all three on the real scheduler.

:class:`DecodeMemory` models that per decode engine in the simulator: a turn's decode reserves
its whole sequence's blocks when it is admitted (prompt + output, so a running request never
needs to preempt another: the preemption path is not modelled); when retained plus running
blocks leave too few, the turn waits until enough handles expire or running requests finish.
Reads and notifies that would free a handle during that wait are not foreseen, so the wait is
an upper bound.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from kvscope.emulator.reuse_model import DecodeNode


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's weights and KV cache (from its public config), and what the physics
    cost model (:mod:`kvscope.emulator.physics`) counts its work and its reads with."""

    name: str
    parameters: float  # all parameters (MoE: every expert)
    active_parameters: float  # per token (dense: all)
    layers: int
    kv_heads: int  # MLA: 1 (one latent, replicated on every rank)
    head_dim: int
    weight_bytes: float  # per parameter (bf16: 2, fp8: 1)
    kv_bytes_per_token: int
    # Query heads × query head dim: the attention's FLOPs per token pair per layer are 4 × this.
    attention_dim: int = 0
    fp8_weights: bool = False
    # Tokens per KV block of vLLM's attention backend, and NIXL regions a rank registers (one
    # descriptor per block per region): physics.py's host term.
    kv_block_tokens: int = 16
    nixl_regions: int = 0
    # The built-in model whose fitted efficiency the physics borrows (its own name when fitted).
    family: str = ""

    @property
    def weights_bytes(self) -> float:
        """Bytes of the weights."""
        return self.parameters * self.weight_bytes

    def kv_bytes_per_token_per_gpu(self, tensor_parallel_size: int) -> float:
        """KV bytes one token takes on each GPU: the KV heads split over the GPUs, a head never
        split (fewer heads than GPUs, or MLA's one latent, are replicated)."""
        return self.kv_bytes_per_token / min(tensor_parallel_size, self.kv_heads)


# Qwen/Qwen3-32B config.json: num_hidden_layers 64, num_key_value_heads 8, head_dim 128,
# torch_dtype bfloat16; 32.8 B parameters (its model card). KV: 64 × 8 × 128 × (K, V) × 2 bytes;
# 64 query heads × 128. vLLM 0.29.0's NIXL connector: one region per layer (physics.py).
QWEN3_32B = ModelShape("qwen3-32b", 32.8e9, 32.8e9, 64, 8, 128, 2.0, 64 * 8 * 128 * 2 * 2,
                       attention_dim=64 * 128, kv_block_tokens=16, nixl_regions=64,
                       family="qwen3-32b")
# GLM-5 FP8: 744 B parameters, 40 B active (zai-org's announcement), fp8 weights. The shape is
# GLM-5.1's config.json (tests/emulator/data/model_configs/glm-5.1.json, the same
# GlmMoeDsaForCausalLM architecture; GLM-5's own was not read): 78 layers, an MLA latent cache
# of kv_lora_rank 512 + qk_rope_head_dim 64 (× 2 bytes: vLLM's bf16 KV cache), 64 query heads
# × (qk_nope 192 + rope 64); model_config.py counts 743 B parameters, 41 B active from it.
# Served by vLLM's FLASHMLA_SPARSE (64-token blocks) with an indexer-key region per layer
# (index_topk set, no index_topk_freq: every layer; physics.py).
GLM5_FP8 = ModelShape("glm-5-fp8", 744e9, 40e9, 78, 1, 576, 1.0, 78 * (512 + 64) * 2,
                      attention_dim=64 * 256, fp8_weights=True, kv_block_tokens=64,
                      nixl_regions=2 * 78, family="glm-5-fp8")
MODELS: dict[str, ModelShape] = {m.name: m for m in (QWEN3_32B, GLM5_FP8)}


@dataclass(frozen=True)
class Gpu:
    """One GPU's published limits (decimal units, as the datasheets give them)."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense, no sparsity


# NVIDIA datasheets: H100 SXM5 80 GB HBM3 3.35 TB/s, 989 TFLOP/s BF16 dense; H200 SXM 141 GB
# HBM3e 4.8 TB/s, 989 TFLOP/s; A100 SXM 80 GB HBM2e 2.039 TB/s, 312 TFLOP/s.
GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("h100-80gb", 80e9, 3.35e12, 989e12),
    Gpu("h200-141gb", 141e9, 4.8e12, 989e12),
    Gpu("a100-80gb", 80e9, 2.039e12, 312e12),
)}
NO_GPU = "none"


class CapacityError(ValueError):
    """A hardware profile that leaves no room for a KV cache, or names an unknown part."""


@dataclass(frozen=True)
class HardwareProfile:
    """A decode engine: a model on ``tensor_parallel_size`` GPUs at a memory utilisation."""

    gpu: Gpu
    model: ModelShape
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    reserved_bytes: float = 0.0  # activation peak, CUDA graphs: not modelled (upper bound)

    def kv_cache_bytes(self) -> float:
        """Bytes left for the KV cache over the engine's GPUs."""
        usable = self.gpu.memory_bytes * self.gpu_memory_utilization * self.tensor_parallel_size
        return usable - self.model.weights_bytes - self.reserved_bytes

    def kv_blocks(self, block_size: int) -> int:
        """KV blocks of ``block_size`` tokens the engine holds; CapacityError when none fit.
        Each GPU holds every block's share of it (a replicated head or latent whole), so the
        blocks are one GPU's free bytes over one GPU's bytes a block."""
        tp = self.tensor_parallel_size
        free = self.kv_cache_bytes() / tp
        per_block = block_size * self.model.kv_bytes_per_token_per_gpu(tp)
        blocks = math.floor(free / per_block) if free > 0 else 0
        if blocks < 1:
            raise CapacityError(
                f"{self.model.name} on {self.tensor_parallel_size}x {self.gpu.name} at "
                f"gpu_memory_utilization {self.gpu_memory_utilization:g}: the weights "
                f"({self.model.weights_bytes / 1e9:.1f} GB) leave no room for a KV cache")
        return blocks


def hardware(gpu: str, model: str | ModelShape, gpu_memory_utilization: float = 0.9,
             tensor_parallel_size: int = 1) -> HardwareProfile:
    """The profile of ``model`` (a built-in's name, or a shape read from a config) on ``gpu``;
    CapacityError naming an unknown part."""
    if gpu not in GPUS:
        raise CapacityError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    if isinstance(model, str) and model not in MODELS:
        raise CapacityError(f"no model config for profile {model!r} (known: "
                            f"{', '.join(MODELS)}; or --model-config FILE): its KV cache cannot "
                            "be sized")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise CapacityError(f"gpu_memory_utilization {gpu_memory_utilization} is not in (0, 1]")
    if tensor_parallel_size < 1:
        raise CapacityError(f"tensor_parallel_size {tensor_parallel_size} must be >= 1")
    shape = MODELS[model] if isinstance(model, str) else model
    return HardwareProfile(GPUS[gpu], shape, gpu_memory_utilization, tensor_parallel_size)


class DecodeMemory:
    """One decode engine's KV blocks over virtual time: retained handles (the node's) plus the
    running requests' blocks; a turn that does not fit waits (module docstring), and the turns
    waiting hold their place (FCFS: a later turn counts their blocks as taken)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._running: list[tuple[float, int]] = []  # (end, blocks) of started requests
        self._waiting: list[tuple[float, float, int]] = []  # (start, end, blocks) of queued ones
        self.running_blocks = 0
        self.waiting_blocks = 0
        self.queued_turns = 0
        self.queued_s = 0.0
        self.peak_blocks = 0

    def _advance(self, t: float) -> None:
        waiting, running = self._waiting, self._running
        while waiting and waiting[0][0] <= t:
            _, end, blocks = heapq.heappop(waiting)
            self.waiting_blocks -= blocks
            heapq.heappush(running, (end, blocks))
            self.running_blocks += blocks
        while running and running[0][0] <= t:
            self.running_blocks -= heapq.heappop(running)[1]

    def admit(self, node: DecodeNode, t: float, blocks: int, duration_s: float) -> float:
        """When a turn arriving at decode at ``t`` starts, holding ``blocks`` for
        ``duration_s`` once started: at ``t`` when they fit beside the retained handles, the
        running and the waiting requests, else once enough handles expire and requests end.
        A turn larger than the whole cache runs once everything is free (vLLM would refuse it
        at admission: not modelled)."""
        self._advance(t)
        node.reap(t)
        used = node.retained_blocks + self.running_blocks + self.waiting_blocks
        start = t
        if used + blocks > self.capacity_blocks:
            offset = node.config.clock_offset_s
            # A request that ends keeps its blocks as a retained handle for the TTL when decode
            # retains (it is the same blocks, pinned), else frees them at its end.
            keep = node.config.decoder_kv_blocks_ttl if node.config.bidirectional_kv_xfer else 0.0
            frees = sorted(
                [(r.expiry_local - offset, r.blocks) for r in node.handles.values()]
                + [(end + keep, b) for end, b in self._running]
                + [(end + keep, b) for _, end, b in self._waiting])
            for when, freed in frees:
                used -= freed
                start = max(start, when)
                if used + blocks <= self.capacity_blocks:
                    break
            self.queued_turns += 1
            self.queued_s += start - t
        if start > t:
            heapq.heappush(self._waiting, (start, start + duration_s, blocks))
            self.waiting_blocks += blocks
        else:
            heapq.heappush(self._running, (start + duration_s, blocks))
            self.running_blocks += blocks
        self.peak_blocks = max(self.peak_blocks, node.retained_blocks + self.running_blocks)
        return start


__all__ = ["CapacityError", "DecodeMemory", "GLM5_FP8", "GPUS", "Gpu", "HardwareProfile", "MODELS",
    "ModelShape", "NO_GPU", "QWEN3_32B", "hardware"]
