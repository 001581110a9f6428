"""The nodes, caches and handles of vLLM 0.33.0's NIXL pull connector with D→P readback.

The rules themselves (params, offer check, threshold, expiry guard, ``remote_num_tokens``,
validity, outcomes) are :mod:`kvscope.reuse`'s; this module applies them to state.

One model serves the emulated HTTP servers (real time), the virtual-time simulator and the
what-if analysis: nothing here does I/O, reads a clock or starts a thread. Every time-dependent
call takes ``now``, one *global* time in seconds; each node adds its own ``clock_offset_s`` to
get its local ``perf_counter`` domain, exactly the quantity vLLM exports as
``remote_blocks_expiry_time``. Sequences are described at block level (:class:`BlockSeq`).

What it mirrors (read from the 0.33.0 wheel, paths under
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``; each claim checked on the real classes in
``tests/vllm_contract/test_real_*_claims.py``):

* :meth:`PrefillNode.decide` = scheduler local hit (``get_computed_blocks``: longest cached
  chain of full blocks within the first ``num_tokens - 1`` tokens, so a full hit still computes
  the last token) + ``NixlPullConnectorScheduler.get_num_new_matched_tokens`` (D→P branch:
  ``do_remote_decode``, truthy ``remote_block_ids`` and the four keys *present*; ``count =
  min(remote_num_tokens, num_prompt_tokens) - local``; ``(0, False)`` when ``threshold > 0 and
  0 < count < threshold``; no bidir check here) + ``update_state_after_alloc`` (registers the
  read only with bidir on at P and not ``_remote_blocks_processed``; zero external tokens →
  notify-only, which releases D's handle). ``prompt_logprobs`` (``skip_reading_prefix_cache``):
  no local hit is read and an accepted pull becomes notify-only (``scheduler_skipped``).
* Bidir off at P, D offering ≥ threshold: P still answers ``(count, True)``, the scheduler parks
  the request in WAITING_FOR_REMOTE_KVS, nothing registers a read, no ``finished_recving`` ever
  arrives: the request stalls until the client gives up (``stalled=True``). D is never
  notified, so its handle lives until the TTL reaper. Below threshold or covered locally, P
  computes and D is likewise not notified.
* A second schedule of the same request (preemption after the read, or ``recompute`` after a
  failed load, which resets ``num_computed_tokens`` to 0) runs the same decision with
  ``_remote_blocks_processed`` set: when it again answers ``(count > 0, async)`` no read is
  registered (decision ``reissued``) and the request stalls in WAITING_FOR_REMOTE_KVS for good
  (``NodeConfig.stall_on_reissued_load``; confirmed on the real scheduler; set it False to model
  the documented "falls back to local prefill"). When P's prefix cache now covers the span
  (pulled blocks are cached after a successful load) it proceeds locally.
* Worker read: handshake (peer found at ``remote_host:remote_port`` with that engine id, no
  injected fault; a notify-only request's failed handshake is dropped) → expiry guard
  ``now_P + 5.0 >= expiry - offset`` → ``declined_expired`` (skipped when expiry is ``None`` or
  notify-only) → READ of whole blocks. The caller passes ``now`` as the time the request is
  admitted (the worker checks at ``start_load_kv``, after queueing and the handshake). A
  failure is handled by ``kv_load_failure_policy``: ``fail`` ends the turn with an error;
  ``recompute`` reschedules.
* Decode ``request_finished``: with bidir on and status stopped/length-capped, pins the blocks,
  ``expiry = now_D + decoder_kv_blocks_ttl`` (never renewed), ``remote_num_tokens =
  num_computed_tokens`` (:func:`kvscope.reuse.params.remote_num_tokens`: prompt + output after
  a stop token under the async scheduler, else prompt + output − 1) and returns the exact 0.33.0
  params dict
  (:data:`PARAMS_FIELDS`); aborted/errored or bidir off → no params. Handles are single-use:
  the first read or notify releases them; the reaper releases at ``now_D >= expiry``.

Ground-truth accounting and the outcome label are decided by :func:`account_turn`, following
:mod:`kvscope.reuse.outcomes`.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvscope import semconv
from kvscope.collector.engine_telemetry import KvRetentionRecord, ReuseDecisionRecord
from kvscope.emulator.tokens import DEFAULT_BLOCK_SIZE, Blocks, BlockSeq
from kvscope.reuse import decisions
from kvscope.reuse.params import (
    FAILURE_POLICY_FAIL,
    RETAINING_STATUSES,
    SCHEDULING_ASYNC,
    TRANSFER_MODE_PULL,
    FailurePolicy,
    answer_offer,
    read_declined_expired,
    remote_num_tokens,
)
from kvscope.reuse.validity import (
    INVALID_BEYOND_PREFIX,
    UNRECOGNIZED_NOTIFY,
    UNRECOGNIZED_READ,
    invalid_tokens,
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


class PrefixCache:
    """A bounded prefix cache of full blocks keyed by chained hash, evicting least recently used.

    Like vLLM's free-block queue, a sequence's blocks are touched tail first, so within one
    sequence the tail is evicted before its prefix and the cache stays prefix-closed.

    The LRU order is kept as *stamps*: a touch of ``n`` blocks gives block ``i`` the stamp
    ``clock + n - 1 - i`` and advances the clock by ``n``, which is exactly the order an
    OrderedDict would reach by moving the blocks to its end tail first; eviction removes the
    smallest stamps, one block at a time in that order (never in bulk beyond the overflow).
    Since a block's parent always holds a larger stamp (every touch of a block touches its
    prefix too), the smallest stamp is always a *leaf* (a cached block with no cached child).

    Two storage forms, chosen by the first sequence a cache sees (each handles both kinds of
    sequence exactly; the choice is only about speed):

    * *runs*, for :class:`BlockRuns` (the simulator's run-numbered blocks): blocks are stored by
      maximal runs of consecutive ids (``seq.runs``), keyed by the run's first id; a run's
      cached part is always a prefix of it, described by *pieces* ``[end, top]`` (offsets
      ``[previous end, end)`` carry stamps ``top - offset``), newest piece first. A touch or
      lookup costs O(runs), and a heap of run tails finds the smallest stamp.
    * *per block*, for :class:`BlockSeq` (the HTTP servers' random chained hashes, where every
      run is one block long): one flat ``hash -> stamp`` dict, refreshed in bulk by
      ``dict.update(zip(...))``; a lookup bisects the prefix (the cache is prefix-closed), and
      a heap of leaves ``(stamp, index, hashes)`` finds the smallest stamp, its parent being
      ``hashes[index - 1]``.

    Relies on chained ids (an id fixes its whole prefix), as vLLM's block hashes and the
    workloads' block ids are.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.evicted_blocks = 0
        self._size = 0
        self._clock = 0
        # None until the first sequence decides the storage form.
        self._per_block: bool | None = None
        # Runs form.
        self._runs: dict[int, list[list[int]]] = {}
        # (stamp of a run's last cached block, run key); stale entries are skipped when popped.
        self._tails: list[tuple[int, int]] = []
        # Per-block form.
        self._stamps: dict[int, int] = {}
        # (stamp of hashes[index], index, hashes); every leaf has an entry with its current
        # stamp; stale and non-leaf entries are skipped or wait their turn.
        self._leaves: list[tuple[int, int, tuple[int, ...]]] = []

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block_hash: int) -> bool:
        if self._per_block:
            return block_hash in self._stamps
        pieces = self._runs.get(block_hash)
        if pieces is not None:
            return True
        # Inside a run: O(runs) scan (not on any hot path).
        return any(key < block_hash < key + p[-1][0] for key, p in self._runs.items())

    def _form_is_per_block(self, seq: Blocks) -> bool:
        """Whether this cache stores blocks one by one (decided once, by the first sequence)."""
        if self._per_block is None:
            self._per_block = isinstance(seq, BlockSeq)
        return self._per_block

    def longest_hit_blocks(self, seq: Blocks, max_tokens: int | None = None) -> int:
        """Leading blocks of ``seq`` cached here, within ``max_tokens`` (default num_tokens - 1)."""
        limit = seq.num_tokens - 1 if max_tokens is None else max_tokens
        n = min(seq.num_blocks, max(limit, 0) // seq.block_size)
        if self._form_is_per_block(seq):
            return self._cached_prefix(seq.block_hashes, n)
        runs = self._runs
        hit = 0
        for key, count in seq.runs:
            if hit >= n:
                break
            pieces = runs.get(key)
            if pieces is None:
                break
            cached = pieces[-1][0]
            if cached < count:
                hit += cached
                break
            hit += count
        return min(hit, n)

    def _cached_prefix(self, hashes: Sequence[int], n: int) -> int:
        """Leading blocks of ``hashes[:n]`` in the per-block dict (bisection: prefix-closed)."""
        stamps = self._stamps
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in stamps:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def touch(self, seq: Blocks, num_blocks: int | None = None) -> None:
        """Insert or refresh the first ``num_blocks`` full blocks of ``seq`` (all by default).

        O(runs touched) for run-numbered blocks, one C-level dict update per touch otherwise; a
        cache of capacity 0 (prefix caching off) costs nothing.
        """
        if self.capacity_blocks == 0:
            return
        total = seq.num_blocks
        n = total if num_blocks is None else len(range(total)[:num_blocks])
        if n <= 0:
            return
        top = self._clock + n - 1  # the stamp of block 0; it decreases along the sequence
        self._clock += n
        if self._form_is_per_block(seq):
            self._touch_blocks(seq.block_hashes, n, top)
            return
        runs, tails, push = self._runs, self._tails, heapq.heappush
        left = n
        for key, count in seq.runs:
            if left <= 0:
                break
            count = min(count, left)
            left -= count
            pieces = runs.get(key)
            if pieces is None or pieces[-1][0] <= count:
                # The whole cached part is refreshed: one piece, a new tail stamp.
                self._size += count - (pieces[-1][0] if pieces is not None else 0)
                runs[key] = [[count, top]]
                push(tails, (top - count + 1, key))
            else:
                # A prefix is refreshed; blocks past it keep their (older) stamps and tail.
                keep = 0
                while pieces[keep][0] <= count:
                    keep += 1
                pieces[:keep] = [[count, top]]
            top -= count
        if self._size > self.capacity_blocks:
            self._evict(self._size - self.capacity_blocks)
        if len(tails) > 2 * len(runs) + 1024:
            self._tails = [(p[-1][1] - p[-1][0] + 1, key) for key, p in runs.items()]
            heapq.heapify(self._tails)

    def _touch_blocks(self, hashes: tuple[int, ...], n: int, top: int) -> None:
        """Per-block touch of ``hashes[:n]``, block 0 getting stamp ``top``."""
        stamps = self._stamps
        self._size += n - self._cached_prefix(hashes, n)
        # zip stops after n blocks; an existing key keeps its dict slot and takes the new stamp.
        stamps.update(zip(hashes, range(top, top - n, -1), strict=False))
        heapq.heappush(self._leaves, (top - n + 1, n - 1, hashes))
        if self._size > self.capacity_blocks:
            self._evict_blocks(self._size - self.capacity_blocks)
        if len(self._leaves) > 2 * len(stamps) + 1024:
            # Valid entries (one per distinct block at most) include every leaf.
            self._leaves = [e for e in self._leaves if stamps.get(e[2][e[1]]) == e[0]]
            heapq.heapify(self._leaves)

    def _evict(self, overflow: int) -> None:
        """Remove the ``overflow`` blocks with the smallest stamps (least recently used)."""
        runs, tails = self._runs, self._tails
        self._size -= overflow
        self.evicted_blocks += overflow
        while overflow > 0:
            stamp, key = heapq.heappop(tails)
            pieces = runs.get(key)
            if pieces is None:
                continue
            end, top = pieces[-1]
            if top - end + 1 != stamp:
                continue  # stale: the run's tail was refreshed or evicted since
            start = pieces[-2][0] if len(pieces) > 1 else 0
            # Pieces never interleave in stamp order (a touch takes a fresh range of stamps and
            # gives each run on its path a disjoint part of it), so the whole oldest piece is
            # older than every other cached block.
            drop = min(overflow, end - start)
            overflow -= drop
            end -= drop
            if end > start:
                pieces[-1][0] = end
            else:
                pieces.pop()
                if not pieces:
                    del runs[key]
                    continue
                end, top = pieces[-1]
            heapq.heappush(tails, (top - end + 1, key))

    def _evict_blocks(self, overflow: int) -> None:
        """Per-block form of :meth:`_evict`: pop the oldest leaf, then walk up its chain."""
        stamps, leaves = self._stamps, self._leaves
        self._size -= overflow
        self.evicted_blocks += overflow
        while overflow > 0:
            stamp, index, hashes = heapq.heappop(leaves)
            if stamps.get(hashes[index]) != stamp:
                continue  # stale: refreshed or evicted since
            # The first valid entry is the global minimum (every leaf is in the heap and a
            # leaf holds the smallest stamp). After removing stamp s, a block stamped s + 1 is
            # the next minimum: follow the parent while it is, without the heap.
            while True:
                del stamps[hashes[index]]
                overflow -= 1
                if index == 0:
                    break
                index -= 1
                parent = stamps[hashes[index]]
                if overflow == 0 or parent != stamp + 1:
                    heapq.heappush(leaves, (parent, index, hashes))
                    break
                stamp = parent


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


class Fabric:
    """Which decode engine answers a side-channel address (the NIXL handshake's view)."""

    def __init__(self) -> None:
        self._by_address: dict[tuple[str, int], DecodeNode] = {}

    def register(self, node: DecodeNode, hosts: tuple[str, ...] = ()) -> None:
        """Make ``node`` reachable at its side-channel host and any aliases in ``hosts``."""
        for host in (node.config.side_channel_host, *hosts):
            self._by_address[(host, node.config.side_channel_port)] = node

    def resolve(self, host: object, port: object, engine_id: object) -> DecodeNode | None:
        """The node a handshake to ``host:port`` reaches, if it is engine ``engine_id``."""
        if not isinstance(host, str) or not isinstance(port, int):
            return None
        node = self._by_address.get((host, port))
        if node is None or node.config.engine_id != engine_id:
            return None
        return node


@dataclass(frozen=True)
class Faults:
    """Failures to inject into one prefill's read (the emulator's fault switches)."""

    handshake_fails: bool = False
    transfer_fails: bool = False
    preempt_after_read: bool = False
    # Error in P's estimate of D's clock offset (seconds; positive = P thinks D is ahead).
    clock_offset_error_s: float = 0.0


NO_FAULTS = Faults()


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class ReuseDecision:
    """P scheduler's decision for one schedule of a request (get_num_new_matched_tokens + alloc)."""

    request_id: str
    prompt_tokens: int
    local_hit_tokens: int
    remote_offered_tokens: int
    count: int
    tokens_to_pull: int
    load_async: bool
    threshold: int
    decision: str
    read_registered: bool
    notify_only: bool
    stalled: bool
    bidirectional_kv_xfer: bool
    block_size: int = DEFAULT_BLOCK_SIZE

    def record(self, time_ns: int, params: Mapping[str, Any] | None,
               traceparent: str | None = None) -> ReuseDecisionRecord:
        """This decision as the telemetry record prefill's hooks emit (offer from ``params``)."""
        offered = (params or {}).get("remote_num_tokens")
        remote_engine = (params or {}).get("remote_engine_id")
        return ReuseDecisionRecord(
            self.request_id, time_ns, self.local_hit_tokens,
            offered if isinstance(offered, int) else None, self.tokens_to_pull, self.threshold,
            self.decision, self.bidirectional_kv_xfer, self.prompt_tokens,
            remote_engine if isinstance(remote_engine, str) else None, traceparent,
            self.block_size)


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class TransferRecord:
    """One D→P READ attempt (or decline) by P's worker."""

    direction: str
    status: str
    tokens: int
    blocks: int
    bytes: int
    remote_engine_id: str
    stale_handle: bool = False


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class PrefillResult:
    """Everything one prefill request did about reuse, for spans and ground truth."""

    decision: ReuseDecision
    transfer: TransferRecord | None
    local_hit_tokens: int
    remote_reused_tokens: int
    computed_tokens: int
    preempted: bool
    load_failed: bool
    errored: bool
    stalled: bool
    rescheduled_decision: ReuseDecision | None
    decode_release: str | None

    @property
    def cached_tokens(self) -> int:
        """What vLLM reports as the request's cached prompt tokens (``num_cached_tokens``):
        local hit + external tokens at its first schedule (``PrefillStats.set``, scheduler.py),
        whether or not the read then succeeds; P returns it to D as
        ``remote_prefill_cached_tokens``, which D reports as ``cached_tokens``."""
        return self.decision.local_hit_tokens + self.decision.tokens_to_pull


@dataclass
class _RequestState:
    params: dict[str, Any] | None
    processed: bool = False
    schedules: int = 0
    skip: bool = False


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


class PrefillNode:
    """A prefill engine: prefix cache, the scheduler's reuse decision and the worker's read.

    ``compact_block_ids``: as for :class:`DecodeNode`, P's params for D carry a ``range``.
    """

    def __init__(
        self, config: NodeConfig, fabric: Fabric | None = None, *, compact_block_ids: bool = False
    ) -> None:
        self.config = config
        self.compact_block_ids = compact_block_ids
        self.fabric = fabric if fabric is not None else Fabric()
        self.cache = PrefixCache(
            config.cache_capacity_blocks if config.enable_prefix_caching else 0
        )
        self._requests: dict[str, _RequestState] = {}

    def decide(
        self, request_id: str, prompt: Blocks, params: Mapping[str, Any] | None,
        skip_reading_prefix_cache: bool = False,
    ) -> ReuseDecision:
        """One schedule of ``request_id`` (``num_computed_tokens == 0``): local hit, then offer.

        ``skip_reading_prefix_cache`` (a request with ``prompt_logprobs``): no local prefix is
        read (``kv_cache_manager.py``, read from the source) and the scheduler turns the
        connector's accepted pull into notify-only (confirmed on the real scheduler:
        tests/vllm_contract/test_real_scheduler_claims.py).
        """
        state = self._requests.setdefault(
            request_id, _RequestState(dict(params) if params is not None else None)
        )
        state.schedules += 1
        state.skip = skip_reading_prefix_cache
        return self._decide(request_id, prompt, state)

    def _decide(self, request_id: str, prompt: Blocks, state: _RequestState) -> ReuseDecision:
        cfg = self.config
        local = 0 if state.skip else self.cache.longest_hit_blocks(prompt) * prompt.block_size
        params = state.params
        decision, offered, count, load_async = answer_offer(
            params, local, prompt.num_tokens, cfg.kv_recompute_threshold
        )
        if state.skip and load_async:
            decision, load_async = semconv.DECISION_SCHEDULER_SKIPPED, False
        pulled = count if load_async else 0
        reissued = load_async and state.processed and cfg.bidirectional_kv_xfer
        if reissued:
            # _remote_blocks_processed: a second schedule registers no read; the request waits
            # for a load that never comes (vLLM 0.33.0 has no timeout there).
            decision = semconv.DECISION_REISSUED
        # update_state_after_alloc: the read (or notify-only) is registered once per request.
        registered = bool(
            decision
            in (
                semconv.DECISION_PULL,
                semconv.DECISION_LOCAL_COVERS,
                semconv.DECISION_BELOW_THRESHOLD,
                semconv.DECISION_SCHEDULER_SKIPPED,
            )
            and cfg.bidirectional_kv_xfer
            and not state.processed
        )
        if params is not None and params.get("do_remote_decode") and cfg.bidirectional_kv_xfer:
            state.processed = True
        return ReuseDecision(
            request_id=request_id,
            prompt_tokens=prompt.num_tokens,
            local_hit_tokens=local,
            remote_offered_tokens=offered,
            count=count,
            tokens_to_pull=pulled,
            load_async=load_async,
            threshold=cfg.kv_recompute_threshold,
            decision=decision,
            read_registered=registered,
            notify_only=registered and not load_async,
            stalled=load_async and not registered,
            bidirectional_kv_xfer=cfg.bidirectional_kv_xfer,
            block_size=prompt.block_size,
        )

    def prefill(
        self,
        request_id: str,
        prompt: Blocks,
        params: Mapping[str, Any] | None,
        now: float,
        faults: Faults = NO_FAULTS,
        *,
        skip_reading_prefix_cache: bool = False,
    ) -> PrefillResult:
        """Schedule, read (if registered) and compute one prefill request at global time ``now``.

        The prompt's blocks enter P's prefix cache when the request computes; the request's
        state is dropped at the end (call :meth:`finish_request` for P→D params).
        """
        cfg = self.config
        decision = self.decide(request_id, prompt, params, skip_reading_prefix_cache)
        state = self._requests[request_id]
        transfer: TransferRecord | None = None
        release: str | None = None
        if decision.read_registered:
            transfer, release = self._read(decision, state.params or {}, now, faults)
        load_failed = transfer is not None and transfer.status != semconv.TRANSFER_OK
        local, remote = decision.local_hit_tokens, 0
        rescheduled: ReuseDecision | None = None
        errored = stalled = preempted = False
        if decision.stalled:
            stalled = True
        elif load_failed and cfg.kv_load_failure_policy == FAILURE_POLICY_FAIL:
            errored = True
        elif load_failed or (transfer is not None and faults.preempt_after_read):
            preempted = not load_failed
            if preempted and cfg.enable_prefix_caching:
                # A finished load is cached before the request runs; preemption keeps it cached.
                self.cache.touch(
                    prompt,
                    (decision.local_hit_tokens + decision.tokens_to_pull) // prompt.block_size,
                )
            state.schedules += 1
            rescheduled = self._decide(request_id, prompt, state)
            local = rescheduled.local_hit_tokens
            stalled = rescheduled.load_async and cfg.stall_on_reissued_load
        elif transfer is not None and not transfer.stale_handle:
            remote = decision.tokens_to_pull
        # A stale READ still fills the blocks (with garbage): P does not compute those tokens.
        garbage = decision.tokens_to_pull if transfer is not None and transfer.stale_handle else 0
        computed = 0 if (errored or stalled) else prompt.num_tokens - local - remote - garbage
        if not (errored or stalled):
            self.cache.touch(prompt)
        self._requests.pop(request_id, None)
        return PrefillResult(
            decision=decision,
            transfer=transfer,
            local_hit_tokens=local,
            remote_reused_tokens=remote,
            computed_tokens=computed,
            preempted=preempted,
            load_failed=load_failed,
            errored=errored,
            stalled=stalled,
            rescheduled_decision=rescheduled,
            decode_release=release,
        )

    def _read(
        self, decision: ReuseDecision, params: Mapping[str, Any], now: float, faults: Faults
    ) -> tuple[TransferRecord | None, str | None]:
        """The worker's ``_read_blocks_for_req``: handshake, expiry guard, READ or notify."""
        cfg = self.config
        engine = str(params.get("remote_engine_id"))
        remote_id = str(params.get("remote_request_id"))
        bs = cfg.block_size
        first_block = decision.local_hit_tokens // bs
        blocks = math.ceil((decision.local_hit_tokens + decision.tokens_to_pull) / bs) - first_block
        blocks = max(blocks, 0) if decision.load_async else 0
        node = self.fabric.resolve(params.get("remote_host"), params.get("remote_port"), engine)

        def record(status: str, moved: bool, stale: bool = False) -> TransferRecord:
            n = blocks if moved else 0
            return TransferRecord(
                direction=semconv.DIRECTION_D_TO_P,
                status=status,
                tokens=decision.tokens_to_pull if moved else 0,
                blocks=n,
                bytes=n * cfg.block_bytes,
                remote_engine_id=engine,
                stale_handle=stale,
            )

        if node is None or faults.handshake_fails:
            if decision.notify_only:
                # Not in _recving_metadata: vLLM drops the failure; D is never notified and
                # keeps the handle until its reaper.
                return None, None
            return (record(semconv.TRANSFER_HANDSHAKE_FAILED, False), None)
        expiry = params.get("remote_blocks_expiry_time")
        if decision.notify_only:
            reply = node.receive(remote_id, now, read=False)
            return None, semconv.RELEASE_NOTIFIED if reply.known else None
        if expiry is not None:
            # P's estimate of D's offset (remote perf_counter − local), from the handshake.
            offset = node.config.clock_offset_s - cfg.clock_offset_s + faults.clock_offset_error_s
            if read_declined_expired(cfg.local_time(now), float(expiry), offset):
                # Declined reads neither read nor notify: D keeps the blocks until its reaper.
                return record(semconv.TRANSFER_DECLINED_EXPIRED, False), None
        if faults.transfer_fails:
            return record(semconv.TRANSFER_FAILED, False), None
        reply = node.receive(remote_id, now, read=True)
        if not reply.known:
            # R14: D already freed the blocks; the READ moves whatever they hold now.
            return record(semconv.TRANSFER_OK, True, stale=True), None
        return record(semconv.TRANSFER_OK, True), semconv.RELEASE_READ

    def finish_request(
        self, request_id: str, prompt: Blocks, cached_tokens: int = 0
    ) -> dict[str, Any]:
        """P's params for D after its one-token prefill (P→D: ``do_remote_prefill=True``)."""
        cfg = self.config
        num_computed = prompt.num_tokens
        blocks = math.ceil(num_computed / cfg.block_size)
        params = kv_transfer_params(
            cfg,
            is_prefill=True,
            request_id=request_id,
            block_ids=range(blocks) if self.compact_block_ids else list(range(blocks)),
            num_computed_tokens=num_computed,
            expiry=None,
        )
        params["remote_prefill_cached_tokens"] = cached_tokens
        return params


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class TurnAccounting:
    """Ground truth for one turn: the token split (DESIGN §5) and its outcome label."""

    reusable_tokens: int
    local_hit_tokens: int
    remote_reused_tokens: int
    recomputed_reusable_tokens: int
    outcome: str
    evidence: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # What happened, as the decision table's facts (kvscope.reuse.decisions.FACTS).
    facts: dict[str, Any] = field(default_factory=dict)


def account_turn(
    turn_index: int,
    reusable_tokens: int,
    result: PrefillResult | None,
    *,
    router_lookup: str | None = semconv.ROUTER_HIT,
    decode_returned_params: bool = True,
    router_entry_age_s: float | None = None,
    history_edited: bool = False,
    reuse_guard: str | None = None,
) -> TurnAccounting:
    """Split turn ``turn_index``'s reusable tokens and label it: the facts of what happened,
    read by the one decision table (:data:`kvscope.reuse.decisions.TABLE`).

    ``reusable_tokens`` is the common prefix of the prompt with decode's sequence, capped at the
    tokens decode holds KV for. ``history_edited``: the messages do not extend the previous
    turn's (edited, reset). ``facts`` are the table's facts; ``extra`` carries, when a read
    loaded KV that does not match the prompt, ``invalid_tokens`` and ``invalid_kind``
    (:mod:`kvscope.reuse.validity`).
    """
    facts = turn_facts(turn_index, reusable_tokens, result, router_lookup=router_lookup,
                       decode_returned_params=decode_returned_params,
                       router_entry_age_s=router_entry_age_s, history_edited=history_edited,
                       reuse_guard=reuse_guard)
    outcome, evidence = decisions.decide(facts)
    if turn_index <= 1:
        accounting = TurnAccounting(0, 0, 0, 0, outcome, evidence)
    else:
        accounting = TurnAccounting(
            facts["reusable"], facts["local"], facts["remote"],
            facts["reusable"] - facts["local"] - facts["remote"], outcome, evidence)
    accounting.facts = facts
    if facts.get("invalid_tokens"):
        accounting.extra = {"invalid_tokens": facts["invalid_tokens"],
                            "invalid_kind": facts["invalid_kind"]}
    return accounting


def turn_facts(
    turn_index: int,
    reusable_tokens: int,
    result: PrefillResult | None,
    *,
    router_lookup: str | None = semconv.ROUTER_HIT,
    decode_returned_params: bool = True,
    router_entry_age_s: float | None = None,
    history_edited: bool = False,
    reuse_guard: str | None = None,
) -> dict[str, Any]:
    """What happened to one turn, as the decision table's facts (the emulator knows them all)."""
    facts: dict[str, Any] = {
        "turn_index": turn_index, "router_lookup": router_lookup,
        "router_entry_age_s": router_entry_age_s, "reuse_guard": reuse_guard,
        "client_only": False,
        "prev_params": decisions.PREV_RETURNED if decode_returned_params else decisions.PREV_NONE,
        "engine_seen": result is not None,
    }
    if turn_index <= 1:
        return facts | {"history": decisions.HISTORY_FIRST}
    reusable = max(reusable_tokens, 0)
    facts["history"] = decisions.HISTORY_EDITED if history_edited else (
        decisions.HISTORY_CONTINUES)
    facts["common_prefix"] = reusable
    ran = result is not None and not (result.errored or result.stalled)
    invalid, kind, loaded = 0, None, 0
    if ran and result is not None and result.transfer is not None and result.transfer.tokens:
        decision = result.decision
        loaded = result.transfer.tokens
        invalid, kind = invalid_tokens(
            decision.local_hit_tokens, loaded, decision.remote_offered_tokens, reusable,
            decision.block_size, after_release=result.transfer.stale_handle,
        )
    local = remote = 0
    if ran and result is not None:
        local = min(result.local_hit_tokens, reusable)
        if result.remote_reused_tokens and kind in (None, INVALID_BEYOND_PREFIX):
            reach = result.local_hit_tokens + result.remote_reused_tokens
            remote = max(min(reach, reusable) - local, 0)
    facts |= {"reusable": reusable, "local": local, "remote": remote,
              "reused": local + remote, "loaded": loaded,
              "invalid_kind": kind if invalid > 0 else None, "invalid_tokens": invalid}
    if result is None:
        facts["coverable"] = reusable
        return facts
    decision = result.decision
    transfer = result.transfer
    offered = decision.remote_offered_tokens
    facts |= {
        "decision": decision.decision, "bidir": decision.bidirectional_kv_xfer,
        "offered": offered, "below_count": decision.count, "threshold": decision.threshold,
        "prompt_tokens": decision.prompt_tokens, "rescheduled": result.preempted,
        "read_status": (transfer.status if transfer is not None and result.load_failed
                        else semconv.TRANSFER_OK if transfer is not None else None),
        "load_errored": result.load_failed and result.errored,
        "load_reissued": result.load_failed and result.stalled,
        "coverable": decisions.coverable(reusable, offered, local),
    }
    return facts


__all__ = ["DecodeNode", "Fabric", "Faults", "NO_FAULTS", "NodeConfig", "PrefillNode",
    "PrefillResult", "PrefixCache", "ReadReply", "Retention", "ReuseDecision", "TransferRecord",
    "TurnAccounting", "account_turn", "kv_transfer_params", "turn_facts", "vllm_request_id"]
