"""kvscope.reuse.taint: which later turns read KV an invalid load computed.

The rule itself is checked against real vLLM by the real tier (tests/vllm_real/test_history.py:
the turn after an unguarded edit, and the same prompt sent again without an id, differ from a
plain server's output); here, its cases one by one."""

from __future__ import annotations

from dataclasses import replace

from kvscope.reuse import taint
from kvscope.reuse.taint import TaintTurn, propagate

_BASE = TaintTurn(key=0, x_request_id="x0", previous=None, arrival_ns=0, prefilled_ns=10,
                  prefill_engine="P", prompt_hash="h0", decode_request_id="d0",
                  retention_id=None, local_hit=0, pulled=0, continues=False,
                  own_invalid=False, clean_tokens=0)


def _turn(key: int, **changes: object) -> TaintTurn:
    fields: dict[str, object] = {
        "key": key, "x_request_id": f"x{key}", "arrival_ns": 100 * key,
        "prefilled_ns": 100 * key + 10, "prompt_hash": f"h{key}", "decode_request_id": f"d{key}"}
    return replace(_BASE, **(fields | changes))  # type: ignore[arg-type]


def _edited(key: int = 1, clean: int = 64) -> TaintTurn:
    # An invalid load: the prompt's own KV up to ``clean`` tokens, foreign after.
    return _turn(key, previous="x0", retention_id="d0", local_hit=32, pulled=200,
                 own_invalid=True, clean_tokens=clean)


def test_the_next_turn_reads_decodes_kv_of_an_invalid_load() -> None:
    nxt = _turn(2, previous="x1", retention_id="d1", local_hit=0, pulled=300, continues=True)
    found = propagate([_turn(0), _edited(), nxt])
    assert found == {2: taint.Taint(300, 236, "x1", taint.VIA_DECODE, 64, True)}


def test_the_next_turn_reads_prefills_cached_blocks_of_an_invalid_load() -> None:
    # No read (decode's TTL passed), but prefill's cache still holds the invalid prompt's blocks.
    nxt = _turn(2, previous="x1", local_hit=224, continues=True)
    found = propagate([_turn(0), _edited(), nxt])
    assert found[2].via == taint.VIA_PREFIX_CACHE and found[2].tokens == 224 - 64


def test_a_read_or_hit_within_the_clean_prefix_is_not_tainted() -> None:
    within = _turn(2, previous="x1", retention_id="d1", local_hit=32, pulled=32, continues=True)
    assert propagate([_edited(clean=64), within]) == {}


def test_the_same_prompt_again_with_no_conversation_hits_the_dirty_blocks() -> None:
    again = _turn(2, previous=None, local_hit=128, prompt_hash="h1")
    found = propagate([_edited(), again])
    assert found[2].source == "x1" and found[2].via == taint.VIA_PREFIX_CACHE


def test_another_prefill_or_a_hit_before_the_blocks_were_computed_is_not_tainted() -> None:
    elsewhere = _turn(2, local_hit=128, prompt_hash="h1", prefill_engine="P2")
    early = replace(_turn(2, local_hit=128, prompt_hash="h1"), arrival_ns=105)
    assert propagate([_edited(), elsewhere]) == {}
    assert propagate([_edited(), early]) == {}


def test_an_edited_history_that_does_not_continue_is_not_linked_by_its_previous_turn() -> None:
    other = _turn(2, previous="x1", local_hit=128, continues=False)
    assert propagate([_edited(), other]) == {}


def test_taint_travels_down_a_chain_and_keeps_the_first_dirty_start() -> None:
    second = _turn(2, previous="x1", retention_id="d1", pulled=300, continues=True)
    third = _turn(3, previous="x2", retention_id="d2", local_hit=0, pulled=400, continues=True)
    found = propagate([_edited(), second, third])
    assert found[3].source == "x2" and found[3].dirty_start == 64 and found[3].tokens == 336


def test_an_inexact_start_taints_but_counts_no_tokens() -> None:
    source = replace(_edited(), clean_exact=False)
    nxt = _turn(2, previous="x1", retention_id="d1", pulled=300, continues=True)
    found = propagate([source, nxt])
    assert found[2].tokens is None and found[2].read == 300 and not found[2].exact


def test_a_turn_with_its_own_invalid_load_is_a_source_not_a_taint() -> None:
    nxt = replace(_edited(2), previous="x1", retention_id="d1", continues=True)
    assert propagate([_edited(), nxt]) == {}


def test_decode_known_later_is_registered_by_decoded() -> None:
    """The emulator's truth learns decode's request id at decode's finish, after prefill."""
    tracker = taint.TaintTracker()
    source = replace(_edited(), decode_request_id=None)
    tracker.record(source, tracker.read(source))
    nxt = _turn(2, previous="x1", retention_id="d1", pulled=300, continues=True)
    assert tracker.read(nxt) is None
    tracker.decoded("x1", "d1")
    assert tracker.read(nxt) is not None
