"""The ledger's outcome and validity on the cases users hit (issue 28, item 3), from spans shaped
as the proxy and the engine hooks write them, through the per-turn SQL and ``shape``."""

from __future__ import annotations

from typing import Any

import polars as pl

from kvscope import semconv
from kvscope.analysis.ledger import (
    HISTORY_CONTINUES,
    HISTORY_EDITED,
    HISTORY_UNKNOWN,
    VALIDITY_INVALID,
    VALIDITY_NOT_VERIFIED,
    VALIDITY_VALID,
    build,
)
from kvscope.reuse import outcomes
from kvscope.reuse.router import GUARD_EDITED
from kvscope.reuse.validity import INVALID_MISALIGNED, invalid_tokens

NS = pl.Datetime("ns")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _strings(rows: list[dict[str, Any]], times: tuple[str, ...] = (),
             durations: tuple[str, ...] = ()) -> pl.DataFrame:
    names = sorted({k for row in rows for k in row})
    frame = pl.DataFrame([{k: row.get(k) for k in names} for row in rows],
                         schema={k: pl.String for k in names})
    return frame.with_columns(*(pl.col(t).cast(pl.Int64).cast(NS) for t in times),
                              *(pl.col(d).cast(pl.UInt64) for d in durations))


def _turn(i: int, **attrs: Any) -> dict[str, Any]:
    row = {"run_id": "r", "trace_id": f"t{i}", "span_id": f"s{i}", "x_request_id": f"x{i}",
           "conversation_id": "c", "turn_index": str(i), "arrival": str(i * 10**9),
           "duration_ns": "1000000", "status_code": "STATUS_CODE_UNSET",
           "router_lookup": semconv.ROUTER_HIT if i > 1 else semconv.ROUTER_MISS,
           "route": CHAT}
    row.update({k: None if v is None else str(v) for k, v in attrs.items()})
    return row


def _ledger(turn1: dict[str, Any], turn2: dict[str, Any], *, returned: bool = True,
            decision: dict[str, Any] | None = None, read_tokens: int = 0) -> dict[str, Any]:
    """Turn 2's ledger row: turn 1's decode leg (``returned``: it gave params back), turn 2's
    reuse decision and, when ``read_tokens``, a finished D->P read."""
    frames: dict[str, pl.DataFrame] = {
        "turns": _strings([turn1, turn2], ("arrival",), ("duration_ns",)),
        "decode": _strings([{"trace_id": "t1", "parent_span_id": "s1", "decode_ns": "1000",
                             "decode_request_id": "d1",
                             "metadata_returned": str(returned).lower()}],
                           durations=("decode_ns",)),
    }
    if decision is not None:
        row = {"request_id": "chatcmpl-x2-abcdef12", "span_id": "e1", "engine": "p0",
               "time": str(2 * 10**9 + 1), "threshold": "64", "bidir": "true"}
        row.update({k: str(v) for k, v in decision.items()})
        frames["decisions"] = _strings([row], ("time",))
    if read_tokens:
        frames["transfers"] = _strings([{
            "request_id": "chatcmpl-x2-abcdef12", "span_id": "e2", "engine": "p0",
            "direction": semconv.DIRECTION_D_TO_P, "status": semconv.TRANSFER_OK,
            "size_bytes": str(read_tokens * 1000), "start": str(2 * 10**9 + 2),
            "duration_ns": "1000"}], ("start",), ("duration_ns",))
    ledger = build(frames)
    return ledger.filter(pl.col("turn_index") == 2).row(0, named=True)


def _pull(local: int, offered: int, prompt: int, **more: Any) -> dict[str, Any]:
    return {"decision": semconv.DECISION_PULL, "local_hit": local, "offered": offered,
            "to_pull": min(offered, prompt) - local, **more}


def test_a_single_message_chat_replaced_by_another_is_an_edit() -> None:
    """A chat's single message has its boundary hash like any other: replaced by a different
    single message under the same conversation id, the KV decode holds is not the prompt's."""
    one = _turn(1, prompt_tokens=300, output_tokens=50, boundary_hashes="aa", messages=1,
                roles="u")
    other = _turn(2, prompt_tokens=320, output_tokens=20, boundary_hashes="bb", messages=1,
                  roles="u")
    row = _ledger(one, other, decision=_pull(0, 350, 320), read_tokens=320)
    assert row["history"] == HISTORY_EDITED
    assert row["outcome"] == outcomes.REUSED_INVALID, row["evidence"]
    assert row["reuse_validity"] == VALIDITY_INVALID
    # A completions prompt (one text that grows) has no message boundaries to compare.
    grown = _ledger(one | {"route": COMPLETIONS}, other | {"route": COMPLETIONS},
                    decision=_pull(0, 350, 320), read_tokens=320)
    assert grown["history"] == HISTORY_UNKNOWN
    assert grown["reuse_validity"] == VALIDITY_NOT_VERIFIED


def _continuing(prompt2: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return (_turn(1, prompt_tokens=90, output_tokens=30, boundary_hashes="h1,h2", messages=2,
                  roles="su"),
            _turn(2, prompt_tokens=prompt2, output_tokens=10, boundary_hashes="h1,h2,h3,h4",
                  messages=4, roles="suau"))


def test_a_decode_sequence_longer_than_the_prompt_is_misaligned_unless_one_block_holds_both(
        ) -> None:
    """Decode offered 120 tokens, the continuing prompt has 100 (re-tokenised reply): the
    worker end-trims decode's 8 blocks of 16 to the 7 prefill needs, so prefill gets decode's
    last 7 blocks. Only when the spans prove both ends fall in one block is the read aligned."""
    one, two = _continuing(100)
    expected = invalid_tokens(0, 100, 120, 100, 16)
    assert expected == (100, INVALID_MISALIGNED)
    for block in (16, None):  # with the block size; without it nothing proves alignment
        extra = {"block_size": block} if block else {}
        row = _ledger(one, two, decision=_pull(0, 120, 100, **extra), read_tokens=100)
        assert row["history"] == HISTORY_CONTINUES
        assert row["outcome"] == outcomes.REUSED_INVALID, row["evidence"]
        assert (row["invalid_tokens"], row["reuse_validity"]) == (100, VALIDITY_INVALID)
        assert "misaligned" in row["evidence"] and row["remote_reused_tokens"] == 0
    # 110 offered, 100 in the prompt: 7 blocks of 16 each, the read is aligned and valid.
    assert invalid_tokens(0, 100, 110, 100, 16) == (0, None)
    aligned = _ledger(one, two, decision=_pull(0, 110, 100, block_size=16), read_tokens=100)
    assert aligned["outcome"] == outcomes.REUSED_REMOTE, aligned["evidence"]
    assert (aligned["invalid_tokens"], aligned["reuse_validity"]) == (0, VALIDITY_VALID)


def test_invalid_tokens_are_counted_whenever_the_evidence_gives_them() -> None:
    one, two = _continuing(200)
    # Prefill was seen loading nothing (local hit covers the offer): 0 invalid, not null.
    covered = _ledger(one, two, decision={"decision": semconv.DECISION_LOCAL_COVERS,
                                          "local_hit": 119, "offered": 119, "to_pull": 0})
    assert covered["invalid_tokens"] == 0
    # No engine evidence at all: not measured.
    unseen = _ledger(one, two)
    assert unseen["invalid_tokens"] is None


def test_a_turn_the_guard_blocked_gets_the_cause_its_fields_show() -> None:
    """--reuse-guard sent MISS params (the history was edited; the turn kept too few hashes for
    the ledger to see it): prefill saw no offer, but the router had an entry."""
    one, _ = _continuing(200)
    two = _turn(2, prompt_tokens=200, output_tokens=10, reuse_guard=GUARD_EDITED)
    row = _ledger(one, two, decision={"decision": semconv.DECISION_NO_OFFER, "local_hit": 0,
                                      "to_pull": 0})
    assert row["outcome"] == outcomes.PREFIX_DIVERGED, row["evidence"]
    assert "reuse guard" in row["evidence"]


def test_the_below_threshold_count_is_vllms() -> None:
    """A 231-token prompt, 224 cached, 574 offered: vLLM compares min(574, 231) - 224 = 7."""
    one, two = _continuing(231)
    row = _ledger(one, two, decision={"decision": semconv.DECISION_BELOW_THRESHOLD,
                                      "local_hit": 224, "offered": 574, "to_pull": 0,
                                      "threshold": 64})
    assert row["outcome"] == outcomes.BELOW_THRESHOLD
    assert row["evidence"] == "7 < 64"


def test_several_causes_are_ranked_and_both_named() -> None:
    """Decode returned no params for turn 1 and turn 2's history was edited: nothing could have
    been pulled either way. The table ranks decode's missing params first; the evidence says
    both."""
    one = _turn(1, prompt_tokens=100, output_tokens=20, boundary_hashes="h1,h2", messages=2,
                roles="su")
    two = _turn(2, prompt_tokens=150, output_tokens=20, boundary_hashes="h1,h9,h3", messages=3,
                roles="sua", router_lookup=semconv.ROUTER_MISS)
    row = _ledger(one, two, returned=False,
                  decision={"decision": semconv.DECISION_NO_OFFER, "local_hit": 0,
                            "to_pull": 0})
    assert row["history"] == HISTORY_EDITED
    assert row["outcome"] == outcomes.NO_DECODE_METADATA, row["evidence"]
    assert row["evidence"].startswith(outcomes.EVIDENCE_NO_DECODE_METADATA)
    assert "also edited" in row["evidence"]


def test_a_client_that_left_after_prefills_read_keeps_the_reuse_it_made() -> None:
    """Prefill pulled decode's KV, then the client left while decode generated (the turn span
    errored, client_disconnected: real tier, test_client_left.py): prefill's read stands, the
    turn reused what it pulled. Any other error (here the upstream's) still voids the turn's
    reuse: nothing says prefill's work reached an answer."""
    one, two = _continuing(160)
    left = two | {"status_code": "STATUS_CODE_ERROR",
                  "error_kind": semconv.ERROR_CLIENT_DISCONNECTED}
    row = _ledger(one, left, decision=_pull(64, 119, 160), read_tokens=55)
    assert row["errored"] is True
    assert (row["outcome"], row["remote_reused_tokens"], row["local_hit_tokens"]) == (
        outcomes.REUSED_REMOTE, 55, 64), row["evidence"]
    failed = _ledger(one, left | {"error_kind": semconv.ERROR_UPSTREAM_STATUS},
                     decision=_pull(64, 119, 160), read_tokens=55)
    assert (failed["remote_reused_tokens"], failed["local_hit_tokens"]) == (0, 0)
    assert failed["outcome"] != outcomes.REUSED_REMOTE
