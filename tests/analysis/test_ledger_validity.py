"""The ledger's reuse validity from counts: the same rule as ``kvscope.reuse.validity``, where the
spans carry what it needs, and "not verified" where they do not (the block size)."""

from __future__ import annotations

import polars as pl

from kvscope.analysis import ledger
from kvscope.reuse import validity

BLOCK = 16


def _judge(**turn: object) -> dict[str, object]:
    row = {"_read_ok": True, "_reuse_void": False, "_stale": False, "decision_local_hit": 0,
           "to_pull_tokens": 0, "reusable_tokens": 0, "history": ledger.HISTORY_CONTINUES,
           "block_size": None, "offered_tokens": None, "decision": "pull", "tokens_match": None}
    row.update(turn)
    frame = pl.DataFrame([row], schema_overrides={
        "block_size": pl.Int64, "offered_tokens": pl.Int64, "reusable_tokens": pl.Int64,
        "tokens_match": pl.Int64})
    out = ledger._validity(frame.lazy()).collect()
    return out.row(0, named=True)


def test_a_read_past_the_shared_prefix_counts_from_prefills_own_hit() -> None:
    """Positions up to prefill's own hit are its own KV: only the pulled tokens past both the
    shared prefix and that hit are invalid, as validity.invalid_tokens counts them."""
    # Prefill holds 128 tokens itself, the prompt shares 100 with decode, 32 more are pulled.
    got = _judge(decision_local_hit=128, to_pull_tokens=32, reusable_tokens=100)
    expected = validity.invalid_tokens(128, 32, 160, 100, BLOCK)
    assert (got["invalid_tokens"], got["_invalid_kind"]) == expected == (
        32, validity.INVALID_BEYOND_PREFIX)
    assert got["reuse_validity"] == ledger.VALIDITY_INVALID
    # Within the shared prefix: valid, 0 tokens.
    within = _judge(decision_local_hit=32, to_pull_tokens=64, reusable_tokens=100)
    assert (within["invalid_tokens"], within["reuse_validity"]) == (0, ledger.VALIDITY_VALID)
    assert validity.invalid_tokens(32, 64, 96, 100, BLOCK) == (0, None)


def test_without_hashes_a_longer_decode_sequence_is_not_called_invalid() -> None:
    """Decode's sequence one token longer than the prompt, in the prompt's last block, is an
    aligned read (validity says so); without the block size on the spans the ledger cannot tell
    it from a misaligned one, so it says "not verified", never raises the alarm."""
    assert validity.invalid_tokens(0, 99, 101, 100, BLOCK) == (0, None)
    got = _judge(history=ledger.HISTORY_UNKNOWN, to_pull_tokens=99, reusable_tokens=100,
                 offered_tokens=101, prompt_tokens=100)
    assert got["_invalid_kind"] is None
    assert got["reuse_validity"] == ledger.VALIDITY_NOT_VERIFIED


def test_the_engines_token_hashes_decide_over_the_message_hashes() -> None:
    """The hooks hash the prompt's tokens a read covers (prefill) and the tokens decode holds KV
    for (decode). Different: invalid, though the messages continue (a reply re-sent as text
    that tokenizes otherwise: tests/vllm_real/test_history.py); equal: valid, though the
    messages look edited or a completions prompt gives no history at all."""
    retokenized = _judge(decision_local_hit=96, to_pull_tokens=85, reusable_tokens=181,
                         offered_tokens=181, tokens_match=0)
    assert retokenized["_invalid_kind"] == validity.INVALID_TOKENS
    assert retokenized["reuse_validity"] == ledger.VALIDITY_INVALID
    assert retokenized["invalid_tokens"] is None  # where the tokens differ is not measured
    for history in (ledger.HISTORY_EDITED, ledger.HISTORY_UNKNOWN):
        same = _judge(history=history, to_pull_tokens=64, reusable_tokens=None,
                      offered_tokens=64, tokens_match=1)
        assert same["_invalid_kind"] is None
        assert (same["reuse_validity"], same["invalid_tokens"]) == (ledger.VALIDITY_VALID, 0)
    # A misaligned read stays misaligned whatever the hashes (decode's last blocks).
    shifted = _judge(to_pull_tokens=64, offered_tokens=200, block_size=BLOCK, tokens_match=1)
    assert shifted["_invalid_kind"] == validity.INVALID_MISALIGNED
