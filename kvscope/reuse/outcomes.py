"""The closed list of per-turn reuse outcomes (DESIGN §5), their decision order and evidence.

Exactly one per turn. The emulator's ground truth
(:func:`kvscope.emulator.ground_truth.account_turn`) and the ledger
(:func:`kvscope.analysis.ledger._label`) decide in this order, with the evidence templates
below (``{}`` placeholders: ``str.format`` in the model, ``pl.format`` in the ledger).

Definitions (turn k ≥ 2 of one conversation; docs/architecture.md, "One vocabulary"): turn k's
*previous turn* is turn k-1 under the same conversation id, whatever its prompt; ``reusable`` =
tokens of the common prefix of turn k's prompt with turn k-1's prompt + output whose KV decode
holds; ``local`` = P's prefix-cache hit inside the reusable span; ``remote`` = tokens pulled D→P
by a finished, valid read, inside the reusable span; ``recomputed`` = reusable − local − remote
(≥ 0); ``offered`` = D's ``remote_num_tokens``; ``invalid`` = tokens a read loaded that do not
belong to their position of the prompt (:mod:`kvscope.reuse.validity`). The first rule that
holds wins:

1. ``first_turn``: turn 1.
2. ``reused_invalid``: a D→P read loaded KV that does not match the prompt — past the common
   prefix (edited history), misaligned (a prompt shorter than decode's sequence), or after
   decode released the blocks (a read racing the TTL reaper). A correctness alarm, ahead of
   everything else.
3. ``prefix_diverged``: the history was edited since turn k-1 (message-boundary hashes, or no
   common prefix while D offered) and nothing invalid was loaded (with no offer and
   reusable == 0: ``unknown``).
4. Full reuse: local + remote > 0 and ≥ the coverable span (min(reusable, max(offered, local))
   when D offered, else reusable): ``reused_remote`` when remote > 0, else ``reused_local``.
5. Otherwise the first miss cause that applies:
   ``no_conversation_id`` (router saw no id) → ``no_decode_metadata`` (D returned no params for
   turn k-1: bidir off at D, aborted/errored turn, stream cut) → ``router_ttl_expired`` /
   ``handle_consumed`` / ``router_no_entry`` (router lookup stale / consumed / miss, or P got no
   offer) → ``invalid_params`` (offer failed the D→P key check) → ``prefill_bidir_disabled``
   (bidir off at P and the offer was not covered locally: in 0.33.0 the request stalls in
   WAITING_FOR_REMOTE_KVS, or computes without notifying D when below threshold) →
   ``below_threshold`` (0 < count < threshold after the local hit) → ``scheduler_skipped``
   (the connector accepted the pull, the scheduler allocated no external tokens:
   prompt_logprobs, hybrid partial tails) → ``preempted`` (preempted after its read; the second
   schedule cannot read again) → ``load_failed_errored`` (read failed and
   ``kv_load_failure_policy`` = ``fail``) → ``load_stalled`` (read failed, policy
   ``recompute``: the re-issued load waits in WAITING_FOR_REMOTE_KVS and never runs) →
   ``decode_ttl_expired`` / ``handshake_failed`` / ``transfer_failed`` (read declined as expired
   / handshake / READ failed, when the request then computed locally).
6. ``partial``: some reusable tokens were reused and no cause above explains the rest.
7. ``unknown``: nothing reused and no rule explains it (the evidence says which evidence was
   missing).
"""

from __future__ import annotations

FIRST_TURN = "first_turn"
REUSED_REMOTE = "reused_remote"
REUSED_LOCAL = "reused_local"
PARTIAL = "partial"
REUSED_INVALID = "reused_invalid"
NO_CONVERSATION_ID = "no_conversation_id"
ROUTER_NO_ENTRY = "router_no_entry"
ROUTER_TTL_EXPIRED = "router_ttl_expired"
HANDLE_CONSUMED = "handle_consumed"
NO_DECODE_METADATA = "no_decode_metadata"
INVALID_PARAMS = "invalid_params"
BELOW_THRESHOLD = "below_threshold"
DECODE_TTL_EXPIRED = "decode_ttl_expired"
HANDSHAKE_FAILED = "handshake_failed"
TRANSFER_FAILED = "transfer_failed"
PREFIX_DIVERGED = "prefix_diverged"
PREFILL_BIDIR_DISABLED = "prefill_bidir_disabled"
PREEMPTED = "preempted"
LOAD_FAILED_ERRORED = "load_failed_errored"
LOAD_STALLED = "load_stalled"
SCHEDULER_SKIPPED = "scheduler_skipped"
UNKNOWN = "unknown"

OUTCOMES: tuple[str, ...] = (
    FIRST_TURN,
    REUSED_REMOTE,
    REUSED_LOCAL,
    PARTIAL,
    REUSED_INVALID,
    NO_CONVERSATION_ID,
    ROUTER_NO_ENTRY,
    ROUTER_TTL_EXPIRED,
    HANDLE_CONSUMED,
    NO_DECODE_METADATA,
    INVALID_PARAMS,
    BELOW_THRESHOLD,
    DECODE_TTL_EXPIRED,
    HANDSHAKE_FAILED,
    TRANSFER_FAILED,
    PREFIX_DIVERGED,
    PREFILL_BIDIR_DISABLED,
    PREEMPTED,
    LOAD_FAILED_ERRORED,
    LOAD_STALLED,
    SCHEDULER_SKIPPED,
    UNKNOWN,
)
# Outcomes that count as reuse; every other label after turn 1 is a miss cause.
REUSE_OUTCOMES: tuple[str, ...] = (REUSED_REMOTE, REUSED_LOCAL, PARTIAL)
# Every label after turn 1 that is not a valid reuse: the alarm first, then the miss causes.
MISS_CAUSES: tuple[str, ...] = tuple(o for o in OUTCOMES if o not in REUSE_OUTCOMES + (FIRST_TURN,))

# Evidence, one template per rule ("{}" placeholders, filled in order).
EVIDENCE_FIRST_TURN = "turn 1"
EVIDENCE_INVALID = {
    "beyond_prefix": "loaded {} tokens of decode's KV, {} past the prompt's common prefix ({})",
    "misaligned": "loaded {} tokens of decode's KV, misaligned: decode's sequence ({}) is "
                  "longer than the prompt ({}), the read takes decode's last blocks",
    "after_release": "loaded {} tokens of decode's KV after decode released the blocks",
    "edited": "loaded {} tokens of decode's KV although the history was edited since the "
              "previous turn (message-boundary hashes)",
    "tokens_differ": "loaded {} tokens of decode's KV, but the prompt's tokens are not those "
                     "decode holds KV for (the engines' token hashes)",
    "tainted": "read {} tokens through {}, KV computed from an invalid load (request {})",
}
EVIDENCE_EDITED = "history edited since the previous turn"
EVIDENCE_NO_COMMON_PREFIX = "no common prefix with the previous turn"
EVIDENCE_REUSED_REMOTE = "pulled {}, local {}"
EVIDENCE_REUSED_LOCAL = "local hit {}"
EVIDENCE_NO_CONVERSATION_ID = "request had no conversation id"
EVIDENCE_NO_DECODE_METADATA = "previous turn: decode returned no params"
EVIDENCE_INVALID_PARAMS = "offer failed the D->P key check"
EVIDENCE_NO_OFFER = "prefill got no offer"
EVIDENCE_BIDIR_OFF = "bidirectional_kv_xfer off at prefill"
EVIDENCE_BELOW_THRESHOLD = "{} < {}"
EVIDENCE_SCHEDULER_SKIPPED = "connector accepted the pull; the scheduler allocated no external " \
    "tokens (prompt_logprobs or a hybrid partial tail)"
EVIDENCE_PREEMPTED = "rescheduled after its read"
EVIDENCE_LOAD_FAILED = "read {}, policy fail"
EVIDENCE_LOAD_STALLED = "read {}, policy recompute: the re-issued load stalls"
EVIDENCE_DECLINED = "read declined as expired"
EVIDENCE_HANDSHAKE = "handshake to decode failed"
EVIDENCE_TRANSFER = "NIXL READ failed"
EVIDENCE_PARTIAL = "reused {} of {}"
# A turn only its client recorded (kvscope ingest): no span of the proxy or the engines says why.
EVIDENCE_CLIENT_ONLY = ("client-side record only: router lookup, decode's params, reuse "
                        "decision and transfers not measured")
EVIDENCE_UNEXPLAINED = "no rule explains the miss"

# Engine spans alone (no proxy span names the request): what needs the conversation is unknown.
EVIDENCE_ENGINE_ONLY_NO_DECISION = "engine spans only, and no reuse decision among them"
EVIDENCE_ENGINE_ONLY_NO_OFFER = (
    "engine spans only: prefill was offered no decode KV; whether an earlier turn left any "
    "needs the conversation, which only a proxy span records")
# The hooks kvscope could not install in this vLLM ({}: their names).
EVIDENCE_HOOKS_MISSING = "kvscope's hooks {} not installed in this vLLM"


__all__ = ["BELOW_THRESHOLD", "DECODE_TTL_EXPIRED", "EVIDENCE_BELOW_THRESHOLD",
    "EVIDENCE_BIDIR_OFF", "EVIDENCE_CLIENT_ONLY", "EVIDENCE_DECLINED", "EVIDENCE_EDITED",
    "EVIDENCE_ENGINE_ONLY_NO_DECISION", "EVIDENCE_ENGINE_ONLY_NO_OFFER", "EVIDENCE_FIRST_TURN",
    "EVIDENCE_HANDSHAKE", "EVIDENCE_HOOKS_MISSING", "EVIDENCE_INVALID", "EVIDENCE_INVALID_PARAMS",
    "EVIDENCE_LOAD_FAILED", "EVIDENCE_LOAD_STALLED", "EVIDENCE_NO_COMMON_PREFIX",
    "EVIDENCE_NO_CONVERSATION_ID", "EVIDENCE_NO_DECODE_METADATA", "EVIDENCE_NO_OFFER",
    "EVIDENCE_PARTIAL", "EVIDENCE_PREEMPTED", "EVIDENCE_REUSED_LOCAL", "EVIDENCE_REUSED_REMOTE",
    "EVIDENCE_SCHEDULER_SKIPPED", "EVIDENCE_TRANSFER", "EVIDENCE_UNEXPLAINED", "FIRST_TURN",
    "HANDLE_CONSUMED", "HANDSHAKE_FAILED", "INVALID_PARAMS", "LOAD_FAILED_ERRORED", "LOAD_STALLED",
    "MISS_CAUSES", "NO_CONVERSATION_ID", "NO_DECODE_METADATA", "OUTCOMES", "PARTIAL", "PREEMPTED",
    "PREFILL_BIDIR_DISABLED", "PREFIX_DIVERGED", "REUSED_INVALID", "REUSED_LOCAL", "REUSED_REMOTE",
    "REUSE_OUTCOMES", "ROUTER_NO_ENTRY", "ROUTER_TTL_EXPIRED", "SCHEDULER_SKIPPED",
    "TRANSFER_FAILED", "UNKNOWN"]
