"""The conversation id of a proxied request: where the router key comes from.

The router itself (single-use, TTL-bounded entries of decode's params) is a reuse rule and lives
in :mod:`kvscope.reuse.router`; this module reads the key from an HTTP request as vLLM's proxy
does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscope import semconv

# The header a client may name its conversation by: the vLLM multi-turn benchmark sends it with
# --send-conversation-id (vLLM's proxy ignores it; kvscope's falls back to it, kvscope replay
# sends it).
SESSION_HEADER = "X-Session-ID"
# Conversation ids longer than this are not used as keys (a client bug, or an attack on memory).
MAX_CONVERSATION_ID_CHARS = 256


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class ConversationId:
    """The conversation id of one request, where it came from, and why it was refused if so."""

    value: str | None
    source: str | None  # None: not known (a proxy log names no source)
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


__all__ = ["ConversationId", "MAX_CONVERSATION_ID_CHARS", "SESSION_HEADER", "conversation_id_from"]
