"""Append-only conversations on real P/D servers: prefill pulls decode's KV (D→P) each turn, and
a turn below ``kv_recompute_threshold`` computes instead; every turn token-exact."""

from __future__ import annotations

from typing import Any

from tests.vllm_real.deployment import BLOCK_SIZE, THRESHOLD_TOKENS
from tests.vllm_real.turns import Answer, judged_turn, token_ids


def _next_prompt(prompt: list[int], answer: Answer, new: int, seed: int) -> list[int]:
    """The next turn's prompt: this turn's prompt, its output ids, then a new user message."""
    return prompt + answer.token_ids + token_ids(new, seed)


def test_append_only_turns_pull_decodes_kv_and_stay_token_exact(deployment: Any,
                                                                turns: Any) -> None:
    scenario = "append_only"
    prompt = token_ids(40, seed=1)
    previous = None
    for turn in (1, 2, 3):
        answer = judged_turn(deployment, turns, scenario=scenario, conversation_id="append-1",
                             turn_index=turn, prompt=prompt, max_tokens=72, previous=previous,
                             not_offered="router_no_entry")
        previous, prompt = answer, _next_prompt(prompt, answer, 20, seed=10 + turn)
    turns.scenarios_done.add(scenario)
    mine = turns.of(scenario)
    assert [t.vllm_outcome for t in mine] == ["first_turn", "reused_remote", "reused_remote"]
    # Prefill holds the previous prompt's full blocks; decode offers prompt + output - 1
    # tokens: the pull is the rest, and at least the threshold.
    assert all(t.vllm_pulled_tokens >= THRESHOLD_TOKENS for t in mine[1:])
    assert all(t.oracle_match for t in mine), [(t.turn_index, t.max_logprob_delta)
                                               for t in mine]


def test_a_turn_below_the_threshold_computes_and_stays_token_exact(deployment: Any,
                                                                    turns: Any) -> None:
    scenario = "below_threshold"
    prompt = token_ids(40, seed=2)
    # Decode holds 40 + 16 - 1 = 55 tokens; prefill has 32 (one full block) cached: 23 to pull.
    first = judged_turn(deployment, turns, scenario=scenario, conversation_id="below-1",
                        turn_index=1, prompt=prompt, max_tokens=16, previous=None,
                        not_offered="router_no_entry")
    assert 40 + 16 - 1 - BLOCK_SIZE < THRESHOLD_TOKENS
    judged_turn(deployment, turns, scenario=scenario, conversation_id="below-1",
                turn_index=2, prompt=_next_prompt(prompt, first, 10, seed=20), max_tokens=8,
                previous=first, not_offered="router_no_entry")
    turns.scenarios_done.add(scenario)
    mine = turns.of(scenario)
    assert [t.vllm_outcome for t in mine] == ["first_turn", "below_threshold"]
    assert all(t.oracle_match for t in mine)
