"""Every decision branch of the reuse model, and properties of its token accounting."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope import semconv
from kvscope.emulator.ground_truth import account_turn
from kvscope.emulator.reuse_model import (
    DecodeNode,
    Fabric,
    Faults,
    NodeConfig,
    PrefillNode,
    PrefixCache,
)
from kvscope.emulator.tokens import BlockSeq
from kvscope.reuse import outcomes
from kvscope.reuse.params import (
    D_TO_P_REQUIRED_KEYS,
    PARAMS_FIELDS,
    SCHEDULING_SYNC,
    STATUS_ABORTED,
    STATUS_ERROR,
    STATUS_LENGTH_CAPPED,
    STATUS_STOPPED,
)
from kvscope.reuse.router import MISS_PARAMS

BS = 16
TTL = 480.0


def seq(n: int, salt: int = 0) -> BlockSeq:
    """A sequence of ``n`` distinct tokens; equal salts share prefixes."""
    return BlockSeq.from_tokens([salt * 1_000_003 + i for i in range(n)], BS)


def deployment(
    *,
    p_bidir: bool = True,
    d_bidir: bool = True,
    threshold: int = 64,
    policy: str = "fail",
    p_caching: bool = False,
    p_offset: float = 0.0,
    d_offset: float = 0.0,
    stall: bool = True,
    scheduling: str = SCHEDULING_SYNC,
) -> tuple[PrefillNode, DecodeNode]:
    """One P and one D; synchronous scheduling unless asked (D offers prompt + output − 1)."""
    fabric = Fabric()
    d = DecodeNode(
        NodeConfig(
            "decode-0",
            side_channel_port=5601,
            bidirectional_kv_xfer=d_bidir,
            decoder_kv_blocks_ttl=TTL,
            kv_bytes_per_token=100,
            clock_offset_s=d_offset,
            scheduling=scheduling,
        )
    )
    fabric.register(d)
    p = PrefillNode(
        NodeConfig(
            "prefill-0",
            bidirectional_kv_xfer=p_bidir,
            kv_recompute_threshold=threshold,
            kv_load_failure_policy=policy,
            enable_prefix_caching=p_caching,
            kv_bytes_per_token=100,
            clock_offset_s=p_offset,
            stall_on_reissued_load=stall,
        ),
        fabric,
    )
    return p, d


def finished_turn(d: DecodeNode, n_tokens: int, now: float = 0.0, rid: str = "d-1") -> dict:
    _, params = d.finish_request(rid, seq(n_tokens), STATUS_STOPPED, now)
    assert params is not None
    return params


# --- decode retention and params ------------------------------------------------------------


def test_decode_params_have_exactly_the_0_33_0_field_set() -> None:
    _, d = deployment(d_offset=1000.0)
    retention, params = d.finish_request("d-1", seq(1000), STATUS_STOPPED, now=5.0)
    assert retention is not None and params is not None
    assert set(params) == set(PARAMS_FIELDS)
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_num_tokens"] == 999  # prompt + output - 1
    assert params["remote_blocks_expiry_time"] == pytest.approx(1005.0 + TTL)  # D's clock
    assert params["remote_block_ids"] == [list(range(63))]  # ceil(999 / 16), one KV group
    assert params["transfer_mode"] == "pull"
    assert retention.bytes == 63 * BS * 100


@pytest.mark.parametrize("status", [STATUS_ABORTED, STATUS_ERROR])
def test_aborted_or_errored_decode_retains_nothing(status: str) -> None:
    _, d = deployment()
    assert d.finish_request("d-1", seq(500), status, 0.0) == (None, None)
    assert d.retained_bytes(0.0) == 0


def test_decode_with_bidir_off_returns_no_params() -> None:
    _, d = deployment(d_bidir=False)
    assert d.finish_request("d-1", seq(500), STATUS_LENGTH_CAPPED, 0.0) == (None, None)


def test_prefill_params_for_decode() -> None:
    p, _ = deployment()
    params = p.finish_request("p-1", seq(100), cached_tokens=32)
    assert set(params) == set(PARAMS_FIELDS) | {"remote_prefill_cached_tokens"}
    assert params["do_remote_prefill"] is True and params["remote_blocks_expiry_time"] is None


def test_ttl_reaper_releases_at_expiry_and_is_not_renewed() -> None:
    _, d = deployment()
    finished_turn(d, 500, now=10.0)
    assert d.retained_bytes(10.0 + TTL - 0.001) > 0
    (reaped,) = d.reap(10.0 + TTL)
    assert reaped.release_reason == semconv.RELEASE_EXPIRED and reaped.held_s == TTL
    assert d.retained_bytes(10.0 + TTL) == 0


# --- prefill decision branches --------------------------------------------------------------


def test_pull_reads_and_releases_the_handle_once() -> None:
    p, d = deployment()
    params = finished_turn(d, 1000)
    result = p.prefill("p-2", seq(1150), params, now=30.0)
    assert result.decision.decision == semconv.DECISION_PULL
    assert result.remote_reused_tokens == 999
    assert result.transfer is not None and result.transfer.status == semconv.TRANSFER_OK
    assert result.transfer.blocks == 63 and result.transfer.bytes == 63 * BS * 100
    assert result.computed_tokens == 1150 - 999
    assert d.released[-1].release_reason == semconv.RELEASE_READ
    # Single use: the same params again find no handle (a stale read of freed blocks).
    again = p.prefill("p-3", seq(1150), params, now=31.0)
    assert again.transfer is not None and again.transfer.stale_handle
    stale = account_turn(2, 1000, again)
    assert stale.outcome == outcomes.REUSED_INVALID and stale.remote_reused_tokens == 0
    assert stale.extra == {"invalid_tokens": 999, "invalid_kind": "after_release"}


@pytest.mark.parametrize(
    ("remote_tokens", "decision"),
    [(63, semconv.DECISION_BELOW_THRESHOLD), (64, semconv.DECISION_PULL)],
)
def test_threshold_edges(remote_tokens: int, decision: str) -> None:
    p, d = deployment(threshold=64)
    params = finished_turn(d, remote_tokens + 1)
    result = p.prefill("p-2", seq(remote_tokens + 100), params, now=1.0)
    assert result.decision.decision == decision
    if decision == semconv.DECISION_BELOW_THRESHOLD:
        assert result.decision.notify_only and result.remote_reused_tokens == 0
        assert d.released[-1].release_reason == semconv.RELEASE_NOTIFIED
        assert account_turn(2, remote_tokens + 1, result).outcome == outcomes.BELOW_THRESHOLD
    else:
        assert result.remote_reused_tokens == 64


def test_threshold_zero_pulls_a_single_token() -> None:
    p, d = deployment(threshold=0)
    result = p.prefill("p-2", seq(50), finished_turn(d, 2), now=1.0)
    assert result.decision.decision == semconv.DECISION_PULL and result.remote_reused_tokens == 1


def test_local_hit_covers_offer_notifies_decode() -> None:
    p, d = deployment(p_caching=True)
    p.prefill("p-1", seq(1000), None, now=0.0)  # P computed the prefix itself
    params = finished_turn(d, 900)
    result = p.prefill("p-2", seq(1100), params, now=1.0)
    assert result.decision.decision == semconv.DECISION_LOCAL_COVERS
    assert result.local_hit_tokens == 992  # 62 full blocks of the 999-token limit
    assert d.released[-1].release_reason == semconv.RELEASE_NOTIFIED
    assert account_turn(2, 900, result).outcome == outcomes.REUSED_LOCAL


def test_local_hit_subtracted_before_threshold() -> None:
    p, d = deployment(p_caching=True)
    p.prefill("p-1", seq(1000), None, now=0.0)
    params = finished_turn(d, 1050)  # offers 1049; local hit 992 → count 57 < 64
    result = p.prefill("p-2", seq(1200), params, now=1.0)
    assert result.decision.count == 57
    assert result.decision.decision == semconv.DECISION_BELOW_THRESHOLD


@pytest.mark.parametrize("missing", D_TO_P_REQUIRED_KEYS)
def test_missing_required_key_is_invalid(missing: str) -> None:
    p, d = deployment()
    params = finished_turn(d, 1000)
    del params[missing]
    result = p.prefill("p-2", seq(1100), params, now=1.0)
    assert result.decision.decision == semconv.DECISION_INVALID_PARAMS
    assert not result.decision.read_registered and result.remote_reused_tokens == 0
    assert account_turn(2, 1000, result).outcome == outcomes.INVALID_PARAMS


def test_falsy_block_ids_with_offer_is_invalid_and_router_miss_is_no_offer() -> None:
    p, d = deployment()
    params = finished_turn(d, 1000)
    params["remote_block_ids"] = []
    assert p.decide("a", seq(1100), params).decision == semconv.DECISION_INVALID_PARAMS
    assert p.decide("b", seq(1100), dict(MISS_PARAMS)).decision == semconv.DECISION_NO_OFFER


def test_present_but_none_host_passes_the_check_then_fails_handshake() -> None:
    p, d = deployment()
    params = finished_turn(d, 1000)
    params["remote_host"] = None
    result = p.prefill("p-2", seq(1100), params, now=1.0)
    assert result.decision.decision == semconv.DECISION_PULL
    assert result.transfer is not None
    assert result.transfer.status == semconv.TRANSFER_HANDSHAKE_FAILED


def test_bidir_off_at_prefill_stalls_and_decode_keeps_blocks_until_ttl() -> None:
    p, d = deployment(p_bidir=False)
    result = p.prefill("p-2", seq(1100), finished_turn(d, 1000), now=1.0)
    assert result.decision.load_async and not result.decision.read_registered
    assert result.stalled and result.computed_tokens == 0
    assert account_turn(2, 1000, result).outcome == outcomes.PREFILL_BIDIR_DISABLED
    assert d.retained_bytes(TTL - 1) > 0
    assert d.reap(TTL)[0].release_reason == semconv.RELEASE_EXPIRED


def test_bidir_off_at_prefill_below_threshold_computes_without_notifying() -> None:
    p, d = deployment(p_bidir=False)
    result = p.prefill("p-2", seq(100), finished_turn(d, 11), now=1.0)
    assert not result.stalled and result.computed_tokens == 100
    assert d.handles  # not notified


# --- expiry guard, faults and policies -------------------------------------------------------


@pytest.mark.parametrize(
    ("read_at", "offset_error", "declined"),
    [
        (TTL - 5.0 - 0.01, 0.0, False),  # just inside the 5 s margin
        (TTL - 5.0, 0.0, True),  # exactly at the margin: declined (>=)
        (TTL - 10.0, 0.0, False),
        (TTL - 10.0, 6.0, True),  # P thinks D's clock is 6 s further ahead: deadline looks sooner
        (TTL - 5.0 - 0.01, -1.0, False),  # P thinks D is less ahead: deadline looks later
    ],
)
def test_expiry_guard_with_clock_offsets(
    read_at: float, offset_error: float, declined: bool
) -> None:
    p, d = deployment(p_offset=-3.0, d_offset=1234.5)
    params = finished_turn(d, 1000, now=0.0)
    result = p.prefill("p-2", seq(1100), params, read_at, Faults(clock_offset_error_s=offset_error))
    assert result.transfer is not None
    status = semconv.TRANSFER_DECLINED_EXPIRED if declined else semconv.TRANSFER_OK
    assert result.transfer.status == status
    if declined:
        assert result.errored and account_turn(2, 1000, result).outcome == (
            outcomes.LOAD_FAILED_ERRORED
        )
        assert d.handles  # a decline neither reads nor notifies


def test_expired_read_with_recompute_policy_and_no_stall() -> None:
    p, d = deployment(policy="recompute", stall=False)
    params = finished_turn(d, 1000)
    result = p.prefill("p-2", seq(1100), params, now=TTL)
    assert result.load_failed and not result.errored and not result.stalled
    assert result.computed_tokens == 1100
    assert account_turn(2, 1000, result).outcome == outcomes.DECODE_TTL_EXPIRED


def test_recompute_policy_reissued_load_stalls_by_default() -> None:
    p, d = deployment(policy="recompute")
    result = p.prefill("p-2", seq(1100), finished_turn(d, 1000), now=TTL)
    assert result.rescheduled_decision is not None
    assert result.rescheduled_decision.load_async and result.stalled


@pytest.mark.parametrize(
    ("faults", "outcome_fail", "outcome_recompute"),
    [
        (Faults(handshake_fails=True), outcomes.LOAD_FAILED_ERRORED, outcomes.HANDSHAKE_FAILED),
        (Faults(transfer_fails=True), outcomes.LOAD_FAILED_ERRORED, outcomes.TRANSFER_FAILED),
    ],
)
def test_failures_under_both_policies(
    faults: Faults, outcome_fail: str, outcome_recompute: str
) -> None:
    for policy, expected in (("fail", outcome_fail), ("recompute", outcome_recompute)):
        p, d = deployment(policy=policy, stall=False)
        result = p.prefill("p-2", seq(1100), finished_turn(d, 1000), now=1.0, faults=faults)
        assert result.remote_reused_tokens == 0
        assert result.errored is (policy == "fail")
        assert account_turn(2, 1000, result).outcome == expected


def test_preemption_after_read_cannot_read_again() -> None:
    p, d = deployment(stall=False)
    result = p.prefill(
        "p-2", seq(1100), finished_turn(d, 1000), 1.0, Faults(preempt_after_read=True)
    )
    assert result.preempted and result.transfer is not None
    assert result.rescheduled_decision is not None
    assert not result.rescheduled_decision.read_registered
    assert result.remote_reused_tokens == 0 and result.computed_tokens == 1100
    assert account_turn(2, 1000, result).outcome == outcomes.PREEMPTED


def test_preemption_with_prefix_caching_reuses_the_pulled_blocks_locally() -> None:
    p, d = deployment(p_caching=True)
    result = p.prefill(
        "p-2", seq(1100), finished_turn(d, 1000), 1.0, Faults(preempt_after_read=True)
    )
    assert result.rescheduled_decision is not None
    # The 62 full pulled blocks were cached; the 7-token remainder is below threshold.
    assert result.rescheduled_decision.decision == semconv.DECISION_BELOW_THRESHOLD
    assert not result.stalled and result.local_hit_tokens == 992


@pytest.mark.parametrize(("prompt", "reusable", "invalid", "kind", "reused", "recomputed"), [
    # Edited history: decode's tokens past the edit land in the prompt's positions; the valid
    # part is still reuse (the first 400 tokens matched).
    pytest.param(1100, 400, 599, "beyond_prefix", 400, 0, id="past-the-common-prefix"),
    # Truncated history: the end-trimmed block list puts decode's tail (D offers 999 tokens:
    # 63 blocks) at the start of a prompt of 19 blocks.
    pytest.param(300, 300, 300, "misaligned", 0, 300, id="prompt-shorter-than-decode"),
])
def test_a_read_of_decode_s_blocks_into_the_wrong_positions_is_invalid_reuse(
        prompt: int, reusable: int, invalid: int, kind: str, reused: int,
        recomputed: int) -> None:
    p, d = deployment()
    result = p.prefill("p-2", seq(prompt), finished_turn(d, 1000), now=1.0)
    assert result.decision.decision == semconv.DECISION_PULL and result.transfer is not None
    accounting = account_turn(2, reusable, result)
    assert accounting.outcome == outcomes.REUSED_INVALID
    assert accounting.extra == {"invalid_tokens": invalid, "invalid_kind": kind}
    assert accounting.remote_reused_tokens == reused
    assert accounting.recomputed_reusable_tokens == recomputed


def test_a_whole_valid_read_is_reused_remote_not_invalid() -> None:
    p, d = deployment()
    result = p.prefill("p-2", seq(1100), finished_turn(d, 1000), now=1.0)
    accounting = account_turn(2, 999, result)
    assert accounting.outcome == outcomes.REUSED_REMOTE and accounting.extra == {}


@pytest.mark.parametrize(("scheduling", "status", "offered"), [
    (SCHEDULING_SYNC, STATUS_STOPPED, 999), (SCHEDULING_SYNC, STATUS_LENGTH_CAPPED, 999),
    ("async", STATUS_STOPPED, 1000), ("async", STATUS_LENGTH_CAPPED, 999),
])
def test_decode_offers_what_its_scheduler_computed(scheduling: str, status: str,
                                                   offered: int) -> None:
    """The measured table of tests/vllm_contract/test_real_scheduler_claims.py."""
    _, d = deployment(scheduling=scheduling)
    _, params = d.finish_request("d-1", seq(1000), status, 0.0)
    assert params is not None and params["remote_num_tokens"] == offered


def test_notify_only_with_a_failed_handshake_is_dropped() -> None:
    """Below threshold, the handshake fails: vLLM drops it; the turn runs, D is not told."""
    p, d = deployment(threshold=2000)
    params = finished_turn(d, 1000)
    result = p.prefill("p-2", seq(1100), params, now=1.0, faults=Faults(handshake_fails=True))
    assert result.decision.notify_only and result.transfer is None
    assert not (result.errored or result.load_failed) and result.computed_tokens == 1100
    assert d.handles  # still pinned: the reaper frees it at the TTL
    assert account_turn(2, 999, result).outcome == outcomes.BELOW_THRESHOLD


def test_a_reissued_load_is_its_own_decision_and_stalls() -> None:
    """Policy recompute: the second schedule registers no read (_remote_blocks_processed)."""
    p, d = deployment(policy="recompute")
    result = p.prefill("p-2", seq(1100), finished_turn(d, 1000), now=1.0,
                       faults=Faults(transfer_fails=True))
    assert result.rescheduled_decision is not None
    assert result.rescheduled_decision.decision == semconv.DECISION_REISSUED
    assert result.stalled and not result.errored
    assert account_turn(2, 999, result).outcome == outcomes.LOAD_STALLED


def test_router_and_decode_causes() -> None:
    p, _ = deployment()
    result = p.prefill("p-2", seq(1100), None, now=1.0)
    assert account_turn(1, 0, result).outcome == outcomes.FIRST_TURN
    for lookup, outcome in (
        (semconv.ROUTER_MISS, outcomes.ROUTER_NO_ENTRY),
        (semconv.ROUTER_STALE, outcomes.ROUTER_TTL_EXPIRED),
        (semconv.ROUTER_CONSUMED, outcomes.HANDLE_CONSUMED),
        (semconv.ROUTER_NO_CONVERSATION_ID, outcomes.NO_CONVERSATION_ID),
    ):
        assert account_turn(2, 1000, result, router_lookup=lookup).outcome == outcome
    acc = account_turn(
        2, 1000, result, router_lookup=semconv.ROUTER_MISS, decode_returned_params=False
    )
    assert acc.outcome == outcomes.NO_DECODE_METADATA and acc.recomputed_reusable_tokens == 1000


# --- prefix cache ---------------------------------------------------------------------------


def test_prefix_cache_never_counts_the_last_prompt_token() -> None:
    cache = PrefixCache(100)
    full = seq(64)
    cache.touch(full)
    assert cache.longest_hit_blocks(full) == 3  # 63 tokens → 3 full blocks
    assert cache.longest_hit_blocks(seq(65)) == 4


def test_lru_eviction_under_capacity_pressure() -> None:
    cache = PrefixCache(8)
    a, b = seq(64, salt=1), seq(64, salt=2)
    cache.touch(a)
    cache.touch(b)
    assert len(cache) == 8 and cache.evicted_blocks == 0
    cache.touch(a)  # a becomes most recent
    cache.touch(seq(33, salt=3))  # 2 new blocks evict b's tail first
    assert cache.evicted_blocks == 2
    assert cache.longest_hit_blocks(seq(65, salt=1)) == 4
    assert cache.longest_hit_blocks(seq(65, salt=2)) == 2  # prefix kept, tail gone


# --- properties -----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    prev=st.integers(2, 3000),
    new=st.integers(0, 500),
    reusable_cut=st.integers(0, 3500),
    threshold=st.sampled_from([0, 1, 64, 256]),
    cached=st.integers(0, 3000),
    read_at=st.floats(0.0, 600.0),
    p_bidir=st.booleans(),
    policy=st.sampled_from(["fail", "recompute"]),
    handshake=st.booleans(),
    transfer=st.booleans(),
    preempt=st.booleans(),
)
def test_token_split_sums_and_pull_bounds(
    prev: int,
    new: int,
    reusable_cut: int,
    threshold: int,
    cached: int,
    read_at: float,
    p_bidir: bool,
    policy: str,
    handshake: bool,
    transfer: bool,
    preempt: bool,
) -> None:
    p, d = deployment(p_bidir=p_bidir, threshold=threshold, policy=policy, p_caching=True)
    prompt = seq(prev + new)
    if cached:
        p.prefill("warm", seq(min(cached, prev + new)), None, now=0.0)
    params = finished_turn(d, prev)
    faults = Faults(handshake_fails=handshake, transfer_fails=transfer, preempt_after_read=preempt)
    result = p.prefill("p-2", prompt, params, read_at, faults)
    reusable = min(reusable_cut, prev)
    acc = account_turn(2, reusable, result)
    assert acc.local_hit_tokens + acc.remote_reused_tokens + acc.recomputed_reusable_tokens == (
        acc.reusable_tokens
    )
    assert acc.recomputed_reusable_tokens >= 0
    assert result.decision.tokens_to_pull <= result.decision.remote_offered_tokens
    assert result.remote_reused_tokens <= result.decision.tokens_to_pull
    assert acc.outcome in outcomes.OUTCOMES
    if not (result.errored or result.stalled):
        assert result.computed_tokens >= 1 or prompt.num_tokens == 0


@settings(max_examples=50, deadline=None)
@given(n=st.integers(2, 2000), new=st.integers(0, 300), t=st.floats(0, 1000))
def test_deterministic(n: int, new: int, t: float) -> None:
    runs = []
    for _ in range(2):
        p, d = deployment()
        result = p.prefill("p-2", seq(n + new), finished_turn(d, n), now=t)
        runs.append((dataclasses.asdict(result), account_turn(2, n, result)))
    assert runs[0] == runs[1]


def test_prompt_logprobs_turn_a_pull_into_notify_only() -> None:
    """skip_reading_prefix_cache: no local hit is read, the accepted pull becomes notify-only
    (the real scheduler's override: tests/vllm_contract/test_real_scheduler_claims.py)."""
    p, d = deployment(p_caching=True)
    result = p.prefill("p-2", seq(1100), finished_turn(d, 1000), now=1.0,
                       skip_reading_prefix_cache=True)
    decision = result.decision
    assert decision.decision == semconv.DECISION_SCHEDULER_SKIPPED and decision.notify_only
    assert decision.tokens_to_pull == 0 and result.transfer is None
    assert d.released[-1].release_reason == semconv.RELEASE_NOTIFIED
    assert account_turn(2, 999, result).outcome == outcomes.SCHEDULER_SKIPPED


def test_a_decode_finishing_with_no_blocks_returns_params_with_empty_block_ids() -> None:
    """pull_scheduler.py request_finished with no blocks: ``(False, params)``, empty block ids,
    ``remote_num_tokens`` 0, no expiry. Nothing is retained, and prefill's offer check fails."""
    _, d = deployment(scheduling=SCHEDULING_SYNC)
    retention, params = d.finish_request("d-1", seq(1), STATUS_STOPPED, now=1.0)
    assert retention is None and params is not None
    assert params["remote_block_ids"] == [[]] and params["remote_num_tokens"] == 0
    assert params["remote_blocks_expiry_time"] is None and params["do_remote_decode"] is True
    assert list(params) == list(PARAMS_FIELDS)


def test_cached_tokens_are_vllms_local_plus_external_at_the_first_schedule() -> None:
    """PrefillStats.set (scheduler.py): num_cached_tokens = local hit + external tokens when the
    request is first scheduled, whether or not the read then succeeds. Simulator and HTTP
    emulator both report this count (P's usage; D's via remote_prefill_cached_tokens)."""
    p, d = deployment()
    params = finished_turn(d, 1000)
    pulled = p.prefill("p-2", seq(1150), params, now=30.0)
    assert pulled.cached_tokens == pulled.decision.tokens_to_pull == 999
    # Single use: the same params again read freed blocks; vLLM still counted them cached.
    stale = p.prefill("p-3", seq(1150), params, now=31.0)
    assert stale.transfer is not None and stale.transfer.stale_handle
    assert stale.remote_reused_tokens == 0 and stale.cached_tokens == 999
    p, d = deployment(threshold=2000)
    below = p.prefill("p-4", seq(1150), finished_turn(d, 1000), now=32.0)
    assert below.decision.decision == semconv.DECISION_BELOW_THRESHOLD
    assert below.cached_tokens == 0


def test_potentially_invalid_kv_blocks_cases_are_counted_and_labelled() -> None:
    """Decode logs "Potentially invalid KV blocks" for any notification of an id it no longer
    tracks: a READ after release moved freed blocks (reused_invalid, after_release); a
    notify-only message after the reaper moved nothing (not invalid)."""
    p, d = deployment()
    params = finished_turn(d, 1000)
    p.prefill("p-2", seq(1150), params, now=30.0)
    stale = p.prefill("p-3", seq(1150), params, now=31.0)  # single use: the handle is gone
    assert d.notifications_after_expiry == {"read_after_release": 1, "notify_after_release": 0}
    assert account_turn(2, 1000, stale).outcome == outcomes.REUSED_INVALID
    # Prefill's own cache covers the offer: notify-only, sent after decode's reaper ran.
    p, d = deployment(p_caching=True)
    p.prefill("p-warm", seq(1150), None, now=0.0)
    params = finished_turn(d, 1000)
    late = p.prefill("p-4", seq(1150), params, now=TTL + 10)
    assert late.decision.decision == semconv.DECISION_LOCAL_COVERS and late.transfer is None
    assert d.notifications_after_expiry == {"read_after_release": 0, "notify_after_release": 1}
    accounting = account_turn(2, 999, late)
    assert accounting.outcome == outcomes.REUSED_LOCAL and not accounting.extra
