"""The closed list of per-turn reuse outcomes (DESIGN §5) and how the emulator decides each.

Plain strings so analysis code can import them without the emulator. Exactly one per turn.

Definitions (turn k ≥ 2 of one conversation): ``reusable`` = tokens of the common prefix of turn
k's prompt with turn k-1's prompt + output (the caller computes it from tokens, or by
construction in the simulator); ``local`` = P's prefix-cache hit that falls inside the reusable
span; ``remote`` = tokens pulled D→P by a finished, valid read; ``recomputed`` =
reusable − local − remote. The emulator decides in this order; the first rule that holds wins:

1. ``first_turn``: turn 1 (nothing earlier to reuse).
2. ``no_conversation_id``: the client sent no conversation id, so the router kept nothing.
3. ``router_no_entry``: the router had no entry (first lookup after a restart, or D never
   returned params for the previous turn while the router was not told why).
4. ``router_ttl_expired``: the router's entry was older than its own TTL (450 s in vLLM's proxy).
5. ``handle_consumed``: the entry was already popped by an overlapping turn (single use).
6. ``no_decode_metadata``: D returned no ``kv_transfer_params`` for turn k-1 (bidir off at D,
   turn aborted/errored, stream cut before the final chunk).
7. ``invalid_params``: P got params that fail the D→P key check (missing or falsy
   ``remote_block_ids``, or a missing engine/request/host/port key).
8. ``prefill_bidir_disabled``: bidir off at P while D offered; in 0.33.0 P still answers
   (count, async) and parks the request in WAITING_FOR_REMOTE_KVS without registering a read
   (the turn stalls), or, below threshold / covered locally, computes without notifying D.
9. ``preempted``: P was preempted after its read; the second schedule cannot read again.
10. ``load_failed_errored``: a read failed (declined as expired, handshake or transfer failure)
    and ``kv_load_failure_policy`` = ``fail`` ended the turn with an error.
11. ``decode_ttl_expired``: P's worker declined the read (``now_P + 5 >= expiry - offset``), or
    D had already reaped the handle when the read came (stale read), policy ``recompute``.
12. ``handshake_failed`` / ``transfer_failed``: the read failed for that reason, policy
    ``recompute``.
13. ``prefix_diverged``: D's offer reaches past the reusable span (history edited by the
    client): P pulled KV that does not match its prompt, so only ``reusable`` tokens count.
14. ``below_threshold``: the remainder after P's local hit was ``0 < count < threshold``.
15. ``reused_remote``: remote > 0 and local + remote == reusable, or remote > 0 with local > 0.
    (Remote pull that leaves reusable tokens recomputed is ``partial``.)
16. ``reused_local``: remote == 0 and local == reusable > 0 (P's prefix cache covered it).
17. ``partial``: some but not all reusable tokens were reused for none of the reasons above
    (e.g. the offer stopped short of the reusable span: D counts prompt + output − 1).
18. ``unknown``: reusable > 0, nothing reused and no rule above explains it (the ledger adds
    which evidence was missing). With reusable == 0 and k ≥ 2 the emulator also says
    ``prefix_diverged`` when D offered, else ``unknown``.
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
