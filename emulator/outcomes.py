"""The closed list of per-turn reuse outcomes (DESIGN §5) and how the emulator decides each.

Plain strings so analysis code can import them without the emulator. Exactly one per turn.

Definitions (turn k ≥ 2 of one conversation): ``reusable`` = tokens of the common prefix of turn
k's prompt with turn k-1's prompt + output (the caller computes it from tokens, or knows it by
construction in the simulator); ``local`` = P's prefix-cache hit inside the reusable span;
``remote`` = tokens pulled D→P by a finished, valid read, inside the reusable span;
``recomputed`` = reusable − local − remote (≥ 0). ``offered`` = D's ``remote_num_tokens``.
:func:`kvscope.emulator.reuse_model.account_turn` decides in this order; the first rule that holds
wins:

1. ``first_turn``: turn 1.
2. ``prefix_diverged``: a successful read reached past the reusable span (the client edited
   the history): P holds KV that does not match its prompt. Also when reusable == 0 and D
   offered (with no offer and reusable == 0: ``unknown``).
3. Full reuse: local + remote > 0 and ≥ the coverable span (min(reusable, max(offered, local))
   when D offered, else reusable; D never offers its last output token, num_computed = prompt +
   output − 1, so that one token does not make a turn partial): ``reused_remote`` when remote
   > 0, else ``reused_local``.
4. Otherwise the first miss cause that applies:
   ``no_conversation_id`` (router saw no id) → ``no_decode_metadata`` (D returned no params for
   turn k-1: bidir off at D, aborted/errored turn, stream cut) → ``router_ttl_expired`` /
   ``handle_consumed`` / ``router_no_entry`` (router lookup stale / consumed / miss, or P got no
   offer) → ``invalid_params`` (offer failed the D→P key check) → ``prefill_bidir_disabled``
   (bidir off at P and the offer was not covered locally: in 0.33.0 the request stalls in
   WAITING_FOR_REMOTE_KVS, or computes without notifying D when below threshold) →
   ``below_threshold`` (0 < count < threshold after the local hit) → ``decode_ttl_expired``
   (the READ hit a handle D had already reaped) → ``preempted`` (preempted after its read; the
   second schedule cannot read again) → ``load_failed_errored`` (read failed and
   ``kv_load_failure_policy`` = ``fail``) → ``decode_ttl_expired`` / ``handshake_failed`` /
   ``transfer_failed`` (read declined as expired / handshake / READ failed, policy
   ``recompute``).
5. ``partial``: some reusable tokens were reused and no cause above explains the rest.
6. ``unknown``: nothing reused and no rule explains it (the ledger says which evidence was
   missing).
"""

from __future__ import annotations

FIRST_TURN = "first_turn"
REUSED_REMOTE = "reused_remote"
REUSED_LOCAL = "reused_local"
PARTIAL = "partial"
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
UNKNOWN = "unknown"

OUTCOMES: tuple[str, ...] = (
    FIRST_TURN,
    REUSED_REMOTE,
    REUSED_LOCAL,
    PARTIAL,
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
    UNKNOWN,
)
# Outcomes that count as reuse; every other label after turn 1 is a miss cause.
REUSE_OUTCOMES: tuple[str, ...] = (REUSED_REMOTE, REUSED_LOCAL, PARTIAL)
MISS_CAUSES: tuple[str, ...] = tuple(o for o in OUTCOMES if o not in REUSE_OUTCOMES + (FIRST_TURN,))
