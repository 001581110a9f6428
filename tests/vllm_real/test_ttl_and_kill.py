"""Reads that cannot succeed, on real servers: a turn after decode's ``decoder_kv_blocks_ttl``,
and a turn after the decode server was killed. Prefill runs ``kv_load_failure_policy`` fail
(vLLM's default): what vLLM does then — decline, error, or compute — is read from its log and
its answer, not assumed. Runs after the other scenarios (it kills decode), before the ledger."""

from __future__ import annotations

import time
from typing import Any

from tests.vllm_real import deployment as d
from tests.vllm_real.conftest import DECODE_TTL_S
from tests.vllm_real.turns import judged_turn, token_ids


def test_a_turn_after_decodes_ttl_then_a_turn_after_decode_died(deployment: Any,
                                                                 turns: Any) -> None:
    # A proxy whose router keeps decode's params longer than decode keeps the blocks (the
    # misconfiguration kvscope proxy warns about): it still offers them after decode's TTL.
    late = d.proxy("late proxy", deployment.logs / "late-proxy.log",
                   prefill=deployment.prefill, decode=deployment.decode,
                   serve=deployment.serve, ttl_s=DECODE_TTL_S,
                   extra=["--router-ttl", str(3 * DECODE_TTL_S)]).start()
    try:
        late.wait_ready("/health", timeout_s=120)
        prompt = token_ids(40, seed=70)
        expired_first = judged_turn(deployment, turns, scenario="decode_ttl", proxy=late,
                                    conversation_id="ttl-1", turn_index=1, prompt=prompt,
                                    max_tokens=72, previous=None,
                                    not_offered="router_no_entry")
        assert expired_first is not None
        time.sleep(DECODE_TTL_S + 1)
        judged_turn(deployment, turns, scenario="decode_ttl", proxy=late,
                    conversation_id="ttl-1", turn_index=2,
                    prompt=prompt + expired_first.token_ids + token_ids(20, seed=71),
                    max_tokens=8, previous=expired_first, not_offered="router_ttl_expired",
                    may_fail=True)
        turns.scenarios_done.add("decode_ttl")

        # Decode dies right after a turn (well within its TTL and the router's).
        killed_prompt = token_ids(40, seed=80)
        killed_first = judged_turn(deployment, turns, scenario="decode_killed",
                                   conversation_id="killed-1", turn_index=1,
                                   prompt=killed_prompt, max_tokens=72, previous=None,
                                   not_offered="router_no_entry")
        assert killed_first is not None
        deployment.decode.kill()
        judged_turn(deployment, turns, scenario="decode_killed", conversation_id="killed-1",
                    turn_index=2,
                    prompt=killed_prompt + killed_first.token_ids + token_ids(20, seed=81),
                    max_tokens=8, previous=killed_first, not_offered="router_no_entry",
                    may_fail=True)
        turns.scenarios_done.add("decode_killed")
    finally:
        late.stop(timeout_s=60)
    ttl_turn = turns.of("decode_ttl")[1]
    killed_turn = turns.of("decode_killed")[1]
    # vLLM loaded nothing in either turn.
    assert ttl_turn.vllm_pulled_tokens == 0 and killed_turn.vllm_pulled_tokens == 0
    assert ttl_turn.vllm_outcome in ("decode_ttl_expired", "load_failed_errored"), ttl_turn
    assert killed_turn.vllm_outcome in ("handshake_failed", "transfer_failed",
                                        "load_failed_errored"), killed_turn
