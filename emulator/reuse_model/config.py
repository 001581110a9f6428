"""One vLLM engine's NIXL connector settings, as the emulated nodes read them."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.emulator.tokens import DEFAULT_BLOCK_SIZE
from kvscope.reuse.params import (
    SCHEDULING_ASYNC,
    FailurePolicy,
)


@dataclass(frozen=True)
class NodeConfig:
    """One vLLM engine's connector settings (``kv_connector_extra_config`` and friends)."""

    engine_id: str
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 5600
    bidirectional_kv_xfer: bool = False
    kv_recompute_threshold: int = 64
    decoder_kv_blocks_ttl: float = 480.0
    kv_lease_duration: float = 30.0
    kv_load_failure_policy: FailurePolicy = "fail"
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    # Free-but-cached blocks the prefix cache may hold; pinned (retained) blocks are extra.
    cache_capacity_blocks: int = 1 << 20
    kv_bytes_per_token: int = 0
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    registration_generation: int = 0
    # This engine's perf_counter = global time + offset (each process has its own epoch).
    clock_offset_s: float = 0.0
    stall_on_reissued_load: bool = True
    # SchedulerConfig.async_scheduling (vLLM's default: async); it sets remote_num_tokens.
    scheduling: str = SCHEDULING_ASYNC

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block on this engine."""
        return self.block_size * self.kv_bytes_per_token

    def local_time(self, now: float) -> float:
        """Global time ``now`` in this engine's perf_counter domain."""
        return now + self.clock_offset_s


__all__ = ["NodeConfig"]
