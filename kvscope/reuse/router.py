"""The proxy's router semantics: decode's ``kv_transfer_params`` kept per conversation.

Semantics follow vLLM's ``disagg_proxy_multiturn.py`` (``ConversationKVCache``): ``put`` stores a
copy of decode's params with ``remote_host`` already rewritten to the decode instance's HTTP host;
``lookup`` pops the entry (single use) and discards it when older than the TTL; prefill gets the
entry's params with the direction flags rewritten, or :data:`MISS_PARAMS`. The entry is found by
conversation id alone: nothing checks that the new prompt continues the turn whose KV it names
(see :mod:`kvscope.reuse.validity`). What kvscope adds is *why* a lookup found nothing: a
tombstone per conversation remembers whether its last entry was consumed by an earlier turn or
discarded as stale, so a miss can be told apart from ``consumed`` and ``stale``. Both maps are
bounded (least recently written evicted first) so that a client minting endless conversation ids
cannot grow the proxy without limit. Pure: the clock is injected (the simulator runs it on
virtual time).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvscope import semconv

# What vLLM's proxy sends to prefill when it has no decode metadata for the conversation.
MISS_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class Lookup:
    """The result of one router lookup: a ``semconv.ROUTER_*`` value, entry age and params.

    ``history`` is the last message-boundary hash of the turn whose decode params these are,
    when the proxy recorded it, and ``reply`` that hash chained with the reply decode produced
    (for :func:`history_continues`).
    """

    result: str
    age_s: float | None = None
    params: dict[str, Any] | None = None
    history: str | None = None
    reply: str | None = None


@dataclass(slots=True)
class _Entry:
    params: dict[str, Any]
    stored_at: float
    history: str | None = None
    reply: str | None = None


class ConversationRouter:
    """Single-use, TTL-bounded cache of decode's kv_transfer_params per conversation."""

    def __init__(
        self,
        ttl_s: float,
        *,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        # In the order they were stored (put moves an entry to the end): the oldest first.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # conversation id -> (ROUTER_CONSUMED or ROUTER_STALE, when a stale entry was stored):
        # what happened to its last entry.
        self._tombstones: OrderedDict[str, tuple[str, float | None]] = OrderedDict()
        self.evicted_capacity = 0

    @property
    def size(self) -> int:
        """Conversations with an entry cached now."""
        return len(self._entries)

    def lookup(self, conversation_id: str | None) -> Lookup:
        """Take (pop) the entry for ``conversation_id``; say why when there is none to use."""
        if conversation_id is None:
            return Lookup(semconv.ROUTER_NO_CONVERSATION_ID)
        entry = self._entries.pop(conversation_id, None)
        if entry is None:
            fate = self._tombstones.get(conversation_id)
            if fate is None:
                return Lookup(semconv.ROUTER_MISS)
            why, stored_at = fate
            # A stale entry dropped before this lookup: its age as if it had waited here.
            return Lookup(why, self._clock() - stored_at if stored_at is not None else None)
        age = self._clock() - entry.stored_at
        if age > self.ttl_s:
            self._tombstone(conversation_id, semconv.ROUTER_STALE, entry.stored_at)
            return Lookup(semconv.ROUTER_STALE, age)
        self._tombstone(conversation_id, semconv.ROUTER_CONSUMED)
        return Lookup(semconv.ROUTER_HIT, age, dict(entry.params), entry.history, entry.reply)

    def put(self, conversation_id: str, params: Mapping[str, Any], decode_host: str,
            history: str | None = None) -> None:
        """Store decode's params, ``remote_host`` rewritten to the decode HTTP host (as vLLM).

        ``history``: the last message-boundary hash of the turn the params belong to.
        """
        stored = dict(params)
        stored["remote_host"] = decode_host
        now = self._clock()
        # Entries past the TTL go as new ones come (oldest first, so a put costs O(1) amortised):
        # otherwise the conversations that ended would hold their decode params (a few KB
        # each) until GET /health or the entry cap, 100k.
        self._drop_stale(now)
        self._entries.pop(conversation_id, None)
        self._entries[conversation_id] = _Entry(stored, now, history)
        self._tombstones.pop(conversation_id, None)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
            self.evicted_capacity += 1

    def set_reply(self, conversation_id: str, history: str, reply: str) -> None:
        """Record the boundary hash of the reply decode produced for the entry of ``history``
        (known when the reply has ended, after ``put``; another turn's entry is left alone)."""
        entry = self._entries.get(conversation_id)
        if entry is not None and entry.history == history:
            entry.reply = reply

    def evict_stale(self) -> int:
        """Drop entries older than the TTL; return how many (vLLM runs this on GET /health)."""
        return self._drop_stale(self._clock())

    def _drop_stale(self, now: float) -> int:
        entries = self._entries
        dropped = 0
        while entries:
            conversation_id, entry = next(iter(entries.items()))
            if now - entry.stored_at <= self.ttl_s:
                break
            del entries[conversation_id]
            self._tombstone(conversation_id, semconv.ROUTER_STALE, entry.stored_at)
            dropped += 1
        return dropped

    def _tombstone(self, conversation_id: str, why: str, stored_at: float | None = None) -> None:
        self._tombstones.pop(conversation_id, None)
        self._tombstones[conversation_id] = (why, stored_at)
        while len(self._tombstones) > self._max_entries:
            self._tombstones.popitem(last=False)


def prefill_params(lookup: Lookup) -> dict[str, Any]:
    """The kv_transfer_params to send to prefill for this lookup (vLLM's rewriting)."""
    if lookup.params:
        params = dict(lookup.params)
        params["do_remote_decode"] = True
        params["do_remote_prefill"] = False
        return params
    return dict(MISS_PARAMS)


def blocks_in(params: Mapping[str, Any]) -> int | None:
    """Number of blocks in group 0 of ``remote_block_ids`` (what vLLM's proxy logs), if any."""
    groups = params.get("remote_block_ids")
    if not isinstance(groups, list) or not groups:
        return None
    first = groups[0]
    if isinstance(first, list):
        return len(first)
    return len(groups)


# Why the reuse guard sent MISS params (kvscope proxy --reuse-guard).
GUARD_PASSED = "continues"
GUARD_EDITED = "history_edited"
GUARD_UNCHECKED = "no_history"  # the entry or the request had no boundary hashes to compare


def history_continues(previous_last: str, hashes: Sequence[str], roles: str,
                      reply: str | None = None) -> bool:
    """Whether a request's messages are the previous turn's, then the assistant's reply, then more.

    ``previous_last`` is the previous turn's last boundary hash; ``hashes`` and ``roles`` are
    this request's boundary hashes (chained: hash i names messages 0..i) and role initials, all
    of them. ``reply``, when known, is ``previous_last`` chained with the reply decode produced:
    then the request must carry that very reply (an edited reply is an edited history, since
    decode holds the KV of its own). The ledger applies the same rule to the hashes its spans
    keep (:func:`kvscope.analysis.ledger._continues`).
    """
    if reply is not None:
        return reply in hashes
    try:
        index = list(hashes).index(previous_last)
    except ValueError:
        return False
    return index + 1 < len(hashes) and roles[index + 1 : index + 2] == "a"


def guard(lookup: Lookup, hashes: Sequence[str] | None, roles: str | None) -> str:
    """The reuse guard's verdict for a lookup: :data:`GUARD_PASSED`, EDITED or UNCHECKED.

    vLLM's proxy finds decode's params by conversation id alone, so an edited history, a retry
    from an earlier point, or another client sending the same id would load KV that does not
    belong to the prompt. The guard lets an entry through only when the request continues the
    turn the entry came from.
    """
    if lookup.history is None or not hashes or roles is None:
        return GUARD_UNCHECKED
    continues = history_continues(lookup.history, hashes, roles, lookup.reply)
    return GUARD_PASSED if continues else GUARD_EDITED


__all__ = ["ConversationRouter", "GUARD_EDITED", "GUARD_PASSED", "GUARD_UNCHECKED", "Lookup",
    "MISS_PARAMS", "blocks_in", "guard", "history_continues", "prefill_params"]
