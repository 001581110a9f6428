"""A client that leaves mid-stream, on real servers: its turn's prefill pulled decode's KV, then
the client closed its stream while decode generated. vLLM aborts decode's request (no
``kv_transfer_params``, nothing retained), so the conversation's next turn is offered nothing.

Against vLLM 0.32 the proxy calls decode non-streaming (its streams carry no params) and replays
the answer as a stream: the client leaves before its first byte, while decode is generating."""

from __future__ import annotations

import re
import time
from typing import Any

from tests.vllm_real.deployment import MAX_MODEL_LEN
from tests.vllm_real.turns import ServerLog, judged_turn, token_ids


def test_a_client_that_leaves_mid_stream(deployment: Any, turns: Any) -> None:
    scenario = "client_left"
    conversation = "left-1"
    prompt = token_ids(40, seed=90)
    first = judged_turn(deployment, turns, scenario=scenario, conversation_id=conversation,
                        turn_index=1, prompt=prompt, max_tokens=72, previous=None,
                        not_offered="router_no_entry")
    assert first is not None
    # Turn 2 pulls turn 1's KV, then its client leaves half a second into a decode as long as
    # the model's length allows (~4 s on an idle machine).
    second_prompt = prompt + first.token_ids + token_ids(20, seed=91)
    judged_turn(deployment, turns, scenario=scenario, conversation_id=conversation,
                turn_index=2, prompt=second_prompt,
                max_tokens=MAX_MODEL_LEN - len(second_prompt) - 16, previous=first,
                not_offered="router_no_entry", leave_mid_stream_=True)
    left = turns.of(scenario)[1]
    assert left.x_request_id, "the proxy's log never named the turn the client left"
    # vLLM's evidence that decode's request was aborted (and so returned no params): its
    # connector's request_finished line (DEBUG, nixl/pull_scheduler.py).
    # The abort reaches decode's engine a step later: on a loaded machine, seconds after the
    # client left (10 s once, the plain server's answer long back): wait for it.
    decode_log = ServerLog(deployment.decode.log)
    aborted = rf"request_finished\(\S*{re.escape(left.x_request_id)}\S*\), " \
              r"request_status=FINISHED_ABORTED"
    deadline = time.monotonic() + 120
    while not decode_log.count(aborted) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert decode_log.count(aborted), "decode never logged turn 2's request as aborted"
    # Turn 3 continues turn 2's prompt (its output never reached the client): the router's
    # entry went to turn 2, decode returned nothing for it, prefill is offered nothing.
    judged_turn(deployment, turns, scenario=scenario, conversation_id=conversation,
                turn_index=3, prompt=second_prompt + token_ids(20, seed=92), max_tokens=8,
                previous=None, not_offered="no_decode_metadata")
    turns.scenarios_done.add(scenario)
    mine = turns.of(scenario)
    assert [t.vllm_outcome for t in mine] == ["first_turn", "reused_remote",
                                              "no_decode_metadata"], mine
    assert mine[1].vllm_pulled_tokens > 0 and mine[1].oracle_match is None
    assert mine[0].oracle_match and mine[2].oracle_match
    third = turns.of(scenario)[2]
    assert ServerLog(deployment.proxy.log).count(
        rf"\[{re.escape(third.x_request_id or '?')}\] conv={conversation}: cache MISS")
