"""A prefill engine of vLLM 0.33.0's NIXL connector with D→P readback: the scheduler's reuse
decision and the worker's read.

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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvscope import semconv
from kvscope.collector.engine_telemetry import ReuseDecisionRecord
from kvscope.emulator.reuse_model.config import NodeConfig
from kvscope.emulator.reuse_model.fabric import Fabric
from kvscope.emulator.reuse_model.params import kv_transfer_params
from kvscope.emulator.reuse_model.prefix_cache import PrefixCache
from kvscope.emulator.reuse_model.transfer import TransferRecord
from kvscope.emulator.tokens import DEFAULT_BLOCK_SIZE, Blocks
from kvscope.reuse.params import (
    FAILURE_POLICY_FAIL,
    answer_offer,
    read_declined_expired,
)


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


__all__ = ["Faults", "NO_FAULTS", "PrefillNode", "PrefillResult", "ReuseDecision"]
