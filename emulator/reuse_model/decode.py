"""A decode engine of vLLM 0.33.0's NIXL connector with D→P readback: pinned blocks and their TTL.

What it mirrors (read from the 0.33.0 wheel, ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``;
checked on the real classes in ``tests/vllm_contract/test_real_*_claims.py``):
decode's ``request_finished``, with bidir on and status stopped/length-capped, pins the blocks,
``expiry = now_D + decoder_kv_blocks_ttl`` (never renewed), ``remote_num_tokens =
num_computed_tokens`` (:func:`kvscope.reuse.params.remote_num_tokens`: prompt + output after a
stop token under the async scheduler, else prompt + output − 1) and returns the exact 0.33.0
params dict (:func:`~kvscope.emulator.reuse_model.params.kv_transfer_params`); aborted/errored or
bidir off → no params. Handles are single-use: the first read or notify releases them; the reaper
releases at ``now_D >= expiry``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvscope import semconv
from kvscope.collector.engine_telemetry import KvRetentionRecord
from kvscope.emulator.reuse_model.config import NodeConfig
from kvscope.emulator.reuse_model.params import kv_transfer_params
from kvscope.emulator.reuse_model.prefix_cache import PrefixCache
from kvscope.emulator.reuse_model.transfer import TransferRecord
from kvscope.emulator.tokens import Blocks
from kvscope.reuse.params import (
    RETAINING_STATUSES,
    remote_num_tokens,
)
from kvscope.reuse.validity import (
    UNRECOGNIZED_NOTIFY,
    UNRECOGNIZED_READ,
)


@dataclass
class Retention:
    """Blocks decode pinned for a later reader, from pin to release."""

    request_id: str
    engine_id: str
    blocks: int
    bytes: int
    tokens: int
    ttl_s: float
    start: float
    expiry_local: float
    end: float | None = None
    release_reason: str = semconv.RELEASE_OPEN

    @property
    def held_s(self) -> float | None:
        """Seconds held, or None while open."""
        return None if self.end is None else self.end - self.start

    def record(self, start_ns: int, end_ns: int | None,
               traceparent: str | None = None) -> KvRetentionRecord:
        """This retention as the telemetry record decode's hooks emit (``end_ns`` None: open)."""
        return KvRetentionRecord(self.request_id, start_ns, end_ns, self.blocks, self.bytes,
                                 self.ttl_s, self.release_reason, self.tokens, traceparent)


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class ReadReply:
    """What decode's side of one READ or notify saw."""

    known: bool
    retention: Retention | None


class DecodeNode:
    """A decode engine: prefix cache, pinned handles for D→P readback, and the TTL reaper.

    ``compact_block_ids`` puts a ``range`` instead of a list in ``remote_block_ids`` (same ids,
    O(1) to build): for the simulator, where nothing serialises the params; the HTTP servers keep
    the exact 0.33.0 list.
    """

    def __init__(self, config: NodeConfig, *, compact_block_ids: bool = False) -> None:
        self.config = config
        self.compact_block_ids = compact_block_ids
        self.cache = PrefixCache(
            config.cache_capacity_blocks if config.enable_prefix_caching else 0
        )
        self.handles: dict[str, Retention] = {}
        # Blocks the open handles pin (kept as handles open and close: read per admitted turn).
        self.retained_blocks = 0
        self._expiries: list[tuple[float, str]] = []
        self._next_block_id = 0
        self.released: list[Retention] = []
        # "Potentially invalid KV blocks" lines decode would log, by case
        # (validity.UNRECOGNIZED_READ / UNRECOGNIZED_NOTIFY): vLLM's
        # num_notifications_after_expiry is their sum.
        self.notifications_after_expiry: dict[str, int] = {
            UNRECOGNIZED_READ: 0, UNRECOGNIZED_NOTIFY: 0}

    def finish_request(
        self, request_id: str, sequence: Blocks, status: str, now: float
    ) -> tuple[Retention | None, dict[str, Any] | None]:
        """``request_finished`` on D for a sequence of prompt + output tokens.

        Returns the pinned retention and the ``kv_transfer_params`` D sends back, or
        ``(None, None)`` when bidir is off or the request did not finish normally; with no
        blocks to keep, ``(None, params)`` with empty block ids and 0 tokens (as vLLM).
        """
        cfg = self.config
        self.cache.touch(sequence)
        if not cfg.bidirectional_kv_xfer or status not in RETAINING_STATUSES:
            return None, None
        num_computed = remote_num_tokens(sequence.num_tokens, cfg.scheduling, status)
        blocks = math.ceil(num_computed / cfg.block_size)
        if blocks == 0:
            # pull_scheduler.py request_finished: no blocks to delay-free → (False, params) with
            # empty block ids, remote_num_tokens 0 and no expiry (P's offer check then fails).
            return None, kv_transfer_params(cfg, is_prefill=False, request_id=request_id,
                                            block_ids=[], num_computed_tokens=0, expiry=None)
        self.reap(now)
        expiry_local = cfg.local_time(now) + cfg.decoder_kv_blocks_ttl
        retention = Retention(
            request_id=request_id,
            engine_id=cfg.engine_id,
            blocks=blocks,
            bytes=blocks * cfg.block_bytes,
            tokens=num_computed,
            ttl_s=cfg.decoder_kv_blocks_ttl,
            start=now,
            expiry_local=expiry_local,
        )
        ids = range(self._next_block_id, self._next_block_id + blocks)
        block_ids = ids if self.compact_block_ids else list(ids)
        self._next_block_id += blocks
        self.handles[request_id] = retention
        self.retained_blocks += blocks
        heapq.heappush(self._expiries, (expiry_local, request_id))
        params = kv_transfer_params(
            cfg,
            is_prefill=False,
            request_id=request_id,
            block_ids=block_ids,
            num_computed_tokens=num_computed,
            expiry=expiry_local,
        )
        return retention, params

    def admit(
        self, request_id: str, prompt: Blocks, params: Mapping[str, Any] | None
    ) -> TransferRecord | None:
        """D's P→D pull for a new request (``do_remote_prefill`` branch: no threshold)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        cfg = self.config
        local_blocks = self.cache.longest_hit_blocks(prompt)
        count = prompt.num_tokens - local_blocks * prompt.block_size
        if count <= 0:
            return None
        blocks = math.ceil(prompt.num_tokens / prompt.block_size) - local_blocks
        self.cache.touch(prompt)
        return TransferRecord(
            direction=semconv.DIRECTION_P_TO_D,
            status=semconv.TRANSFER_OK,
            tokens=count,
            blocks=blocks,
            bytes=blocks * cfg.block_bytes,
            remote_engine_id=str(params.get("remote_engine_id")),
        )

    def reap(self, now: float) -> list[Retention]:
        """Release every handle whose deadline has passed on D's clock (the TTL reaper)."""
        now_local = self.config.local_time(now)
        reaped = []
        while self._expiries and self._expiries[0][0] <= now_local:
            expiry_local, request_id = heapq.heappop(self._expiries)
            retention = self.handles.get(request_id)
            if retention is None or retention.expiry_local != expiry_local:
                continue
            # The reaper releases at its own tick; global time of the deadline is exact enough.
            reaped.append(
                self._release(
                    request_id, expiry_local - self.config.clock_offset_s, semconv.RELEASE_EXPIRED
                )
            )
        return reaped

    def receive(self, request_id: str, now: float, read: bool) -> ReadReply:
        """A READ (``read``) or notify-only message from prefill for ``request_id``."""
        self.reap(now)
        if request_id not in self.handles:
            # vLLM logs "Potentially invalid KV blocks for unrecognized request"; a READ still
            # moves whatever the freed blocks now hold, a notify-only message moves nothing.
            self.notifications_after_expiry[
                UNRECOGNIZED_READ if read else UNRECOGNIZED_NOTIFY] += 1
            return ReadReply(False, None)
        reason = semconv.RELEASE_READ if read else semconv.RELEASE_NOTIFIED
        return ReadReply(True, self._release(request_id, now, reason))

    def retained_bytes(self, now: float) -> int:
        """Bytes pinned for later readers at ``now``."""
        self.reap(now)
        return sum(r.bytes for r in self.handles.values())

    def _release(self, request_id: str, when: float, reason: str) -> Retention:
        retention = self.handles.pop(request_id)
        self.retained_blocks -= retention.blocks
        retention.end = when
        retention.release_reason = reason
        self.released.append(retention)
        return retention


__all__ = ["DecodeNode", "ReadReply", "Retention"]
