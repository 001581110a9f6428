"""The per-conversation router cache: decode's ``kv_transfer_params`` kept for the next turn.

Semantics follow vLLM's ``disagg_proxy_multiturn.py`` (``ConversationKVCache``): ``put`` stores a
copy of decode's params with ``remote_host`` already rewritten to the decode instance's HTTP host;
``lookup`` pops the entry (single use) and discards it when older than the TTL. What kvscope adds
is *why* a lookup found nothing: a tombstone per conversation remembers whether its last entry was
consumed by an earlier turn or discarded as stale, so a miss can be told apart from ``consumed``
and ``stale``. Both maps are bounded (least recently written evicted first) so that a client
minting endless conversation ids cannot grow the proxy without limit.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvscope import semconv

# Conversation ids longer than this are not used as keys (a client bug, or an attack on memory).
MAX_CONVERSATION_ID_CHARS = 256

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
class ConversationId:
    """The conversation id of one request, where it came from, and why it was refused if so."""

    value: str | None
    source: str
    rejected: str | None = None


def conversation_id_from(body: dict[str, Any], session_header: str | None) -> ConversationId:
    """Pop ``conversation_id`` from ``body`` (as vLLM's proxy does); fall back to X-Session-ID.

    The body field is always removed so vLLM never sees it. Ids that are too long, not text or
    not printable are refused (recorded, never raised): the turn then runs without reuse.
    """
    raw = body.pop("conversation_id", None)
    source = semconv.ID_SOURCE_BODY
    if raw is None or raw == "":
        raw = session_header or None
        source = semconv.ID_SOURCE_HEADER
    if raw is None:
        return ConversationId(None, semconv.ID_SOURCE_NONE)
    if isinstance(raw, bool) or not isinstance(raw, str | int):
        return ConversationId(None, source, semconv.ID_REJECTED_WRONG_TYPE)
    value = str(raw)
    if len(value) > MAX_CONVERSATION_ID_CHARS:
        return ConversationId(None, source, semconv.ID_REJECTED_TOO_LONG)
    if not value.isprintable():
        return ConversationId(None, source, semconv.ID_REJECTED_NON_PRINTABLE)
    return ConversationId(value, source)


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class Lookup:
    """The result of one router lookup: a ``semconv.ROUTER_*`` value, entry age and params."""

    result: str
    age_s: float | None = None
    params: dict[str, Any] | None = None


@dataclass(slots=True)
class _Entry:
    params: dict[str, Any]
    stored_at: float


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
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # conversation id -> ROUTER_CONSUMED or ROUTER_STALE: what happened to its last entry.
        self._tombstones: OrderedDict[str, str] = OrderedDict()
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
            why = self._tombstones.get(conversation_id)
            return Lookup(why if why is not None else semconv.ROUTER_MISS)
        age = self._clock() - entry.stored_at
        if age > self.ttl_s:
            self._tombstone(conversation_id, semconv.ROUTER_STALE)
            return Lookup(semconv.ROUTER_STALE, age)
        self._tombstone(conversation_id, semconv.ROUTER_CONSUMED)
        return Lookup(semconv.ROUTER_HIT, age, dict(entry.params))

    def put(self, conversation_id: str, params: Mapping[str, Any], decode_host: str) -> None:
        """Store decode's params, ``remote_host`` rewritten to the decode HTTP host (as vLLM)."""
        stored = dict(params)
        stored["remote_host"] = decode_host
        self._entries.pop(conversation_id, None)
        self._entries[conversation_id] = _Entry(stored, self._clock())
        self._tombstones.pop(conversation_id, None)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
            self.evicted_capacity += 1

    def evict_stale(self) -> int:
        """Drop entries older than the TTL; return how many (vLLM runs this on GET /health)."""
        now = self._clock()
        stale = [cid for cid, e in self._entries.items() if now - e.stored_at > self.ttl_s]
        for cid in stale:
            del self._entries[cid]
            self._tombstone(cid, semconv.ROUTER_STALE)
        return len(stale)

    def _tombstone(self, conversation_id: str, why: str) -> None:
        self._tombstones.pop(conversation_id, None)
        self._tombstones[conversation_id] = why
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
