"""Workload data types: conversations of turns, their block-level view and their chat rendering.

A :class:`Workload` describes multi-turn agentic sessions by numbers only (token counts, waits,
resets, sub-agents); it never holds prompt or completion text. Two views derive from it:

- the **block view** (:func:`block_view`) for the virtual-time simulator: each turn's prompt as
  chained full-block ids, where equal ids at the same position mean an equal prefix. Prompts are
  :class:`BlockChain` nodes that share their prefix with an earlier chain instead of copying it,
  so a 100k-token prompt costs O(1) memory on top of the previous turn's.
- the **chat view** (:class:`ChatHistory`) for HTTP replay: the OpenAI ``messages`` list of a
  turn, given the assistant replies actually received so far. Content is filler words generated
  from seeds, rebuilt on demand and never stored.

Both follow the token contract of ``kvscope.emulator.tokens``: one token per whitespace-separated
word; a message renders as ``<|ROLE|> content <|end|>`` (two extra tokens) and the prompt ends with
``<|assistant|>`` (one token). Under that contract, for a turn that follows its predecessor
(no reset), the prompt is the previous prompt, the previous reply, the reply's ``<|end|>``, one new
message and the generation prompt, so ``new_input_tokens = words + 4``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from kvscope.errors import KvscopeError

DEFAULT_BLOCK_SIZE = 16

# Token overheads of the chat template (the contract of kvscope.emulator.tokens).
MESSAGE_OVERHEAD_TOKENS = 2  # <|ROLE|> ... <|end|>
GENERATION_PROMPT_TOKENS = 1  # <|assistant|>
# A follow-up adds: <|end|> closing the previous reply, one wrapped message, the generation prompt.
FOLLOW_UP_OVERHEAD_TOKENS = 1 + MESSAGE_OVERHEAD_TOKENS + GENERATION_PROMPT_TOKENS

Render = Literal["chat", "blocks"]


class WorkloadError(KvscopeError, ValueError):
    """A workload cannot be built: a bad trace file, row or option (the message names it)."""


# The longest span a trace's times may cover: a run's timestamps are its epoch plus these
# seconds, so a time beyond it (1e18 ms) would overflow the store's timestamps. A century is far
# beyond any trace and far within them.
MAX_TRACE_S = 100 * 365 * 86400.0


def trace_seconds(value: object, where: str, what: str, *, per_second: float = 1.0) -> float:
    """A trace's time field as seconds: finite, >= 0 and within :data:`MAX_TRACE_S`.

    ``value`` is in units ``per_second`` to the second (Mooncake's milliseconds: 1000);
    :class:`WorkloadError` naming ``where`` and ``what`` otherwise.
    """
    try:
        raw = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise WorkloadError(f"{where}: {what} {value!r} is not a number") from None
    if raw != raw or raw in (float("inf"), float("-inf")):
        raise WorkloadError(f"{where}: {what} {value!r} is not a finite number")
    seconds = raw / per_second
    if not 0.0 <= seconds <= MAX_TRACE_S:
        unit = "ms" if per_second == 1000.0 else "s"
        raise WorkloadError(f"{where}: {what} {raw:g} {unit} is out of range (0 to "
                            f"{MAX_TRACE_S * per_second:g} {unit})")
    return seconds


# Largest trace file a workload reads (read whole: the shipped weka CSV is 3.5 MB).
MAX_TRACE_BYTES = 256 << 20


# --- block chains -------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False, slots=True)
class BlockChain:
    """The chained block ids of one token sequence: ``kept`` blocks of ``base``, then new runs.

    ``runs`` holds ``(first_id, count)`` pairs of consecutive ids. Identity equality only: compare
    chains with :meth:`ids` or :func:`common_prefix_blocks` (structural equality would recurse
    through every earlier turn).
    """

    base: BlockChain | None
    kept: int
    runs: tuple[tuple[int, int], ...]
    # Number of full blocks in the sequence (derived; read several times a simulated turn).
    num_blocks: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        blocks = self.kept
        for _, count in self.runs:  # mostly one run: a loop beats sum() over a generator
            blocks += count
        object.__setattr__(self, "num_blocks", blocks)

    def block_id(self, position: int) -> int:
        """Return the id of the block at ``position`` (0-based)."""
        node: BlockChain | None = self
        while node is not None:
            if position < node.kept:
                node = node.base
                continue
            offset = position - node.kept
            for first, count in node.runs:
                if offset < count:
                    return first + offset
                offset -= count
            break
        raise IndexError(f"block {position} outside a chain of {self.num_blocks} blocks")

    def ids(self) -> list[int]:
        """Expand the chain into its list of block ids (O(blocks); for tests and small prompts)."""
        segments: list[tuple[tuple[tuple[int, int], ...], int]] = []
        node: BlockChain | None = self
        limit = self.num_blocks
        while node is not None and limit > 0:
            own = limit - node.kept
            if own > 0:
                segments.append((node.runs, own))
            limit = min(limit, node.kept)
            node = node.base
        out: list[int] = []
        for runs, own in reversed(segments):
            for first, count in runs:
                take = min(count, own)
                out.extend(range(first, first + take))
                own -= take
                if own <= 0:
                    break
        return out

    @staticmethod
    def from_ids(ids: Sequence[int], base: BlockChain | None = None) -> BlockChain:
        """Build a chain from explicit ids, sharing the common prefix with ``base`` if given."""
        kept = 0
        if base is not None:
            limit = min(len(ids), base.num_blocks)
            kept = _common_prefix_len(lambda i: ids[i], base.block_id, limit)
        return BlockChain(base if kept else None, kept, _runs(ids[kept:]))


    def runs_from(self, start: int) -> tuple[tuple[int, int], ...]:
        """The runs of the ids from position ``start`` on (O(runs) past the kept prefix)."""
        if start < self.kept:
            return _runs(self.ids()[start:])
        offset = start - self.kept
        out: list[tuple[int, int]] = []
        for first, count in self.runs:
            if offset >= count:
                offset -= count
                continue
            out.append((first + offset, count - offset))
            offset = 0
        return tuple(out)


def _runs(ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    runs: list[tuple[int, int]] = []
    for block in ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return tuple(runs)


def _common_prefix_len(left: Callable[[int], int], right: Callable[[int], int], limit: int) -> int:
    # Chained ids: equal at position i implies equal before it, so the match is monotone and a
    # binary search finds the boundary in O(log n) lookups.
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if left(mid - 1) == right(mid - 1):
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_prefix_blocks(a: BlockChain, b: BlockChain) -> int:
    """Return how many leading blocks two chains share."""
    return _common_prefix_len(a.block_id, b.block_id, min(a.num_blocks, b.num_blocks))


# --- workload -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One request of a conversation, described by numbers only.

    ``shared_prefix_tokens`` is the block-level truth: how many leading tokens of this prompt equal
    the previous turn's prompt + output (0 for turn 1). ``new_input_tokens`` is what the prompt adds
    after that prefix. ``reset`` marks a context reset (history dropped or compacted; the prompt
    keeps only the system prompt and task, plus a summary). ``blocks`` carries explicit block ids
    when a trace provides them (raw WEKA, Mooncake); otherwise :func:`block_view` derives them.
    ``sent_at_s`` is the send time a trace records (Mooncake), which then places the turn instead
    of ``think_time_s`` (see :func:`send_time`).
    """

    index: int
    think_time_s: float
    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int
    new_input_tokens: int
    reset: bool = False
    blocks: BlockChain | None = field(default=None, compare=False, repr=False)
    # When a trace records the send time (workload seconds, the clock of start_s): the turn is
    # sent then, or when the previous turn ends if that is later. None: think_time_s after it.
    sent_at_s: float | None = None


@dataclass(frozen=True)
class Conversation:
    """One session (or sub-agent) of a workload: when it starts and its turns, in order.

    A sub-agent is a child conversation with ``parent_id`` set, starting at the spawn time; its
    first prompt shares ``system_prompt_tokens`` with the parent when both have the same
    ``system_seed`` (equal seed and size render the identical system message).
    """

    id: str
    start_s: float
    turns: tuple[Turn, ...]
    parent_id: str | None = None
    seed: int = 0
    system_seed: int = 0
    system_prompt_tokens: int = 0
    task_tokens: int = 0
    render: Render = "chat"


@dataclass(frozen=True)
class Workload:
    """A set of conversations plus where they came from and the options that shaped them."""

    name: str
    block_size: int
    conversations: tuple[Conversation, ...]
    source: str
    settings: Mapping[str, str | int | float | bool] = field(default_factory=dict)

    def conversation(self, conversation_id: str) -> Conversation:
        """Return the conversation with this id."""
        for conv in self.conversations:
            if conv.id == conversation_id:
                return conv
        raise KeyError(conversation_id)

    @property
    def num_requests(self) -> int:
        """Total number of turns over all conversations."""
        return sum(len(c.turns) for c in self.conversations)

    def summary(self) -> dict[str, int | float]:
        """Return headline counts: conversations, sub-agents, requests, resets, tokens."""
        turns = [t for c in self.conversations for t in c.turns]
        return {
            "conversations": len(self.conversations),
            "subagents": sum(1 for c in self.conversations if c.parent_id is not None),
            "requests": len(turns),
            "resets": sum(1 for t in turns if t.reset),
            "prompt_tokens": sum(t.prompt_tokens for t in turns),
            "output_tokens": sum(t.output_tokens for t in turns),
            "shared_prefix_tokens": sum(t.shared_prefix_tokens for t in turns),
        }


def check_times(workload: Workload) -> None:
    """:class:`WorkloadError` naming the conversation and turn of the first time that is not a
    finite number within [0, MAX_TRACE_S] (start, think time, send time) or of a negative token
    count: checked before a run is recorded, so a bad workload built in code records nothing."""
    for conv in workload.conversations:
        trace_seconds(conv.start_s, f"{workload.name}: conversation {conv.id}", "start_s")
        for turn in conv.turns:
            where = f"{workload.name}: conversation {conv.id} turn {turn.index}"
            trace_seconds(turn.think_time_s, where, "think_time_s")
            if turn.sent_at_s is not None:
                trace_seconds(turn.sent_at_s, where, "sent_at_s")
            if min(turn.prompt_tokens, turn.output_tokens, turn.shared_prefix_tokens) < 0:
                raise WorkloadError(f"{where}: a negative token count")


# --- block view ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockView:
    """Each turn's prompt, and prompt + output, as chains keyed by ``(conversation id, index)``.

    ``sequences`` are what decode holds after the turn (prompt and generated tokens); the next
    turn's reusable blocks are ``common_prefix_blocks(sequence(k - 1), prompt(k))``.
    """

    block_size: int
    prompts: Mapping[tuple[str, int], BlockChain]
    sequences: Mapping[tuple[str, int], BlockChain]

    def prompt(self, conversation_id: str, index: int) -> BlockChain:
        """Return the chain of one turn's prompt."""
        return self.prompts[(conversation_id, index)]

    def sequence(self, conversation_id: str, index: int) -> BlockChain:
        """Return the chain of one turn's prompt followed by its output."""
        return self.sequences[(conversation_id, index)]


def block_view(workload: Workload) -> BlockView:
    """Derive each turn's prompt block chain; deterministic for a given workload.

    Derived turns take ``shared_prefix_tokens // block_size`` blocks from the previous turn's
    prompt + output and fresh ids after that; turn 1 starts with the system prompt's blocks,
    shared by every conversation with the same ``(system_seed, system_prompt_tokens)``.
    """
    bs = workload.block_size
    next_id = 1
    prompts: dict[tuple[str, int], BlockChain] = {}
    sequences: dict[tuple[str, int], BlockChain] = {}
    systems: dict[tuple[int, int], BlockChain] = {}

    def fresh(count: int) -> tuple[tuple[int, int], ...]:
        nonlocal next_id
        if count <= 0:
            return ()
        first, next_id = next_id, next_id + count
        return ((first, count),)

    for conv in workload.conversations:
        previous_seq: BlockChain | None = None
        for turn in conv.turns:
            full = turn.prompt_tokens // bs
            if turn.blocks is not None:
                chain = turn.blocks
                if previous_seq is not None and turn.shared_prefix_tokens:
                    kept = min(turn.shared_prefix_tokens // bs, previous_seq.num_blocks, full)
                    chain = _continue_explicit(previous_seq, chain, kept)
            elif previous_seq is None:
                key = (conv.system_seed, conv.system_prompt_tokens)
                system = systems.get(key)
                if system is None:
                    system = BlockChain(None, 0, fresh(conv.system_prompt_tokens // bs))
                    systems[key] = system
                kept = min(system.num_blocks, full)
                chain = BlockChain(system, kept, fresh(full - kept))
            else:
                kept = min(turn.shared_prefix_tokens // bs, previous_seq.num_blocks, full)
                chain = BlockChain(previous_seq, kept, fresh(full - kept))
            prompts[(conv.id, turn.index)] = chain
            # The reply extends the sequence: the block holding the prompt's tail and the output's
            # head is new, as is every block after it.
            with_output = max(chain.num_blocks, (turn.prompt_tokens + turn.output_tokens) // bs)
            previous_seq = BlockChain(
                chain, chain.num_blocks, fresh(with_output - chain.num_blocks)
            )
            sequences[(conv.id, turn.index)] = previous_seq
    return BlockView(bs, prompts, sequences)


def _continue_explicit(previous_seq: BlockChain, chain: BlockChain, kept: int) -> BlockChain:
    """An explicit prompt chain whose first ``kept`` blocks are the previous turn's sequence.

    A trace that hashes coarser blocks than ours (Mooncake: 512 tokens) cannot say that a
    follow-up re-sends the previous prompt's partial last block and the reply; its
    ``shared_prefix_tokens`` can, so those blocks are taken from the previous prompt + output
    and the trace's own ids follow. A chain that already shares them (raw WEKA) is kept as is.
    """
    if kept <= common_prefix_blocks(previous_seq, chain):
        return chain
    return BlockChain(previous_seq, kept, chain.runs_from(kept))


def send_time(turn: Turn, previous_end_s: float) -> float:
    """When ``turn`` is sent, its previous turn having ended at ``previous_end_s``.

    At the trace's send time when it records one (never before the previous turn ends: a chat
    client sends after the answer), else ``think_time_s`` after the previous turn ended.
    """
    if turn.sent_at_s is not None:
        return max(previous_end_s, turn.sent_at_s)
    return previous_end_s + max(turn.think_time_s, 0.0)


# --- chat view ----------------------------------------------------------------------------------


def _syllable_words() -> tuple[str, ...]:
    consonants = "bdfgklmnprstvz"
    vowels = "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    return tuple(a + b for a in syllables for b in syllables)


# 4,900 two-syllable nonsense words: one token each under the whitespace tokenizer, never a
# special token, never real text.
VOCABULARY: tuple[str, ...] = _syllable_words()


def mix_seed(*parts: object) -> int:
    """Combine parts into a 63-bit seed that is stable across processes and Python versions."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def filler(seed: int, words: int) -> str:
    """Return ``words`` deterministic filler words for ``seed``."""
    if words <= 0:
        return ""
    return " ".join(random.Random(seed).choices(VOCABULARY, k=words))


@lru_cache(maxsize=65536)
def _block_text(block_id: int, words: int) -> str:
    return filler(mix_seed("block", block_id), words)


def count_tokens(text: str) -> int:
    """Count tokens the way the emulator's tokenizer does: whitespace-separated words."""
    return len(text.split())


class ChatHistory:
    """Builds the OpenAI ``messages`` of each turn of one conversation, in order.

    Call :meth:`messages` for a turn, send it, then :meth:`add_reply` with the text actually
    received. ``chat`` conversations render a system prompt and user task, then per turn one
    message sized so the prompt reaches the turn's ``prompt_tokens`` (at least one word), and on a
    reset a summary replacing the history. ``blocks`` conversations (trace imports with explicit
    block ids) render each prompt as one user message whose words come block by block from the
    block ids, so equal block ids give equal text prefixes; replies are not carried there.
    """

    def __init__(self, conversation: Conversation, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.conversation = conversation
        self.block_size = block_size
        self._messages: list[dict[str, str]] = []
        self._tokens = 0  # template tokens of self._messages, without the generation prompt
        self._open_reply = False  # last message is an assistant reply (its <|end|> is new input)

    @property
    def history_tokens(self) -> int:
        """Tokens of the rendered history so far (without the generation prompt)."""
        return self._tokens

    def _append(self, role: str, content: str, words: int) -> None:
        self._messages.append({"role": role, "content": content})
        self._tokens += words + MESSAGE_OVERHEAD_TOKENS

    def _start(self) -> None:
        conv = self.conversation
        self._messages, self._tokens = [], 0
        system_words = max(1, conv.system_prompt_tokens - MESSAGE_OVERHEAD_TOKENS)
        task_words = max(1, conv.task_tokens - MESSAGE_OVERHEAD_TOKENS)
        self._append("system", filler(mix_seed("system", conv.system_seed), system_words),
                     system_words)
        self._append("user", filler(mix_seed("task", conv.seed), task_words), task_words)

    def messages(self, turn: Turn) -> list[dict[str, str]]:
        """Return the messages to send for ``turn`` (which must follow the previous call's)."""
        if self.conversation.render == "blocks":
            return self._block_messages(turn)
        if turn.index == 1 or turn.reset or not self._messages:
            self._start()
            if turn.index == 1:
                # Turn 1's prompt is the system prompt and the task, padded to its size.
                pad = turn.prompt_tokens - self._tokens - GENERATION_PROMPT_TOKENS
                if pad > MESSAGE_OVERHEAD_TOKENS:
                    words = pad - MESSAGE_OVERHEAD_TOKENS
                    self._append("user", filler(mix_seed("pad", self.conversation.seed), words),
                                 words)
                return list(self._messages)
            kind = "summary"
        else:
            kind = "tool"
        words = max(
            1,
            turn.prompt_tokens
            - self._tokens
            - MESSAGE_OVERHEAD_TOKENS
            - GENERATION_PROMPT_TOKENS,
        )
        content = filler(mix_seed(kind, self.conversation.seed, turn.index), words)
        self._append("user", content, words)
        return list(self._messages)

    def add_reply(self, text: str) -> None:
        """Append the assistant reply actually received for the last turn."""
        if self.conversation.render == "blocks":
            return
        self._append("assistant", text, count_tokens(text))

    def _block_messages(self, turn: Turn) -> list[dict[str, str]]:
        bs = self.block_size
        ids = turn.blocks.ids() if turn.blocks is not None else []
        content_tokens = max(
            1, turn.prompt_tokens - MESSAGE_OVERHEAD_TOKENS - GENERATION_PROMPT_TOKENS
        )
        parts = [_block_text(block, bs) for block in ids]
        tail = content_tokens - len(ids) * bs
        if tail > 0:
            parts.append(filler(mix_seed("tail", self.conversation.seed, turn.index), tail))
        return [{"role": "user", "content": " ".join(parts)}]


def messages(
    conversation: Conversation,
    turn: Turn,
    replies: Sequence[str],
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[dict[str, str]]:
    """Render one turn's messages from scratch, given the replies to every earlier turn."""
    history = ChatHistory(conversation, block_size)
    for earlier, reply in zip(conversation.turns, replies, strict=False):
        if earlier.index >= turn.index:
            break
        history.messages(earlier)
        history.add_reply(reply)
    return history.messages(turn)


def iter_turns(workload: Workload) -> Iterator[tuple[Conversation, Turn]]:
    """Yield every (conversation, turn) pair in workload order."""
    for conv in workload.conversations:
        for turn in conv.turns:
            yield conv, turn


__all__ = ["BlockChain", "BlockView", "ChatHistory", "Conversation", "DEFAULT_BLOCK_SIZE",
    "FOLLOW_UP_OVERHEAD_TOKENS", "GENERATION_PROMPT_TOKENS", "MAX_TRACE_BYTES", "MAX_TRACE_S",
    "MESSAGE_OVERHEAD_TOKENS", "Render", "Turn", "VOCABULARY", "Workload", "WorkloadError",
    "block_view", "check_times", "common_prefix_blocks", "count_tokens", "filler", "iter_turns",
    "messages", "mix_seed", "send_time", "trace_seconds"]
