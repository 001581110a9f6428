"""What a chat message's content is as prompt text: the one reading the proxy's boundary
hashes and the emulator's chat template share.

vLLM renders a list of text-only content parts as their texts joined by newlines
(``parse_chat_message_content_parts``, ``vllm/renderers/chat_utils/chat_message.py``, 0.33.0),
so a client that sends a message back as ``[{"type": "text", "text": ...}]`` sends the same prompt
as one that sends the string. Anything else (images, audio, other shapes) has no text reading
here: it is written as sorted JSON, so that it is stable and never equal to a plain string.
"""

from __future__ import annotations

import json
from typing import Any


def content_text(content: Any) -> str:
    """The text ``content`` is rendered as (a string, text parts, or sorted JSON)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(part, dict) and part.get("type") == "text"
            and isinstance(part.get("text"), str) for part in content):
        return "\n".join(part["text"] for part in content)
    return json.dumps(content, sort_keys=True)


__all__ = ["content_text"]
