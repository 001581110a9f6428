"""What vLLM 0.33.0 puts on the wire: decode's and prefill's ``kv_transfer_params`` dicts and the
engine request ids it derives from an ``X-Request-Id``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from kvscope.emulator.reuse_model.config import NodeConfig
from kvscope.reuse.params import (
    TRANSFER_MODE_PULL,
)


def kv_transfer_params(
    cfg: NodeConfig,
    *,
    is_prefill: bool,
    request_id: str,
    block_ids: Sequence[int],
    num_computed_tokens: int,
    expiry: float | None,
) -> dict[str, Any]:
    """The exact dict ``request_finished`` returns in 0.33.0 (one KV group)."""
    return {
        "do_remote_prefill": is_prefill,
        "do_remote_decode": not is_prefill,
        "remote_block_ids": [block_ids],
        "remote_engine_id": cfg.engine_id,
        "remote_request_id": request_id,
        "remote_host": cfg.side_channel_host,
        "remote_port": cfg.side_channel_port,
        "tp_size": max(cfg.tp_size, cfg.dcp_size),
        "dcp_size": cfg.dcp_size,
        "pp_size": cfg.pp_size,
        "remote_num_tokens": num_computed_tokens,
        "remote_blocks_expiry_time": expiry,
        "remote_registration_generation": cfg.registration_generation,
        "transfer_mode": TRANSFER_MODE_PULL,
    }


def vllm_request_id(base: str, rng: random.Random, *, chat: bool = True,
                    randomize: bool = True) -> str:
    """The engine request id vLLM derives from an X-Request-Id (``base``).

    ``chatcmpl-``/``cmpl-`` + base (a completion's also ``-0``, its prompt's index: vLLM's
    completion serving makes one engine request per prompt, ``f"{request_id}-{i}"``), then
    ``-`` + 8 random hex digits unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``
    (``randomize=False``).
    """
    response_id = "chatcmpl-" + base if chat else f"cmpl-{base}-0"
    return f"{response_id}-{rng.getrandbits(32):08x}" if randomize else response_id


__all__ = ["kv_transfer_params", "vllm_request_id"]
