"""The ledger against vLLM's evidence and the oracle, turn by turn, for each scenario the tier
ran (this module runs last: it stops the proxies and ``kvscope serve`` to read the store)."""

from __future__ import annotations

import time
from typing import Any

import polars as pl
import pytest

from tests.vllm_real.conftest import TurnEvidence, Turns

SCENARIOS = (
    "append_only", "below_threshold", "no_conversation_id", "shorter_prompt",
    "edited_history_unguarded", "edited_history_guarded",
    "other_client_unguarded", "other_client_guarded", "concurrent", "decode_ttl",
    "decode_killed",
)
# The ledger's labels for a turn whose loaded KV matched its prompt (or that loaded none).
_INVALID = "reused_invalid"


@pytest.fixture(scope="module")
def ledger(deployment: Any) -> pl.DataFrame:
    """The ledger of everything the tier ran: proxies stopped (their spans flushed), then
    ``kvscope serve`` stopped (everything acknowledged written), then built from the file."""
    from kvscope.analysis.ledger import ledger as build
    from kvscope.store.database import open_readonly

    # Engines and vLLM's tracer export every 0.5 s; give them a few rounds.
    time.sleep(3)
    for proxy in (deployment.proxy, deployment.guarded_proxy):
        proxy.stop(timeout_s=60)
    time.sleep(2)
    deployment.serve.stop()
    con = open_readonly(deployment.serve.db)
    try:
        return build(con)
    finally:
        con.close()


def _judge(turn: TurnEvidence, row: dict[str, Any] | None) -> None:
    if row is None:
        turn.ledger_agrees = False
        turn.notes += " (no ledger row)"
        return
    turn.ledger_outcome = row["outcome"]
    turn.ledger_pulled_tokens = row["remote_reused_tokens"]
    pulled = row["remote_reused_tokens"] or 0
    turn.ledger_agrees = (row["outcome"] == turn.vllm_outcome
                          and pulled == turn.vllm_pulled_tokens)
    # A turn the ledger calls reused_invalid must differ from the plain server's output;
    # every other turn must be token-exact (an errored turn has no output to compare).
    if turn.oracle_match is not None:
        turn.oracle_agrees = (not turn.oracle_match) == (row["outcome"] == _INVALID)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ledger_matches_vllms_evidence_and_the_oracle(scenario: str, ledger: pl.DataFrame,
                                                      turns: Turns) -> None:
    if scenario not in turns.scenarios_done:
        pytest.fail(f"scenario {scenario} did not finish its turns (see its test)")
    rows = {r["x_request_id"]: r for r in ledger.to_dicts() if r["x_request_id"]}
    mine = turns.of(scenario)
    for turn in mine:
        _judge(turn, rows.get(turn.x_request_id or ""))
    table = [(t.turn_index, t.vllm_outcome, t.vllm_pulled_tokens, t.ledger_outcome,
              t.ledger_pulled_tokens, t.oracle_match) for t in mine]
    assert all(t.ledger_agrees for t in mine), table
    assert all(t.oracle_agrees for t in mine), table
