"""Turns whose prompt does not continue what decode holds, on real servers, without and with
``--reuse-guard``: vLLM pulls by token counts and keys by conversation id alone, so KV that does
not belong to the prompt is loaded (the output then differs from the plain server's) unless the
guard sends vLLM's MISS params.

Chat requests (the proxy hashes message boundaries: that is what the ledger and the guard see),
and token-id completions (a prompt shorter than decode's sequence)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.vllm_real.tiny_model import _WORDS
from tests.vllm_real.turns import judged_turn, token_ids


def _text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


# Each test below runs without, then with, the proxy's --reuse-guard.
GUARDED = pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])


def _variant(deployment: Any, guarded: bool, scenario: str, conversation: str,
             seed: int) -> tuple[str, Any, str, int]:
    """One variant's scenario name, proxy, conversation id and text seed. Texts of their own
    per variant (the guarded one's seed is 100 more): an invalid pull leaves foreign KV in
    prefill's prefix cache (test_an_invalid_pull_poisons_prefills_prefix_cache), which the same
    text would hit."""
    return (f"{scenario}_{'guarded' if guarded else 'unguarded'}",
            deployment.guarded_proxy if guarded else deployment.proxy,
            f"{conversation}-{int(guarded)}", seed + 100 * guarded)


@GUARDED
def test_an_edited_history_loads_foreign_kv_unless_guarded(deployment: Any, turns: Any,
                                                           guarded: bool) -> None:
    scenario, proxy, conversation, seed = _variant(deployment, guarded, "edited_history",
                                                   "edited", 30)
    first = [_user(_text(60, seed=seed))]
    answer = judged_turn(deployment, turns, scenario=scenario, conversation_id=conversation,
                         turn_index=1, messages=first, max_tokens=72, previous=None,
                         not_offered="router_no_entry", proxy=proxy)
    # The client rewrites its first message (an edit), keeps the reply, adds a question.
    edited = [_user(_text(60, seed=seed + 1)), {"role": "assistant", "content": "done"},
              _user(_text(40, seed=seed + 2))]
    # A reply long enough that turn 3's read of it clears the threshold (64) beyond prefill's
    # own hit of turn 2's prompt.
    reply = judged_turn(deployment, turns, scenario=scenario, conversation_id=conversation,
                        turn_index=2, messages=edited, max_tokens=72, previous=answer,
                        not_offered="prefix_diverged", proxy=proxy)
    assert reply is not None and reply.text
    # The client goes on from the edited turn, append-only: its history continues turn 2, so
    # the read is valid by itself, but what it reads (prefill's cached blocks of turn 2's
    # prompt, decode's KV of turn 2) was computed from the foreign KV turn 2 loaded.
    third = [*edited, {"role": "assistant", "content": reply.text},
             _user(_text(20, seed=seed + 3))]
    judged_turn(deployment, turns, scenario=scenario, conversation_id=conversation,
                turn_index=3, messages=third, max_tokens=8, previous=reply,
                not_offered="router_no_entry", proxy=proxy)
    turns.scenarios_done.add(scenario)
    second, after = turns.of(scenario)[1:]
    if guarded:
        assert (second.vllm_outcome, second.vllm_pulled_tokens) == ("prefix_diverged", 0)
        assert second.oracle_match
        # The guard passes it (the messages continue), and the read is of turn 2's clean KV;
        # but the reply re-sent as text may tokenize otherwise than decode generated it (BPE):
        # then the tokens the read covers are not the prompt's, and the output differs.
        assert after.vllm_pulled_tokens > 0
        assert after.oracle_match == (after.vllm_outcome == "reused_remote")
    else:
        assert second.vllm_outcome == "reused_invalid" and second.vllm_pulled_tokens > 0
        assert not second.oracle_match
        assert after.vllm_pulled_tokens > 0 and after.vllm_outcome == "reused_invalid"
        assert not after.oracle_match


@GUARDED
def test_another_client_under_the_same_conversation_id(deployment: Any, turns: Any,
                                                       guarded: bool) -> None:
    scenario, proxy, conversation, seed = _variant(deployment, guarded, "other_client",
                                                   "shared", 40)
    answer = judged_turn(deployment, turns, scenario=scenario, conversation_id=conversation,
                         turn_index=1, messages=[_user(_text(60, seed=seed))], max_tokens=72,
                         previous=None, not_offered="router_no_entry", proxy=proxy)
    # A single-message chat replaced by another one: another client, the same id.
    judged_turn(deployment, turns, scenario=scenario, conversation_id=conversation,
                turn_index=2, messages=[_user(_text(120, seed=seed + 1))], max_tokens=8,
                previous=answer, not_offered="prefix_diverged", proxy=proxy)
    turns.scenarios_done.add(scenario)
    second = turns.of(scenario)[1]
    if guarded:
        assert second.vllm_pulled_tokens == 0 and second.oracle_match
    else:
        assert second.vllm_outcome == "reused_invalid" and not second.oracle_match


def test_an_invalid_pull_poisons_prefills_prefix_cache(deployment: Any, turns: Any) -> None:
    """After the unguarded edited turn loaded foreign KV, prefill caches those blocks under
    that prompt's block hashes: the same prompt again, with no conversation id (nothing is
    offered), hits prefill's prefix cache and computes from the foreign KV. vLLM's evidence
    (its prefix-cache hit counter, the tokens) and the oracle say so; the ledger must link the
    two turns by the prompt's hashes (kvscope.reuse.taint)."""
    scenario = "poisoned_prefix_cache"
    if "edited_history_unguarded" not in turns.scenarios_done:
        pytest.skip("needs test_an_edited_history_loads_foreign_kv_unless_guarded[unguarded]")
    invalid = turns.of("edited_history_unguarded")[1]
    assert invalid.vllm_outcome == "reused_invalid"
    edited = [_user(_text(60, seed=31)), {"role": "assistant", "content": "done"},
              _user(_text(40, seed=32))]
    judged_turn(deployment, turns, scenario=scenario, conversation_id=None, turn_index=1,
                messages=edited, max_tokens=8, previous=None, not_offered="no_conversation_id")
    turns.scenarios_done.add(scenario)
    again = turns.of(scenario)[0]
    assert again.vllm_pulled_tokens == 0 and (again.local_hit_tokens or 0) > 0
    assert again.vllm_outcome == "reused_invalid"
    assert not again.oracle_match  # the foreign KV, from prefill's own cache


def test_a_prompt_shorter_than_decodes_sequence(deployment: Any, turns: Any) -> None:
    """The client retries from inside the previous answer: its prompt is a prefix of decode's
    sequence, shorter than it. vLLM loads min(decode's tokens, prompt) tokens; the oracle says
    whether those are the prompt's own."""
    scenario = "shorter_prompt"
    prompt = token_ids(100, seed=50)
    answer = judged_turn(deployment, turns, scenario=scenario, conversation_id="shorter-1",
                         turn_index=1, prompt=prompt, max_tokens=72, previous=None,
                         not_offered="router_no_entry")
    # Prefill holds 96 tokens (3 blocks) of the prompt; 100 + 64 of decode's 171 reach past it.
    retry = prompt + answer.token_ids[:64]
    judged_turn(deployment, turns, scenario=scenario, conversation_id="shorter-1",
                turn_index=2, prompt=retry, max_tokens=8, previous=answer,
                not_offered="router_no_entry")
    turns.scenarios_done.add(scenario)
    second = turns.of(scenario)[1]
    assert second.vllm_pulled_tokens >= 64


def test_no_conversation_id_means_no_reuse(deployment: Any, turns: Any) -> None:
    scenario = "no_conversation_id"
    prompt = token_ids(40, seed=60)
    answer = judged_turn(deployment, turns, scenario=scenario, conversation_id=None,
                         turn_index=1, prompt=prompt, max_tokens=72, previous=None,
                         not_offered="no_conversation_id")
    judged_turn(deployment, turns, scenario=scenario, conversation_id=None, turn_index=2,
                prompt=prompt + answer.token_ids + token_ids(20, seed=61), max_tokens=8,
                previous=answer, not_offered="no_conversation_id")
    turns.scenarios_done.add(scenario)
    mine = turns.of(scenario)
    assert [t.vllm_pulled_tokens for t in mine] == [0, 0]
    assert all(t.oracle_match for t in mine)
