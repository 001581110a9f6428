"""Eight conversations at once on the real servers: every turn pulls its own conversation's KV,
token-exact, and every span lands in the one run."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.vllm_real.turns import judged_turn, token_ids

CONVERSATIONS = 8


def test_eight_concurrent_conversations(deployment: Any, turns: Any) -> None:
    scenario = "concurrent"

    def conversation(n: int) -> None:
        conv = f"concurrent-{n}"
        prompt = token_ids(40 + n, seed=100 + n)
        answer = judged_turn(deployment, turns, scenario=scenario, conversation_id=conv,
                             turn_index=1, prompt=prompt, max_tokens=72, previous=None,
                             not_offered="router_no_entry")
        judged_turn(deployment, turns, scenario=scenario, conversation_id=conv, turn_index=2,
                    prompt=prompt + answer.token_ids + token_ids(12, seed=200 + n),
                    max_tokens=8, previous=answer, not_offered="router_no_entry")

    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        for done in [pool.submit(conversation, n) for n in range(CONVERSATIONS)]:
            done.result()
    turns.scenarios_done.add(scenario)
    mine = turns.of(scenario)
    assert len(mine) == 2 * CONVERSATIONS
    assert [t.vllm_outcome for t in mine if t.turn_index == 2] == ["reused_remote"] * 8
    assert all(t.oracle_match for t in mine), [(t.conversation_id, t.turn_index,
                                                t.max_logprob_delta) for t in mine]
