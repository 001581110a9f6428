"""Was a D→P reuse *valid*: does every token P loaded from decode belong to that position?

vLLM decides the pull by counts only (:func:`kvscope.reuse.params.pull_count`), so three things
load KV that does not match the prompt:

* **edited history** under the same conversation id: decode's tokens past the edit differ from
  the prompt's, and the read still takes them (``beyond_prefix``);
* **a prompt shorter than decode's sequence** (truncation, a retry of an earlier turn): the
  worker's ``_apply_prefix_caching`` (``base_worker.py``) end-trims decode's block list to the
  number of blocks P needs, so P gets decode's *last* blocks for its positions (``misaligned``);
* **a read racing decode's TTL reaper**: the blocks were freed (and may be reused) before the
  READ; P reports success and D logs "Potentially invalid KV blocks" (``after_release``).

One definition serves the emulator's ground truth (which knows the tokens) and the ledger (which
knows message-boundary hashes and counts): :func:`loaded_span` says which of decode's blocks land
where, :func:`invalid_tokens` how many loaded tokens do not belong to their position.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.reuse.params import blocks_for

INVALID_BEYOND_PREFIX = "beyond_prefix"
INVALID_MISALIGNED = "misaligned"
INVALID_AFTER_RELEASE = "after_release"
# What the ledger can say from message-boundary hashes alone: the history was edited, so the
# tokens loaded past the edit do not match (how many is not measurable without a tokenizer).
INVALID_EDITED = "edited"


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class LoadedSpan:
    """Which of decode's blocks one D→P read put in which of prefill's block positions."""

    first_p_block: int
    first_d_block: int
    blocks: int

    @property
    def shift_blocks(self) -> int:
        """Decode block index minus prefill block position (0 when aligned)."""
        return self.first_d_block - self.first_p_block


def loaded_span(
    local_tokens: int, pulled_tokens: int, remote_tokens: int, block_size: int
) -> LoadedSpan:
    """The blocks a read of ``pulled_tokens`` after ``local_tokens`` moves, and from where.

    P fills its blocks ``local // bs`` .. ``ceil((local + pulled) / bs)``; decode's list holds
    ``ceil(remote_tokens / bs)`` blocks and is end-trimmed to that many, so the read takes
    decode's last blocks.
    """
    first_p = local_tokens // block_size
    blocks = max(blocks_for(local_tokens + pulled_tokens, block_size) - first_p, 0)
    d_blocks = blocks_for(remote_tokens, block_size)
    return LoadedSpan(first_p, max(d_blocks - blocks, 0), blocks)


def invalid_tokens(
    local_tokens: int,
    pulled_tokens: int,
    remote_tokens: int,
    common_prefix_tokens: int,
    block_size: int,
    *,
    after_release: bool = False,
) -> tuple[int, str | None]:
    """``(tokens, kind)``: how many pulled tokens do not match the prompt at their position.

    ``common_prefix_tokens`` is the common prefix of the prompt with decode's sequence. A
    misaligned or released read invalidates everything it loaded; an aligned one, the tokens
    past the common prefix.
    """
    if pulled_tokens <= 0:
        return 0, None
    if after_release:
        return pulled_tokens, INVALID_AFTER_RELEASE
    span = loaded_span(local_tokens, pulled_tokens, remote_tokens, block_size)
    if span.shift_blocks != 0:
        return pulled_tokens, INVALID_MISALIGNED
    valid_end = max(common_prefix_tokens, local_tokens)
    beyond = min(local_tokens + pulled_tokens - valid_end, pulled_tokens)
    if beyond > 0:
        return beyond, INVALID_BEYOND_PREFIX
    return 0, None
