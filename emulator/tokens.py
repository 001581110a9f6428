"""Deterministic tokenizer, chat template and chained block hashing for the emulator.

The emulator never needs a real vocabulary, only stable token ids and vLLM-shaped prefix
structure, so (contract shared with the servers, the simulator and the workloads):

* one token per whitespace-separated word; its id is a stable 31-bit hash of the word
  (blake2b, never Python's per-process randomized ``hash``);
* the chat template renders each message as ``<|ROLE|> content <|end|>`` (two extra tokens per
  message) and appends ``<|assistant|>`` as the generation prompt (one token), so turn k-1's
  prompt + output, followed by ``<|end|>``, is a prefix of turn k's prompt when the client
  re-sends the history unchanged;
* :func:`block_hashes` chains full blocks as vLLM's ``hash_block_tokens`` does: each block's hash
  depends on its parent's hash and its own token ids; a trailing partial block has no hash.

:class:`BlockSeq` is the block-level description the reuse model works on (hashes of full
blocks, token count, the partial tail's token ids); it extends in O(new tokens), never
re-hashing the shared prefix, so long agentic prompts stay cheap. Both it and :class:`BlockRuns`
(the simulator's form: no per-block tuple at all) expose ``runs``, the sequence's block ids as
maximal runs of consecutive ids, which is what the reuse model's prefix cache works on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from kvscope.reuse.content import content_text

DEFAULT_BLOCK_SIZE = 16
END_MARKER = "<|end|>"
GENERATION_PROMPT = "<|assistant|>"
# Parent of the first block, like vLLM's NONE_HASH seed (fixed here: determinism beats salting).
ROOT_HASH = 0
_MASK31 = 0x7FFFFFFF
_MASK63 = 0x7FFFFFFFFFFFFFFF

# A small fixed vocabulary for emulated completions; only ids and counts ever leave the process.
_OUTPUT_WORDS = tuple(
    "the tool returned a result and we now call next step file read write patch test passed"
    " failed check output plan update search code function value error fix run done".split()
)


def token_id(word: str) -> int:
    """Stable 31-bit id of one word."""
    digest = hashlib.blake2b(word.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "little") & _MASK31


def encode(text: str) -> list[int]:
    """Token ids of ``text``: one per whitespace-separated word."""
    return [token_id(word) for word in text.split()]


def role_marker(role: str) -> str:
    """The marker word that opens a message of ``role`` (e.g. ``<|user|>``)."""
    return f"<|{role}|>"


def render_chat(
    messages: Iterable[Mapping[str, object]], add_generation_prompt: bool = True
) -> str:
    """Render chat messages as text with the emulator's template (content ``None`` → empty)."""
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        parts.append(role_marker(str(message.get("role", "user"))))
        if content:
            parts.append(content_text(content))
        parts.append(END_MARKER)
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return " ".join(parts)


def apply_chat_template(
    messages: Iterable[Mapping[str, object]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of chat messages under the emulator's template."""
    return encode(render_chat(messages, add_generation_prompt))


def generate_output_words(seed: int, n: int) -> list[str]:
    """``n`` deterministic words for an emulated completion, chosen by ``seed``."""
    words = []
    state = seed & _MASK63
    for _ in range(n):
        # splitmix64 step: cheap, stable across Python versions, no global random state.
        state = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
        words.append(_OUTPUT_WORDS[z % len(_OUTPUT_WORDS)])
    return words


def hash_block(parent: int, block: Sequence[int]) -> int:
    """Chained hash of one full block: depends on the parent hash and the block's token ids.

    Python's tuple-of-int hash is deterministic across processes (PYTHONHASHSEED only salts
    str/bytes) and ~20x cheaper than blake2b, which matters at 100k-token prompts.
    """
    return hash((parent, tuple(block))) & _MASK63


def block_hashes(
    token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, parent: int = ROOT_HASH
) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block is skipped)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return tuple(hashes)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token-id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


Runs = tuple[tuple[int, int], ...]


def block_runs(ids: Iterable[int]) -> Runs:
    """``ids`` as maximal runs ``(first_id, count)`` of consecutive ids, in order.

    With chained ids (an id fixes its whole prefix), whether an id *starts* a maximal run depends
    on the id alone (its predecessor is always the same), so every sequence that holds an id
    places it in a run with the same first id: runs can be keyed by their first id.
    """
    out: list[tuple[int, int]] = []
    first = count = 0
    for block in ids:
        if count and first + count == block:
            count += 1
            continue
        if count:
            out.append((first, count))
        first, count = block, 1
    if count:
        out.append((first, count))
    return tuple(out)


def join_runs(head: Runs, tail: Iterable[tuple[int, int]]) -> Runs:
    """``head`` followed by ``tail``, merging runs that continue one another (stays maximal)."""
    out = list(head)
    for first, count in tail:
        if count <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + count)
        else:
            out.append((first, count))
    return tuple(out)


def take_runs(runs: Runs, blocks: int) -> Runs:
    """The leading ``blocks`` blocks of ``runs``."""
    out: list[tuple[int, int]] = []
    left = blocks
    for first, count in runs:
        if left <= 0:
            break
        out.append((first, min(count, left)))
        left -= count
    return tuple(out)


@dataclass(frozen=True)
class BlockSeq:
    """A token sequence as the reuse model sees it: full-block chained hashes plus a count.

    ``tail`` holds the token ids of the trailing partial block (fewer than ``block_size``), so
    :meth:`extend` can complete it later without the caller keeping every token.
    """

    block_hashes: tuple[int, ...]
    num_tokens: int
    tail: tuple[int, ...] = ()
    block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def from_tokens(
        cls, token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE
    ) -> BlockSeq:
        """Describe ``token_ids`` by blocks."""
        return cls((), 0, (), block_size).extend(token_ids)

    @property
    def num_blocks(self) -> int:
        """Full (hashable) blocks."""
        return len(self.block_hashes)

    @cached_property
    def runs(self) -> Runs:
        """The block hashes as maximal runs of consecutive values (see :func:`block_runs`)."""
        return block_runs(self.block_hashes)

    def extend(self, token_ids: Sequence[int]) -> BlockSeq:
        """This sequence followed by ``token_ids``; hashes only the blocks they complete."""
        if not token_ids:
            return self
        pending = list(self.tail)
        pending.extend(token_ids)
        bs = self.block_size
        parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
        full = len(pending) - len(pending) % bs
        new_hashes = block_hashes(pending[:full], bs, parent)
        return BlockSeq(
            self.block_hashes + new_hashes,
            self.num_tokens + len(token_ids),
            tuple(pending[full:]),
            bs,
        )

    def common_prefix_blocks(self, other: BlockSeq) -> int:
        """Leading full blocks the two sequences share (chained hashes make this a prefix test)."""
        a, b = self.block_hashes, other.block_hashes
        # Chained hashes make "equal at i" monotone (equal at i => equal below i): bisect it.
        lo, hi = 0, min(len(a), len(b))
        while lo < hi:
            mid = (lo + hi) // 2
            if a[mid] == b[mid]:
                lo = mid + 1
            else:
                hi = mid
        return lo


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class BlockRuns:
    """A sequence given by runs of consecutive block ids, never expanded block by block.

    The simulator's workloads number blocks so that a conversation's blocks are mostly one run;
    this form makes a 100k-token prompt a handful of pairs. ``runs`` must be maximal (as
    :func:`block_runs` and :func:`join_runs` build them) and hold ``num_blocks`` blocks.
    """

    runs: Runs
    num_blocks: int
    num_tokens: int
    block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def from_ids(
        cls, ids: Iterable[int], num_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> BlockRuns:
        """Describe explicit block ids (tests, small inputs)."""
        runs = block_runs(ids)
        return cls(runs, sum(count for _, count in runs), num_tokens, block_size)

    @property
    def block_hashes(self) -> tuple[int, ...]:
        """Every block id, expanded (O(blocks): for tests and small sequences)."""
        return tuple(i for first, count in self.runs for i in range(first, first + count))


Blocks = BlockSeq | BlockRuns


__all__ = ["BlockRuns", "BlockSeq", "Blocks", "DEFAULT_BLOCK_SIZE", "END_MARKER",
    "GENERATION_PROMPT", "ROOT_HASH", "Runs", "apply_chat_template", "block_hashes", "block_runs",
    "common_prefix_len", "encode", "generate_output_words", "hash_block", "join_runs",
    "render_chat", "role_marker", "take_runs", "token_id"]
