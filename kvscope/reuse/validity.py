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

"Potentially invalid KV blocks for unrecognized request" (``pull_worker.py``
``_get_new_notifs``, counted as ``num_notifications_after_expiry``) is logged for *any*
notification whose request id decode no longer tracks, in three cases:

* the reaper released the blocks before P posted its READ (:data:`UNRECOGNIZED_READ`);
* the reaper released them while the READ was in flight (also :data:`UNRECOGNIZED_READ`: the
  notification comes when the READ ends);
* a notify-only message (local hit covers the offer, below threshold, a notify-only pull) after
  the reaper released them (:data:`UNRECOGNIZED_NOTIFY`): nothing was read, nothing is invalid.

The rule for a read after release: freed blocks go back to decode's free pool holding their
data; they turn into another request's KV only when decode allocates them again before the READ
ends. The READ is invalid exactly when that could have happened; the spans cannot show block
reuse, so the ledger labels every read that ended after release ``after_release`` (a
correctness alarm that may be false when decode allocated nothing in between), and a notify-only
message after release is never invalid.

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
# The cases of decode's "Potentially invalid KV blocks" line (a notification for a request id it
# no longer tracks): a READ that came or ended after release, or a notify-only message.
UNRECOGNIZED_READ = "read_after_release"
UNRECOGNIZED_NOTIFY = "notify_after_release"
# What the ledger can say from message-boundary hashes alone: the history was edited, so the
# tokens loaded past the edit do not match (how many is not measurable without a tokenizer).
INVALID_EDITED = "edited"
# What the engines' token hashes show (kvscope.kv.tokens_hash): the prompt's tokens the read
# covers are not those decode holds KV for (an edit, or a reply re-sent as text that tokenizes
# otherwise than decode generated it); where they differ is not measured.
INVALID_TOKENS = "tokens_differ"
# KV computed from an earlier invalid load, read again through prefill's prefix cache or
# decode's retained KV (:mod:`kvscope.reuse.taint`).
INVALID_TAINTED = "tainted"


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


__all__ = ["INVALID_AFTER_RELEASE", "INVALID_BEYOND_PREFIX", "INVALID_EDITED", "INVALID_MISALIGNED",
    "INVALID_TAINTED", "INVALID_TOKENS", "LoadedSpan", "UNRECOGNIZED_NOTIFY", "UNRECOGNIZED_READ",
    "invalid_tokens", "loaded_span"]
