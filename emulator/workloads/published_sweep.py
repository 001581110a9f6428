"""The workload of the published bidirectional-KV sweep: fixed-size chats behind a shared prefix.

The setup of :mod:`kvscope.published` (vLLM's multi-turn benchmark as the blog ran it):
``conversations`` chats of ``turns`` turns, each turn adding ``new_tokens`` of input and
``output_tokens`` of answer, every chat starting with the same ``prefix_tokens``-token prefix
(the swept "prompt length"). Turn 1's prompt is the prefix and the first message; turn k's is
turn k−1's prompt, its answer and a new message, so it re-sends ``prefix + (k−1)·(new + output)``
tokens the chat already computed. Over 10 turns the mean prompt is the prefix + 2,175 tokens
(150 new, 300 out).

Time: the benchmark's clients send a chat's next turn as soon as the answer ends (no think time).
``clients`` chats run at once: chat i starts in slot ``i // clients``, slots ``slot_s`` apart
(long enough for a chat to end; the simulator does not model queueing, so overlapping chats
would change nothing but the timeline).
"""

from __future__ import annotations

from kvscope import published
from kvscope.emulator.workloads.model import (
    DEFAULT_BLOCK_SIZE,
    FOLLOW_UP_OVERHEAD_TOKENS,
    GENERATION_PROMPT_TOKENS,
    Conversation,
    Turn,
    Workload,
    WorkloadError,
    mix_seed,
)

NAME = "published_sweep"
DEFAULT_SLOT_S = 600.0


# The defaults are the published setup (kvscope.published keeps the numbers; both published
# sweeps ran the same chats).
def generate(
    prefix_tokens: int,
    *,
    conversations: int = published.QWEN3_32B.conversations,
    turns: int = published.QWEN3_32B.turns,
    new_tokens: int = published.QWEN3_32B.new_tokens,
    output_tokens: int = published.QWEN3_32B.output_tokens,
    clients: int = published.QWEN3_32B.clients,
    slot_s: float = DEFAULT_SLOT_S,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Workload:
    """The sweep's workload at one shared-prefix length (see the module docstring)."""
    checks = {
        "prefix_tokens": prefix_tokens >= 1,
        "conversations": conversations >= 0,
        "turns": turns >= 1,
        "new_tokens": new_tokens > FOLLOW_UP_OVERHEAD_TOKENS,
        "output_tokens": output_tokens >= 1,
        "clients": clients >= 1,
        "slot_s": slot_s > 0,
        "block_size": block_size >= 1,
    }
    for name, ok in checks.items():
        if not ok:
            raise WorkloadError(f"published sweep workload: invalid {name}")
    system_seed = mix_seed(NAME, "prefix")
    # Turn 1: the prefix (the system message), then the first message and the generation prompt.
    task = new_tokens - GENERATION_PROMPT_TOKENS
    out = []
    for number in range(conversations):
        conv_id = f"sweep-{prefix_tokens}-{number:03d}"
        prompt = prefix_tokens + new_tokens
        chat = [Turn(1, 0.0, prompt, output_tokens, 0, prompt)]
        for index in range(2, turns + 1):
            shared = prompt + output_tokens
            prompt = shared + new_tokens
            chat.append(Turn(index, 0.0, prompt, output_tokens, shared, new_tokens))
        out.append(Conversation(
            id=conv_id,
            start_s=(number // clients) * slot_s,
            turns=tuple(chat),
            seed=mix_seed(NAME, "content", conv_id),
            system_seed=system_seed,
            system_prompt_tokens=prefix_tokens,
            task_tokens=task,
        ))
    return Workload(
        name=f"{NAME}-{prefix_tokens}",
        block_size=block_size,
        conversations=tuple(out),
        source=published.SOURCE,
        settings={
            "format": NAME,
            "shared_prefix_tokens": prefix_tokens,
            "conversations": conversations,
            "turns": turns,
            "new_tokens": new_tokens,
            "output_tokens": output_tokens,
            "clients": clients,
        },
    )


__all__ = ["DEFAULT_SLOT_S", "NAME", "generate"]
