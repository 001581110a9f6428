"""The nodes, caches and handles of vLLM 0.33.0's NIXL pull connector with D→P readback.

The rules themselves (params, offer check, threshold, expiry guard, ``remote_num_tokens``,
validity, outcomes) are :mod:`kvscope.reuse`'s; this package applies them to state, one idea per
module:

    config.py        NodeConfig: one engine's connector settings
    prefix_cache.py  PrefixCache: full blocks by chained hash, least recently used first out
    params.py        the kv_transfer_params dicts and request ids vLLM puts on the wire
    transfer.py      TransferRecord: one transfer attempt or decline
    decode.py        DecodeNode: pinned blocks for D→P readback and the TTL reaper
    fabric.py        Fabric: which decode engine answers a side-channel address
    prefill.py       PrefillNode: the scheduler's reuse decision and the worker's read

One model serves the emulated HTTP servers (real time), the virtual-time simulator and the
what-if analysis: nothing here does I/O, reads a clock or starts a thread. Every time-dependent
call takes ``now``, one *global* time in seconds; each node adds its own ``clock_offset_s`` to
get its local ``perf_counter`` domain, exactly the quantity vLLM exports as
``remote_blocks_expiry_time``. Sequences are described at block level (:class:`BlockSeq`).

Each turn's ground truth (token split and outcome label) is decided from these nodes' results by
:func:`kvscope.emulator.ground_truth.account_turn`, with the decision table.
"""

from kvscope.emulator.reuse_model.config import NodeConfig
from kvscope.emulator.reuse_model.decode import DecodeNode, ReadReply, Retention
from kvscope.emulator.reuse_model.fabric import Fabric
from kvscope.emulator.reuse_model.params import kv_transfer_params, vllm_request_id
from kvscope.emulator.reuse_model.prefill import (
    NO_FAULTS,
    Faults,
    PrefillNode,
    PrefillResult,
    ReuseDecision,
)
from kvscope.emulator.reuse_model.prefix_cache import PrefixCache
from kvscope.emulator.reuse_model.transfer import TransferRecord

__all__ = ["NO_FAULTS", "DecodeNode", "Fabric", "Faults", "NodeConfig", "PrefillNode",
           "PrefillResult", "PrefixCache", "ReadReply", "Retention", "ReuseDecision",
           "TransferRecord", "kv_transfer_params", "vllm_request_id"]
