"""Workloads: multi-turn agentic sessions as numbers, for the simulator and for HTTP replay.

Sources: :mod:`.synthetic` (seeded generator), :mod:`.weka` (real Claude Code traces published
by WEKA, shipped in ``emulator/data/weka_cc``) and :mod:`.mooncake` (Mooncake JSONL traces;
:mod:`.mooncake_synthetic` generates seeded traces of the same shape that know their sessions).
"""

from __future__ import annotations

from kvscope.emulator.workloads.model import (
    DEFAULT_BLOCK_SIZE,
    BlockChain,
    BlockView,
    ChatHistory,
    Conversation,
    Turn,
    Workload,
    WorkloadError,
    block_view,
    common_prefix_blocks,
    messages,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "BlockChain",
    "BlockView",
    "ChatHistory",
    "Conversation",
    "Turn",
    "Workload",
    "WorkloadError",
    "block_view",
    "common_prefix_blocks",
    "messages",
]
