"""Message boundaries: keyed, chained hashes of a conversation's messages, never their text.

Hash i covers messages 0..i, so two prompts share exactly as many leading hashes as they share
leading messages: whoever holds two turns' hashes can tell whether the later one continues the
earlier (the reuse guard, the ledger's history check, the emulator's truth) without seeing a
prompt. The proxy computes them per turn; the simulator chains them for its synthetic messages;
the ledger compares them. The key (:mod:`kvscope.boundary_key`) makes a store alone unable to
confirm a guessed prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvscope.boundary_key import HASH_HEX, BoundaryKey
from kvscope.reuse.content import content_text

# Hex characters kept of each message-boundary hash: 64 bits, plenty to detect edited history.
BOUNDARY_HASH_HEX = HASH_HEX
# Boundary hashes stored per turn: the last ones only. A chained hash names its whole prefix, so
# turn k extends turn k-1 iff k-1's last hash is among k's; storing every hash would grow each
# span with the conversation's length.
BOUNDARY_HASHES_KEPT = 16


def boundary_hashes(body: Mapping[str, Any], key: BoundaryKey, keep: int | None = None
                    ) -> tuple[int, str]:
    """The number of messages and the chained blake2b hashes, keyed with ``key``, of the last
    ``keep`` of them (all by default), comma separated; never the text.

    Hash i covers messages 0..i, so two prompts share exactly as many leading hashes as they share
    leading messages: the ledger can detect edited or truncated history without seeing it. A
    completions ``prompt`` counts as one user message. Every message is hashed (the chain needs
    them all); only the kept ones are written out. Keyed (:mod:`kvscope.boundary_key`), so that
    a store alone cannot confirm a guessed prompt.
    """
    count, hashes, _ = message_boundaries(body, key, keep)
    return count, hashes


def message_boundaries(body: Mapping[str, Any], key: BoundaryKey, keep: int | None = None
                       ) -> tuple[int, str, str]:
    """The number of messages, the hashes (:func:`boundary_hashes`) and the role initials of
    the last ``keep`` of them (all by default), in one pass over the messages.

    A role initial is ``s``ystem, ``u``ser, ``a``ssistant, ``t``ool, ... (``?`` when a message
    has none, or one that is not printable). With the hashes it tells whether the message right
    after the previous turn's messages is the assistant's reply (a continuation) or something
    else (a reset's summary).
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        prompt = body.get("prompt")
        if prompt is None:
            return 0, "", ""
        messages = [{"role": "user", "content": prompt}]
    digests: list[bytes] = []
    initials: list[str] = []
    chain = b""
    for message in messages:
        if type(message) is dict or isinstance(message, Mapping):
            role = str(message.get("role", ""))
            content = message.get("content", "")
            initial = role[:1]
            # A lone surrogate (or a control character) cannot be stored: "?" as for no role.
            initials.append(initial if initial.isprintable() and initial else "?")
        else:
            role, content = "", message
            initials.append("?")
        chain = chain_boundary(chain, role, _text(content), key)
        digests.append(chain)
    if keep is not None:
        start = max(len(digests) - keep, 0)
        digests, initials = digests[start:], initials[start:]
    return len(messages), ",".join(d.hex() for d in digests), "".join(initials)


def _text(content: Any) -> str:
    """What a message's content is hashed as: the text the chat template renders for it."""
    return content_text(content)


def sse_event(payload: bytes | str) -> dict[str, Any] | None:
    """One SSE ``data:`` payload as the JSON object an OpenAI-compatible server sends; None when
    it is not one."""
    try:
        event = json.loads(payload)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def reply_text(source: str | tuple[bytes, ...] | None, kept: bool = True) -> str | None:
    """The assistant message a client sends back for decode's reply: its text, or None when
    the reply is not one plain-text message (tool calls, several choices, unreadable events).

    ``source`` is the text itself, or a chat stream's SSE payloads (the ``data:`` lines).
    A stop string that ended the reply (``stop_reason``) is part of it when decode ``kept``
    the reply's KV (returned params: the engine finished the request in the step the string
    appeared): decode computed it, the client's text lacks it, so the next turn does not
    continue what decode holds. Otherwise the frontend aborted the request and nothing is held.
    """
    if source is None or isinstance(source, str):
        return source
    parts: list[str] = []
    for payload in source:
        event = sse_event(payload)
        if event is None:
            return None
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                return None
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            if delta.get("tool_calls"):
                return None
            content = delta.get("content")
            if isinstance(content, str):
                parts.append(content)
            stop = choice.get("stop_reason")
            if kept and isinstance(stop, str):  # decode holds what the text leaves out
                parts.append(stop)
    return "".join(parts)


def chain_boundary(chain: bytes, role: str, text: str, key: BoundaryKey) -> bytes:
    """The boundary hash after one more message, given the hash of the messages before it."""
    h = key.hasher()
    h.update(chain)
    h.update(role.encode("utf-8", "surrogatepass"))  # JSON can carry lone surrogates
    h.update(b"\x00")
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.digest()


__all__ = ["BOUNDARY_HASHES_KEPT", "BOUNDARY_HASH_HEX", "boundary_hashes", "chain_boundary",
           "message_boundaries", "reply_text", "sse_event"]
